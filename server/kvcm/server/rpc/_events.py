"""EventService: the sequenced KV-event stream of a pool, with resume."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Final, TypeAlias

import grpc

from kvcm.common.errors import FailedPreconditionError, NotFoundError, ResourceExhaustedError
from kvcm.core.pool import Pool
from kvcm.server.rpc._state import PoolRuntime, ServerState
from kvcm.server.rpc._status import AbortRpc
from kvcm.v1 import events_pb2, service_pb2_grpc
from kvcm.wire import events_to_proto

__all__ = ["EventServicer", "subscriber_keepalive"]

_LOG = logging.getLogger("kvcm.server.leases")

# grpc ships no type information: its context is Any to mypy.
Context: TypeAlias = Any
_MAX_EVENTS_PER_MESSAGE: Final = 1024


def subscriber_keepalive(lease_s: float) -> list[tuple[str, int]]:
    """gRPC server options that end a stopped reader's streams within about ``lease_s``.

    A reader whose process stopped (paused, hung, its host gone) answers no HTTP/2 PING:
    the server pings every connection after ``lease_s / 2`` without traffic and closes it
    when the answer takes longer than ``lease_s / 2``, ending its streams whether or not a
    write was blocked. Pings are sent whatever data the connection carries
    (``max_pings_without_data`` 0: an idle event stream sends none). Empty for 0 (off).
    """
    if not lease_s > 0:
        return []
    half_ms = max(int(lease_s * 500), 1)
    return [
        ("grpc.keepalive_time_ms", half_ms),
        ("grpc.keepalive_timeout_ms", half_ms),
        ("grpc.http2.ping_timeout_ms", half_ms),  # what enforces the timeout (grpc 1.85)
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _check_epoch(request: events_pb2.SubscribeEventsRequest, pool: Pool) -> None:
    """Refuse a resume position that belongs to another incarnation of the pool."""
    if request.HasField("expected_epoch") and request.expected_epoch != pool.epoch:
        raise FailedPreconditionError(
            f"pool {pool.name!r} is at epoch {pool.epoch}, not expected_epoch "
            f"{request.expected_epoch}: it was re-created and its sequence numbers restarted; "
            "drop the pool's index and subscribe from the live edge",
            field="expected_epoch",
        )


class _ReadDeadline:
    """Ends a stream whose reader took a lease of the server's awake time to accept a message.

    Counted in awake time (``ServerState.clock``): when the server itself stalled, the reader
    could not read either, so the timer fires again for what is left of the lease.
    """

    __slots__ = ("_deadline", "_handle", "_lease", "_pool_id", "_state", "_task")

    def __init__(
        self, state: ServerState, task: asyncio.Task[Any], pool_id: str, lease: float
    ) -> None:
        self._state = state
        self._task = task
        self._pool_id = pool_id
        self._lease = lease
        self._deadline = state.clock.awake() + lease
        self._handle = asyncio.get_running_loop().call_later(lease, self._fire)

    def cancel(self) -> None:
        self._handle.cancel()

    def _fire(self) -> None:
        left = self._deadline - self._state.clock.awake()
        if left > 0:
            self._handle = asyncio.get_running_loop().call_later(left, self._fire)
            return
        key = (self._pool_id, "subscriber")
        self._state.reclaims[key] = self._state.reclaims.get(key, 0) + 1
        _LOG.info(
            "subscriber lease expired: stream ended",
            extra={"event": "lease_reclaimed", "pool": self._pool_id, "lease": "subscriber",
                   "idle_s": self._lease, "requests": 0, "cleared": False},
        )  # fmt: skip
        self._task.cancel()


class EventServicer(service_pb2_grpc.EventServiceServicer):
    """SubscribeEvents."""

    def __init__(self, state: ServerState) -> None:
        """Serve ``state``'s registry."""
        self._state = state

    async def SubscribeEvents(  # noqa: N802
        self, request: events_pb2.SubscribeEventsRequest, context: Context
    ) -> AsyncIterator[events_pb2.SubscribeEventsResponse]:
        """Stream the pool's events from start_sequence on (see events.proto)."""
        pool = await self._state.pool(request.pool_id)
        runtime = self._state.runtimes[pool.name]
        _check_epoch(request, pool)
        start = request.start_sequence if request.HasField("start_sequence") else None
        sequence = pool.check_event_start(start)
        visible = self._state.visible_events(pool)
        if visible is not None:  # events its standby does not have yet are not out yet
            sequence = min(sequence, visible + 1)
        limit = self._state.limits.max_subscribers_per_pool
        if runtime.subscribers >= limit:
            raise ResourceExhaustedError(
                f"pool {pool.name!r} holds its limit of {limit} live event subscriptions "
                "(limits.max_subscribers_per_pool)"
            )
        runtime.subscribers += 1
        lease = self._state.subscriber_lease_s
        task = asyncio.current_task()
        try:
            async for message in self._stream(request, pool, runtime, sequence):
                if not lease or task is None:
                    yield message
                    continue
                # A reader that takes longer than the lease to accept one message has
                # stopped reading: its stream is ended, freeing what it holds.
                deadline = _ReadDeadline(self._state, task, pool.name, lease)
                try:
                    yield message
                finally:
                    deadline.cancel()
        finally:
            runtime.subscribers -= 1

    async def _stream(
        self,
        request: events_pb2.SubscribeEventsRequest,
        pool: Pool,
        runtime: PoolRuntime,
        sequence: int,
    ) -> AsyncIterator[events_pb2.SubscribeEventsResponse]:
        limit = request.max_events_per_message or _MAX_EVENTS_PER_MESSAGE
        limit = min(limit, _MAX_EVENTS_PER_MESSAGE)
        hash_length = pool.hashing.hash_length_bytes
        yield events_pb2.SubscribeEventsResponse(
            first_sequence=sequence,
            hash_length_bytes=hash_length,
            oldest_sequence=pool.oldest_event_sequence,
            pool_epoch=pool.epoch,
        )
        lanes = self._state.lanes
        while True:
            # A long Step publishes its events in its lane: the log is read between calls.
            while (busy := lanes.get(pool.name)) is not None:
                await busy.wait()
            # Checked after every write too: a reader that was backed up when the pool was
            # deleted gets NOT_FOUND next, not the deleted pool's remaining events.
            self._check_live(pool, runtime, sequence)
            waiter = runtime.events
            visible = self._state.visible_events(pool)
            if visible is not None and visible < sequence:  # held for the standby
                await waiter.wait()
                continue
            got = pool.events_from(
                sequence, limit if visible is None else min(limit, visible + 1 - sequence)
            )
            if got is None:
                raise AbortRpc(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"subscriber fell behind: events from {sequence} were dropped; resume "
                    "from the live edge",
                )
            events, stamp = got
            if events:
                yield events_pb2.SubscribeEventsResponse(
                    first_sequence=sequence,
                    events=events_to_proto(events),
                    timestamp_unix_seconds=stamp,
                    pool_epoch=pool.epoch,
                )
                sequence += len(events)
                continue
            await waiter.wait()

    def _check_live(self, pool: Pool, runtime: PoolRuntime, sequence: int) -> None:
        if runtime.deleted:
            raise NotFoundError(f"pool {pool.name!r} (epoch {pool.epoch}) was deleted")
        if not self._state.serving:
            raise AbortRpc(
                grpc.StatusCode.UNAVAILABLE,
                f"the server is shutting down; resume from sequence {sequence} with "
                f"expected_epoch {pool.epoch}",
            )
