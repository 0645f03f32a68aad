"""The HTTP side's cluster-wide reads with bearer tokens on (docs/security.md), on a real etcd
and three ``kvcm serve --auth-tokens`` replicas.

A fanned-out read is authorized on every replica for the caller's own token (forwarded with
each part): a reader limited to some pools gets exactly those pools of every replica, a scope
naming a pool it may not read is 403 even when that pool lives on another replica, and a
read without a token is 401 before anything is asked. A per-pool read's redirect is answered
only to a valid token, and the token sent again to ``Location`` reads the pool there.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _cluster import Etcd, Replica
from google.protobuf import json_format

from kvcm.client import LookupQuery, SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.wire.lookup import lookup_query_to_proto

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=16,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)
CONFIG = PoolConfig(max_model_len=1024, explicit_layout=LAYOUT)
TOKENS = {
    "ops-secret": ("ops", "admin:*"),
    "router-secret": ("router", "reader:pub-*"),
}
POOLS = ["pub-0", "priv-0", "pub-1", "priv-1", "pub-2", "priv-2"]
PUBLIC = sorted(name for name in POOLS if name.startswith("pub-"))
OPS = {"authorization": "Bearer ops-secret"}
ROUTER = {"authorization": "Bearer router-secret"}


def _start(replicas: list[Replica]) -> None:
    for replica in replicas:
        replica.spawn()
    deadline = time.monotonic() + 60
    for replica in replicas:
        with SchedulerClient(replica.address, timeout=2.0, token="ops-secret") as client:
            while True:
                try:
                    client.list_pools()
                    break
                except Exception:
                    assert replica.process is not None
                    assert replica.process.poll() is None, "kvcm serve exited"
                    assert time.monotonic() < deadline, "kvcm serve did not come up"
                    time.sleep(0.05)
    for replica in replicas:  # every replica sees the three
        while "kvcm_cluster_replicas 3.0" not in httpx.get(_metrics(replica), headers=OPS).text:
            assert time.monotonic() < deadline, f"{replica.address} never saw 3 replicas"
            time.sleep(0.05)


def _metrics(replica: Replica) -> str:
    return f"{_http(replica)}/metrics"


def _http(replica: Replica) -> str:
    return f"http://127.0.0.1:{replica.http_port}"


@pytest.fixture(scope="module")
def cluster(etcd: Etcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Three replicas with bearer tokens on, and POOLS created through the first."""
    lines = []
    for token, (name, role) in TOKENS.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        lines.append(f'[[tokens]]\nname = "{name}"\nsha256 = "{digest}"\nroles = ["{role}"]\n')
    tokens = Path(tmp_path_factory.mktemp("tokens")) / "tokens.toml"
    tokens.write_text("\n".join(lines), encoding="utf-8")
    started = [Replica(etcd, f"/kvcm-fanout-auth-{os.getpid()}") for _ in range(3)]
    saved = os.environ.get("KVCM_AUTH_TOKENS")
    os.environ["KVCM_AUTH_TOKENS"] = str(tokens)  # the replicas' spawn copies the environment
    try:
        _start(started)
        with SchedulerClient(
            ",".join(r.address for r in started), timeout=10.0, token="ops-secret"
        ) as client:
            for name in POOLS:
                client.create_pool(name, CONFIG)
        yield started
    finally:
        if saved is None:
            os.environ.pop("KVCM_AUTH_TOKENS", None)
        else:
            os.environ["KVCM_AUTH_TOKENS"] = saved
        for replica in started:
            replica.stop()


def _owners(cluster: list[Replica]) -> dict[str, Replica]:
    owners = {}
    for replica in cluster:
        local = httpx.get(
            f"{_http(replica)}/v1/pools", headers={**OPS, "kvcm-cluster-local": "1"}
        ).json()
        owners.update({pool["name"]: replica for pool in local["pools"]})
    assert sorted(owners) == sorted(POOLS)
    assert len({id(owners[name]) for name in PUBLIC}) >= 2, "readable pools on several replicas"
    return owners


def _lookup(query: LookupQuery) -> dict[str, Any]:
    body: dict[str, Any] = json_format.MessageToDict(
        lookup_query_to_proto(query), preserving_proto_field_name=True
    )
    return body


def test_a_limited_token_reads_exactly_its_pools_of_every_replica(cluster: list[Replica]) -> None:
    _owners(cluster)
    prompt = LookupQuery(token_ids=tuple(range(64)))
    for replica in cluster:
        url = _http(replica)
        answer = httpx.post(f"{url}/v1/lookup", json=_lookup(prompt), headers=ROUTER)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert (body["replicas"], body["missing_replicas"]) == (3, [])
        assert sorted(hit["pool_id"] for hit in body["pools"]) == PUBLIC
        everything = httpx.post(f"{url}/v1/lookup", json=_lookup(prompt), headers=OPS).json()
        assert sorted(hit["pool_id"] for hit in everything["pools"]) == sorted(POOLS)
        listed = httpx.get(f"{url}/v1/pools", headers=ROUTER).json()
        assert [pool["name"] for pool in listed["pools"]] == PUBLIC
        assert httpx.get(f"{url}/v1/transfers", headers=ROUTER).json()["missing_replicas"] == []
        with SchedulerClient(replica.address, timeout=5.0, token="router-secret") as client:
            assert sorted(hit.pool_id for hit in client.lookup(prompt).pools) == PUBLIC
            assert [pool.pool_id for pool in client.list_pools()] == PUBLIC


def test_a_scope_naming_an_unreadable_pool_elsewhere_is_403_and_no_token_is_401(
    cluster: list[Replica],
) -> None:
    owners = _owners(cluster)
    privates = [name for name in POOLS if not name.startswith("pub-")]
    for replica in cluster:
        url = _http(replica)
        assert any(owners[name] is not replica for name in privates), "one lives elsewhere"
        for private in privates:
            query = LookupQuery(token_ids=tuple(range(64)), pool_ids=("pub-0", private))
            answer = httpx.post(f"{url}/v1/lookup", json=_lookup(query), headers=ROUTER)
            assert answer.status_code == 403, (replica.address, private, answer.text)
            assert answer.json()["error"]["code"] == "PERMISSION_DENIED"
            assert private in answer.json()["error"]["message"]
        bare = httpx.post(f"{url}/v1/lookup", json=_lookup(LookupQuery(token_ids=(1,) * 16)))
        assert bare.status_code == 401
        assert httpx.get(f"{url}/v1/pools").status_code == 401


def test_a_redirect_is_answered_to_a_valid_token_only_and_the_token_reads_there(
    cluster: list[Replica],
) -> None:
    owners = _owners(cluster)
    for name in PUBLIC:
        owner = owners[name]
        other = next(replica for replica in cluster if replica is not owner)
        path = f"/v1/pools/{name}"
        assert httpx.get(f"{_http(other)}{path}").status_code == 401  # placement not told
        moved = httpx.get(f"{_http(other)}{path}", headers=ROUTER)
        assert moved.status_code == 307, moved.text
        assert moved.headers["location"] == f"{_http(owner)}{path}"
        # Clients drop the token on a redirect to another origin: send it again there.
        there = httpx.get(moved.headers["location"], headers=ROUTER)
        assert there.status_code == 200, there.text
        assert there.json()["name"] == name
    private = next(name for name in POOLS if not name.startswith("pub-"))
    denied = httpx.get(f"{_http(owners[private])}/v1/pools/{private}", headers=ROUTER)
    assert denied.status_code == 403
