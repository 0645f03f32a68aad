"""vLLM's ZMQ KV-event stream, published by the server for every pool.

A consumer written for a vLLM 0.33 engine (``--kv-events-config``) reads kvcm unchanged: a
PUB socket sends each publication as the multipart message ``(topic, seq, payload)`` where
``seq`` is an 8-byte big-endian batch number and ``payload`` is vLLM's msgpack ``KVEventBatch``
``[ts, events, data_parallel_rank]``, every event a map tagged with its class name, byte for
byte as vLLM's encoder writes it. A ROUTER socket answers vLLM's replay request (an empty
frame and an 8-byte start ``seq``) with ``(b"", topic, seq, payload)`` for every kept batch
from ``seq`` on and then vLLM's end marker ``(b"", b"", -1, b"")``.

What differs from one engine's publisher, and why:

* One server holds many pools, so each pool is its own topic (``kv_events_topic``, a template
  over ``{pool}`` and ``{model}``, by default ``kv@{pool}@{model}``, llm-d's convention of
  ``kv@<engine>@<model>``) with its own batch numbers, as each vLLM engine has its own.
  A replay request may add the topic as a fourth frame to replay one pool; without it every
  pool of the socket is replayed (exactly vLLM's answer when the socket carries one pool).
* Streams: with ``kv_events_port_label`` unset every pool shares one PUB socket (and one
  replay socket); with it set (``data_parallel_rank``, vLLM's own rule) a pool publishes on
  the endpoint's port plus the label's value, and is replayed on the replay port plus it, so
  a consumer that ignores topics (Dynamo's) sees one pool per socket.
* Numbering per pool *id* never goes backwards on the wire (:class:`KvEventNumbering`): a pool
  deleted or replaced publishes ``AllBlocksCleared`` as the last batch of its incarnation and
  the next incarnation goes on after it, so a consumer that drops batches numbered at or below
  the last one it saw follows the new incarnation; the numbering is checkpointed with
  ``--data-dir`` and the cleared batch stays replayable.
* Batches come from the pool's own event log (one batch per call that changed the cache),
  which survives a restart with ``--data-dir``: a replay after a restart sends the same bytes.
* The event loop never waits for ZMQ: it puts each batch on a bounded ``queue.Queue`` that the
  publisher thread drains (a queue's own condition variable: no wake-up can be lost), and
  that thread owns the PUB sockets and encodes there. A second thread owns the replay and
  monitor sockets. A full queue (``kv_events_max_queue_size``) drops the batch and counts it;
  the consumer sees the gap in ``seq`` and replays it.

::

    event loop: publish() --put_nowait--> queue.Queue --get(timeout)--> publisher thread
                                                                         encode, PUB.send
    replay ROUTERs, PUB monitors <--poll-- service thread --collect()--> event loop (kept
                                                                         batches) -> ROUTER
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcm.common.errors import ConfigError
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcm.common.hashing import external_block_hash
from kvcm.core.pool_types import ZmqEventStream

if TYPE_CHECKING:
    from kvcm.core.pool import Pool
    from kvcm.server.settings import ServerSettings

__all__ = [
    "KvEventCounters",
    "KvEventNumbering",
    "KvEventStream",
    "collect_batches",
    "kv_events_topic",
    "offset_endpoint",
    "stream_offset",
]

_LOG = logging.getLogger("kvcm.server.kv_events")
_END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
_REPLAY_TIMEOUT_S: Final = 10.0
_DEFAULT_DP_RANK: Final = 0
# How long the publisher waits on an empty queue before it looks at the closing flag, and the
# service thread's poll timeout (its stop flag and newly opened streams): bounds shutdown only.
_IDLE_WAIT_S: Final = 0.2
_SERVICE_POLL_MS: Final = 100
# A stream whose endpoint could not be bound is tried again after this long.
_REOPEN_AFTER_S: Final = 5.0
_MAX_RETIRED_IDS: Final = 100_000


# vLLM 0.33's event structs, declared alike (names, field order, options) so that msgspec
# writes the same bytes: events are maps tagged with the class name, defaults left out.
class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredStruct(_Event, tag="BlockStored"):
    """vLLM's ``BlockStored`` on the wire."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemovedStruct(_Event, tag="BlockRemoved"):
    """vLLM's ``BlockRemoved`` on the wire."""

    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksClearedStruct(_Event, tag="AllBlocksCleared"):
    """vLLM's ``AllBlocksCleared`` on the wire."""


