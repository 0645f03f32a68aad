"""Scheduler leases on a real server: what a dead scheduler left is reclaimed, nothing else.

Pools with a short lease (0.4 s): an abandoned one is reclaimed by its policy within about a
lease and a check interval; one whose scheduler keeps calling (Steps or KeepAlive) is never
touched; a pool without a lease keeps its requests; CLEAR resets the cache and publishes
AllBlocksCleared. Each reclaim is counted in kvcm_lease_reclaims_total and logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator

import httpx
import pytest

from kvcm.client import LeaseExpiry, SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError, NotFoundError
from kvcm.common.events import AllBlocksCleared
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

LEASE_S = 0.4
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
BASE = PoolConfig(
    max_model_len=512,
    enable_kv_cache_events=True,
    scheduler_lease_s=LEASE_S,
    explicit_layout=KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0")
    )
    try:
        yield running
    finally:
        running.stop()


def _admit(client: SchedulerClient, pool_id: str, keys: range) -> None:
    hasher = client.block_hasher(pool_id)
    step = StepBuilder()
    for key in keys:
        prompt = [key] * 40
        step.add_request(key, prompt, hasher.hash_token_ids(prompt))
        step.allocate(key, 40, 0, lookup=True)
        step.cache_blocks(key, 40)
    client.step(pool_id, step)


def _wait_until(predicate: object, timeout_s: float) -> float:
    started = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.02)
    return time.monotonic() - started


def test_an_abandoned_scheduler_is_reclaimed_and_nothing_else(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvcm.server.leases")
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("abandoned", BASE)
        client.create_pool("alive", BASE)
        client.create_pool("unleased", dataclasses.replace(BASE, scheduler_lease_s=0.0))
        for pool_id in ("abandoned", "alive", "unleased"):
            _admit(client, pool_id, range(1, 4))
        started = time.monotonic()
        last_call = time.time()
        # "alive" keeps renewing, alternately by KeepAlive and by an ordinary call; a monitor
        # keeps reading "abandoned", which renews nothing.
        beat = 0
        while time.monotonic() - started < 4 * LEASE_S:
            if beat % 2:
                client.take_new_block_ids("alive")
            else:
                assert client.keep_alive("alive") == LEASE_S
            beat += 1
            if client.get_usage("abandoned").num_requests:
                with contextlib.suppress(NotFoundError):  # reclaimed meanwhile
                    client.get_block_ids("abandoned", 1)
                    client.get_blocks("abandoned", 2)
                    client.get_num_common_prefix_blocks("abandoned", 3)
            time.sleep(LEASE_S / 4)
        _wait_until(lambda: client.describe_pool("abandoned").num_requests == 0, 5.0)
        abandoned = client.describe_pool("abandoned")
        assert abandoned.num_free_blocks == 39  # freed, and still cached (FREE_REQUESTS)
        assert client.describe_pool("alive").num_requests == 3
        assert client.describe_pool("unleased").num_requests == 3
        # The blocks stayed cached: the same prompt hits again.
        hasher = client.block_hasher("abandoned")
        step = StepBuilder()
        step.add_request(9, [1] * 41, hasher.hash_token_ids([1] * 41))
        step.allocate(9, 41, 0, lookup=True)
        found = client.step("abandoned", step).lookup(0)
        assert found is not None
        assert found.num_computed_tokens == 32
    records = [r for r in caplog.records if getattr(r, "event", "") == "lease_reclaimed"]
    reclaimed_after = records[0].created - last_call
    print(f"reclaimed {reclaimed_after:.2f} s after the scheduler's last call (lease {LEASE_S} s)")
    assert LEASE_S < reclaimed_after < LEASE_S + 1.5
    assert [(r.pool, r.requests) for r in records] == [("abandoned", 3)]  # type: ignore[attr-defined]
    metrics = httpx.get(f"http://{server.http_address}/metrics").text
    assert 'kvcm_lease_reclaims_total{kind="scheduler",pool="abandoned"} 1.0' in metrics


def test_clear_resets_the_cache_and_tells_routers(server: EmbeddedServer) -> None:
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("cleared", dataclasses.replace(BASE, lease_expiry=LeaseExpiry.CLEAR))
        _admit(client, "cleared", range(1, 3))
        info = client.describe_pool("cleared")
        _wait_until(lambda: client.describe_pool("cleared").num_requests == 0, 5.0)
        events: list[object] = []
        with client.subscribe_events(
            "cleared", start_sequence=info.last_event_sequence + 1
        ) as stream:
            for batch in stream:
                events.extend(batch.events)
                if any(isinstance(e, AllBlocksCleared) for e in events):
                    break
        assert isinstance(events[-1], AllBlocksCleared)
        # An empty cache: the same prompt no longer hits.
        hasher = client.block_hasher("cleared")
        step = StepBuilder()
        step.add_request(7, [1] * 41, hasher.hash_token_ids([1] * 41))
        step.allocate(7, 41, 0, lookup=True)
        found = client.step("cleared", step).lookup(0)
        assert found is not None
        assert found.num_computed_tokens == 0


def test_a_negative_lease_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="scheduler_lease_s"):
        dataclasses.replace(BASE, scheduler_lease_s=-1.0)


def test_an_idle_vllm_shipper_keeps_its_lease_and_a_dead_one_loses_it(
    server: EmbeddedServer,
) -> None:
    """The vLLM integration's shipper sends KeepAlives while idle; once closed, it stops."""
    from kvcm.core.pool import Pool
    from kvcm.integrations.vllm import RecordedStep
    from kvcm.integrations.vllm._shipper import GrpcStepShipper

    config = dataclasses.replace(BASE, hash_seed="shipper")
    local = Pool("local", config)
    with SchedulerClient(server.grpc_address) as client:
        hasher = local.hashing.block_hasher()
        step = StepBuilder()
        step.step_seq = 1
        for key in (1, 2):
            prompt = [key] * 40
            step.add_request(key, prompt, hasher.hash_token_ids(prompt))
            step.allocate(key, 40, 0)
        program = step.build()
        expected = local.run_step(program)
        shipper = GrpcStepShipper(
            address=server.grpc_address,
            pool_id="shipped",
            pool_config=lambda: config,
            lease_s=LEASE_S,
        )
        shipper.submit(RecordedStep(program=program, expected=expected))
        assert shipper.flush(10.0)
        time.sleep(4 * LEASE_S)  # idle for four leases: its KeepAlives renew the lease
        assert client.describe_pool("shipped").num_requests == 2
        assert shipper.stats.steps_verified == 1
        assert shipper.stats.rpcs >= 2 + 1 + 4  # attach (describe, create), Step, KeepAlives
        shipper.close()
        _wait_until(lambda: client.describe_pool("shipped").num_requests == 0, 5.0)


