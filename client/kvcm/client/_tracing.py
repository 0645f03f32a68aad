"""Metadata the SDK adds to every call: W3C trace context, and the bearer token if any.

When ``opentelemetry-api`` is importable, every channel the SDK opens adds the caller's current
span context (``traceparent`` / ``tracestate``, via OpenTelemetry's configured propagator) to
each call's metadata, so the server's spans join the caller's trace: sync channels through a
thin channel wrapper (cheaper per call than a gRPC interceptor), ``grpc.aio`` ones as well
(:func:`aio_intercept`; :func:`aio_interceptors` remains for a caller's own channels).
Without OpenTelemetry or a token nothing is installed; with it but no active span, a call adds
nothing. The SDK never starts spans or configures exporters itself:
that is the application's choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

__all__ = ["aio_intercept", "aio_interceptors", "intercept"]

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


class _Adding:
    """A sync multicallable whose calls carry the channel's metadata: the caller's, then the
    static pairs and the current trace context (passed through unchanged when there is
    nothing to add). Cheaper than a ``grpc.intercept_channel`` interceptor (about 0.1 ms of
    CPU a call), whose call details and outcome objects are built for every call."""

    __slots__ = ("_inner", "_static")

    def __init__(self, inner: Any, static: Metadata) -> None:
        self._inner, self._static = inner, static

    def _metadata(self, metadata: Metadata | None) -> Metadata | None:
        return _metadata(metadata, self._static)

    def __call__(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **kw: Any,
    ) -> Any:
        return self._inner(request, timeout, self._metadata(metadata), **kw)

    def with_call(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **kw: Any,
    ) -> Any:
        return self._inner.with_call(request, timeout, self._metadata(metadata), **kw)

    def future(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **kw: Any,
    ) -> Any:
        return self._inner.future(request, timeout, self._metadata(metadata), **kw)


class _MetadataChannel(grpc.Channel):  # type: ignore[misc]
    """A sync channel whose multicallables add the static metadata (a token) and the current
    trace context to every call (see :class:`_Adding`)."""

    def __init__(self, channel: grpc.Channel, static: Metadata) -> None:
        self._channel, self._static = channel, static

    def unary_unary(self, method: str, *args: Any, **kw: Any) -> _Adding:
        return _Adding(self._channel.unary_unary(method, *args, **kw), self._static)

    def unary_stream(self, method: str, *args: Any, **kw: Any) -> _Adding:
        return _Adding(self._channel.unary_stream(method, *args, **kw), self._static)

    def stream_unary(self, method: str, *args: Any, **kw: Any) -> _Adding:
        return _Adding(self._channel.stream_unary(method, *args, **kw), self._static)

    def stream_stream(self, method: str, *args: Any, **kw: Any) -> _Adding:
        return _Adding(self._channel.stream_stream(method, *args, **kw), self._static)

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Any) -> None:
        self._channel.unsubscribe(callback)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> _MetadataChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._channel.close()


class _AioAdding:
    """A ``grpc.aio`` multicallable whose calls carry the channel's metadata (as
    :class:`_Adding`): cheaper than an aio client interceptor, which wraps every call in an
    intercepted call object of its own (about 65 us of CPU a call)."""

    __slots__ = ("_inner", "_static")

    def __init__(self, inner: Any, static: Metadata) -> None:
        self._inner, self._static = inner, static

    def __call__(self, *args: Any, metadata: Metadata | None = None, **kw: Any) -> Any:
        return self._inner(*args, metadata=_metadata(metadata, self._static), **kw)


class _AioMetadataChannel(grpc.aio.Channel):  # type: ignore[misc]
    """A ``grpc.aio`` channel whose multicallables add the static metadata (a token) and the
    current trace context to every call (see :class:`_AioAdding`)."""

    def __init__(self, channel: grpc.aio.Channel, static: Metadata) -> None:
        self._channel, self._static = channel, static

    def unary_unary(self, method: str, *args: Any, **kw: Any) -> _AioAdding:
        return _AioAdding(self._channel.unary_unary(method, *args, **kw), self._static)

    def unary_stream(self, method: str, *args: Any, **kw: Any) -> _AioAdding:
        return _AioAdding(self._channel.unary_stream(method, *args, **kw), self._static)

    def stream_unary(self, method: str, *args: Any, **kw: Any) -> _AioAdding:
        return _AioAdding(self._channel.stream_unary(method, *args, **kw), self._static)

    def stream_stream(self, method: str, *args: Any, **kw: Any) -> _AioAdding:
        return _AioAdding(self._channel.stream_stream(method, *args, **kw), self._static)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    async def __aenter__(self) -> _AioMetadataChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._channel.close(None)


def aio_intercept(channel: grpc.aio.Channel, static: Metadata = ()) -> grpc.aio.Channel:
    """``channel`` (``grpc.aio``) adding ``static`` metadata (a token) and the trace context
    to every call (as it is when there is neither)."""
    if _INJECT is None and not static:
        return channel
    return _AioMetadataChannel(channel, tuple(static))


def intercept(channel: grpc.Channel, static: Metadata = ()) -> grpc.Channel:
    """``channel`` adding ``static`` metadata (a token) and the trace context to every call
    (as it is when there is neither)."""
    if _INJECT is None and not static:
        return channel
    return _MetadataChannel(channel, tuple(static))


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
