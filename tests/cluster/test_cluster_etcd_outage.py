"""etcd stopped under load, in the production setup: replicas with ``--data-dir`` (every pool a
``sync`` pool with a hot standby), SDK schedulers driving Steps throughout.

etcd stays down for over twice the lease TTL, so every replica's lease expires in etcd's view
meanwhile. Throughout the outage every pool's Steps are acknowledged (its primary and standby
talk to each other directly; nothing on a call's path waits for etcd), while CreatePool is
refused UNAVAILABLE naming etcd and creates nothing. After etcd returns no failover happens
(every placement record, epoch included, is what it was: leases expired together, and each
replica re-registers before it acts on departures), a new pool can be created again, and every
pool equals an in-process replay of its acknowledged programs.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import httpx
import pytest
from _cluster import Etcd, Replica, durable_replicas, running
from _load import CONFIG, Driver, assert_pool_matches, expected_pool

from kvcm.client import SchedulerClient, UnavailableError
from kvcm.server.cluster import Placement

LEASE_TTL_S = 2
OUTAGE_S = 2 * LEASE_TTL_S + 1.5
PREFIX = "/kvcm-test-etcd-outage"
POOLS = [f"outage-{i}" for i in range(3)]
# The longest a pool may go without an acknowledged Step during the outage (a Step every
# ~10 ms when all is well; a 2-core VM's scheduling hiccups stay well under this).
MAX_GAP_S = 1.0


@pytest.fixture
def cluster(etcd: Etcd, tmp_path: Path) -> Iterator[list[Replica]]:
    try:
        with running(durable_replicas(etcd, PREFIX, tmp_path, lease_ttl_s=LEASE_TTL_S)) as started:
            yield started
    finally:
        if etcd.process is None:
            etcd.start()  # the module's etcd, for the tests after this one


async def _placements(etcd: Etcd) -> dict[str, Placement]:
    host, _, port = etcd.endpoint.removeprefix("http://").rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
        listing = await client.get_prefix(f"{PREFIX}/placement/".encode())
        return {p.pool_id: p for p in (Placement.decode(kv.value) for kv in listing)}


def _metric(replica: Replica, name: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{replica.http_port}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported by {replica.address}")


def _wait_session(replicas: list[Replica], up: float, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    for replica in replicas:
        while _metric(replica, "kvcm_cluster_etcd_session_up") != up:
            assert time.monotonic() < deadline, f"{replica.address}: session never {up}"
            time.sleep(0.1)


def test_etcd_down_under_load_sync_pools_keep_acknowledging_and_placement_waits(
    cluster: list[Replica], etcd: Etcd
) -> None:
    seeds = ",".join(replica.address for replica in cluster)
    with SchedulerClient(seeds, timeout=10.0) as client:
        for pool_id in POOLS:
            client.create_pool(pool_id, CONFIG)
    before = asyncio.run(_placements(etcd))
    assert sorted(before) == POOLS
    assert all(p.standby is not None and p.epoch == 1 for p in before.values()), before

    drivers = [Driver(seeds, pool_id) for pool_id in POOLS]
    for driver in drivers:
        driver.thread.start()
    try:
        deadline = time.monotonic() + 20
        while min(len(d.acks) for d in drivers) < 20:
            assert time.monotonic() < deadline, "no Steps before the outage"
            time.sleep(0.05)
        etcd.stop()
        down = time.monotonic()
        try:
            _wait_session(cluster, 0.0)
            with SchedulerClient(seeds, timeout=5.0) as client:
                with pytest.raises(UnavailableError, match="etcd") as refused:
                    client.create_pool("created-during-outage", CONFIG)
                assert "placement resumes when etcd is back" in str(refused.value)
            time.sleep(max(0.0, down + OUTAGE_S - time.monotonic()))
            up = time.monotonic()
            with SchedulerClient(seeds, timeout=5.0) as client:
                listed = {p.pool_id for p in client.list_pools()}
            assert "created-during-outage" not in listed
        finally:
            etcd.start()
        _wait_session(cluster, 1.0)
        time.sleep(2 * LEASE_TTL_S)  # time for any (wrong) failover to happen
        after_outage = time.monotonic()
        count = [len(d.acks) for d in drivers]
        deadline = time.monotonic() + 10
        while any(len(d.acks) < n + 20 for d, n in zip(drivers, count, strict=True)):
            assert time.monotonic() < deadline, "Steps stopped after etcd came back"
            time.sleep(0.05)
    finally:
        for driver in drivers:
            driver.stopping.set()
        for driver in drivers:
            driver.thread.join(30)

    for driver in drivers:
        acked = sorted(driver.acks)
        assert acked == list(range(1, len(acked) + 1))
        # Acknowledged throughout the outage: no gap longer than MAX_GAP_S between down and up.
        during = sorted(at for _, at in driver.acks.values() if down <= at <= up)
        assert len(during) >= 50, (driver.pool_id, len(during))
        marks = [down, *during, up]
        gap = max(b - a for a, b in itertools.pairwise(marks))
        assert gap <= MAX_GAP_S, (driver.pool_id, gap)
        assert any(at > after_outage for _, at in driver.acks.values())

    # No failover, no standby change: every record as it was, epochs included.
    after = asyncio.run(_placements(etcd))
    assert after == before
    with SchedulerClient(seeds, timeout=10.0) as client:
        client.create_pool("created-after-outage", CONFIG)
    for driver in drivers:
        placement = after[driver.pool_id]
        assert_pool_matches(placement.primary, driver.pool_id, expected_pool(len(driver.acks)))
