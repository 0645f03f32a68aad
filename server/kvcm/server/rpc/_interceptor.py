"""The server interceptor: the error table applied to every kvcm RPC, and RPC statistics.

Servicers raise; this wraps each kvcm.v1 handler so that a :mod:`kvcm.common.errors` class
becomes its status (with the Step rejection trailer where there is one), an unexpected
exception becomes INTERNAL (logged), and every finished call is observed once in
:class:`~kvcm.server.telemetry.RpcStats` with its method, status code and duration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvcm.common.errors import KVCMError
from kvcm.server.rpc._log import log_call_rejected
from kvcm.server.rpc._status import AbortRpc, StepRejectedError, status_details, status_of
from kvcm.server.telemetry import RpcStats

__all__ = ["MethodInterceptor", "TelemetryInterceptor"]

_LOG = logging.getLogger("kvcm.server.rpc")
_PREFIX = "/kvcm.v1."


async def _abort(context: Any, exc: BaseException) -> str:
    """Map ``exc`` to its status and end the call; returns the code's name."""
    if isinstance(exc, AbortRpc):
        code, details = exc.code, exc.details
    elif isinstance(exc, KVCMError):
        code, details = status_of(exc), str(exc)
    else:
        _LOG.exception("internal error")
        code, details = grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"
    trailer = exc.trailer() if isinstance(exc, StepRejectedError) else ()
    await context.abort(code, status_details(details), trailer)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


class MethodInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A server interceptor that wraps each kvcm.v1 method's handler once, on its first call.

    Subclasses implement :meth:`_wrap`; other services' handlers (health, reflection) pass
    through untouched.
    """

    def __init__(self) -> None:
        """An empty cache of wrapped handlers."""
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The method's wrapped handler (built once)."""
        full_name: str = handler_call_details.method
        wrapped = self._wrapped.get(full_name)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None or not full_name.startswith(_PREFIX):
            return handler
        wrapped = self._wrap_full(full_name, handler)
        self._wrapped[full_name] = wrapped
        return wrapped

    def _wrap_full(self, full_name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` of ``full_name`` (``"/kvcm.v1.SchedulerService/Step"``) wrapped.

        By default :meth:`_wrap` with the short name; override where the service matters.
        """
        return self._wrap(full_name.rsplit("/", 1)[-1], handler)

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` of ``method`` (``"Step"``) wrapped, or as it is."""
        raise NotImplementedError


class TelemetryInterceptor(MethodInterceptor):
    """Applies the error table and observes every kvcm RPC (see the module docstring)."""

    def __init__(self, stats: RpcStats) -> None:
        """Observe into ``stats``."""
        super().__init__()
        self._stats = stats

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        # Each kind's behavior wrapped by the wrapper of its shape (one answer or a stream),
        # with the handler's serializers.
        serializers = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        for kind, make, wrap in (
            ("unary_unary", grpc.unary_unary_rpc_method_handler, self._unary),
            ("stream_unary", grpc.stream_unary_rpc_method_handler, self._unary),
            ("unary_stream", grpc.unary_stream_rpc_method_handler, self._stream),
            # ReplicaService.ShipRecords
            ("stream_stream", grpc.stream_stream_rpc_method_handler, self._stream),
        ):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(wrap(method, behavior), **serializers)
        return handler

    def _unary(self, method: str, behavior: Any) -> Any:
        stats = self._stats

        async def wrapped(request: Any, context: Any) -> Any:
            async with _Observed(stats, method, context):
                return await behavior(request, context)

        return wrapped

    def _stream(self, method: str, behavior: Any) -> Any:
        stats = self._stats

        async def wrapped(request: Any, context: Any) -> AsyncIterator[Any]:
            async with _Observed(stats, method, context):
                async for item in behavior(request, context):
                    yield item

        return wrapped


class _Observed:
    """One call's observation: its duration and status code counted once when it ends; a
    servicer's error (not a grpc abort of its own) logged, counted before its status leaves
    (a client that reads /metrics right after its error must find the call there) and turned
    into the call's status."""

    __slots__ = ("_context", "_method", "_started", "_stats")

    def __init__(self, stats: RpcStats, method: str, context: Any) -> None:
        self._stats, self._method, self._context = stats, method, context
        self._started = 0.0

    async def __aenter__(self) -> None:
        self._started = time.perf_counter()

    async def __aexit__(self, kind: object, exc: BaseException | None, trace: object) -> bool:
        method, code = self._method, "OK"
        if isinstance(exc, asyncio.CancelledError):
            code = "CANCELLED"
        elif isinstance(exc, Exception) and type(exc).__module__.startswith("grpc"):
            aborted = self._context.code()  # an abort of its own (a cluster's redirect): its code
            if isinstance(aborted, grpc.StatusCode):
                code = aborted.name
        elif isinstance(exc, Exception):
            code = status_of(exc).name if not isinstance(exc, AbortRpc) else exc.code.name
            log_call_rejected(method, code, exc)
            self._stats.observe(method, code, time.perf_counter() - self._started)
            await _abort(self._context, exc)
        self._stats.observe(method, code, time.perf_counter() - self._started)
        return False
