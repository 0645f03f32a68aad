"""ReplicaService needs the replica role (docs/security.md): with ``auth_tokens`` on, a call
without a token is UNAUTHENTICATED and one with a scheduler's token PERMISSION_DENIED (a
ShipRecords stream that would overwrite a pool with a seed included: the pool is unchanged),
while two replicas that present a ``replica:*`` token (``KVCM_REPLICA_TOKEN``) replicate; that
token may do nothing else (no pool created, no Step)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from _data_dir_server import CONFIG, program

from kvcm.client import PermissionDeniedError, SchedulerClient
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings
from kvcm.v1 import replica_pb2, replica_pb2_grpc

ADMIN, SCHEDULER, REPLICA = "admin-secret", "scheduler-secret", "replica-secret"


def _tokens(path: Path) -> Path:
    entries = []
    for token, name, role in (
        (ADMIN, "admin", "admin:*"),
        (SCHEDULER, "sched", "scheduler:*"),
        (REPLICA, "replica", "replica:*"),
    ):
        digest = hashlib.sha256(token.encode()).hexdigest()
        entries.append(f'[[tokens]]\nname = "{name}"\nsha256 = "{digest}"\nroles = ["{role}"]\n')
    path.write_text("\n".join(entries), encoding="utf-8")
    return path


@pytest.fixture
def pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[EmbeddedServer, ...]]:
    monkeypatch.setenv("KVCM_REPLICA_TOKEN", REPLICA)  # what each replica presents to the other
    monkeypatch.setenv("KVCM_REPLICA_DIGEST_EVERY", "2")
    tokens = _tokens(tmp_path / "tokens.toml")
    servers = [
        start_embedded_server(
            ServerSettings(
                grpc_address="127.0.0.1:0",
                http_address="",
                auth_tokens=str(tokens),
                data_dir=str(tmp_path / name),
                log_level="ERROR",
            )
        )
        for name in ("a", "b")
    ]
    try:
        yield tuple(servers)
    finally:
        for server in servers:
            server.stop()


def _placement(primary: str, standby: str) -> replica_pb2.SetPlacementRequest:
    return replica_pb2.SetPlacementRequest(
        pool_id="p", primary=primary, standby=standby, placement_epoch=1
    )


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_replica_service_needs_the_replica_role_and_replicas_present_their_token(
    pair: tuple[EmbeddedServer, ...],
) -> None:
    a, b = pair
    with grpc.insecure_channel(b.grpc_address) as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
        request = _placement(a.grpc_address, b.grpc_address)
        for metadata, code in (
            ((), grpc.StatusCode.UNAUTHENTICATED),
            (_bearer(SCHEDULER), grpc.StatusCode.PERMISSION_DENIED),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                stub.SetPlacement(request, metadata=metadata, timeout=10)
            assert refused.value.code() is code
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetReplicaState(
                    replica_pb2.GetReplicaStateRequest(pool_id="p"), metadata=metadata, timeout=10
                )
            assert refused.value.code() is code
        # A scheduler's token cannot push a seed over B's pool.
        with SchedulerClient(b.grpc_address, token=ADMIN) as client:
            client.create_pool("p", CONFIG)
            before = client.describe_pool("p")
        forged = replica_pb2.ShipRecordsRequest(
            pool_id="p",
            placement_epoch=9,
            seq=1,
            seed=replica_pb2.ReplicaSeed(last=True, exists=False),
        )
        answers = stub.ShipRecords(iter([forged]), metadata=_bearer(SCHEDULER), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            list(answers)
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        with SchedulerClient(b.grpc_address, token=ADMIN) as client:
            assert client.describe_pool("p") == before  # unchanged
            client.delete_pool("p")
        # The replica token is good for ReplicaService only.
        with (
            SchedulerClient(b.grpc_address, token=REPLICA) as client,
            pytest.raises(PermissionDeniedError, match="replica"),
        ):
            client.create_pool("q", CONFIG)
        # With the replica token both ways, A ships to B.
        assert stub.SetPlacement(request, metadata=_bearer(REPLICA), timeout=10).role == "standby"
    with grpc.insecure_channel(a.grpc_address) as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
        assert stub.SetPlacement(request, metadata=_bearer(ADMIN), timeout=10).role == "primary"
        with SchedulerClient(a.grpc_address, token=SCHEDULER) as client:
            with SchedulerClient(a.grpc_address, token=ADMIN) as admin:
                admin.create_pool("p", CONFIG)
            for seq in range(1, 6):
                client.step("p", program(seq))
        state = replica_pb2.GetReplicaStateRequest(pool_id="p")
        on_a = stub.GetReplicaState(state, metadata=_bearer(ADMIN), timeout=10)
    with grpc.insecure_channel(b.grpc_address) as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + 10
        while True:
            on_b = stub.GetReplicaState(state, metadata=_bearer(ADMIN), timeout=10)
            if on_b.seq == on_a.seq or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert on_a.acked_seq == on_a.seq == on_b.seq == 6  # CreatePool and 5 Steps
    assert on_b.digest == on_a.digest
    deadline = time.monotonic() + 20  # a periodic digest comes once A's outbox is empty
    while on_b.digest_checks < 1 and time.monotonic() < deadline:
        with grpc.insecure_channel(b.grpc_address) as channel:
            stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
            on_b = stub.GetReplicaState(state, metadata=_bearer(ADMIN), timeout=10)
        time.sleep(0.02)
    assert on_b.digest_checks >= 1
    assert on_b.digest_mismatches == 0
