"""A real kvcm server on 127.0.0.1 for the integration tests.

One server per test session, started on free ports (gRPC and HTTP both bound to port 0) in a
background thread that runs its own asyncio event loop, exactly as ``kvcm serve`` runs it.
Tests reach it through ``kvcm_address`` (gRPC ``host:port``) and ``kvcm_http_address``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from kvcm.server.app import KVCMServer
from kvcm.server.settings import ServerSettings

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RunningServer:
    """A server running in a background thread.

    Attributes:
        grpc_address: ``127.0.0.1:<port>`` of the gRPC side.
        http_address: ``127.0.0.1:<port>`` of the HTTP side.
        server: The server object (touch it only through ``call``).
        loop: The event loop it runs on.
    """

    grpc_address: str
    http_address: str
    server: KVCMServer
    loop: asyncio.AbstractEventLoop

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)


def start_server_thread(settings: ServerSettings) -> tuple[RunningServer, threading.Thread]:
    """Start a server on its own loop in a daemon thread; returns once it serves."""
    started: dict[str, object] = {}
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            server = KVCMServer(settings)
            try:
                await server.start()
            except BaseException as exc:
                started["error"] = exc
                ready.set()
                return
            started["server"] = server
            ready.set()
            await server.wait_stopped()

        loop.run_until_complete(main())

    thread = threading.Thread(target=run, name="kvcm-test-server", daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the kvcm server did not start within 30 s")
    if "error" in started:
        raise RuntimeError("the kvcm server failed to start") from started["error"]  # type: ignore[misc]
    server = started["server"]
    assert isinstance(server, KVCMServer)
    running = RunningServer(
        grpc_address=server.grpc_address,
        http_address=server.http_address,
        server=server,
        loop=loop,
    )
    return running, thread


def stop_server_thread(running: RunningServer, thread: threading.Thread) -> None:
    """Stop a server started by ``start_server_thread`` and close its loop."""
    running.call(running.server.stop(grace_s=1.0))
    thread.join(timeout=30)
    running.loop.close()


@pytest.fixture(scope="session")
def kvcm_server() -> Iterator[RunningServer]:
    """A real kvcm server on 127.0.0.1 (gRPC and HTTP on free ports), for the whole session."""
    settings = ServerSettings(
        grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", log_level="WARNING"
    )
    running, thread = start_server_thread(settings)
    try:
        yield running
    finally:
        stop_server_thread(running, thread)


@pytest.fixture(scope="session")
def kvcm_address(kvcm_server: RunningServer) -> str:
    """``host:port`` of the session server's gRPC side."""
    return kvcm_server.grpc_address


@pytest.fixture(scope="session")
def kvcm_http_address(kvcm_server: RunningServer) -> str:
    """``host:port`` of the session server's HTTP side."""
    return kvcm_server.http_address
