"""The event streams the scheduler clients return: ``EventStream`` and ``AsyncEventStream``.

Written by hand, unlike the sync client (generated from the async one): iterating and cancelling
a server-streaming call is where grpc's two APIs really differ.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from kvcm.client._base import MAX_REROUTES, redirect_owner
from kvcm.client._errors import error_from_rpc
from kvcm.wire import EventBatch, decode_event_batch

__all__ = ["AsyncEventStream", "EventStream"]


class EventStream:
    """An open ``SubscribeEvents`` stream: iterate it for ``EventBatch`` es; close to stop.

    Attributes:
        pool_id: The pool.
    """

    __slots__ = ("_call", "_hash_length_bytes", "_lost", "_reopen", "pool_id")

    def __init__(
        self,
        pool_id: str,
        call: Any,
        reopen: Callable[[str], Any] | None = None,
        lost: Callable[[grpc.RpcError], object] | None = None,
    ) -> None:
        """Wrap a server-streaming call; ``reopen(owner)`` opens it again on the replica a
        cluster's redirect names (before any batch came); ``lost(exc)`` tells the client the
        stream failed (UNAVAILABLE: a dead replica), so that the next one goes elsewhere."""
        self.pool_id = pool_id
        self._call = call
        self._hash_length_bytes = 0
        self._reopen = reopen
        self._lost = lost

    def __iter__(self) -> Iterator[EventBatch]:
        received = False
        for reroute in range(MAX_REROUTES + 1):
            try:
                for message in self._call:
                    received = True
                    if message.hash_length_bytes:
                        self._hash_length_bytes = message.hash_length_bytes
                    yield decode_event_batch(message, self._hash_length_bytes)
                return
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.CANCELLED and self._call.cancelled():
                    return  # closed by us: the end of the stream, not an error
                owner = redirect_owner(exc)
                if received or owner is None or self._reopen is None or reroute == MAX_REROUTES:
                    if self._lost is not None:
                        self._lost(exc)
                    raise error_from_rpc(exc, "SubscribeEvents") from exc
                self._call = self._reopen(owner)

    def close(self) -> None:
        """Cancel the stream (iteration then ends quietly)."""
        self._call.cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncEventStream:
    """An open ``SubscribeEvents`` stream: ``async for`` it; close to stop.

    Attributes:
        pool_id: The pool.
    """

    __slots__ = ("_call", "_closed", "_hash_length_bytes", "_lost", "_reopen", "pool_id")

    def __init__(
        self,
        pool_id: str,
        call: Any,
        reopen: Callable[[str], Any] | None = None,
        lost: Callable[[grpc.RpcError], object] | None = None,
    ) -> None:
        """As :class:`EventStream`."""
        self.pool_id = pool_id
        self._call = call
        self._hash_length_bytes = 0
        self._closed = False
        self._reopen = reopen
        self._lost = lost

    async def __aiter__(self) -> AsyncIterator[EventBatch]:
        received = False
        for reroute in range(MAX_REROUTES + 1):
            try:
                async for message in self._call:
                    received = True
                    if message.hash_length_bytes:
                        self._hash_length_bytes = message.hash_length_bytes
                    yield decode_event_batch(message, self._hash_length_bytes)
                return
            except asyncio.CancelledError:
                if self._closed:
                    return
                raise
            except grpc.RpcError as exc:
                if self._closed:
                    return  # closed by us: the end of the stream, not an error
                owner = redirect_owner(exc)
                if received or owner is None or self._reopen is None or reroute == MAX_REROUTES:
                    if self._lost is not None:
                        self._lost(exc)
                    raise error_from_rpc(exc, "SubscribeEvents") from exc
                self._call = self._reopen(owner)

    def close(self) -> None:
        """Cancel the stream (iteration then ends quietly)."""
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncEventStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
