"""Failover driven by etcd: three ``kvcm serve --data-dir`` replicas (so each pool has a hot
standby, docs/replication.md), placement in a real etcd.

``kill -9`` the primary of a pool an SDK scheduler drives with exactly-once Steps: once the
dead replica's lease expires its standby takes the pool over by an etcd transaction (epoch
2), the same client goes on without being restarted, every Step acknowledged before the kill
is there (each request's blocks as answered), and the pools the dead replica followed get a
new standby. The failover time is printed (``-s``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import grpc
import pytest
from _cluster import Etcd, Replica, durable_replicas, running, wait_for_members

from kvcm.client import ItemStatus, SchedulerClient, ServiceError, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.cluster import Placement
from kvcm.v1 import admin_pb2, replica_pb2, replica_pb2_grpc, service_pb2_grpc

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=1024,
    explicit_layout=KVCacheConfig(
        num_blocks=256,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)
LEASE_TTL_S = 2
PREFIX = "/kvcm-test-failover"


@pytest.fixture
def cluster(etcd: Etcd, tmp_path: Path) -> Iterator[list[Replica]]:
    with running(durable_replicas(etcd, PREFIX, tmp_path, lease_ttl_s=LEASE_TTL_S)) as started:
        yield started


async def _placements(etcd: Etcd) -> dict[str, Placement]:
    host, _, port = etcd.endpoint.removeprefix("http://").rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
        listing = await client.get_prefix(f"{PREFIX}/placement/".encode())
        return {p.pool_id: p for p in (Placement.decode(kv.value) for kv in listing)}


def _step(client: SchedulerClient, pool: str, seq: int, key: int) -> list[list[int]]:
    """Add request ``key`` and allocate its prompt, exactly once (``step_seq``)."""
    prompt = [key * 1000 + i for i in range(48)]
    step = StepBuilder()
    step.step_seq = seq
    step.add_request(key, prompt, client.block_hasher(pool).hash_token_ids(prompt))
    step.allocate(key, len(prompt), 0, lookup=True)
    result = client.step(pool, step, timeout=10.0)
    assert result.statuses == [ItemStatus.OK]
    return [list(ids) for ids in client.get_block_ids(pool, key)]


def test_kill_9_of_a_primary_its_standby_takes_over_and_nothing_acknowledged_is_lost(
    etcd: Etcd, cluster: list[Replica]
) -> None:
    seeds = ",".join(replica.address for replica in cluster)
    pools = ["fo-a", "fo-b", "fo-c"]
    with SchedulerClient(seeds, timeout=10.0) as client:
        for pool in pools:
            client.create_pool(pool, CONFIG)
        before = asyncio.run(_placements(etcd))
        assert {p.primary for p in before.values()} == {r.address for r in cluster}
        victim_pool = pools[0]
        victim = next(r for r in cluster if r.address == before[victim_pool].primary)
        standby = before[victim_pool].standby
        acknowledged = {key: _step(client, victim_pool, key, key) for key in range(1, 9)}

        victim.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        # Before its lease runs out the dead replica is still listed: a fan-out says it missed it.
        live = next(r for r in cluster if r is not victim)
        with grpc.insecure_channel(live.address) as channel:
            stub = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
            answer, call = stub.ListPools.with_call(admin_pb2.ListPoolsRequest(), timeout=5)
        trailer = dict(call.trailing_metadata())
        if time.monotonic() - killed_at < LEASE_TTL_S - 0.5:  # (a slow machine may be past it)
            assert trailer["kvcm-missing-replicas"] == victim.address
            assert trailer["kvcm-replicas"] == "3"
            assert {"fo-b", "fo-c"} <= {p.pool_id for p in answer.pools}
        seq = len(acknowledged) + 1
        while True:  # the same client, not restarted
            try:
                acknowledged[seq] = _step(client, victim_pool, seq, seq)
                break
            except ServiceError:
                assert time.monotonic() - killed_at < LEASE_TTL_S + 10, "no failover"
                time.sleep(0.1)
        failover_s = time.monotonic() - killed_at
        print(f"failover: {failover_s:.2f} s (lease TTL {LEASE_TTL_S} s)")
        assert failover_s < LEASE_TTL_S + 6

        after = asyncio.run(_placements(etcd))
        assert (after[victim_pool].primary, after[victim_pool].epoch) == (standby, 2)
        for key, ids in acknowledged.items():  # every acknowledged Step is there
            assert [list(x) for x in client.get_block_ids(victim_pool, key)] == ids
        for pool in pools[1:]:  # the other pools never stopped
            assert client.describe_pool(pool).pool_id == pool
        deadline = time.monotonic() + 10
        while any(victim.address in (p.primary, p.standby) for p in after.values()):
            assert time.monotonic() < deadline, f"placements still name {victim.address}"
            time.sleep(0.2)
            after = asyncio.run(_placements(etcd))


@pytest.mark.skipif(os.environ.get("KVCM_LONG") != "1", reason="long run: KVCM_LONG=1")
def test_thirty_kills_in_a_row_lose_nothing_and_say_how_long_failover_takes(
    etcd: Etcd, cluster: list[Replica], tmp_path: Path
) -> None:
    """Kill -9 the pool's primary 30 times, starting a fresh replica after each kill so three
    stay live; print failover time p50/p99."""
    live = list(cluster)
    pool = "fo-long"
    times: list[float] = []
    acknowledged: dict[int, list[list[int]]] = {}
    seq = 0
    for kill in range(30):
        # Seeds are the replicas live now (a deployment's seeds are a stable name, e.g. a
        # Kubernetes Service; here the killed replicas are replaced by new addresses).
        with SchedulerClient(",".join(r.address for r in live), timeout=10.0) as client:
            if kill == 0:
                client.create_pool(pool, CONFIG)
            placement = asyncio.run(_placements(etcd))[pool]
            deadline = time.monotonic() + 15
            while placement.standby not in {r.address for r in live}:
                assert time.monotonic() < deadline, f"kill {kill}: no live standby"
                time.sleep(0.1)
                placement = asyncio.run(_placements(etcd))[pool]
            seq += 1  # acknowledged in sync mode: the standby has it before the answer
            acknowledged[seq] = _step(client, pool, seq, seq)
            victim = next(r for r in live if r.address == placement.primary)
            victim.stop(signal.SIGKILL)
            live.remove(victim)
            killed_at = time.monotonic()
            seq += 1
            while True:  # the same client goes on
                try:
                    acknowledged[seq] = _step(client, pool, seq, seq)
                    break
                except ServiceError:
                    assert time.monotonic() - killed_at < LEASE_TTL_S + 10, f"kill {kill}"
                    time.sleep(0.05)
            times.append(time.monotonic() - killed_at)
            for key, ids in acknowledged.items():
                assert [list(x) for x in client.get_block_ids(pool, key)] == ids, (kill, key)
            for key in list(acknowledged)[:-4]:  # keep the pool from filling up
                finish = StepBuilder()
                seq += 1
                finish.step_seq = seq
                finish.finish(key)
                client.step(pool, finish, timeout=10.0)
                del acknowledged[key]
        fresh = Replica(etcd, PREFIX, lease_ttl_s=LEASE_TTL_S, data_dir=tmp_path / f"k{kill}")
        fresh.start()
        cluster.append(fresh)  # stopped by the fixture
        live.append(fresh)
        wait_for_members(live, 3)
    times.sort()
    p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
    print(
        f"failover over {len(times)} kills: p50 {p50:.2f} s, p99 {p99:.2f} s, max {times[-1]:.2f} s"
    )


def _replica_state(address: str, pool: str) -> replica_pb2.GetReplicaStateResponse:
    with grpc.insecure_channel(address) as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
        answer: replica_pb2.GetReplicaStateResponse = stub.GetReplicaState(
            replica_pb2.GetReplicaStateRequest(pool_id=pool), timeout=5
        )
        return answer


def _wait_replicated(placement: Placement, pool: str) -> None:
    """Until the primary serves ``pool`` at the placement's epoch and its standby holds the
    same state (digest) at that epoch."""
    deadline = time.monotonic() + 15
    while True:
        primary = _replica_state(placement.primary, pool)
        assert placement.standby is not None
        standby = _replica_state(placement.standby, pool)
        seen = (primary.role, primary.placement_epoch, standby.role, standby.placement_epoch)
        if (
            seen == ("primary", placement.epoch, "standby", placement.epoch)
            and primary.digest
            and primary.digest == standby.digest
        ):
            return
        assert time.monotonic() < deadline, f"{pool} not replicated at {placement}: {seen}"
        time.sleep(0.1)


def test_a_pool_deleted_and_created_again_after_a_failover_is_served_and_replicated(
    etcd: Etcd, cluster: list[Replica]
) -> None:
    """The deleted pool's placement had epoch 2 (its primary changed); the new pool's starts at
    1 again: every replica forgets the old epoch when the placement record is deleted, so the
    new placement is not ignored as stale (the new pool is served and has a standby), and the
    old primary, stepped down with a copy kept for reads, drops that copy (else it would
    serve it as a local pool once the placement is gone)."""
    seeds = ",".join(replica.address for replica in cluster)
    pool = "re-a"
    with SchedulerClient(seeds, timeout=10.0) as client:
        client.create_pool(pool, CONFIG)
        _step(client, pool, 1, 1)
        first = asyncio.run(_placements(etcd))[pool]
        _wait_replicated(first, pool)
        # The primary changes (as a failover does): epoch 2, the old standby primary, the third
        # replica its standby; the old primary steps down, keeping its copy for reads.
        assert first.standby is not None
        third = next(r.address for r in cluster if r.address not in (first.primary, first.standby))
        moved = Placement(pool_id=pool, primary=first.standby, standby=third, epoch=2)
        asyncio.run(_put(etcd, moved))
        _wait_replicated(moved, pool)
        _step(client, pool, 2, 2)
        fenced = _replica_state(first.primary, pool)
        assert (fenced.role, fenced.placement_epoch) == ("fenced", 2)
        assert fenced.digest  # its copy, kept for reads

        client.delete_pool(pool)
        deadline = time.monotonic() + 10
        while pool in asyncio.run(_placements(etcd)) or _replica_state(first.primary, pool).digest:
            assert time.monotonic() < deadline, "the deleted pool's placement or copy stayed"
            time.sleep(0.1)
        assert _replica_state(first.primary, pool).role == "none"
        client.create_pool(pool, CONFIG)
        again = asyncio.run(_placements(etcd))[pool]
        assert again.epoch == 1
        acknowledged = {key: _step(client, pool, key, key) for key in range(1, 4)}
        _wait_replicated(again, pool)
        for key, ids in acknowledged.items():
            assert [list(x) for x in client.get_block_ids(pool, key)] == ids
        assert _replica_state(again.standby or "", pool).seq >= 3  # it follows the new pool


async def _put(etcd: Etcd, placement: Placement) -> None:
    host, _, port = etcd.endpoint.removeprefix("http://").rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
        await client.put(f"{PREFIX}/placement/{placement.pool_id}".encode(), placement.encode())


def test_a_replica_that_missed_a_delete_takes_the_new_pool_at_epoch_1(
    etcd: Etcd, cluster: list[Replica]
) -> None:
    """A replica down while its pool (epoch 2 there, kept in its data directory) was deleted
    and created again sees the new epoch-1 placement on its return: that is the delete it
    missed, so it forgets the old epoch and can be the new pool's standby (an old epoch kept
    would refuse the new primary's stream as stale and fence it)."""
    seeds = ",".join(replica.address for replica in cluster)
    pool = "re-b"
    with SchedulerClient(seeds, timeout=10.0) as client:
        client.create_pool(pool, CONFIG)
        first = asyncio.run(_placements(etcd))[pool]
        assert first.standby is not None
        moved = Placement(pool_id=pool, primary=first.standby, standby=first.primary, epoch=2)
        asyncio.run(_put(etcd, moved))
        _wait_replicated(moved, pool)
        _step(client, pool, 1, 1)
        away = next(r for r in cluster if r.address == first.primary)  # the standby now
        away.stop(signal.SIGKILL)
        others = [r for r in cluster if r is not away]
        wait_for_members(others, 2)
        client.delete_pool(pool)
        client.create_pool(pool, CONFIG)
        again = asyncio.run(_placements(etcd))[pool]
        assert again.epoch == 1
        assert away.address not in (again.primary, again.standby)
        away.start()  # the same address and data directory: it knew epoch 2
        wait_for_members(cluster, 3)
        # Make it the new pool's standby (as a move or a replacement would).
        with_away = Placement(pool_id=pool, primary=again.primary, standby=away.address, epoch=1)
        asyncio.run(_put(etcd, with_away))
        acknowledged = {key: _step(client, pool, key, key) for key in range(1, 4)}
        _wait_replicated(with_away, pool)
        for key, ids in acknowledged.items():
            assert [list(x) for x in client.get_block_ids(pool, key)] == ids
