"""The event streams the scheduler clients return: ``EventStream`` and ``AsyncEventStream``.

Written by hand, unlike the sync client (generated from the async one): iterating and cancelling
a server-streaming call is where grpc's two APIs really differ.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from kvcm.client._errors import error_from_rpc
from kvcm.wire import EventBatch, decode_event_batch

__all__ = ["AsyncEventStream", "EventStream"]


class EventStream:
    """An open ``SubscribeEvents`` stream: iterate it for ``EventBatch`` es; close to stop.

    Attributes:
        pool_id: The pool.
    """

    __slots__ = ("_call", "_hash_length_bytes", "pool_id")

    def __init__(self, pool_id: str, call: Any) -> None:
        """Wrap a server-streaming call."""
        self.pool_id = pool_id
        self._call = call
        self._hash_length_bytes = 0

    def __iter__(self) -> Iterator[EventBatch]:
        try:
            for message in self._call:
                if message.hash_length_bytes:
                    self._hash_length_bytes = message.hash_length_bytes
                yield decode_event_batch(message, self._hash_length_bytes)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.CANCELLED and self._call.cancelled():
                return  # closed by us: the end of the stream, not an error
            raise error_from_rpc(exc, "SubscribeEvents") from exc

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

    __slots__ = ("_call", "_closed", "_hash_length_bytes", "pool_id")

    def __init__(self, pool_id: str, call: Any) -> None:
        """Wrap a server-streaming call."""
        self.pool_id = pool_id
        self._call = call
        self._hash_length_bytes = 0
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[EventBatch]:
        try:
            async for message in self._call:
                if message.hash_length_bytes:
                    self._hash_length_bytes = message.hash_length_bytes
                yield decode_event_batch(message, self._hash_length_bytes)
        except asyncio.CancelledError:
            if self._closed:
                return
            raise
        except grpc.RpcError as exc:
            if self._closed:
                return  # closed by us: the end of the stream, not an error
            raise error_from_rpc(exc, "SubscribeEvents") from exc

    def close(self) -> None:
        """Cancel the stream (iteration then ends quietly)."""
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncEventStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
