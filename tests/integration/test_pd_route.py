"""The P/D routing call on a real server: RoutePd through the SDK, POST /v1/pd/route, auth,
bad input, metrics.

Every answer is checked against each pool's own GetComputedBlocks for the same prompt (asked
over the same server) and the documented scoring, computed here from those hits and loads.
"""

from __future__ import annotations

import base64
import hashlib
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvcm.client import (
    HeldRequest,
    LookupQuery,
    PdRoute,
    PdRouteQuery,
    PdScope,
    PermissionDeniedError,
    SchedulerClient,
    ServiceNotFoundError,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

BLOCK = 16


def _config(num_blocks: int, role: str) -> PoolConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=spec),),
    )
    return PoolConfig(
        max_model_len=2048, explicit_layout=layout, labels={"model": "m", "role": role}
    )


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", log_level="WARNING")
    )
    try:
        yield running
    finally:
        running.stop(grace_s=1.0)


def _serve(client: SchedulerClient, pool_id: str, key: int, prompt: list[int], keep: bool) -> None:
    hashes = client.block_hasher(pool_id).hash_token_ids(prompt)
    client.add_request(pool_id, key, prompt, hashes, request_id=f"r{key}")
    hit = client.get_computed_blocks(pool_id, key)
    blocks = client.allocate_slots(
        pool_id, key, len(prompt) - hit.num_computed_tokens, hit.num_computed_tokens, hit=hit
    )
    if blocks is None or not keep:
        client.free(pool_id, key)


def _own_hit(client: SchedulerClient, pool_id: str, prompt: list[int]) -> int:
    key = 999_999
    hashes = client.block_hasher(pool_id).hash_token_ids(prompt)
    client.add_request(pool_id, key, prompt, hashes, request_id="probe")
    try:
        return client.get_computed_blocks(pool_id, key).num_computed_tokens
    finally:
        client.free(pool_id, key)


def _expected(
    client: SchedulerClient,
    prompt: list[int],
    prefill: list[str],
    decode: list[str],
    weight: float,
    bidirectional: bool,
) -> tuple[list[str], list[str], int, int]:
    """Both rankings and (decode hit, remote_num_tokens), from each pool's own answers."""
    usage = {hit.pool_id: hit.load for hit in client.lookup(LookupQuery(token_ids=prompt)).pools}
    hits = {pool_id: _own_hit(client, pool_id, prompt) for pool_id in prefill + decode}
    n = len(prompt)

    def decode_key(pool_id: str) -> tuple[float, int, float, str]:
        load = usage[pool_id]
        return (-(hits[pool_id] / n - weight * load.usage), load.num_waiting, load.usage, pool_id)

    decode_ranked = sorted(decode, key=decode_key)
    credit = hits[decode_ranked[0]] if bidirectional else 0

    def prefill_key(pool_id: str) -> tuple[float, int, int, float, str]:
        load = usage[pool_id]
        score = max(hits[pool_id], credit) / n - weight * load.usage
        return (-score, -hits[pool_id], load.num_waiting, load.usage, pool_id)

    return sorted(prefill, key=prefill_key), decode_ranked, hits[decode_ranked[0]], credit


