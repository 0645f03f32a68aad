"""Coordinators: which one vLLM picks, and the hybrid fixed-point hit search."""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from kvcm.core.coordinator import (
    CoordinatorConfig,
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from kvcm.core.request import Request

COMMON = {"num_kv_heads": 1, "head_size": 8, "dtype": DType.FLOAT16}


def make(
    specs: list[KVCacheSpec],
    *,
    caching: bool = True,
    scheduler_block_size: int = 4,
    hash_block_size: int = 4,
    num_blocks: int = 40,
) -> KVCacheCoordinator:
    groups = [KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs)]
    return get_kv_cache_coordinator(
        CoordinatorConfig(
            kv_cache_config=KVCacheConfig(
                num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
            ),
            max_model_len=1024,
            max_in_flight_tokens=1024,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            enable_caching=caching,
            enable_kv_cache_events=False,
        )
    )


def full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, **COMMON)


def swa(block_size: int = 4, window: int = 8) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, sliding_window=window, **COMMON)


def compute(coordinator: KVCacheCoordinator, request: Request) -> None:
    coordinator.allocate_new_blocks(request.request_id, request.num_tokens)
    coordinator.cache_blocks(request, request.num_tokens)


def test_coordinator_choice() -> None:
    assert type(make([full()], caching=False)) is KVCacheCoordinatorNoPrefixCache
    assert type(make([], caching=False)) is KVCacheCoordinatorNoPrefixCache
    assert type(make([full()])) is UnitaryKVCacheCoordinator
    assert type(make([full(), swa()])) is HybridKVCacheCoordinator
    assert type(make([full(), full()])) is HybridKVCacheCoordinator


def test_no_prefix_cache_with_zero_groups() -> None:
    coordinator = make([], caching=False)
    assert coordinator.allocate_new_blocks("a", 10) == ()
    hit = coordinator.find_longest_cache_hit([], 10)
    assert (hit.blocks, hit.num_tokens) == ((), 0)
    coordinator.free("a")


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="hash_block_size"):
        make([full(8)], scheduler_block_size=8, hash_block_size=4)
    with pytest.raises(ConfigError, match="multiple"):
        make([full(4), swa(6)], scheduler_block_size=8)
    with pytest.raises(ConfigError, match="chunked local"):
        make(
            [full(8), ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=16, **COMMON)],
            scheduler_block_size=8,
        )
    with pytest.raises(ConfigError, match="at least one"):
        make([])


def test_hybrid_hit_is_aligned_to_the_lcm_and_agreed_by_all_groups() -> None:
    coordinator = make([full(8), swa(4, 8)], scheduler_block_size=8, hash_block_size=4)
    hasher = BlockHasher(4)
    first = Request("a", range(30), block_hasher=hasher)
    compute(coordinator, first)
    coordinator.free("a")
    probe = Request("b", [*range(30), 1], block_hasher=hasher)
    hit = coordinator.find_longest_cache_hit(probe.block_hashes, probe.num_tokens - 1)
    assert hit.num_tokens == 24
    assert [len(blocks) for blocks in hit.blocks] == [3, 6]
    null = coordinator.block_pool.null_block
    assert hit.blocks[1][:4] == [null] * 4


def test_hybrid_fixed_point_shrinks_full_attention_to_the_window_hit() -> None:
    coordinator = make([full(4), swa(4, 8)])
    hasher = BlockHasher(4)
    first = Request("a", range(24), block_hasher=hasher)
    compute(coordinator, first)
    swa_blocks = coordinator.get_blocks("a")[1]
    coordinator.free("a")
    coordinator.block_pool.evict_blocks({swa_blocks[4].block_id, swa_blocks[2].block_id})
    probe = Request("b", [*range(24), 1], block_hasher=hasher)
    hit = coordinator.find_longest_cache_hit(probe.block_hashes, 24)
    # Window runs: blocks 0-1 reach the start (tokens 0..7); block 3 alone is too short.
    assert hit.num_tokens == 8
    assert [len(blocks) for blocks in hit.blocks] == [2, 2]


def test_three_spec_groups_iterate_to_a_fixed_point() -> None:
    coordinator = make([full(4), swa(4, 8), swa(4, 16)])
    hasher = BlockHasher(4)
    first = Request("a", range(40), block_hasher=hasher)
    compute(coordinator, first)
    long_window = coordinator.get_blocks("a")[2]
    coordinator.free("a")
    coordinator.block_pool.evict_blocks({long_window[7].block_id})
    probe = Request("b", [*range(40), 1], block_hasher=hasher)
    hit = coordinator.find_longest_cache_hit(probe.block_hashes, 40)
    assert hit.num_tokens == 28
    assert [len(blocks) for blocks in hit.blocks] == [7, 7, 7]


def test_cache_blocks_only_caches_scheduler_aligned_prefix_in_hybrid() -> None:
    coordinator = make([full(8), swa(4, 8)], scheduler_block_size=8, hash_block_size=4)
    request = Request("a", range(30), block_hasher=BlockHasher(4))
    compute(coordinator, request)
    full_blocks, swa_blocks = coordinator.get_blocks("a")
    assert [b.block_hash is not None for b in full_blocks] == [True, True, True, False]
    assert sum(b.block_hash is not None for b in swa_blocks) == 6
