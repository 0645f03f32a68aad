"""Cluster-wide reads over HTTP and the SDK's missing replicas, on a real etcd and three
``kvcm serve`` replicas (issue 31: "an answer that misses a replica says so").

* ``POST /v1/lookup`` through any replica equals the merge of every pool's own answer (each
  asked at its owner, alone in scope) and the gRPC ``Lookup``'s answer through that replica;
  ``POST /v1/pd/route`` equals the gRPC ``RoutePd``; ``GET /v1/pools`` lists every replica's
  pools, each summary as its owner shows it; all say ``replicas: 3``, ``missing_replicas: []``;
* a per-pool read on a replica that does not serve the pool is redirected (307) to the
  owner's HTTP side;
* ``GET /v1/transfers`` (and the gRPC ``ListTransfers``) of every pool lists every
  replica's transfers in one server's order;
* with one replica SIGSTOPped, every cluster-wide read (HTTP, and the SDK's ``lookup``,
  ``route_pd`` and ``list_pools``, sync and async) is answered within the fan-out deadline
  and names the stopped replica, and the other replicas' pools are all there.

The replicas' etcd leases are long (15 s) so the stopped one stays a member while stopped.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _cluster import Etcd, Replica, running, wait_for_members
from google.protobuf import json_format

from kvcm.client import (
    AsyncSchedulerClient,
    ItemStatus,
    LookupQuery,
    SchedulerClient,
    StepBuilder,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.lookup import LookupAnswer
from kvcm.core.pd_route import PdRouteQuery, PdScope
from kvcm.core.pool import PoolConfig
from kvcm.wire.lookup import lookup_query_to_proto, lookup_result_to_json
from kvcm.wire.pd import pd_route_query_to_proto, pd_route_to_json

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=64,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)
CONFIG = PoolConfig(max_model_len=1024, explicit_layout=LAYOUT)
NUM_POOLS = 6
FANOUT_TIMEOUT_S = 1.0  # the harness's --cluster-fanout-timeout-s
PROMPT = tuple(range(96))


@pytest.fixture(scope="module")
def cluster(etcd: Etcd) -> Iterator[list[Replica]]:
    """Three replicas whose leases outlast a short SIGSTOP."""
    prefix = f"/kvcm-fanout-http-{os.getpid()}"
    replicas = [Replica(etcd, prefix, lease_ttl_s=15) for _ in range(3)]
    with running(replicas, stop_signal=signal.SIGTERM) as started:
        yield started


def _seeds(replicas: list[Replica]) -> str:
    return ",".join(replica.address for replica in replicas)


@pytest.fixture(scope="module")
def pools(cluster: list[Replica]) -> dict[str, str]:
    """NUM_POOLS pools with a few cached prompts each (shared prefixes, so several pools hit):
    pool id -> the replica that serves it (where ``describe_pool`` was answered)."""
    names = [f"fh-{i}" for i in range(NUM_POOLS)]
    rng = random.Random(31)
    with SchedulerClient(_seeds(cluster), timeout=10.0) as client:
        for name in names:
            client.create_pool(name, CONFIG)
        for index, name in enumerate(names):
            hasher = client.block_hasher(name)
            for key in range(3):
                prompt = [rng.randrange(1000) for _ in range(16 * rng.randrange(1, 5))]
                if key == 1:
                    prompt = list(range(32 + 16 * (index % 4)))
                step = StepBuilder()
                step.add_request(key, prompt, hasher.hash_token_ids(prompt), request_id=f"{key}")
                step.allocate(key, len(prompt), 0, lookup=True)
                step.cache_blocks(key, len(prompt))
                assert client.step(name, step).statuses == [ItemStatus.OK]
    owners = {}
    for replica in cluster:  # each replica's own pools, asked alone (no fan-out)
        answer = httpx.get(f"{_http(replica)}/v1/pools", headers={"kvcm-cluster-local": "1"})
        owners.update({pool["name"]: replica.address for pool in answer.json()["pools"]})
    assert sorted(owners) == names
    assert len(set(owners.values())) == 3, f"pools on every replica: {owners}"
    return owners


def _http(replica: Replica) -> str:
    return f"http://127.0.0.1:{replica.http_port}"


def _body(message: Any) -> dict[str, Any]:
    document: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return document


def _own_merge(cluster: list[Replica], pools: dict[str, str]) -> list[tuple[str, int]]:
    """Every pool asked alone at its owner, ranked by the core's key (score, waiting, usage,
    id): the cluster answer a single server holding every pool gives."""
    rows = []
    with SchedulerClient(_seeds(cluster), timeout=5.0) as client:
        for name in pools:
            (hit,) = client.lookup(LookupQuery(token_ids=PROMPT, pool_ids=(name,))).pools
            rows.append(
                (-hit.score, hit.load.num_waiting, hit.load.usage, name, hit.num_hit_tokens)
            )
    rows.sort()
    assert any(row[4] for row in rows), "the shared prefixes make hits"
    return [(row[3], row[4]) for row in rows]


def _fanned(response: httpx.Response, asked: int, missing: list[str]) -> dict[str, Any]:
    """The answer's body, checked to say it asked ``asked`` replicas and missed ``missing``."""
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert (body.pop("replicas"), body.pop("missing_replicas")) == (asked, missing)
    assert response.headers["kvcm-replicas"] == str(asked)
    assert response.headers.get("kvcm-missing-replicas", "") == ",".join(missing)
    return body


