"""Pool snapshots: a restored pool is the same pool, now and for every later call.

Random Step programs (the generator of test_step_programs) run on a pool with events and
statistics on; at a random point the pool is snapshotted and restored from the bytes. The
restored pool must have the same fingerprint, and the two must then answer every further
program identically (outcomes, rejections, fingerprints, published events). A full-attention
pool and a hybrid full + sliding-window pool are drawn; damaged and mismatched snapshots are
refused with INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_step_programs import OPTIONS, PROFILE, _build, _sane_op, ops

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError, KVCMError
from kvcm.common.specs import FullAttentionSpec, SlidingWindowSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import OpKind, StepOutcome, StepProgram
from kvcm.core.snapshot import decode_pool, encode_pool

FULL = dataclasses.replace(OPTIONS, enable_kv_cache_events=True, log_stats=True)
_SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
_WINDOW = SlidingWindowSpec(
    block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16, sliding_window=32
)
HYBRID = dataclasses.replace(
    FULL,
    explicit_layout=KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=(),
        kv_cache_groups=(
            KVCacheGroupSpec(layer_names=("full",), kv_cache_spec=_SPEC),
            KVCacheGroupSpec(layer_names=("window",), kv_cache_spec=_WINDOW),
        ),
    ),
)


def _run(pool: Pool, program: StepProgram) -> StepOutcome | str:
    try:
        outcome = pool.run_step(program)
    except KVCMError as exc:
        return f"{type(exc).__name__}: {exc}"
    pool.publish_events(1000.0)
    pool.take_prefix_cache_stats()
    return outcome


@settings(PROFILE, max_examples=min(PROFILE.max_examples, 120))
@given(st.data())
def test_a_restored_pool_is_the_same_pool(data: st.DataObject) -> None:
    options = data.draw(st.sampled_from([FULL, HYBRID]))
    original = Pool("p", options)
    num_programs = data.draw(st.integers(2, 16))
    snapshot_at = data.draw(st.integers(0, num_programs - 1))
    restored: Pool | None = None
    for index in range(num_programs):
        if index == snapshot_at:
            restored = decode_pool(encode_pool(original), "p", options)
            assert restored.state_fingerprint() == original.state_fingerprint()
        live = sorted(original.requests)
        program_ops = data.draw(
            st.lists(st.one_of(_sane_op(live), _sane_op(live), ops), min_size=1, max_size=6)
        )
        answer = _run(original, _build(original, program_ops))
        if restored is not None:
            assert _run(restored, _build(restored, program_ops)) == answer
            assert restored.state_fingerprint() == original.state_fingerprint()
    assert restored is not None


def _busy_pool() -> Pool:
    pool = Pool("p", FULL)
    program = _build(
        pool,
        [("add", 1, 40, True), ("alloc", 1, 40, 0), ("add", 2, 20, True), ("alloc", 2, 20, 0)],
    )
    pool.run_step(program)
    pool.run_step(_build(pool, [("cache", 1, 32), ("finish", 2)]))
    pool.publish_events(5.0)
    return pool


def test_damaged_or_mismatched_snapshots_are_refused() -> None:
    pool = _busy_pool()
    data = encode_pool(pool)
    flipped = data[:-1] + bytes([data[-1] ^ 1])
    for bad in (b"", data[:20], b"X" + data[1:], data[:-1], flipped):
        with pytest.raises(InvalidArgumentError) as caught:
            decode_pool(bad, "p", FULL)
        assert caught.value.field == "data"
    with pytest.raises(InvalidArgumentError, match="blocks"):
        decode_pool(data, "p", HYBRID)


def test_a_pool_waiting_for_workers_has_no_snapshot() -> None:
    pending = Pool("w", PoolConfig(max_model_len=128, world_size=2))
    with pytest.raises(FailedPreconditionError):
        encode_pool(pending)


def test_events_sequence_numbers_and_the_retry_guard_survive() -> None:
    pool = _busy_pool()
    program = _build(pool, [("alloc", 1, 8, 40)])
    program.step_seq = 1
    first = pool.run_step(program)
    pool.publish_events(6.0)
    restored = decode_pool(encode_pool(pool), "p", FULL)
    assert restored.last_event_sequence == pool.last_event_sequence > 0
    assert restored.events_from(1, 100) == pool.events_from(1, 100)
    assert restored.run_step(program) == first  # the retry answers the remembered outcome
    again = _build(restored, [("new_step",)])
    again.step_seq = 2
    assert restored.run_step(again).num_ops_executed == 1
    assert OpKind.NEW_STEP_STARTS in again.ops


def test_a_large_pool_round_trips_in_seconds() -> None:
    """Cost check at a realistic size (bench/restart.py measures it properly)."""
    layout = dataclasses.replace(FULL.explicit_layout, num_blocks=200_000)
    options = dataclasses.replace(FULL, explicit_layout=layout, max_model_len=100_000)
    pool = Pool("big", options)
    started = time.perf_counter()
    data = encode_pool(pool)
    restored = decode_pool(data, "big", options)
    elapsed = time.perf_counter() - started
    assert restored.ready_manager().num_free_blocks == pool.ready_manager().num_free_blocks
    assert elapsed < 30
