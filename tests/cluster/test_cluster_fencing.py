"""Fencing through etcd: SIGSTOP a pool's primary past its etcd lease, while an SDK scheduler
drives the pool through the seed list.

The lease expires, the standby is promoted by an etcd transaction (epoch 2), and the same
client's exactly-once Steps are acknowledged by the new primary within the lease TTL plus one
second of the SIGSTOP: a stopped replica accepts connections and answers nothing, so the SDK
bounds each attempt (``RetryPolicy.attempt_timeout_s``) and then asks the seeds again. After
SIGCONT the old primary acknowledges nothing (a Step sent to it directly, with a plain gRPC
stub that follows no redirect, is refused or redirected to the new epoch), it is no longer a
primary, and the pool equals both the new primary's and an in-process replay of every
acknowledged program.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import grpc
import pytest
from _cluster import Etcd, Replica, durable_replicas, running
from _load import CONFIG, assert_pool_matches, expected_pool

from _data_dir_server import program  # isort: skip  (tests/integration, put on sys.path by _load)
from _replication import replica_state  # isort: skip

from kvcm.client import RetryPolicy, SchedulerClient, StepBuilder, UnavailableError
from kvcm.common.errors import InvalidArgumentError
from kvcm.server.cluster import Placement
from kvcm.v1 import admin_pb2, replica_pb2, service_pb2_grpc
from kvcm.wire import pool_config_to_proto

LEASE_TTL_S = 2
PREFIX = "/kvcm-test-fencing"
# Each attempt of an idempotent call waits at most a quarter of the lease TTL for an answer.
POLICY = RetryPolicy(
    max_attempts=5, initial_backoff_s=0.02, max_backoff_s=0.05, attempt_timeout_s=0.5
)


@pytest.fixture
def cluster(etcd: Etcd, tmp_path: Path) -> Iterator[list[Replica]]:
    with running(durable_replicas(etcd, PREFIX, tmp_path, lease_ttl_s=LEASE_TTL_S)) as started:
        yield started


async def _placements(etcd: Etcd) -> dict[str, Placement]:
    host, _, port = etcd.endpoint.removeprefix("http://").rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
        listing = await client.get_prefix(f"{PREFIX}/placement/".encode())
        return {p.pool_id: p for p in (Placement.decode(kv.value) for kv in listing)}


def _wait(condition: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class _Stepper:
    """``program(1..)`` on a pool through the seed list, each resent (same step_seq) until
    acknowledged; ``acks[seq]`` is (sent, acknowledged) of the call that was acknowledged."""

    def __init__(self, seeds: str, pool_id: str) -> None:
        self.seeds = seeds
        self.pool_id = pool_id
        self.acks: dict[int, tuple[float, float]] = {}
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        seq = 1
        with SchedulerClient(self.seeds, timeout=10.0, retry_policy=POLICY) as client:
            while not self.stopping.is_set():
                sent = time.monotonic()
                try:
                    client.step(self.pool_id, program(seq))
                except Exception as exc:  # the same program again
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    time.sleep(0.05)
                    continue
                self.acks[seq] = (sent, time.monotonic())
                seq += 1
                time.sleep(0.01)

    def stop(self) -> int:
        self.stopping.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        acked = sorted(self.acks)
        assert acked == list(range(1, len(acked) + 1))
        return len(acked)


def _direct_step(address: str, pool_id: str, seq: int) -> grpc.RpcError | None:
    """Send ``program(seq)`` to ``address`` with a plain stub (no redirect followed);
    ``None`` when it was acknowledged, else the refusal."""
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.SchedulerServiceStub(channel)  # type: ignore[no-untyped-call]
        request = StepBuilder.from_program(program(seq)).to_proto(pool_id)
        try:
            stub.Step(request, timeout=10)
        except grpc.RpcError as exc:
            return exc
        return None


def test_paused_primary_fails_over_through_the_sdk_and_is_fenced(
    etcd: Etcd, cluster: list[Replica]
) -> None:
    seeds = ",".join(replica.address for replica in cluster)
    pool_id = "fence"
    with SchedulerClient(seeds, timeout=10.0) as client:
        client.create_pool(pool_id, CONFIG)
    _wait(lambda: asyncio.run(_placements(etcd)).get(pool_id) is not None, "the placement")
    before = asyncio.run(_placements(etcd))[pool_id]
    assert before.standby is not None
    assert before.epoch == 1
    old = next(replica for replica in cluster if replica.address == before.primary)
    assert old.process is not None

    stepper = _Stepper(seeds, pool_id)
    stepper.thread.start()
    _wait(lambda: len(stepper.acks) >= 20, "20 acknowledged Steps")
    old.process.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _wait(lambda: asyncio.run(_placements(etcd))[pool_id].epoch >= 2, "the promotion", 10)
        promoted_s = time.monotonic() - stopped
        after = asyncio.run(_placements(etcd))[pool_id]
        assert after.primary == before.standby
        # Steps go on through the seeds: the first one sent after the SIGSTOP is
        # acknowledged (by the new primary: the old one is stopped) within TTL + 1 s.
        _wait(
            lambda: any(sent > stopped for sent, _ in stepper.acks.values()),
            "a Step acknowledged after the SIGSTOP",
            10,
        )
        served_s = min(acked for sent, acked in stepper.acks.values() if sent > stopped) - stopped
        print(f"promoted after {promoted_s:.2f} s, served after {served_s:.2f} s")
        assert served_s <= LEASE_TTL_S + 1.0, (served_s, stepper.errors[-5:])
        held = len(stepper.acks)
        _wait(lambda: len(stepper.acks) >= held + 10, "10 more Steps on the new primary")
    finally:
        old.process.send_signal(signal.SIGCONT)
    # Right after SIGCONT, before its watch may have caught up: the old primary acknowledges
    # nothing sent to it directly.
    refused = _direct_step(old.address, pool_id, 10_000)
    assert refused is not None, "the old primary acknowledged a Step after its lease expired"
    print(f"the old primary's answer: {refused.code().name}: {refused.details()}")
    trailers = dict(refused.trailing_metadata() or ())
    if refused.code() is grpc.StatusCode.FAILED_PRECONDITION and "kvcm-owner" in trailers:
        assert trailers["kvcm-owner"] == after.primary
        assert int(trailers["kvcm-epoch"]) >= after.epoch
    else:
        assert refused.code() is grpc.StatusCode.UNAVAILABLE, (refused.code(), refused.details())
    # It stepped down: not a primary, at the new epoch; the pool is the new primary's.
    _wait(lambda: replica_state(old.address, pool_id).role != "primary", "the old to step down")
    on_old = replica_state(old.address, pool_id)
    assert on_old.role in ("fenced", "standby", "none"), on_old.role
    acknowledged = stepper.stop()
    final = asyncio.run(_placements(etcd))[pool_id]
    assert final.primary == after.primary
    assert_pool_matches(final.primary, pool_id, expected_pool(acknowledged))
    # Its standby (the old primary, seeded again, or the third replica) holds the same pool.
    assert final.standby is not None
    on_primary = replica_state(final.primary, pool_id)
    _wait(
        lambda: replica_state(final.standby, pool_id).digest == on_primary.digest,  # type: ignore[arg-type]
        "the standby to equal the primary",
    )
    if on_old.role == "standby" or final.standby == old.address:
        assert replica_state(old.address, pool_id).digest == on_primary.digest


def test_async_pool_keeps_its_mode_and_its_paused_primary_acknowledges_nothing(
    etcd: Etcd, cluster: list[Replica]
) -> None:
    """An ``async`` pool (chosen at creation, kept in its placement record): its primary is
    fenced by its own etcd lease, since no standby's word stands between it and an answer."""
    seeds = ",".join(replica.address for replica in cluster)
    pool_id = "fence-async"
    with SchedulerClient(seeds, timeout=10.0, retry_policy=POLICY) as client:
        with pytest.raises(InvalidArgumentError, match="replication_mode") as bad:
            client.create_pool("bad", CONFIG, replication_mode="eventually")
        assert bad.value.field == "replication_mode"
        with grpc.insecure_channel(cluster[0].address) as channel:  # the server checks too
            stub = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.RpcError) as refused:
                stub.CreatePool(
                    admin_pb2.CreatePoolRequest(
                        pool_id="bad", config=pool_config_to_proto(CONFIG), replication_mode="x"
                    ),
                    timeout=10,
                )
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "replication_mode" in (refused.value.details() or "")
        client.create_pool(pool_id, CONFIG, replication_mode="async")
        for seq in range(1, 11):
            client.step(pool_id, program(seq))
    placements = asyncio.run(_placements(etcd))
    assert "bad" not in placements  # refused: nothing placed
    before = placements[pool_id]
    assert before.mode == "async"
    assert before.standby is not None
    assert replica_state(before.primary, pool_id).mode == replica_pb2.REPLICATION_MODE_ASYNC
    on_primary = replica_state(before.primary, pool_id)
    _wait(
        lambda: replica_state(before.standby, pool_id).digest == on_primary.digest,  # type: ignore[arg-type]
        "the standby to hold the 10 programs",
    )
    old = next(replica for replica in cluster if replica.address == before.primary)
    assert old.process is not None
    old.process.send_signal(signal.SIGSTOP)
    late: list[grpc.RpcError | None] = []
    sender = threading.Thread(
        target=lambda: late.append(_direct_step(old.address, pool_id, 11)), daemon=True
    )
    sender.start()  # queued while the primary is paused, read once it runs again
    try:
        _wait(lambda: asyncio.run(_placements(etcd))[pool_id].epoch >= 2, "the promotion", 10)
        after = asyncio.run(_placements(etcd))[pool_id]
        assert after.primary == before.standby
        assert after.mode == "async"  # honoured after the failover
        with SchedulerClient(seeds, timeout=10.0, retry_policy=POLICY) as client:
            for seq in range(11, 21):
                client.step(pool_id, program(seq))
    finally:
        old.process.send_signal(signal.SIGCONT)
    refused_now = _direct_step(old.address, pool_id, 21)
    sender.join(20)
    assert late, "the Step sent during the pause got no answer"
    print(f"answers of the old primary: {late}, {refused_now}")
    assert late[0] is not None, "the paused async primary acknowledged a Step after its lease"
    assert refused_now is not None, "the old async primary acknowledged a Step after SIGCONT"
    _wait(lambda: replica_state(old.address, pool_id).role != "primary", "the old to step down")
    final = asyncio.run(_placements(etcd))[pool_id]
    assert final.primary == after.primary
    assert final.mode == "async"
    assert replica_state(final.primary, pool_id).mode == replica_pb2.REPLICATION_MODE_ASYNC
    assert_pool_matches(final.primary, pool_id, expected_pool(20))
    # etcd away past the lease TTL: the async pool's primary cannot renew its lease, so it
    # answers nothing (its lease may have expired and its standby be promoted, as far as
    # it can tell), while a sync pool goes on (its standby's acknowledgement fences it).
    # etcd back: the async pool answers again.
    with SchedulerClient(seeds, timeout=10.0, retry_policy=POLICY) as client:
        client.create_pool("fence-sync", CONFIG)
        client.step("fence-sync", program(1))
        etcd.stop()
        try:
            time.sleep(LEASE_TTL_S + 0.5)
            unleased = _direct_step(final.primary, pool_id, 21)
            assert unleased is not None, "an async primary acknowledged without a live lease"
            assert unleased.code() is grpc.StatusCode.UNAVAILABLE, unleased
            assert "etcd lease" in (unleased.details() or "")
            client.step("fence-sync", program(2))
        finally:
            etcd.start()
        # The same step_seq again, as a scheduler would, until the lease is renewed.
        deadline = time.monotonic() + 20
        while True:
            try:
                client.step(pool_id, program(21))
                break
            except UnavailableError:
                assert time.monotonic() < deadline, "the async pool never answered again"
                time.sleep(0.2)
    assert_pool_matches(final.primary, pool_id, expected_pool(21))
