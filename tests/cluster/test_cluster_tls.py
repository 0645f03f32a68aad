"""A cluster with TLS everywhere (docs/security.md, "A cluster of replicas").

A real etcd serving only TLS and demanding client certificates (``--client-cert-auth``), and
three ``kvcm serve --data-dir`` replicas with mutual TLS, bearer tokens and TLS to etcd, all
with certificates made here (``tests/_pki.py``). Checked: etcd refuses a plaintext client and
a TLS client without a certificate, and the replicas register and place pools through it;
an SDK scheduler (a tenant: its own client certificate, a scheduler token) drives Steps that
the pool's primary replicates to its standby over TLS; that tenant, calling the standby's
ReplicaService directly (a forged seed, a promotion, a read), is refused PERMISSION_DENIED
naming the replica role (UNAUTHENTICATED without a token) and the standby's copy and the
placement are unchanged; then ``kill -9`` of the primary: the standby takes the pool over and
the same client goes on, every acknowledged Step there; then an operator moves the pool with
``kvcm cluster move`` over TLS to etcd and to the replicas.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from _cluster import free_port
from _pki import Pki

from kvcm.client import ItemStatus, SchedulerClient, ServiceError, StepBuilder, TlsConfig
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.cluster import EtcdUnavailableError, Placement
from kvcm.server.cluster._etcd import EtcdSession
from kvcm.server.settings import ServerSettings
from kvcm.server.tls import ChannelCredentials, etcd_credentials
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
PREFIX = "/kvcm-test-tls"
POOL = "tls-a"
TOKENS = {  # token -> (name, role)
    "ops-secret": ("ops", "admin:*"),
    "engine-secret": ("engine", "scheduler:*"),
    "router-secret": ("router", "reader:*"),
    "replica-secret": ("kvcm-replicas", "replica:*"),
}


@dataclass
class Files:
    """The PEM files of the test's PKI (one CA signs etcd, replicas and clients)."""

    pki: Pki
    ca: Path
    etcd_cert: Path
    etcd_key: Path
    client: TlsConfig  # a tenant's TLS (its own certificate)
    tokens: Path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    directory = tmp_path_factory.mktemp("pki")
    pki = Pki(directory, "kvcm-cluster")
    etcd_cert, etcd_key = pki.issue("etcd")
    client_cert, client_key = pki.issue("tenant")
    lines = []
    for token, (name, role) in TOKENS.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        lines.append(f'[[tokens]]\nname = "{name}"\nsha256 = "{digest}"\nroles = ["{role}"]\n')
    tokens = directory / "tokens.toml"
    tokens.write_text("\n".join(lines), encoding="utf-8")
    return Files(
        pki=pki,
        ca=pki.write("ca.pem", pki.ca_pem),
        etcd_cert=pki.write("etcd.pem", etcd_cert),
        etcd_key=pki.write("etcd.key", etcd_key),
        client=TlsConfig(
            root_certificates=pki.ca_pem, certificate_chain=client_cert, private_key=client_key
        ),
        tokens=tokens,
    )


