"""RpcStats (fixed buckets, per-method histograms, per-(method, code) counts, snapshots) and
the event-loop lag monitor."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time

import pytest

from kvcm.server.telemetry import (
    DEFAULT_LATENCY_BUCKETS_SECONDS,
    LoopLagMonitor,
    LoopLagSnapshot,
    RpcStats,
)


def test_observations_land_in_le_buckets_and_accumulate() -> None:
    stats = RpcStats(buckets=(0.001, 0.01, 0.1))
    stats.observe("Step", "OK", 0.0005)
    stats.observe("Step", "OK", 0.001)  # equal to a bound: that bound's bucket
    stats.observe("Step", "OK", 0.05)
    stats.observe("Step", "INVALID_ARGUMENT", 3.0)  # above every bound: +Inf only
    stats.observe("Lookup", "OK", 0.002)

    snap = stats.snapshot()
    assert [m.method for m in snap.latencies] == ["Lookup", "Step"]
    step = snap.latencies[1]
    assert step.upper_bounds == (0.001, 0.01, 0.1)
    assert step.cumulative_counts == (2, 2, 3, 4)
    assert step.count == 4
    assert math.isclose(step.sum_seconds, 0.0005 + 0.001 + 0.05 + 3.0)
    assert snap.latencies[0].cumulative_counts == (0, 1, 1, 1)
    assert snap.requests == (
        ("Lookup", "OK", 1),
        ("Step", "INVALID_ARGUMENT", 1),
        ("Step", "OK", 3),
    )


def test_snapshot_is_a_copy() -> None:
    stats = RpcStats()
    stats.observe("Free", "OK", 0.0001)
    before = stats.snapshot()
    stats.observe("Free", "OK", 0.0001)
    assert before.latencies[0].count == 1
    assert before.requests == (("Free", "OK", 1),)
    assert stats.snapshot().requests == (("Free", "OK", 2),)


def test_negative_durations_count_as_zero() -> None:
    stats = RpcStats(buckets=(1.0,))
    stats.observe("Step", "OK", -1.0)
    latency = stats.snapshot().latencies[0]
    assert latency.cumulative_counts == (1, 1)
    assert latency.sum_seconds == 0.0


def test_empty_stats_snapshot() -> None:
    snap = RpcStats().snapshot()
    assert snap.latencies == ()
    assert snap.requests == ()
    assert RpcStats().buckets == DEFAULT_LATENCY_BUCKETS_SECONDS


@pytest.mark.parametrize(
    "buckets", [(), (0.1, 0.1), (0.2, 0.1), (0.0, 1.0), (float("inf"),), (float("nan"),)]
)
def test_bad_buckets_are_rejected(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="buckets"):
        RpcStats(buckets=buckets)


def test_telemetry_imports_no_metrics_library() -> None:
    # The RPC path records into RpcStats; prometheus_client is only for the scrape side.
    code = (
        "import sys, kvcm.server.telemetry\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('prometheus_client', 'fastapi', 'starlette', 'grpc')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------- loop lag


def test_loop_lag_monitor_sees_a_loop_held_by_a_blocking_call() -> None:
    async def run() -> LoopLagSnapshot:
        monitor = LoopLagMonitor(interval_s=0.01)
        monitor.start(asyncio.get_running_loop())
        monitor.start(asyncio.get_running_loop())  # a second start does nothing
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # holds the loop: the next tick runs ~0.2 s late
        await asyncio.sleep(0.03)
        monitor.stop()
        return monitor.snapshot()

    snapshot = asyncio.run(run())
    assert snapshot.count >= 3
    assert snapshot.cumulative_counts[-1] == snapshot.count
    assert snapshot.sum_seconds >= 0.15
    # At least one tick landed above 100 ms.
    at_or_below_100ms = snapshot.cumulative_counts[snapshot.upper_bounds.index(0.1)]
    assert at_or_below_100ms < snapshot.count


def test_loop_lag_monitor_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LoopLagMonitor(interval_s=0)
    with pytest.raises(ValueError, match="ascending"):
        LoopLagMonitor(buckets=(0.1, 0.01))
