"""The lookup port (``lookup_address``): Lookup without gRPC, on a real server on 127.0.0.1.

Its answers equal the gRPC Lookup's on a randomized workload (packed and not, best-k and every
pool, pools evicting, deleted and re-created); its errors are the gRPC method's status codes and
messages; malformed frames get an error frame and close only their own connection; pipelined
requests are answered in order; tokens, TLS and shutdown behave as on the gRPC side. Frames are
written by hand here (a router in another language speaks the same bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import random
import re
import socket
import ssl
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from _pki import Pki

from kvcm.client import (
    AsyncSchedulerClient,
    DeadlineExceededError,
    LookupQuery,
    PermissionDeniedError,
    SchedulerClient,
    ServiceNotFoundError,
    StatusCode,
    TlsConfig,
    UnavailableError,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvcm.core.lookup import LookupAnswer
from kvcm.core.pool import PoolConfig
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.rpc import _lookup_port
from kvcm.server.rpc._lookup import OFF_LOOP_HASH_BLOCKS
from kvcm.server.settings import ServerSettings
from kvcm.v1 import lookup_pb2, service_pb2_grpc
from kvcm.wire.lookup import lookup_query_to_proto
from kvcm.wire.lookup_port import (
    HEADER,
    NO_REQUEST_ID,
    FrameKind,
    decode_error,
    decode_header,
    encode_frame,
    encode_hello,
    encode_request,
    split_id,
)

COMMON = {"num_kv_heads": 2, "head_size": 64, "dtype": DType.BFLOAT16}
CODE = {code.name: code.value[0] for code in grpc.StatusCode}


def _config(specs: list[KVCacheSpec], num_blocks: int) -> PoolConfig:
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=tuple(
            KVCacheGroupSpec(layer_names=(f"l{i}",), kv_cache_spec=spec)
            for i, spec in enumerate(specs)
        ),
    )
    return PoolConfig(max_model_len=1024, explicit_layout=layout)


def _full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, **COMMON)  # type: ignore[arg-type]


def _swa() -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=16, sliding_window=32, **COMMON)  # type: ignore[arg-type]


def _serve(client: SchedulerClient, pool_id: str, key: int, prompt: list[int]) -> None:
    """Admit, allocate and cache one request; three in four finish (their blocks stay
    cached), the rest keep running."""
    hashes = client.block_hasher(pool_id).hash_token_ids(prompt)
    client.add_request(pool_id, key, prompt, hashes, request_id=f"r{key}")
    hit = client.get_computed_blocks(pool_id, key)
    blocks = client.allocate_slots(
        pool_id, key, len(prompt) - hit.num_computed_tokens, hit.num_computed_tokens, hit=hit
    )
    if blocks is None or key % 4:
        client.free(pool_id, key)


class RawPort:
    """A hand-written lookup-port client: frames as docs/lookup.md spells them."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = "",
        context: ssl.SSLContext | None = None,
        receive_buffer: int = 0,
    ) -> None:
        host, _, port = address.rpartition(":")
        sock = socket.socket()
        sock.settimeout(10.0)
        if receive_buffer:  # before connecting: the window it advertises stays small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.connect((host, int(port)))
        self.sock = context.wrap_socket(sock, server_hostname=host) if context else sock
        self._buffer = b""
        if token is not None:
            self.send(encode_hello(token))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _read(self, size: int) -> bytes:
        while len(self._buffer) < size:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError(f"closed with {len(self._buffer)} of {size} bytes read")
            self._buffer += chunk
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def frame(self) -> tuple[FrameKind, bytes]:
        kind, length = decode_header(self._read(HEADER.size))
        return kind, self._read(length)

    def hello(self) -> None:
        assert self.frame() == (FrameKind.HELLO, b"")

    def error(self) -> tuple[int, str, str]:
        kind, payload = self.frame()
        assert kind is FrameKind.ERROR, payload
        request_id, code, message = decode_error(payload)
        return request_id, grpc.StatusCode(_BY_NUMBER[code]).name, message

    def answer(self, request_id: int) -> lookup_pb2.LookupResponse:
        kind, payload = self.frame()
        assert kind is FrameKind.ANSWER, decode_error(payload)
        got_id, body = split_id(payload)
        assert got_id == request_id
        return lookup_pb2.LookupResponse.FromString(body)

    def closed(self) -> bool:
        """Whether the server closed the connection (EOF, nothing more to read)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            lookup_address="127.0.0.1:0",
            log_level="WARNING",
        )
    )
    try:
        yield running
    finally:
        running.stop(grace_s=1.0)


def test_answers_equal_the_grpc_lookup_on_a_randomized_workload(server: EmbeddedServer) -> None:
    rng = random.Random(26)
    kinds = [
        lambda: _config([_full()], 48),
        lambda: _config([_full()], 10),  # small: evicts constantly
        lambda: _config([_full(), _swa()], 48),  # hybrid
    ]
    documents = [[rng.randrange(30000) for _ in range(rng.randrange(40, 240))] for _ in range(8)]
    pool_ids = [f"port-{i:02d}" for i in range(24)]
    port = RawPort(server.lookup_address)
    port.hello()
    channel = grpc.insecure_channel(server.grpc_address)
    stub = service_pb2_grpc.LookupServiceStub(channel)  # type: ignore[no-untyped-call]
    with SchedulerClient(server.grpc_address) as client:
        for index, pool_id in enumerate(pool_ids):
            client.create_pool(pool_id, kinds[index % len(kinds)]())
        for key in range(1, 161):
            document = rng.choice(documents)
            _serve(client, rng.choice(pool_ids), key, document[: rng.randrange(1, len(document))])
        request_id = 0
        for round_ in range(5):
            probe = rng.choice(documents)[: rng.randrange(17, 240)]
            hashes = client.block_hasher(pool_ids[0]).hash_token_ids(probe)
            queries = [
                LookupQuery(token_ids=probe),  # every pool
                LookupQuery(token_ids=probe, pool_ids=rng.sample(pool_ids, 7), max_results=3),
                LookupQuery(block_hashes=b"".join(hashes), num_tokens=len(probe), max_results=5),
            ]
            for query in queries:
                for packed in (True, False):
                    request = lookup_query_to_proto(query, packed=packed)
                    request_id += 1
                    port.send(encode_request(request_id, request.SerializeToString()))
                    assert port.answer(request_id) == stub.Lookup(request, timeout=10)
            assert any(stub.Lookup(lookup_query_to_proto(queries[0])).packed.num_hit_tokens)
            # Evictions, deletes and re-creations under the same names: the next round follows.
            for pool_id in rng.sample(pool_ids, 4):
                client.delete_pool(pool_id)
                if round_ % 2:
                    client.create_pool(pool_id, rng.choice(kinds)())
                    document = rng.choice(documents)
                    _serve(client, pool_id, 10_000 + round_ * 10, document)
                else:
                    pool_ids.remove(pool_id)
            for pool_id in rng.sample(pool_ids, 4):
                client.evict_blocks(pool_id, rng.sample(range(1, 10), 3))
    channel.close()
    port.close()


def test_errors_are_the_grpc_methods_and_leave_the_connection_open(
    server: EmbeddedServer,
) -> None:
    channel = grpc.insecure_channel(server.grpc_address)
    stub = service_pb2_grpc.LookupServiceStub(channel)  # type: ignore[no-untyped-call]
    port = RawPort(server.lookup_address)
    port.hello()
    cases = [
        lookup_pb2.LookupRequest(),  # no prompt
        lookup_pb2.LookupRequest(tokens=lookup_pb2.TokenPrompt(token_ids=[1]), load_weight=-1.0),
        lookup_query_to_proto(LookupQuery(token_ids=[1, 2], pool_ids=["no-such-pool"])),
    ]
    for request_id, request in enumerate(cases, start=40):
        port.send(encode_request(request_id, request.SerializeToString()))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Lookup(request, timeout=10)
        assert port.error() == (request_id, refused.value.code().name, refused.value.details())
    # Bytes that are not a LookupRequest: INVALID_ARGUMENT naming the request, as over gRPC.
    port.send(encode_request(7, b"\xff\xff\xff"))
    assert port.error() == (7, "INVALID_ARGUMENT", "request is not a valid kvcm.v1.LookupRequest")
    # The connection still answers.
    port.send(
        encode_request(8, lookup_query_to_proto(LookupQuery(token_ids=[3])).SerializeToString())
    )
    assert port.answer(8).num_pools_in_scope >= 0
    port.close()
    channel.close()
    # Every port call is counted as a gRPC Lookup call is (kvcm_rpc_requests_total).
    metrics = httpx.get(f"http://{server.http_address}/metrics", timeout=5.0).text
    assert 'kvcm_rpc_requests_total{code="INVALID_ARGUMENT",method="Lookup"}' in metrics


def _assert_serving(server: EmbeddedServer) -> None:
    port = RawPort(server.lookup_address)
    port.hello()
    request = lookup_query_to_proto(LookupQuery(token_ids=list(range(40))))
    port.send(encode_request(1, request.SerializeToString()))
    assert port.answer(1).num_pools_in_scope == len(server.server.state.registry.list())
    port.close()


def test_malformed_frames_close_only_their_connection(server: EmbeddedServer) -> None:
    limit = server.server.settings.limits.max_message_bytes
    request = lookup_query_to_proto(LookupQuery(token_ids=[1, 2, 3])).SerializeToString()
    bystander = RawPort(server.lookup_address)
    bystander.hello()
    cases: list[tuple[bytes, str, str]] = [
        (b"XXXX" + bytes(5), "INVALID_ARGUMENT", "bad magic"),
        (struct.pack("<4sBI", b"KVL1", 9, 0), "INVALID_ARGUMENT", "unknown frame kind 9"),
        (struct.pack("<4sBI", b"KVL1", 2, limit + 9), "RESOURCE_EXHAUSTED", "over the limit"),
        (encode_frame(FrameKind.ANSWER, bytes(8)), "INVALID_ARGUMENT", "got ANSWER"),
        (encode_frame(FrameKind.REQUEST, b"\x01\x02"), "INVALID_ARGUMENT", "8-byte request id"),
        (encode_hello(""), "INVALID_ARGUMENT", "got HELLO"),  # a second hello
        # The id of errors about the connection: its own error would read as one.
        (encode_request(NO_REQUEST_ID, request), "INVALID_ARGUMENT", "0xFFFFFFFFFFFFFFFF is"),
    ]
    for data, code, words in cases:
        port = RawPort(server.lookup_address)
        port.hello()
        port.send(encode_request(5, request) + data + encode_request(6, request))
        port.answer(5)  # what came before the bad frame is answered, nothing after it
        request_id, got, message = port.error()
        assert (request_id, got) == (NO_REQUEST_ID, code)
        assert words in message
        assert port.closed()
        port.close()
    # A request before any hello, a hello over 64 KiB, a frame cut short by a closed socket.
    early = RawPort(server.lookup_address, token=None)
    early.send(encode_request(1, request))
    assert early.error()[1:] == (
        "INVALID_ARGUMENT",
        "Lookup: the first frame must be a HELLO, got REQUEST",
    )
    big = RawPort(server.lookup_address, token=None)
    big.send(encode_hello("x" * (64 * 1024 + 1)))
    assert big.error()[1] == "RESOURCE_EXHAUSTED"
    truncated = RawPort(server.lookup_address)
    truncated.hello()
    truncated.send(encode_request(1, request)[:-2])
    truncated.close()
    bystander.send(encode_request(9, request))
    bystander.answer(9)
    # The port's connections and the ones it closed, by code, are exported.
    metrics = httpx.get(f"http://{server.http_address}/metrics", timeout=5.0).text
    closed = re.search(r'kvcm_lookup_port_closed_total\{code="INVALID_ARGUMENT"\} (\S+)', metrics)
    assert closed is not None
    assert float(closed.group(1)) >= 6
    assert re.search(r'kvcm_lookup_port_connections\{state="greeted"\} [1-9]', metrics)
    assert re.search(r'kvcm_lookup_port_requests_total\{code="OK"\} [1-9]', metrics)
    bystander.close()
    _assert_serving(server)


def test_before_the_hello_a_frame_is_refused_at_its_header(server: EmbeddedServer) -> None:
    """Before its HELLO a connection may make the server hold no more than a HELLO: a header
    of another kind, or a HELLO over 64 KiB, is refused as soon as its 9 bytes arrive,
    without waiting for (or buffering) the payload it announces."""
    limit = server.server.settings.limits.max_message_bytes
    for kind, length, code, words in [
        (FrameKind.REQUEST, limit + 8, "INVALID_ARGUMENT", "must be a HELLO, got REQUEST"),
        (FrameKind.ANSWER, 1 << 20, "INVALID_ARGUMENT", "must be a HELLO, got ANSWER"),
        (FrameKind.HELLO, 64 * 1024 + 1, "RESOURCE_EXHAUSTED", "over the limit (65536 bytes)"),
    ]:
        early = RawPort(server.lookup_address, token=None)
        early.sock.settimeout(3.0)  # the old code waited for the whole frame: no answer
        early.send(struct.pack("<4sBI", b"KVL1", kind, length) + bytes(4096))
        request_id, got, message = early.error()
        assert (request_id, got) == (NO_REQUEST_ID, code)
        assert words in message
        assert early.closed()
        early.close()
    _assert_serving(server)


def test_pipelined_requests_are_answered_in_order(server: EmbeddedServer) -> None:
    prompt = list(range(16 * 20))
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("pipelined", _config([_full()], 64))
        _serve(client, "pipelined", 4, prompt)
    port = RawPort(server.lookup_address)
    port.hello()
    ids = random.Random(3).sample(range(1, 2**63), 300)  # more than a connection queues
    hits = {request_id: (request_id % 20) * 16 + 1 for request_id in ids}
    port.send(
        b"".join(
            encode_request(
                request_id,
                lookup_query_to_proto(
                    LookupQuery(token_ids=prompt[: hits[request_id]], pool_ids=["pipelined"])
                ).SerializeToString(),
            )
            for request_id in ids
        )
    )
    for request_id in ids:
        answer = port.answer(request_id)
        assert list(answer.packed.num_hit_tokens) == [(hits[request_id] - 1) // 16 * 16]
    port.close()


def test_a_lookup_that_waits_keeps_its_place(server: EmbeddedServer) -> None:
    """A request answered where it is read (nothing before it) and one whose lookup must wait
    (a token prompt long enough to be hashed off the loop) share a connection: the requests
    read behind the waiting one wait their turn, and every answer leaves in order."""
    short = list(range(16 * 4))
    long = list(range(16 * OFF_LOOP_HASH_BLOCKS + 16))
    config = dataclasses.replace(_config([_full()], 64), max_model_len=len(long) + 16)
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("waits", config)
        _serve(client, "waits", 4, short)

    def request(request_id: int, tokens: list[int]) -> bytes:
        query = LookupQuery(token_ids=tokens, pool_ids=["waits"])
        return encode_request(request_id, lookup_query_to_proto(query).SerializeToString())

    port = RawPort(server.lookup_address)
    port.hello()
    port.send(request(1, short))  # alone: answered at once
    assert list(port.answer(1).packed.num_hit_tokens) == [48]
    port.send(request(2, long) + request(3, short) + request(4, long[:33]) + request(5, short))
    expected = {2: 64, 3: 48, 4: 32, 5: 48}
    for request_id, hit in expected.items():
        assert list(port.answer(request_id).packed.num_hit_tokens) == [hit]
    port.close()


def _server_side(server: EmbeddedServer, port: RawPort) -> _lookup_port._Connection:
    """The server's end of ``port``'s connection (found by its peer address)."""
    lookup_port = server.server.lookup_port
    assert lookup_port is not None
    peer = f"ipv4:127.0.0.1:{port.sock.getsockname()[1]}"
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        for connection in list(lookup_port.connections):
            if connection.peer == peer:
                return connection
        time.sleep(0.01)
    raise AssertionError(f"no server connection for {peer}")


def _fill_answers(server: EmbeddedServer, port: RawPort) -> tuple[_lookup_port._Connection, bytes]:
    """Make the server's end of ``port`` (a client with a small receive buffer that does not
    read) unwritable: a slow path to the client (small kernel buffers), filled with requests
    answered with long errors (a missing pool's 500-character name), one at a time so that
    few wait. Returns the server's connection and the request sent."""
    connection = _server_side(server, port)
    transport = connection._transport
    assert transport is not None
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    missing = lookup_query_to_proto(LookupQuery(token_ids=[1], pool_ids=["m" * 500]))
    filler = encode_request(3, missing.SerializeToString())
    deadline = time.monotonic() + 10.0
    while connection._writable.is_set() and time.monotonic() < deadline:
        port.send(filler)
        time.sleep(0.002)
        while connection._queue and connection._writable.is_set():
            time.sleep(0.001)  # answered before the next: the queue stays short
    assert not connection._writable.is_set()
    return connection, filler


def test_a_client_that_does_not_read_holds_bounded_bytes(server: EmbeddedServer) -> None:
    """A client that never reads its answers and pipelines large requests makes the server
    hold at most QUEUE_BYTES (1 MiB) of requests plus one 256 KiB read, and one answer plus
    the transport's 64 KiB: the port stops reading it, and parses no further than its budget
    in a chunk it already read (the old code held all 8 MiB)."""
    port = RawPort(server.lookup_address, receive_buffer=4096)
    connection, filler = _fill_answers(server, port)
    transport = connection._transport
    assert transport is not None
    assert not connection._paused  # still reading: what comes next is read
    big = encode_request(4, b"\xff" * (200 << 10))

    sent = 0

    def pump() -> None:
        nonlocal sent
        with contextlib.suppress(OSError):  # closed below, while blocked
            for _ in range(40):  # 8 MiB
                port.sock.sendall(big)
                sent += 1

    port.sock.settimeout(5.0)
    with ThreadPoolExecutor(1) as thread:
        done = thread.submit(pump)
        peak = 0
        started = time.monotonic()
        while time.monotonic() < started + (1.0 if sent > 10 else 4.0):
            queued = sum(len(body) for _, body in list(connection._queue))
            peak = max(peak, queued + len(connection._buffer))
            time.sleep(0.01)
        assert peak > 4 * len(big)  # the large requests were read (some of them)
        assert peak <= (1 << 20) + (256 << 10), peak  # QUEUE_BYTES and a read: docs/lookup.md
        assert transport.get_write_buffer_size() <= (64 << 10) + len(filler) + 100
        port.close()
        done.result()
    _assert_serving(server)


def _token_file(path: Path, tokens: dict[str, tuple[str, list[str]]]) -> Path:
    lines = []
    for token, (name, roles) in tokens.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        quoted = ", ".join(f'"{role}"' for role in roles)
        lines += ["[[tokens]]", f'name = "{name}"', f'sha256 = "{digest}"', f"roles = [{quoted}]"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tokens_and_tls(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With auth_tokens and TLS: the hello's token decides the principal (readable pools
    only, a named unreadable pool PERMISSION_DENIED naming scope.pool_ids[i], a bad token
    UNAUTHENTICATED and closed, audited); plaintext and untrusted clients are refused."""
    pki = Pki(tmp_path, "lookup-port")
    cert, key = pki.issue("kvcm-server")
    tokens = _token_file(
        tmp_path / "tokens.toml",
        {"admin": ("ops", ["admin:*"]), "router-a": ("router-a", ["reader:team-a-*"])},
    )
    running = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="",
            lookup_address="127.0.0.1:0",
            log_level="WARNING",
            auth_tokens=str(tokens),
            tls_cert=str(pki.write("server.pem", cert)),
            tls_key=str(pki.write("server.key", key)),
        )
    )
    context = ssl.create_default_context(cafile=str(pki.write("ca.pem", pki.ca_pem)))
    prompt = list(range(64))
    request = lookup_query_to_proto(LookupQuery(token_ids=prompt))
    try:
        tls = TlsConfig(root_certificates=pki.ca_pem)
        with SchedulerClient(running.grpc_address, token="admin", tls=tls) as admin:
            for pool_id in ("team-a-0", "team-a-1", "team-b-0"):
                admin.create_pool(pool_id, _config([_full()], 16))
                _serve(admin, pool_id, 4, prompt)
        router = RawPort(running.lookup_address, token="router-a", context=context)
        router.hello()
        router.send(encode_request(1, request.SerializeToString()))
        answer = router.answer(1)
        assert sorted(answer.packed.pool_id) == ["team-a-0", "team-a-1"]
        assert answer.num_pools_in_scope == 2
        named = lookup_query_to_proto(
            LookupQuery(token_ids=prompt, pool_ids=["team-a-0", "team-b-0"])
        )
        router.send(encode_request(2, named.SerializeToString()))
        request_id, code, message = router.error()
        assert (request_id, code) == (2, "PERMISSION_DENIED")
        assert "scope.pool_ids[1]" in message
        assert "team-b-0" in message
        router.send(encode_request(3, request.SerializeToString()))  # still open
        assert router.answer(3).num_pools_in_scope == 2
        router.close()
        with caplog.at_level("WARNING", logger="kvcm.audit"):
            for token in ("nope", ""):
                wrong = RawPort(running.lookup_address, token=token, context=context)
                wrong.send(encode_request(1, request.SerializeToString()))
                assert wrong.error()[:2] == (NO_REQUEST_ID, "UNAUTHENTICATED")
                assert wrong.closed()
                wrong.close()
        assert any("a token not in the tokens file" in r.getMessage() for r in caplog.records)
        # The SDK: TLS with the client's roots, the token in its HELLO, the RPC's errors.
        address = running.lookup_address
        with SchedulerClient(running.grpc_address, tls=tls, token="router-a") as rpc:
            expected = rpc.lookup(LookupQuery(token_ids=prompt))
        with SchedulerClient(
            running.grpc_address, tls=tls, token="router-a", lookup_address=address
        ) as sdk:
            assert sdk.lookup(LookupQuery(token_ids=prompt)) == expected
            assert sorted(hit.pool_id for hit in expected.pools) == ["team-a-0", "team-a-1"]
            with pytest.raises(PermissionDeniedError, match=r"scope.pool_ids\[1\]") as denied:
                sdk.lookup(LookupQuery(token_ids=prompt, pool_ids=["team-a-0", "team-b-0"]))
            assert denied.value.code is StatusCode.PERMISSION_DENIED
        for token in ("nope", None):
            with SchedulerClient(
                running.grpc_address, tls=tls, token=token, lookup_address=address
            ) as stranger:
                with pytest.raises(PermissionDeniedError) as refused:
                    stranger.lookup(LookupQuery(token_ids=prompt))
                assert refused.value.code is StatusCode.UNAUTHENTICATED
        # A reload (SIGHUP) reaches open connections: a changed entry's roles apply from the
        # next request on, a removed token is refused there (that request's id, then the
        # connection's UNAUTHENTICATED) and the connection closed, as gRPC refuses its next call.
        table = running.server.tokens
        assert table is not None
        kept = RawPort(running.lookup_address, token="router-a", context=context)
        kept.hello()
        kept.send(encode_request(1, request.SerializeToString()))
        assert kept.answer(1).num_pools_in_scope == 2
        _token_file(tokens, {"admin": ("ops", ["admin:*"]), "router-a": ("a", ["reader:team-b-*"])})
        table.reload()
        kept.send(encode_request(2, request.SerializeToString()))
        assert list(kept.answer(2).packed.pool_id) == ["team-b-0"]
        _token_file(tokens, {"admin": ("ops", ["admin:*"])})
        table.reload()
        # Pipelined behind the refused one, 4 and 5 get no error of their own.
        kept.send(b"".join(encode_request(i, request.SerializeToString()) for i in (3, 4, 5)))
        assert kept.error() == (
            3,
            "UNAUTHENTICATED",
            "Lookup: the connection's token is no longer in the tokens file",
        )
        assert kept.error()[:2] == (NO_REQUEST_ID, "UNAUTHENTICATED")
        assert kept.closed()
        kept.close()
        with (
            SchedulerClient(running.grpc_address, token="admin", lookup_address=address) as plain,
            pytest.raises(UnavailableError),
        ):
            plain.lookup(LookupQuery(token_ids=prompt), timeout=2.0)
        # Plaintext gets no answer from a TLS port; nor does a client that does not trust it.
        plain = RawPort(running.lookup_address, token="admin")
        plain.send(encode_request(1, request.SerializeToString()))
        with pytest.raises((EOFError, ConnectionResetError, ValueError)):
            plain.frame()
        plain.close()
        with pytest.raises(ssl.SSLCertVerificationError):
            RawPort(running.lookup_address, token="admin", context=ssl.create_default_context())
    finally:
        running.stop(grace_s=1.0)


def test_stop_closes_connections_and_settings_are_checked(tmp_path: Path) -> None:
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", lookup_address="127.0.0.1:0")
    )
    assert running.server.lookup_address == running.lookup_address != ""
    port = RawPort(running.lookup_address)
    port.hello()
    running.stop(grace_s=1.0)
    assert port.error()[:2] == (NO_REQUEST_ID, "UNAVAILABLE")
    assert port.closed()
    port.close()
    with pytest.raises(ConnectionRefusedError):
        RawPort(running.lookup_address)
    off = start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    assert off.lookup_address == ""
    assert off.server.lookup_port is None
    off.stop()
    with pytest.raises(ConfigError, match="lookup_address"):
        ServerSettings(lookup_address="nowhere")
    with pytest.raises(ConfigError, match="lookup_address: the lookup port"):
        ServerSettings(lookup_address="127.0.0.1:0", etcd_endpoints="http://127.0.0.1:2379")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    with pytest.raises(RuntimeError, match="lookup_address: cannot listen"):
        start_embedded_server(
            ServerSettings(grpc_address="127.0.0.1:0", http_address="", lookup_address=address)
        )
    taken.close()


def test_stop_is_bounded_by_a_client_that_does_not_read() -> None:
    """stop() returns within its grace (and a little) when a client has stopped reading its
    answers, and closes that connection too (its last frames dropped): a connection closed
    but still flushing is aborted after the grace, and the listener's wait_closed (which on
    Python >= 3.12 waits for every connection) is bounded."""
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", lookup_address="127.0.0.1:0")
    )
    lookup_port = running.server.lookup_port
    assert lookup_port is not None
    stuck = RawPort(running.lookup_address, receive_buffer=4096)
    _fill_answers(running, stuck)
    started = time.monotonic()
    running.stop(grace_s=0.5)
    assert time.monotonic() - started < 0.5 + 2.0  # the grace, STOP_WAIT_S (1 s) and slack
    assert not lookup_port.connections  # aborted, not left flushing
    stuck.close()


def test_mutual_tls_needs_a_client_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tls_client_ca the port, like the gRPC side, refuses a client without a certificate
    signed by that CA and answers one with; once tls_client_ca is rewritten to another CA,
    the old CA's certificates are refused by the port and the HTTP side alike (a new TLS
    context, not the old one with a CA added)."""
    from kvcm.server import app

    monkeypatch.setattr(app, "_TLS_WATCH_S", 0.05)
    pki = Pki(tmp_path, "lookup-port-mtls")
    cert, key = pki.issue("kvcm-server")
    ca = pki.write("ca.pem", pki.ca_pem)
    client_ca = pki.write("client-ca.pem", pki.ca_pem)
    running = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            lookup_address="127.0.0.1:0",
            log_level="WARNING",
            tls_cert=str(pki.write("server.pem", cert)),
            tls_key=str(pki.write("server.key", key)),
            tls_client_ca=str(client_ca),
        )
    )
    request = lookup_query_to_proto(LookupQuery(token_ids=[1, 2])).SerializeToString()
    try:
        anonymous = RawPort(
            running.lookup_address, token=None, context=ssl.create_default_context(cafile=str(ca))
        )
        anonymous.send(encode_hello("") + encode_request(1, request))  # TLS 1.3: refused later
        with pytest.raises((EOFError, ssl.SSLError, ConnectionResetError)):
            anonymous.frame()
        anonymous.close()
        client_cert, client_key = pki.issue("router")
        context = ssl.create_default_context(cafile=str(ca))
        context.load_cert_chain(
            str(pki.write("router.pem", client_cert)), str(pki.write("router.key", client_key))
        )
        port = RawPort(running.lookup_address, context=context)
        port.hello()
        port.send(encode_request(1, request))
        assert port.answer(1).num_pools_in_scope == 0
        port.close()
        healthz = f"https://{running.http_address}/healthz"
        assert httpx.get(healthz, verify=context, timeout=5.0).status_code == 200
        # The operator replaces the client CA: CA1's certificates are refused from then on.
        other = Pki(tmp_path, "lookup-port-mtls-2")
        other_cert, other_key = other.issue("router-2")
        client_ca.write_bytes(other.ca_pem)
        time.sleep(0.5)  # the files are checked every _TLS_WATCH_S
        refused = RawPort(running.lookup_address, token=None, context=context)
        refused.send(encode_hello("") + encode_request(1, request))
        with pytest.raises((EOFError, ssl.SSLError, ConnectionResetError)):
            refused.frame()
        refused.close()
        with pytest.raises(httpx.HTTPError):
            httpx.get(healthz, verify=context, timeout=5.0)
        rotated = ssl.create_default_context(cafile=str(ca))
        rotated.load_cert_chain(
            str(other.write("router-2.pem", other_cert)), str(other.write("r2.key", other_key))
        )
        port = RawPort(running.lookup_address, context=rotated)
        port.hello()
        port.send(encode_request(2, request))
        assert port.answer(2).num_pools_in_scope == 0
        port.close()
        assert httpx.get(healthz, verify=rotated, timeout=5.0).status_code == 200
    finally:
        running.stop(grace_s=1.0)


