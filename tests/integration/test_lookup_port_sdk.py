"""The SDK's lookup-port connection shared by callers, against a fake port on 127.0.0.1 that
answers each request after a delay (so that one lookup is in flight while another waits):
a caller that times out waiting for the connection leaves it alone, and close() during a
lookup leaves nothing open."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcm.client import DeadlineExceededError, UnavailableError
from kvcm.client._lookup_port import AsyncLookupPortConnection, LookupPortConnection
from kvcm.v1 import lookup_pb2
from kvcm.wire.lookup_port import (
    HEADER,
    FrameKind,
    decode_header,
    encode_answer,
    encode_frame,
    split_id,
)

DELAY_S = 0.4


class SlowPort:
    """A lookup port that accepts any HELLO and answers every request (7 pools in scope)
    ``DELAY_S`` after reading it; counts connections and requests."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.requests = 0
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self.open.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        reader = sock.makefile("rb")
        answer = lookup_pb2.LookupResponse(num_pools_in_scope=7).SerializeToString()
        try:
            while header := reader.read(HEADER.size):
                kind, length = decode_header(header)
                payload = reader.read(length)
                if kind is FrameKind.HELLO:
                    sock.sendall(encode_frame(FrameKind.HELLO, b""))
                    continue
                self.requests += 1
                time.sleep(DELAY_S)
                sock.sendall(encode_answer(split_id(payload)[0], answer))
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for sock in self.open:
            sock.close()


@pytest.fixture
def slow_port() -> Iterator[SlowPort]:
    port = SlowPort()
    try:
        yield port
    finally:
        port.close()


REQUEST = lookup_pb2.LookupRequest()


def test_sync_lookup_waits_for_the_connection_within_its_deadline(slow_port: SlowPort) -> None:
    """A thread whose deadline passes while another thread's lookup holds the connection gets
    DeadlineExceededError at its deadline, sends nothing and leaves the connection open."""
    connection = LookupPortConnection(slow_port.address, token=None, tls=None)
    assert connection.lookup(REQUEST, 5.0).num_pools_in_scope == 7  # opened
    with ThreadPoolExecutor(1) as thread:
        first = thread.submit(connection.lookup, REQUEST, 5.0)
        time.sleep(0.1)  # in flight, holding the connection
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            connection.lookup(REQUEST, 0.1)
        assert time.monotonic() - started < DELAY_S - 0.1  # not after the other's answer
        assert first.result().num_pools_in_scope == 7
    assert connection.lookup(REQUEST, 5.0).num_pools_in_scope == 7
    assert (slow_port.connections, slow_port.requests) == (1, 3)  # the timed-out one: unsent
    connection.close()
    with pytest.raises(UnavailableError, match="closed"):
        connection.lookup(REQUEST, 5.0)
    assert slow_port.connections == 1


def test_async_lookup_timing_out_on_the_lock_leaves_the_connection_alone(
    slow_port: SlowPort,
) -> None:
    """A coroutine that times out waiting for the connection does not close it under the
    coroutine using it: that one's answer arrives on the same connection, sent once."""

    async def run() -> None:
        connection = AsyncLookupPortConnection(slow_port.address, token=None, tls=None)
        assert (await connection.lookup(REQUEST, 5.0)).num_pools_in_scope == 7
        first = asyncio.create_task(connection.lookup(REQUEST, 5.0))
        await asyncio.sleep(0.1)
        with pytest.raises(DeadlineExceededError):
            await connection.lookup(REQUEST, 0.1)
        assert (await first).num_pools_in_scope == 7
        assert (slow_port.connections, slow_port.requests) == (1, 2)
        await connection.close()

    asyncio.run(run())


def test_async_close_during_a_lookup_reopens_nothing(slow_port: SlowPort) -> None:
    """close() while a lookup is in flight: that lookup raises UnavailableError instead of
    reconnecting (a connection nobody would close), and so does a later one."""

    async def run() -> None:
        connection = AsyncLookupPortConnection(slow_port.address, token=None, tls=None)
        await connection.lookup(REQUEST, 5.0)
        in_flight = asyncio.create_task(connection.lookup(REQUEST, 5.0))
        await asyncio.sleep(0.1)
        await connection.close()
        with pytest.raises(UnavailableError):
            await in_flight
        with pytest.raises(UnavailableError, match="closed"):
            await connection.lookup(REQUEST, 5.0)
        assert connection._streams is None
        assert slow_port.connections == 1

    asyncio.run(run())
