"""What each replication mode promises when a replica dies (docs/replication.md).

* ``sync``, the standby dies: the primary's answers wait for it, then answer UNAVAILABLE
  (the call is applied and journaled on the primary); once placement drops the standby the
  same Step (same step_seq) is answered from memory and the pool goes on; a new standby is
  seeded with a snapshot plus the records after it and then follows live.
* ``async``, the primary dies: the promoted standby holds a consistent prefix of the
  acknowledged programs (an in-process replay of the first k of them), never a mix.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from _data_dir_server import program
from _replication import (
    CONFIG,
    HttpServer,
    assert_pool_matches,
    digest_checks,
    expected_pool,
    place,
    replica_state,
)

from kvcm.client import SchedulerClient, ServiceError, StepBuilder
from kvcm.v1 import service_pb2_grpc

ENV = {"KVCM_REPLICA_DIGEST_EVERY": "4", "KVCM_REPLICA_SYNC_TIMEOUT_S": "0.5"}


def _start(tmp_path: Path, name: str) -> HttpServer:
    server = HttpServer(tmp_path / name, ENV)
    server.start()
    return server


def test_sync_primary_waits_for_a_dead_standby_then_a_new_one_is_seeded(tmp_path: Path) -> None:
    a, b = _start(tmp_path, "a"), _start(tmp_path, "b")
    c: HttpServer | None = None
    try:
        place(b.address, "s", a.address, b.address, 1)
        place(a.address, "s", a.address, b.address, 1)
        with SchedulerClient(a.address, timeout=10.0) as client:
            client.create_pool("s", CONFIG)
            for seq in range(1, 6):
                client.step("s", program(seq))
        assert a.metric("kvcm_replication_role", pool="s", state="primary") == 1
        assert b.metric("kvcm_replication_role", pool="s", state="standby") == 1
        assert a.metric("kvcm_replication_lag_records", pool="s") == 0
        b.kill()
        # Applied on A, never confirmed by its standby: not acknowledged.
        with grpc.insecure_channel(a.address) as channel:
            stub = service_pb2_grpc.SchedulerServiceStub(channel)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.RpcError) as refused:
                stub.Step(StepBuilder.from_program(program(6)).to_proto("s"), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "did not confirm the record within 0.5 s" in refused.value.details()
        assert a.metric("kvcm_replication_lag_records", pool="s") == 1
        assert (a.metric("kvcm_replication_lag_seconds", pool="s") or 0) > 0.4
        with (
            SchedulerClient(a.address, timeout=1.5) as client,
            pytest.raises(ServiceError),  # the SDK's retries of the same step_seq: alike
        ):
            client.step("s", program(6))
        place(a.address, "s", a.address, None, 1)  # placement drops the dead standby
        with SchedulerClient(a.address, timeout=10.0) as client:
            client.step("s", program(6))  # the same step_seq: answered from memory
            for seq in range(7, 11):
                client.step("s", program(seq))
        assert_pool_matches(a.address, "s", expected_pool(10))
        # A new standby: seeded with the pool as of its last record, then it follows live.
        c = _start(tmp_path, "c")
        place(c.address, "s", a.address, c.address, 1)
        place(a.address, "s", a.address, c.address, 1)
        with SchedulerClient(a.address, timeout=10.0) as client:
            for seq in range(11, 21):
                client.step("s", program(seq))
        on_a, on_c = replica_state(a.address, "s"), replica_state(c.address, "s")
        assert (on_c.role, on_c.seq, on_a.acked_seq) == ("standby", on_a.seq, on_a.seq)
        assert on_c.digest == on_a.digest
        checked = digest_checks(c.address, "s", 2)  # the seed's and at least one periodic
        assert checked.digest_checks >= 2
        assert checked.digest_mismatches == 0
        assert_pool_matches(c.address, "s", expected_pool(20))
        assert a.metric("kvcm_replication_lag_records", pool="s") == 0
        assert (a.metric("kvcm_replication_seeds_total", pool="s") or 0) >= 1
        assert c.metric("kvcm_replication_digest_mismatches_total", pool="s") == 0
    finally:
        for server in (a, b, c):
            if server is not None:
                server.stop()


def test_async_standby_holds_a_consistent_prefix_after_the_primary_dies(tmp_path: Path) -> None:
    a, b = _start(tmp_path, "a"), _start(tmp_path, "b")
    try:
        place(b.address, "q", a.address, b.address, 1, sync=False)
        place(a.address, "q", a.address, b.address, 1, sync=False)
        with SchedulerClient(a.address, timeout=10.0) as client:
            client.create_pool("q", CONFIG)
            for seq in range(1, 41):
                client.step("q", program(seq))
        a.kill()  # right after the last answer: the standby may lag behind
        place(b.address, "q", b.address, None, 2)
        with SchedulerClient(b.address, timeout=10.0) as client:
            progress = client.describe_pool("q").step_progress
        assert progress is not None
        applied = progress.last_step_seq
        assert 0 < applied <= 40
        assert_pool_matches(b.address, "q", expected_pool(applied))
        assert b.metric("kvcm_replication_role", pool="q", state="primary") == 1
        assert b.metric("kvcm_replication_promotions_total") == 1
    finally:
        a.stop()
        b.stop()