def test_http_lookup_through_any_replica_equals_the_merge_of_every_pools_own_answer(
    cluster: list[Replica], pools: dict[str, str]
) -> None:
    expected = _own_merge(cluster, pools)
    queries = [
        LookupQuery(token_ids=PROMPT),
        LookupQuery(token_ids=PROMPT, max_results=3),
        LookupQuery(token_ids=PROMPT, pool_ids=tuple(sorted(pools))[::2]),
    ]
    for replica in cluster:
        with SchedulerClient(replica.address, timeout=5.0) as client:
            for query in queries:
                body = _fanned(
                    httpx.post(
                        f"{_http(replica)}/v1/lookup", json=_body(lookup_query_to_proto(query))
                    ),
                    3,
                    [],
                )
                grpc_answer = client.lookup(query)
                assert grpc_answer.missing_replicas == ()
                # The HTTP answer is the gRPC answer, field for field.
                assert body == lookup_result_to_json(grpc_answer)
                ranked = [(hit["pool_id"], hit["num_hit_tokens"]) for hit in body["pools"]]
                wanted = [row for row in expected if not query.pool_ids or row[0] in query.pool_ids]
                assert ranked == wanted[: query.max_results or None]
                assert body["num_pools_in_scope"] == len(query.pool_ids or pools)


def test_http_pd_route_and_pool_listing_through_any_replica_merge_every_replica(
    cluster: list[Replica], pools: dict[str, str]
) -> None:
    names = sorted(pools)
    query = PdRouteQuery(
        prompt=LookupQuery(token_ids=PROMPT, max_results=2),
        prefill=PdScope(pool_ids=tuple(names[:3])),
        decode=PdScope(pool_ids=tuple(names[3:])),
    )
    local = {}  # each replica's own summaries, asked alone
    for replica in cluster:
        answer = httpx.get(f"{_http(replica)}/v1/pools", headers={"kvcm-cluster-local": "1"})
        assert "missing_replicas" not in answer.json()
        local.update({pool["name"]: pool for pool in answer.json()["pools"]})
    assert sorted(local) == names
    for replica in cluster:
        body = _fanned(
            httpx.post(f"{_http(replica)}/v1/pd/route", json=_body(pd_route_query_to_proto(query))),
            3,
            [],
        )
        with SchedulerClient(replica.address, timeout=5.0) as client:
            assert body == pd_route_to_json(client.route_pd(query))
        assert (body["num_prefill_pools_in_scope"], body["num_decode_pools_in_scope"]) == (3, 3)
        listed = _fanned(httpx.get(f"{_http(replica)}/v1/pools"), 3, [])["pools"]
        assert [pool["name"] for pool in listed] == names
        for pool in listed:  # as its owner shows it (no call ran in between)
            assert pool == local[pool["name"]]