def test_route_ranks_both_roles_as_each_pools_own_hits_say(server: EmbeddedServer) -> None:
    rng = random.Random(11)
    prefill = [f"rt-p{i}" for i in range(3)]
    decode = [f"rt-d{i}" for i in range(4)]
    documents = [[rng.randrange(30000) for _ in range(rng.randrange(64, 400))] for _ in range(6)]
    with SchedulerClient(server.grpc_address) as client:
        for pool_id in prefill:
            client.create_pool(pool_id, _config(128, "prefill"))
        for pool_id in decode:
            client.create_pool(pool_id, _config(96, "decode"))
        for key in range(1, 61):
            pool_id = rng.choice(prefill + decode)
            document = rng.choice(documents)
            prompt = document[: rng.randrange(1, len(document) + 1)]
            _serve(client, pool_id, key, prompt, keep=rng.random() < 0.2)
        checked = 0
        for round_ in range(12):
            document = rng.choice(documents)
            prompt = [*document[: rng.randrange(17, len(document) + 1)], rng.randrange(30000)]
            weight = rng.choice([0.0, 0.5, 3.0])
            bidirectional = round_ % 2 == 1
            query = PdRouteQuery(
                prompt=LookupQuery(token_ids=prompt, load_weight=weight),
                prefill=PdScope(labels={"role": "prefill"}),
                decode=PdScope(pool_ids=decode),
                bidirectional=bidirectional,
            )
            route = client.route_pd(query)
            want_p, want_d, decode_hit, credit = _expected(
                client, prompt, prefill, decode, weight, bidirectional
            )
            assert [hit.pool_id for hit in route.prefill] == want_p
            assert [hit.pool_id for hit in route.decode] == want_d
            assert route.num_tokens == len(prompt)
            assert route.decode_hit_tokens == decode_hit == route.decode[0].num_hit_tokens
            assert route.decode_pull_tokens == len(prompt) - decode_hit
            assert route.remote_num_tokens == credit
            best_p = route.prefill[0].num_hit_tokens
            assert route.prefill_compute_tokens == len(prompt) - max(best_p, credit)
            assert (route.num_prefill_pools_in_scope, route.num_decode_pools_in_scope) == (3, 4)
            checked += route.decode_hit_tokens > 0
            # The HTTP twin answers the same.
            with httpx.Client(base_url=f"http://{server.http_address}", timeout=10.0) as http:
                body = {
                    "tokens": {"token_ids": prompt},
                    "prefill_scope": {"labels": {"role": "prefill"}},
                    "decode_scope": {"pool_ids": decode},
                    "load_weight": weight,
                    "bidirectional": bidirectional,
                }
                answer = http.post("/v1/pd/route", json=body)
                assert answer.status_code == 200, answer.text
                document_ = answer.json()
                assert [p["pool_id"] for p in document_["prefill"]] == want_p
                assert [p["pool_id"] for p in document_["decode"]] == want_d
                assert document_["remote_num_tokens"] == credit
                assert document_["decode_hit_tokens"] == decode_hit
        assert checked >= 3  # the workload gives decode pools real hits


def test_the_decode_engine_holding_the_conversation_wins_and_bidirectional_credit(
    server: EmbeddedServer,
) -> None:
    with SchedulerClient(server.grpc_address) as client:
        for pool_id in ("cv-p0", "cv-p1"):
            client.create_pool(pool_id, _config(64, "cv-prefill"))
        for pool_id in ("cv-d0", "cv-d1"):
            client.create_pool(pool_id, _config(64, "cv-decode"))
        turn1 = list(range(5000, 5000 + 10 * BLOCK + 3))
        _serve(client, "cv-d1", 1, turn1, keep=False)  # decode-1 served turn 1
        _serve(client, "cv-p1", 2, turn1[: 4 * BLOCK], keep=False)  # p1 holds 4 blocks
        turn2 = turn1 + list(range(9000, 9040))
        query = PdRouteQuery(
            prompt=LookupQuery(token_ids=turn2, load_weight=0.0),
            prefill=PdScope(labels={"role": "cv-prefill"}),
            decode=PdScope(labels={"role": "cv-decode"}),
        )
        route = client.route_pd(query)
        assert route.decode[0].pool_id == "cv-d1"
        assert route.decode_hit_tokens == 10 * BLOCK
        assert route.decode_pull_tokens == len(turn2) - 10 * BLOCK
        assert route.prefill[0].pool_id == "cv-p1"
        assert route.remote_num_tokens == 0
        assert route.prefill_compute_tokens == len(turn2) - 4 * BLOCK
        both = client.route_pd(PdRouteQuery(**{**_fields(query), "bidirectional": True}))
        assert both.remote_num_tokens == 10 * BLOCK
        # Both prefill engines may pull the 10 blocks: p1 still ranks first on its own hit.
        assert [hit.pool_id for hit in both.prefill] == ["cv-p1", "cv-p0"]
        assert both.prefill[0].score == both.prefill[1].score
        assert both.prefill_compute_tokens == len(turn2) - 10 * BLOCK
        # max_results cuts each role after ranking.
        one = client.route_pd(
            PdRouteQuery(
                **{
                    **_fields(query),
                    "prompt": LookupQuery(token_ids=turn2, load_weight=0.0, max_results=1),
                    "bidirectional": True,
                }
            )
        )
        assert [h.pool_id for h in one.prefill] == ["cv-p1"]
        assert [h.pool_id for h in one.decode] == ["cv-d1"]


