"""What the servicers share: the pool registry, per-pool wake-ups, created configs, stats."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import fnmatch
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from kvcm.common.errors import KVCMError
from kvcm.common.events import KVCacheEvent
from kvcm.core.limits import DEFAULT_LIMITS, Limits
from kvcm.core.pool import Pool, PoolRegistry
from kvcm.core.pool_types import ZmqEventStream
from kvcm.server.kv_events import KvEventNumbering, kv_events_topic
from kvcm.server.rpc._offloop import OFF_LOOP_STEP, OFF_LOOP_WORK, OffLoopWork
from kvcm.server.settings import DEFAULT_KV_EVENTS_TOPIC
from kvcm.server.telemetry import RpcStats, StepProgressBook
from kvcm.server.transfers import TransferBook
from kvcm.v1 import admin_pb2

if TYPE_CHECKING:
    from kvcm.server.journal import Journal
    from kvcm.server.kv_events import KvEventStream
    from kvcm.server.tracing import Tracing

__all__ = [
    "CALL_TIME",
    "PRINCIPAL",
    "AwakeClock",
    "EventHold",
    "PoolRuntime",
    "Principal",
    "ServerState",
    "may_hash",
]

CALL_TIME: ContextVar[float] = ContextVar("kvcm_call_time", default=0.0)
"""The time the current call stamps its events with (0: now); set by the journal."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who called (``kvcm.server.auth``): a token's name and its (role, pool glob) pairs."""

    name: str
    roles: tuple[tuple[str, str], ...]

    def has(self, role: str, pool_id: str) -> bool:
        """Whether ``role`` (or admin) covers ``pool_id``."""
        return any(
            (granted in (role, "admin")) and fnmatch.fnmatchcase(pool_id, glob)
            for granted, glob in self.roles
        )


PRINCIPAL: ContextVar[Principal | None] = ContextVar("kvcm_principal", default=None)
"""The authenticated caller of the current call (``None``: authentication is off)."""


def may_hash(pool_id: str) -> bool:
    """Whether the current caller may see ``pool_id``'s hash seed (always, without auth)."""
    principal = PRINCIPAL.get()
    return principal is None or principal.has("scheduler", pool_id)


T = TypeVar("T")


def _off_loop(work: Callable[[], T], context: OffLoopWork) -> T:
    with context:
        return work()


class AwakeClock:
    """Monotonic time during which the server was awake: leases count it, not stalls.

    A lease measures its holder's silence. When the server itself stalls (the process was
    paused or starved, or its event loop was blocked), its holders could not reach it, so
    the stall must not count against them. :meth:`now` is called at least every ``beat_s``
    (``LeaseMonitor`` beats it) and by every lease check: a gap between two calls longer than
    ``beat_s + tolerance_s`` is a stall, whose length beyond ``beat_s`` is added to
    :attr:`stalled_s` and reported to ``on_stall`` (which extends every lease deadline).

    Attributes:
        stalled_s: Stalls detected so far, in seconds.
        stalls: Stalls detected so far.
    """

    __slots__ = ("_beat_s", "_clock", "_last", "_max_gap_s", "on_stall", "stalled_s", "stalls")

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        beat_s: float = 0.1,
        tolerance_s: float = 0.05,
    ) -> None:
        """Read ``clock`` (monotonic seconds), expecting a call at least every ``beat_s``."""
        self._clock = clock
        self._beat_s = beat_s
        self._max_gap_s = beat_s + tolerance_s
        self._last = clock()
        self.stalled_s = 0.0
        self.stalls = 0
        self.on_stall: Callable[[float, float], None] | None = None

    @property
    def beat_s(self) -> float:
        """How often :meth:`now` is expected to be called, at the least."""
        return self._beat_s

    def now(self) -> float:
        """``clock()`` now, after accounting any stall since the previous call."""
        now = self._clock()
        gap = now - self._last
        self._last = now
        if gap > self._max_gap_s:
            stall = gap - self._beat_s
            self.stalled_s += stall
            self.stalls += 1
            if self.on_stall is not None:
                self.on_stall(stall, now)
        return now

    def awake(self) -> float:
        """Awake seconds so far (``now() - stalled_s``): differences are lease time."""
        now = self.now()
        return now - self.stalled_s


