"""HOST_SYNC: a pool whose host tier an engine's offloading connector keeps replays its calls.

The same calls applied to a bare ``HostTier`` (what ``KvcmOffloadingManager`` holds in the
engine) and shipped as one Step program, through the wire codec, leave the pool's tier equal
to it; refusals name their field and change nothing.
"""

from __future__ import annotations

import hashlib

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError, KVCMError
from kvcm.common.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.host_tier import HostTier, SyncAction, apply_sync
from kvcm.core.op_table import OpWriter
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import OpKind, StepProgram
from kvcm.wire.step import program_from_proto, program_to_proto

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=16,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)


def _pool(*, offload: int = 0, host_bytes: int = 0) -> Pool:
    config = PoolConfig(
        max_model_len=512,
        explicit_layout=LAYOUT,
        offload_host_blocks=offload,
        host_tier_bytes=host_bytes,
        enable_kv_cache_events=True,
    )
    return Pool("p", config)


def _key(pool: Pool, n: int) -> BlockHashWithGroupId:
    digest = hashlib.sha256(str(n).encode()).digest()[: pool.hashing.hash_length_bytes]
    return make_block_hash_with_group_id(BlockHash(digest), 0)


def _program(calls: list[tuple[int, list[BlockHashWithGroupId]]]) -> StepProgram:
    # As the vLLM integration's recorder writes them (and through the wire).
    program = StepProgram()
    for action, keys in calls:
        program.ops.append(int(OpKind.HOST_SYNC))
        program.host_sync_actions.append(action)
        program.host_sync_num_keys.append(len(keys))
        program.host_sync_group_ids.extend(get_group_id(k) for k in keys)
        program.host_sync_keys += b"".join(k[:-4] for k in keys)
    return program_from_proto(program_to_proto(program, "p"))


def _state(host: HostTier) -> tuple[object, ...]:
    keys = host.keys()
    return (
        [(k, keys[k]) for k in host.recency()],
        host.pending_keys(),
        host.pinned(),
        host.num_free,
        host.stats(),
    )


def test_the_pool_tier_equals_the_engine_tier_call_for_call() -> None:
    pool = _pool(offload=4)
    engine = HostTier(4)
    k = [_key(pool, n) for n in range(8)]
    calls: list[tuple[int, list[BlockHashWithGroupId]]] = [
        (SyncAction.STORE, k[0:3]),
        (SyncAction.STORED, k[0:3]),
        (SyncAction.LOAD, [k[0]]),
        (SyncAction.TOUCH, [k[2], k[1]]),
        (SyncAction.STORE, k[3:5]),  # one free block: evicts the least recent unpinned key
        (SyncAction.STORE_FAILED, [k[4]]),
        (SyncAction.STORED, [k[3]]),
        (SyncAction.LOADED, [k[0]]),
        (SyncAction.STORE, k[5:8]),
        (SyncAction.LOAD, [k[7], k[6]]),  # pending: nothing pinned, nothing counted
        (SyncAction.LOADED, [k[6]]),  # not pinned: ignored
    ]
    for step in (calls[:4], calls[4:]):
        for action, keys in step:
            apply_sync(engine, action, keys, [16])
        pool.run_step(_program(step))
        assert _state(pool.host_tier) == _state(engine)  # type: ignore[arg-type]
    stats = engine.stats()
    assert stats.stores == 8
    assert stats.evictions > 0
    assert stats.loads == 1
    assert stats.hit_tokens == 16
    # The tier's events are the pool's, medium CPU: stores on completion, evictions.
    pool.publish_events(0.0)
    kinds = [
        type(e).__name__ for e, _ in pool.event_log_contents() if getattr(e, "medium", "") == "CPU"
    ]
    assert kinds.count("BlockStored") == 4
    assert "BlockRemoved" in kinds
    # CLEAR forgets everything.
    pool.run_step(_program([(SyncAction.CLEAR, [])]))
    assert pool.host_tier is not None
    assert pool.host_tier.num_free == 4


def test_refusals_name_the_field_and_change_nothing() -> None:
    pool = _pool(offload=4)
    key = _key(pool, 1)
    before = pool.state_fingerprint()
    bad_action = _program([(SyncAction.STORE, [key])])
    bad_action.host_sync_actions[0] = 9
    bad_group = _program([(SyncAction.STORE, [key])])
    bad_group.host_sync_group_ids[0] = 1
    clear_with_keys = _program([(SyncAction.CLEAR, [key])])
    short = _program([(SyncAction.STORE, [key])])
    short.host_sync_keys = short.host_sync_keys[:-1]
    for program, field in (
        (bad_action, "host_sync_actions[0]"),
        (bad_group, "host_sync_group_ids[0]"),
        (clear_with_keys, "host_sync_num_keys[0]"),
        (short, "host_sync_keys"),
    ):
        with pytest.raises(InvalidArgumentError) as info:
            pool.run_step(program)
        assert info.value.field == field
        assert pool.state_fingerprint() == before
    # A pool whose tier demotes takes no HOST_SYNC; a connector's tier takes nothing else.
    demoting = _pool(host_bytes=4 * SPEC.page_size_bytes)
    with pytest.raises(FailedPreconditionError) as refused:
        demoting.run_step(_program([(SyncAction.TOUCH, [key])]))
    assert refused.value.field == "config.offload_host_blocks"
    program = StepProgram()
    OpWriter(program).op[OpKind.TAKE_HOST_COPIES]()
    with pytest.raises(KVCMError) as other:
        pool.run_step(program)
    assert other.value.field == "config.offload_host_blocks"
    with pytest.raises(InvalidArgumentError) as both:
        PoolConfig(
            max_model_len=512, explicit_layout=LAYOUT, offload_host_blocks=4, host_tier_bytes=1
        )
    assert both.value.field == "config.offload_host_blocks"
