"""W3C trace-context propagation from the SDK to the server (when OpenTelemetry is there).

When ``opentelemetry-api`` is importable, every channel the SDK opens gets a client
interceptor that adds the caller's current span context (``traceparent`` / ``tracestate``,
via OpenTelemetry's configured propagator) to each call's metadata, so the server's spans
join the caller's trace. Without OpenTelemetry no interceptor is installed; with it but no
active span, a call adds nothing. The SDK never starts spans or configures exporters itself:
that is the application's choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grpc

__all__ = ["aio_interceptors", "intercept"]

Metadata = Sequence[tuple[str, str | bytes]]


def _injector() -> Callable[[], list[tuple[str, str]]] | None:
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        return None

    def current() -> list[tuple[str, str]]:
        if not trace.get_current_span().get_span_context().is_valid:
            return []
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return list(carrier.items())

    return current


_INJECT = _injector()


def _metadata(existing: Metadata | None) -> Metadata | None:
    assert _INJECT is not None
    extra = _INJECT()
    if not extra:
        return existing
    return [*(existing or ()), *extra]


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Metadata | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: Any


class _CallDetails(_Details, grpc.ClientCallDetails):  # type: ignore[misc]
    """``grpc.ClientCallDetails`` with the trace context added to the metadata."""


def _with_context(details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
    return _CallDetails(
        details.method,
        details.timeout,
        _metadata(details.metadata),
        details.credentials,
        getattr(details, "wait_for_ready", None),
        getattr(details, "compression", None),
    )


class _Propagator(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds the current trace context to every call (sync channels)."""

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_context(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_context(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_context(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_context(details), requests)


def intercept(channel: grpc.Channel) -> grpc.Channel:
    """``channel`` with trace-context propagation when OpenTelemetry is importable."""
    if _INJECT is None:
        return channel
    return grpc.intercept_channel(channel, _Propagator())


def _aio_details(details: Any) -> Any:
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        _metadata(details.metadata),
        details.credentials,
        details.wait_for_ready,
    )


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_aio_details(details), requests)


def aio_interceptors() -> list[Any]:
    """Interceptors for ``grpc.aio`` channels (empty without OpenTelemetry)."""
    if _INJECT is None:
        return []
    return [_AioUnaryUnary(), _AioUnaryStream(), _AioStreamUnary()]