# ------------------------------------------------------------------------------ the SDK
def test_the_sdk_over_the_port_answers_as_over_grpc(server: EmbeddedServer) -> None:
    """``lookup_address`` sends lookup() over the port: the same answers as the RPC's (sync
    client shared by threads, and asyncio), the same error classes."""
    rng = random.Random(7)
    documents = [[rng.randrange(30000) for _ in range(rng.randrange(40, 200))] for _ in range(5)]
    pool_ids = [f"sdk-{i}" for i in range(10)]
    with (
        SchedulerClient(server.grpc_address) as rpc,
        SchedulerClient(server.grpc_address, lookup_address=server.lookup_address) as port,
    ):
        for index, pool_id in enumerate(pool_ids):
            rpc.create_pool(pool_id, _config([_full()] if index % 2 else [_full(), _swa()], 32))
        for key in range(1, 61):
            document = rng.choice(documents)
            _serve(rpc, rng.choice(pool_ids), key, document[: rng.randrange(1, len(document))])
        queries = []
        for _ in range(12):
            probe = rng.choice(documents)[: rng.randrange(17, 200)]
            queries += [
                LookupQuery(token_ids=probe, pool_ids=pool_ids),
                LookupQuery(token_ids=probe, pool_ids=pool_ids, max_results=3, load_weight=0.0),
            ]
        expected = [rpc.lookup(query) for query in queries]
        assert any(hit.num_hit_tokens for answer in expected for hit in answer.pools)
        assert [port.lookup(query) for query in queries] == expected
        # One client, eight threads: one lookup at a time on its connection, each answered.
        with ThreadPoolExecutor(8) as threads:
            assert list(threads.map(port.lookup, queries * 4)) == expected * 4

        async def over_asyncio() -> list[LookupAnswer]:
            async with AsyncSchedulerClient(
                server.grpc_address, lookup_address=server.lookup_address
            ) as client:
                return list(await asyncio.gather(*(client.lookup(q) for q in queries)))

        assert asyncio.run(over_asyncio()) == expected
        with pytest.raises(ServiceNotFoundError, match=r"scope.pool_ids\[1\]") as missing:
            port.lookup(LookupQuery(token_ids=[1, 2], pool_ids=["sdk-0", "nope"]))
        with pytest.raises(ServiceNotFoundError) as over_rpc:
            rpc.lookup(LookupQuery(token_ids=[1, 2], pool_ids=["sdk-0", "nope"]))
        assert str(missing.value) == str(over_rpc.value)
        assert port.lookup(queries[0]) == expected[0]  # the connection stays open


