"""Decode context parallelism in the core: the pool setting, its wire form, the manager's sizes.

The behaviour is compared with vLLM 0.33's manager in tests/compat/test_dcp_compat.py (and a
Mamba hybrid in test_mamba_align_compat.py); here: the setting's domain, that it travels and
survives a snapshot, and what it changes (attention blocks span the ranks, Mamba states not).
"""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.wire import pool_config_from_proto, pool_config_to_proto

_ATTN = {"num_kv_heads": 2, "head_size": 8, "dtype": DType.FLOAT16}


def _layout(*specs: KVCacheSpec) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=(),
        kv_cache_groups=tuple(
            KVCacheGroupSpec(layer_names=(f"layer.{i}",), kv_cache_spec=spec)
            for i, spec in enumerate(specs)
        ),
    )


def _pool(layout: KVCacheConfig, dcp: int) -> Pool:
    return Pool(
        "p",
        PoolConfig(max_model_len=1024, explicit_layout=layout, decode_context_parallel_size=dcp),
    )


@pytest.mark.parametrize("value", [0, -2, 1025, 1.5, True])
def test_a_bad_size_names_the_field(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"config\.decode_context_parallel_size") as err:
        PoolConfig(
            max_model_len=64,
            explicit_layout=_layout(FullAttentionSpec(block_size=16, **_ATTN)),
            decode_context_parallel_size=value,  # type: ignore[arg-type]
        )
    assert err.value.field == "config.decode_context_parallel_size"


def test_planning_from_registered_workers_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"needs config\.explicit_layout") as err:
        PoolConfig(max_model_len=64, world_size=2, decode_context_parallel_size=2)
    assert err.value.field == "config.decode_context_parallel_size"


def test_the_size_travels_only_when_set_and_zero_on_the_wire_is_refused() -> None:
    layout = _layout(FullAttentionSpec(block_size=16, **_ATTN))
    config = PoolConfig(max_model_len=64, explicit_layout=layout, decode_context_parallel_size=4)
    message = pool_config_to_proto(config)
    assert message.decode_context_parallel_size == 4
    assert pool_config_from_proto(message) == config
    default = pool_config_to_proto(PoolConfig(max_model_len=64, world_size=1))
    assert not default.HasField("decode_context_parallel_size")
    assert pool_config_from_proto(default).decode_context_parallel_size == 1
    default.decode_context_parallel_size = 0
    with pytest.raises(InvalidArgumentError, match=r"config\.decode_context_parallel_size"):
        pool_config_from_proto(default)


def test_attention_blocks_span_the_ranks_and_hits_land_on_them() -> None:
    layout = _layout(FullAttentionSpec(block_size=16, **_ATTN))
    pool = _pool(layout, 2)
    manager = pool.manager
    assert manager is not None
    assert [m.block_size for m in manager.coordinator.single_type_managers] == [32]
    assert (manager.scheduler_block_size, manager.hash_block_size) == (32, 32)
    # What workers allocate is each rank's block: the pool's layout keeps 16 tokens.
    assert pool.kv_cache_config is not None
    assert pool.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size == 16
    hasher = BlockHasher(32, pool.hashing.algorithm, pool.hashing.seed)
    prompt = list(range(1, 81))  # 80 tokens: 2 full blocks of 32
    hashes = b"".join(hasher.hash_token_ids(prompt))
    pool.add_request(1, "a", prompt, hashes)
    blocks = pool.allocate(1, 80, 0)
    assert blocks is not None
    assert len(blocks[0]) == 3  # 80 tokens in blocks of 32
    pool.free(1, preempt=False)
    pool.add_request(2, "b", prompt, hashes)
    _, num_hit_tokens = pool.get_computed_blocks(2, None)
    assert num_hit_tokens == 64


def test_mamba_states_keep_their_size_and_an_equal_hash_block_serves_sub_block_hits() -> None:
    # Full attention 16 x 4 ranks = 64-token blocks beside a Mamba block of 32: the hash block
    # is 32, and under DCP (only) a Mamba block equal to it lets hits end inside full
    # attention's blocks, as vLLM 0.33 decides.
    layout = _layout(
        FullAttentionSpec(block_size=16, **_ATTN),
        MambaSpec(
            block_size=32, shapes=((4, 8),), dtypes=(DType.FLOAT16,), mamba_cache_mode="align"
        ),
    )
    manager = _pool(layout, 4).manager
    assert manager is not None
    assert [m.block_size for m in manager.coordinator.single_type_managers] == [64, 32]
    assert (manager.scheduler_block_size, manager.hash_block_size) == (64, 32)
    assert manager.coordinator.enable_partial_hash_hits
    assert manager.coordinator.cache_hit_alignment_tokens == 32
    single = _pool(
        _layout(FullAttentionSpec(block_size=64, **_ATTN), layout.kv_cache_groups[1].kv_cache_spec),
        1,
    ).manager
    assert single is not None
    assert not single.coordinator.enable_partial_hash_hits


def test_local_attention_is_refused_naming_the_group() -> None:
    layout = _layout(
        FullAttentionSpec(block_size=16, **_ATTN),
        SlidingWindowSpec(block_size=16, sliding_window=32, **_ATTN),
    )
    with pytest.raises(ConfigError, match=r"dcp_world_size=2: group 1: .*got: SlidingWindowSpec"):
        _pool(layout, 2)
    assert _pool(layout, 1).manager is not None


def test_a_snapshot_restores_the_setting_and_the_same_state() -> None:
    from kvcm.core.fingerprint import state_fingerprint
    from kvcm.core.snapshot import decode_pool, encode_pool

    pool = _pool(_layout(FullAttentionSpec(block_size=16, **_ATTN)), 4)
    hasher = BlockHasher(64, pool.hashing.algorithm, pool.hashing.seed)
    prompt = list(range(200))
    pool.add_request(1, "a", prompt, b"".join(hasher.hash_token_ids(prompt)))
    assert pool.allocate(1, 200, 0) is not None
    copy = decode_pool(encode_pool(pool), "p", pool.options)
    assert copy.manager is not None
    assert copy.manager.coordinator.single_type_managers[0].block_size == 64
    assert state_fingerprint(copy) == state_fingerprint(pool)
