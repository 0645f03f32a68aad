"""The pools a data directory brings back are still claimed where nothing says they were deleted.

A replica places the pools its data directory holds that etcd does not place (this replica
their primary), unless etcd holds the pool's tombstone and the directory is a cluster
replica's (docs/cluster.md, "A pool deleted while a replica was down"). Two claims must go on:

* a lone server's data directory (``kvcm serve --data-dir`` without etcd, so no
  ``replication.json``) joining a cluster: its pool is placed and served even where etcd holds
  a tombstone of that id (another cluster's deleted pool), which the placement removes;
* a cluster replica whose placements etcd lost (no records, no tombstones): its pools are
  placed again, each in the replication mode it had.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aetcd
from _cluster import Etcd, Replica
from _load import CONFIG, assert_pool_matches, expected_pool

from _data_dir_server import Server, program  # isort: skip  (tests/integration, via _load)

from kvcm.client import SchedulerClient
from kvcm.server.cluster import Placement

PREFIX = "/kvcm-test-claim"
STEPS = 4


async def _etcd(
    etcd: Etcd, *, put: dict[str, bytes] | None = None, drop: str = ""
) -> dict[str, bytes]:
    """Write ``put``, delete the keys under ``drop``, then read every key under the prefix."""
    host, _, port = etcd.endpoint.removeprefix("http://").rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
        for key, value in (put or {}).items():
            await client.put(f"{PREFIX}/{key}".encode(), value)
        if drop:
            await client.delete_prefix(f"{PREFIX}/{drop}".encode())
        listing = await client.get_prefix(f"{PREFIX}/".encode())
        return {kv.key.decode().removeprefix(f"{PREFIX}/"): kv.value for kv in listing}


def _claimed(etcd: Etcd, *pool_ids: str, timeout_s: float = 10.0) -> dict[str, bytes]:
    """Every key under the prefix once each pool of ``pool_ids`` is placed: a replica claims
    its data directory's pools after it has started and registered, not before."""
    deadline = time.monotonic() + timeout_s
    while True:
        keys = asyncio.run(_etcd(etcd))
        if all(f"placement/{pool_id}" in keys for pool_id in pool_ids):
            return keys
        assert time.monotonic() < deadline, f"not placed within {timeout_s} s: {sorted(keys)}"
        time.sleep(0.05)


def test_a_lone_servers_pools_and_pools_etcd_lost_are_claimed(etcd: Etcd, tmp_path: Path) -> None:
    data_dir = tmp_path / "r0"
    lone = Server(data_dir)
    lone.start()
    try:
        with SchedulerClient(lone.address, timeout=10.0) as client:
            client.create_pool("lone", CONFIG)
            for seq in range(1, STEPS + 1):
                client.step("lone", program(seq))
    finally:
        lone.stop()
    assert not (data_dir / "replication.json").exists()
    # A pool of that id was deleted in the cluster before: its tombstone is there.
    before = asyncio.run(_etcd(etcd, put={"deleted/lone": b'{"epoch": 3, "pool_id": "lone"}'}))
    assert "deleted/lone" in before

    replica = Replica(etcd, PREFIX, data_dir=data_dir)
    replica.start()
    try:
        keys = _claimed(etcd, "lone")
        assert "deleted/lone" not in keys  # removed in the placing transaction
        placed = Placement.decode(keys["placement/lone"])
        assert (placed.primary, placed.standby, placed.epoch) == (replica.address, None, 1)
        assert_pool_matches(replica.address, "lone", expected_pool(STEPS))
        with SchedulerClient(replica.address, timeout=10.0) as client:
            client.create_pool("fast", CONFIG, replication_mode="async")
            for seq in range(1, STEPS + 1):
                client.step("fast", program(seq))
        assert Placement.decode(asyncio.run(_etcd(etcd))["placement/fast"]).mode == "async"
        replica.stop(signal.SIGKILL)

        # etcd lost every record (restored from an old backup, say): no placement, no tombstone.
        left = asyncio.run(_etcd(etcd, drop="placement/"))
        assert not [key for key in left if key.startswith(("placement/", "deleted/"))]
        assert (data_dir / "replication.json").exists()  # a cluster replica's directory now
        replica.start()
        keys = _claimed(etcd, "lone", "fast")
        lone_again = Placement.decode(keys["placement/lone"])
        fast_again = Placement.decode(keys["placement/fast"])
        assert (lone_again.primary, lone_again.mode) == (replica.address, "sync")
        assert (fast_again.primary, fast_again.mode) == (replica.address, "async")
        # The next term after the epoch the data directory knew (1), so a replica that had
        # followed the pool takes it as a primary change, not as a pool created again.
        assert lone_again.epoch == fast_again.epoch == 2
        assert not [key for key in keys if key.startswith("deleted/")]
        for pool_id in ("lone", "fast"):
            assert_pool_matches(replica.address, pool_id, expected_pool(STEPS))
    finally:
        replica.stop(signal.SIGKILL)
