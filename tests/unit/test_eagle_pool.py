"""A pool's EAGLE/MTP settings (kvcm.v1.PoolConfig fields 29-32): validation, the wire, and
what a pool with lookahead block hashes expects of its requests' hashes.

The decisions themselves (the trailing-block drop, lookahead events) are compared with vLLM
0.33 in tests/compat/test_spec_decode_engine_core.py and test_eagle_manager_compat.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.wire import pool_config_from_proto, pool_config_to_proto

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=16,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)


def _hashes(pool: Pool, tokens: list[int], lookahead: int) -> bytes:
    hashing = pool.hashing
    hasher = BlockHasher(
        hashing.hash_block_size, hashing.algorithm, hashing.seed, num_lookahead_tokens=lookahead
    )
    return b"".join(hasher.hash_token_ids(tokens))


def test_eagle_settings_round_trip_and_bad_values_name_their_field() -> None:
    config = PoolConfig(
        max_model_len=256,
        explicit_layout=LAYOUT,
        num_hash_lookahead_tokens=1,
        num_prefill_lookahead=3,
        eagle_block_drop_group_ids=(0,),
    )
    assert pool_config_from_proto(pool_config_to_proto(config)) == config
    plain = pool_config_to_proto(PoolConfig(max_model_len=256, explicit_layout=LAYOUT))
    assert plain.num_hash_lookahead_tokens == plain.num_prefill_lookahead == 0
    assert not plain.eagle_block_drop_group_ids
    for field, value in (
        ("num_hash_lookahead_tokens", -1),
        ("num_hash_lookahead_tokens", 65),
        ("num_prefill_lookahead", 1000),
        ("eagle_block_drop_group_ids", (0, 0)),
        ("eagle_block_drop_group_ids", (-1,)),
    ):
        with pytest.raises(InvalidArgumentError, match=rf"config\.{field}") as caught:
            PoolConfig(max_model_len=256, explicit_layout=LAYOUT, **{field: value})  # type: ignore[arg-type]
        assert caught.value.field == f"config.{field}"
    wire = pool_config_to_proto(config)
    wire.num_prefill_lookahead = 65
    with pytest.raises(InvalidArgumentError, match=r"config\.num_prefill_lookahead"):
        pool_config_from_proto(wire)


def test_groups_the_drop_cannot_serve_are_refused_when_the_pool_is_planned() -> None:
    # A group index past the layout, and chunked local attention (vLLM asserts it).
    with pytest.raises(ConfigError, match="eagle_block_drop_group_ids"):
        Pool(
            "p",
            PoolConfig(max_model_len=256, explicit_layout=LAYOUT, eagle_block_drop_group_ids=(1,)),
        )
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16, attention_chunk_size=64
    )
    layout = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=chunked),),
    )
    with pytest.raises(ConfigError, match="chunked local attention"):
        Pool(
            "p",
            PoolConfig(max_model_len=256, explicit_layout=layout, eagle_block_drop_group_ids=(0,)),
        )


def test_lookahead_hashes_cover_the_next_token_and_are_verified() -> None:
    pool = Pool(
        "p",
        PoolConfig(
            max_model_len=256,
            explicit_layout=LAYOUT,
            num_hash_lookahead_tokens=1,
            verify_block_hashes=True,
        ),
    )
    prompt = list(range(32))
    # 32 tokens fill two blocks, but the second block's hash needs token 32: one hash.
    assert pool.expected_num_hashes(32) == 1
    with pytest.raises(InvalidArgumentError, match="1 hashes"):
        pool.add_request(1, "r", prompt, _hashes(pool, prompt, 0))
    with pytest.raises(InvalidArgumentError, match="differ"):
        pool.add_request(
            1, "r", prompt, _hashes(pool, prompt, 0)[: len(_hashes(pool, prompt, 0)) // 2]
        )
    pool.add_request(1, "r", prompt, _hashes(pool, prompt, 1))
    # The next token completes the second hash; the standard hash of that block is refused.
    grown = [*prompt, 32]
    second = _hashes(pool, grown, 1)[pool.hashing.hash_length_bytes :]
    with pytest.raises(InvalidArgumentError, match="differ"):
        pool.append_tokens(1, [32], _hashes(pool, grown, 0)[pool.hashing.hash_length_bytes :])
    pool.append_tokens(1, [32], second)
    assert len(pool.request(1).block_hashes) == 2


def test_token_lookups_and_the_pools_hasher_use_the_lookahead() -> None:
    """A router's token-id Lookup (and the SDK's DescribePool hasher) hashes a lookahead
    pool's prompts as its engine did: with standard hashes nothing would ever match."""
    from kvcm.core.lookup import LookupQuery
    from kvcm.core.pool import PoolRegistry
    from kvcm.core.program import HitSpec
    from kvcm.wire import hashing_from_proto, hashing_to_proto

    registry = PoolRegistry()
    pools = {
        lookahead: registry.create(
            f"l{lookahead}",
            PoolConfig(
                max_model_len=256, explicit_layout=LAYOUT, num_hash_lookahead_tokens=lookahead
            ),
        )
        for lookahead in (0, 1)
    }
    prompt = list(range(50))  # 3 full blocks; with one lookahead token 3 hashes (49 // 16)
    for lookahead, pool in pools.items():
        hashing = hashing_from_proto(hashing_to_proto(pool.hashing))
        assert hashing.num_lookahead_tokens == lookahead
        assert b"".join(hashing.block_hasher().hash_token_ids(prompt)) == _hashes(
            pool, prompt, lookahead
        )
        pool.add_request(1, "r", prompt, _hashes(pool, prompt, lookahead))
        hit = pool.get_computed_blocks(1, None)
        spec = HitSpec(num_tokens=hit.num_computed_tokens, block_ids=hit.blocks.get_block_ids())
        assert pool.allocate(1, len(prompt), 0, hit=spec) is not None
        pool.free(1, preempt=False)
    # 49 tokens: three blocks for both pools (the third lookahead hash covers token 48).
    answer = registry.lookup(LookupQuery(token_ids=prompt[:49]))
    assert {hit.pool_id: hit.num_hit_tokens for hit in answer.pools} == {"l0": 48, "l1": 48}


