"""A hot standby per pool (docs/replication.md): two ``kvcm serve --data-dir`` processes on
127.0.0.1 with a static placement (primary A, standby B) set through ReplicaService.SetPlacement.

* Under Step load from several SDK schedulers, every acknowledged program of a sync pool is
  on B, B's copy has A's digest, and after ``kill -9`` of A and B's promotion the schedulers
  go on against B: each pool equals an in-process replay of its acknowledged programs, and
  its event stream on B holds every event once, numbered 1, 2, 3...
* Fencing: SIGSTOP A, promote B, more Steps on B, SIGCONT A: A acknowledges nothing more (a
  Step sent to it while it was paused is refused), steps down, and once B seeds it A's pool
  equals B's.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from _data_dir_server import program
from _replication import (
    Scheduler,
    assert_pool_matches,
    digest_checks,
    expected_pool,
    place,
    replica_state,
    start_pair,
    step_epoch,
)

from kvcm.client import SchedulerClient, ServiceError

POOLS = ("p0", "p1", "p2")


def _wait(predicate, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _create(address: str, pool_ids: tuple[str, ...]) -> None:
    from _replication import CONFIG

    with SchedulerClient(address, timeout=10.0) as client:
        for pool_id in pool_ids:
            client.create_pool(pool_id, CONFIG)


def test_sync_standby_has_every_acknowledged_program_and_takes_over(tmp_path: Path) -> None:
    a, b = start_pair(tmp_path)
    try:
        _create(b.address, ("b-own",))  # B's registry hands out other incarnations than A's
        for pool_id in POOLS:
            assert place(b.address, pool_id, a.address, b.address, 1) == "standby"
            assert place(a.address, pool_id, a.address, b.address, 1) == "primary"
        _create(a.address, POOLS)
        schedulers = [Scheduler(p, a.address, stop_at=40, pause_at=15) for p in POOLS]
        for scheduler in schedulers:
            scheduler.start()
        for scheduler in schedulers:
            scheduler.join()
        # Quiet: every acknowledged program is on B (sync), and B's copy is A's.
        for scheduler in schedulers:
            assert scheduler.acked == list(range(1, 16))
            on_a = replica_state(a.address, scheduler.pool_id)
            on_b = replica_state(b.address, scheduler.pool_id)
            assert (on_a.role, on_b.role) == ("primary", "standby")
            assert on_a.acked_seq == on_a.seq == on_b.seq  # CreatePool + 15 Steps after the seed
            assert on_b.digest
            assert on_a.digest == on_b.digest
            # Digests were due after records 4, 8, 12 and 16 (CreatePool and 15 Steps); each
            # one sent covers every record due before it.
            checked = digest_checks(b.address, scheduler.pool_id, 1)
            assert checked.digest_checks >= 1
            assert checked.digest_mismatches == 0
            assert_pool_matches(b.address, scheduler.pool_id, expected_pool(15))
            # The pool's incarnation (the epoch its event streams carry) is A's on B.
            with SchedulerClient(a.address) as to_a, SchedulerClient(b.address) as to_b:
                epoch = to_a.describe_pool(scheduler.pool_id).epoch
                assert to_b.describe_pool(scheduler.pool_id).epoch == epoch > 0
        # Load again, then kill -9 A in the middle of it.
        for scheduler in schedulers:
            scheduler.pause_at = 0
            scheduler.start()
        _wait(lambda: all(len(s.acked) >= 25 for s in schedulers), "25 programs per pool")
        a.kill()
        killed_at = {s.pool_id: len(s.acked) for s in schedulers}
        for pool_id in POOLS:  # placement's etcd transaction would do this: epoch 2
            assert place(b.address, pool_id, b.address, None, 2) == "primary"
        for scheduler in schedulers:
            scheduler.repoint(b.address)
        for scheduler in schedulers:
            scheduler.join()
        for scheduler in schedulers:
            # Every program acknowledged, each once and in order, across the failover.
            assert scheduler.acked == list(range(1, 41)), scheduler.errors
            assert killed_at[scheduler.pool_id] < 40
            assert_pool_matches(b.address, scheduler.pool_id, expected_pool(40))
            assert replica_state(b.address, scheduler.pool_id).placement_epoch == 2
        # A comes back from its data directory still believing it is primary at epoch 1
        # (replication.json): its first ship is refused by B (epoch 2), so it steps down,
        # acknowledges nothing, and keeps that across its next restart.
        roles = a.data_dir / "replication.json"
        assert {row["role"] for row in json.loads(roles.read_text()).values()} == {"primary"}
        a.start()
        for pool_id in POOLS:
            _wait(lambda p=pool_id: replica_state(a.address, p).role == "fenced", "A to step down")
        with SchedulerClient(a.address, timeout=1.0) as client:
            for pool_id in POOLS:
                with pytest.raises(ServiceError, match="not served by this replica"):
                    client.step(pool_id, program(41))
        saved = json.loads(roles.read_text())
        assert {(row["role"], row["epoch"]) for row in saved.values()} == {("fenced", 2)}
    finally:
        a.stop()
        b.stop()


def test_paused_primary_is_fenced_and_acknowledges_nothing(tmp_path: Path) -> None:
    a, b = start_pair(tmp_path)
    try:
        pool_id = "f"
        place(b.address, pool_id, a.address, b.address, 1)
        place(a.address, pool_id, a.address, b.address, 1)
        _create(a.address, (pool_id,))
        with SchedulerClient(a.address, timeout=10.0) as client:
            for seq in range(1, 11):
                client.step(pool_id, program(seq))
        assert a.process is not None
        a.process.send_signal(signal.SIGSTOP)
        # A Step sent to the paused primary: it must never be acknowledged.
        late: list[object] = []

        def send_late() -> None:
            try:
                with SchedulerClient(a.address, timeout=8.0) as client:
                    late.append(client.step(pool_id, program(11)))
            except ServiceError as exc:
                late.append(exc)

        sender = threading.Thread(target=send_late, daemon=True)
        sender.start()
        time.sleep(0.3)
        assert place(b.address, pool_id, b.address, None, 2) == "primary"
        with SchedulerClient(b.address, timeout=10.0) as client:
            for seq in range(11, 21):
                client.step(pool_id, program(seq))
        a.process.send_signal(signal.SIGCONT)
        sender.join(30)
        assert len(late) == 1, late
        assert isinstance(late[0], ServiceError), late
        # A stepped down when B refused its ship (older epoch): nothing more is acknowledged.
        _wait(lambda: replica_state(a.address, pool_id).role == "fenced", "A to step down")
        with (
            SchedulerClient(a.address, timeout=2.0) as client,
            pytest.raises(ServiceError, match="not served by this replica"),
        ):
            client.step(pool_id, program(21))
        # A primary that stepped down is never promoted before it was seeded again.
        with pytest.raises(grpc.RpcError) as refused:
            place(a.address, pool_id, a.address, None, 3)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "stepped down" in (refused.value.details() or "")
        on_a = replica_state(a.address, pool_id)
        assert (on_a.role, on_a.placement_epoch) == ("fenced", 2)  # nothing changed
        # Placement makes A the standby at epoch 2: B seeds it, A's pool equals B's.
        place(a.address, pool_id, b.address, a.address, 2)
        place(b.address, pool_id, b.address, a.address, 2)
        with SchedulerClient(b.address, timeout=10.0) as client:
            for seq in range(21, 26):
                client.step(pool_id, program(seq))
        on_a = replica_state(a.address, pool_id)
        on_b = replica_state(b.address, pool_id)
        assert on_a.role == "standby"
        assert on_b.role == "primary"
        assert on_a.placement_epoch == on_b.placement_epoch == 2
        assert on_a.digest
        assert on_a.digest == on_b.digest
        assert_pool_matches(a.address, pool_id, expected_pool(25))
        assert_pool_matches(b.address, pool_id, expected_pool(25))
        # Every acknowledgement names the placement epoch that gave it.
        assert step_epoch(b.address, pool_id, program(26)) == "2"
    finally:
        a.stop()
        b.stop()
