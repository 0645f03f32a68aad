"""A wire fuzzer: hostile clients against a real kvcm server on 127.0.0.1.

Hypothesis draws calls of every RPC of kvcm.v1 (AdminService, WorkerService, SchedulerService
with Step programs, EventService) through raw gRPC stubs, raw bytes and the SDK, and checks
each one (``_fuzz.harness.Harness.check``): never INTERNAL or UNKNOWN; a rejected call leaves
every pool byte-identical; an accepted call answers what the in-process core answers and
leaves the served pool in the core's state. A failure prints the minimal failing call.

CI runs a small budget. The long run (see tests/README.md): ``bash scripts/fuzz-long.sh``, or
``KVCM_FUZZ_EXAMPLES=100000`` for more examples; ``KVCM_FUZZ_COLLECT=1`` counts every
distinct failure instead of stopping at the first, and ``KVCM_FUZZ_REPORT=path`` writes the
counts as JSON.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import grpc
import pytest
from _fuzz.calls import draw_call, draw_garbage, warm_up_calls
from _fuzz.harness import Finding, FuzzStats, Harness
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm.client import InternalError, SchedulerClient, ServiceError
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

_EXAMPLES = int(os.environ.get("KVCM_FUZZ_EXAMPLES", "60"))
_CALLS_PER_EXAMPLE = int(os.environ.get("KVCM_FUZZ_CALLS", "12"))
_COLLECT = os.environ.get("KVCM_FUZZ_COLLECT", "") == "1"
_REPORT = os.environ.get("KVCM_FUZZ_REPORT", "")
_SETTINGS = settings(
    max_examples=_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

_STATS = FuzzStats()
_STARTED = time.monotonic()
# The long run writes its report every this many examples too, so a cut-short run has one.
_REPORT_EVERY = 50


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[EmbeddedServer]:
    """A server of the fuzzer's own (its pools are read directly, and it may be wrecked)."""
    settings_ = ServerSettings(
        grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", log_level="CRITICAL"
    )
    running = start_embedded_server(settings_)
    try:
        yield running
    finally:
        running.stop(grace_s=0.5)
        if _REPORT:
            _write_report(_REPORT)


@pytest.fixture(scope="module")
def harness(fuzz_server: EmbeddedServer) -> Iterator[Harness]:
    """The harness over one raw channel to the fuzz server."""
    with grpc.insecure_channel(fuzz_server.grpc_address) as channel:
        yield Harness(fuzz_server, channel, _STATS)


def _write_report(path: str) -> None:
    report = {
        "wall_s": round(time.monotonic() - _STARTED, 1),
        "examples": _STATS.examples,
        "calls": _STATS.calls,
        "rejections": _STATS.rejections,
        "state_changes_after_rejection": _STATS.state_changes_after_rejection,
        "internal_or_unknown": _STATS.internal_or_unknown,
        "reference_mismatches": _STATS.reference_mismatches,
        "codes": dict(sorted(_STATS.codes.items())),
        "distinct_failures": [str(finding) for finding in _STATS.findings.values()],
    }
    with open(path, "w", encoding="utf-8") as out:
        json.dump(report, out, indent=2)


def _example_done() -> None:
    _STATS.examples += 1
    if _REPORT and _STATS.examples % _REPORT_EVERY == 0:
        _write_report(_REPORT)


def _fail(findings: list[Finding]) -> None:
    for finding in findings:
        _STATS.add(finding)
    if findings and not _COLLECT:
        pytest.fail("\n".join(str(finding) for finding in findings), pytrace=False)


@_SETTINGS
@given(data=st.data())
def test_hostile_call_sequences(harness: Harness, data: st.DataObject) -> None:
    """Sequences of valid and hostile calls on a fresh pool: the three checks after each."""
    target = harness.new_target()
    try:
        warm_up = [
            call
            for key in range(data.draw(st.integers(0, 2), label="warm_requests"))
            for call in warm_up_calls(data, target, key)
        ]
        for call in warm_up:
            _fail(harness.check(call, target))
        for _ in range(data.draw(st.integers(1, _CALLS_PER_EXAMPLE), label="num_calls")):
            call = draw_call(data, target)
            findings = harness.check(call, target)
            _fail(findings)
            if any(finding.check != "status" for finding in findings):
                break  # the reference no longer follows the served pool
    finally:
        harness.drop_target(target)
        _example_done()


@_SETTINGS
@given(data=st.data())
def test_undecodable_bytes(harness: Harness, data: st.DataObject) -> None:
    """Bytes no request decodes from, on every method: never INTERNAL/UNKNOWN, no change."""
    target = harness.new_target()
    try:
        _fail(harness.check(draw_garbage(data, target), target))
    finally:
        harness.drop_target(target)
        _example_done()


@settings(max_examples=max(10, _EXAMPLES // 4), deadline=None)
@given(
    pool_id=st.one_of(
        st.sampled_from(["", "x" * 129, "p" * 20_000, "pööl", "\x00", "nope"]),
        st.text(max_size=40),
    ),
    method=st.sampled_from(["describe_pool", "get_usage", "take_new_block_ids", "delete_pool"]),
)
def test_sdk_hostile_pool_ids(fuzz_server: EmbeddedServer, pool_id: str, method: str) -> None:
    """The SDK with hostile pool ids: a precise ServiceError from the server, never
    InternalError, nor a client-side failure to read the answer (metadata size)."""
    with SchedulerClient(fuzz_server.grpc_address, timeout=10) as client:
        try:
            getattr(client, method)(pool_id)
        except InternalError as exc:
            finding = Finding(
                "status", f"SDK {method}(pool_id={pool_id[:80]!r})", exc.code.name, str(exc)[:500]
            )
            _fail([finding])
        except ServiceError as exc:
            if "metadata" in str(exc).lower():  # the client failed; the answer never came
                finding = Finding(
                    "status", f"SDK {method}(pool_id={pool_id[:80]!r})", exc.code.name, str(exc)
                )
                _fail([finding])
