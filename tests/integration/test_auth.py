"""Bearer tokens and roles on a real server, over gRPC and HTTP, from one table.

A real server on loopback with a real tokens file. Every gRPC method and HTTP route is called
with every kind of token, on a pool the token's globs cover and on one they do not, and the
answer (allowed, UNAUTHENTICATED / 401, PERMISSION_DENIED / 403) must be what :data:`EXPECTED`
(written here by hand: the contract) says. The cases come from the server's own table
(``kvcm.server.access.RULES``) and from the methods and routes the server registers, so a new
method or route without a row fails here. Then: listings scoped to the readable pools, the
audit lines of refusals (who, what, why; never the token; rate-limited), ResyncPool creating a
pool only with the admin role, SIGHUP's reload, a bad tokens file.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import message_factory

from kvcm.client import PermissionDeniedError, SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.lookup import LookupQuery
from kvcm.core.pool import Pool, PoolConfig, PoolRegistry
from kvcm.core.snapshot import encode_pool
from kvcm.server.access import RULES
from kvcm.server.auth import TokenTable
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.http import build_app
from kvcm.server.rpc import ServerState, TransferView, lookup_as, route_pd
from kvcm.server.settings import ServerSettings
from kvcm.server.telemetry import RpcStats
from kvcm.v1 import replica_pb2, scheduler_pb2, service_pb2, service_pb2_grpc
from kvcm.wire import pool_config_to_proto

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=256,
    hash_seed="the-seed",
    explicit_layout=KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)
# token -> (principal name, roles). "Kinds" below name the tokens by what they hold.
TOKENS = {
    "admin-token": ("ops", ["admin:*"]),
    "admin-a-token": ("ops-a", ["admin:a-*"]),
    "sched-a-token": ("engine-a", ["scheduler:a-*"]),
    "worker-a-token": ("gpu-a", ["worker:a-*"]),
    "reader-a-token": ("router-a", ["reader:a-*"]),
    "scrape-token": ("prometheus", ["scrape:*"]),
    "replica-token": ("kvcm-replica", ["replica:*"]),
}
KINDS = {
    "admin": "admin-token",
    "admin-a": "admin-a-token",
    "scheduler-a": "sched-a-token",
    "worker-a": "worker-a-token",
    "reader-a": "reader-a-token",
    "scrape": "scrape-token",
    "replica": "replica-token",
    "none": None,
    "unknown": "not-a-token",
}
VALID = frozenset(kind for kind, token in KINDS.items() if token in TOKENS)
OWN_POOL, OTHER_POOL = "a-engine", "b-engine"

# The contract, by hand: which kinds of token may make each call on OWN_POOL (a-*), and whether
# the call names a pool (then only admin:* may make it on OTHER_POOL, b-*).
A_DRIVERS = {"admin", "admin-a", "scheduler-a"}
A_READERS = A_DRIVERS | {"worker-a", "reader-a"}
OPEN = frozenset({"none", "unknown"}) | VALID
EXPECTED: dict[str, tuple[frozenset[str], bool]] = {
    "/kvcm.v1.AdminService/CreatePool": (frozenset({"admin", "admin-a"}), True),
    "/kvcm.v1.AdminService/DeletePool": (frozenset({"admin", "admin-a"}), True),
    "/kvcm.v1.AdminService/DescribePool": (frozenset(A_READERS), True),
    "/kvcm.v1.AdminService/ListPools": (VALID, False),
    "/kvcm.v1.WorkerService/RegisterWorker": (frozenset({"admin", "admin-a", "worker-a"}), True),
    **{
        f"/kvcm.v1.SchedulerService/{method.name}": (frozenset(A_DRIVERS), True)
        for method in service_pb2.DESCRIPTOR.services_by_name["SchedulerService"].methods
    },
    "/kvcm.v1.EventService/SubscribeEvents": (frozenset(A_READERS), True),
    "/kvcm.v1.LookupService/Lookup": (VALID, False),
    "/kvcm.v1.LookupService/RoutePd": (VALID, False),
    **{
        f"/kvcm.v1.TransferService/{method}": (frozenset(A_DRIVERS), True)
        for method in (
            "HoldSource",
            "PlanTransfer",
            "CommitTransfer",
            "ReleaseTransfer",
            "ExpireTransfer",
        )
    },
    "/kvcm.v1.TransferService/DescribeTransfer": (frozenset(A_READERS), True),
    # Any valid token may list; naming a pool it may not read is refused.
    "/kvcm.v1.TransferService/ListTransfers": (frozenset(A_READERS), True),
    # Replica to replica: a replica's token or admin:*, never a tenant's (nor admin:a-*).
    **{
        f"/kvcm.v1.ReplicaService/{method.name}": (frozenset({"admin", "replica"}), False)
        for method in replica_pb2.DESCRIPTOR.services_by_name["ReplicaService"].methods
    },
    "GET /metrics": (frozenset({"admin", "scrape"}), False),
    "GET /healthz": (OPEN, False),
    "GET /readyz": (OPEN, False),
    "GET /v1/pools": (VALID, False),
    "GET /v1/pools/{pool}": (frozenset(A_READERS), True),
    "GET /v1/pools/{pool}/events": (frozenset(A_READERS), True),
    "GET /": (OPEN, False),
    "GET /docs": (OPEN, False),
    "POST /v1/lookup": (VALID, False),
    "POST /v1/pd/route": (VALID, False),
    # Any valid token may list (the pools it may read; ?pool= naming another one is a 403).
    "GET /v1/transfers": (VALID, False),
    "GET /v1/transfers/{pool}/{transfer_id}": (frozenset(A_READERS), True),
    "GET /openapi.json": (VALID, False),
    "HEAD /openapi.json": (VALID, False),
}


def _grpc_methods() -> dict[str, Any]:
    """Every kvcm.v1 method the server registers, by full name."""
    return {
        f"/{service.full_name}/{method.name}": method
        for file in (service_pb2, replica_pb2)
        for service in file.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }


def _http_routes() -> list[str]:
    """``VERB /path`` of every route the server's HTTP app declares."""
    registry = PoolRegistry()
    app = build_app(
        registry,
        RpcStats(),
        lambda: True,
        lookup=functools.partial(lookup_as, registry),
        pd_route=functools.partial(route_pd, registry),
        transfers=TransferView(ServerState(registry, RpcStats())),
    )
    return [
        f"{verb} {route.path}"  # type: ignore[attr-defined]
        for route in app.routes
        for verb in sorted(getattr(route, "methods", None) or ())
    ]


