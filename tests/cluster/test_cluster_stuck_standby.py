"""A standby that is live in etcd but does not acknowledge no longer freezes its sync pool.

Real etcd and three ``kvcm serve --data-dir`` replicas (sync standbys). The standby of a pool
that an SDK scheduler drives through the seed list is SIGSTOPped: its process answers nothing,
yet its etcd lease (TTL 15 s) stays live for the whole stop, so failover never sees it leave,
as with a full disk, a stuck apply or a partition between two replicas. The pool's calls
time out waiting for it (``KVCM_REPLICA_SYNC_TIMEOUT_S`` 1 s); after three in a row the
primary swaps the placement for one naming the third replica standby (an etcd transaction,
same epoch); the waiting calls wait for the new standby's seed, and Steps are acknowledged
again within a bound. The stopped replica is no longer in the placement (it cannot be
promoted) and, resumed, holds no standby role; the pool equals an in-process replay of every
acknowledged program on the primary and on the new standby (digests).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import httpx
import pytest
from _cluster import Etcd, Replica, durable_replicas, running
from _load import CONFIG, assert_pool_matches, expected_pool

from _data_dir_server import program  # isort: skip  (tests/integration, put on sys.path by _load)
from _replication import replica_state  # isort: skip

from kvcm.client import RetryPolicy, SchedulerClient
from kvcm.server.cluster import Placement

LEASE_TTL_S = 15  # the stopped standby's lease outlives the test's stop
SYNC_TIMEOUT_S = 1
PREFIX = "/kvcm-test-stuck-standby"
POLICY = RetryPolicy(max_attempts=5, initial_backoff_s=0.02, max_backoff_s=0.05)
# Three sync timeouts, the etcd transaction, the new standby's seed, the SDK's retry.
RESUME_BOUND_S = 3 * SYNC_TIMEOUT_S + 4.0


@pytest.fixture
def cluster(etcd: Etcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Replica]]:
    monkeypatch.setenv("KVCM_REPLICA_SYNC_TIMEOUT_S", str(SYNC_TIMEOUT_S))
    with running(durable_replicas(etcd, PREFIX, tmp_path, lease_ttl_s=LEASE_TTL_S)) as started:
        yield started


async def _read(etcd: Etcd) -> tuple[dict[str, Placement], set[str]]:
    host, _, port = etcd.endpoint.removeprefix("http://").rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
        placed = await client.get_prefix(f"{PREFIX}/placement/".encode())
        live = await client.get_prefix(f"{PREFIX}/replicas/".encode())
        placements = {p.pool_id: p for p in (Placement.decode(kv.value) for kv in placed)}
        prefix = len(f"{PREFIX}/replicas/")
        return placements, {kv.key.decode()[prefix:] for kv in live}


def _metric(replica: Replica, name: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{replica.http_port}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported by {replica.address}")


class _Stepper:
    """``program(1..)`` on the pool through the seed list, each resent (same step_seq) until
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

    def acked_after(self, moment: float) -> float | None:
        times = [acked for sent, acked in list(self.acks.values()) if sent > moment]
        return min(times) if times else None

    def stop(self) -> int:
        self.stopping.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        acked = sorted(self.acks)
        assert acked == list(range(1, len(acked) + 1))
        return len(acked)


def _wait(condition: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_standby_live_in_etcd_that_does_not_acknowledge_is_replaced(
    cluster: list[Replica], etcd: Etcd
) -> None:
    by_address = {replica.address: replica for replica in cluster}
    seeds = ",".join(by_address)
    with SchedulerClient(seeds, timeout=10.0) as client:
        client.create_pool("stuck", CONFIG)
    before = asyncio.run(_read(etcd))[0]["stuck"]
    assert before.standby is not None
    primary, stuck = by_address[before.primary], by_address[before.standby]
    (third,) = set(cluster) - {primary, stuck}
    _wait(lambda: replica_state(stuck.address, "stuck").has_copy, "the standby's seed")

    stepper = _Stepper(seeds, "stuck")
    stepper.thread.start()
    try:
        _wait(lambda: len(stepper.acks) >= 20, "Steps before the stop")
        assert stuck.process is not None
        stuck.process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        _wait(lambda: stepper.acked_after(stopped + SYNC_TIMEOUT_S) is not None, "Steps again")
        resumed = stepper.acked_after(stopped + SYNC_TIMEOUT_S)
        assert resumed is not None
        assert resumed - stopped <= RESUME_BOUND_S, resumed - stopped
        print(f"Steps acknowledged again {resumed - stopped:.2f} s after the SIGSTOP")

        placements, live = asyncio.run(_read(etcd))
        after = placements["stuck"]
        # Replaced while its lease was live: the same epoch and primary, the third replica.
        assert stuck.address in live
        assert (after.primary, after.epoch) == (before.primary, before.epoch)
        assert after.standby == third.address
        assert _metric(primary, "kvcm_cluster_standby_replacements_total") == 1.0
        count = len(stepper.acks)
        _wait(lambda: len(stepper.acks) >= count + 20, "Steps with the new standby")
        stuck.process.send_signal(signal.SIGCONT)
        count = len(stepper.acks)
        _wait(lambda: len(stepper.acks) >= count + 20, "Steps after the old standby resumed")
    finally:
        steps = stepper.stop()

    # The resumed replica holds no role that failover could promote; the placement is as
    # replaced (it did not come back as the standby).
    _wait(lambda: replica_state(stuck.address, "stuck").role != "standby", "the old standby")
    assert not replica_state(stuck.address, "stuck").has_copy
    final = asyncio.run(_read(etcd))[0]["stuck"]
    assert (final.primary, final.standby, final.epoch) == (
        before.primary,
        third.address,
        before.epoch,
    )
    expected = expected_pool(steps)
    assert_pool_matches(primary.address, "stuck", expected)
    _wait(
        lambda: (
            replica_state(third.address, "stuck").digest
            == replica_state(primary.address, "stuck").digest
        ),
        "the new standby's copy",
    )
    assert replica_state(third.address, "stuck").has_copy
