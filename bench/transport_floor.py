"""Benchmark: the floor of each transport a router could reach kvcm by, without kvcm in it.

An echo server in a process of its own answers a 32 KiB request (a hashed 1k-block prompt is
32 KiB of sha256 hashes) with 200 bytes (a best-5 answer); the client in this process calls it
with a gap between calls (10 ms by default, as a router asks once per request placed, so each
call finds both processes idle, as in production), over:

1. gRPC, ``grpc.aio`` server (kvcm's) and a sync ``grpc`` channel (the SDK's);
2. gRPC, a sync ``grpc.server`` with a thread pool;
3. an ``asyncio.Protocol`` server answering length-prefixed frames on its event loop (the
   lookup port's shape, docs/lookup.md#the-lookup-port), a blocking socket client;
4. a blocking socket server in a thread (the floor of two Python processes on loopback).

Prints median and p99 per transport. On the 2-core VM of session 8 gRPC's floor was about
2 ms p50 whatever the server, ten times the sockets': every gRPC call crosses several threads
(grpcio's poller, its completion queue, the asyncio loop's wakeup), each paying a wakeup on an
idle machine. Hence the lookup port.

    python bench/transport_floor.py [--calls 300] [--gap-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Callable
from concurrent import futures
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import grpc

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from _common import Timing

REQUEST_BYTES = 32 * 1024
ANSWER_BYTES = 200
_METHOD = "/floor.Echo/Call"


def _echo(request: bytes, context: Any) -> bytes:
    return request[:ANSWER_BYTES]


async def _aecho(request: bytes, context: Any) -> bytes:
    return request[:ANSWER_BYTES]


def _handlers(behavior: Callable[..., Any]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "floor.Echo", {"Call": grpc.unary_unary_rpc_method_handler(behavior)}
    )


def _serve_grpc_aio(ports: Queue[int]) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handlers(_aecho),))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _serve_grpc_sync(ports: Queue[int]) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((_handlers(_echo),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


class _FrameEcho(asyncio.Protocol):
    """4-byte little-endian length, then the payload; answered with its first 200 bytes."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= 4:
            length = int.from_bytes(buffer[:4], "little")
            if len(buffer) < 4 + length:
                return
            answer = bytes(buffer[4 : 4 + ANSWER_BYTES])
            del buffer[: 4 + length]
            assert self._transport is not None
            self._transport.write(len(answer).to_bytes(4, "little") + answer)


def _serve_asyncio(ports: Queue[int]) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_FrameEcho, "127.0.0.1", 0)
        ports.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def _serve_socket(ports: Queue[int]) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        length = int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "little")
        data = conn.recv(length, socket.MSG_WAITALL)
        if not data:
            return
        answer = data[:ANSWER_BYTES]
        conn.sendall(len(answer).to_bytes(4, "little") + answer)


def _grpc_caller(port: int) -> Callable[[bytes], bytes]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(_METHOD)
    return lambda payload: call(payload, timeout=10)  # type: ignore[no-any-return]


def _socket_caller(port: int) -> Callable[[bytes], bytes]:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call(payload: bytes) -> bytes:
        conn.sendall(len(payload).to_bytes(4, "little") + payload)
        length = int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "little")
        return conn.recv(length, socket.MSG_WAITALL)

    return call


TRANSPORTS: tuple[tuple[str, Callable[[Queue[int]], None], Callable[[int], Any]], ...] = (
    ("gRPC, grpc.aio server (kvcm's), sync client", _serve_grpc_aio, _grpc_caller),
    ("gRPC, sync grpc.server, sync client", _serve_grpc_sync, _grpc_caller),
    ("asyncio.Protocol server (the lookup port's shape)", _serve_asyncio, _socket_caller),
    ("blocking socket server (the floor)", _serve_socket, _socket_caller),
)


def measure(
    serve: Callable[[Queue[int]], None],
    caller: Callable[[int], Callable[[bytes], bytes]],
    calls: int,
    gap_s: float,
) -> Timing:
    """Start ``serve`` in a process, then time ``calls`` calls with ``gap_s`` between them."""
    context = multiprocessing.get_context("spawn")
    ports: Queue[int] = context.Queue()
    process = context.Process(target=serve, args=(ports,), daemon=True)
    process.start()
    try:
        call = caller(ports.get(timeout=60))
        payload = os.urandom(REQUEST_BYTES)
        for _ in range(50):  # connection, first calls
            assert len(call(payload)) == ANSWER_BYTES
        samples = []
        for _ in range(calls):
            time.sleep(gap_s)
            start = time.perf_counter()
            call(payload)
            samples.append(time.perf_counter() - start)
        return Timing.of(samples)
    finally:
        process.kill()
        process.join(10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--calls", type=int, default=300, help="timed calls per transport")
    parser.add_argument("--gap-ms", type=float, default=10.0, help="idle time between calls")
    args = parser.parse_args(argv)
    print(
        f"echo of {REQUEST_BYTES // 1024} KiB -> {ANSWER_BYTES} B between two processes, "
        f"{args.gap_ms:g} ms between calls, {args.calls} calls each (ms)"
    )
    width = max(len(name) for name, _, _ in TRANSPORTS)
    print(f"{'transport':<{width}} {'p50':>7} {'p99':>7}")
    for name, serve, caller in TRANSPORTS:
        timing = measure(serve, caller, args.calls, args.gap_ms / 1e3)
        print(f"{name:<{width}} {timing.median_ms:>7.3f} {timing.p99_ms:>7.3f}")


if __name__ == "__main__":
    main()
