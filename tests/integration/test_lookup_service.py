"""Lookup across pools on a real server: gRPC through the SDK, POST /v1/lookup, tokens.

Over 100 pools driven with randomized shared-prefix workloads, every Lookup answer equals what
each pool's own GetComputedBlocks answers for the same prompt, asked over the same server.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from kvcm.client import (
    LookupQuery,
    PermissionDeniedError,
    SchedulerClient,
    ServiceInvalidArgumentError,
    ServiceNotFoundError,
    ServiceResourceExhaustedError,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import HashAlgorithm
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings
from kvcm.v1 import service_pb2_grpc
from kvcm.wire.lookup import lookup_query_to_proto, lookup_result_from_proto

COMMON = {"num_kv_heads": 2, "head_size": 64, "dtype": DType.BFLOAT16}
NUM_POOLS = 120


def _config(specs: list[KVCacheSpec], num_blocks: int, **extra: object) -> PoolConfig:
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=tuple(
            KVCacheGroupSpec(layer_names=(f"l{i}",), kv_cache_spec=spec)
            for i, spec in enumerate(specs)
        ),
    )
    return PoolConfig(max_model_len=1024, explicit_layout=layout, **extra)  # type: ignore[arg-type]


def _full(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, **COMMON)  # type: ignore[arg-type]


def _swa() -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=16, sliding_window=32, **COMMON)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", log_level="WARNING")
    )
    try:
        yield running
    finally:
        running.stop(grace_s=1.0)


def _serve(client: SchedulerClient, pool_id: str, key: int, prompt: list[int]) -> None:
    hashes = client.block_hasher(pool_id).hash_token_ids(prompt)
    client.add_request(pool_id, key, prompt, hashes, request_id=f"r{key}")
    hit = client.get_computed_blocks(pool_id, key)
    blocks = client.allocate_slots(
        pool_id, key, len(prompt) - hit.num_computed_tokens, hit.num_computed_tokens, hit=hit
    )
    if blocks is None or key % 4:  # three in four finish; the rest keep their blocks
        client.free(pool_id, key)


def _own_hit(client: SchedulerClient, pool_id: str, key: int, prompt: list[int]) -> int:
    """The pool's own GetComputedBlocks for the prompt (a probe request, freed again)."""
    hashes = client.block_hasher(pool_id).hash_token_ids(prompt)
    client.add_request(pool_id, key, prompt, hashes, request_id=f"probe{key}")
    try:
        return client.get_computed_blocks(pool_id, key).num_computed_tokens
    finally:
        client.free(pool_id, key)


def test_lookup_equals_each_pools_own_answer_over_120_pools(server: EmbeddedServer) -> None:
    rng = random.Random(5)
    kinds = [
        lambda: _config([_full()], 64),
        lambda: _config([_full()], 12),  # small: evicts constantly
        lambda: _config([_full()], 64, hash_algorithm=HashAlgorithm.XXHASH),
        lambda: _config([_full(), _swa()], 64),  # hybrid: answered by its coordinator
    ]
    documents = [[rng.randrange(30000) for _ in range(rng.randrange(40, 300))] for _ in range(10)]
    pool_ids = [f"lk-{i:03d}" for i in range(NUM_POOLS)]
    with SchedulerClient(server.grpc_address) as client:
        for index, pool_id in enumerate(pool_ids):
            client.create_pool(pool_id, kinds[index % len(kinds)]())
        for key in range(1, 701):
            pool_id = rng.choice(pool_ids)
            document = rng.choice(documents)
            prompt = document[: rng.randrange(1, len(document) + 1)] + [
                rng.randrange(30000) for _ in range(rng.randrange(0, 20))
            ]
            _serve(client, pool_id, key, prompt)
        channel = grpc.insecure_channel(server.grpc_address)
        stub = service_pb2_grpc.LookupServiceStub(channel)  # type: ignore[no-untyped-call]
        for round_ in range(6):
            probe = rng.choice(documents)[: rng.randrange(17, 300)]
            query = LookupQuery(token_ids=probe, pool_ids=pool_ids)
            answer = client.lookup(query)  # the SDK asks for the packed answer
            assert answer.num_pools_in_scope == NUM_POOLS
            assert answer.skipped == ()
            # The unpacked answer (PoolHit messages) is the same answer; best 5 is its head.
            plain = stub.Lookup(lookup_query_to_proto(query, packed=False), timeout=30)
            assert not plain.HasField("packed")
            assert lookup_result_from_proto(plain) == answer
            best = client.lookup(dataclasses.replace(query, max_results=5))
            assert best.pools == answer.pools[:5]
            got = {hit.pool_id: hit.num_hit_tokens for hit in answer.pools}
            expected = {
                pool_id: _own_hit(client, pool_id, 10_000_000 + round_ * 1000 + i, probe)
                for i, pool_id in enumerate(pool_ids)
            }
            assert got == expected
            assert any(expected.values())
            scores = [hit.score for hit in answer.pools]
            assert scores == sorted(scores, reverse=True)
            # Pools deleted and re-created under the same name (maybe of another kind), some
            # blocks evicted by id: the next round's answers must follow.
            for pool_id in rng.sample(pool_ids, 6):
                client.delete_pool(pool_id)
                client.create_pool(pool_id, rng.choice(kinds)())
                for extra in range(3):
                    document = rng.choice(documents)
                    _serve(
                        client,
                        pool_id,
                        20_000_000 + round_ * 100 + extra,
                        document[: rng.randrange(1, len(document) + 1)],
                    )
            for pool_id in rng.sample(pool_ids, 6):
                client.evict_blocks(pool_id, rng.sample(range(1, 12), 4))
        channel.close()


