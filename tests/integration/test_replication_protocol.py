"""ReplicaService's refusals, message by message, on a real standby (docs/replication.md):
bad placements are INVALID_ARGUMENT naming the field and change nothing; an older placement
is FAILED_PRECONDITION; on a ShipRecords stream a message with an older epoch is answered
STALE_EPOCH, a record that does not follow the last one NEED_SEED, a digest that differs
DIGEST_MISMATCH (the copy is dropped), and none of them changes the standby's pool."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from _data_dir_server import CONFIG, program

from kvcm.client import SchedulerClient, ServiceError, StepBuilder
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings
from kvcm.v1 import admin_pb2, replica_pb2, replica_pb2_grpc
from kvcm.wire import pool_config_to_proto

PRIMARY = "127.0.0.1:1"  # never dialled: the test plays the primary


@pytest.fixture
def standby(tmp_path: Path) -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="",
            data_dir=str(tmp_path / "b"),
            log_level="ERROR",
        )
    )
    try:
        yield running
    finally:
        running.stop()


def _stub(channel: grpc.Channel) -> replica_pb2_grpc.ReplicaServiceStub:
    return replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]


def _place(**fields: object) -> replica_pb2.SetPlacementRequest:
    base: dict[str, object] = {"pool_id": "p", "primary": PRIMARY, "placement_epoch": 3}
    return replica_pb2.SetPlacementRequest(**{**base, **fields})  # type: ignore[arg-type]


def _record(seq: int, request: bytes, method: str = "Step") -> replica_pb2.ShipRecordsRequest:
    return replica_pb2.ShipRecordsRequest(
        pool_id="p",
        placement_epoch=3,
        seq=seq,
        record=replica_pb2.ReplicaRecord(method=method, request=request, time=1000.0 + seq),
    )


def test_bad_placements_name_their_field_and_change_nothing(standby: EmbeddedServer) -> None:
    with grpc.insecure_channel(standby.grpc_address) as channel:
        stub = _stub(channel)
        for fields, field in (
            ({"pool_id": ""}, "pool_id"),
            ({"primary": ""}, "primary"),
            ({"standby": PRIMARY}, "standby"),
            ({"placement_epoch": 0}, "placement_epoch"),
            ({"mode": 7}, "mode"),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                stub.SetPlacement(_place(**fields), timeout=10)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"SetPlacement: {field}:" in (refused.value.details() or "")
            state = stub.GetReplicaState(replica_pb2.GetReplicaStateRequest(pool_id="p"))
            assert (state.role, state.placement_epoch) == ("none", 0)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetReplicaState(replica_pb2.GetReplicaStateRequest(pool_id=""), timeout=10)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "pool_id" in (refused.value.details() or "")
        assert stub.SetPlacement(_place(standby=standby.grpc_address)).role == "standby"
        with pytest.raises(grpc.RpcError) as refused:
            stub.SetPlacement(_place(standby=standby.grpc_address, placement_epoch=2))
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "placement_epoch: 2 is older than 3" in (refused.value.details() or "")


def test_ship_records_refuses_stale_gapped_and_differing_messages(
    standby: EmbeddedServer,
) -> None:
    with grpc.insecure_channel(standby.grpc_address) as channel:
        stub = _stub(channel)
        stub.SetPlacement(_place(standby=standby.grpc_address), timeout=10)
        config = pool_config_to_proto(CONFIG)
        create = admin_pb2.CreatePoolRequest(pool_id="p", config=config).SerializeToString()
        steps = [
            StepBuilder.from_program(program(seq)).to_proto("p").SerializeToString()
            for seq in (1, 2)
        ]
        messages = [
            replica_pb2.ShipRecordsRequest(pool_id="p", placement_epoch=3),  # hello
            replica_pb2.ShipRecordsRequest(  # seed: the pool does not exist yet
                pool_id="p",
                placement_epoch=3,
                seq=0,
                seed=replica_pb2.ReplicaSeed(last=True, exists=False),
            ),
            _record(1, create, "CreatePool"),
            _record(2, steps[0]),
            replica_pb2.ShipRecordsRequest(pool_id="p", placement_epoch=2, seq=3),  # stale
            _record(4, steps[1]),  # does not follow record 2
        ]
        answers = list(stub.ShipRecords(iter(messages), timeout=20))
        statuses = [(a.status, a.seq, a.placement_epoch) for a in answers]
        assert statuses == [
            (replica_pb2.SHIP_STATUS_OK, 0, 3),
            (replica_pb2.SHIP_STATUS_OK, 0, 3),
            (replica_pb2.SHIP_STATUS_OK, 1, 3),
            (replica_pb2.SHIP_STATUS_OK, 2, 3),
            (replica_pb2.SHIP_STATUS_STALE_EPOCH, 2, 3),
            (replica_pb2.SHIP_STATUS_NEED_SEED, 2, 3),
        ]
        with SchedulerClient(standby.grpc_address, timeout=10.0) as client:
            after_two = client.describe_pool("p")
        assert after_two.num_requests == 0  # program 1 finished its request
        # A digest that differs: the copy is dropped (a seed is asked for), nothing applied.
        messages = [
            replica_pb2.ShipRecordsRequest(pool_id="p", placement_epoch=3),
            replica_pb2.ShipRecordsRequest(
                pool_id="p",
                placement_epoch=3,
                seq=0,
                seed=replica_pb2.ReplicaSeed(last=True, exists=False),
            ),
            _record(1, create, "CreatePool"),
            replica_pb2.ShipRecordsRequest(
                pool_id="p", placement_epoch=3, seq=1, digest=b"\x00" * 16
            ),
            _record(2, steps[0]),
        ]
        answers = list(stub.ShipRecords(iter(messages), timeout=20))
        assert [a.status for a in answers] == [
            replica_pb2.SHIP_STATUS_OK,
            replica_pb2.SHIP_STATUS_OK,
            replica_pb2.SHIP_STATUS_OK,
            replica_pb2.SHIP_STATUS_DIGEST_MISMATCH,
            replica_pb2.SHIP_STATUS_NEED_SEED,
        ]
        state = stub.GetReplicaState(replica_pb2.GetReplicaStateRequest(pool_id="p"))
        assert (state.role, state.seq, state.digest_mismatches) == ("standby", 1, 1)
        # Clients' mutations of a standby's copy are refused; reads are answered.
        with SchedulerClient(standby.grpc_address, timeout=2.0) as client:
            assert client.describe_pool("p").num_requests == 0
            with pytest.raises(ServiceError, match="not served by this replica"):
                client.step("p", program(3))


def test_only_the_newest_stream_changes_the_copy(standby: EmbeddedServer) -> None:
    """A primary that reconnected leaves its old stream open: that one changes nothing."""
    with grpc.insecure_channel(standby.grpc_address) as channel:
        stub = _stub(channel)
        stub.SetPlacement(_place(standby=standby.grpc_address), timeout=10)
        create = admin_pb2.CreatePoolRequest(
            pool_id="p", config=pool_config_to_proto(CONFIG)
        ).SerializeToString()
        old: queue.Queue[replica_pb2.ShipRecordsRequest | None] = queue.Queue()
        old_answers = stub.ShipRecords(iter(old.get, None), timeout=20)
        hello = replica_pb2.ShipRecordsRequest(pool_id="p", placement_epoch=3)
        absent = replica_pb2.ShipRecordsRequest(
            pool_id="p",
            placement_epoch=3,
            seed=replica_pb2.ReplicaSeed(last=True, exists=False),
        )
        old.put(hello)
        old.put(absent)
        assert [next(old_answers).status for _ in range(2)] == [replica_pb2.SHIP_STATUS_OK] * 2
        new = [hello, absent, _record(1, create, "CreatePool")]
        new_answers = list(stub.ShipRecords(iter(new), timeout=20))
        assert [a.status for a in new_answers] == [replica_pb2.SHIP_STATUS_OK] * 3
        old.put(_record(2, StepBuilder.from_program(program(1)).to_proto("p").SerializeToString()))
        late = next(old_answers)
        assert late.status == replica_pb2.SHIP_STATUS_NEED_SEED
        assert "newer stream" in late.detail
        old.put(None)
        with SchedulerClient(standby.grpc_address, timeout=10.0) as client:
            assert client.describe_pool("p").last_event_sequence == 0  # the Step never ran


def test_a_newer_epoch_is_taken_without_asking_placement(standby: EmbeddedServer) -> None:
    """A primary placed at a newer epoch can ship before the standby's own placement says so
    (its etcd watch lags by a round trip): the standby takes the newer epoch at once, as that
    epoch's standby (epochs only rise through placement's transactions), and the older one is
    stale from then on."""
    with grpc.insecure_channel(standby.grpc_address) as channel:
        stub = _stub(channel)
        stub.SetPlacement(_place(standby=standby.grpc_address), timeout=10)  # epoch 3
        create = admin_pb2.CreatePoolRequest(
            pool_id="p", config=pool_config_to_proto(CONFIG)
        ).SerializeToString()
        messages = [
            replica_pb2.ShipRecordsRequest(pool_id="p", placement_epoch=4),  # hello
            replica_pb2.ShipRecordsRequest(
                pool_id="p", placement_epoch=4, seed=replica_pb2.ReplicaSeed(last=True)
            ),
            replica_pb2.ShipRecordsRequest(
                pool_id="p",
                placement_epoch=4,
                seq=1,
                record=replica_pb2.ReplicaRecord(method="CreatePool", request=create, time=1.0),
            ),
            replica_pb2.ShipRecordsRequest(pool_id="p", placement_epoch=3),  # the old primary
        ]
        answers = list(stub.ShipRecords(iter(messages), timeout=20))
        assert [(a.status, a.seq, a.placement_epoch) for a in answers] == [
            (replica_pb2.SHIP_STATUS_OK, 0, 4),
            (replica_pb2.SHIP_STATUS_OK, 0, 4),
            (replica_pb2.SHIP_STATUS_OK, 1, 4),
            (replica_pb2.SHIP_STATUS_STALE_EPOCH, 1, 4),
        ]
        state = stub.GetReplicaState(replica_pb2.GetReplicaStateRequest(pool_id="p"), timeout=10)
        assert (state.role, state.placement_epoch, state.seq) == ("standby", 4, 1)
    with SchedulerClient(standby.grpc_address, timeout=10.0) as client:
        assert client.describe_pool("p").num_requests == 0  # the copy the records made
