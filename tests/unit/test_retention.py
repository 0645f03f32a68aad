"""Sparse prefix-cache retention on a pool: the shared-prefix junction a lookup finds.

The differential tests (tests/compat/test_manager_compat.py, test_vllm_scheduler.py) prove the
policy equals vLLM's; these pin down how a pool learns a junction: from its own lookup
(GetComputedBlocks), or from a hit whose lookup ran elsewhere (a mirror's), which may also
leave the pool's own answer in place.
"""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec, SlidingWindowSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import HitSpec

_ATTN = {"num_kv_heads": 2, "head_size": 8, "dtype": DType.FLOAT16}
# Full attention in 16-token blocks beside a 6-token window in 4-token blocks: a hit needs
# the window's 2 blocks before a 16-token boundary, so sparse retention shows.
LAYOUT = KVCacheConfig(
    num_blocks=64,
    kv_cache_tensors=(),
    kv_cache_groups=(
        KVCacheGroupSpec(
            layer_names=("full",), kv_cache_spec=FullAttentionSpec(block_size=16, **_ATTN)
        ),
        KVCacheGroupSpec(
            layer_names=("swa",),
            kv_cache_spec=SlidingWindowSpec(block_size=4, sliding_window=6, **_ATTN),
        ),
    ),
)


def _pool(retention: int | None) -> Pool:
    return Pool(
        "p",
        PoolConfig(
            max_model_len=256, explicit_layout=LAYOUT, prefix_cache_retention_interval=retention
        ),
    )


def _add(pool: Pool, key: int, prompt: list[int]) -> None:
    hasher = BlockHasher(4, pool.hashing.algorithm, pool.hashing.seed)
    pool.add_request(key, f"r{key}", prompt, b"".join(hasher.hash_token_ids(prompt)))


def _run(pool: Pool, key: int, num_tokens: int, hit: HitSpec | None = None) -> None:
    assert pool.allocate(key, num_tokens, 0, hit=hit) is not None


PREFIX = list(range(100, 164))  # 64 tokens: 4 full-attention blocks, 16 window blocks


def _junction(pool: Pool, key: int) -> int:
    manager = pool.manager
    assert manager is not None
    return manager.get_shared_prefix_boundary(str(key))  # the core knows it by its key


def test_a_sibling_lookup_finds_the_junction_and_keeps_it_through_a_bare_hit() -> None:
    pool = _pool(0)
    _add(pool, 1, [*PREFIX, *range(1, 21)])
    _run(pool, 1, 84)
    pool.free(1, preempt=False)
    _add(pool, 2, [*PREFIX, 9, 9, 9, 9, 9])
    hit = pool.get_computed_blocks(2, None)
    # Full attention cached the whole 64-token prefix; the window kept only the blocks before
    # the first prompt's replay boundary (83, floored to 80), so the hybrid hit is empty and
    # the junction is where full attention's hit ends.
    assert hit.num_computed_tokens == 0
    assert _junction(pool, 2) == 64
    ids = tuple([b.block_id for b in group] for group in hit.blocks.blocks)
    # A hit without a junction of its own (an SDK client's) leaves the pool's answer.
    _run(
        pool,
        2,
        69 - hit.num_computed_tokens,
        HitSpec(num_tokens=hit.num_computed_tokens, block_ids=ids),
    )
    assert _junction(pool, 2) == 64


def test_a_mirrors_hit_sets_or_clears_the_junction() -> None:
    pool = _pool(0)
    _add(pool, 1, [*PREFIX, 1])
    _run(pool, 1, 65, HitSpec(num_tokens=0, block_ids=([], []), shared_prefix_boundary=32))
    assert _junction(pool, 1) == 32
    _add(pool, 2, [*PREFIX, 2])
    _run(pool, 2, 65, HitSpec(num_tokens=0, block_ids=([], []), shared_prefix_boundary=0))
    assert _junction(pool, 2) == 0


@pytest.mark.parametrize("retention", [-1, 1.5])
def test_a_bad_interval_names_the_field(retention: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"config\.prefix_cache_retention_interval"):
        PoolConfig(max_model_len=64, world_size=1, prefix_cache_retention_interval=retention)  # type: ignore[arg-type]


def test_an_interval_off_the_scheduler_block_is_refused_with_vllms_reason() -> None:
    with pytest.raises(ConfigError, match=r"multiple of scheduler_block_size \(16\)"):
        _pool(24)


def test_a_snapshot_carries_the_junctions_and_the_copy_decides_the_same() -> None:
    # A resync (or a checkpoint) must restore where each live request's lookup found a shared
    # prefix, or the copy keeps fewer window blocks than the original when the request runs.
    from kvcm.core.fingerprint import state_fingerprint
    from kvcm.core.snapshot import decode_pool, encode_pool

    pool = _pool(0)
    _add(pool, 1, [*PREFIX, *range(1, 21)])
    _run(pool, 1, 84)
    pool.free(1, preempt=False)
    _add(pool, 2, [*PREFIX, 9, 9, 9, 9, 9])
    pool.get_computed_blocks(2, None)
    assert _junction(pool, 2) == 64
    copy = decode_pool(encode_pool(pool), "p", pool.options)
    assert _junction(copy, 2) == 64
    for each in (pool, copy):
        _run(each, 2, 69)
        _add(each, 3, [*PREFIX, 7, 7, 7, 7, 7, 7])
        each.get_computed_blocks(3, None)
        _run(each, 3, 70)
    assert state_fingerprint(copy) == state_fingerprint(pool)
    assert encode_pool(copy) == encode_pool(pool)


def test_a_snapshot_naming_a_junction_of_no_live_request_is_refused() -> None:
    from kvcm.core.snapshot import decode_pool, decode_sections, encode_pool, encode_sections

    pool = _pool(0)
    _add(pool, 1, [*PREFIX, 9])
    pool.get_computed_blocks(1, None)
    sections = decode_sections(encode_pool(pool))
    sections[1]["junctions"] = {"77": 16}
    with pytest.raises(InvalidArgumentError, match="junctions"):
        decode_pool(encode_sections(sections), "p", pool.options)
