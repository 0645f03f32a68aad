"""Per-attention-type managers: hit search, skipped tokens, block estimates, free order."""

from __future__ import annotations

import pytest

from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError
from kvcm.common.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvcm.core.block import KVCacheBlock
from kvcm.core.block_pool import BlockPool
from kvcm.core.single_type_managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    ManagerOptions,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
)

BLOCK_SIZE = 4
OPTIONS = ManagerOptions(
    enable_caching=True,
    scheduler_block_size=BLOCK_SIZE,
    max_model_len=1024,
    max_in_flight_tokens=1024,
    records_new_block_ids=False,
)
COMMON = {"num_kv_heads": 1, "head_size": 8, "dtype": DType.FLOAT16}


def make_pool(num_blocks: int = 20, hash_block_size: int = BLOCK_SIZE) -> BlockPool:
    return BlockPool(
        num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=hash_block_size
    )


class _Hashes:
    """A request-shaped object whose block hashes are given directly."""

    def __init__(self, request_id: str, hashes: list[bytes]) -> None:
        self.request_id = request_id
        self.block_hashes = hashes
        self.all_token_ids = list(range(len(hashes) * BLOCK_SIZE))
        self.num_prompt_tokens = len(self.all_token_ids)
        self.lora_name = None
        self.lora_id = None
        self.cache_salt = None
        self.mm_features: list[object] = []
        self.prompt_embeds = None
        self.session_id = None


def hashes(n: int, tag: str = "h") -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(32, b".") for i in range(n)]


def cache(
    manager: SingleTypeKVCacheManager, request_id: str, block_hashes: list[bytes]
) -> list[KVCacheBlock]:
    """Allocate and cache blocks for ``block_hashes`` under ``request_id``."""
    num_tokens = len(block_hashes) * BLOCK_SIZE
    manager.allocate_new_blocks(request_id, num_tokens)
    manager.cache_blocks(_Hashes(request_id, block_hashes), num_tokens)  # type: ignore[arg-type]
    return manager.req_to_blocks[request_id]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_factory_picks_manager_per_spec() -> None:
    pool = make_pool()
    cases = [
        (FullAttentionSpec(block_size=4, **COMMON), FullAttentionManager),
        (MLAAttentionSpec(block_size=4, **COMMON), FullAttentionManager),
        (SlidingWindowSpec(block_size=4, sliding_window=8, **COMMON), SlidingWindowManager),
        (
            ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **COMMON),
            ChunkedLocalAttentionManager,
        ),
        (CrossAttentionSpec(block_size=4, **COMMON), CrossAttentionManager),
    ]
    for spec, manager_type in cases:
        assert type(get_manager_for_kv_cache_spec(spec, pool, 0, OPTIONS)) is manager_type


def test_full_attention_hit_stops_at_first_miss_and_aligns() -> None:
    pool = make_pool()
    manager = get_manager_for_kv_cache_spec(
        FullAttentionSpec(block_size=4, **COMMON), pool, 0, OPTIONS
    )
    stored = cache(manager, "a", hashes(4))
    probe = [*hashes(2), b"miss".ljust(32, b"."), *hashes(4)[3:]]
    hit = manager.find_longest_cache_hit(probe, 100, [0], 4)
    assert (ids(hit.blocks[0]), hit.num_tokens) == (ids(stored[:2]), 8)
    hit = manager.find_longest_cache_hit(hashes(4), 100, [0], 8)
    assert hit.num_tokens == 16
    hit = manager.find_longest_cache_hit(hashes(4), 11, [0], 8)
    assert (len(hit.blocks[0]), hit.num_tokens) == (2, 8)


def test_sliding_window_hit_needs_a_window_of_contiguous_blocks() -> None:
    pool = make_pool()
    spec = SlidingWindowSpec(block_size=4, sliding_window=8, **COMMON)
    manager = get_manager_for_kv_cache_spec(spec, pool, 0, OPTIONS)
    assert isinstance(manager, SlidingWindowManager)
    assert manager.contiguous_blocks_for_hit == 2
    stored = cache(manager, "a", hashes(6))
    null = pool.null_block.block_id
    hit = manager.find_longest_cache_hit(hashes(6), 24, [0], 4)
    assert ids(hit.blocks[0]) == [null, null, null, null, *ids(stored[4:6])]
    assert hit.num_tokens == 24
    # Evict block 4 (index 4): the best window now ends at block 3.
    pool.evict_blocks({stored[4].block_id})
    manager.free("a")
    hit = manager.find_longest_cache_hit(hashes(6), 24, [0], 4)
    assert ids(hit.blocks[0]) == [null, null, *ids(stored[2:4])]
    assert hit.num_tokens == 16