@pytest.fixture(scope="module")
def etcd_url(files: Files, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real etcd on 127.0.0.1 serving TLS only, with client certificates required."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (bash scripts/install-etcd.sh installs Debian's)")
    port, peer_port = free_port(), free_port()
    url, peer = f"https://127.0.0.1:{port}", f"http://127.0.0.1:{peer_port}"
    process = subprocess.Popen(
        [binary, "--name", "kvcm-tls", "--data-dir", str(tmp_path_factory.mktemp("etcd")),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"kvcm-tls={peer}", "--log-level", "error",
         "--cert-file", str(files.etcd_cert), "--key-file", str(files.etcd_key),
         "--trusted-ca-file", str(files.ca), "--client-cert-auth"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert process.poll() is None, "etcd exited at start"
            assert time.monotonic() < deadline, "etcd did not come up"
            time.sleep(0.05)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Replica:
    """``kvcm serve`` with TLS everywhere, its log in a file."""

    def __init__(self, files: Files, etcd_url: str, directory: Path, index: int) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.directory = directory
        cert, key = files.pki.issue(f"replica-{index}")
        self.cert = files.pki.write(f"replica-{index}.pem", cert)
        self.key = files.pki.write(f"replica-{index}.key", key)
        self.log = directory / f"replica-{index}.log"
        self.data_dir = directory / f"data-{index}"
        self.args = [
            sys.executable, "-m", "kvcm.server.cli", "serve", "--grpc-address", self.address,
            "--http-address", "", "--data-dir", str(self.data_dir),
            "--tls-cert", str(self.cert), "--tls-key", str(self.key),
            "--tls-client-ca", str(files.ca), "--auth-tokens", str(files.tokens),
            "--etcd-endpoints", etcd_url, "--etcd-ca", str(files.ca),
            "--etcd-cert", str(self.cert), "--etcd-key", str(self.key),
            "--etcd-prefix", PREFIX, "--etcd-lease-ttl-s", str(LEASE_TTL_S),
            "--etcd-timeout-s", "1", "--cluster-fanout-timeout-s", "1", "--log-level", "WARNING",
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        env = {**os.environ, "KVCM_REPLICA_TOKEN": "replica-secret"}
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.args, stdout=subprocess.DEVNULL, stderr=log, env=env
            )

    def wait_serving(self, files: Files) -> None:
        assert self.process is not None
        deadline = time.monotonic() + 60
        with SchedulerClient(
            self.address, tls=files.client, token="router-secret", timeout=2.0
        ) as client:
            while True:
                try:
                    client.list_pools()
                    return
                except Exception:
                    if self.process.poll() is not None:
                        raise AssertionError(f"kvcm serve exited: {self.log.read_text()}") from None
                    assert time.monotonic() < deadline, "kvcm serve did not come up"
                    time.sleep(0.05)

    def stop(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(15)


def _settings(etcd_url: str, files: Files, **tls: str) -> ServerSettings:
    return ServerSettings(etcd_endpoints=etcd_url, **tls)


def _etcd_get_prefix(etcd_url: str, files: Files, prefix: str) -> list[tuple[bytes, bytes]]:
    """The keys under ``prefix``, read over TLS with a client certificate (as a replica)."""
    cert, key = files.pki.issue("reader")
    settings = _settings(
        etcd_url,
        files,
        etcd_ca=str(files.ca),
        etcd_cert=str(files.pki.write("reader.pem", cert)),
        etcd_key=str(files.pki.write("reader.key", key)),
    )
    host, _, port = etcd_url.removeprefix("https://").rpartition(":")

    async def read() -> list[tuple[bytes, bytes]]:
        session = EtcdSession(
            [(host, int(port))], timeout_s=5.0, credentials=etcd_credentials(settings)
        )
        try:
            listing = await session.call(lambda c: c.get_prefix(prefix.encode()))
            return [(kv.key, kv.value) for kv in listing]
        finally:
            await session.close()

    return asyncio.run(read())


def _placement(etcd_url: str, files: Files) -> Placement:
    (found,) = _etcd_get_prefix(etcd_url, files, f"{PREFIX}/placement/{POOL}")
    return Placement.decode(found[1])


@pytest.fixture
def cluster(files: Files, etcd_url: str, tmp_path: Path) -> Iterator[list[Replica]]:
    started = [Replica(files, etcd_url, tmp_path, i) for i in range(3)]
    try:
        for replica in started:  # side by side: each spends its start-up importing
            replica.spawn()
        for replica in started:
            replica.wait_serving(files)
        deadline = time.monotonic() + 15
        while len(_etcd_get_prefix(etcd_url, files, f"{PREFIX}/replicas/")) < 3:
            assert time.monotonic() < deadline, "the replicas did not register in etcd"
            time.sleep(0.1)
        yield started
    finally:
        for replica in started:
            replica.stop(signal.SIGKILL)


def test_etcd_refuses_plaintext_and_clients_without_a_certificate(
    etcd_url: str, files: Files
) -> None:
    host, _, port = etcd_url.removeprefix("https://").rpartition(":")
    anonymous = etcd_credentials(_settings(etcd_url, files, etcd_ca=str(files.ca)))

    async def attempt(credentials: ChannelCredentials | None) -> None:
        session = EtcdSession([(host, int(port))], timeout_s=2.0, credentials=credentials)
        try:
            await session.call(lambda c: c.get(b"/anything"))
        finally:
            await session.close()

    for credentials in (None, anonymous):  # plaintext; TLS without a client certificate
        with pytest.raises(EtcdUnavailableError, match="etcd unreachable at"):
            asyncio.run(attempt(credentials))


def _replica_state(replica: Replica, files: Files) -> replica_pb2.GetReplicaStateResponse:
    tls = files.client
    credentials = grpc.ssl_channel_credentials(
        tls.root_certificates, tls.private_key, tls.certificate_chain
    )
    with grpc.secure_channel(replica.address, credentials) as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
        answer: replica_pb2.GetReplicaStateResponse = stub.GetReplicaState(
            replica_pb2.GetReplicaStateRequest(pool_id=POOL),
            metadata=(("authorization", "Bearer replica-secret"),),
            timeout=5,
        )
        return answer


def _step(client: SchedulerClient, seq: int) -> list[list[int]]:
    """Add request ``seq`` and allocate its prompt, exactly once (``step_seq``)."""
    prompt = [seq * 1000 + i for i in range(48)]
    step = StepBuilder()
    step.step_seq = seq
    step.add_request(seq, prompt, client.block_hasher(POOL).hash_token_ids(prompt))
    step.allocate(seq, len(prompt), 0, lookup=True)
    result = client.step(POOL, step, timeout=10.0)
    assert result.statuses == [ItemStatus.OK]
    return [list(ids) for ids in client.get_block_ids(POOL, seq)]


def _fan_out_reaches_every_replica(replica: Replica, files: Files) -> None:
    """A ListPools through one replica asks its peers over TLS and misses none."""
    tls = files.client
    credentials = grpc.ssl_channel_credentials(
        tls.root_certificates, tls.private_key, tls.certificate_chain
    )
    with grpc.secure_channel(replica.address, credentials) as channel:
        stub = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
        answer, call = stub.ListPools.with_call(
            admin_pb2.ListPoolsRequest(),
            metadata=(("authorization", "Bearer router-secret"),),
            timeout=5,
        )
    trailer = dict(call.trailing_metadata())
    assert trailer["kvcm-replicas"] == "3"
    assert "kvcm-missing-replicas" not in trailer
    assert [pool.pool_id for pool in answer.pools] == [POOL]


def _drain(method: Any, requests: Iterator[Any], **kwargs: Any) -> list[Any]:
    """Every answer of a bidi stream call."""
    return list(method(requests, **kwargs))


def _attack(standby: Replica, primary: Replica, files: Files) -> None:
    """A tenant (valid client certificate) calls the standby's ReplicaService directly."""
    tls = files.client
    credentials = grpc.ssl_channel_credentials(
        tls.root_certificates, tls.private_key, tls.certificate_chain
    )
    forged_seed = replica_pb2.ShipRecordsRequest(  # would drop the standby's copy
        pool_id=POOL, placement_epoch=99, seq=1, seed=replica_pb2.ReplicaSeed(last=True)
    )
    promote = replica_pb2.SetPlacementRequest(  # would promote the standby, fencing the primary
        pool_id=POOL, primary=standby.address, standby=primary.address, placement_epoch=99
    )
    with grpc.secure_channel(standby.address, credentials) as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
        for token, code in (
            ("engine-secret", grpc.StatusCode.PERMISSION_DENIED),
            ("router-secret", grpc.StatusCode.PERMISSION_DENIED),
            (None, grpc.StatusCode.UNAUTHENTICATED),
        ):
            metadata = (("authorization", f"Bearer {token}"),) if token else ()
            calls = {
                "ShipRecords": partial(_drain, stub.ShipRecords, iter([forged_seed])),
                "SetPlacement": partial(stub.SetPlacement, promote),
                "GetReplicaState": partial(
                    stub.GetReplicaState, replica_pb2.GetReplicaStateRequest(pool_id=POOL)
                ),
            }
            for method, call in calls.items():
                with pytest.raises(grpc.RpcError) as refused:
                    call(metadata=metadata, timeout=5)
                assert refused.value.code() is code, (method, token, refused.value)
                details = refused.value.details() or ""
                if code is grpc.StatusCode.PERMISSION_DENIED:
                    assert "has no role replica (or admin) on every pool" in details
                else:
                    assert "'authorization: Bearer <token>' is required" in details


def test_tls_everywhere_serves_steps_refuses_a_tenant_on_replica_calls_and_fails_over(
    files: Files, etcd_url: str, cluster: list[Replica]
) -> None:
    seeds = ",".join(replica.address for replica in cluster)
    with SchedulerClient(seeds, tls=files.client, token="ops-secret", timeout=10.0) as admin:
        admin.create_pool(POOL, CONFIG)
    before = _placement(etcd_url, files)
    by_address = {replica.address: replica for replica in cluster}
    primary, standby = by_address[before.primary], by_address[str(before.standby)]
    with SchedulerClient(seeds, tls=files.client, token="engine-secret", timeout=10.0) as client:
        acknowledged = {seq: _step(client, seq) for seq in range(1, 7)}
        # Shipped to the standby over TLS (sync: each Step's answer waited for it).
        on_primary = _replica_state(primary, files)
        on_standby = _replica_state(standby, files)
        assert (on_standby.role, on_standby.placement_epoch) == ("standby", 1)
        assert on_standby.seq == on_primary.seq == on_primary.acked_seq >= 7  # CreatePool + 6
        assert on_standby.digest == on_primary.digest

        _fan_out_reaches_every_replica(standby, files)
        _attack(standby, primary, files)
        after_attack = _replica_state(standby, files)
        for field in ("role", "placement_epoch", "seq", "digest", "digest_mismatches"):
            assert getattr(after_attack, field) == getattr(on_standby, field), field
        assert _placement(etcd_url, files) == before
        acknowledged[7] = _step(client, 7)  # the pool is still served and replicated

        primary.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        seq = 8
        while True:  # the same client, not restarted
            try:
                acknowledged[seq] = _step(client, seq)
                break
            except ServiceError:
                assert time.monotonic() - killed_at < LEASE_TTL_S + 15, "no failover"
                time.sleep(0.1)
        print(f"failover with TLS: {time.monotonic() - killed_at:.2f} s (TTL {LEASE_TTL_S} s)")
        after = _placement(etcd_url, files)
        assert (after.primary, after.epoch) == (standby.address, 2)
        for key, ids in acknowledged.items():  # every acknowledged Step is there
            assert [list(x) for x in client.get_block_ids(POOL, key)] == ids
        # The new primary ships to its new standby (the third replica) over TLS too.
        third = next(r for r in cluster if r not in (primary, standby))
        deadline = time.monotonic() + 15
        while True:
            state = _replica_state(third, files)
            if state.role == "standby" and state.seq == _replica_state(standby, files).seq:
                break
            assert time.monotonic() < deadline, f"no copy on the new standby: {state}"
            time.sleep(0.1)
        # An operator moves the pool over TLS to etcd and to the replicas (kvcm cluster move).
        moved = _kvcm_cluster(files, etcd_url, "move", POOL, "--to", third.address)
        assert moved.returncode == 0, moved.stderr
        assert f"{POOL}: primary {third.address}, standby {standby.address}, epoch 3" in (
            moved.stdout
        )
        acknowledged[seq + 1] = _step(client, seq + 1)
        for key, ids in acknowledged.items():
            assert [list(x) for x in client.get_block_ids(POOL, key)] == ids


def _kvcm_cluster(files: Files, etcd_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvcm cluster ARGS`` as an operator: admin token, its own certificate."""
    cert, key = files.pki.issue("operator")
    cert_file, key_file = files.pki.write("op.pem", cert), files.pki.write("op.key", key)
    flags = [
        "--etcd-endpoints", etcd_url, "--etcd-prefix", PREFIX, "--timeout", "20",
        "--etcd-ca", str(files.ca), "--etcd-cert", str(cert_file), "--etcd-key", str(key_file),
        "--tls-ca", str(files.ca), "--tls-client-cert", str(cert_file),
        "--tls-client-key", str(key_file),
    ]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "kvcm.server.cli", "cluster", *flags, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "KVCM_TOKEN": "ops-secret"},
    )
