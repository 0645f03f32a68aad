"""``kvcm pd-proxy`` in front of simulated OpenAI-compatible engines backed by real kvcm pools.

Real HTTP everywhere: a kvcm server on 127.0.0.1, three engine servers (examples/pd_engine.py:
one prefill, two decode, each over its own pool), the proxy served by uvicorn, and a client
that streams. The tests check that the proxy routes a conversation's next turn to the decode
engine that holds its exact longest prefix (what each pool's own lookup says), passes
``do_remote_decode`` to the prefill engine and the prefill's answer to the decode engine, fails
over to the next decode engine, and that nothing stays held once leases pass.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from kvcm.cli._connect import Connection
from kvcm.cli.pd_proxy import Engine, ProxyConfig, build_proxy_app
from kvcm.client import LookupQuery, PoolConfig, SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from pd_engine import SimEngine

BLOCK = 16
TRANSFER_LEASE_S = 1.5  # generous: a pull on a loaded machine must finish within it


def _pool(num_blocks: int) -> PoolConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=spec),),
    )
    return PoolConfig(max_model_len=4096, explicit_layout=layout, scheduler_lease_s=2.0)


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            log_level="WARNING",
            transfer_lease_s=TRANSFER_LEASE_S,
        )
    )
    try:
        yield running
    finally:
        running.stop(grace_s=1.0)


class _Cluster:
    def __init__(self, server: EmbeddedServer, prefix: str, fault: int | str = 0) -> None:
        never_pull_every = fault if isinstance(fault, int) else 0
        self.bidirectional = fault == "bidirectional"
        self.client = SchedulerClient(server.grpc_address)
        self.prefill = SimEngine(
            name=f"{prefix}p0",
            role="prefill",
            pool_id=f"{prefix}p0",
            kvcm_address=server.grpc_address,
            kv_lease_s=1.0,
            bidirectional=self.bidirectional,
            kv_recompute_threshold=16,
        )
        self.decode = [
            SimEngine(
                name=f"{prefix}d{i}",
                role="decode",
                pool_id=f"{prefix}d{i}",
                kvcm_address=server.grpc_address,
                never_pull_every=never_pull_every if i == 0 else 0,
                bidirectional=self.bidirectional,
                decoder_ttl_s=1.5,
            )
            for i in range(2)
        ]
        for engine in [self.prefill, *self.decode]:
            self.client.create_pool(engine.pool_id, _pool(256))
            engine.start()
        self.proxies: list[tuple[uvicorn.Server, threading.Thread]] = []
        self.connection = Connection(
            address=server.grpc_address, tls=None, token=None, timeout_s=5.0
        )

    def proxy(self, policy: str, connection: Connection | None = None) -> str:
        config = ProxyConfig(
            prefill=(Engine(url=self.prefill.url, pool_id=self.prefill.pool_id, role="prefill"),),
            decode=tuple(
                Engine(url=engine.url, pool_id=engine.pool_id, role="decode")
                for engine in self.decode
            ),
            policy=policy,
            timeout_s=30.0,
            bidirectional=self.bidirectional,
        )
        app = build_proxy_app(config, connection or self.connection)
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        self.proxies.append((server, thread))
        return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    def held_blocks(self) -> dict[str, tuple[int, int]]:
        """Per pool: (requests tracked, blocks neither free nor the null block)."""
        out = {}
        for engine in [self.prefill, *self.decode]:
            usage = self.client.get_usage(engine.pool_id)
            out[engine.pool_id] = (usage.num_requests, usage.num_blocks - 1 - usage.num_free_blocks)
        return out

    def close(self) -> None:
        for server, thread in self.proxies:
            server.should_exit = True
            thread.join(timeout=10)
        for engine in [self.prefill, *self.decode]:
            engine.stop()
        self.client.close()


@pytest.fixture
def cluster(server: EmbeddedServer, request: pytest.FixtureRequest) -> Iterator[_Cluster]:
    prefix = f"{request.node.originalname[5:25]}-".replace("_", "")
    running = _Cluster(server, prefix, getattr(request, "param", 0))
    try:
        yield running
    finally:
        running.close()


def _complete(
    http: httpx.Client, prompt: list[int], *, stream: bool
) -> tuple[list[int], httpx.Headers]:
    body = {"model": "sim", "prompt": prompt, "max_tokens": 6, "stream": stream}
    if not stream:
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["token_ids"], answer.headers
    tokens: list[int] = []
    done = False
    with http.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            for choice in json.loads(line[6:])["choices"]:
                tokens += choice["token_ids"]
        headers = answer.headers
    assert done
    return tokens, headers


def _settle(cluster: _Cluster) -> dict[str, tuple[int, int]]:
    """Wait past the leases; what each pool still holds."""
    deadline = time.monotonic() + 10
    held = cluster.held_blocks()
    while any(requests for requests, _ in held.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        held = cluster.held_blocks()
    return held


def test_the_next_turn_goes_to_the_decode_engine_holding_its_prefix(cluster: _Cluster) -> None:
    url = cluster.proxy("kvcm")
    conversations = {
        name: list(range(base, base + 5 * BLOCK + 7)) for name, base in (("a", 1000), ("b", 20000))
    }
    # decode-1 served conversation b's first turn before (through the plain SDK).
    warm, client = cluster.decode[1].pool_id, cluster.client
    first_b = conversations["b"]
    client.add_request(warm, 1, first_b, client.block_hasher(warm).hash_token_ids(first_b))
    client.allocate_slots(warm, 1, len(first_b), 0)
    client.free(warm, 1)
    served: dict[str, str] = {}
    with httpx.Client(base_url=url, timeout=30.0) as http:
        for name, prompt in conversations.items():
            output, headers = _complete(http, prompt, stream=name == "a")
            assert len(output) == 6
            served[name] = headers["x-kvcm-decode"]
            conversations[name] = prompt + output
        # a: no engine holds it, equal scores, the smaller pool id; b: the engine holding it.
        assert served == {"a": cluster.decode[0].pool_id, "b": warm}
        for turn in range(2):
            for name, history in list(conversations.items()):
                prompt = history + list(range(7 * turn + 50, 7 * turn + 57))
                holders = {
                    hit.pool_id: hit.num_hit_tokens
                    for hit in cluster.client.lookup(
                        LookupQuery(token_ids=prompt, pool_ids=[e.pool_id for e in cluster.decode])
                    ).pools
                }
                best = max(holders, key=lambda pool: (holders[pool], pool == served[name]))
                decode = next(e for e in cluster.decode if e.pool_id == best)
                before = decode.stats.pulled_tokens
                output, headers = _complete(http, prompt, stream=turn == 1)
                assert headers["x-kvcm-decode"] == best == served[name]
                assert int(headers["x-kvcm-decode-hit-tokens"]) == holders[best]
                assert holders[best] >= len(history) // BLOCK * BLOCK - BLOCK
                # The decode engine pulled exactly the prompt minus its own exact hit.
                assert decode.stats.pulled_tokens - before == len(prompt) - holders[best]
                conversations[name] = prompt + output
        stats = http.get("/v1/pd/stats").json()
    assert stats["routed_by_kvcm"] == 6
    assert stats["failed"] == 0
    # The prefill engine got do_remote_decode; each decode engine the prefill's own params.
    assert all(
        p["do_remote_decode"] and not p["do_remote_prefill"] for p in cluster.prefill.received
    )
    decode_params = [p for engine in cluster.decode for p in engine.received]
    assert len(decode_params) == 6
    for params in decode_params:
        assert params["do_remote_prefill"]
        assert params["remote_engine_id"] == cluster.prefill.name
        assert params["remote_host"] == "127.0.0.1"
        assert params["remote_block_ids"]
    assert cluster.prefill.stats.sources_released == 6  # every source was pulled and released
    held = _settle(cluster)
    assert all(requests == 0 for requests, _ in held.values()), held
    # Nothing is held: every block is free (cached blocks count as free).
    assert all(blocks == 0 for _, blocks in held.values()), held


def test_round_robin_alternates_blind_to_the_caches(cluster: _Cluster) -> None:
    url = cluster.proxy("round-robin")
    prompt = list(range(3000, 3000 + 4 * BLOCK))
    seen = []
    pulled = 0
    with httpx.Client(base_url=url, timeout=30.0) as http:
        for turn in range(4):
            output, headers = _complete(http, prompt, stream=False)
            seen.append(headers["x-kvcm-decode"])
            prompt = [*prompt, *output, 9000 + turn]
        stats = http.get("/v1/pd/stats").json()
    pulled = sum(engine.stats.pulled_tokens for engine in cluster.decode)
    assert seen == [cluster.decode[i % 2].pool_id for i in range(4)]
    assert stats["routed_round_robin"] == 4
    assert stats["routed_by_kvcm"] == 0
    # Each turn lands on the engine that did not serve the previous one: it pulls more than
    # the new tokens of the turn.
    assert pulled > 4 * 8
    assert all(requests == 0 for requests, _ in _settle(cluster).values())


@pytest.mark.parametrize("cluster", [1], indirect=True)  # decode-0 never pulls
def test_a_decode_engine_that_never_pulls_fails_over_and_leaks_nothing(cluster: _Cluster) -> None:
    url = cluster.proxy("kvcm")
    with httpx.Client(base_url=url, timeout=30.0) as http:
        for i in range(3):
            prompt = list(range(100 * i, 100 * i + 3 * BLOCK + 1))
            output, headers = _complete(http, prompt, stream=i == 1)
            assert len(output) == 6
            assert headers["x-kvcm-decode"] == cluster.decode[1].pool_id
        stats = http.get("/v1/pd/stats").json()
    faulty = cluster.decode[0]
    assert faulty.stats.abandoned >= 1
    assert stats["decode_retries"] == faulty.stats.abandoned
    # The abandoned allocations are reclaimed by the server's transfer lease.
    held = _settle(cluster)
    assert all(requests == 0 and blocks == 0 for requests, blocks in held.values()), held


def test_a_dead_decode_engine_is_skipped(cluster: _Cluster) -> None:
    url = cluster.proxy("kvcm")
    with httpx.Client(base_url=url, timeout=30.0) as http:
        prompt = list(range(7000, 7000 + 3 * BLOCK))
        _, headers = _complete(http, prompt, stream=False)
        first = headers["x-kvcm-decode"]
        dead = next(engine for engine in cluster.decode if engine.pool_id == first)
        dead.die()
        output, headers = _complete(http, [*prompt, 1, 2, 3], stream=True)
        assert headers["x-kvcm-decode"] != first
        assert len(output) == 6
        assert http.get("/v1/pd/stats").json()["decode_retries"] == 1
    assert all(requests == 0 for requests, _ in _settle(cluster).values())


def test_text_prompts_are_tokenized_by_the_engine_and_bad_bodies_refused(
    cluster: _Cluster,
) -> None:
    url = cluster.proxy("kvcm")
    with httpx.Client(base_url=url, timeout=30.0) as http:
        chat = {
            "model": "sim",
            "messages": [{"role": "user", "content": "hello there " * 20}],
            "max_tokens": 3,
        }
        answer = http.post("/v1/chat/completions", json=chat)
        assert answer.status_code == 200, answer.text
        assert answer.json()["object"] == "chat.completion"
        assert answer.headers["x-kvcm-prefill"] == cluster.prefill.pool_id
        assert http.post("/v1/completions", content=b"not json").status_code == 400
        assert http.post("/v1/completions", json=[1, 2]).status_code == 400
        assert http.get("/healthcheck").json()["decode"] == 2


def test_the_kvcm_pd_proxy_command_serves_and_refuses_bad_flags(
    cluster: _Cluster, server: EmbeddedServer
) -> None:
    import socket
    import subprocess

    cli = [sys.executable, "-m", "kvcm.cli", "pd-proxy", "--grpc-address", server.grpc_address]
    bad = subprocess.run(
        [*cli, "--prefill", "not-a-url", "--decode", "http://127.0.0.1:1=x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2
    assert "--prefill 'not-a-url': expected URL=POOL" in bad.stderr
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engines = [
        *("--prefill", f"{cluster.prefill.url}={cluster.prefill.pool_id}"),
        *(arg for e in cluster.decode for arg in ("--decode", f"{e.url}={e.pool_id}")),
    ]
    process = subprocess.Popen(
        [*cli, "--port", str(port), *engines], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert "kvcm pd-proxy: http://127.0.0.1:" in process.stdout.readline()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0) as http:
            deadline = time.monotonic() + 20
            while True:
                try:
                    assert http.get("/healthcheck").status_code == 200
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            output, headers = _complete(http, list(range(500, 560)), stream=True)
            assert len(output) == 6
            assert headers["x-kvcm-prefill"] == cluster.prefill.pool_id
            assert http.get("/v1/pd/stats").json()["routed_by_kvcm"] == 1
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.mark.parametrize("cluster", ["bidirectional"], indirect=True)
def test_bidirectional_the_prefill_pulls_exactly_what_the_decode_engine_holds(
    cluster: _Cluster,
) -> None:
    """The decode engine answers the blocks it holds after a turn; on the next turn the proxy
    hands the prefill engine those params with kvcm's remote_num_tokens: the prefix of the new
    prompt the held request really holds, not the count the decode engine reported."""
    url = cluster.proxy("kvcm")
    turn1 = list(range(40_000, 40_000 + 6 * BLOCK + 3))
    with httpx.Client(base_url=url, timeout=30.0) as http:
        output, headers = _complete(http, turn1, stream=True)
        decode = next(e for e in cluster.decode if e.pool_id == headers["x-kvcm-decode"])
        # The decode engine holds turn 1 (prompt and output; the last token is not computed).
        held_tokens = len(turn1) + len(output) - 1
        turn2 = [*turn1, *output, *range(70, 90)]
        prefill = cluster.prefill
        before = (prefill.stats.pulled_tokens, prefill.stats.computed_tokens)
        _, headers = _complete(http, turn2, stream=False)
        assert headers["x-kvcm-decode"] == decode.pool_id
        sent = prefill.received[-1]
        assert sent["do_remote_decode"] is True
        assert sent["remote_engine_id"] == decode.name
        exact = min(held_tokens // BLOCK, (len(turn2) - 1) // BLOCK) * BLOCK
        assert sent["remote_num_tokens"] == exact
        own_hit = len(turn1) // BLOCK * BLOCK  # what the prefill engine computed on turn 1
        pulled = prefill.stats.pulled_tokens - before[0]
        assert pulled == exact - own_hit
        assert prefill.stats.computed_tokens - before[1] == len(turn2) - exact
        # A client that rewrote the history after 2 blocks: the decode engine still holds
        # turn 2's blocks, but only 2 of them match; that is what the prefill engine is told.
        edited = [*turn2[: 2 * BLOCK + 5], *range(900, 900 + 3 * BLOCK)]
        _complete(http, edited, stream=False)
        told = prefill.received[-1]
        assert told["remote_engine_id"] == decode.name
        assert told["remote_num_tokens"] == 2 * BLOCK  # the decode engine reported far more
        stats = http.get("/v1/pd/stats").json()
    assert stats["failed"] == 0
    held = _settle(cluster)  # decoder_ttl_s and kv_lease_s pass: every held request freed
    assert all(requests == 0 for requests, _ in held.values()), held
    assert all(blocks == 0 for _, blocks in held.values()), held


def test_without_kvcm_the_proxy_routes_round_robin_and_says_so(cluster: _Cluster) -> None:
    down = Connection(address="127.0.0.1:1", tls=None, token=None, timeout_s=0.5)
    url = cluster.proxy("kvcm", down)
    with httpx.Client(base_url=url, timeout=30.0) as http:
        seen = [
            _complete(http, list(range(i, i + 40)), stream=False)[1]["x-kvcm-decode"]
            for i in range(2)
        ]
        stats = http.get("/v1/pd/stats").json()
    assert seen == [engine.pool_id for engine in cluster.decode]
    assert stats["kvcm_unavailable"] == 2
    assert stats["routed_round_robin"] == 2
    assert stats["failed"] == 0
