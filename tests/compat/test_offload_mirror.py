"""An engine's host tier, visible to kvcm's server: vLLM's offloading connector on kvcm.

vLLM's real ``EngineCore`` (tests/compat/_engine_core.py) runs ``KvcmScheduler`` with vLLM's
``OffloadingConnector`` whose index is ``KvcmOffloadingSpec`` (its scheduler side on CPU, the
simulated workers finishing each store and load job within the step), shipping to a real kvcm
server on 127.0.0.1 in mirror and in remote mode. Next to it, the same workload runs on vLLM's
own scheduler with the same connector and spec. Every turn must be equal (batches, engine
outputs, KV events); after every turn the mirror is flushed and the server's pool, created
with ``offload_host_blocks``, must hold the engine's host tier exactly: the same keys in the
same recency order in the same host blocks, the same pending stores and pins, the same
counters, because every call the connector makes into the tier ships as a HOST_SYNC op that
the server replays. Then the tier is what kvcm shows: the server's Lookup answers the engine
tier's hit as ``tier_hit_tokens["CPU"]``, its KV events carry the engine tier's stores and
evictions with medium ``CPU``, and ``GET /v1/pools/{pool}`` reports its usage, stores,
evictions and loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _engine_core import build_engine, plan_workload, run
from test_offload_spec import _setup

from kvcm.client import LookupQuery, SchedulerClient
from kvcm.common.hashing import external_block_hash
from kvcm.core.host_tier import prefix_host_hit_tokens
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

NUM_REQUESTS = 30
NUM_CHUNKS = 40  # far below the working set: the tier evicts


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A kvcm server on 127.0.0.1 (gRPC and HTTP)."""
    embedded = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0")
    )
    try:
        yield embedded
    finally:
        embedded.stop()


def _tier_state(host: Any) -> tuple[Any, ...]:
    keys = host.keys()
    return (
        [(key, keys[key]) for key in host.recency()],
        host.pending_keys(),
        host.pinned(),
        host.num_free,
        host.stats(),
    )


def _server_tier(server: EmbeddedServer, pool_id: str) -> tuple[tuple[Any, ...], list[Any]]:
    async def read() -> tuple[tuple[Any, ...], list[Any]]:
        pool = await server.server.state.pool(pool_id)
        events = [event for event, _ in pool.event_log_contents()]
        return _tier_state(pool.host_tier), events

    return server.call(read())


def _cpu_events(events: list[Any]) -> list[tuple[str, Any]]:
    # (type, hash) per key, in order; the engine's events (plain data: a stored event has
    # token_ids) may carry several keys each, the server's kvcm events one.
    pairs = []
    for event in events:
        if isinstance(event, dict):
            if event.get("medium") != "CPU":
                continue
            kind = "BlockStored" if "token_ids" in event else "BlockRemoved"
            pairs += [(kind, block_hash) for block_hash in event["block_hashes"]]
        elif getattr(event, "medium", None) == "CPU":
            kind = type(event).__name__
            pairs += [(kind, external_block_hash(h)) for h in event.block_hashes]
    return pairs


def _plain(outputs: Any) -> Any:
    # The connector's stats carry wall-clock histograms (lookup delays): keep their names.
    if isinstance(outputs, dict):
        return {
            key: (sorted(value["data"]) if key == "kv_connector_stats" and value else _plain(value))
            for key, value in outputs.items()
        }
    if isinstance(outputs, list):
        return [_plain(value) for value in outputs]
    return outputs


@pytest.mark.parametrize("mode", ["mirror", "remote"])
def test_the_server_holds_the_engine_host_tier_after_every_step(
    mode: str, server: EmbeddedServer, vllm: Any
) -> None:
    from kvcm.integrations.vllm import KvcmOffloadingManager, KvcmScheduler

    del vllm
    setup = _setup("KvcmOffloadingSpec", NUM_CHUNKS)
    plans = plan_workload(7, NUM_REQUESTS, setup)
    pool_id = f"offload-{mode}"
    config = {"kvcm": {"address": server.grpc_address, "pool_id": pool_id, "mode": mode}}
    reference = build_engine(setup)
    mirrored = build_engine(setup, KvcmScheduler, config)
    try:
        manager = mirrored.scheduler.kv_cache_manager
        offloading = mirrored.scheduler.connector.connector_scheduler.manager
        assert isinstance(offloading, KvcmOffloadingManager)
        host = offloading.host
        assert manager.host_tier is host
        assert manager.pool_config().offload_host_blocks == NUM_CHUNKS
        reference_host = reference.scheduler.connector.connector_scheduler.manager.host
        engine_events: list[Any] = []
        turns = 0
        for expected, actual in zip(run(reference, plans), run(mirrored, plans), strict=True):
            turns += 1
            assert actual.scheduled == expected.scheduled, turns
            assert _plain(actual.outputs) == _plain(expected.outputs), turns
            assert actual.events == expected.events, turns
            engine_events.extend(actual.events)
            # update_from_output()'s calls (completed stores and loads) ship with the next
            # step: flush them too.
            assert manager.flush(10.0), manager.sink.stats
            state, server_events = _server_tier(server, pool_id)
            assert state == _tier_state(host), f"turn {turns}: the server's tier differs"
            assert _tier_state(host) == _tier_state(reference_host), turns
        stats = host.stats()
        assert turns > 100
        assert stats.stores > NUM_CHUNKS  # the tier filled
        assert stats.evictions > 0
        shipper = manager.sink.stats
        assert shipper.mismatches == 0
        assert shipper.resyncs == 0

        # KV events: the server's CPU events are the engine's, key for key, in order.
        assert _cpu_events(engine_events)
        assert _cpu_events(server_events) == _cpu_events(engine_events)

        # Lookup: a prompt whose blocks only the host tier holds hits there, as the engine's
        # connector would load them.
        core = manager.core
        held = 0
        with SchedulerClient(server.grpc_address) as client:
            for plan in plans:
                if plan.cache_salt is not None:
                    continue
                tokens = list(plan.prompt)
                answer = client.lookup(LookupQuery(token_ids=tokens, pool_ids=[pool_id]))
                (hit,) = answer.pools
                hashes = _prompt_hashes(server, pool_id, tokens)
                expected_cpu = prefix_host_hit_tokens(
                    core, host, hashes, hit.num_hit_tokens, len(tokens) - 1
                )
                assert dict(hit.tier_hit_tokens).get("CPU", 0) == expected_cpu, plan.request_id
                held += expected_cpu > 0
        assert held, "some prompt is held in the host tier only"

        # Metrics: the pool's summary reports the engine tier's usage and counters.
        http_address = server.http_address
        with httpx.Client(base_url=f"http://{http_address}", timeout=5.0) as http:
            tier = http.get(f"/v1/pools/{pool_id}").json()["host_tier"]
        assert tier["blocks"] == NUM_CHUNKS
        assert tier["used_blocks"] == stats.num_used
        assert tier["demoted_blocks"] == stats.stores
        assert tier["evicted_blocks"] == stats.evictions
        assert tier["loaded_blocks"] == stats.loads
    finally:
        mirrored.shutdown()
        reference.shutdown()


def _prompt_hashes(server: EmbeddedServer, pool_id: str, tokens: list[int]) -> Any:
    async def read() -> Any:
        pool = await server.server.state.pool(pool_id)
        return pool.computed_hashes(tokens, None, None)

    return server.call(read())
