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
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_step_programs import OPTIONS, PROFILE, _build, _sane_op, ops

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError, KVCMError
from kvcm.common.specs import FullAttentionSpec, SlidingWindowSpec
from kvcm.core.invariants import pool_violations
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import OpKind, StepOutcome, StepProgram
from kvcm.core.snapshot import decode_pool, decode_sections, encode_pool, encode_sections
from kvcm.core.stats import PrefixCacheStats

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
        assert list(pool_violations(original)) == []
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


# ---------------------------------------------------------------------------- forgeries
# A snapshot is checked like a Step: hostile content behind a valid frame and CRC is refused
# with INVALID_ARGUMENT naming where, and nothing but a pool that keeps every invariant is
# built. (tests/integration/test_snapshot_forgery.py forges them at random against a server.)
def _reframe(body: bytes) -> bytes:
    """A snapshot frame (magic, version, CRC, length) around ``body``."""
    return struct.pack("<8sIIQ", b"KVCMSNAP", 1, zlib.crc32(body), len(body)) + body


def _forged(edit: Callable[[list[Any]], None], pool: Pool | None = None) -> bytes:
    sections = decode_sections(encode_pool(pool or _busy_pool()))
    edit(sections)
    return encode_sections(sections)


def _spliced(raw: bytes) -> bytes:
    """The busy pool's snapshot with ``extras.failed_plans`` encoded as ``raw``."""
    marker = 0x5EED_F00D_5EED_F00D

    def mark(sections: list[Any]) -> None:
        sections[3]["failed_plans"] = marker

    data = _forged(mark)
    encoded = b"I" + struct.pack("<q", marker)
    assert data.count(encoded) == 1
    return _reframe(data[struct.calcsize("<8sIIQ") :].replace(encoded, raw))