def test_a_per_pool_read_elsewhere_is_redirected_to_the_owners_http_side(
    cluster: list[Replica], pools: dict[str, str]
) -> None:
    by_address = {replica.address: replica for replica in cluster}
    name, owner_address = sorted(pools.items())[0]
    owner = by_address[owner_address]
    other = next(replica for replica in cluster if replica is not owner)
    for path in (f"/v1/pools/{name}", f"/v1/pools/{name}/events", f"/v1/transfers?pool={name}"):
        answer = httpx.get(f"{_http(other)}{path}")
        assert answer.status_code == 307, answer.text
        assert answer.headers["location"] == f"{_http(owner)}{path}"
        assert answer.headers["kvcm-owner"] == owner_address
        assert answer.json()["error"]["code"] == "FAILED_PRECONDITION"
        followed = httpx.get(f"{_http(other)}{path}", follow_redirects=True)
        assert followed.status_code == 200, followed.text
        assert followed.json() == httpx.get(f"{_http(owner)}{path}").json()
    assert httpx.get(f"{_http(owner)}/v1/pools/{name}").json()["name"] == name
    missing = httpx.get(f"{_http(other)}/v1/pools/no-such-pool")  # unplaced: answered here
    assert missing.status_code == 404


def test_the_transfer_listing_of_every_pool_through_any_replica_merges_every_replica(
    cluster: list[Replica], pools: dict[str, str]
) -> None:
    names = sorted(pools)
    with SchedulerClient(_seeds(cluster), timeout=10.0) as client:
        for name in names:  # one transfer held per pool, on every replica
            client.hold_source(name, f"t-{name}", 0, lease_s=600)
        for name in names[::2]:  # half of them ended, one after the other
            client.release_transfer(name, f"t-{name}", "test")
    # As one server orders them: in flight oldest first, then ended latest first.
    held = [f"t-{name}" for name in names[1::2]]
    expected = held + [f"t-{name}" for name in reversed(names[::2])]
    for replica in cluster:
        with SchedulerClient(replica.address, timeout=5.0) as client:
            listed = client.list_transfers()
        assert [t.transfer_id for t in listed] == expected
        assert listed.missing_replicas == ()
        body = _fanned(httpx.get(f"{_http(replica)}/v1/transfers"), 3, [])
        assert [t["transfer_id"] for t in body["transfers"]] == expected
        only = _fanned(httpx.get(f"{_http(replica)}/v1/transfers?state=HELD"), 3, [])
        assert [t["transfer_id"] for t in only["transfers"]] == held
        assert {t["state"] for t in only["transfers"]} == {"TRANSFER_STATE_HELD"}
    bad = httpx.get(f"{_http(cluster[0])}/v1/transfers?state=LOST")
    assert bad.status_code == 400
    assert bad.json()["error"]["message"].startswith("state: 'LOST'")


