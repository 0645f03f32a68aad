"""EventService: the sequenced KV-event stream of a pool, with resume."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final, TypeAlias

import grpc

from kvcm.common.errors import NotFoundError
from kvcm.server.rpc._state import ServerState
from kvcm.server.rpc._status import AbortRpc
from kvcm.v1 import events_pb2, service_pb2_grpc
from kvcm.wire import events_to_proto

__all__ = ["EventServicer"]

# grpc ships no type information: its context is Any to mypy.
Context: TypeAlias = Any
_MAX_EVENTS_PER_MESSAGE: Final = 1024
# RegisterWorker answers this long before the client's deadline, so its own message arrives.
_DEADLINE_MARGIN_S: Final = 0.02


class EventServicer(service_pb2_grpc.EventServiceServicer):
    """SubscribeEvents."""

    def __init__(self, state: ServerState) -> None:
        """Serve ``state``'s registry."""
        self._state = state

    async def SubscribeEvents(  # noqa: N802
        self, request: events_pb2.SubscribeEventsRequest, context: Context
    ) -> AsyncIterator[events_pb2.SubscribeEventsResponse]:
        """Stream the pool's events from start_sequence on (see events.proto)."""
        pool = self._state.registry.get(request.pool_id)
        runtime = self._state.runtimes[pool.name]
        start = request.start_sequence if request.HasField("start_sequence") else None
        sequence = pool.check_event_start(start)
        limit = request.max_events_per_message or _MAX_EVENTS_PER_MESSAGE
        limit = min(limit, _MAX_EVENTS_PER_MESSAGE)
        hash_length = pool.hashing.hash_length_bytes
        yield events_pb2.SubscribeEventsResponse(
            first_sequence=sequence,
            hash_length_bytes=hash_length,
            oldest_sequence=pool.oldest_event_sequence,
        )
        while True:
            waiter = runtime.events
            got = pool.events_from(sequence, limit)
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
                    events=events_to_proto(events, hash_length),
                    timestamp_unix_seconds=stamp,
                )
                sequence += len(events)
                continue
            await waiter.wait()
            if runtime.deleted:
                raise NotFoundError(f"pool {pool.name!r} was deleted")
            if not self._state.serving:
                raise AbortRpc(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the server is shutting down; resume from sequence {sequence}",
                )
