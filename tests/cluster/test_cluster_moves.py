"""Moving pools live and draining a replica (``kvcm cluster move|drain``, docs/cluster.md):
three ``kvcm serve --data-dir`` replicas on a real etcd, three SDK schedulers driving
exactly-once Steps through the seed list and one KV-event reader per pool, all the while.

* ``kvcm cluster move POOL --to ADDRESS`` (the real command line, in a subprocess) makes the
  replica that held nothing of the pool its primary: the pool's record names it primary, the
  old primary its standby, epoch 2; the old primary has stepped down and follows.
* ``kvcm cluster drain ADDRESS`` leaves the replica primary of no pool.
* Refusals name what is wrong (an unknown pool, a replica that is not live) and change no
  record.
* The clients are never restarted; at the end every pool equals an in-process replay of its
  acknowledged programs (nothing acknowledged lost) and every reader saw each event once.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest
from _cluster import Etcd, Replica, durable_replicas, running
from _load import CONFIG, Driver, Reader, assert_pool_matches, expected_pool
from _replication import replica_state

from kvcm.client import SchedulerClient
from kvcm.server.cluster import Placement

PREFIX = "/kvcm-test-moves"
POOLS = ["mv-0", "mv-1", "mv-2"]


@pytest.fixture
def cluster(etcd: Etcd, tmp_path: Path) -> Iterator[list[Replica]]:
    with running(durable_replicas(etcd, PREFIX, tmp_path)) as started:
        yield started


def _placements(etcd: Etcd) -> dict[str, Placement]:
    async def read() -> dict[str, Placement]:
        host, _, port = etcd.endpoint.removeprefix("http://").rpartition(":")
        async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
            listing = await client.get_prefix(f"{PREFIX}/placement/".encode())
            return {p.pool_id: p for p in (Placement.decode(kv.value) for kv in listing)}

    return asyncio.run(read())


def _kvcm(etcd: Etcd, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcm.cli", "cluster", "--etcd-endpoints", etcd.endpoint,
         "--etcd-prefix", PREFIX, "--timeout", "30", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _more_acks(drivers: list[Driver], count: int = 3) -> None:
    seen = [len(d.acks) for d in drivers]
    deadline = time.monotonic() + 20
    while any(len(d.acks) < n + count for d, n in zip(drivers, seen, strict=True)):
        assert time.monotonic() < deadline, f"schedulers stalled: {[len(d.acks) for d in drivers]}"
        time.sleep(0.05)


def test_move_and_drain_under_load_lose_nothing_and_clients_follow(
    etcd: Etcd, cluster: list[Replica]
) -> None:
    seeds = ",".join(replica.address for replica in cluster)
    with SchedulerClient(seeds, timeout=10.0) as client:
        for pool_id in POOLS:
            client.create_pool(pool_id, CONFIG)
    drivers = [Driver(seeds, pool_id) for pool_id in POOLS]
    readers = [Reader(seeds, pool_id) for pool_id in POOLS]
    try:
        for worker in [*drivers, *readers]:
            worker.thread.start()
        _more_acks(drivers, 5)

        # Refusals change nothing.
        before = _placements(etcd)
        refused = _kvcm(etcd, "move", "no-such-pool", "--to", cluster[0].address)
        assert refused.returncode == 1
        assert "pool 'no-such-pool' has no placement" in refused.stderr
        refused = _kvcm(etcd, "move", POOLS[0], "--to", "127.0.0.1:1")
        assert refused.returncode == 1
        assert "127.0.0.1:1 is not a live replica" in refused.stderr
        assert _placements(etcd) == before

        # Move a pool to the replica that held nothing of it, under load.
        old = before[POOLS[0]]
        target = next(r.address for r in cluster if r.address not in (old.primary, old.standby))
        started = time.monotonic()
        moved = _kvcm(etcd, "move", POOLS[0], "--to", target)
        took = time.monotonic() - started
        assert moved.returncode == 0, moved.stderr
        print(f"move: {took:.2f} s (the command, Python's start included)")
        after = _placements(etcd)[POOLS[0]]
        assert (after.primary, after.standby, after.epoch) == (target, old.primary, 2)
        assert f"{POOLS[0]}: primary {target}, standby {old.primary}, epoch 2" in moved.stdout
        deadline = time.monotonic() + 20
        while replica_state(old.primary, POOLS[0]).role != "standby":  # stepped down, follows
            assert time.monotonic() < deadline, replica_state(old.primary, POOLS[0])
            time.sleep(0.05)
        _more_acks(drivers)  # the same clients, following the move

        # Drain a replica: it is left primary of nothing.
        drained = max(cluster, key=lambda r: sum(p.primary == r.address for p in after_all(etcd)))
        primaries_before = [p for p in _placements(etcd).values() if p.primary == drained.address]
        assert primaries_before
        result = _kvcm(etcd, "drain", drained.address)
        assert result.returncode == 0, result.stderr
        assert f"{drained.address}: primary of no pool ({len(primaries_before)} moved)" in (
            result.stdout
        )
        final = _placements(etcd)
        assert all(p.primary != drained.address for p in final.values())
        for placement in primaries_before:
            assert final[placement.pool_id].epoch == placement.epoch + 1
        _more_acks(drivers)

        for driver in drivers:
            driver.stopping.set()
        for driver in drivers:
            driver.thread.join(15)
            assert not driver.thread.is_alive()
        final = _placements(etcd)
        for driver, reader in zip(drivers, readers, strict=True):
            acked = sorted(driver.acks)
            assert acked == list(range(1, len(acked) + 1))
            expected = expected_pool(len(acked))
            assert_pool_matches(final[driver.pool_id].primary, driver.pool_id, expected)
            reader.stop(expected.last_event_sequence)
            want = [(i + 1, repr(e)) for i, (e, _) in enumerate(expected.event_log_contents())]
            assert reader.seen == want, driver.pool_id
    finally:
        for worker in [*drivers, *readers]:
            worker.stopping.set()
        for reader in readers:
            if reader.stream is not None:
                reader.stream.close()


def after_all(etcd: Etcd) -> list[Placement]:
    return list(_placements(etcd).values())
