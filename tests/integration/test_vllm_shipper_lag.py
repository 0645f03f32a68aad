"""The vLLM integration's shipper against a real ``kvcm serve`` process that stalls and dies.

An engine hands the shipper one closed step at a time (steps recorded on a local pool, with
the answers the local pool gave, as the mirror records them). The server is SIGSTOPped, then
killed and restarted on the same port, while steps keep coming: ``submit`` never waits for it,
the lag it reports grows, and once the server answers again the backlog is shipped coalesced
(or, after the server lost the pool, repaired by a snapshot) and every shipped step verified.
The server's DescribePool and ``GET /v1/pools/{pool}`` report the pool's step progress.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest

from kvcm.client import SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.snapshot import encode_state, fresh_extras
from kvcm.integrations.vllm import RecordedStep
from kvcm.integrations.vllm._shipper import GrpcStepShipper
from kvcm.v1 import admin_pb2, service_pb2_grpc

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGSTOP")

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=512,
    hash_seed="lag",
    explicit_layout=KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class _Server:
    """``kvcm serve`` in its own process (gRPC and HTTP on fixed loopback ports)."""

    def __init__(self) -> None:
        self.grpc = f"127.0.0.1:{_free_port()}"
        self.http = f"127.0.0.1:{_free_port()}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvcm.server.cli", "serve"),
                *("--grpc-address", self.grpc, "--http-address", self.http),
                *("--log-level", "WARNING"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with SchedulerClient(self.grpc, timeout=1.0) as client:
            _wait_until(lambda: _answers(client), 30.0)

    def signal(self, signum: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)


def _answers(client: SchedulerClient) -> bool:
    try:
        client.list_pools()
    except Exception:
        return False
    return True


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    give_up_at = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up_at, "timed out"
        time.sleep(0.05)


@pytest.fixture
def server() -> Iterator[_Server]:
    running = _Server()
    running.start()
    try:
        yield running
    finally:
        if running.process is not None and running.process.poll() is None:
            running.signal(signal.SIGCONT)
            running.kill()


class _Engine:
    """Closes one step per call on a local pool (request k admitted, k - 1 finished)."""

    def __init__(self) -> None:
        self.pool = Pool("local", CONFIG)
        self.hasher = self.pool.hashing.block_hasher()
        self.num_steps = 0

    def step(self) -> RecordedStep:
        self.num_steps += 1
        key = self.num_steps
        builder = StepBuilder()
        builder.continue_on_does_not_fit = True
        builder.step_seq = key
        prompt = [key % 997 + 1] * 40
        builder.add_request(key, prompt, self.hasher.hash_token_ids(prompt))
        builder.allocate(key, 40, 0)
        if key > 1:
            builder.finish(key - 1)
        program = builder.build()
        expected = self.pool.run_step(program)
        return RecordedStep(program=program, expected=expected, closed_at=time.monotonic())

    def snapshot(self) -> tuple[int, bytes]:
        key = self.num_steps
        request = self.pool.requests[key]
        data = encode_state(
            self.pool.ready_manager(),
            {key: request},
            {key: request.request_id},
            extras=fresh_extras(last_step_seq=key, max_model_len=CONFIG.max_model_len),
            drop_pending_events=True,
        )
        return key, data


def _submit(shipper: GrpcStepShipper, engine: _Engine, count: int) -> float:
    """Submit ``count`` steps (taking a snapshot when asked); the slowest submit, in s."""
    slowest = 0.0
    for _ in range(count):
        step = engine.step()
        start = time.perf_counter()
        shipper.submit(step)
        slowest = max(slowest, time.perf_counter() - start)
        if shipper.wants_snapshot:
            shipper.submit_snapshot(*engine.snapshot())
    return slowest


def test_a_stopped_then_killed_server_never_stops_the_engine(server: _Server) -> None:
    engine = _Engine()
    shipper = GrpcStepShipper(
        address=server.grpc,
        pool_id="lagging",
        pool_config=lambda: CONFIG,
        step_timeout_s=1.0,
        max_backlog=300,
    )
    try:
        _submit(shipper, engine, 50)
        assert shipper.flush(10.0)
        assert shipper.lag().backlog_steps == 0
        with SchedulerClient(server.grpc) as client:
            info = client.describe_pool("lagging")
            assert info.num_requests == 1
        # Stalled: every submit returns at once, the lag grows and is reported.
        server.signal(signal.SIGSTOP)
        slowest = _submit(shipper, engine, 200)
        time.sleep(0.3)
        lag = shipper.lag()
        assert slowest < 0.05, slowest
        assert lag.backlog_steps >= 190
        assert lag.oldest_unshipped_age_s >= 0.3
        assert lag.last_closed_step_seq == 250
        # Resumed: the backlog goes out coalesced, every step verified.
        server.signal(signal.SIGCONT)
        assert shipper.flush(20.0), shipper.stats
        stats = shipper.stats
        assert stats.mismatches == 0
        assert stats.resyncs == 0
        assert stats.steps_verified == 250
        assert stats.max_steps_per_rpc > 1
        assert shipper.lag().last_acked_step_seq == 250
        # The server reports where the pool stands (gRPC and HTTP).
        with grpc.insecure_channel(server.grpc) as channel:
            raw = service_pb2_grpc.AdminServiceStub(channel).DescribePool(
                admin_pb2.DescribePoolRequest(pool_id="lagging"), timeout=5
            )
        progress = raw.pool.step_progress
        assert raw.pool.HasField("step_progress")
        assert progress.last_step_seq == 250
        assert progress.steps_behind == 0
        assert progress.last_step_age_s >= progress.since_applied_s >= 0
        body = httpx.get(f"http://{server.http}/v1/pools/lagging").json()
        assert body["step_progress"]["last_step_seq"] == 250
        metrics = httpx.get(f"http://{server.http}/metrics").text
        assert 'kvcm_pool_last_step_seq{pool="lagging"} 250.0' in metrics
        # Killed: the backlog overflows, no snapshot is asked for while nobody answers.
        server.kill()
        slowest = _submit(shipper, engine, 400)
        assert slowest < 0.05, slowest
        _wait_until(lambda: not shipper.lag().reachable, 10.0)
        assert shipper.stats.backlog_overflows >= 1
        assert not shipper.wants_snapshot
        # Back (empty): the shipper notices, asks for a snapshot, and repairs the pool.
        server.start()
        _wait_until(lambda: shipper.wants_snapshot or shipper.stats.resyncs > 0, 20.0)
        _submit(shipper, engine, 5)
        assert shipper.flush(20.0), shipper.stats
        assert shipper.stats.resyncs == 1
        with SchedulerClient(server.grpc) as client:
            assert client.describe_pool("lagging").num_requests == 1
        assert shipper.lag().last_acked_step_seq == engine.num_steps
    finally:
        shipper.close(1.0)