GRPC_METHODS = _grpc_methods()
HTTP_ROUTES = _http_routes()
CASES = sorted(set(RULES) | set(GRPC_METHODS) | set(HTTP_ROUTES) | set(EXPECTED))


def _write_tokens(path: Path, tokens: dict[str, tuple[str, list[str]]]) -> None:
    entries = []
    for token, (name, roles) in tokens.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        quoted = ", ".join(f'"{role}"' for role in roles)
        entries.append(f'[[tokens]]\nname = "{name}"\nsha256 = "{digest}"\nroles = [{quoted}]\n')
    path.write_text("\n".join(entries), encoding="utf-8")


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens.toml"
    _write_tokens(path, TOKENS)
    return path


@pytest.fixture(scope="module")
def server(tokens_file: Path) -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            auth_tokens=str(tokens_file),
            log_level="ERROR",
            data_dir=str(tokens_file.parent / "data"),  # ReplicaService is registered
        )
    )
    try:
        with _client(running, "admin-token") as admin:
            admin.create_pool(OWN_POOL, CONFIG)
            admin.create_pool(OTHER_POOL, CONFIG)
        yield running
    finally:
        running.stop()


def _client(server: EmbeddedServer, token: str | None) -> SchedulerClient:
    return SchedulerClient(server.grpc_address, token=token, timeout=5.0)


def _call_grpc(channel: grpc.Channel, full_name: str, token: str | None, pool_id: str) -> str:
    """Make the call with an otherwise empty request naming ``pool_id``; its status code."""
    method = GRPC_METHODS[full_name]
    request_class = message_factory.GetMessageClass(method.input_type)
    fields = method.input_type.fields_by_name
    request = request_class(pool_id=pool_id) if "pool_id" in fields else request_class()
    if full_name.endswith("/CreatePool"):
        request.pool_id = f"{pool_id}-never"  # no config: INVALID_ARGUMENT once allowed
    if full_name.endswith("/DeletePool"):
        request.pool_id = f"{pool_id}-missing"  # NOT_FOUND once allowed: nothing deleted
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    codec = {
        "request_serializer": request_class.SerializeToString,
        "response_deserializer": lambda data: data,
    }
    try:
        if method.client_streaming and method.server_streaming:  # ShipRecords: a hello
            bidi = channel.stream_stream(full_name, **codec)
            for _ in bidi(iter([request]), metadata=metadata, timeout=5.0):
                break
        elif method.client_streaming:
            stream_call = channel.stream_unary(full_name, **codec)
            stream_call(iter([request]), metadata=metadata, timeout=5.0)
        elif method.server_streaming:
            for _ in channel.unary_stream(full_name, **codec)(
                request, metadata=metadata, timeout=0.5
            ):
                break
        else:
            channel.unary_unary(full_name, **codec)(request, metadata=metadata, timeout=5.0)
    except grpc.RpcError as exc:
        return str(exc.code().name)
    return "OK"