def _fields(query: PdRouteQuery) -> dict[str, object]:
    return {
        "prompt": query.prompt,
        "prefill": query.prefill,
        "decode": query.decode,
        "bidirectional": query.bidirectional,
    }


def test_hash_prompts_route_like_token_prompts(server: EmbeddedServer) -> None:
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("hp-p", _config(32, "hp-prefill"))
        client.create_pool("hp-d", _config(32, "hp-decode"))
        prompt = list(range(100, 100 + 5 * BLOCK))
        _serve(client, "hp-d", 1, prompt, keep=False)
        hashes = b"".join(client.block_hasher("hp-d").hash_token_ids(prompt))
        route = client.route_pd(
            PdRouteQuery(
                prompt=LookupQuery(block_hashes=hashes, num_tokens=len(prompt) + 1),
                prefill=PdScope(pool_ids=["hp-p"]),
                decode=PdScope(pool_ids=["hp-d"]),
            )
        )
        assert route.decode_hit_tokens == 5 * BLOCK
        assert route.decode_pull_tokens == 1
        with httpx.Client(base_url=f"http://{server.http_address}", timeout=10.0) as http:
            answer = http.post(
                "/v1/pd/route",
                json={
                    "hashes": {
                        "block_hashes": base64.b64encode(hashes).decode(),
                        "num_tokens": len(prompt) + 1,
                    },
                    "prefill_scope": {"pool_ids": ["hp-p"]},
                    "decode_scope": {"pool_ids": ["hp-d"]},
                },
            )
            assert answer.json()["decode_hit_tokens"] == 5 * BLOCK