def test_the_sdk_reconnects_to_a_restarted_server() -> None:
    """A connection the server closed (stop) is opened again once, silently; while the
    server is down lookup() raises UnavailableError; an unanswered lookup times out."""
    settings = ServerSettings(
        grpc_address="127.0.0.1:0", http_address="", lookup_address="127.0.0.1:0"
    )
    first = start_embedded_server(settings)
    fixed = ServerSettings(
        grpc_address=first.grpc_address, http_address="", lookup_address=first.lookup_address
    )
    query = LookupQuery(token_ids=list(range(40)))
    client = SchedulerClient(first.grpc_address, lookup_address=first.lookup_address, timeout=5.0)
    try:
        assert client.lookup(query).num_pools_in_scope == 0
        first.stop(grace_s=0.5)
        second = start_embedded_server(fixed)  # same ports
        try:
            client.create_pool("after-restart", _config([_full()], 16))
            assert client.lookup(query).num_pools_in_scope == 1  # reopened, once
        finally:
            second.stop(grace_s=0.5)
        with pytest.raises(UnavailableError):
            client.lookup(query)
        third = start_embedded_server(fixed)
        try:
            assert client.lookup(query).num_pools_in_scope == 0
        finally:
            third.stop(grace_s=0.5)
    finally:
        client.close()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts (the kernel does) and never answers
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    with (
        SchedulerClient("127.0.0.1:1", lookup_address=address) as stuck,
        pytest.raises(DeadlineExceededError),
    ):
        stuck.lookup(query, timeout=0.3)
    silent.close()
    with pytest.raises(InvalidArgumentError, match="lookup_address"):
        SchedulerClient("127.0.0.1:1,127.0.0.1:2", lookup_address=address)
    with pytest.raises(InvalidArgumentError, match="lookup_address"):
        SchedulerClient("127.0.0.1:1", lookup_address="no-port")


