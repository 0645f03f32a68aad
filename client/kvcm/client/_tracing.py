"""Metadata the SDK adds to every call: W3C trace context, and the bearer token if any.

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


def _metadata(existing: Metadata | None, static: Metadata) -> Metadata | None:
    extra = [*static, *(_INJECT() if _INJECT is not None else ())]
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


def _with_context(details: grpc.ClientCallDetails, static: Metadata) -> grpc.ClientCallDetails:
    return _CallDetails(
        details.method,
        details.timeout,
        _metadata(details.metadata, static),
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
    """Adds the static metadata and the current trace context to every call (sync)."""

    def __init__(self, static: Metadata) -> None:
        self._static = static

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_context(details, self._static), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_context(details, self._static), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_context(details, self._static), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_context(details, self._static), requests)


def intercept(channel: grpc.Channel, static: Metadata = ()) -> grpc.Channel:
    """``channel`` adding ``static`` metadata (a token) and the trace context to every call
    (as it is when there is neither)."""
    if _INJECT is None and not static:
        return channel
    return grpc.intercept_channel(channel, _Propagator(tuple(static)))


def _aio_details(details: Any, static: Metadata) -> Any:
    metadata = _metadata(tuple(details.metadata or ()), static)
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        grpc.aio.Metadata(*metadata) if metadata else details.metadata,
        details.credentials,
        details.wait_for_ready,
    )


class _AioStatic:
    def __init__(self, static: Metadata) -> None:
        self._static = static


class _AioUnaryUnary(_AioStatic, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self._static), request)


class _AioUnaryStream(_AioStatic, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self._static), request)


class _AioStreamUnary(_AioStatic, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_aio_details(details, self._static), requests)


def aio_interceptors(static: Metadata = ()) -> list[Any]:
    """Interceptors for ``grpc.aio`` channels (none without a token and OpenTelemetry)."""
    if _INJECT is None and not static:
        return []
    static = tuple(static)
    return [_AioUnaryUnary(static), _AioUnaryStream(static), _AioStreamUnary(static)]
