"""A kvcm server in a background thread of the calling process.

``kvcm serve`` owns its process's event loop. The demo and the integration tests instead run the
same server on its own loop in a daemon thread, so that synchronous code (the SDK's sync
clients) can call it from the main thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from kvcm.server.app import KVCMServer
from kvcm.server.settings import ServerSettings

__all__ = ["EmbeddedServer", "start_embedded_server"]

T = TypeVar("T")

_START_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class EmbeddedServer:
    """A server running in a background thread.

    Attributes:
        grpc_address: ``host:port`` of the gRPC side (the bound port when 0 was asked for).
        http_address: ``host:port`` of the HTTP side (``""`` without one).
        lookup_address: ``host:port`` of the lookup port (``""`` without one).
        server: The server object; touch it only through ``call``.
        loop: The event loop it runs on.
        thread: The thread running the loop.
    """

    grpc_address: str
    http_address: str
    server: KVCMServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    lookup_address: str = ""

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self, grace_s: float = 1.0) -> None:
        """Shut the server down gracefully, join its thread and close its loop."""
        self.call(self.server.stop(grace_s=grace_s))
        self.thread.join(timeout=_START_TIMEOUT_S)
        self.loop.close()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def start_embedded_server(settings: ServerSettings, *, span_exporter: Any = None) -> EmbeddedServer:
    """Start a server on its own loop in a daemon thread; returns once it serves.

    ``span_exporter``: an OpenTelemetry span exporter that turns tracing on (tests).

    Raises:
        RuntimeError: The server did not start (the cause says why, e.g. a port in use).
    """
    outcome: dict[str, object] = {}
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            server = KVCMServer(settings, span_exporter=span_exporter)
            try:
                await server.start()
            except BaseException as exc:
                outcome["error"] = exc
                ready.set()
                return
            outcome["server"] = server
            ready.set()
            await server.wait_stopped()

        loop.run_until_complete(main())

    thread = threading.Thread(target=run, name="kvcm-embedded-server", daemon=True)
    thread.start()
    if not ready.wait(_START_TIMEOUT_S):
        raise RuntimeError(f"the kvcm server did not start within {_START_TIMEOUT_S:.0f} s")
    error = outcome.get("error")
    if error is not None:
        thread.join(timeout=_START_TIMEOUT_S)
        loop.close()
        raise RuntimeError(f"the kvcm server failed to start: {error}") from (
            error if isinstance(error, BaseException) else None
        )
    server = outcome["server"]
    assert isinstance(server, KVCMServer)
    return EmbeddedServer(
        grpc_address=server.grpc_address,
        http_address=server.http_address,
        server=server,
        loop=loop,
        thread=thread,
        lookup_address=server.lookup_address,
    )