class EventBatchStruct(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _wire_hash(block_hash: Any, int_hashes: bool) -> Any:
    # Events restored from a snapshot older than full-width hashes hold vLLM's ints already.
    if int_hashes and isinstance(block_hash, bytes):
        return external_block_hash(block_hash)
    return block_hash


def _wire_hashes(hashes: list[Any], int_hashes: bool) -> list[Any]:
    if not int_hashes or not hashes or not isinstance(hashes[0], bytes):
        return hashes
    return [external_block_hash(h) for h in hashes]


def _to_structs(events: Iterable[KVCacheEvent], int_hashes: bool) -> list[Any]:
    out: list[Any] = []
    append = out.append
    for event in events:
        if type(event) is BlockStored:
            parent = event.parent_block_hash
            if parent is not None:
                parent = _wire_hash(parent, int_hashes)
            # Positional, in the struct's field order: the cheapest construction.
            append(
                BlockStoredStruct(
                    _wire_hashes(event.block_hashes, int_hashes),
                    parent,
                    event.token_ids,
                    event.block_size,
                    event.lora_id,
                    event.medium,
                    event.lora_name,
                    event.extra_keys,
                    event.group_idx,
                    event.kv_cache_spec_kind,
                    event.kv_cache_spec_sliding_window,
                    event.locality,
                    event.ownership,
                    event.session_id,
                    event.lookahead_token_ids,
                )
            )
        elif type(event) is BlockRemoved:
            append(
                BlockRemovedStruct(
                    _wire_hashes(event.block_hashes, int_hashes),
                    event.medium,
                    event.group_idx,
                    event.locality,
                    event.ownership,
                )
            )
        elif type(event) is AllBlocksCleared:
            append(AllBlocksClearedStruct())
        else:  # pragma: no cover - the core emits only the three kinds
            raise TypeError(f"unknown KV event {event!r}")
    return out


def kv_events_topic(template: str, pool: Pool) -> str:
    """The ZMQ topic of ``pool`` under ``template`` (``{pool}``: its id; ``{model}``: its
    ``model`` label, empty without one)."""
    labels = pool.options.labels
    return template.format(pool=pool.name, model=labels.get("model", ""))


def _is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard and ipc/inproc endpoints are bound, the rest connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``endpoint`` for the stream ``offset`` (vLLM's rule for a data-parallel rank): a tcp
    port plus ``offset``, an ipc/inproc path with ``_dp<offset>`` appended. Port 0 stays 0:
    each stream then binds its own ephemeral port (DescribePool tells which)."""
    if offset == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{offset}"
    head, _, port = endpoint.rpartition(":")
    number = int(port)
    return endpoint if number == 0 else f"{head}:{number + offset}"


def _label_int(pool: Pool, label: str) -> int | None:
    value = pool.options.labels.get(label) if label else None
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def stream_offset(pool: Pool, port_label: str) -> int:
    """The stream ``pool`` publishes on: its ``port_label`` label's value (a decimal integer),
    else 0 (also when ``port_label`` is empty: one stream for every pool)."""
    value = _label_int(pool, port_label)
    return 0 if value is None else value


def _dp_rank(pool: Pool) -> int:
    """The ``data_parallel_rank`` a pool's batches carry: its ``data_parallel_rank`` label
    (an engine's DP rank), else 0 as a vLLM engine without data parallelism sends."""
    value = _label_int(pool, "data_parallel_rank")
    return _DEFAULT_DP_RANK if value is None else value


@dataclass(slots=True)
class _Batch:
    topic: bytes
    seq: int  # on the wire
    ts: float
    events: list[KVCacheEvent]
    dp_rank: int
    pool_id: str = ""
    stream: _Stream | None = None
    queued_at: float = 0.0  # time.monotonic() when queued


# ------------------------------------------------------------------ numbering per pool id
@dataclass(slots=True)
class _Retired:
    """The last incarnation of a pool id: the first wire ``seq`` of the next one, and its
    ``AllBlocksCleared`` batch (numbered ``next_seq - 1``), kept for replay."""

    next_seq: int
    ts: float
    topic: bytes
    dp_rank: int
    offset: int


class KvEventNumbering:
    """The wire ``seq`` of every pool id: ``base(pool id) + the pool's own batch number``.

    A pool numbers its batches from 0 per incarnation (its event log, checkpointed with it).
    When an incarnation ends (DeletePool, ResyncPool over it) its last batch is
    ``AllBlocksCleared``; :meth:`retire` then moves the id's base past it, so the next
    incarnation's batch 0 goes out as the number after that clear, and keeps the clear for
    replay. The table is checkpointed (:meth:`encode`); records replayed from the journal
    call :meth:`retire` again, so it survives a crash too.

    NOTE: at most ``max_retired`` retired ids are remembered (the most recently retired).
    Forgetting one that has no pool raises ``floor`` to its next ``seq``, and ids in no table
    start at ``floor``, so a forgotten id only ever jumps forward. Before ``floor`` rises,
    every live pool's id that is in no table is pinned at the old floor (``_pinned``, at most
    one per live pool), so no live pool's numbers move.
    """

    __slots__ = ("_floor", "_pinned", "_retired", "max_retired", "port_label")

    def __init__(self, port_label: str = "", max_retired: int = _MAX_RETIRED_IDS) -> None:
        """An empty table; ``port_label`` picks each pool's stream (:func:`stream_offset`)."""
        self.port_label = port_label
        self.max_retired = max_retired
        self._retired: dict[str, _Retired] = {}
        self._pinned: dict[str, int] = {}
        self._floor = 0

    def base(self, pool_id: str) -> int:
        """The wire ``seq`` of batch 0 of ``pool_id``'s current incarnation."""
        retired = self._retired.get(pool_id)
        if retired is not None:
            return retired.next_seq
        return self._pinned.get(pool_id, self._floor)

    def adopt(self, pool_id: str, base: int) -> None:
        """Number ``pool_id``'s current incarnation from ``base`` (a standby's copy numbers
        its batches as its primary does: docs/replication.md)."""
        if self.base(pool_id) == base:
            return
        self._retired.pop(pool_id, None)
        self._pinned[pool_id] = base

    def last_seq(self, pool: Pool) -> int:
        """The wire ``seq`` of the last batch published under ``pool``'s id (-1: none)."""
        return self.base(pool.name) + pool.event_batches()[0] - 1

    def retire(self, pool: Pool, topic: str, live: Callable[[], Iterable[str]]) -> None:
        """``pool``'s incarnation ended after publishing its ``AllBlocksCleared`` (if any).

        ``live`` gives the ids that have a pool now (read only when over the cap).
        """
        next_batch = pool.event_batches()[0]
        last = pool.last_event_batch()
        if next_batch == 0 or last is None:
            return  # it published nothing: the next incarnation starts where this one did
        base = self.base(pool.name) + next_batch
        self._retired.pop(pool.name, None)  # re-inserted last: the most recently retired
        self._pinned.pop(pool.name, None)
        offset = stream_offset(pool, self.port_label)
        self._retired[pool.name] = _Retired(base, last[2], topic.encode(), _dp_rank(pool), offset)
        if len(self._retired) > self.max_retired:
            self._forget(pool.name, set(live()))

    def _forget(self, keep: str, live: set[str]) -> None:
        """Forget the oldest retired ids that have no pool, down to ``max_retired``."""
        floor = self._floor
        for pool_id in list(self._retired):
            if len(self._retired) <= self.max_retired:
                break
            if pool_id != keep and pool_id not in live:
                floor = max(floor, self._retired.pop(pool_id).next_seq)
        if floor > self._floor:
            for pool_id in live:
                if pool_id not in self._retired and pool_id not in self._pinned:
                    self._pinned[pool_id] = self._floor
            self._floor = floor
        for pool_id in [p for p in self._pinned if p not in live]:
            del self._pinned[pool_id]  # gone: its next pool may start at the floor

    def cleared_batches(self, start: int, topic: str | None, offset: int) -> list[_Batch]:
        """The kept ``AllBlocksCleared`` batches of retired incarnations on stream ``offset``
        numbered ``start`` or later (of the one whose topic is ``topic``, or all)."""
        wanted = None if topic is None else topic.encode()
        return [
            _Batch(r.topic, r.next_seq - 1, r.ts, [AllBlocksCleared()], r.dp_rank)
            for r in self._retired.values()
            if r.offset == offset and r.next_seq - 1 >= start and wanted in (None, r.topic)
        ]

    def encode(self) -> bytes:
        """The table as bytes (for a checkpoint)."""
        rows = [
            [pool_id, r.next_seq, r.ts, r.topic, r.dp_rank, r.offset]
            for pool_id, r in self._retired.items()
        ]
        return msgspec.msgpack.encode([self._floor, rows, self._pinned])

    def restore(self, data: bytes) -> None:
        """Install a table saved by :meth:`encode` (``b""``: an empty one).

        Raises:
            ConfigError: ``data`` is not such a table.
        """
        if not data:
            return
        try:
            floor, rows, pinned = msgspec.msgpack.decode(data)
            retired = {
                str(pool_id): _Retired(int(seq), float(ts), bytes(topic), int(rank), int(offset))
                for pool_id, seq, ts, topic, rank, offset in rows
            }
            pins = {str(pool_id): int(seq) for pool_id, seq in pinned.items()}
        except (msgspec.DecodeError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"data_dir: the KV-event numbering is damaged: {exc}") from exc
        self._floor = int(floor)
        self._retired = retired
        self._pinned = pins


# ------------------------------------------------------------------ the sockets
@dataclass(slots=True, eq=False)
class _Stream:
    """One PUB socket (owned by the publisher thread) and its replay ROUTER and monitor
    (owned by the service thread); opened on the event loop, handed over through queues."""

    offset: int
    endpoint: str
    replay_endpoint: str
    pub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    replay: zmq.Socket[bytes] | None
    peers: int = 0


@dataclass(slots=True)
class KvEventCounters:
    """What the publisher did (read by /metrics).

    Attributes:
        batches: Batches sent on the PUB sockets.
        events: Events in them.
        dropped: Batches dropped because the publisher's queue was full (or their stream's
            endpoint could not be opened).
        replays: Replay requests answered.
        replayed_batches: Batches sent in answer to them.
        errors: Sends, replays or stream openings that failed (logged).
        peers: Subscribers (or, connecting, endpoints) the PUB sockets are connected to now.
        last_sent: The wire ``seq`` of the last batch sent, by pool id.
        pending: The publisher's queue (``None``: none yet), read by :meth:`queue_depth` and
            :meth:`oldest_unsent_age_s`.
    """

    batches: int = 0
    peers: int = 0
    events: int = 0
    dropped: int = 0
    replays: int = 0
    replayed_batches: int = 0
    errors: int = 0
    last_sent: dict[str, int] = field(default_factory=dict)
    pending: queue.Queue[_Batch | None] | None = None

    def queue_depth(self) -> int:
        """Batches queued and not yet taken by the publisher thread."""
        return 0 if self.pending is None else self.pending.qsize()

    def oldest_unsent_age_s(self) -> float:
        """Seconds the oldest queued batch has waited (0: none queued)."""
        if self.pending is None:
            return 0.0
        try:
            head = self.pending.queue[0]  # a peek: the thread may take it meanwhile
        except IndexError:
            return 0.0
        return 0.0 if head is None else max(0.0, time.monotonic() - head.queued_at)


Collect = Callable[[int, str | None, int], concurrent.futures.Future[list[_Batch]]]
"""Asks the event loop for the kept batches of a stream (see :class:`KvEventStream`)."""


class KvEventStream:
    """The server's vLLM-wire publisher: PUB sockets and optional replay ROUTERs.

    ``publish`` is called on the event loop and only queues; two threads own the sockets.

    Attributes:
        counters: What was published.
        numbering: The wire numbering per pool id (shared with the server state).
    """

    def __init__(
        self, settings: ServerSettings, *, collect: Collect, numbering: KvEventNumbering
    ) -> None:
        """Open the shared stream's sockets (bind errors surface here) and start the threads.

        Args:
            settings: ``kv_events_*`` settings.
            collect: Asks the event loop for every kept batch of stream ``offset`` from a
                wire ``seq`` on (of one topic, or all); the future resolves to them in
                publication order per pool.
            numbering: The wire numbering per pool id.

        Raises:
            ConfigError: An endpoint cannot be bound or connected to.
        """
        self.counters = KvEventCounters()
        self.numbering = numbering
        self._int_hashes = bool(settings.kv_events_use_int_block_hashes)
        self._collect = collect
        self._endpoint = settings.kv_events_endpoint
        self._replay_endpoint = settings.kv_events_replay_endpoint
        self._hwm = settings.kv_events_hwm
        self._port_label = settings.kv_events_port_label
        self._queue: queue.Queue[_Batch | None] = queue.Queue(settings.kv_events_max_queue_size)
        self.counters.pending = self._queue
        self._opened: queue.SimpleQueue[_Stream] = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._failed: dict[int, float] = {}
        self._closing = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        try:
            self._shared = self._open(0)
        except zmq.ZMQError as exc:
            raise ConfigError(f"kv_events_endpoint / kv_events_replay_endpoint: {exc}") from exc
        self._publisher = threading.Thread(
            target=self._publish_loop, name="kvcm-kv-events", daemon=True
        )
        self._service = threading.Thread(
            target=self._service_loop, name="kvcm-kv-events-replay", daemon=True
        )
        self._publisher.start()
        self._service.start()

    @property
    def endpoint(self) -> str:
        """The shared (offset 0) PUB endpoint, port resolved when bound."""
        return self._shared.endpoint

    @property
    def replay_endpoint(self) -> str:
        """The shared (offset 0) replay endpoint, port resolved (``""``: no replay)."""
        return self._shared.replay_endpoint

    # -------------------------------------------------------------- on the event loop
    def stream_offset(self, pool: Pool) -> int:
        """The stream ``pool`` publishes on (:func:`stream_offset`)."""
        return stream_offset(pool, self._port_label)

    def sharing(self, pools: Iterable[Pool]) -> dict[int, int]:
        """How many of ``pools`` publish on each stream (for :meth:`describe`)."""
        counts: dict[int, int] = {}
        for pool in pools:
            if pool.options.enable_kv_cache_events:
                offset = self.stream_offset(pool)
                counts[offset] = counts.get(offset, 0) + 1
        return counts

    def describe(self, pool: Pool, topic: str, sharing: dict[int, int]) -> ZmqEventStream | None:
        """Where ``pool`` (publishing as ``topic``; ``sharing``: :meth:`sharing` of every
        pool) publishes and replays, and its last wire ``seq``; ``None``: its stream cannot
        be opened."""
        offset = self.stream_offset(pool)
        stream = self._stream(offset)
        if stream is None:
            return None
        return ZmqEventStream(
            endpoint=stream.endpoint,
            replay_endpoint=stream.replay_endpoint,
            topic=topic,
            last_seq=self.numbering.last_seq(pool),
            data_parallel_rank=_dp_rank(pool),
            dedicated=sharing.get(offset, 0) <= 1,
        )

    def publish(
        self,
        pool: Pool,
        topic: str,
        held: tuple[int, list[KVCacheEvent], float] | None = None,
    ) -> None:
        """Queue the batch ``pool`` published last (called right after it published), or
        ``held`` (one it published earlier, held until its standby had it)."""
        last = pool.last_event_batch() if held is None else held
        if last is None:
            return
        seq, events, ts = last
        stream = self._stream(stream_offset(pool, self._port_label))
        batch = _Batch(
            topic.encode(),
            self.numbering.base(pool.name) + seq,
            ts,
            events,
            _dp_rank(pool),
            pool.name,
            stream,
            time.monotonic(),
        )
        if stream is None:
            self.counters.dropped += 1
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.counters.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout``), stop the threads and close the sockets."""
        self._closing.set()
        deadline = time.monotonic() + timeout
        # On a full queue the thread still exits once it is empty: it sees the closing flag.
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._publisher.join(max(0.0, deadline - time.monotonic()))
        self._service.join(max(0.0, deadline - time.monotonic()) + 2 * _IDLE_WAIT_S)
        if self._publisher.is_alive() or self._service.is_alive():
            _LOG.warning("the KV-event publisher did not stop within %.1f s", timeout)
            return
        for stream in self._streams.values():
            _close_stream(stream)

    def _stream(self, offset: int) -> _Stream | None:
        stream = self._streams.get(offset)
        if stream is not None:
            return stream
        failed = self._failed.get(offset)
        if failed is not None and time.monotonic() - failed < _REOPEN_AFTER_S:
            return None
        try:
            return self._open(offset)
        except zmq.ZMQError as exc:
            self._failed[offset] = time.monotonic()
            self.counters.errors += 1
            _LOG.error(
                "KV-event stream %d cannot be opened on %s: %s",
                offset,
                offset_endpoint(self._endpoint, offset),
                exc,
            )
            return None

    def _open(self, offset: int) -> _Stream:
        """Bind or connect stream ``offset``'s sockets and hand them to the threads."""
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self._hwm)
        # Before bind/connect, so that no connection goes uncounted.
        monitor = pub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        replay: zmq.Socket[bytes] | None = None
        try:
            endpoint = offset_endpoint(self._endpoint, offset)
            if _is_bind_endpoint(endpoint):
                pub.bind(endpoint)
                endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(endpoint)
            replay_endpoint = ""
            if self._replay_endpoint:
                replay = self._ctx.socket(zmq.ROUTER)
                # A replay is sent whole or not at all: a peer whose queue stays full (or that
                # left) makes the send fail instead of ZMQ dropping batches silently.
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                replay.setsockopt(zmq.SNDHWM, self._hwm)
                replay.setsockopt(zmq.SNDTIMEO, int(_REPLAY_TIMEOUT_S * 1000))
                replay.bind(offset_endpoint(self._replay_endpoint, offset))
                replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            pub.disable_monitor()
            monitor.close(linger=0)
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        stream = _Stream(offset, endpoint, replay_endpoint, pub, monitor, replay)
        self._streams[offset] = stream
        self._failed.pop(offset, None)
        self._opened.put(stream)  # the service thread registers its monitor and ROUTER
        return stream

    # -------------------------------------------------------------- the publisher thread
    def _publish_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        get = self._queue.get
        counters = self.counters
        last_sent = counters.last_sent
        while True:
            try:
                batch = get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            if batch is None:
                return
            assert batch.stream is not None
            try:
                payload = self._encode(encoder, batch)
                batch.stream.pub.send_multipart(
                    (batch.topic, batch.seq.to_bytes(8, "big"), payload)
                )
            except Exception:
                counters.errors += 1
                _LOG.exception("KV-event batch %d not published", batch.seq)
                continue
            counters.batches += 1
            counters.events += len(batch.events)
            last_sent[batch.pool_id] = batch.seq

    def _encode(self, encoder: msgspec.msgpack.Encoder, batch: _Batch) -> bytes:
        structs = _to_structs(batch.events, self._int_hashes)
        return encoder.encode(EventBatchStruct(batch.ts, structs, batch.dp_rank))

    # -------------------------------------------------------------- the service thread
    def _service_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        monitors: dict[zmq.Socket[bytes], _Stream] = {}
        routers: dict[zmq.Socket[bytes], _Stream] = {}
        while not self._closing.is_set() or self._publisher.is_alive():
            while True:
                try:
                    stream = self._opened.get_nowait()
                except queue.Empty:
                    break
                monitors[stream.monitor] = stream
                poller.register(stream.monitor, zmq.POLLIN)
                if stream.replay is not None:
                    routers[stream.replay] = stream
                    poller.register(stream.replay, zmq.POLLIN)
            for sock, _ in poller.poll(_SERVICE_POLL_MS):
                if sock in monitors:
                    self._count_peers(monitors[sock])
                else:
                    try:
                        self._serve_replay(encoder, routers[sock])
                    except Exception:
                        self.counters.errors += 1
                        _LOG.exception("KV-event replay failed")

    def _count_peers(self, stream: _Stream) -> None:
        while True:
            try:
                event = recv_monitor_message(stream.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            change = -1 if event["event"] == zmq.EVENT_DISCONNECTED else 1
            if stream.peers + change >= 0:
                stream.peers += change
                self.counters.peers += change

    def _serve_replay(self, encoder: msgspec.msgpack.Encoder, stream: _Stream) -> None:
        sock = stream.replay
        assert sock is not None
        frames = sock.recv_multipart()
        if len(frames) not in (3, 4) or frames[1] != b"" or len(frames[2]) != 8:
            self.counters.errors += 1
            _LOG.warning("invalid KV-event replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames[:3]
        start = int.from_bytes(start_bytes, "big")
        topic = frames[3].decode() if len(frames) == 4 else None
        batches = self._collect(start, topic, stream.offset).result(_REPLAY_TIMEOUT_S)
        for batch in batches:
            payload = self._encode(encoder, batch)
            sock.send_multipart((client, b"", batch.topic, batch.seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client, b"", b"", _END_SEQ, b""))
        self.counters.replays += 1
        self.counters.replayed_batches += len(batches)


def _close_stream(stream: _Stream) -> None:
    stream.pub.disable_monitor()
    stream.monitor.close(linger=0)
    stream.pub.close(linger=1000)
    if stream.replay is not None:
        stream.replay.close(linger=0)


def collect_batches(
    pool: Pool,
    topic: str,
    numbering: KvEventNumbering,
    start: int,
    wanted: str | None,
    *,
    held: int | None = None,
) -> list[_Batch]:
    """Every kept batch of ``pool`` (publishing as ``topic``) whose wire ``seq`` is ``start``
    or later, unless ``wanted`` names another topic; none from the pool's batch ``held`` on
    (held for its standby: not out yet)."""
    if wanted is not None and wanted != topic:
        return []
    base = numbering.base(pool.name)
    encoded = topic.encode()
    rank = _dp_rank(pool)
    return [
        _Batch(encoded, base + seq, ts, events, rank)
        for seq, events, ts in pool.event_batches_from(max(0, start - base))
        if held is None or seq < held
    ]


def loop_collector(
    loop: asyncio.AbstractEventLoop,
    gather: Callable[[int, str | None, int], Coroutine[Any, Any, list[_Batch]]],
) -> Collect:
    """A ``collect`` for :class:`KvEventStream` that runs ``gather(start, topic, offset)`` (a
    coroutine function returning the batches) on ``loop``."""

    def collect(
        start: int, topic: str | None, offset: int
    ) -> concurrent.futures.Future[list[_Batch]]:
        return asyncio.run_coroutine_threadsafe(gather(start, topic, offset), loop)

    return collect
