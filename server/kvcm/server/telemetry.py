"""RPC statistics and event-loop lag, kept on the server's loop, read by the collector at scrape.

``RpcStats`` is plain Python with no metrics library behind it: the gRPC layer calls
:meth:`RpcStats.observe` once per finished RPC, and the HTTP side's collector turns a
:meth:`RpcStats.snapshot` into Prometheus families only when ``/metrics`` is scraped. An
observation costs one dict lookup per table, one bisection over the fixed bucket bounds and a
few integer additions; it allocates only the first time a method or a (method, code) pair is
seen, and both are bounded by the service's RPC list and the gRPC status codes.

:class:`LoopLagMonitor` is a timer on the server's loop that records how late it runs
(``kvcm_event_loop_lag_seconds``): what every RPC waits before the loop gets to it.

The server runs on one asyncio event loop and the collector runs on that same loop, so neither
side takes a lock: an observation and a snapshot never interleave.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcm.core.pool_types import StepProgress

__all__ = [
    "DEFAULT_LATENCY_BUCKETS_SECONDS",
    "DEFAULT_LOOP_LAG_BUCKETS_SECONDS",
    "LoopLagMonitor",
    "LoopLagSnapshot",
    "MethodLatency",
    "RpcStats",
    "RpcStatsSnapshot",
    "StepProgressBook",
]

# Upper bounds in seconds. A scheduler step on loopback takes tens to hundreds of microseconds,
# so the buckets start at 50 us; the top finite bucket still catches a slow worker registration.
DEFAULT_LATENCY_BUCKETS_SECONDS: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class MethodLatency:
    """The latency histogram of one RPC method, as Prometheus wants it.

    Attributes:
        method: the RPC method name (for example ``"Step"``).
        upper_bounds: the finite bucket bounds in seconds, ascending; ``+Inf`` is implied.
        cumulative_counts: observations at or below each bound, one entry per bound plus a
            last one for ``+Inf`` (equal to ``count``).
        count: the number of observations.
        sum_seconds: the sum of the observed durations.
    """

    method: str
    upper_bounds: tuple[float, ...]
    cumulative_counts: tuple[int, ...]
    count: int
    sum_seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcStatsSnapshot:
    """A consistent copy of everything :class:`RpcStats` has counted.

    Attributes:
        latencies: one histogram per method seen, sorted by method name.
        requests: finished RPCs per ``(method, code)``, sorted by key.
    """

    latencies: tuple[MethodLatency, ...]
    requests: tuple[tuple[str, str, int], ...]


class _Histogram:
    """Per-method bucket counts (not cumulative; the snapshot accumulates them)."""

    __slots__ = ("bucket_counts", "count", "sum_seconds")

    def __init__(self, num_buckets: int) -> None:
        # One slot per finite bound plus one for +Inf.
        self.bucket_counts = [0] * (num_buckets + 1)
        self.count = 0
        self.sum_seconds = 0.0


class RpcStats:
    """Counts finished RPCs and their latencies per method and status code.

    Args:
        buckets: the histogram's finite upper bounds in seconds, strictly ascending.

    Raises:
        ValueError: if ``buckets`` is empty, not strictly ascending, or holds a value that
            is not a finite positive number.
    """

    __slots__ = ("_bounds", "_histograms", "_requests")

    def __init__(self, buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS_SECONDS) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds:
            raise ValueError("buckets: at least one bucket bound is required")
        if any(not math.isfinite(b) or b <= 0.0 for b in bounds):
            raise ValueError(f"buckets: bounds must be finite and positive, got {bounds}")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"buckets: bounds must be strictly ascending, got {bounds}")
        self._bounds = bounds
        self._histograms: dict[str, _Histogram] = {}
        self._requests: dict[tuple[str, str], int] = {}

    @property
    def buckets(self) -> tuple[float, ...]:
        """The finite bucket upper bounds in seconds."""
        return self._bounds

    def observe(self, method: str, code: str, seconds: float) -> None:
        """Record one finished RPC.

        Args:
            method: the RPC method name, without the service prefix (``"Step"``).
            code: the gRPC status code name (``"OK"``, ``"NOT_FOUND"``, ...).
            seconds: the wall-clock duration of the call; negative values count as zero.
        """
        histogram = self._histograms.get(method)
        if histogram is None:
            histogram = self._histograms[method] = _Histogram(len(self._bounds))
        seconds = max(seconds, 0.0)
        # bisect_left puts a value equal to a bound into that bound's bucket (Prometheus "le").
        histogram.bucket_counts[bisect.bisect_left(self._bounds, seconds)] += 1
        histogram.count += 1
        histogram.sum_seconds += seconds
        key = (method, code)
        self._requests[key] = self._requests.get(key, 0) + 1

    def snapshot(self) -> RpcStatsSnapshot:
        """Copy the counters out, accumulating each histogram's buckets.

        Returns:
            The snapshot; later observations do not change it.
        """
        latencies = []
        for method in sorted(self._histograms):
            histogram = self._histograms[method]
            cumulative = []
            running = 0
            for n in histogram.bucket_counts:
                running += n
                cumulative.append(running)
            latencies.append(
                MethodLatency(
                    method=method,
                    upper_bounds=self._bounds,
                    cumulative_counts=tuple(cumulative),
                    count=histogram.count,
                    sum_seconds=histogram.sum_seconds,
                )
            )
        requests = tuple((method, code, n) for (method, code), n in sorted(self._requests.items()))
        return RpcStatsSnapshot(latencies=tuple(latencies), requests=requests)


# Upper bounds in seconds for the event loop's lag. A healthy loop runs a timer within a
# millisecond; a pool build or a long Step that holds the loop shows as tens to hundreds of ms.
DEFAULT_LOOP_LAG_BUCKETS_SECONDS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopLagSnapshot:
    """The event-loop lag histogram at one instant.

    Attributes:
        upper_bounds: the finite bucket bounds in seconds, ascending.
        cumulative_counts: observations at or below each bound, then one for ``+Inf``.
        count: the number of observations (timer ticks).
        sum_seconds: the summed lag.
    """

    upper_bounds: tuple[float, ...]
    cumulative_counts: tuple[int, ...]
    count: int
    sum_seconds: float


class LoopLagMonitor:
    """Measures how late the event loop runs a periodic timer (its lag), as a histogram.

    A timer is due every ``interval_s``; when it runs, the time past its due time is one
    observation. Anything that holds the loop (a long Step, a synchronous pool build, a busy
    scrape) delays every RPC by as much, and shows here first.

    Args:
        interval_s: seconds between ticks.
        buckets: the histogram's finite upper bounds in seconds, strictly ascending.
    """

    __slots__ = ("_bounds", "_due", "_handle", "_histogram", "_interval_s", "_loop")

    def __init__(
        self,
        interval_s: float = 0.1,
        buckets: Sequence[float] = DEFAULT_LOOP_LAG_BUCKETS_SECONDS,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        self._bounds = RpcStats(buckets).buckets  # the same validation
        self._histogram = _Histogram(len(self._bounds))
        self._interval_s = float(interval_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start ticking on ``loop`` (the server's); a second call does nothing."""
        if self._handle is not None:
            return
        self._loop = loop
        self._schedule(loop.time())

    def stop(self) -> None:
        """Stop ticking; the counts stay."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def observe(self, seconds: float) -> None:
        """Record one lag (negative values count as zero)."""
        seconds = max(seconds, 0.0)
        histogram = self._histogram
        histogram.bucket_counts[bisect.bisect_left(self._bounds, seconds)] += 1
        histogram.count += 1
        histogram.sum_seconds += seconds

    def snapshot(self) -> LoopLagSnapshot:
        """Copy the histogram out, buckets accumulated."""
        histogram = self._histogram
        return LoopLagSnapshot(
            upper_bounds=self._bounds,
            cumulative_counts=tuple(itertools.accumulate(histogram.bucket_counts)),
            count=histogram.count,
            sum_seconds=histogram.sum_seconds,
        )

    def _schedule(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self._interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self.observe(now - self._due)
        self._schedule(now)


# ------------------------------------------------------------------------- step progress
class StepProgressBook:
    """Each pool's step progress, noted by the Step handler on the loop.

    A note costs one small tuple; ages are computed when read (DescribePool, ``/metrics``,
    ``GET /v1/pools/{pool}``), on the server's monotonic clock.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        """An empty book; ``clock``: monotonic seconds (tests)."""
        self._clock = clock
        # pool id -> (step_seq, scheduler_step_seq, reported age, applied at)
        self._notes: dict[str, tuple[int, int, float, float]] = {}

    def note_step(
        self, pool_id: str, step_seq: int | None, scheduler_step_seq: int, step_age_s: float
    ) -> None:
        """A Step with ``step_seq`` was applied to ``pool_id`` (``None``: not sequenced)."""
        if step_seq is None:
            return
        age = step_age_s if math.isfinite(step_age_s) and step_age_s > 0 else 0.0
        self._notes[pool_id] = (step_seq, max(scheduler_step_seq, step_seq), age, self._clock())

    def forget(self, pool_id: str) -> None:
        """The pool is gone."""
        self._notes.pop(pool_id, None)

    def get(self, pool_id: str, last_step_seq: int) -> StepProgress | None:
        """The pool's progress now, or ``None`` when no sequenced Step was applied to it since
        the server started.

        Args:
            pool_id: The pool.
            last_step_seq: The pool's last applied step_seq now: a note of another one (the
                pool was resynchronised or re-created since) is not answered.
        """
        note = self._notes.get(pool_id)
        if note is None or note[0] != last_step_seq:
            return None
        step_seq, scheduler_step_seq, reported_age, applied_at = note
        since = max(0.0, self._clock() - applied_at)
        return StepProgress(
            last_step_seq=step_seq,
            last_step_age_s=reported_age + since,
            scheduler_step_seq=scheduler_step_seq,
            steps_behind=scheduler_step_seq - step_seq,
            since_applied_s=since,
        )

    def pool_ids(self) -> list[str]:
        """Pools with a note, sorted."""
        return sorted(self._notes)
