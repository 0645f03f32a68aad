"""The server process itself: health, reflection, graceful shutdown, worker registration, CLI."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec
from kvcm.server.embedded import start_embedded_server
from kvcm.server.settings import ServerSettings
from kvcm.v1 import admin_pb2, events_pb2, service_pb2_grpc, worker_pb2
from kvcm.wire import layer_specs_to_proto, spec_to_proto

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
KVCM_SERVICES = {
    "kvcm.v1.AdminService",
    "kvcm.v1.WorkerService",
    "kvcm.v1.SchedulerService",
    "kvcm.v1.EventService",
}


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    status: int = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
    return status


def test_health_serves_every_kvcm_service(kvcm_address: str) -> None:
    with grpc.insecure_channel(kvcm_address) as channel:
        for service in ("", *KVCM_SERVICES):
            assert _health(channel, service) == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_every_service(kvcm_address: str) -> None:
    with grpc.insecure_channel(kvcm_address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    names = {service.name for service in answer.list_services_response.service}
    assert names >= KVCM_SERVICES
    assert "grpc.health.v1.Health" in names


def test_graceful_shutdown_flips_health_then_drains() -> None:
    settings = ServerSettings(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0")
    running = start_embedded_server(settings)
    stopped = False
    try:
        with grpc.insecure_channel(running.grpc_address) as channel:
            admin = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
            admin.CreatePool(
                admin_pb2.CreatePoolRequest(
                    pool_id="drain", config=admin_pb2.PoolConfig(max_model_len=64, world_size=2)
                ),
                timeout=5,
            )
            worker = service_pb2_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]
            waiting = worker.RegisterWorker.future(
                worker_pb2.RegisterWorkerRequest(
                    pool_id="drain",
                    rank=0,
                    world_size=2,
                    layer_specs=layer_specs_to_proto({"layer.0": SPEC}),
                    available_memory_bytes=1 << 24,
                ),
                timeout=30,
            )
            layout = admin_pb2.PoolConfig(max_model_len=64, enable_kv_cache_events=True)
            layout.explicit_layout.num_blocks = 4
            layout.explicit_layout.kv_cache_groups.add(
                layer_names=["layer.0"], kv_cache_spec=spec_to_proto(SPEC)
            )
            admin.CreatePool(admin_pb2.CreatePoolRequest(pool_id="streamed", config=layout))
            events = service_pb2_grpc.EventServiceStub(channel)  # type: ignore[no-untyped-call]
            stream = events.SubscribeEvents(events_pb2.SubscribeEventsRequest(pool_id="streamed"))
            next(stream)  # the first message: subscribed
            time.sleep(0.2)  # the registration now waits for rank 1
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            http = httpx.Client(base_url=f"http://{running.http_address}")
            assert http.get("/readyz").status_code == 200
            stopping = threading.Thread(
                target=lambda: running.call(running.server.stop(grace_s=1.0)), daemon=True
            )
            stopping.start()
            with pytest.raises(grpc.RpcError) as caught:
                waiting.result(timeout=5)  # a waiting registration ends at once, UNAVAILABLE
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as ended:
                next(stream)  # so does an event stream, which could otherwise last forever
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not running.server.state.serving
            stopping.join(timeout=10)
            stopped = True
            http.close()
    finally:
        if not stopped:
            running.stop(grace_s=1.0)
        else:
            running.thread.join(timeout=10)
            running.loop.close()


def _register(
    address: str, pool_id: str, rank: int, specs: dict[str, KVCacheSpec], memory: int
) -> worker_pb2.RegisterWorkerResponse:
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]
        response: worker_pb2.RegisterWorkerResponse = stub.RegisterWorker(
            worker_pb2.RegisterWorkerRequest(
                pool_id=pool_id,
                rank=rank,
                world_size=2,
                layer_specs=layer_specs_to_proto(specs),
                available_memory_bytes=memory,
            ),
            timeout=10,
        )
        return response


def test_two_ranks_get_one_config_with_the_smaller_memory(kvcm_address: str) -> None:
    with grpc.insecure_channel(kvcm_address) as channel:
        admin = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
        admin.CreatePool(
            admin_pb2.CreatePoolRequest(
                pool_id="ranks", config=admin_pb2.PoolConfig(max_model_len=256, world_size=2)
            ),
            timeout=5,
        )
    specs: dict[str, KVCacheSpec] = {"layer.0": SPEC, "layer.1": SPEC}
    page = SPEC.page_size_bytes * 2
    answers: dict[int, worker_pb2.RegisterWorkerResponse] = {}
    threads = [
        threading.Thread(
            target=lambda r=rank, m=memory: answers.__setitem__(
                r, _register(kvcm_address, "ranks", r, specs, m)
            )
        )
        for rank, memory in ((0, 100 * page), (1, 60 * page))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    assert sorted(answers) == [0, 1]
    assert answers[0].kv_cache_config.num_blocks == 60
    assert answers[0] == answers[1]
    # Same specs again: the same answer at once. Other specs: ALREADY_EXISTS.
    assert _register(kvcm_address, "ranks", 0, specs, 100 * page) == answers[0]
    with pytest.raises(grpc.RpcError) as caught:
        _register(kvcm_address, "ranks", 0, {"layer.0": SPEC}, 100 * page)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_ranks_that_disagree_are_failed_precondition(kvcm_address: str) -> None:
    with grpc.insecure_channel(kvcm_address) as channel:
        admin = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
        admin.CreatePool(
            admin_pb2.CreatePoolRequest(
                pool_id="disagree", config=admin_pb2.PoolConfig(max_model_len=256, world_size=2)
            ),
            timeout=5,
        )
        worker = service_pb2_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]
        first = worker.RegisterWorker.future(
            worker_pb2.RegisterWorkerRequest(
                pool_id="disagree",
                rank=0,
                world_size=2,
                layer_specs=layer_specs_to_proto({"layer.0": SPEC}),
                available_memory_bytes=1 << 24,
            ),
            timeout=0.5,
        )
        other = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
        time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as caught:
            _register(kvcm_address, "disagree", 1, {"layer.0": other}, 1 << 24)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as timed_out:
            first.result()
        assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as bad_rank:
            _register(kvcm_address, "disagree", 5, {"layer.0": SPEC}, 1 << 24)
        assert bad_rank.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_kvcm_serve_runs_from_a_config_file_and_stops_on_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "kvcm.toml"
    config.write_text(
        '[server]\ngrpc_address = "127.0.0.1:0"\nhttp_address = "127.0.0.1:0"\n',
        encoding="utf-8",
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcm.server.cli", "serve", "--config", str(config)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        line = ""
        give_up_at = time.monotonic() + 30
        while "kvcm serving" not in line:
            assert time.monotonic() < give_up_at, "kvcm serve did not start"
            line = process.stderr.readline()
            assert line or process.poll() is None, "kvcm serve exited"
        address = line.split("gRPC on ")[1].split(",")[0]
        with grpc.insecure_channel(address) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        process.terminate()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_kvcm_serve_rejects_a_bad_config_file(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nno_such_key = 1\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "kvcm.server.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "no_such_key" in result.stderr
