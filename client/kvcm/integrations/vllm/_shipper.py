"""Shipping the mirror's Step programs to the kvcm server, off the scheduler's critical path.

:class:`GrpcStepShipper` is the :class:`~kvcm.integrations.vllm._sinks.StepSink` of mirror
mode with a server address (``synchronous``: of remote mode). ``submit`` only appends the
closed step to a bounded backlog; one background thread sends the steps in order, one Step
RPC each (``step_seq`` makes a retry after a lost reply run once), and compares every answer
with what the mirror answered. So the scheduler never waits for kvcm: a slow or unreachable
server only grows the backlog.

The server's copy is repaired from the mirror whenever it cannot be trusted: the pool is gone
(deleted by an operator, or a server restarted without a data directory), a Step is refused or
answered differently (a divergence), the server is at another ``step_seq``, or the backlog
outgrew its bound while the server was unreachable (then it is dropped, not shipped). The
shipper asks for a snapshot of the mirror at the next step boundary (``wants_snapshot``; the
scheduler thread answers with :meth:`submit_snapshot`), uploads it with ``ResyncPool``, and
ships the steps recorded after it. While the server cannot be reached, no snapshot is asked
for (taking one costs the scheduler thread a copy of the pool): the shipper probes the server
with backoff and asks for one once it answers.

A server that falls behind is caught up by **coalescing**: Step calls are at least
:data:`COALESCE_WINDOW_S` apart, and every Step RPC carries all the steps queued when it is
sent (up to :data:`MAX_COALESCED_OPS` ops and
:data:`MAX_COALESCED_TOKENS` tokens), concatenated into one program whose ``num_steps`` tells
the server which steps it covers; the answers are verified as one. So the shipper's
throughput grows with the backlog, and the lag stays bounded while the engine steps faster
than one round trip. Every Step also reports the newest step the scheduler closed and the
shipped step's age, which the server exports as the pool's step progress. The engine side's
view is :meth:`GrpcStepShipper.lag` (logged when the oldest unshipped step gets old), also
exported as Prometheus metrics of the engine process (:mod:`kvcm.integrations.vllm._metrics`).

The shipping thread shares the interpreter lock with the engine's, so whatever it runs while
the engine is inside the scheduler lengthens that turn. With :class:`EngineTurns` (the kvcm
schedulers mark every ``schedule()`` and ``update_from_output()``) it starts each unit of work
(building a batch, a Step call) right after the engine leaves one of those calls and gives
the lock up, as a GPU engine does to wait for its model, so that the unit runs in that wait
and not in the engine's next call; otherwise it parks until the engine leaves its next call.
An idle engine (no call for :data:`IDLE_S`) does not hold it back; past :data:`MAX_DEFER_S`
(the oldest unshipped step's age) it ships anyway, so the lag stays bounded for an engine
that never waits.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kvcm.client import (
    CallCancelledError,
    DeadlineExceededError,
    PermissionDeniedError,
    SchedulerClient,
    ServiceError,
    ServiceFailedPreconditionError,
    ServiceNotFoundError,
    TlsConfig,
    UnavailableError,
    UnimplementedError,
)
from kvcm.core.program import StepOutcome, StepProgram
from kvcm.integrations.vllm import _metrics

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvcm.core.pool_types import PoolConfig
    from kvcm.integrations.vllm._recorder import RecordedStep

__all__ = [
    "COALESCE_WINDOW_S",
    "FRESH_S",
    "IDLE_S",
    "MAX_DEFER_S",
    "EngineTurns",
    "MAX_COALESCED_OPS",
    "MAX_COALESCED_TOKENS",
    "GrpcStepShipper",
    "ShipperStats",
    "ShippingLag",
    "coalesce",
]

_LOG = logging.getLogger("kvcm.integrations.vllm")

# Failures that say nothing about the pool's state: the same call is repeated after a backoff
# (a Step's step_seq makes a repeat run once). Credentials and versions are an operator's to
# fix; the engine keeps scheduling meanwhile.
_TRANSIENT = (
    UnavailableError,
    DeadlineExceededError,
    CallCancelledError,
    PermissionDeniedError,
    UnimplementedError,
)
# Backoff between attempts while the server is unreachable, in seconds.
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
COALESCE_WINDOW_S: Final = 0.005
"""The least time between two Step calls: a step closed sooner after the last call waits for
the rest of it, and one call then carries every step closed meanwhile. An engine stepping
slower than this ships each step at once; a faster one pays one call (~0.5 ms of the
process's CPU with gRPC's Python client) per window instead of per step, and its lag grows by
at most this much."""
FRESH_S: Final = 0.002
"""How soon after the engine leaves a scheduler call the shipping thread starts a unit of
work (see :class:`EngineTurns`); later, it waits for the next one."""
IDLE_S: Final = 0.02
"""An engine out of the scheduler this long is idle (no request to step): the shipping thread
works without waiting for its next call."""
MAX_DEFER_S: Final = 0.1
"""The longest the shipping thread waits for the engine to leave the scheduler before it
starts a unit of work anyway (the oldest unshipped step's age): an engine that never waits
for anything still has its steps shipped, at most this much later."""
# A backlog this long is sent without waiting for the window.
_FULL_BATCH_STEPS = 64
MAX_COALESCED_OPS: Final = 4096
"""Most ops one coalesced Step carries (half the server's default ``max_step_ops``)."""
MAX_COALESCED_TOKENS: Final = 32 * 1024
"""Most token ids one coalesced Step carries (a quarter of ``max_step_tokens``)."""
# The lag is logged when the oldest unshipped step is this old, at most once per interval.
_LAG_WARN_S = 2.0
_LAG_LOG_INTERVAL_S = 30.0
# Per-step lags kept for lag() percentiles.
_LAG_SAMPLES = 4096


@dataclass(slots=True)
class ShipperStats:
    """What the shipper did so far (read them from any thread; each is one int).

    Attributes:
        steps_submitted: Steps the scheduler closed.
        steps_shipped: Steps the server ran (each once).
        steps_verified: Shipped steps whose answers equal the mirror's.
        mismatches: Shipped steps answered differently (each starts a resync).
        resyncs: Snapshots of the mirror uploaded.
        steps_dropped: Steps never shipped because a snapshot covers them.
        backlog_overflows: Times the backlog outgrew ``max_backlog`` and was dropped.
        rpcs: Calls made: DescribePool and CreatePool when attaching, Step, ResyncPool
            (repeats after a failure included).
        retries: Calls repeated after UNAVAILABLE or a deadline.
        snapshot_bytes: Snapshot bytes uploaded.
        backlog_high_water: The largest backlog seen.
        step_rpcs: Step calls that the server answered (one per coalesced batch).
        max_steps_per_rpc: The most steps one Step call carried.
        probes: Calls made only to learn whether an unreachable server answers again.
    """

    steps_submitted: int = 0
    steps_shipped: int = 0
    steps_verified: int = 0
    mismatches: int = 0
    resyncs: int = 0
    steps_dropped: int = 0
    backlog_overflows: int = 0
    rpcs: int = 0
    retries: int = 0
    snapshot_bytes: int = 0
    backlog_high_water: int = 0
    step_rpcs: int = 0
    max_steps_per_rpc: int = 0
    probes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ShippingLag:
    """How far the server's copy is behind the mirror, as the shipper sees it now.

    Attributes:
        backlog_steps: Closed steps the server has not acknowledged (in flight included).
        oldest_unshipped_age_s: Seconds since the oldest of them was closed (0: none).
        last_closed_step_seq: The newest step the scheduler closed.
        last_acked_step_seq: The newest step the server acknowledged (or a resync covered).
        lag_p50_s: Median, over the last acknowledged steps, of close-to-acknowledgement time.
        lag_p99_s: Their 99th percentile.
        reachable: Whether the last call reached the server.
    """

    backlog_steps: int
    oldest_unshipped_age_s: float
    last_closed_step_seq: int
    last_acked_step_seq: int
    lag_p50_s: float
    lag_p99_s: float
    reachable: bool


class EngineTurns:
    """Whether the engine's thread is waiting between scheduler calls now, for the shipping
    thread.

    The scheduler calls :meth:`enter` when ``schedule()`` or ``update_from_output()`` starts
    and :meth:`leave` when it returns (a flag write, and a clock read on leaving; ``leave``
    also releases a parked shipping thread). The shipping thread calls :meth:`wait_between`
    before a unit of work: it returns at once if the engine left its last call at most
    :data:`FRESH_S` ago and has not entered another, and otherwise parks (the interpreter lock
    released, no polling) until the engine leaves its next call, ``ring`` is called, or the
    timeout passes. Waking up within ``FRESH_S`` of a leave means the engine gave the lock up
    right after leaving, as it does when it waits for its model: the unit then runs at the
    start of that wait, not at its end, where the engine's next call would wait for the lock.

    Attributes:
        busy: The engine's thread is inside ``schedule()`` or ``update_from_output()``.
        left_at: ``time.perf_counter()`` when it last left one (0.0: never).
    """

    __slots__ = ("_bell", "_parked", "busy", "left_at")

    def __init__(self) -> None:
        self.busy = False
        self.left_at = 0.0
        self._parked = False
        # Held while nobody rang: the parked thread blocks acquiring it, leave() releases it.
        self._bell = threading.Lock()
        self._bell.acquire()

    def enter(self) -> None:
        """The engine's thread starts a scheduler call (engine thread)."""
        self.busy = True

    def leave(self) -> None:
        """The engine's thread returned from its scheduler call (engine thread)."""
        self.busy = False
        self.left_at = time.perf_counter()
        if self._parked:
            self.ring()

    def ring(self) -> None:
        """Release a parked shipping thread now (any thread: flush, close)."""
        self._parked = False
        with contextlib.suppress(RuntimeError):  # already released: nobody parked since
            self._bell.release()

    def fresh(self) -> bool:
        """The engine left its last call at most :data:`FRESH_S` ago and is still out."""
        return not self.busy and time.perf_counter() - self.left_at <= FRESH_S

    def idle(self, idle_s: float) -> bool:
        """The engine has been out of the scheduler for ``idle_s`` or longer."""
        return not self.busy and time.perf_counter() - self.left_at >= idle_s

    def wait_between(self, timeout_s: float) -> bool:
        """Shipping thread: wait up to ``timeout_s`` for a moment right after the engine
        leaves a scheduler call; whether it is one (``False``: the timeout passed, ``ring``
        was called, or the engine was busy again when this thread got the lock)."""
        bell = self._bell
        bell.acquire(blocking=False)  # forget a ring nobody waited for
        self._parked = True
        if self.fresh():
            self._parked = False
            return True
        if timeout_s > 0:
            bell.acquire(timeout=timeout_s)
        self._parked = False
        return self.fresh()


def coalesce(steps: list[RecordedStep]) -> tuple[StepProgram, StepOutcome]:
    """One program (and the mirror's answers) for consecutive steps, concatenated.

    The steps must be consecutive, recorded with ``continue_on_does_not_fit`` and no token
    budget (a recorder's steps are): run as one, the ops do exactly what they do one step at
    a time. The program carries the last step's ``step_seq`` and ``num_steps``.
    """
    program = StepProgram(continue_on_does_not_fit=True)
    expected = StepOutcome()
    hashes: list[bytes] = []
    host_hashes: list[bytes] = []
    for step in steps:
        part = step.program
        answers = step.expected
        offset = len(program.alloc_num_new_tokens)
        program.ops += part.ops
        program.request_keys += part.request_keys
        program.new_requests += part.new_requests
        program.alloc_num_new_tokens += part.alloc_num_new_tokens
        program.alloc_num_computed_tokens += part.alloc_num_computed_tokens
        for index, options in part.alloc_options.items():
            program.alloc_options[offset + index] = options
        program.append_num_tokens += part.append_num_tokens
        program.append_token_ids += part.append_token_ids
        program.append_num_block_hashes += part.append_num_block_hashes
        hashes.append(part.append_block_hashes)
        program.cache_num_computed_tokens += part.cache_num_computed_tokens
        program.remove_skipped_total_computed_tokens += part.remove_skipped_total_computed_tokens
        program.evict_num_block_ids += part.evict_num_block_ids
        program.evict_block_ids += part.evict_block_ids
        program.record_hit_tokens += part.record_hit_tokens
        program.extend_prompt_num_tokens += part.extend_prompt_num_tokens
        program.report_hit_num_groups += part.report_hit_num_groups
        program.report_hit_num_blocks += part.report_hit_num_blocks
        program.host_sync_actions += part.host_sync_actions
        program.host_sync_num_keys += part.host_sync_num_keys
        program.host_sync_group_ids += part.host_sync_group_ids
        host_hashes.append(part.host_sync_keys)
        expected.alloc_statuses += answers.alloc_statuses
        expected.alloc_num_block_ids += answers.alloc_num_block_ids
        expected.alloc_block_ids += answers.alloc_block_ids
        expected.reset += answers.reset
        # Drains stay in step order, each with its own count: the copies split per step.
        expected.drained_copy_block_ids += answers.drained_copy_block_ids
        expected.drained_num_copies += answers.drained_num_copies
    program.append_block_hashes = b"".join(hashes)
    program.host_sync_keys = b"".join(host_hashes)
    program.step_seq = steps[-1].program.step_seq
    program.num_steps = len(steps)
    expected.num_ops_executed = len(program.ops)
    expected.step_seq = program.step_seq
    return program, expected


def _coalescible(step: RecordedStep) -> bool:
    program = step.program
    return (
        program.continue_on_does_not_fit
        and program.token_budget is None
        and program.default_num_lookahead_tokens == 0
        and program.step_seq is not None
        and program.num_steps == 1
    )


def _num_tokens(program: StepProgram) -> int:
    return len(program.append_token_ids) + sum(
        len(new.prompt_token_ids) for new in program.new_requests
    )


def outcomes_agree(expected: StepOutcome, actual: StepOutcome) -> bool:
    """Whether the server answered a step as the mirror did (the verified fields)."""
    return (
        actual.num_ops_executed == expected.num_ops_executed
        and actual.alloc_statuses == expected.alloc_statuses
        and actual.alloc_num_block_ids == expected.alloc_num_block_ids
        and actual.alloc_block_ids == expected.alloc_block_ids
        and actual.reset == expected.reset
        and actual.drained_num_copies == expected.drained_num_copies
        and actual.drained_copy_block_ids == expected.drained_copy_block_ids
    )


class GrpcStepShipper:
    """Ships closed steps to the server in order from one background thread.

    Attributes:
        pool_id: The pool on the server.
        stats: Counters (see :class:`ShipperStats`).
        acknowledges_each_answer: ``synchronous`` (remote mode): ``submit`` returns once the
            server acknowledged the step, so the mirror closes one after each allocation.
    """

    def __init__(
        self,
        *,
        address: str,
        pool_id: str,
        pool_config: Callable[[], PoolConfig],
        step_timeout_s: float = 10.0,
        max_backlog: int = 4096,
        client: SchedulerClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        synchronous: bool = False,
        snapshot_source: Callable[[], tuple[int, bytes]] | None = None,
        lease_s: float = 0.0,
        tls: TlsConfig | None = None,
        token: str | None = None,
        coalesce_window_s: float = COALESCE_WINDOW_S,
        max_defer_s: float = MAX_DEFER_S,
    ) -> None:
        """Connect lazily and start the shipping thread (none when ``synchronous``).

        Args:
            address: The kvcm server (``host:port``).
            pool_id: The pool the engine owns there (created when missing).
            pool_config: How to create it (the mirror's layout and settings; asked for when
                the pool is first needed, once the engine has set its NONE_HASH).
            step_timeout_s: Deadline of one call.
            max_backlog: Steps kept while the server lags; beyond it they are dropped and the
                server is repaired from a snapshot instead.
            client: The SDK client to use (``None``: one for ``address``, owned and closed).
            clock: Monotonic clock (tests).
            synchronous: Remote mode: ``submit`` ships the step itself and returns once the
                server acknowledged it (retrying for up to ``step_timeout_s``, then raising
                :class:`~kvcm.client.UnavailableError`); a repair takes its snapshot from
                ``snapshot_source`` at once.
            snapshot_source: The mirror's ``(step_seq, snapshot)`` now (synchronous mode).
            lease_s: The pool's scheduler lease; while idle the shipper renews it with
                KeepAlive every third of it (0: no lease, no keepalives).
            tls: TLS for the channel (``None``: plaintext).
            token: Bearer token sent with every call.
            coalesce_window_s: The least time between two Step calls (0: none); see
                :data:`COALESCE_WINDOW_S`.
            max_defer_s: How long a unit of work waits for the engine to leave the scheduler
                (see :attr:`turns`); see :data:`MAX_DEFER_S`.
        """
        self.pool_id = pool_id
        self.stats = ShipperStats()
        self._config_source = pool_config
        self._config: PoolConfig | None = None
        self._timeout_s = step_timeout_s
        self._max_backlog = max_backlog
        self._owns_client = client is None
        self._client = (
            client if client is not None else SchedulerClient(address, tls=tls, token=token)
        )
        self._clock = clock
        self._backlog: collections.deque[RecordedStep] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False  # a call is in flight or a step is being verified
        self._idle = False  # the shipping thread waits for a step (submit() must wake it)
        self._attached = False
        self._need_snapshot = False
        self._snapshot: tuple[int, bytes] | None = None
        self._last_error = ""
        self._synchronous = synchronous
        self.acknowledges_each_answer = synchronous
        # An idle engine renews its pool's scheduler lease a few times per lease.
        self._keepalive_s = lease_s / 3 if lease_s > 0 else None
        self._last_call = clock()
        self._snapshot_source = snapshot_source
        # The batch sent and not yet acknowledged: a retry sends exactly it again.
        self._inflight: tuple[list[RecordedStep], StepProgram, StepOutcome] | None = None
        self._reachable = True
        self._last_closed_seq = 0
        self._last_acked_seq = 0
        self._lags: collections.deque[float] = collections.deque(maxlen=_LAG_SAMPLES)
        self._lag_logged_at = -_LAG_LOG_INTERVAL_S
        self._lag_warned = False
        self._window_s = coalesce_window_s
        self._last_send = -coalesce_window_s
        self._hurry = False  # flush(): send what is queued without waiting for the window
        self._max_defer_s = max_defer_s
        self.turns = EngineTurns()
        """The engine's scheduler calls: the shipping thread works between them (the kvcm
        schedulers mark them; unmarked, the engine always counts as between them)."""
        self._thread: threading.Thread | None = None
        if not synchronous:
            self._thread = threading.Thread(target=self._run, name="kvcm-step-shipper", daemon=True)
            self._thread.start()
        _metrics.track(self)  # exported by the engine process's /metrics

    # ------------------------------------------------------------------ scheduler thread
    def submit(self, step: RecordedStep) -> None:
        """Queue one closed step (mirror mode: never blocks on the server).

        Raises:
            UnavailableError: Synchronous mode only: the server did not acknowledge the step
                within ``step_timeout_s``.
        """
        if step.step_seq is not None:
            self._last_closed_seq = step.step_seq
        if self._synchronous:
            self._backlog.append(step)
            self.stats.steps_submitted += 1
            self._ship_now()
            return
        with self._cond:
            self.stats.steps_submitted += 1
            backlog = self._backlog
            backlog.append(step)
            if len(backlog) > self._max_backlog:
                self.stats.backlog_overflows += 1
                self.stats.steps_dropped += len(backlog)
                backlog.clear()
                self._need_snapshot = True
                self._snapshot = None  # a pending one is older than the dropped steps
            self.stats.backlog_high_water = max(self.stats.backlog_high_water, len(backlog))
            # Wake the shipping thread only when it waits for work or a full batch is queued:
            # inside the coalescing window, or with a call in flight, it looks at the backlog
            # on its own; a wake-up per step would take the interpreter lock from the engine
            # once per step for nothing.
            if self._idle or len(backlog) == _FULL_BATCH_STEPS:
                self._cond.notify_all()

    @property
    def wants_snapshot(self) -> bool:
        """Whether the shipper needs a snapshot of the mirror (taken at a step boundary).

        Not while the server is unreachable: the snapshot would only wait, and taking one
        costs the scheduler thread a copy of the pool.
        """
        return self._need_snapshot and self._snapshot is None and self._reachable

    def submit_snapshot(self, step_seq: int, data: bytes) -> None:
        """Hand over a snapshot of the mirror after step ``step_seq`` was closed."""
        with self._cond:
            self._snapshot = (step_seq, data)
            self._cond.notify()

    def resync_from(self, step_seq: int, data: bytes) -> None:
        """Repair the server's copy from this snapshot (after step ``step_seq``) before
        anything else: the steps queued up to it are dropped, a call in flight is not
        repeated. For a shipper that learns of a snapshot unasked (the shipper process)."""
        with self._cond:
            self._need_snapshot = True
            self._inflight = None
            self._snapshot = (step_seq, data)
            self._last_closed_seq = max(self._last_closed_seq, step_seq)
            self._cond.notify_all()

    def lag(self) -> ShippingLag:
        """How far the server's copy is behind the mirror now (any thread)."""
        with self._cond:
            backlog = self._backlog
            oldest = backlog[0].closed_at if backlog else 0.0
            num_steps = len(backlog)
            lags = sorted(self._lags)
        if self._need_snapshot:
            num_steps = max(num_steps, self._last_closed_seq - self._last_acked_seq)
        return ShippingLag(
            backlog_steps=num_steps,
            oldest_unshipped_age_s=max(0.0, self._clock() - oldest) if oldest else 0.0,
            last_closed_step_seq=self._last_closed_seq,
            last_acked_step_seq=self._last_acked_seq,
            lag_p50_s=lags[len(lags) // 2] if lags else 0.0,
            lag_p99_s=lags[min(len(lags) - 1, (99 * len(lags)) // 100)] if lags else 0.0,
            reachable=self._reachable,
        )

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted step was shipped (or dropped); ``False`` on timeout."""
        deadline = self._clock() + timeout_s
        with self._cond:
            self._hurry = True
            self._cond.notify_all()
            self.turns.ring()
            try:
                while self._backlog or self._busy or self._need_snapshot:
                    left = deadline - self._clock()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.05))
            finally:
                self._hurry = False
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Ship what is pending (up to ``timeout_s``), then stop the thread.

        A snapshot the shipper waits for is not taken here: call the mirror's ``flush``
        first (``shutdown()`` does).
        """
        if self._thread is None:
            if self._owns_client:
                self._client.close()
            _metrics.untrack(self)
            return
        if not self.flush(timeout_s):
            _LOG.warning(
                "kvcm: %d steps for pool %r were not shipped at shutdown (%s)",
                len(self._backlog),
                self.pool_id,
                self._last_error or "the server did not answer in time",
            )
        with self._cond:
            self._closing = True
            self._cond.notify()
        self.turns.ring()
        self._thread.join(timeout=timeout_s)
        if self._owns_client:
            self._client.close()
        _metrics.untrack(self)

    # ------------------------------------------------------------------ remote mode
    def _ship_now(self) -> None:
        deadline = self._clock() + self._timeout_s
        backoff = _BACKOFF_MIN_S
        while self._backlog or self._need_snapshot:
            if self._need_snapshot and self._snapshot is None:
                assert self._snapshot_source is not None
                seq, data = self._snapshot_source()
                self._snapshot = (seq, data)
            try:
                self._work()
            except _TRANSIENT as exc:
                self._note_error(exc)
                self.stats.retries += 1
                if self._clock() + backoff > deadline:
                    raise UnavailableError(
                        f"kvcm pool {self.pool_id!r}: the server did not acknowledge step "
                        f"{_seq(self._backlog[0]) if self._backlog else '?'} within "
                        f"{self._timeout_s} s: {exc}"
                    ) from exc
                time.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    # ------------------------------------------------------------------ shipping thread
    def _run(self) -> None:
        backoff = _BACKOFF_MIN_S
        while True:
            with self._cond:
                while not self._closing:
                    delay = self._delay()
                    if delay == 0.0:
                        break
                    if delay is not None:  # the coalescing window after the last call
                        self._cond.wait(delay)
                        continue
                    self._idle = True  # nothing to do: submit() wakes it
                    try:
                        woken = self._cond.wait(self._keepalive_s)
                    finally:
                        self._idle = False
                    if not woken and self._keepalive_due():
                        break
                if self._closing:
                    return
                self._busy = True
            try:
                self._work()
                backoff = _BACKOFF_MIN_S
                self._reachable = True
                if self._last_error:
                    _LOG.info("kvcm: pool %r: the server answers again", self.pool_id)
                    self._last_error = ""
            except _TRANSIENT as exc:
                if not self._last_error:
                    _LOG.warning("kvcm: pool %r: %s; retrying", self.pool_id, exc)
                self._reachable = False
                self._note_error(exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                self.stats.retries += 1
            except Exception as exc:  # the engine must keep scheduling whatever happens
                self._note_error(exc)
                _LOG.exception("kvcm: shipping to pool %r failed; repairing it", self.pool_id)
                self._want_snapshot()
                time.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                self._log_lag()

    def _log_lag(self) -> None:
        # One line when the oldest unshipped step gets old (then at most one per interval),
        # and one when the server caught up again.
        with self._cond:
            oldest = self._backlog[0].closed_at if self._backlog else 0.0
        now = self._clock()
        age = now - oldest if oldest else 0.0
        if age >= _LAG_WARN_S and now - self._lag_logged_at >= _LAG_LOG_INTERVAL_S:
            self._lag_logged_at = now
            self._lag_warned = True
            lag = self.lag()
            _LOG.warning(
                "kvcm: pool %r is %d steps (%.1f s) behind the engine%s",
                self.pool_id,
                lag.backlog_steps,
                age,
                "" if self._reachable else f" ({self._last_error})",
            )
        elif self._lag_warned and not oldest and not self._need_snapshot:
            self._lag_warned = False
            _LOG.info("kvcm: pool %r caught up with the engine", self.pool_id)

    def _keepalive_due(self) -> bool:
        return (
            self._keepalive_s is not None
            and self._attached
            and self._clock() - self._last_call >= self._keepalive_s
        )

    def _delay(self) -> float | None:
        # 0.0: work now; None: nothing to do; else seconds until the coalescing window after
        # the last Step call ends (the steps closed meanwhile go in the same call).
        if self._need_snapshot:
            # A snapshot to upload, or an unreachable server to probe until it answers.
            return 0.0 if self._snapshot is not None or not self._reachable else None
        backlog = self._backlog
        if not backlog:
            return None
        if self._hurry or self._inflight is not None or len(backlog) >= _FULL_BATCH_STEPS:
            return 0.0
        return max(0.0, self._last_send + self._window_s - self._clock())

    def _note_error(self, exc: BaseException) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}"

    def _want_snapshot(self) -> None:
        with self._cond:
            self._need_snapshot = True
            self._snapshot = None
            self._inflight = None

    def _work(self) -> None:
        self._last_call = self._clock()
        if not self._attached:
            self._attach()
        if not self._backlog and not self._need_snapshot:  # idle: renew the lease
            self.stats.rpcs += 1
            self._client.keep_alive(self.pool_id, timeout=self._timeout_s)
            return
        if self._need_snapshot:
            if self._snapshot is not None:
                self._resync()
            elif not self._reachable:  # the next step boundary takes one once it answers
                self._probe()
            return
        batch = self._inflight
        if batch is None:
            self._between_turns()
            batch = self._next_batch()
            self._inflight = batch
        else:  # a retry: its build's moment is long past
            self._between_turns()
        self._ship(batch)
        with self._cond:
            if self._inflight is batch:
                self._inflight = None
            shipped = set(map(id, batch[0]))
            backlog = self._backlog
            while backlog and id(backlog[0]) in shipped:
                backlog.popleft()
            if self._synchronous and self._snapshot_needed():
                # Remote mode repairs at once; the step is in the mirror's snapshot.
                backlog.clear()
        del batch
        self._collect_in_the_wait()

    def _collect_in_the_wait(self) -> None:
        # Shipping thread, after a unit of work: its notes and messages are garbage now. While
        # the engine still waits for its model (it left a scheduler call within FRESH_S and has
        # not entered another), collect the youngest generation once it is half-way to its
        # threshold, and the middle one with it when this collection would be the one that
        # triggers it: the collection an engine turn would trigger a few turns later (a decode
        # boundary's allocations cross the threshold) runs in the wait instead. Never the
        # oldest generation (its size is the engine's). Not in remote mode (the engine waits
        # for each answer), nor with the collector off.
        if self._synchronous or not gc.isenabled() or not self.turns.fresh():
            return
        threshold = gc.get_threshold()
        count = gc.get_count()
        if threshold[0] and count[0] * 2 >= threshold[0]:
            gc.collect(1 if count[1] + 1 >= threshold[1] else 0)

    def _between_turns(self) -> None:
        # Shipping thread, before a unit of work: start it right after the engine leaves a
        # scheduler call and gives up the interpreter lock (it waits for its model then: the
        # unit runs in that wait, not in the engine's next call), or once the engine is idle;
        # not later than the oldest unshipped step's deferral bound, and without waiting in
        # remote mode, a flush or a close.
        turns = self.turns
        while not (self._synchronous or self._hurry or self._closing):
            if turns.fresh() or turns.idle(IDLE_S):
                return
            with self._cond:
                oldest = self._backlog[0].closed_at if self._backlog else None
            if oldest is None:
                return
            left = oldest + self._max_defer_s - self._clock()
            if left <= 0 or turns.wait_between(min(left, IDLE_S)):
                return

    def _next_batch(self) -> tuple[list[RecordedStep], StepProgram, StepOutcome]:
        # Every queued step that fits in one coalesced Step (at least the first one).
        with self._cond:
            queued = list(self._backlog)
        first = queued[0]
        recorder = first.recorder
        built = (
            None
            if recorder is None
            else recorder.build_batch(
                queued, max_ops=MAX_COALESCED_OPS, max_tokens=MAX_COALESCED_TOKENS
            )
        )
        if built is not None:
            # The recorder wrote the steps straight into one program (none of their own).
            count, program, expected = built
            return self._stamped(queued[:count], program, expected)
        steps = [first]
        if len(queued) > 1 and _coalescible(first):
            num_ops = len(first.program.ops)
            num_tokens = _num_tokens(first.program)
            for step in queued[1:]:
                program = step.program
                num_ops += len(program.ops)
                num_tokens += _num_tokens(program)
                if (
                    num_ops > MAX_COALESCED_OPS
                    or num_tokens > MAX_COALESCED_TOKENS
                    or not _coalescible(step)
                    or program.step_seq != _seq(steps[-1]) + 1
                ):
                    break
                steps.append(step)
        if len(steps) == 1:
            program, expected = first.program, first.expected
        else:
            program, expected = coalesce(steps)
        return self._stamped(steps, program, expected)

    def _stamped(
        self, steps: list[RecordedStep], program: StepProgram, expected: StepOutcome
    ) -> tuple[list[RecordedStep], StepProgram, StepOutcome]:
        # The batch, its program telling the server how far the scheduler is.
        if program.step_seq is not None:
            program.scheduler_step_seq = max(self._last_closed_seq, program.step_seq)
            program.step_age_s = max(0.0, self._clock() - steps[-1].closed_at)
        return steps, program, expected

    def _snapshot_needed(self) -> bool:
        return self._need_snapshot  # read anew: the call just made may have set it

    def _pool_config(self) -> PoolConfig:
        if self._config is None:
            self._config = self._config_source()
        return self._config

    def _probe(self) -> None:
        # Whether the server answers again (then a snapshot repairs the pool).
        self.stats.rpcs += 1
        self.stats.probes += 1
        with contextlib.suppress(ServiceNotFoundError):  # it answers; a resync creates it
            self._client.describe_pool(self.pool_id, timeout=self._timeout_s)
        self._reachable = True

    def _attach(self) -> None:
        """Create the pool when missing; an existing one is repaired from the mirror."""
        client = self._client
        self.stats.rpcs += 1
        try:
            info = client.describe_pool(self.pool_id, timeout=self._timeout_s)
        except ServiceNotFoundError:
            if not self._need_snapshot:  # else the resync creates it
                client.create_pool(self.pool_id, self._pool_config(), timeout=self._timeout_s)
                self.stats.rpcs += 1
                _LOG.info("kvcm: created pool %r", self.pool_id)
        else:
            _LOG.info(
                "kvcm: pool %r exists (%d requests); replacing its state with this engine's",
                self.pool_id,
                info.num_requests,
            )
            self._want_snapshot()
        self._attached = True

    def _ship(self, batch: tuple[list[RecordedStep], StepProgram, StepOutcome]) -> None:
        steps, program, expected = batch
        self.stats.rpcs += 1
        self._last_send = self._clock()
        try:
            result = self._client.step(self.pool_id, program, timeout=self._timeout_s)
        except ServiceNotFoundError:
            _LOG.warning("kvcm: pool %r is gone on the server; re-creating it", self.pool_id)
            self._attached = False
            self._want_snapshot()
            return
        except ServiceFailedPreconditionError as exc:
            _LOG.warning("kvcm: pool %r is out of step (%s); resynchronising", self.pool_id, exc)
            self._want_snapshot()
            return
        except _TRANSIENT:
            raise
        except ServiceError as exc:
            self.stats.mismatches += len(steps)
            _LOG.error("kvcm: pool %r refused step %s: %s", self.pool_id, program.step_seq, exc)
            self._want_snapshot()
            return
        stats = self.stats
        stats.step_rpcs += 1
        stats.steps_shipped += len(steps)
        stats.max_steps_per_rpc = max(stats.max_steps_per_rpc, len(steps))
        now = self._clock()
        for step in steps:
            self._lags.append(now - step.closed_at)
        if program.step_seq is not None:
            self._last_acked_seq = program.step_seq
        if outcomes_agree(expected, result.outcome):
            stats.steps_verified += len(steps)
            return
        stats.mismatches += len(steps)
        _LOG.error(
            "kvcm: pool %r answered steps %s-%s differently from the mirror; resynchronising",
            self.pool_id,
            steps[0].step_seq,
            program.step_seq,
        )
        self._want_snapshot()

    def _resync(self) -> None:
        with self._cond:
            snapshot = self._snapshot
        assert snapshot is not None
        step_seq, data = snapshot
        self.stats.rpcs += 1
        self.stats.snapshot_bytes += len(data)
        self._client.resync_pool(
            self.pool_id, data, self._pool_config(), step_seq=step_seq, timeout=self._timeout_s
        )
        self.stats.resyncs += 1
        self._attached = True
        self._last_acked_seq = step_seq
        with self._cond:
            backlog = self._backlog
            while backlog and _seq(backlog[0]) <= step_seq:
                backlog.popleft()
                self.stats.steps_dropped += 1
            if self._snapshot is snapshot:  # else the backlog overflowed meanwhile: again
                self._need_snapshot = False
                self._snapshot = None
            self._inflight = None
        _LOG.info("kvcm: pool %r resynchronised from the mirror at step %d", self.pool_id, step_seq)


def _seq(step: Any) -> int:
    seq = step.step_seq
    assert isinstance(seq, int)
    return seq