def test_bad_input_names_the_field_and_counts_nothing(server: EmbeddedServer) -> None:
    def scrape() -> str:
        with httpx.Client(base_url=f"http://{server.http_address}", timeout=10.0) as http:
            return http.get("/metrics").text

    def counter(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(name)

    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("bad-p", _config(16, "bad"))
        before = counter(scrape(), "kvcm_pd_routes_total")
        with pytest.raises(ServiceNotFoundError, match=r"decode_scope\.pool_ids\[1\]"):
            client.route_pd(
                PdRouteQuery(
                    prompt=LookupQuery(token_ids=[1, 2, 3]),
                    prefill=PdScope(pool_ids=["bad-p"]),
                    decode=PdScope(pool_ids=["bad-p", "nope"]),
                )
            )
        with pytest.raises(InvalidArgumentError, match="decode_scope is empty"):
            PdRouteQuery(
                prompt=LookupQuery(token_ids=[1]),
                prefill=PdScope(pool_ids=["bad-p"]),
                decode=PdScope(),
            )
        with pytest.raises(InvalidArgumentError, match=r"prefill_scope\.pool_ids\[0\]"):
            PdRouteQuery(
                prompt=LookupQuery(token_ids=[1]),
                prefill=PdScope(pool_ids=[""]),
                decode=PdScope(pool_ids=["bad-p"]),
            )
        assert counter(scrape(), "kvcm_pd_routes_total") == before
        route = client.route_pd(
            PdRouteQuery(
                prompt=LookupQuery(token_ids=list(range(40))),
                prefill=PdScope(pool_ids=["bad-p"]),
                decode=PdScope(pool_ids=["bad-p"]),
            )
        )
        assert isinstance(route, PdRoute)
        text = scrape()
        assert counter(text, "kvcm_pd_routes_total") == before + 1
        assert counter(text, "kvcm_pd_route_prompt_tokens_total") >= 40
    with httpx.Client(base_url=f"http://{server.http_address}", timeout=10.0) as http:
        cases = [
            ({"tokens": {"token_ids": [1]}, "prefill_scope": {"pool_ids": ["bad-p"]}}, 400,
             "decode_scope"),
            ({"prefill_scope": {"pool_ids": ["bad-p"]}, "decode_scope": {"pool_ids": ["bad-p"]}},
             400, "prompt"),
            ({"tokens": {"token_ids": [1]}, "prefill_scope": {"pool_ids": ["x-none"]},
              "decode_scope": {"pool_ids": ["bad-p"]}}, 404, "prefill_scope.pool_ids[0]"),
            ({"tokens": {"token_ids": [1]}, "prefill_scope": {"labels": {"bad key": "v"}},
              "decode_scope": {"pool_ids": ["bad-p"]}}, 400, "prefill_scope.labels"),
            ({"tokens": {"token_ids": [1]}, "prefill_scope": {"pool_ids": ["bad-p"]},
              "decode_scope": {"pool_ids": ["bad-p"]}, "load_weight": -1}, 400, "load_weight"),
            ({"tokens": {"token_ids": [1]}, "nope": 1}, 400, "nope"),
        ]  # fmt: skip
        for body, status, named in cases:
            answer = http.post("/v1/pd/route", json=body)
            assert answer.status_code == status, (body, answer.text)
            assert named in answer.json()["error"]["message"], (named, answer.text)
        not_json = http.post("/v1/pd/route", content=b"\xff")
        assert not_json.status_code == 400
        assert counter(scrape(), "kvcm_pd_routes_total") == before + 1


def _token_file(path: Path, tokens: dict[str, tuple[str, list[str]]]) -> None:
    lines = []
    for token, (name, roles) in tokens.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        quoted = ", ".join(f'"{role}"' for role in roles)
        lines += ["[[tokens]]", f'name = "{name}"', f'sha256 = "{digest}"', f"roles = [{quoted}]"]
    path.write_text("\n".join(lines) + "\n")


def test_route_sees_only_pools_the_token_may_read(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    _token_file(
        tokens,
        {"admin": ("ops", ["admin:*"]), "proxy-a": ("proxy-a", ["reader:team-a-*"])},
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
            admin.create_pool("team-a-p", _config(16, "prefill"))
            admin.create_pool("team-a-d", _config(16, "decode"))
            admin.create_pool("team-b-d", _config(16, "decode"))
            _serve(admin, "team-b-d", 1, prompt, keep=False)
        query = PdRouteQuery(
            prompt=LookupQuery(token_ids=prompt),
            prefill=PdScope(labels={"role": "prefill"}),
            decode=PdScope(labels={"role": "decode"}),
        )
        with SchedulerClient(running.grpc_address, token="proxy-a") as proxy:
            route = proxy.route_pd(query)
            assert [hit.pool_id for hit in route.decode] == ["team-a-d"]  # not team-b's hit
            with pytest.raises(PermissionDeniedError, match=r"decode_scope\.pool_ids"):
                proxy.route_pd(
                    PdRouteQuery(
                        prompt=query.prompt,
                        prefill=query.prefill,
                        decode=PdScope(pool_ids=["team-b-d"]),
                    )
                )
        with httpx.Client(base_url=f"http://{running.http_address}", timeout=5.0) as http:
            body = {
                "tokens": {"token_ids": prompt},
                "prefill_scope": {"labels": {"role": "prefill"}},
                "decode_scope": {"pool_ids": ["team-b-d"]},
            }
            assert http.post("/v1/pd/route", json=body).status_code == 401
            denied = http.post(
                "/v1/pd/route", json=body, headers={"Authorization": "Bearer proxy-a"}
            )
            assert denied.status_code == 403
            assert "decode_scope.pool_ids[0]" in denied.json()["error"]["message"]
    finally:
        running.stop(grace_s=1.0)


def test_a_scope_inside_the_prompt_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="prompt: the scope is given per role"):
        PdRouteQuery(
            prompt=LookupQuery(token_ids=[1], pool_ids=["x"]),
            prefill=PdScope(pool_ids=["a"]),
            decode=PdScope(pool_ids=["b"]),
        )


def test_held_requests_give_the_exact_prefix_the_prefill_may_read(server: EmbeddedServer) -> None:
    """remote_num_tokens with held: what the held request's own blocks hold of the prompt,
    hash by hash, not the decode pool's hit (which other requests' cached blocks may extend)."""
    a, b, c = (list(range(base, base + n * BLOCK)) for base, n in ((100, 3), (900, 3), (5000, 5)))
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("hd-p", _config(64, "hd-prefill"))
        client.create_pool("hd-d", _config(64, "hd-decode"))
        client.create_pool("hd-d2", _config(64, "hd-decode"))

        def hold(key: int, request_id: str, prompt: list[int], keep: bool) -> None:
            hashes = client.block_hasher("hd-d").hash_token_ids(prompt)
            client.add_request("hd-d", key, prompt, hashes, request_id=request_id)
            hit = client.get_computed_blocks("hd-d", key)
            computed = hit.num_computed_tokens
            client.allocate_slots("hd-d", key, len(prompt) - computed, computed, hit=hit)
            if not keep:
                client.free("hd-d", key)

        hold(1, "x", [*a, *b, 1, 2, 3, 4, 5], keep=True)  # held: shares a with the prompt
        hold(2, "y", [*a, *c, 7, 7, 7], keep=False)  # cached, not held: a + c
        prompt = [*a, *c, *range(20)]

        def route(held: list[HeldRequest], bidirectional: bool = True) -> PdRoute:
            return client.route_pd(
                PdRouteQuery(
                    prompt=LookupQuery(token_ids=prompt, load_weight=0.0),
                    prefill=PdScope(pool_ids=["hd-p"]),
                    decode=PdScope(labels={"role": "hd-decode"}),
                    bidirectional=bidirectional,
                    held=held,
                )
            )

        plain = route([])
        assert (plain.decode[0].pool_id, plain.decode_hit_tokens) == ("hd-d", 8 * BLOCK)
        assert plain.remote_num_tokens == 8 * BLOCK  # the pool's hit
        x = route([HeldRequest("hd-d", "x")])
        assert (x.held_request_id, x.remote_num_tokens) == ("x", 3 * BLOCK)
        assert x.prefill_compute_tokens == len(prompt) - 3 * BLOCK
        # y is no longer held (freed); a request on another pool is not the best pool's.
        gone = route([HeldRequest("hd-d", "y"), HeldRequest("hd-d2", "x")])
        assert (gone.held_request_id, gone.remote_num_tokens) == ("", 0)
        assert gone.prefill_compute_tokens == len(prompt)
        hold(3, "z", [*prompt, 99, 98], keep=True)  # holds the whole prompt
        z = route([HeldRequest("hd-d", "x"), HeldRequest("hd-d", "z")])
        assert z.held_request_id == "z"
        assert z.remote_num_tokens == (len(prompt) - 1) // BLOCK * BLOCK  # capped as a hit
        with httpx.Client(base_url=f"http://{server.http_address}", timeout=10.0) as http:
            body = {
                "tokens": {"token_ids": prompt},
                "prefill_scope": {"pool_ids": ["hd-p"]},
                "decode_scope": {"labels": {"role": "hd-decode"}},
                "load_weight": 0,
                "bidirectional": True,
                "held": [{"pool_id": "hd-d", "request_id": "x"}],
            }
            answer = http.post("/v1/pd/route", json=body).json()
            assert (answer["held_request_id"], answer["remote_num_tokens"]) == ("x", 3 * BLOCK)
            refused = http.post("/v1/pd/route", json={**body, "bidirectional": False})
            assert refused.status_code == 400
            assert "held is for bidirectional routes" in refused.json()["error"]["message"]
            empty = http.post(
                "/v1/pd/route", json={**body, "held": [{"pool_id": "hd-d", "request_id": ""}]}
            )
            assert empty.status_code == 400
            assert "held[0].request_id" in empty.json()["error"]["message"]
        with pytest.raises(InvalidArgumentError, match="held is for bidirectional"):
            route([HeldRequest("hd-d", "x")], bidirectional=False)