def test_a_transfer_that_never_completes_is_freed_and_a_completed_one_is_not() -> None:
    """P/D: requests allocated with delay_cache_blocks wait for their KV; the lost one goes."""
    from kvcm.client import SlotOptions

    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", transfer_lease_s=LEASE_S)
    )
    try:
        with SchedulerClient(running.grpc_address) as client:
            client.create_pool("decode", dataclasses.replace(BASE, scheduler_lease_s=0.0))
            hasher = client.block_hasher("decode")
            step = StepBuilder()
            for key in (1, 2):  # two remote prefills whose KV is on its way
                prompt = [key] * 40
                step.add_request(key, prompt, hasher.hash_token_ids(prompt))
                step.allocate(key, 40, 0, options=SlotOptions(delay_cache_blocks=True))
            client.step("decode", step)
            done = StepBuilder()
            done.cache_blocks(2, 40)  # request 2's transfer completed
            client.step("decode", done)
            _wait_until(lambda: client.describe_pool("decode").num_requests == 1, 5.0)
            assert client.get_block_ids("decode", 2) != ([],)  # untouched
            with pytest.raises(Exception, match="1"):
                client.get_block_ids("decode", 1)  # finished: its key is gone
        assert running.server.state.reclaims == {("decode", "transfer"): 1}
    finally:
        running.stop()