@dataclass(slots=True)
class PoolRuntime:
    """The asyncio side of one pool: who waits for it to be planned or for its events.

    Attributes:
        config: The ``PoolConfig`` the pool was created with (echoed by DescribePool).
        planned: Set once the pool is READY (or deleted, or the server stops); set and
            replaced when a registration round's plan fails.
        events: Set (and replaced) whenever events are published (or the pool is deleted).
        deleted: Whether the pool was deleted.
        round: Registration rounds ended by a failed plan so far (a waiting rank compares
            it with the round it joined).
        plan_failure: Why the last failed round failed (sent to every rank that waited).
        waiting: RegisterWorker calls waiting at the barrier, by rank.
        subscribers: Live SubscribeEvents streams of the pool (bounded by
            ``Limits.max_subscribers_per_pool``).
    """

    config: admin_pb2.PoolConfig
    planned: asyncio.Event = field(default_factory=asyncio.Event)
    events: asyncio.Event = field(default_factory=asyncio.Event)
    deleted: bool = False
    round: int = 0
    plan_failure: KVCMError | None = None
    waiting: dict[int, int] = field(default_factory=dict)
    subscribers: int = 0

    def fail_round(self, error: KVCMError) -> None:
        """End the current registration round with ``error``: every waiting rank gets it."""
        self.plan_failure = error
        self.round += 1
        self.planned.set()
        self.planned = asyncio.Event()

    def wake_subscribers(self) -> None:
        """Wake every subscriber waiting for events."""
        self.events.set()
        self.events = asyncio.Event()


@dataclass(slots=True)
class EventHold:
    """A pool whose KV events wait for its standby (a replicated ``sync`` pool,
    docs/replication.md): subscribers read, and the ZMQ wire carries, only the events of
    records the standby acknowledged, so a router never sees a batch the next primary may not
    have.

    Attributes:
        pool: The pool object held (``None``: the pool's first; a pool replaced under its
            id is held by a new hold from its first batch on).
        visible: The last event sequence released (subscribers read up to it).
        pending: ZMQ batches published by the core but not released yet, oldest first: (the
            pool's last event sequence once the batch was published, (batch sequence,
            events, timestamp)).
    """

    pool: Pool | None
    visible: int
    pending: collections.deque[tuple[int, tuple[int, list[KVCacheEvent], float]]] = field(
        default_factory=collections.deque
    )


