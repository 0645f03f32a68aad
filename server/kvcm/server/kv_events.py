"""vLLM's ZMQ KV-event stream, published by the server for every pool.

A consumer written for a vLLM 0.33 engine (``--kv-events-config``) reads kvcm unchanged: one
PUB socket sends each publication as the multipart message ``(topic, seq, payload)`` where
``seq`` is an 8-byte big-endian batch number and ``payload`` is vLLM's msgpack ``KVEventBatch``
``[ts, events, data_parallel_rank]``, every event a map tagged with its class name, byte for
byte as vLLM's encoder writes it. A ROUTER socket answers vLLM's replay request (an empty
frame and an 8-byte start ``seq``) with ``(b"", topic, seq, payload)`` for every kept batch
from ``seq`` on and then vLLM's end marker ``(b"", b"", -1, b"")``.

What differs from one engine's publisher, and why:

* One server holds many pools, so each pool is its own topic (``kv_events_topic``, a template
  over ``{pool}`` and ``{model}``, by default ``kv@{pool}@{model}``, llm-d's convention of
  ``kv@<engine>@<model>``) with its own batch numbers from 0, as each vLLM engine has its own.
  A replay request may add the topic as a fourth frame to replay one pool; without it every
  pool's batches from ``seq`` on are sent (exactly vLLM's answer when the server holds one pool).
* Batches come from the pool's own event log (one batch per call that changed the cache),
  which survives a restart with ``--data-dir``: a replay after a restart sends the same bytes.
* The event loop never waits for ZMQ: it hands each batch to the publisher thread, which owns
  both sockets and encodes there. A full queue (``kv_events_max_queue_size``) drops the batch
  and counts it; the consumer sees the gap in ``seq`` and replays it.
* A deleted or replaced pool (DeletePool; ResyncPool over an existing pool, as when its engine
  restarts) publishes ``AllBlocksCleared`` as the last batch of its old incarnation, so a
  router drops what it learnt; the new incarnation numbers its batches from 0 again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcm.common.errors import ConfigError
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcm.common.hashing import external_block_hash

if TYPE_CHECKING:
    from kvcm.core.pool import Pool
    from kvcm.server.settings import ServerSettings

__all__ = ["KvEventCounters", "KvEventStream", "collect_batches", "kv_events_topic"]

_LOG = logging.getLogger("kvcm.server.kv_events")
_END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
_REPLAY_TIMEOUT_S: Final = 10.0
_DEFAULT_DP_RANK: Final = 0


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


@dataclass(slots=True)
class _Batch:
    topic: bytes
    seq: int
    ts: float
    events: list[KVCacheEvent]
    dp_rank: int


@dataclass(slots=True)
class KvEventCounters:
    """What the publisher did (read by /metrics).

    Attributes:
        batches: Batches sent on the PUB socket.
        events: Events in them.
        dropped: Batches dropped because the publisher's queue was full.
        replays: Replay requests answered.
        replayed_batches: Batches sent in answer to them.
        errors: Sends or replays that failed (logged).
        peers: Subscribers (or, connecting, endpoints) the PUB socket is connected to now.
    """

    batches: int = 0
    peers: int = 0
    events: int = 0
    dropped: int = 0
    replays: int = 0
    replayed_batches: int = 0
    errors: int = 0


class KvEventStream:
    """The server's vLLM-wire publisher: a PUB socket and an optional replay ROUTER.

    ``publish`` is called on the event loop and only queues; one thread owns the sockets.

    Attributes:
        endpoint: The PUB endpoint (bound or connected to, vLLM's rule).
        replay_endpoint: The bound replay endpoint (``""``: no replay), port resolved.
        counters: What was published.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        collect: Callable[[int, str | None], concurrent.futures.Future[list[_Batch]]],
    ) -> None:
        """Open the sockets (bind errors surface here) and start the thread.

        Args:
            settings: ``kv_events_*`` settings.
            collect: Asks the event loop for every kept batch from a ``seq`` on (of one topic,
                or all); the future resolves to them in publication order per pool.

        Raises:
            ConfigError: An endpoint cannot be bound or connected to.
        """
        self.counters = KvEventCounters()
        self._int_hashes = bool(settings.kv_events_use_int_block_hashes)
        self._collect = collect
        self._max_queue = settings.kv_events_max_queue_size
        self._queue: deque[_Batch | None] = deque()
        self._signalled = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._wake_address = f"inproc://kvcm-kv-events-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_address)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_address)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(settings.kv_events_hwm)
        # Before bind/connect, so that no connection goes uncounted.
        self._monitor = self._pub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        self._replay: zmq.Socket[bytes] | None = None
        self.endpoint = settings.kv_events_endpoint
        self.replay_endpoint = ""
        try:
            if _is_bind_endpoint(self.endpoint):
                self._pub.bind(self.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(self.endpoint)
            if settings.kv_events_replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(settings.kv_events_replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"kv_events_endpoint / kv_events_replay_endpoint: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="kvcm-kv-events", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- on the event loop
    def publish(self, pool: Pool, topic: str) -> None:
        """Queue the batch ``pool`` published last (called right after it published)."""
        last = pool.last_event_batch()
        if last is None:
            return
        seq, events, ts = last
        if len(self._queue) >= self._max_queue:
            self.counters.dropped += 1
            return
        self._queue.append(_Batch(topic.encode(), seq, ts, events, _dp_rank(pool)))
        self._wake()

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout``), stop the thread and close the sockets."""
        self._queue.append(None)
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            _LOG.warning("the KV-event publisher did not stop within %.1f s", timeout)
            return
        self._close_sockets()

    def _wake(self) -> None:
        if not self._signalled:
            self._signalled = True
            # zmq.Again: the thread has unread wake-ups already.
            with contextlib.suppress(zmq.Again):
                self._wake_tx.send(b"", zmq.NOBLOCK)

    # -------------------------------------------------------------- the publisher thread
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._monitor in ready:
                self._count_peers()
            if self._wake_rx in ready:
                self._signalled = False
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                if not self._send_queued(encoder):
                    return
            if self._replay is not None and self._replay in ready:
                try:
                    self._serve_replay(encoder)
                except Exception:
                    self.counters.errors += 1
                    _LOG.exception("KV-event replay failed")

    def _count_peers(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.counters.peers = max(0, self.counters.peers - 1)
            else:
                self.counters.peers += 1

    def _send_queued(self, encoder: msgspec.msgpack.Encoder) -> bool:
        queue = self._queue
        while queue:
            batch = queue.popleft()
            if batch is None:
                return False
            try:
                payload = self._encode(encoder, batch)
                self._pub.send_multipart((batch.topic, batch.seq.to_bytes(8, "big"), payload))
            except Exception:
                self.counters.errors += 1
                _LOG.exception("KV-event batch %d not published", batch.seq)
                continue
            self.counters.batches += 1
            self.counters.events += len(batch.events)
        return True

    def _encode(self, encoder: msgspec.msgpack.Encoder, batch: _Batch) -> bytes:
        structs = _to_structs(batch.events, self._int_hashes)
        return encoder.encode(EventBatchStruct(batch.ts, structs, batch.dp_rank))

    def _serve_replay(self, encoder: msgspec.msgpack.Encoder) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) not in (3, 4) or frames[1] != b"" or len(frames[2]) != 8:
            self.counters.errors += 1
            _LOG.warning("invalid KV-event replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames[:3]
        start = int.from_bytes(start_bytes, "big")
        topic = frames[3].decode() if len(frames) == 4 else None
        batches = self._collect(start, topic).result(_REPLAY_TIMEOUT_S)
        for batch in batches:
            payload = self._encode(encoder, batch)
            self._replay.send_multipart(
                (client, b"", batch.topic, batch.seq.to_bytes(8, "big"), payload)
            )
        self._replay.send_multipart((client, b"", b"", _END_SEQ, b""))
        self.counters.replays += 1
        self.counters.replayed_batches += len(batches)

    def _close_sockets(self) -> None:
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:
            self._pub.disable_monitor()
            monitor.close(linger=0)
        for sock in (self._pub, self._replay, self._wake_rx, self._wake_tx):
            if sock is not None:
                sock.close(linger=0 if sock is not self._pub else 1000)


def _dp_rank(pool: Pool) -> int:
    """The ``data_parallel_rank`` a pool's batches carry: its ``data_parallel_rank`` label
    (an engine's DP rank), else 0 as a vLLM engine without data parallelism sends."""
    labels = pool.options.labels
    value = labels.get("data_parallel_rank")
    return int(value) if value is not None and str(value).isdigit() else _DEFAULT_DP_RANK


def collect_batches(
    pools: Sequence[tuple[Pool, str]], start: int, topic: str | None
) -> list[_Batch]:
    """Every kept batch numbered ``start`` or later of ``pools`` (each with its topic), or of
    the one whose topic is ``topic``."""
    out: list[_Batch] = []
    for pool, pool_topic in pools:
        if topic is not None and pool_topic != topic:
            continue
        encoded = pool_topic.encode()
        rank = _dp_rank(pool)
        out.extend(
            _Batch(encoded, seq, ts, events, rank)
            for seq, events, ts in pool.event_batches_from(start)
        )
    return out


def loop_collector(
    loop: asyncio.AbstractEventLoop,
    gather: Callable[[int, str | None], Coroutine[Any, Any, list[_Batch]]],
) -> Callable[[int, str | None], concurrent.futures.Future[list[_Batch]]]:
    """A ``collect`` for :class:`KvEventStream` that runs ``gather(start, topic)`` (a
    coroutine function returning the batches) on ``loop``."""

    def collect(start: int, topic: str | None) -> concurrent.futures.Future[list[_Batch]]:
        return asyncio.run_coroutine_threadsafe(gather(start, topic), loop)

    return collect