def _hybrid_mamba_layout() -> KVCacheConfig:
    # Full attention of 64-token blocks beside an align-mode Mamba group of 256: sub-block hits.
    full = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
    mamba = MambaSpec(
        block_size=256, shapes=((4, 8),), dtypes=(DType.FLOAT16,), mamba_cache_mode="align"
    )
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=(),
        kv_cache_groups=(
            KVCacheGroupSpec(layer_names=("attn",), kv_cache_spec=full),
            KVCacheGroupSpec(layer_names=("mamba",), kv_cache_spec=mamba),
        ),
    )


def test_mamba_shared_prefix_checkpoint_setting_round_trips_and_takes_vllms_predicate() -> None:
    # kvcm.v1.PoolConfig field 32: on the wire, validated, and in effect only where vLLM 0.33's
    # KVCacheManager turns it on (sub-block hits beside align-mode Mamba, no MTP re-prefill).
    layout = _hybrid_mamba_layout()
    config = PoolConfig(
        max_model_len=2048,
        explicit_layout=layout,
        hash_block_size=64,
        num_hash_lookahead_tokens=1,
        num_prefill_lookahead=1,
        enable_mamba_shared_prefix_checkpoint=True,
    )
    wire = pool_config_to_proto(config)
    assert wire.enable_mamba_shared_prefix_checkpoint
    assert pool_config_from_proto(wire) == config
    assert not pool_config_to_proto(
        PoolConfig(max_model_len=256, explicit_layout=LAYOUT)
    ).enable_mamba_shared_prefix_checkpoint
    with pytest.raises(
        InvalidArgumentError, match=r"config\.enable_mamba_shared_prefix_checkpoint"
    ):
        PoolConfig(
            max_model_len=256, explicit_layout=LAYOUT, enable_mamba_shared_prefix_checkpoint=1
        )  # type: ignore[arg-type]

    def decided(**changes: object) -> tuple[bool, list[bool]]:
        manager = Pool("p", dataclasses.replace(config, **changes)).manager
        assert manager is not None
        groups = manager.coordinator.single_type_managers
        return manager.mamba_shared_prefix_checkpoint, [
            bool(getattr(group, "shared_prefix_checkpoint", False)) for group in groups
        ]

    assert decided() == (True, [False, True])
    assert decided(enable_mamba_shared_prefix_checkpoint=False) == (False, [False, False])
    # Multi-module MTP's re-prefillable tokens: the cached count trails the chunk end.
    assert decided(num_prefill_lookahead=3, num_hash_lookahead_tokens=3) == (False, [False, False])
    # No align-mode Mamba group (full attention only): no sub-block hits, nothing to key.
    assert decided(explicit_layout=LAYOUT, hash_block_size=None) == (False, [False])


def test_a_step_fed_mamba_pool_does_not_keep_every_block_it_ever_zeroed() -> None:
    """A Mamba pool records new attention blocks for workers to zero; vLLM's scheduler drains
    them every step. A pool fed by Steps (the vLLM mirror's copy on the server) drains them
    when the next step starts: after many steps only the last step's are left, and a caller
    that takes them after its Step still gets that step's."""
    from kvcm.client import StepBuilder

    pool = Pool("p", PoolConfig(max_model_len=4096, explicit_layout=_hybrid_mamba_layout()))
    hasher = BlockHasher(pool.hashing.hash_block_size, pool.hashing.algorithm, pool.hashing.seed)
    manager = pool.ready_manager()
    prompt = list(range(100))
    first = StepBuilder()
    first.new_step_starts()
    first.add_request(1, prompt, b"".join(hasher.hash_token_ids(prompt)))
    first.allocate(1, len(prompt), 0)
    first.cache_blocks(1, len(prompt))
    pool.run_step(first.build())
    recorded = [len(m.new_block_ids) for m in manager.coordinator.single_type_managers]
    assert recorded[0] == 2  # the prompt's two 64-token attention blocks
    computed = len(prompt)
    # One token a step up to the step that takes the 41st attention block (token 2,560).
    while computed <= 40 * 64:
        step = StepBuilder()
        step.new_step_starts()
        step.append_tokens(1, [computed], b"")
        step.allocate(1, 1, computed)
        pool.run_step(step.build())
        computed += 1
    attention = manager.get_block_ids(pool.request(1).request_id)[0]
    assert len(attention) == 41
    # Only the last step's new block is left for zeroing (before: all 41 of them).
    assert [m.new_block_ids for m in manager.coordinator.single_type_managers] == [
        [attention[-1]],
        [],
    ]
    assert manager.take_new_block_ids() == [attention[-1]]
