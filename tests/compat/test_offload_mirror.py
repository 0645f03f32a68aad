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

import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _engine_core import Engine, RequestPlan, _engine_request, build_engine, plan_workload, run
from test_offload_spec import _setup

from kvcm.client import LookupQuery, SchedulerClient
from kvcm.common.hashing import external_block_hash
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

NUM_REQUESTS = 30
NUM_CHUNKS = 40  # far below the working set: the tier evicts (fewer chunks when hybrid)


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


def _cpu_events(events: list[Any]) -> dict[Any, list[tuple[str, Any]]]:
    # Per KV-cache group, (type, hash) per key in order. The engine's events (plain data: a
    # stored event has token_ids) carry a call's keys per group, the server's one key each.
    pairs: dict[Any, list[tuple[str, Any]]] = {}
    for event in events:
        if isinstance(event, dict):
            if event.get("medium") != "CPU":
                continue
            kind = "BlockStored" if "token_ids" in event else "BlockRemoved"
            group, hashes = event.get("group_idx"), event["block_hashes"]
        elif getattr(event, "medium", None) == "CPU":
            kind, group = type(event).__name__, event.group_idx
            hashes = [external_block_hash(h) for h in event.block_hashes]
        else:
            continue
        pairs.setdefault(group, []).extend((kind, h) for h in hashes)
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


@pytest.mark.parametrize(
    ("case", "mode"),
    [("full", "mirror"), ("full", "remote"), ("hybrid-swa", "mirror"), ("hybrid-mamba", "mirror")],
)
def test_the_server_holds_the_engine_host_tier_after_every_step(
    case: str, mode: str, server: EmbeddedServer, vllm: Any
) -> None:
    from kvcm.integrations.vllm import KvcmOffloadingManager, KvcmScheduler

    del vllm
    setup = _setup("KvcmOffloadingSpec", NUM_CHUNKS)
    if case == "hybrid-swa":  # a sliding-window layer beside the full-attention one
        setup = dataclasses.replace(
            setup, sliding_window=32, retention_interval=None, num_blocks=96
        )
    pool_id = f"offload-{case}-{mode}"
    config = {"kvcm": {"address": server.grpc_address, "pool_id": pool_id, "mode": mode}}
    if case == "hybrid-mamba":  # full attention + Mamba in align mode (sub-block hits)
        from test_mamba_engine_core import CASES, _build, _plans

        setup = dataclasses.replace(CASES["sync"], kv_transfer=setup.kv_transfer)
        plans = _plans(3, NUM_REQUESTS // 2, setup.max_model_len)
        reference = _build(setup)
        mirrored = _build(setup, KvcmScheduler, additional_config=config)
    else:
        plans = plan_workload(7, NUM_REQUESTS, setup)
        reference = build_engine(setup)
        mirrored = build_engine(setup, KvcmScheduler, config)
    try:
        manager = mirrored.scheduler.kv_cache_manager
        offloading = mirrored.scheduler.connector.connector_scheduler.manager
        assert isinstance(offloading, KvcmOffloadingManager)
        host = offloading.host
        assert manager.host_tier is host
        assert manager.pool_config().offload_host_blocks == host.num_blocks > 0
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
            if not manager.recorder.num_steps:  # nothing shipped yet: no pool, an empty tier
                assert not host.keys()
                continue
            state, server_events = _server_tier(server, pool_id)
            assert state == _tier_state(host), f"turn {turns}: the server's tier differs"
            assert _tier_state(host) == _tier_state(reference_host), turns
        stats = host.stats()
        assert turns > 100
        assert stats.stores > 0
        if case != "hybrid-mamba":  # its buffer holds the (short) workload
            assert stats.stores > host.num_blocks  # the tier filled
            assert stats.evictions > 0
        shipper = manager.sink.stats
        assert shipper.mismatches == 0
        assert shipper.resyncs == 0

        # KV events: the server's CPU events are the engine's, key for key, in order.
        assert _cpu_events(engine_events)
        assert _cpu_events(server_events) == _cpu_events(engine_events)

        # Lookup: past the device hit, the host tier's tokens are what the engine's own
        # connector would load for the prompt (its lookup, run on the engine's tier).
        held = 0
        with SchedulerClient(server.grpc_address) as client:
            for plan in plans:
                if plan.cache_salt is not None:
                    continue
                tokens = list(plan.prompt)
                answer = client.lookup(LookupQuery(token_ids=tokens, pool_ids=[pool_id]))
                (hit,) = answer.pools
                cpu = dict(hit.tier_hit_tokens).get("CPU", 0)
                if case == "hybrid-mamba":
                    assert cpu == 0  # Mamba pools answer no host hits (docs/host-tier.md)
                    continue
                expected_cpu = _connector_hit(mirrored, plan, hit.num_hit_tokens)
                assert cpu == expected_cpu, plan.request_id
                held += expected_cpu > 0
        assert held or case == "hybrid-mamba", "some prompt is held in the host tier only"

        # Metrics: the pool's summary reports the engine tier's usage and counters.
        http_address = server.http_address
        with httpx.Client(base_url=f"http://{http_address}", timeout=5.0) as http:
            tier = http.get(f"/v1/pools/{pool_id}").json()["host_tier"]
        assert tier["blocks"] == host.num_blocks
        assert tier["used_blocks"] == stats.num_used
        assert tier["demoted_blocks"] == stats.stores
        assert tier["evicted_blocks"] == stats.evictions
        assert tier["loaded_blocks"] == stats.loads
    finally:
        mirrored.shutdown()
        reference.shutdown()


def _connector_hit(engine: Engine, plan: RequestPlan, num_device: int) -> int:
    """What vLLM's offloading connector would load for ``plan``'s prompt as a new request
    after ``num_device`` device-hit tokens: its lookup of complete chunks on the engine's
    tier. A full-attention model leaves the last token to compute, as kvcm's lookups do
    (vLLM's connector then looks up to the prompt's end; its scheduler recomputes the last
    token), so its hit is bounded by the whole blocks before the last token."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        RequestOffloadState,
        _create_req_context,
    )

    scheduler = engine.scheduler.connector.connector_scheduler
    probe = dataclasses.replace(plan, request_id=f"lookup-{plan.request_id}")
    request, _ = engine.core.preprocess_add_request(_engine_request(probe))
    context = _create_req_context(request)
    state = RequestOffloadState(
        config=scheduler.config,
        req=request,
        req_context=context,
        offloading_context=scheduler.manager.on_new_request(context),
    )
    state.update_offload_keys()
    state.num_locally_computed_tokens = num_device
    found = scheduler._lookup_complete_chunks(state) or 0
    if scheduler._sliding_window_groups or not found:
        return found
    block_size = engine.setup.block_size
    bound = (len(plan.prompt) - 1) // block_size * block_size - num_device
    return min(found, bound) if bound > 0 else 0
