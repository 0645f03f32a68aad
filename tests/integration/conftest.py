"""A real kvcm server on 127.0.0.1 for the integration tests.

One server per test session, started on free ports (gRPC and HTTP both bound to port 0) in a
background thread that runs its own asyncio event loop, exactly as ``kvcm serve`` runs it.
Tests reach it through ``kvcm_address`` (gRPC ``host:port``) and ``kvcm_http_address``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvcm.client import SchedulerClient
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

# The integration tests' name for the embedded server.
RunningServer = EmbeddedServer


def start_server_thread(settings: ServerSettings) -> tuple[EmbeddedServer, threading.Thread]:
    """Start a server on its own loop in a daemon thread; returns once it serves."""
    running = start_embedded_server(settings)
    return running, running.thread


def stop_server_thread(running: EmbeddedServer, thread: threading.Thread) -> None:
    """Stop a server started by ``start_server_thread`` and close its loop."""
    del thread
    running.stop(grace_s=1.0)


@pytest.fixture(scope="session")
def kvcm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A real kvcm server on 127.0.0.1 (gRPC, HTTP and the lookup port on free ports), for the
    whole session; it publishes the ZMQ KV-event stream on a local ipc socket, so every metric
    is scraped."""
    settings = ServerSettings(
        grpc_address="127.0.0.1:0",
        http_address="127.0.0.1:0",
        log_level="WARNING",
        kv_events_endpoint=f"ipc://{tmp_path_factory.mktemp('kv-events')}/pub",
        lookup_address="127.0.0.1:0",
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


@pytest.fixture
def client(kvcm_address: str) -> Iterator[SchedulerClient]:
    """A scheduler SDK client of the session server (10 s per call, so a hung call fails the
    test instead of the run)."""
    with SchedulerClient(kvcm_address, timeout=10.0) as sdk:
        yield sdk
