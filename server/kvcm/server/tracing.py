"""OpenTelemetry tracing of the server (the optional extra ``kvcm[tracing]``).

Off unless configured: ``--otlp-endpoint`` (``KVCM_OTLP_ENDPOINT``, ``[server]
otlp_endpoint``) or OpenTelemetry's own ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``. When off, nothing of this module runs on a call: no
interceptor is installed and the Step path takes no phase hook. When on:

* every kvcm.v1 RPC is one SERVER span named ``kvcm.v1.<Service>/<Method>`` (attributes
  ``rpc.system``, ``rpc.service``, ``rpc.method``, ``rpc.grpc.status_code``,
  ``kvcm.pool_id``), a child of the caller's span when the call carries W3C trace context
  (the SDK adds it);
* a Step has child spans for its phases: ``kvcm.step.decode`` (wire to program),
  ``kvcm.step.validate`` and ``kvcm.step.execute`` (the interpreter's two halves) and
  ``kvcm.step.encode``;
* spans leave through a batching OTLP/gRPC exporter; the service name is ``kvcm`` unless
  ``OTEL_SERVICE_NAME`` says otherwise; ``--trace-sample-ratio`` samples root spans (calls that
  carry a sampled parent are always traced).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import grpc

from kvcm.common.errors import ConfigError
from kvcm.server.rpc import MethodInterceptor
from kvcm.v1 import service_pb2

if TYPE_CHECKING:
    from kvcm.core.step import PhaseHook
    from kvcm.server.settings import ServerSettings

__all__ = ["Tracing", "build_tracing", "tracing_wanted"]

_PREFIX = "/kvcm.v1."
# Method name -> its full name, "/kvcm.v1.SchedulerService/Step" (method names are unique).
_SERVICES = {
    method.name: f"/{service.full_name}/{method.name}"
    for service in service_pb2.DESCRIPTOR.services_by_name.values()
    for method in service.methods
}
_OTEL_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def tracing_wanted(settings: ServerSettings, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the settings or OpenTelemetry's variables ask for traces."""
    env = os.environ if environ is None else environ
    return bool(settings.otlp_endpoint) or any(env.get(name) for name in _OTEL_ENDPOINTS)


def build_tracing(settings: ServerSettings, exporter: Any = None) -> Tracing | None:
    """The server's tracing, or ``None`` when it is not wanted (and no ``exporter`` given).

    Args:
        settings: The server's settings.
        exporter: A span exporter to use instead of OTLP (tests: an in-memory exporter);
            spans are then exported one by one, synchronously.

    Raises:
        ConfigError: Tracing is configured but the ``tracing`` extra is not installed.
    """
    if exporter is None and not tracing_wanted(settings):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError:
        raise ConfigError(
            "otlp_endpoint: tracing is configured but OpenTelemetry's SDK is not installed; "
            "pip install 'kvcm[tracing]'"
        ) from None
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "kvcm")})
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio))
    )
    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError(
                "otlp_endpoint: the OTLP exporter is not installed; pip install 'kvcm[tracing]'"
            ) from None
        endpoint = settings.otlp_endpoint or None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider)


class Tracing:
    """The server's tracer: the RPC interceptor and the Step phase spans."""

    def __init__(self, provider: Any) -> None:
        """Trace through ``provider`` (an OpenTelemetry SDK ``TracerProvider``)."""
        from opentelemetry import propagate, trace

        self._provider = provider
        self._tracer = provider.get_tracer("kvcm.server")
        self._extract = propagate.extract
        self._server_kind = trace.SpanKind.SERVER
        self._status = trace.Status
        self._error = trace.StatusCode.ERROR

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Any]:
        """A child span of the current one (a Step phase)."""
        with self._tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def phase_hook(self) -> PhaseHook:
        """The interpreter's phase hook: ``kvcm.step.<phase>`` spans."""

        tracer = self._tracer

        def phase(name: str) -> contextlib.AbstractContextManager[object]:
            span: contextlib.AbstractContextManager[object] = tracer.start_as_current_span(
                f"kvcm.step.{name}"
            )
            return span

        return phase

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """A server interceptor that wraps every kvcm.v1 call in a SERVER span."""
        return _TracingInterceptor(self)

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter."""
        self._provider.shutdown()

    # ------------------------------------------------------------------ call spans
    def _start(self, method: str, context: Any, request: Any) -> Any:
        carrier = dict(context.invocation_metadata() or ())
        parent = self._extract(carrier)
        service, _, name = method[len(_PREFIX) :].partition("/")
        attributes: dict[str, Any] = {
            "rpc.system": "grpc",
            "rpc.service": f"kvcm.v1.{service}",
            "rpc.method": name,
        }
        pool_id = getattr(request, "pool_id", None)
        if isinstance(pool_id, str) and pool_id:
            attributes["kvcm.pool_id"] = pool_id
        return self._tracer.start_as_current_span(
            f"kvcm.v1.{service}/{name}",
            context=parent,
            kind=self._server_kind,
            attributes=attributes,
        )

    def _finish(self, span: Any, context: Any, error: BaseException | None) -> None:
        code = _code_of(context, error)
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_status(self._status(self._error, code.name))


def _code_of(context: Any, error: BaseException | None) -> grpc.StatusCode:
    code = None
    with contextlib.suppress(Exception):
        code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        for member in grpc.StatusCode:
            if member.value[0] == code:
                return member
    return grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN


class _TracingInterceptor(MethodInterceptor):
    def __init__(self, tracing: Tracing) -> None:
        super().__init__()
        self._tracing = tracing

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        tracing = self._tracing
        method = _SERVICES[method]
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }

        async def unary(request: Any, context: Any, behavior: Any) -> Any:
            with tracing._start(method, context, request) as span:
                error: BaseException | None = None
                try:
                    return await behavior(request, context)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    tracing._finish(span, context, error)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                return await unary(request, context, inner)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
        if handler.stream_unary is not None:
            inner_stream = handler.stream_unary

            async def stream_unary(requests: Any, context: Any) -> Any:
                return await unary(requests, context, inner_stream)

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
        if handler.unary_stream is not None:
            producer = handler.unary_stream

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                with tracing._start(method, context, request) as span:
                    error: BaseException | None = None
                    try:
                        async for item in producer(request, context):
                            yield item
                    except BaseException as exc:
                        error = exc
                        raise
                    finally:
                        tracing._finish(span, context, error)

            return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
        return handler
