"""A pool deleted while one of its replicas was down stays deleted when that replica returns.

Three ``kvcm serve --data-dir`` replicas on a real etcd. One replica is ``kill -9``-ed while it
is the primary of one pool and the standby of another; the first fails over to its standby
(epoch 2), then both are deleted through the cluster. The killed replica restarts from its data
directory, which still holds the pools (and its ``replication.json`` their roles): finding
neither placed but both deleted (the tombstone DeletePool leaves in etcd) it drops its copies,
journaled, instead of placing them again. The pools stay gone (ListPools and Lookup through
every replica, DescribePool NOT_FOUND everywhere), also after a second restart; the pool the
dead replica did not serve keeps every acknowledged program; the deleted id is created again
and served.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import grpc
import httpx
import pytest
from _cluster import Etcd, Replica, durable_replicas, running, wait_for_members
from _load import CONFIG, assert_pool_matches, expected_pool

from _data_dir_server import program  # isort: skip  (tests/integration, put on sys.path by _load)
from _replication import replica_state  # isort: skip

from kvcm.client import SchedulerClient, ServiceNotFoundError, UnavailableError
from kvcm.core.lookup import LookupQuery
from kvcm.server.cluster import Placement
from kvcm.v1 import admin_pb2, service_pb2_grpc

LEASE_TTL_S = 2
PREFIX = "/kvcm-test-deleted-pool"
STEPS = 6


@pytest.fixture
def cluster(etcd: Etcd, tmp_path: Path) -> Iterator[list[Replica]]:
    with running(durable_replicas(etcd, PREFIX, tmp_path, lease_ttl_s=LEASE_TTL_S)) as started:
        yield started


async def _records(etcd: Etcd, kind: str) -> dict[str, bytes]:
    host, _, port = etcd.endpoint.removeprefix("http://").rpartition(":")
    prefix = f"{PREFIX}/{kind}/"
    async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
        listing = await client.get_prefix(prefix.encode())
        return {kv.key.decode().removeprefix(prefix): kv.value for kv in listing}


def _placements(etcd: Etcd) -> dict[str, Placement]:
    return {k: Placement.decode(v) for k, v in asyncio.run(_records(etcd, "placement")).items()}


def _wait(condition: object, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _metric(replica: Replica, name: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{replica.http_port}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{replica.address} has no {name}")


def _local_pools(replica: Replica) -> set[str]:
    """The pools ``replica`` holds itself (a ListPools that is not fanned out)."""
    with grpc.insecure_channel(replica.address) as channel:
        stub = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
        answer = stub.ListPools(
            admin_pb2.ListPoolsRequest(), metadata=(("kvcm-cluster-local", "1"),), timeout=10
        )
        return {pool.pool_id for pool in answer.pools}


def _delete(cluster: list[Replica], away: Replica, pool_ids: list[str]) -> None:
    """Delete the pools through the replicas other than ``away``."""
    seeds = ",".join(r.address for r in cluster if r is not away)
    with SchedulerClient(seeds, timeout=10.0) as client:
        for pool_id in pool_ids:
            deadline = time.monotonic() + 10
            while True:  # UNAVAILABLE while a promotion's checkpoint is taken: again
                try:
                    client.delete_pool(pool_id)
                    break
                except UnavailableError:
                    assert time.monotonic() < deadline, f"{pool_id} was not deleted"
                    time.sleep(0.05)


def _assert_gone(cluster: list[Replica], gone: set[str], kept: set[str]) -> None:
    """Through every replica: ListPools and Lookup show exactly ``kept``, DescribePool of each
    of ``gone`` is NOT_FOUND; etcd places only ``kept``."""
    assert set(_placements(etcd=cluster[0].etcd)) == kept
    prompt = [1] * 32 + list(range(100, 107))  # program(1)'s
    for replica in cluster:
        with SchedulerClient(replica.address, timeout=10.0) as client:
            listing = client.list_pools()
            assert listing.missing_replicas == ()
            assert {pool.pool_id for pool in listing} == kept, replica.address
            answer = client.lookup(LookupQuery(token_ids=prompt))
            assert answer.missing_replicas == ()
            assert answer.num_pools_in_scope == len(kept), replica.address
            assert {hit.pool_id for hit in answer.pools} <= kept
            for pool_id in gone:
                with pytest.raises(ServiceNotFoundError):
                    client.describe_pool(pool_id)


def test_a_pool_deleted_while_its_replica_was_down_does_not_come_back(
    etcd: Etcd, cluster: list[Replica]
) -> None:
    seeds = ",".join(replica.address for replica in cluster)
    pools = ["del-a", "del-b", "del-c"]
    with SchedulerClient(seeds, timeout=10.0) as client:
        for pool_id in pools:
            client.create_pool(pool_id, CONFIG)
            for seq in range(1, STEPS + 1):
                client.step(pool_id, program(seq))  # sync: its standby has it
    placed = _placements(etcd)
    victim = next(r for r in cluster if r.address == placed["del-a"].primary)
    as_standby = [p for p, placement in placed.items() if placement.standby == victim.address]
    assert as_standby, f"{victim.address} is no pool's standby: {placed}"
    deleted = {"del-a", as_standby[0]}
    (kept,) = set(pools) - deleted

    assert victim.process is not None
    victim.stop(signal.SIGKILL)
    _wait(lambda: _placements(etcd)["del-a"].epoch == 2, "del-a's failover")
    _delete(cluster, victim, sorted(deleted))
    tombstones = asyncio.run(_records(etcd, "deleted"))
    assert set(tombstones) == deleted
    assert b'"epoch": 2' in tombstones["del-a"]  # the deleted placement's

    for restart in range(2):  # the second start finds the drop journaled
        if restart:
            victim.stop(signal.SIGKILL)
        victim.start()
        wait_for_members(cluster, 3)
        _assert_gone(cluster, deleted, {kept})
        # Its data directory held del-a (it was its primary); of the pool it followed it held
        # only the role (a standby's copy is seeded, never journaled), now forgotten too.
        dropped = _metric(victim, "kvcm_cluster_deleted_pools_dropped_total")
        assert dropped == (1 if restart == 0 else 0), victim.log_tail()
        for pool_id in deleted:
            state = replica_state(victim.address, pool_id)
            assert (state.role, state.placement_epoch, state.digest) == ("none", 0, b"")
        assert_pool_matches(seeds, kept, expected_pool(STEPS))

    with SchedulerClient(seeds, timeout=10.0) as client:
        client.create_pool("del-a", CONFIG)
        assert "del-a" not in asyncio.run(_records(etcd, "deleted"))
        for seq in range(1, STEPS + 1):
            client.step("del-a", program(seq))
    assert _placements(etcd)["del-a"].epoch == 1
    for replica in cluster:
        assert_pool_matches(replica.address, "del-a", expected_pool(STEPS))
    assert_pool_matches(seeds, kept, expected_pool(STEPS))

    # A primary paused past its lease while its pool fails over and is deleted: it learns of
    # it on SIGCONT and drops its copy (a stepped-down primary's, or, had its watch missed the
    # failover, its own); its journal still holds the pool, so were that drop not durable its
    # next start would bring the pool back (it has no role for it any more: the data
    # directory is a cluster replica's, and the tombstone decides).
    paused = next(r for r in cluster if r.address == _placements(etcd)["del-a"].primary)
    assert paused.process is not None
    paused.process.send_signal(signal.SIGSTOP)
    try:
        _wait(lambda: _placements(etcd)["del-a"].epoch == 2, "del-a's second failover")
        _delete(cluster, paused, ["del-a"])
    finally:
        paused.process.send_signal(signal.SIGCONT)
    _wait(lambda: "del-a" not in _local_pools(paused), "the paused primary's drop")
    live = _metric(paused, "kvcm_cluster_deleted_pools_dropped_total")
    paused.stop(signal.SIGKILL)
    paused.start()
    wait_for_members(cluster, 3)
    _assert_gone(cluster, {"del-a", *deleted}, {kept})
    # Dropped once, durably: live (its own copy) or at this start (the stepped-down copy).
    assert live + _metric(paused, "kvcm_cluster_deleted_pools_dropped_total") == 1
    assert_pool_matches(seeds, kept, expected_pool(STEPS))