def test_with_a_replica_stopped_every_cluster_read_comes_in_time_and_names_it(
    cluster: list[Replica], pools: dict[str, str]
) -> None:
    victim = cluster[2]
    asked = cluster[0]
    kept = sorted(name for name, owner in pools.items() if owner != victim.address)
    assert 0 < len(kept) < len(pools)
    names = sorted(pools)
    pd_query = PdRouteQuery(
        prompt=LookupQuery(token_ids=PROMPT),
        prefill=PdScope(pool_ids=tuple(names[:3])),
        decode=PdScope(pool_ids=tuple(names[3:])),
    )
    lookup = _body(lookup_query_to_proto(LookupQuery(token_ids=PROMPT)))
    with SchedulerClient(_seeds(cluster), timeout=10.0) as client:
        transfers = sorted(t.transfer_id for t in client.list_transfers())
    kept_transfers = [f"t-{name}" for name in kept]
    assert set(kept_transfers) < set(transfers)

    async def ask_everything() -> dict[str, tuple[float, Any]]:
        async def timed(name: str, call: Any) -> tuple[str, tuple[float, Any]]:
            started = time.monotonic()
            result = await call
            return name, (time.monotonic() - started, result)

        async with (
            httpx.AsyncClient(base_url=_http(asked), timeout=10) as http,
            AsyncSchedulerClient(asked.address, timeout=10) as sdk,
        ):
            sync = SchedulerClient(asked.address, timeout=10)
            try:
                calls = {
                    "http lookup": http.post("/v1/lookup", json=lookup),
                    "http pd": http.post(
                        "/v1/pd/route", json=_body(pd_route_query_to_proto(pd_query))
                    ),
                    "http pools": http.get("/v1/pools"),
                    "http transfers": http.get("/v1/transfers"),
                    "async lookup": sdk.lookup(LookupQuery(token_ids=PROMPT)),
                    "async pd": sdk.route_pd(pd_query),
                    "async pools": sdk.list_pools(),
                    "async transfers": sdk.list_transfers(),
                    "sync lookup": asyncio.to_thread(sync.lookup, LookupQuery(token_ids=PROMPT)),
                    "sync pd": asyncio.to_thread(sync.route_pd, pd_query),
                    "sync pools": asyncio.to_thread(sync.list_pools),
                    "sync transfers": asyncio.to_thread(sync.list_transfers),
                }
                done = await asyncio.gather(*(timed(k, v) for k, v in calls.items()))
            finally:
                sync.close()
        return dict(done)

    assert victim.process is not None
    victim.process.send_signal(signal.SIGSTOP)
    try:
        answers = asyncio.run(ask_everything())
    finally:
        victim.process.send_signal(signal.SIGCONT)
    missing = [victim.address]
    print("answered with a replica stopped:", {k: round(v[0], 2) for k, v in answers.items()})
    for name, (elapsed_s, _) in answers.items():
        # Each fan-out waits at most the deadline (RoutePd's two roles at once) plus slack
        # for a loaded 2-core machine.
        assert elapsed_s < FANOUT_TIMEOUT_S + 2.0, (name, elapsed_s)
    body = _fanned(answers["http lookup"][1], 3, missing)
    assert sorted(hit["pool_id"] for hit in body["pools"]) == kept
    assert body["num_pools_in_scope"] == len(kept)
    pd_body = _fanned(answers["http pd"][1], 3, missing)
    assert {hit["pool_id"] for hit in pd_body["prefill"] + pd_body["decode"]} <= set(kept)
    listed = _fanned(answers["http pools"][1], 3, missing)["pools"]
    assert [pool["name"] for pool in listed] == kept
    moved = _fanned(answers["http transfers"][1], 3, missing)["transfers"]
    assert sorted(t["transfer_id"] for t in moved) == kept_transfers
    for flavor in ("async", "sync"):
        found: LookupAnswer = answers[f"{flavor} lookup"][1]
        assert found.missing_replicas == (victim.address,), flavor
        assert sorted(hit.pool_id for hit in found.pools) == kept
        assert answers[f"{flavor} pd"][1].missing_replicas == (victim.address,), flavor
        listing = answers[f"{flavor} pools"][1]
        assert listing.missing_replicas == (victim.address,), flavor
        assert [pool.pool_id for pool in listing] == kept
        moved_too = answers[f"{flavor} transfers"][1]
        assert moved_too.missing_replicas == (victim.address,), flavor
        assert sorted(t.transfer_id for t in moved_too) == kept_transfers
    # Back: the next answers miss nobody.
    deadline = time.monotonic() + 10
    while True:
        with SchedulerClient(asked.address, timeout=5.0) as client:
            again = client.lookup(LookupQuery(token_ids=PROMPT))
        if not again.missing_replicas:
            break
        assert time.monotonic() < deadline, again.missing_replicas
        time.sleep(0.1)
    assert sorted(hit.pool_id for hit in again.pools) == names
    wait_for_members(cluster, 3)
