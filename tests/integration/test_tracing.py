"""OpenTelemetry tracing: one Step from the SDK through the server, in one trace.

A real server on 127.0.0.1 exports its spans to OpenTelemetry's in-memory exporter; the test
process is the SDK side, with its own tracer provider. The server's RPC span must be a child
of the client's span (the SDK propagated the W3C context), and the Step's phases children of
the RPC span. With tracing off no interceptor is installed at all.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvcm.client import SchedulerClient, ServiceNotFoundError, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.app import KVCMServer
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.rpc import TelemetryInterceptor
from kvcm.server.settings import ServerSettings

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=256,
    explicit_layout=KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)


@pytest.fixture
def traced() -> Iterator[tuple[EmbeddedServer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    server = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address=""), span_exporter=exporter
    )
    try:
        yield server, exporter
    finally:
        server.stop()


@pytest.fixture
def client_tracer() -> Iterator[Any]:
    provider = TracerProvider()
    client_spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(client_spans))
    yield provider.get_tracer("test-scheduler")
    provider.shutdown()


def _spans_by_name(exporter: InMemorySpanExporter, *names: str) -> dict[str, Any]:
    """The finished spans by name, once ``names`` are among them (an aborted call's span
    ends just after the client has its status)."""
    give_up_at = time.monotonic() + 5.0
    while True:
        spans = {span.name: span for span in exporter.get_finished_spans()}
        if set(names) <= set(spans) or time.monotonic() > give_up_at:
            return spans
        time.sleep(0.01)


def test_one_step_is_one_trace_from_the_sdk_through_the_interpreter(
    traced: tuple[EmbeddedServer, InMemorySpanExporter], client_tracer: Any
) -> None:
    server, exporter = traced
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("traced", CONFIG)
        step = StepBuilder()
        step.add_request(1, list(range(40)))
        step.allocate(1, 40, 0)
        with client_tracer.start_as_current_span("scheduler.step") as parent:
            client.step("traced", step)
        trace_id = parent.get_span_context().trace_id
    spans = _spans_by_name(exporter, "kvcm.v1.SchedulerService/Step", "kvcm.step.encode")
    rpc = spans["kvcm.v1.SchedulerService/Step"]
    assert rpc.kind == trace.SpanKind.SERVER
    assert rpc.context.trace_id == trace_id
    assert rpc.parent is not None
    assert rpc.parent.span_id == parent.get_span_context().span_id
    assert rpc.attributes["rpc.method"] == "Step"
    assert rpc.attributes["kvcm.pool_id"] == "traced"
    assert rpc.attributes["rpc.grpc.status_code"] == 0
    for phase in ("decode", "validate", "execute", "encode"):
        span = spans[f"kvcm.step.{phase}"]
        assert span.context.trace_id == trace_id
        assert span.parent is not None
        assert span.parent.span_id == rpc.context.span_id, phase
    # An untraced call (no active client span) is a root span of its own trace.
    assert spans["kvcm.v1.AdminService/CreatePool"].parent is None


def test_a_rejected_call_is_an_error_span(
    traced: tuple[EmbeddedServer, InMemorySpanExporter],
) -> None:
    server, exporter = traced
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("traced-bad", CONFIG)
        step = StepBuilder()
        step.allocate(99, 8, 0)
        with pytest.raises(Exception, match="99"):
            client.step("traced-bad", step)
        with pytest.raises(ServiceNotFoundError):
            client.describe_pool("no-such-pool")
    _spans_by_name(exporter, "kvcm.v1.SchedulerService/Step", "kvcm.v1.AdminService/DescribePool")
    spans = [s for s in exporter.get_finished_spans() if s.name.startswith("kvcm.v1.")]
    failed = [s for s in spans if s.attributes["rpc.grpc.status_code"] != 0]
    assert {s.name for s in failed} == {
        "kvcm.v1.SchedulerService/Step",
        "kvcm.v1.AdminService/DescribePool",
    }
    assert all(s.status.status_code == trace.StatusCode.ERROR for s in failed)


def test_tracing_off_installs_nothing() -> None:
    server = KVCMServer(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    assert server.tracing is None
    assert server.state.tracing is None
    running = start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    try:
        assert [type(i) for i in running.server.interceptors] == [TelemetryInterceptor]
    finally:
        running.stop()


def test_tracing_configured_without_the_extra_is_a_clear_error() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry.sdk"] = None
        from kvcm.common.errors import ConfigError
        from kvcm.server.app import KVCMServer
        from kvcm.server.settings import ServerSettings
        try:
            KVCMServer(ServerSettings(otlp_endpoint="http://127.0.0.1:4317"))
        except ConfigError as exc:
            print(exc)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "pip install 'kvcm[tracing]'" in out.stdout
    with pytest.raises(ConfigError, match="trace_sample_ratio"):
        ServerSettings(trace_sample_ratio=1.5)


def test_the_async_sdk_propagates_the_trace_context(
    traced: tuple[EmbeddedServer, InMemorySpanExporter], client_tracer: Any
) -> None:
    """The asyncio SDK's channel adds the caller's span context to a call made inside it
    (a channel wrapper, not an interceptor), and nothing to a call made outside one."""
    import asyncio

    from kvcm.client import AsyncSchedulerClient

    server, exporter = traced

    async def main() -> int:
        async with AsyncSchedulerClient(server.grpc_address) as client:
            await client.list_pools()
            with client_tracer.start_as_current_span("router.create") as parent:
                await client.create_pool("traced-aio", CONFIG)
            span_id: int = parent.get_span_context().span_id
            return span_id

    parent_span_id = asyncio.run(main())
    spans = _spans_by_name(
        exporter, "kvcm.v1.AdminService/CreatePool", "kvcm.v1.AdminService/ListPools"
    )
    created = spans["kvcm.v1.AdminService/CreatePool"]
    assert created.parent is not None
    assert created.parent.span_id == parent_span_id
    assert spans["kvcm.v1.AdminService/ListPools"].parent is None