def test_sliding_window_skipped_tokens_and_null_replacement() -> None:
    pool = make_pool()
    manager = get_manager_for_kv_cache_spec(
        SlidingWindowSpec(block_size=4, sliding_window=4, **COMMON), pool, 0, OPTIONS
    )
    assert manager.get_num_skipped_tokens(7) == 4
    assert manager.get_num_skipped_tokens(3) == 0
    manager.allocate_new_blocks("a", 16)
    held = list(manager.req_to_blocks["a"])
    free_before = pool.get_num_free_blocks()
    manager.remove_skipped_blocks("a", 13)  # 10 skipped tokens: 2 blocks
    null = pool.null_block
    assert manager.req_to_blocks["a"][:2] == [null, null]
    assert manager.req_to_blocks["a"][2:] == held[2:]
    assert pool.get_num_free_blocks() == free_before + 2
    manager.remove_skipped_blocks("a", 13)  # idempotent
    assert pool.get_num_free_blocks() == free_before + 2
    manager.free("a")
    assert pool.get_num_free_blocks() == free_before + 4


def test_chunked_local_skipped_tokens_and_hits() -> None:
    pool = make_pool()
    spec = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **COMMON)
    manager = get_manager_for_kv_cache_spec(spec, pool, 0, OPTIONS)
    assert [manager.get_num_skipped_tokens(n) for n in (7, 8, 13)] == [0, 8, 8]
    stored = cache(manager, "a", hashes(4))
    null = pool.null_block.block_id
    # Next token 15: tokens 8..14 are in its chunk; block 2 (8..11) must hit.
    hit = manager.find_longest_cache_hit(hashes(4), 15, [0], 4)
    assert (ids(hit.blocks[0]), hit.num_tokens) == ([null, null, stored[2].block_id], 12)
    # Next token 16 starts a chunk: everything before counts as computed (nulls).
    hit = manager.find_longest_cache_hit(hashes(4), 16, [0], 4)
    assert (ids(hit.blocks[0]), hit.num_tokens) == ([null] * 4, 16)


def test_blocks_to_allocate_counts_evictable_hit_blocks() -> None:
    pool = make_pool()
    manager = get_manager_for_kv_cache_spec(
        FullAttentionSpec(block_size=4, **COMMON), pool, 0, OPTIONS
    )
    stored = list(cache(manager, "a", hashes(3)))
    assert manager.get_num_blocks_to_allocate("b", 20, stored, 12) == 2 + 0
    manager.free("a")
    # Freed cached blocks sit in the free queue: adopting them consumes free capacity.
    assert manager.get_num_blocks_to_allocate("b", 20, stored, 12) == 2 + 3
    manager.add_local_computed_blocks("b", stored, 12)
    assert all(block.ref_cnt == 1 for block in stored)
    # Running request: only the missing blocks.
    assert manager.get_num_blocks_to_allocate("b", 20, [], 12) == 2


def test_free_releases_tail_first() -> None:
    pool = make_pool(num_blocks=6)
    manager = get_manager_for_kv_cache_spec(
        FullAttentionSpec(block_size=4, **COMMON), pool, 0, OPTIONS
    )
    manager.allocate_new_blocks("a", 12)
    blocks = ids(manager.req_to_blocks["a"])
    manager.free("a")
    free_order = ids(pool.free_block_queue.get_all_free_blocks())
    assert free_order[: len(blocks)] == blocks[::-1] or free_order[-len(blocks) :] == blocks[::-1]
    manager.free("never-allocated")


def test_common_prefix_blocks() -> None:
    pool = make_pool()
    manager = get_manager_for_kv_cache_spec(
        FullAttentionSpec(block_size=4, **COMMON), pool, 0, OPTIONS
    )
    stored = list(cache(manager, "a", hashes(3)))
    manager.add_local_computed_blocks("b", stored[:2], 8)
    manager.allocate_new_blocks("b", 12)
    assert manager.get_num_common_prefix_blocks("a") == 2
    assert manager.get_num_common_prefix_blocks("b") == 2
    assert manager.get_num_common_prefix_blocks("unknown") == 0


def test_mamba_without_caching_keeps_only_the_latest_state() -> None:
    pool = BlockPool(num_gpu_blocks=10, enable_caching=False, hash_block_size=16)
    options = ManagerOptions(
        enable_caching=False,
        scheduler_block_size=16,
        max_model_len=1024,
        max_in_flight_tokens=1024,
        records_new_block_ids=False,
    )
    spec = MambaSpec(block_size=16, shapes=((2,),), dtypes=(DType.FLOAT16,))
    manager = get_manager_for_kv_cache_spec(spec, pool, 0, options)
    assert isinstance(manager, MambaManager)
    assert manager.get_num_skipped_tokens(20) == 19
    manager.allocate_new_blocks("a", 40)
    manager.remove_skipped_blocks("a", 40)
    assert manager.req_to_blocks["a"][:2] == [pool.null_block] * 2
    with pytest.raises(ConfigError, match="align"):
        get_manager_for_kv_cache_spec(spec, pool, 0, OPTIONS)


def test_cross_attention_never_caches_or_adopts() -> None:
    pool = make_pool()
    manager = get_manager_for_kv_cache_spec(
        CrossAttentionSpec(block_size=4, **COMMON), pool, 0, OPTIONS
    )
    manager.add_local_computed_blocks("a", [], 0)
    assert manager.get_num_blocks_to_allocate("a", 10, [], 0) == 3
    assert len(manager.allocate_new_blocks("a", 10)) == 3
    assert manager.allocate_new_blocks("a", 10) == []
    with pytest.raises(ConfigError):
        manager.find_longest_cache_hit([], 10, [0], 4)