def test_http_lookup_matches_grpc_and_names_bad_fields(server: EmbeddedServer) -> None:
    prompt = list(range(100, 180))
    labels = {"model": "llama", "role": "prefill"}
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("http-a", _config([_full()], 32, labels=labels))
        client.create_pool("http-b", _config([_full()], 32, labels={"model": "llama"}))
        _serve(client, "http-a", 1, prompt)
        grpc_answer = client.lookup(LookupQuery(token_ids=prompt, labels={"model": "llama"}))
    with httpx.Client(base_url=f"http://{server.http_address}", timeout=5.0) as http:
        response = http.post(
            "/v1/lookup",
            json={"tokens": {"token_ids": prompt}, "scope": {"labels": {"model": "llama"}}},
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert [p["pool_id"] for p in body["pools"]] == [h.pool_id for h in grpc_answer.pools]
        assert body["pools"][0]["num_hit_tokens"] == 64
        assert body["pools"][0]["tier_hit_tokens"] == {"GPU": 64}
        assert body["pools"][0]["load"]["num_free_blocks"] == (
            grpc_answer.pools[0].load.num_free_blocks
        )
        assert body["num_pools_in_scope"] == 2
        prefill = http.post(
            "/v1/lookup",
            json={"tokens": {"token_ids": prompt}, "scope": {"labels": {"role": "prefill"}}},
        )
        assert [p["pool_id"] for p in prefill.json()["pools"]] == ["http-a"]
        # Hash prompts travel as base64 (protobuf's JSON mapping for bytes).
        with SchedulerClient(server.grpc_address) as client:
            hashes = client.block_hasher("http-a").hash_token_ids(prompt)
        by_hash = http.post(
            "/v1/lookup",
            json={
                "hashes": {"block_hashes": base64.b64encode(b"".join(hashes)).decode()},
                "scope": {"pool_ids": ["http-a"]},
            },
        )
        assert by_hash.json()["pools"][0]["num_hit_tokens"] == 80
        for payload, status, field in [
            ({}, 400, "prompt"),
            ({"tokens": {"token_ids": []}}, 400, "tokens.token_ids"),
            ({"tokens": {"token_ids": [1]}, "load_weight": -2}, 400, "load_weight"),
            ({"tokens": {"token_ids": [1]}, "bogus": 1}, 400, "bogus"),
            ({"tokens": {"token_ids": [1]}, "scope": {"pool_ids": ["nope"]}}, 404, "pool_ids"),
        ]:
            bad = http.post("/v1/lookup", json=payload)
            assert bad.status_code == status, (payload, bad.text)
            assert field in bad.json()["error"]["message"]
        not_json = http.post("/v1/lookup", content=b"{not json")
        assert not_json.status_code == 400
        assert not_json.json()["error"]["code"] == "INVALID_ARGUMENT"


def test_grpc_lookup_errors_name_the_field(server: EmbeddedServer) -> None:
    with SchedulerClient(server.grpc_address) as client:
        with pytest.raises(ServiceNotFoundError, match=r"scope.pool_ids\[0\]"):
            client.lookup(LookupQuery(token_ids=[1, 2], pool_ids=["missing-pool"]))
        request_bad = LookupQuery(token_ids=[1], labels={"ok": "v"})
        assert client.lookup(request_bad).pools == ()
        # A raw request the SDK would refuse: the server checks it too.
        from kvcm.v1 import lookup_pb2, service_pb2_grpc

        stub = service_pb2_grpc.LookupServiceStub(client._channel)  # type: ignore[no-untyped-call]
        with pytest.raises(Exception, match="prompt") as caught:
            stub.Lookup(lookup_pb2.LookupRequest(), timeout=5)
        assert "INVALID_ARGUMENT" in str(caught.value)
        with pytest.raises(ServiceInvalidArgumentError, match="load_weight"):
            client._unary(
                "Lookup",
                stub.Lookup,
                lookup_pb2.LookupRequest(
                    tokens=lookup_pb2.TokenPrompt(token_ids=[1]), load_weight=float("inf")
                ),
                5.0,
            )


def _token_file(path: Path, tokens: dict[str, tuple[str, list[str]]]) -> None:
    lines = []
    for token, (name, roles) in tokens.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        quoted = ", ".join(f'"{role}"' for role in roles)
        lines += ["[[tokens]]", f'name = "{name}"', f'sha256 = "{digest}"', f"roles = [{quoted}]"]
    path.write_text("\n".join(lines) + "\n")


def test_lookup_sees_only_pools_the_token_may_read(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    _token_file(
        tokens,
        {
            "admin": ("ops", ["admin:*"]),
            "router-a": ("router-a", ["reader:team-a-*"]),
        },
    )
    running = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            log_level="WARNING",
            auth_tokens=str(tokens),
        )
    )
    prompt = list(range(64))
    try:
        with SchedulerClient(running.grpc_address, token="admin") as admin:
            for pool_id in ("team-a-0", "team-a-1", "team-b-0"):
                admin.create_pool(pool_id, _config([_full()], 16))
                _serve(admin, pool_id, 4, prompt)
            assert len(admin.lookup(LookupQuery(token_ids=prompt)).pools) == 3
        with SchedulerClient(running.grpc_address, token="router-a") as router:
            answer = router.lookup(LookupQuery(token_ids=prompt))
            assert sorted(hit.pool_id for hit in answer.pools) == ["team-a-0", "team-a-1"]
            assert answer.num_pools_in_scope == 2
            with pytest.raises(PermissionDeniedError, match="team-b-0"):
                router.lookup(LookupQuery(token_ids=prompt, pool_ids=["team-a-0", "team-b-0"]))
        with httpx.Client(base_url=f"http://{running.http_address}", timeout=5.0) as http:
            body = {"tokens": {"token_ids": prompt}}
            assert http.post("/v1/lookup", json=body).status_code == 401
            wrong = http.post("/v1/lookup", json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            seen = http.post("/v1/lookup", json=body, headers={"Authorization": "Bearer router-a"})
            assert seen.status_code == 200
            assert sorted(p["pool_id"] for p in seen.json()["pools"]) == ["team-a-0", "team-a-1"]
            denied = http.post(
                "/v1/lookup",
                json={**body, "scope": {"pool_ids": ["team-b-0"]}},
                headers={"Authorization": "Bearer router-a"},
            )
            assert denied.status_code == 403
            assert denied.json()["error"]["code"] == "PERMISSION_DENIED"
    finally:
        running.stop(grace_s=1.0)


def test_long_prompts_over_many_seeds_are_hashed_off_the_loop(server: EmbeddedServer) -> None:
    """xxhash pools each draw their own seed, so a prompt is hashed once per pool: past
    OFF_LOOP_HASH_BLOCKS blocks that runs in a worker thread; the answer is the same."""
    from kvcm.core.lookup import hashing_work
    from kvcm.core.pool import PoolRegistry
    from kvcm.server.rpc import lookup_as
    from kvcm.server.rpc._lookup import OFF_LOOP_HASH_BLOCKS

    rng = random.Random(9)
    prompt = [rng.randrange(30000) for _ in range(4000)]
    config = _config([_full()], 300, hash_algorithm=HashAlgorithm.XXHASH)
    pool_ids = [f"seeded-{i}" for i in range(20)]
    with SchedulerClient(server.grpc_address) as client:
        for index, pool_id in enumerate(pool_ids):
            client.create_pool(pool_id, dataclasses.replace(config, max_model_len=8192))
            _serve(client, pool_id, 4, prompt[: 500 + 150 * index])
        registry: PoolRegistry = server.server.state.registry
        query = LookupQuery(token_ids=prompt, pool_ids=pool_ids)
        assert hashing_work(registry.scope(query), query) >= OFF_LOOP_HASH_BLOCKS
        answer = client.lookup(query)
        expected = {
            pool_id: _own_hit(client, pool_id, 100 + i, prompt)
            for i, pool_id in enumerate(pool_ids)
        }
    assert {hit.pool_id: hit.num_hit_tokens for hit in answer.pools} == expected
    assert len(set(expected.values())) > 10  # every pool holds a different prefix
    # A 4M-token prompt over those 20 seeds would take 5M block hashes: refused up front.
    with SchedulerClient(server.grpc_address) as client:
        long_pools = [f"long-{i}" for i in range(5)]
        for pool_id in long_pools:
            client.create_pool(pool_id, dataclasses.replace(config, max_model_len=1 << 22))
        with pytest.raises(ServiceResourceExhaustedError, match="narrow the scope"):
            client.lookup(LookupQuery(token_ids=[1] * (1 << 22), pool_ids=long_pools))
    # The same through the coroutine itself, on a registry the server does not run.
    assert asyncio.run(lookup_as(PoolRegistry(), LookupQuery(token_ids=[1]), None)).pools == ()


def test_a_large_pool_is_indexed_off_the_loop_at_its_first_lookup(server: EmbeddedServer) -> None:
    """A pool caching OFF_LOOP_INDEX_BLOCKS blocks or more is indexed at its first lookup in a
    worker thread holding the pool (lent, as for a lane: calls on it wait), then answers
    exactly, through the coroutine and over gRPC."""
    from kvcm.server.rpc import lookup_as
    from kvcm.server.rpc._lookup import OFF_LOOP_INDEX_BLOCKS

    rng = random.Random(26)
    num_blocks = OFF_LOOP_INDEX_BLOCKS + 64
    prompt = [rng.randrange(30000) for _ in range(num_blocks * 16 + 5)]
    config = dataclasses.replace(_config([_full()], num_blocks + 8), max_model_len=len(prompt))
    state = server.server.state
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("indexed-off-loop", config)
        _serve(client, "indexed-off-loop", 1, prompt)
        pool = state.registry.get("indexed-off-loop")
        assert pool.manager is not None
        assert pool.manager.block_pool.num_cached_blocks >= OFF_LOOP_INDEX_BLOCKS
        hashes = client.block_hasher("indexed-off-loop").hash_token_ids(prompt)
        query = LookupQuery(
            block_hashes=b"".join(hashes), num_tokens=len(prompt), pool_ids=["indexed-off-loop"]
        )

        async def first_lookup() -> tuple[tuple[bool, bool, int], object, tuple[bool, bool, int]]:
            index = state.registry.index
            before = index.num_pools
            task = asyncio.ensure_future(lookup_as(state.registry, query, None, state=state))
            await asyncio.sleep(0)  # the lookup runs until the indexing thread is started
            during = (pool.lent, "indexed-off-loop" in state.lanes, index.num_pools - before)
            answer = await task
            after = (pool.lent, "indexed-off-loop" in state.lanes, index.num_pools - before)
            return during, answer, after

        during, answer, after = server.call(first_lookup())
        assert during == (True, True, 0)  # lent to the thread, not answered from the index yet
        assert after == (False, False, 1)
        expected = _own_hit(client, "indexed-off-loop", 2, prompt)
        assert expected == num_blocks * 16
        assert [hit.num_hit_tokens for hit in answer.pools] == [expected]  # type: ignore[attr-defined]
        assert [hit.num_hit_tokens for hit in client.lookup(query).pools] == [expected]
        client.delete_pool("indexed-off-loop")
