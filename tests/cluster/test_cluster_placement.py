"""Three ``kvcm serve`` replicas on a real etcd: placement, redirects, fan-out.

* pools created through any one replica spread over all three (least-loaded first), each
  with a standby on another replica, and every replica's view agrees with etcd's records;
* the SDK (sync and async) given the three seeds follows redirects to each pool's primary and
  then talks to it directly; a client given one seed reaches every pool too;
* ``ListPools`` through any replica lists every pool; a ``Lookup`` through any replica
  equals the merge of each pool's own answer (asked at its owner, with the pool alone in
  scope), and a scope naming pools on several replicas is split between them;
* with etcd stopped, every replica keeps serving the pools it owns (redirects included),
  ``CreatePool`` fails UNAVAILABLE naming etcd, and placement resumes when etcd is back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from typing import Any

import aetcd
import grpc
import httpx
import pytest
from _cluster import Etcd, Replica

from kvcm.client import (
    AsyncSchedulerClient,
    ItemStatus,
    LookupQuery,
    SchedulerClient,
    ServiceNotFoundError,
    ServiceResourceExhaustedError,
    StepBuilder,
    UnavailableError,
)
from kvcm.client.worker import WorkerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pd_route import PdRouteQuery, PdScope, rank_pd
from kvcm.core.pool import PoolConfig
from kvcm.server.cluster import Placement
from kvcm.v1 import admin_pb2, service_pb2_grpc

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=64,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)
CONFIG = PoolConfig(max_model_len=1024, explicit_layout=LAYOUT)
NUM_POOLS = 9


def _seeds(replicas: list[Replica]) -> str:
    return ",".join(replica.address for replica in replicas)


def _owned(replica: Replica) -> list[str]:
    """The pools a replica itself holds (asked alone, no fan-out)."""
    with grpc.insecure_channel(replica.address) as channel:
        stub = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
        answer = stub.ListPools(
            admin_pb2.ListPoolsRequest(), metadata=(("kvcm-cluster-local", "1"),), timeout=5
        )
    return sorted(pool.pool_id for pool in answer.pools)


async def _placements(replica: Replica) -> dict[str, Placement]:
    """The placement records in etcd, read with etcd's own client."""
    host, _, port = replica.etcd.endpoint.removeprefix("http://").rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
        listing = await client.get_prefix(f"{replica.prefix}/placement/".encode())
        return {p.pool_id: p for p in (Placement.decode(kv.value) for kv in listing)}


@pytest.fixture(scope="module")
def pools(replicas: list[Replica]) -> list[str]:
    """NUM_POOLS pools created through the first replica only, with a few requests each."""
    names = [f"pool-{i}" for i in range(NUM_POOLS)]
    rng = random.Random(31)
    with SchedulerClient(replicas[0].address, timeout=10.0) as client:
        for name in names:
            client.create_pool(name, CONFIG)
        for index, name in enumerate(names):
            hasher = client.block_hasher(name)
            for key in range(3):
                prompt = [rng.randrange(1000) for _ in range(16 * rng.randrange(1, 5))]
                if key == 1:  # shared prefixes across pools, so lookups rank several pools
                    prompt = list(range(48 + 16 * (index % 3)))
                step = StepBuilder()
                hashes = hasher.hash_token_ids(prompt)
                step.add_request(key, prompt, hashes, request_id=f"{name}-{key}")
                step.allocate(key, len(prompt), 0, lookup=True)
                step.cache_blocks(key, len(prompt))
                assert client.step(name, step).statuses == [ItemStatus.OK]
    return names