@dataclass(slots=True)
class ServerState:
    """The state every servicer reads.

    Attributes:
        registry: The pools.
        rpc_stats: Per-method call counts and latencies (read by /metrics).
        runtimes: The asyncio side of each pool, by pool id.
        serving: Whether the gRPC side serves (False before start and while shutting down).
        limits: The service's hard limits (pending registrations, registration timeout).
        journal: The data directory's journal (``None``: in memory only).
        activity: When (``time.monotonic``) each pool's scheduler last called; moved later
            by every stall of the server (:class:`AwakeClock`), so a lease counts awake time.
        transfers: Requests allocated with ``delay_cache_blocks``, by (pool, key): when
            (moved later by stalls, as ``activity``), and the request object (a reused key
            is another request).
        clock: The awake clock every lease reads (beaten by ``LeaseMonitor``).
        transfer_lease_s: The transfer lease (0: transfers are not tracked).
        transfer_book: The TransferService's records (P/D handoffs with leases).
        subscriber_lease_s: How long an event stream may wait for its reader to accept one
            message before it is ended (0: forever).
        reclaims: Lease reclaims so far, by (pool id, lease kind).
        pd_routes: The P/D routing calls' counters, by metric name (``RoutePd``, ``POST
            /v1/pd/route``).
        progress: Each pool's step progress (the last applied Step's step_seq and age).
        kv_events: The ZMQ KV-event stream (``None``: off, or while a journal is replayed:
            what was published before a restart is replayed on request, not re-sent).
        kv_events_topic: The topic template of the ZMQ stream.
        kv_numbering: The ZMQ stream's numbering per pool id (kept, and checkpointed, also
            while the stream is off: a pool id's numbering must not go backwards when it is
            turned on).
        tracing: The server's tracing (``None``: off; calls take no tracing path at all).
        standby_pools: Pools this replica holds as a standby's copy (or as a primary that
            stepped down; docs/replication.md): they change only by their primary's shipped
            records, publish nothing on the ZMQ wire, reclaim no lease and are in no
            checkpoint.
        lanes: Pools lent to a worker thread for a long call, by pool id, each with the
            event set when the call ends. Every call on such a pool waits for it
            (:meth:`pool`), so a pool is never read or changed by two threads at once and
            each call stays atomic; other pools keep being served on the loop.
        event_holds: Pools whose KV events are released only once their standby has the
            records that made them (:class:`EventHold`; set by the replication of ``sync``
            pools, empty otherwise: events go out as they are published).
    """

    registry: PoolRegistry
    rpc_stats: RpcStats
    limits: Limits = DEFAULT_LIMITS
    runtimes: dict[str, PoolRuntime] = field(default_factory=dict)
    serving: bool = False
    lanes: dict[str, asyncio.Event] = field(default_factory=dict)
    tracing: Tracing | None = None
    journal: Journal | None = None
    activity: dict[str, float] = field(default_factory=dict)
    transfers: dict[tuple[str, int], tuple[float, object]] = field(default_factory=dict)
    transfer_lease_s: float = 0.0
    transfer_book: TransferBook = field(default_factory=TransferBook)
    subscriber_lease_s: float = 0.0
    reclaims: dict[tuple[str, str], int] = field(default_factory=dict)
    pd_routes: dict[str, int] = field(default_factory=dict)
    progress: StepProgressBook = field(default_factory=StepProgressBook)
    clock: AwakeClock = field(default_factory=AwakeClock)
    kv_events: KvEventStream | None = None
    kv_events_topic: str = DEFAULT_KV_EVENTS_TOPIC
    kv_numbering: KvEventNumbering = field(default_factory=KvEventNumbering)
    standby_pools: set[str] = field(default_factory=set)
    event_holds: dict[str, EventHold] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.clock.on_stall = self._extend_leases

    def _extend_leases(self, stall_s: float, now: float) -> None:
        """Move every lease's last renewal ``stall_s`` later (not past ``now``): the server
        stalled, and its holders could not call meanwhile."""
        activity = self.activity
        for pool_id, last in activity.items():
            activity[pool_id] = min(last + stall_s, now)
        transfers = self.transfers
        for key, (started, request) in transfers.items():
            transfers[key] = (min(started + stall_s, now), request)
        self.transfer_book.extend(stall_s, now)

    async def pool(self, pool_id: str) -> Pool:
        """The pool called ``pool_id``, once no worker thread holds it.

        Raises:
            NotFoundError: No such pool (also when it was deleted meanwhile).
        """
        while (busy := self.lanes.get(pool_id)) is not None:
            await busy.wait()
        return self.registry.get(pool_id)

    async def scheduler_pool(self, pool_id: str) -> Pool:
        """:meth:`pool` for a scheduler's call: it renews the pool's scheduler lease."""
        pool = await self.pool(pool_id)
        self.activity[pool_id] = self.clock.now()
        return pool

    async def run_in_lane(
        self, pool: Pool, work: Callable[[], T], *, builds_pool: bool = False
    ) -> T:
        """Run ``work`` (a call on ``pool``) in a worker thread while the pool is lent.

        The caller got ``pool`` from :meth:`pool` and has not awaited since, so no other
        call holds it. Metrics and /v1/pools skip a lent pool (``Pool.lent``).
        ``builds_pool``: the work may build a pool's blocks (see ``OffLoopWork``: the heap is
        frozen afterwards).
        """
        done = asyncio.Event()
        self.lanes[pool.name] = done
        pool.lent = True
        try:
            return await asyncio.to_thread(
                _off_loop, work, OFF_LOOP_WORK if builds_pool else OFF_LOOP_STEP
            )
        finally:
            pool.lent = False
            del self.lanes[pool.name]
            done.set()

    def begin_shutdown(self) -> None:
        """Stop serving: wake every waiting registration and event stream so they end now."""
        self.serving = False
        for runtime in self.runtimes.values():
            runtime.planned.set()
            runtime.wake_subscribers()

    def track_transfers(self, pool: Pool, keys: list[int]) -> None:
        """Start the transfer lease of requests just allocated with ``delay_cache_blocks``."""
        now = self.clock.now()
        for key in keys:
            request = pool.requests.get(key)
            if request is not None:
                self.transfers[(pool.name, key)] = (now, request)

    def published(self, pool: Pool) -> None:
        """Publish the events a mutating call left in the pool's core, waking subscribers
        and handing the batch to the ZMQ stream.

        They are stamped with the call's time (``CALL_TIME``, which a journal record keeps so
        that a replay stamps them alike), else now.
        """
        if pool.publish_events(CALL_TIME.get() or time.time()):
            self.announce(pool)

    def announce(self, pool: Pool) -> None:
        """The loop's half of :meth:`published`: wake the pool's subscribers and hand its
        last batch to the ZMQ stream, once the batch is published (a long Step publishes it
        in its lane: ``Pool.publish_events`` costs ~7 us per event)."""
        hold = self.event_holds.get(pool.name) if self.event_holds else None
        if hold is not None and hold.pool is not pool and pool.name in self.standby_pools:
            del self.event_holds[pool.name]  # a stepped-down primary's, replaced by a seed
            hold = None
        if hold is not None:
            if hold.pool is not pool:  # replaced under its id (ResyncPool): hold the new one
                last = pool.last_event_batch()
                start = pool.last_event_sequence - (len(last[1]) if last is not None else 0)
                hold = self.event_holds[pool.name] = EventHold(pool, start)
            if self.kv_events is not None and pool.name not in self.standby_pools:
                batch = pool.last_event_batch()
                if batch is not None:
                    hold.pending.append((pool.last_event_sequence, batch))
            return  # subscribers are woken when it is released
        runtime = self.runtimes.get(pool.name)
        if runtime is not None:
            runtime.wake_subscribers()
        if self.kv_events is not None and pool.name not in self.standby_pools:
            self.kv_events.publish(pool, self.topic(pool))

    def hold_events(self, pool_id: str) -> None:
        """From now on release ``pool_id``'s KV events only by :meth:`release_events` (what
        was published so far is out already)."""
        pool = self.registry.get(pool_id) if pool_id in self.registry else None
        hold = self.event_holds.get(pool_id)
        if hold is None or hold.pool is not pool:
            start = pool.last_event_sequence if pool is not None else 0
            self.event_holds[pool_id] = EventHold(pool, start)

    def release_events(self, pool: Pool, through: int) -> None:
        """The standby has every record that published ``pool``'s events up to sequence
        ``through``: hand their ZMQ batches to the wire, in order, and let subscribers read
        them."""
        hold = self.event_holds.get(pool.name)
        if hold is None or hold.pool is not pool or through <= hold.visible:
            return
        hold.visible = through
        pending = hold.pending
        stream = self.kv_events
        while pending and pending[0][0] <= through:
            _, batch = pending.popleft()
            if stream is not None and pool.name not in self.standby_pools:
                stream.publish(pool, self.topic(pool), batch)
        runtime = self.runtimes.get(pool.name)
        if runtime is not None:
            runtime.wake_subscribers()

    def unhold_events(self, pool_id: str) -> None:
        """Stop holding ``pool_id``'s events (it has no standby any more): release what is
        pending, and publish as they come from now on."""
        hold = self.event_holds.get(pool_id)
        if hold is None:
            return
        if hold.pool is not None:
            self.release_events(hold.pool, hold.pool.last_event_sequence)
        self.event_holds.pop(pool_id, None)

    def first_held_batch(self, pool: Pool) -> int | None:
        """The batch sequence of ``pool``'s oldest batch held for its standby (``None``:
        none is held): a ZMQ replay sends none from it on."""
        hold = self.event_holds.get(pool.name) if self.event_holds else None
        if hold is None or hold.pool is not pool or not hold.pending:
            return None
        return hold.pending[0][1][0]

    def visible_events(self, pool: Pool) -> int | None:
        """The last event sequence of ``pool`` its subscribers may read (``None``: all)."""
        hold = self.event_holds.get(pool.name) if self.event_holds else None
        if hold is None or hold.pool is not pool:
            return None
        return hold.visible

    def topic(self, pool: Pool) -> str:
        """The pool's ZMQ topic (``kv_events_topic``)."""
        return kv_events_topic(self.kv_events_topic, pool)

    def _pool_ids(self) -> list[str]:
        return [pool.name for pool in self.registry.list()]

    def zmq_events(self, pool: Pool) -> ZmqEventStream | None:
        """Where ``pool``'s batches go out on the ZMQ wire (``None``: it publishes none)."""
        return self.zmq_events_of([pool]).get(pool.name)

    def zmq_events_of(self, pools: list[Pool]) -> dict[str, ZmqEventStream]:
        """:meth:`zmq_events` of each of ``pools`` that publishes, by pool id (one pass over
        the registry for all of them)."""
        stream = self.kv_events
        publishing = [pool for pool in pools if pool.options.enable_kv_cache_events]
        if stream is None or not publishing:
            return {}
        sharing = stream.sharing(self.registry.list())
        out = {}
        for pool in publishing:
            described = stream.describe(pool, self.topic(pool), sharing)
            if described is None:
                continue
            held = self.first_held_batch(pool)
            if held is not None:  # the last batch out is the one before the first held
                last = stream.numbering.base(pool.name) + held - 1
                described = dataclasses.replace(described, last_seq=last)
            out[pool.name] = described
        return out

    def retire(self, pool: Pool) -> None:
        """End a pool that was deleted or is being replaced: publish ``AllBlocksCleared`` as
        its last batch, then end its registrations and event streams (NOT_FOUND). The pool
        id's next incarnation numbers its ZMQ batches after that one. Held events go out
        first (under this incarnation's numbering)."""
        hold = self.event_holds.get(pool.name)
        if hold is not None and hold.pool is pool:
            self.release_events(pool, pool.last_event_sequence)
        if (
            pool.publish_cleared(CALL_TIME.get() or time.time())
            and self.kv_events is not None
            and pool.name not in self.standby_pools
        ):
            self.kv_events.publish(pool, self.topic(pool))
        self.kv_numbering.retire(pool, self.topic(pool), self._pool_ids)
        runtime = self.runtimes.pop(pool.name, None)
        if runtime is not None:
            runtime.deleted = True
            runtime.planned.set()
            runtime.wake_subscribers()