def test_a_subscriber_that_stops_reading_is_ended() -> None:
    """A router that stops reading its event stream holds no slot past the subscriber lease."""
    import grpc

    from kvcm.v1 import events_pb2, service_pb2_grpc

    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", subscriber_lease_s=LEASE_S)
    )
    try:
        with SchedulerClient(running.grpc_address) as client:
            big = dataclasses.replace(
                BASE.explicit_layout,  # type: ignore[type-var]
                num_blocks=300,
            )
            client.create_pool(
                "evented",
                dataclasses.replace(
                    BASE, scheduler_lease_s=0.0, max_model_len=4096, explicit_layout=big
                ),
            )
            hasher = client.block_hasher("evented")
            for key in range(1, 40):  # ~2 MB of BlockStored events (token ids included)
                prompt = [key * 100_000 + i for i in range(4000)]
                step = StepBuilder()
                step.add_request(key, prompt, hasher.hash_token_ids(prompt))
                step.allocate(key, len(prompt), 0)
                step.cache_blocks(key, len(prompt))
                step.finish(key)
                client.step("evented", step)
        options = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(running.grpc_address, options=options) as channel:
            stub = service_pb2_grpc.EventServiceStub(channel)  # type: ignore[no-untyped-call]
            stream = stub.SubscribeEvents(
                events_pb2.SubscribeEventsRequest(pool_id="evented", start_sequence=1)
            )
            next(stream)  # the first message; then this reader stops reading
            state = running.server.state
            _wait_until(lambda: state.reclaims.get(("evented", "subscriber")) == 1, 10.0)
            _wait_until(lambda: state.runtimes["evented"].subscribers == 0, 5.0)
            stream.cancel()
    finally:
        running.stop()


_FROZEN_READER = """
import sys, time
from kvcm.client import SchedulerClient
with SchedulerClient(sys.argv[1]) as client:
    with client.subscribe_events("quiet", start_sequence=1) as stream:
        for batch in stream:
            print("read", flush=True)
"""


def test_a_reader_whose_process_stopped_is_ended_though_no_write_blocks() -> None:
    """A reader process that is paused (or hung, or its host gone) answers no HTTP/2 PING: its
    stream ends within about the subscriber lease even on a quiet pool, where the server
    writes nothing that could block."""
    import signal
    import subprocess
    import sys

    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", subscriber_lease_s=1.0)
    )
    reader = None
    try:
        with SchedulerClient(running.grpc_address) as client:
            client.create_pool("quiet", dataclasses.replace(BASE, scheduler_lease_s=0.0))
            _admit(client, "quiet", range(1, 2))  # one batch of events to read
        reader = subprocess.Popen(
            [sys.executable, "-c", _FROZEN_READER, running.grpc_address],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert reader.stdout is not None
        assert reader.stdout.readline() == "read\n"  # it reads while it runs
        runtime = running.server.state.runtimes["quiet"]
        assert runtime.subscribers == 1
        reader.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        _wait_until(lambda: runtime.subscribers == 0, 10.0)
        ended_after = time.monotonic() - stopped
        print(f"a stopped reader's stream ended {ended_after:.2f} s after it stopped (lease 1 s)")
        assert ended_after < 1.0 + 2.0
    finally:
        if reader is not None:
            reader.send_signal(signal.SIGCONT)
            reader.kill()
            reader.wait(timeout=10)
        running.stop()


def test_a_large_reclaim_runs_in_its_pools_lane_and_frees_everything(
    server: EmbeddedServer,
) -> None:
    """300 requests to finish is over the inline budget: the reclaim runs in the pool's lane
    (the loop keeps serving); the outcome is the same as a small one's."""
    many = dataclasses.replace(
        BASE,
        explicit_layout=dataclasses.replace(
            BASE.explicit_layout,  # type: ignore[type-var]
            num_blocks=310,
        ),
    )
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("many", many)
        hasher = client.block_hasher("many")
        step = StepBuilder()
        for key in range(1, 301):
            prompt = [key] * 16
            step.add_request(key, prompt, hasher.hash_token_ids(prompt))
            step.allocate(key, 16, 0)
        client.step("many", step)
        assert client.describe_pool("many").num_requests == 300
        _wait_until(lambda: client.describe_pool("many").num_requests == 0, 5.0)
        assert client.describe_pool("many").num_free_blocks == 309
        assert not server.server.state.lanes
    assert server.server.state.reclaims == {("many", "scheduler"): 1}