def test_pools_spread_over_the_replicas_each_with_a_standby_elsewhere(
    replicas: list[Replica], pools: list[str]
) -> None:
    owned = {replica.address: _owned(replica) for replica in replicas}
    assert sorted(p for names in owned.values() for p in names) == sorted(pools)
    counts = Counter({address: len(names) for address, names in owned.items()})
    assert set(counts.values()) == {NUM_POOLS // 3}, counts  # least-loaded first: 3, 3, 3
    records = asyncio.run(_placements(replicas[0]))
    assert sorted(records) == sorted(pools)
    standbys: Counter[str] = Counter()
    for address, names in owned.items():
        for name in names:
            placement = records[name]
            assert (placement.primary, placement.epoch) == (address, 1)
            assert placement.standby in owned
            assert placement.standby != address
            standbys[placement.standby] += 1
    assert set(standbys.values()) == {NUM_POOLS // 3}, standbys
    with SchedulerClient(replicas[1].address, timeout=5.0) as client:
        for name in pools:
            info = client.describe_pool(name)  # redirected to the owner, which answers
            assert info.pool_id == name
    redirected = NUM_POOLS - len(owned[replicas[1].address])
    text = httpx.get(f"http://127.0.0.1:{replicas[1].http_port}/metrics").text
    assert f'kvcm_cluster_redirects_total{{method="DescribePool"}} {float(redirected)}' in text
    assert (  # counted with the redirect's status
        'kvcm_rpc_requests_total{code="FAILED_PRECONDITION",method="DescribePool"} '
        f"{float(redirected)}"
    ) in text


def test_the_sdk_follows_redirects_and_then_talks_to_the_owner(
    replicas: list[Replica], pools: list[str]
) -> None:
    owner = {name: replica.address for replica in replicas for name in _owned(replica)}
    with SchedulerClient(_seeds(replicas), timeout=5.0) as client:
        for name in pools:
            usage = client.get_usage(name)
            assert 0.0 < usage.usage <= 1.0
        # Each pool's route is its owner now: the next call goes there with no redirect.
        assert client._routes == {
            name: owner[name] for name in pools if owner[name] != replicas[0].address
        }

    async def drive() -> None:
        async with AsyncSchedulerClient(replicas[2].address, timeout=5.0) as client:
            for name in pools:
                step = StepBuilder()
                step.add_request(100, list(range(32)), client_hashes[name], request_id="async")
                step.allocate(100, 32, 0, lookup=True)
                result = await client.step(name, step)
                assert result.statuses == [ItemStatus.OK]
                step = StepBuilder()
                step.finish(100)
                await client.step(name, step)

    with SchedulerClient(replicas[0].address, timeout=5.0) as sync:
        client_hashes = {
            name: sync.block_hasher(name).hash_token_ids(list(range(32))) for name in pools
        }
    asyncio.run(drive())


def test_a_worker_registers_through_any_replica(replicas: list[Replica], pools: list[str]) -> None:
    """The worker client follows the redirect too: a rank registering through a replica that
    does not own its pool reaches the owner, which plans the pool."""
    specs = {f"layer.{i}": SPEC for i in range(2)}
    with SchedulerClient(_seeds(replicas), timeout=5.0) as client:
        client.create_pool("planned", PoolConfig(max_model_len=1024, world_size=1))
        owner = client._routes.get("planned", replicas[0].address)
        elsewhere = next(r.address for r in replicas if r.address != owner)
        with WorkerClient(elsewhere, timeout=10.0) as worker:
            registration = worker.register("planned", 0, 1, specs, 8 * 1024 * 1024)
        assert registration.kv_cache_config.num_blocks > 0
        assert worker._routes == {"planned": owner}
        assert client.describe_pool("planned").kv_cache_config is not None
        client.delete_pool("planned")


def test_an_event_stream_opened_elsewhere_follows_the_redirect(replicas: list[Replica]) -> None:
    evented = dataclasses.replace(CONFIG, enable_kv_cache_events=True)
    prompt = list(range(64))
    with SchedulerClient(_seeds(replicas), timeout=5.0) as client:
        client.create_pool("evented", evented)
        step = StepBuilder()
        step.add_request(1, prompt, client.block_hasher("evented").hash_token_ids(prompt))
        step.allocate(1, len(prompt), 0, lookup=True)
        step.cache_blocks(1, len(prompt))
        client.step("evented", step)
        owner = client._routes.get("evented", replicas[0].address)
    elsewhere = next(r.address for r in replicas if r.address != owner)
    with SchedulerClient(elsewhere, timeout=5.0) as reader:
        stream = reader.subscribe_events("evented", start_sequence=1, timeout=10.0)
        stored: list[Any] = []
        try:
            for batch in stream:  # the first batch may be the stream's empty opening one
                stored += [e for e in batch.events if type(e).__name__ == "BlockStored"]
                if stored:
                    break
        finally:
            stream.close()
        assert reader._routes == {"evented": owner}
    assert sum(len(event.block_hashes) for event in stored) == len(prompt) // 16
    with SchedulerClient(_seeds(replicas), timeout=5.0) as client:
        client.delete_pool("evented")


def test_list_pools_through_any_replica_lists_every_pool(
    replicas: list[Replica], pools: list[str]
) -> None:
    for replica in replicas:
        with SchedulerClient(replica.address, timeout=5.0) as client:
            assert sorted(p.pool_id for p in client.list_pools()) == sorted(pools)


def test_lookup_through_any_replica_equals_the_merge_of_each_pools_own_answer(
    replicas: list[Replica], pools: list[str]
) -> None:
    prompt = tuple(range(96))
    own: list[tuple[float, int, float, str, int]] = []
    with SchedulerClient(_seeds(replicas), timeout=5.0) as client:
        for name in pools:
            answer = client.lookup(LookupQuery(token_ids=prompt, pool_ids=(name,)))
            (hit,) = answer.pools
            own.append((-hit.score, hit.load.num_waiting, hit.load.usage, name, hit.num_hit_tokens))
    own.sort()
    assert any(row[4] for row in own), "the shared prefixes make hits"
    for replica in replicas:
        with SchedulerClient(replica.address, timeout=5.0) as client:
            answer = client.lookup(LookupQuery(token_ids=prompt))
            assert answer.num_pools_in_scope == NUM_POOLS
            assert [(h.pool_id, h.num_hit_tokens) for h in answer.pools] == [
                (row[3], row[4]) for row in own
            ]
            top = client.lookup(LookupQuery(token_ids=prompt, max_results=4))
            assert [h.pool_id for h in top.pools] == [row[3] for row in own[:4]]
            scoped = client.lookup(LookupQuery(token_ids=prompt, pool_ids=tuple(pools[::2])))
            assert sorted(h.pool_id for h in scoped.pools) == sorted(pools[::2])


def test_route_pd_through_any_replica_ranks_every_replicas_pools(
    replicas: list[Replica], pools: list[str]
) -> None:
    prompt = tuple(range(96))
    for bidirectional in (False, True):
        query = PdRouteQuery(
            prompt=LookupQuery(token_ids=prompt, max_results=3),
            prefill=PdScope(pool_ids=tuple(pools[:5])),
            decode=PdScope(pool_ids=tuple(pools[5:])),
            bidirectional=bidirectional,
        )
        with SchedulerClient(_seeds(replicas), timeout=5.0) as client:
            # The reference: the core's ranking over each role's merged per-pool answers.
            roles = [
                client.lookup(LookupQuery(token_ids=prompt, pool_ids=tuple(names)))
                for names in (pools[:5], pools[5:])
            ]
        expected = rank_pd(query, *roles)
        assert {h.pool_id for h in expected.prefill} | {h.pool_id for h in expected.decode}
        for replica in replicas:
            with SchedulerClient(replica.address, timeout=5.0) as client:
                route = client.route_pd(query)
            assert [(h.pool_id, h.num_hit_tokens) for h in route.prefill] == [
                (h.pool_id, h.num_hit_tokens) for h in expected.prefill
            ]
            assert [(h.pool_id, h.num_hit_tokens) for h in route.decode] == [
                (h.pool_id, h.num_hit_tokens) for h in expected.decode[:3]
            ]
            assert (route.decode_hit_tokens, route.remote_num_tokens) == (
                expected.decode_hit_tokens,
                expected.remote_num_tokens,
            )
            assert route.num_prefill_pools_in_scope == 5
            assert route.num_decode_pools_in_scope == NUM_POOLS - 5


def test_a_pool_that_is_refused_or_deleted_leaves_no_placement(
    replicas: list[Replica], pools: list[str]
) -> None:
    huge = PoolConfig(
        max_model_len=1024,
        explicit_layout=KVCacheConfig(
            num_blocks=2**26,  # beyond max_blocks_per_pool: refused by the primary
            kv_cache_tensors=(),
            kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
        ),
    )
    with SchedulerClient(_seeds(replicas), timeout=5.0) as client:
        with pytest.raises(ServiceResourceExhaustedError, match="max_blocks_per_pool"):
            client.create_pool("too-big", huge)
        client.create_pool("short-lived", CONFIG)
        assert "short-lived" in asyncio.run(_placements(replicas[0]))
        client.delete_pool("short-lived")  # through a replica that may not own it
        with pytest.raises(ServiceNotFoundError):
            client.describe_pool("short-lived")
    records = asyncio.run(_placements(replicas[0]))
    assert "too-big" not in records
    assert "short-lived" not in records
    assert sorted(records) == sorted(pools)


def _session_up(replica: Replica) -> float:
    for line in httpx.get(f"http://127.0.0.1:{replica.http_port}/metrics").text.splitlines():
        if line.startswith("kvcm_cluster_etcd_session_up "):
            return float(line.split()[1])
    raise AssertionError("kvcm_cluster_etcd_session_up not exported")


def _wait_session(replicas: list[Replica], up: float, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    for replica in replicas:
        while _session_up(replica) != up:
            assert time.monotonic() < deadline, f"{replica.address}: session never {up}"
            time.sleep(0.1)


# Last in the module: it stops the module's etcd for a while (and starts it again).
def test_without_etcd_replicas_serve_their_pools_and_placement_waits(
    etcd: Etcd, replicas: list[Replica], pools: list[str]
) -> None:
    etcd.stop()
    try:
        _wait_session(replicas, 0.0)
        with SchedulerClient(_seeds(replicas), timeout=5.0) as client:
            for name in pools:  # every pool, through a fresh client: redirects still work
                step = StepBuilder()
                step.add_request(7, list(range(40)), b"", request_id="outage")
                step.allocate(7, 40, 0)
                step.finish(7)
                assert client.step(name, step).statuses == [ItemStatus.OK]
            assert len(client.list_pools()) == NUM_POOLS
            with pytest.raises(UnavailableError, match="etcd") as refused:
                client.create_pool("placed-after-etcd", CONFIG)
            assert "placement resumes when etcd is back" in str(refused.value)
            assert "placed-after-etcd" not in {p.pool_id for p in client.list_pools()}
    finally:
        etcd.start()
    _wait_session(replicas, 1.0)
    with SchedulerClient(_seeds(replicas), timeout=5.0) as client:
        client.create_pool("placed-after-etcd", CONFIG)
        for replica in replicas:
            with SchedulerClient(replica.address, timeout=5.0) as one:
                assert len(one.list_pools()) == NUM_POOLS + 1
    assert "placed-after-etcd" in asyncio.run(_placements(replicas[0]))