def _call_http(http: httpx.Client, key: str, token: str | None, pool_id: str) -> int:
    verb, path = key.split(" ", 1)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    content = b"{}" if verb == "POST" else None
    answer = http.request(verb, path.replace("{pool}", pool_id), headers=headers, content=content)
    return answer.status_code


def test_the_table_has_a_row_for_every_method_and_route() -> None:
    """A method or route added without a row (or a row without one) fails here."""
    assert set(RULES) == set(GRPC_METHODS) | set(HTTP_ROUTES)
    assert set(EXPECTED) == set(RULES)


@pytest.mark.parametrize("key", CASES)
def test_each_kind_of_token_is_allowed_or_refused_as_the_contract_says(
    server: EmbeddedServer, key: str
) -> None:
    assert key in RULES, f"{key} has no row in kvcm.server.access.RULES"
    assert key in EXPECTED, f"{key} has no expectation in this test"
    allowed_kinds, names_pool = EXPECTED[key]
    outcomes: dict[tuple[str, str], str] = {}
    with (
        grpc.insecure_channel(server.grpc_address) as channel,
        httpx.Client(base_url=f"http://{server.http_address}", timeout=5.0) as http,
    ):
        for kind, token in KINDS.items():
            for pool_id in (OWN_POOL, OTHER_POOL):
                if key.startswith("/"):
                    code = _call_grpc(channel, key, token, pool_id)
                    refused = {"UNAUTHENTICATED", "PERMISSION_DENIED"}
                    got = code if code in refused else "allowed"
                    unauthenticated, denied = "UNAUTHENTICATED", "PERMISSION_DENIED"
                else:
                    status = _call_http(http, key, token, pool_id)
                    assert status < 500, (key, kind, pool_id, status)
                    got = str(status) if status in (401, 403) else "allowed"
                    unauthenticated, denied = "401", "403"
                may = kind in allowed_kinds
                if names_pool and pool_id == OTHER_POOL:
                    may = may and kind == "admin"
                if may:
                    want = "allowed"
                elif kind in VALID:
                    want = denied
                else:
                    want = unauthenticated
                outcomes[(kind, pool_id)] = f"{got} (want {want})"
                assert got == want, (key, kind, pool_id)
    with _client(server, "admin-token") as admin:  # refusals and allowed probes changed nothing
        assert sorted(p.pool_id for p in admin.list_pools()) == [OWN_POOL, OTHER_POOL]


def test_listings_show_only_the_pools_a_token_may_read(server: EmbeddedServer) -> None:
    base = f"http://{server.http_address}"
    for kind, visible in (
        ("admin", [OWN_POOL, OTHER_POOL]),
        ("scheduler-a", [OWN_POOL]),
        ("worker-a", [OWN_POOL]),
        ("reader-a", [OWN_POOL]),
        ("scrape", []),
        ("replica", []),
    ):
        token = KINDS[kind]
        with _client(server, token) as client:
            assert [p.pool_id for p in client.list_pools()] == visible, kind
            answer = client.lookup(LookupQuery(token_ids=tuple(range(32))))
            assert sorted(hit.pool_id for hit in answer.pools) == visible, kind
        pools = httpx.get(f"{base}/v1/pools", headers={"authorization": f"Bearer {token}"})
        assert [p["name"] for p in pools.json()["pools"]] == visible, kind
    denied = httpx.post(
        f"{base}/v1/lookup",
        headers={"authorization": "Bearer reader-a-token"},
        json={"tokens": {"tokenIds": [1, 2, 3]}, "scope": {"poolIds": [OTHER_POOL]}},
    )
    assert denied.status_code == 403
    assert OTHER_POOL in denied.json()["error"]["message"]