def test_a_silent_connection_and_one_too_many_are_closed(
    server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that sends no HELLO in time gets DEADLINE_EXCEEDED and is closed; past
    the port's connection limit a new one gets RESOURCE_EXHAUSTED, and once one closes a new
    one is served again."""
    monkeypatch.setattr(_lookup_port, "HELLO_TIMEOUT_S", 0.2)
    silent = RawPort(server.lookup_address, token=None)
    assert silent.error() == (
        NO_REQUEST_ID,
        "DEADLINE_EXCEEDED",
        "Lookup: no HELLO frame within 0.2 s",
    )
    assert silent.closed()
    silent.close()
    monkeypatch.undo()
    port = server.server.lookup_port
    assert port is not None
    held = [RawPort(server.lookup_address) for _ in range(2)]
    for connection in held:
        connection.hello()
    monkeypatch.setattr(port, "max_connections", len(port.connections))
    refused = RawPort(server.lookup_address, token=None)
    request_id, code, message = refused.error()
    assert (request_id, code) == (NO_REQUEST_ID, "RESOURCE_EXHAUSTED")
    assert "connections already" in message
    assert refused.closed()
    refused.close()
    held.pop().close()
    deadline = time.monotonic() + 5.0
    while len(port.connections) >= port.max_connections and time.monotonic() < deadline:
        time.sleep(0.01)  # the server sees the close on its loop
    _assert_serving(server)
    for connection in held:
        connection.close()


def test_idle_connections_close_and_helloless_ones_take_half_the_slots(
    server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A greeted connection with nothing coming (or a frame never completed) for
    IDLE_TIMEOUT_S gets DEADLINE_EXCEEDED and is closed, one in use stays open; accepted
    sockets have SO_KEEPALIVE; connections without a HELLO hold at most half the slots, so
    peers without a token cannot lock a router out (the oldest makes room for a newcomer)."""
    monkeypatch.setattr(_lookup_port, "IDLE_TIMEOUT_S", 0.4)
    request = lookup_query_to_proto(LookupQuery(token_ids=[1, 2])).SerializeToString()
    quiet, partial, busy = (RawPort(server.lookup_address) for _ in range(3))
    for port in (quiet, partial, busy):
        port.hello()
    sock = _server_side(server, busy)._transport.get_extra_info("socket")  # type: ignore[union-attr]
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    partial.send(encode_request(1, request)[:-3])  # never completed
    for request_id in range(1, 9):  # busy for twice the idle limit: kept
        busy.send(encode_request(request_id, request))
        busy.answer(request_id)
        time.sleep(0.1)
    for port in (quiet, partial):
        request_id, code, message = port.error()
        assert (request_id, code) == (NO_REQUEST_ID, "DEADLINE_EXCEEDED")
        assert "within 0.4 s" in message
        assert port.closed()
        port.close()
    busy.send(encode_request(9, request))
    busy.answer(9)
    busy.close()
    monkeypatch.undo()
    lookup_port = server.server.lookup_port
    assert lookup_port is not None
    monkeypatch.setattr(lookup_port, "max_connections", len(lookup_port.connections) + 6)
    half = lookup_port.max_connections // 2
    squatters = [RawPort(server.lookup_address, token=None) for _ in range(half)]
    deadline = time.monotonic() + 5.0
    while len(lookup_port.unhelloed) < half and time.monotonic() < deadline:
        time.sleep(0.01)
    _assert_serving(server)  # a router still gets in: the oldest without a HELLO made room
    request_id, code, message = squatters[0].error()
    assert (request_id, code) == (NO_REQUEST_ID, "RESOURCE_EXHAUSTED")
    assert "waiting for their HELLO" in message
    for squatter in squatters:
        squatter.close()


def _scrape(server: EmbeddedServer) -> dict[str, float]:
    """The lookup latency counts and the port's request total from /metrics."""
    text = httpx.get(f"http://{server.http_address}/metrics", timeout=5.0).text

    def value(pattern: str) -> float:
        found = re.search(pattern, text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    return {
        "port": value(r"^kvcm_lookup_port_duration_seconds_count (\S+)$"),
        "port_sum": value(r"^kvcm_lookup_port_duration_seconds_sum (\S+)$"),
        "port_le_inf": value(r'^kvcm_lookup_port_duration_seconds_bucket\{le="\+Inf"\} (\S+)$'),
        "all": value(r'^kvcm_rpc_duration_seconds_count\{method="Lookup"\} (\S+)$'),
        "answered": sum(
            float(v)
            for v in re.findall(
                r"^kvcm_lookup_port_requests_total\{code=\"\w+\"\} (\S+)$", text, re.M
            )
        ),
    }


def test_the_port_has_a_latency_histogram_of_its_own(server: EmbeddedServer) -> None:
    """kvcm_lookup_port_duration_seconds counts the port's requests only; gRPC's Lookup calls
    and the port's both stay in kvcm_rpc_duration_seconds{method="Lookup"}."""
    query = LookupQuery(token_ids=list(range(1, 50)))
    before = _scrape(server)
    with (
        SchedulerClient(server.grpc_address) as rpc,
        SchedulerClient(server.grpc_address, lookup_address=server.lookup_address) as port,
    ):
        for _ in range(3):
            rpc.lookup(query)
        for _ in range(5):
            port.lookup(query)
    after = _scrape(server)
    assert after["port"] - before["port"] == 5
    assert after["all"] - before["all"] == 8
    assert after["port_sum"] > before["port_sum"]
    assert after["port_le_inf"] == after["port"] == after["answered"]