def _blob(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def _set(path: tuple[Any, ...], value: object) -> Callable[[list[Any]], None]:
    def edit(sections: list[Any]) -> None:
        node: Any = sections
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value

    return edit


def _free_twice(sections: list[Any]) -> None:
    free = sections[0]["free"]
    free.append(free[0])


def _held_and_free(sections: list[Any]) -> None:
    state = sections[0]
    held = next(i for i, ref in enumerate(state["ref_cnts"]) if ref > 0)
    state["free"].append(held)


def _request_field(index: int, value: object) -> Callable[[list[Any]], None]:
    def edit(sections: list[Any]) -> None:
        sections[2][0][index] = value

    return edit


FORGERIES: dict[str, tuple[Callable[[list[Any]], None], str]] = {
    "free queue names block -1": (_set((0, "free", 0), -1), "block_pool.free[0]"),
    "free queue names a block twice": (_free_twice, "block_pool.free["),
    "negative ref count": (_set((0, "ref_cnts", 3), -1), "block_pool.ref_cnts[3]"),
    "a block both held and free": (_held_and_free, "free_queue"),
    "ref count off by one": (_set((0, "ref_cnts", 1), 7), "blocks[1].ref_cnt"),
    "request key is a string": (_request_field(0, "1"), "requests[0].key"),
    "request key is 2**70": (_request_field(0, 2**70), "requests[0].key"),
    "computed tokens past the prompt": (_request_field(7, 10_000), "num_computed_tokens"),
    "token id beyond uint32": (_request_field(3, [2**40] * 40), "all_token_ids"),
    "garbage statistics": (
        _set((3, "stats_totals", 0), PrefixCacheStats(requests=-5)),
        "stats_total.requests",
    ),
    "more hits than queries": (
        _set((3, "stats_totals", 0), PrefixCacheStats(requests=1, queries=1, hits=9)),
        "stats_total",
    ),
    "statistics of the wrong type": (_set((3, "stats_totals"), "lots"), "extras.stats_totals"),
    "max_model_len overrides the config": (_set((3, "max_model_len"), 10**6), "max_model_len"),
    "a table names a foreign block": (
        _set((1, "groups", 0, "req_to_blocks", "1", 0), 99),
        "req_to_blocks['1'][0]",
    ),
    "a cached block id out of range": (_set((0, "cache_entries", 0), 10**6), "cache_entries"),
    "an event of the wrong shape": (
        _set((3, "events", 0, 0), PrefixCacheStats()),
        "events[0]",
    ),
    "unknown section key": (_set((3, "surprise"), 1), "extras"),
    "fewer blocks than the config": (_set((0, "num_blocks"), 3), "block_pool.num_blocks"),
}

ENCODINGS: dict[str, tuple[bytes, str]] = {
    "non-digit integer": (_blob(b"J", b"12a"), "extras.failed_plans"),
    "5,000-digit integer": (_blob(b"J", b"9" * 5000), "extras.failed_plans"),
    "invalid UTF-8": (_blob(b"S", b"\xff\xfe"), "extras.failed_plans"),
    "unknown enum value": (
        _blob(b"E", b"RequestStatus") + b"I" + struct.pack("<q", 99),
        "extras.failed_plans",
    ),
    "unknown enum": (_blob(b"E", b"os.system") + b"N", "extras.failed_plans"),
    "unknown class": (_blob(b"C", b"Popen") + b"M" + struct.pack("<Q", 0), "extras.failed_plans"),
    "a list as a key": (
        b"M" + struct.pack("<Q", 1) + b"L" + struct.pack("<Q", 0) + b"N",
        "extras.failed_plans",
    ),
    "200k-deep nesting": (
        (b"L" + struct.pack("<Q", 1)) * 200_000 + b"N",
        "extras.failed_plans[0]",
    ),
    "7-byte array": (_blob(b"A", b"\x01" * 7), "extras.failed_plans"),
    "a count beyond the data": (b"L" + struct.pack("<Q", 2**62), "extras.failed_plans"),
    "unknown tag": (b"Z", "extras.failed_plans"),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_content_is_refused_naming_where(name: str) -> None:
    edit, where = FORGERIES[name]
    with pytest.raises(InvalidArgumentError) as caught:
        decode_pool(_forged(edit), "p", FULL)
    assert caught.value.field == "data"
    assert where in str(caught.value), str(caught.value)


@pytest.mark.parametrize("name", sorted(ENCODINGS))
def test_damaged_encodings_are_refused_naming_where(name: str) -> None:
    raw, where = ENCODINGS[name]
    with pytest.raises(InvalidArgumentError) as caught:
        decode_pool(_spliced(raw), "p", FULL)
    assert caught.value.field == "data"
    assert where in str(caught.value), str(caught.value)


def test_an_unchanged_round_trip_of_the_sections_is_accepted() -> None:
    pool = _busy_pool()
    restored = decode_pool(_forged(lambda sections: None, pool), "p", FULL)
    assert restored.state_fingerprint() == pool.state_fingerprint()
    assert list(pool_violations(restored)) == []


def test_a_pool_planned_by_its_workers_is_rebuilt_from_its_registrations() -> None:
    """A checkpoint of a pool its workers planned (no explicit layout) restores it: the
    snapshot carries each rank's registration and decoding plans the pool again."""
    options = PoolConfig(max_model_len=256, world_size=2, enable_kv_cache_events=True)
    pool = Pool("w", options)
    specs = {"full": _SPEC, "window": _WINDOW}
    for rank in (0, 1):
        pool.register_worker(rank, 2, specs, 1 << 22)
    pool.run_step(_build(pool, [("add", 1, 40, True), ("alloc", 1, 40, 0)]))
    pool.publish_events(1.0)
    restored = decode_pool(encode_pool(pool), "w", options)
    assert restored.state_fingerprint() == pool.state_fingerprint()
    assert restored.rank_config(1) == pool.rank_config(1)

    def other_spec(sections: list[Any]) -> None:
        sections[3]["registrations"][1][2][0][1] = dataclasses.replace(_SPEC, block_size=32)

    with pytest.raises(InvalidArgumentError, match=r"extras.registrations\[1\]"):
        decode_pool(_forged(other_spec, pool), "w", options)
    with pytest.raises(InvalidArgumentError, match="do not plan the pool"):
        decode_pool(_forged(_set((3, "registrations"), []), pool), "w", options)