def test_metrics_need_the_scrape_role_and_probes_stay_open(server: EmbeddedServer) -> None:
    base = f"http://{server.http_address}"
    scraped = httpx.get(f"{base}/metrics", headers={"authorization": "Bearer scrape-token"})
    assert scraped.status_code == 200
    assert f'pool="{OTHER_POOL}"' in scraped.text
    anonymous = httpx.get(f"{base}/metrics")
    assert anonymous.status_code == 401
    assert anonymous.headers["www-authenticate"] == "Bearer"
    assert anonymous.json()["error"]["code"] == "UNAUTHENTICATED"
    assert "kvcm_" not in anonymous.text
    pool_admin = httpx.get(f"{base}/metrics", headers={"authorization": "Bearer admin-a-token"})
    assert pool_admin.status_code == 403  # admin of a-* pools only: metrics span every pool
    for probe in ("/healthz", "/readyz"):
        assert httpx.get(f"{base}{probe}").status_code == 200
    unrouted = httpx.get(f"{base}/no/such/route")
    assert unrouted.status_code == 401  # not even whether the path exists without a token
    assert httpx.get(f"{base}/no/such/route", headers=_bearer("reader-a-token")).status_code == (
        404
    )


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _audit(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvcm.audit" and vars(r).get("event") == event]


def test_refusals_are_audited_with_who_what_and_why(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvcm.audit")
    # The audit's bucket refills 10 lines a second; earlier tests (a flood among them) may have
    # emptied it, and this test needs 6 lines plus the "suppressed" line that may go first.
    time.sleep(1.0)
    with _client(server, "sched-a-token") as scheduler, pytest.raises(PermissionDeniedError):
        scheduler.keep_alive(OTHER_POOL)
    with _client(server, "secret-unknown-token") as stranger, pytest.raises(PermissionDeniedError):
        stranger.describe_pool(OWN_POOL)
    base = f"http://{server.http_address}"
    httpx.get(f"{base}/v1/pools/{OTHER_POOL}", headers=_bearer("reader-a-token"))
    httpx.get(f"{base}/metrics", headers=_bearer("secret-unknown-token"))
    with _client(server, "reader-a-token") as reader, pytest.raises(PermissionDeniedError):
        reader.lookup(LookupQuery(token_ids=(1, 2, 3), pool_ids=(OTHER_POOL,)))
    httpx.post(
        f"{base}/v1/lookup",
        headers=_bearer("reader-a-token"),
        json={"tokens": {"tokenIds": [1, 2, 3]}, "scope": {"poolIds": [OTHER_POOL]}},
    )
    lines = [
        tuple(vars(r)[key] for key in ("principal", "method", "pool", "code"))
        for r in _audit(caplog, "auth_refused")
    ]
    assert lines == [
        ("engine-a", "/kvcm.v1.SchedulerService/KeepAlive", OTHER_POOL, "PERMISSION_DENIED"),
        ("", "/kvcm.v1.AdminService/DescribePool", OWN_POOL, "UNAUTHENTICATED"),
        ("router-a", "GET /v1/pools/{pool}", OTHER_POOL, "403"),
        ("", "GET /metrics", "", "401"),
        ("router-a", "/kvcm.v1.LookupService/Lookup", "", "PERMISSION_DENIED"),
        ("router-a", "POST /v1/lookup", "", "403"),
    ]
    for record in _audit(caplog, "auth_refused"):
        assert record.levelno == logging.WARNING
        assert vars(record)["reason"]
        assert vars(record)["peer"].startswith(("ipv4:127.0.0.1", "127.0.0.1"))
        assert "secret-unknown-token" not in repr(vars(record)) + record.getMessage()
    reasons = [vars(r)["reason"] for r in _audit(caplog, "auth_refused")]
    assert "scheduler" in reasons[0]
    assert OTHER_POOL in reasons[0]
    assert reasons[1] == reasons[3] == "a token not in the tokens file"
    assert OTHER_POOL in reasons[4]
    assert OTHER_POOL in reasons[5]


def _snapshot() -> bytes:
    return encode_pool(Pool("local", CONFIG))


def test_resync_creates_a_pool_only_with_the_admin_role(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvcm.audit")
    time.sleep(0.5)
    with _client(server, "sched-a-token") as scheduler:
        with pytest.raises(PermissionDeniedError, match="does not exist") as caught:
            scheduler.resync_pool("a-fresh", _snapshot(), CONFIG, step_seq=1)
        assert "PERMISSION_DENIED" in str(caught.value)
        with _client(server, "admin-token") as admin:
            assert "a-fresh" not in [p.pool_id for p in admin.list_pools()]
        refused = vars(_audit(caplog, "auth_refused")[-1])
        assert (refused["principal"], refused["pool"]) == ("engine-a", "a-fresh")
        with _client(server, "admin-a-token") as pool_admin:
            assert pool_admin.resync_pool("a-fresh", _snapshot(), CONFIG, step_seq=1) > 0
        # The pool exists now: resyncing it is the scheduler's call.
        assert scheduler.resync_pool("a-fresh", _snapshot(), CONFIG, step_seq=2) > 0
        with pytest.raises(PermissionDeniedError):
            scheduler.resync_pool("b-fresh", _snapshot(), CONFIG, step_seq=1)
    with _client(server, "admin-token") as admin:
        assert admin.describe_pool("a-fresh").num_requests == 0
        admin.delete_pool("a-fresh")
        assert "b-fresh" not in [p.pool_id for p in admin.list_pools()]


def test_a_pool_deleted_during_a_resync_upload_is_not_recreated(server: EmbeddedServer) -> None:
    """The creation check runs again when the pool would be created, after the upload."""
    with _client(server, "admin-token") as admin:
        admin.create_pool("a-racing", CONFIG)
    snapshot = _snapshot()
    first_sent, go_on = threading.Event(), threading.Event()

    def chunks() -> Iterator[scheduler_pb2.ResyncPoolRequest]:
        yield scheduler_pb2.ResyncPoolRequest(
            pool_id="a-racing",
            config=pool_config_to_proto(CONFIG),
            step_seq=1,
            data=snapshot[:8],
        )
        first_sent.set()
        go_on.wait(10)
        yield scheduler_pb2.ResyncPoolRequest(data=snapshot[8:])

    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = service_pb2_grpc.SchedulerServiceStub(channel)
        call = stub.ResyncPool.future(
            chunks(), metadata=(("authorization", "Bearer sched-a-token"),), timeout=20
        )
        assert first_sent.wait(10)
        time.sleep(0.3)  # the server has read the first chunk: the pool existed then
        with _client(server, "admin-token") as admin:
            admin.delete_pool("a-racing")
        go_on.set()
        with pytest.raises(grpc.RpcError) as caught:
            call.result()
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "does not exist" in (caught.value.details() or "")
    with _client(server, "admin-token") as admin:
        assert "a-racing" not in [p.pool_id for p in admin.list_pools()]


def test_a_resync_that_would_create_is_refused_before_its_upload(
    server: EmbeddedServer,
) -> None:
    """The rest of the upload is never waited for: the first chunk names a missing pool."""
    go_on = threading.Event()

    def chunks() -> Iterator[scheduler_pb2.ResyncPoolRequest]:
        yield scheduler_pb2.ResyncPoolRequest(
            pool_id="a-never", config=pool_config_to_proto(CONFIG), step_seq=1, data=b"x"
        )
        go_on.wait(10)
        yield scheduler_pb2.ResyncPoolRequest(data=b"y")

    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = service_pb2_grpc.SchedulerServiceStub(channel)
        call = stub.ResyncPool.future(
            chunks(), metadata=(("authorization", "Bearer sched-a-token"),), timeout=20
        )
        try:
            with pytest.raises(grpc.RpcError) as caught:
                call.result(timeout=5)  # while the client still holds back its last chunk
        finally:
            go_on.set()
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "does not exist" in (caught.value.details() or "")


def test_refused_calls_leave_nothing_in_the_journal(tokens_file: Path, tmp_path: Path) -> None:
    """With a data directory: refusals are never written, so a restart does not replay them."""
    settings = ServerSettings(
        grpc_address="127.0.0.1:0",
        http_address="",
        auth_tokens=str(tokens_file),
        data_dir=str(tmp_path / "data"),
        log_level="ERROR",
    )
    running = start_embedded_server(settings)
    try:
        with _client(running, "admin-token") as admin:
            admin.create_pool("a-kept", CONFIG)
        with _client(running, "sched-a-token") as scheduler:
            with pytest.raises(PermissionDeniedError):
                scheduler.resync_pool("a-made", _snapshot(), CONFIG, step_seq=1)
            with pytest.raises(PermissionDeniedError):
                scheduler.delete_pool("a-kept")
            with pytest.raises(PermissionDeniedError):
                scheduler.create_pool("a-made", CONFIG)
    finally:
        running.stop()
    running = start_embedded_server(settings)
    try:
        with _client(running, "admin-token") as admin:
            assert [p.pool_id for p in admin.list_pools()] == ["a-kept"]
    finally:
        running.stop()


GARBAGE = b"\xff\xff\xff\xff"  # field 31, wire type 7: bytes no message decodes from


def _send_garbage(channel: grpc.Channel, full_name: str, metadata: Any) -> None:
    if full_name.endswith("SubscribeEvents"):  # server streaming
        list(channel.unary_stream(full_name)(GARBAGE, metadata=metadata, timeout=5))
    else:
        channel.unary_unary(full_name)(GARBAGE, metadata=metadata, timeout=5)


def test_bytes_that_do_not_decode_are_authenticated_first(
    tokens_file: Path, tmp_path: Path
) -> None:
    """Bad bytes from an anonymous caller are UNAUTHENTICATED (the token is read from the
    metadata, before anything of the request); from a valid token, INVALID_ARGUMENT naming the
    message. With the journal on, neither leaves a record, and the pool is unchanged."""
    settings = ServerSettings(
        grpc_address="127.0.0.1:0",
        http_address="",
        auth_tokens=str(tokens_file),
        data_dir=str(tmp_path / "data"),
        log_level="ERROR",
    )
    running = start_embedded_server(settings)
    try:
        with _client(running, "admin-token") as admin:
            admin.create_pool("a-bytes", CONFIG)
            before = admin.describe_pool("a-bytes")
        with grpc.insecure_channel(running.grpc_address) as channel:
            for full_name in (
                "/kvcm.v1.SchedulerService/Step",
                "/kvcm.v1.AdminService/DescribePool",
                "/kvcm.v1.EventService/SubscribeEvents",
            ):
                for token, code in (
                    (None, grpc.StatusCode.UNAUTHENTICATED),
                    ("not-a-token", grpc.StatusCode.UNAUTHENTICATED),
                    ("sched-a-token", grpc.StatusCode.INVALID_ARGUMENT),
                ):
                    metadata = (("authorization", f"Bearer {token}"),) if token else ()
                    with pytest.raises(grpc.RpcError) as caught:
                        _send_garbage(channel, full_name, metadata)
                    assert caught.value.code() == code, (full_name, token)
                    if code == grpc.StatusCode.INVALID_ARGUMENT:
                        assert "is not a valid kvcm.v1." in (caught.value.details() or "")
        with _client(running, "admin-token") as admin:
            assert admin.describe_pool("a-bytes") == before
    finally:
        running.stop()
    running = start_embedded_server(settings)  # replays the journal: nothing but the create
    try:
        with _client(running, "admin-token") as admin:
            assert [p.pool_id for p in admin.list_pools()] == ["a-bytes"]
            assert admin.describe_pool("a-bytes").usage == before.usage
    finally:
        running.stop()


def test_roles_decide_what_a_call_changes(server: EmbeddedServer) -> None:
    """Allowed calls act, refused ones change nothing; the seed is for those who hash."""
    with _client(server, "admin-token") as admin:
        admin.create_pool("a-steps", CONFIG)
        admin.create_pool("b-steps", CONFIG)
    with _client(server, "reader-a-token") as reader:
        assert reader.describe_pool("a-steps").hashing.seed == ""  # a reader does not hash
        with pytest.raises(PermissionDeniedError):
            reader.step("a-steps", StepBuilder())
    with _client(server, "sched-a-token") as scheduler:
        assert scheduler.describe_pool("a-steps").hashing.seed == "the-seed"
        step = StepBuilder()
        step.add_request(1, list(range(20)))
        step.allocate(1, 20, 0)
        with pytest.raises(PermissionDeniedError, match="b-steps"):
            scheduler.step("b-steps", step)
        scheduler.step("a-steps", step)
        with pytest.raises(PermissionDeniedError):
            scheduler.delete_pool("a-steps")
    with _client(server, "admin-token") as admin:
        assert admin.describe_pool("a-steps").num_requests == 1
        assert admin.describe_pool("b-steps").num_requests == 0
        admin.delete_pool("a-steps")
        admin.delete_pool("b-steps")


def test_a_reload_picks_up_new_tokens(server: EmbeddedServer, tokens_file: Path) -> None:
    with _client(server, "late-token") as late, pytest.raises(PermissionDeniedError):
        late.list_pools()
    _write_tokens(tokens_file, {**TOKENS, "late-token": ("late", ["reader:b-*"])})
    tokens = server.server.tokens
    assert tokens is not None
    try:
        tokens.reload()  # what SIGHUP does
        with _client(server, "late-token") as late:
            assert [p.pool_id for p in late.list_pools()] == [OTHER_POOL]
    finally:
        _write_tokens(tokens_file, TOKENS)
        tokens.reload()


def test_a_bad_tokens_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[tokens]]\nsha256 = "abc"\nroles = ["admin:*"]\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="64 hex digits"):
        TokenTable(str(path))
    path.write_text(f'[[tokens]]\nsha256 = "{"0" * 64}"\nroles = ["root:*"]\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="not one of"):
        TokenTable(str(path))
    path.write_text(
        f'[[tokens]]\nsha256 = "{"0" * 64}"\nroles = ["scrape:a-*"]\n', encoding="utf-8"
    )
    with pytest.raises(ConfigError, match="scrape:\\*"):
        TokenTable(str(path))
    path.write_bytes(b'[[tokens]]\nname = "\xff"\n')
    with pytest.raises(ConfigError, match="auth_tokens"):
        TokenTable(str(path))


def test_a_flood_of_refusals_is_rate_limited_and_counted(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Last in the module: the flood empties the audit's bucket, which gRPC and HTTP share."""
    caplog.set_level(logging.INFO, logger="kvcm.audit")
    tokens = server.server.tokens
    assert tokens is not None
    refusals = tokens.refusals
    deadline = time.monotonic() + 3.0
    while refusals.suppressed and time.monotonic() < deadline:
        time.sleep(0.1)  # earlier tests' count goes out first
    caplog.clear()
    flood = 300
    started = time.monotonic()
    with (
        httpx.Client(base_url=f"http://{server.http_address}") as http,
        grpc.insecure_channel(server.grpc_address) as channel,
    ):
        for index in range(flood):
            if index % 2:
                assert http.get("/v1/pools").status_code == 401
            else:
                assert _call_grpc(channel, "/kvcm.v1.AdminService/ListPools", None, "") == (
                    "UNAUTHENTICATED"
                )
    elapsed = time.monotonic() - started

    def tally() -> tuple[int, list[int]]:
        logged = len(_audit(caplog, "auth_refused"))
        counts = [vars(r)["suppressed"] for r in _audit(caplog, "auth_refusals_suppressed")]
        return logged, counts

    deadline = time.monotonic() + 3.0
    while sum(tally()[1]) + tally()[0] < flood and time.monotonic() < deadline:
        time.sleep(0.1)  # the server logs the count within a second of the flood
    logged, counts = tally()
    assert logged + sum(counts) == flood
    assert logged <= refusals.burst + refusals.rate_per_s * elapsed + 1
    assert counts
    assert all(count > 0 for count in counts)


def test_async_sdk_sends_its_token(server: EmbeddedServer) -> None:
    """The asyncio SDK's channel adds its token to every call (a channel wrapper, not an
    interceptor): a token's Lookup on its own pool is answered, on another pool refused as
    PERMISSION_DENIED, and without a token as UNAUTHENTICATED."""
    import asyncio

    from kvcm.client import AsyncSchedulerClient, StatusCode

    def query(pool_id: str) -> LookupQuery:
        return LookupQuery(block_hashes=b"\0" * 32, num_tokens=16, pool_ids=(pool_id,))

    async def main() -> None:
        async with AsyncSchedulerClient(
            server.grpc_address, token="sched-a-token", timeout=5.0
        ) as client:
            answer = await client.lookup(query(OWN_POOL))
            assert [hit.pool_id for hit in answer.pools] == [OWN_POOL]
            with pytest.raises(PermissionDeniedError) as denied:
                await client.lookup(query(OTHER_POOL))
            assert denied.value.code == StatusCode.PERMISSION_DENIED
        async with AsyncSchedulerClient(server.grpc_address, timeout=5.0) as anonymous:
            with pytest.raises(PermissionDeniedError) as refused:
                await anonymous.lookup(query(OWN_POOL))
            assert refused.value.code == StatusCode.UNAUTHENTICATED

    asyncio.run(main())
