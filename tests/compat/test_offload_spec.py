"""kvcm's host tier as vLLM 0.33's offloading index, next to vLLM's own CPU offloading.

Each case builds two vLLM ``EngineCore`` s (tests/compat/_engine_core.py) with vLLM's
``OffloadingConnector``: one with vLLM's ``CPUOffloadingSpec`` (its LRU policy), one with
``KvcmOffloadingSpec`` loaded the way an operator configures it (``spec_name`` and
``spec_module_path`` in ``kv_connector_extra_config``), whose ``OffloadingManager`` is kvcm's
``HostTier``. The connector's scheduler side runs on CPU; the simulated workers finish each
step's store and load jobs within the step (``_offload_sim``). Both engines run the same seeded
workload (shared prefixes, a device pool far smaller than the working set). Every decision the
connector asks its manager for is recorded: each ``prepare_store`` (the chunks to store and the
chunks evicted for them, or a refusal) and each ``prepare_load``, and each request's computed
tokens when it is first scheduled (its device hit plus its host hit).

* With a host buffer that holds the whole working set, nothing is evicted from it and the two
  managers decide the same at every call: the same stores, loads, hits and KV events (the
  connector's ``BlockStored`` / ``BlockRemoved`` with medium ``CPU`` included).
* With a small host buffer they agree on *what* to store (every refusal and every set of chunks
  to store is the same until their contents first differ) and differ in *which* evictable
  chunks leave first: vLLM's LRU ranks a running request's chunks by the request (one rank per
  request, tail before head, raised when a later request observes them), kvcm's by when each
  chunk was stored, loaded or touched; both rank a finished request's chunks alike (tail
  before head, most recent last). The first difference is an eviction order, never a store
  decision; after it the runs part (their host hits differ: docs/host-tier.md has figures).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from _engine_core import Setup, build_engine, plan_workload, run

NUM_REQUESTS = 50
BYTES_PER_CHUNK = 8192  # two layers of 16-token float16 pages (the harness's model)


def _setup(spec: str, num_chunks: int) -> Setup:
    extra: dict[str, Any] = {"cpu_bytes_to_use": num_chunks * BYTES_PER_CHUNK, "spec_name": spec}
    if spec == "KvcmOffloadingSpec":
        extra["spec_module_path"] = "kvcm.integrations.vllm"
    return Setup(
        num_blocks=48,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=512,
        kv_transfer={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )


def _record(manager: Any, log: list[tuple[Any, ...]]) -> None:
    # Observe the manager where the connector calls it (its answers are returned unchanged).
    prepare_store, prepare_load = manager.prepare_store, manager.prepare_load

    def store(keys: Any, req_context: Any) -> Any:
        out = prepare_store(keys, req_context)
        decision = None if out is None else (tuple(out.keys_to_store), tuple(out.evicted_keys))
        log.append(("store", req_context.req_id, decision))
        return out

    def load(keys: Any, req_context: Any) -> Any:
        log.append(("load", req_context.req_id, tuple(keys)))
        return prepare_load(keys, req_context)

    manager.prepare_store = store
    manager.prepare_load = load


def _run(spec: str, num_chunks: int, seed: int = 7) -> dict[str, Any]:
    engine = build_engine(_setup(spec, num_chunks))
    try:
        connector = engine.scheduler.connector
        manager = connector.connector_scheduler.manager
        log: list[tuple[Any, ...]] = []
        _record(manager, log)
        hits: list[tuple[str, int]] = []
        events: list[Any] = []
        finished = 0
        for record in run(engine, plan_workload(seed, NUM_REQUESTS, engine.setup), record=False):
            for batch in record.scheduled:
                new_reqs = batch.scheduled_new_reqs
                hits.extend((new.req_id, new.num_computed_tokens) for new in new_reqs)
                finished += len(batch.finished_req_ids)
            events.extend(record.events)
        return {
            "manager": manager,
            "log": log,
            "hits": hits,
            "events": events,
            "finished": finished,
        }
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def roomy(vllm: ModuleType) -> dict[str, dict[str, Any]]:
    return {spec: _run(spec, 4000) for spec in ("CPUOffloadingSpec", "KvcmOffloadingSpec")}


@pytest.fixture(scope="module")
def tight(vllm: ModuleType) -> dict[str, dict[str, Any]]:
    return {spec: _run(spec, 40) for spec in ("CPUOffloadingSpec", "KvcmOffloadingSpec")}


def test_vllm_loads_the_spec_by_name_and_module(tight: dict[str, dict[str, Any]]) -> None:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvcm.integrations.vllm import KvcmOffloadingManager, KvcmOffloadingSpec

    spec_cls = OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "KvcmOffloadingSpec", "spec_module_path": "kvcm.integrations.vllm"}
    )
    assert spec_cls is KvcmOffloadingSpec
    assert issubclass(spec_cls, OffloadingSpec)
    # The engine built with the spec's name and module path runs kvcm's manager, sized by
    # vLLM's CPU spec from cpu_bytes_to_use: one host block per chunk.
    manager = tight["KvcmOffloadingSpec"]["manager"]
    assert isinstance(manager, KvcmOffloadingManager)
    assert manager.host.num_blocks == 40


def test_with_room_for_everything_both_managers_decide_alike(
    roomy: dict[str, dict[str, Any]],
) -> None:
    vllm, kvcm = roomy["CPUOffloadingSpec"], roomy["KvcmOffloadingSpec"]
    assert vllm["finished"] == kvcm["finished"] == NUM_REQUESTS
    stores = [entry for entry in vllm["log"] if entry[0] == "store"]
    loads = [entry for entry in vllm["log"] if entry[0] == "load"]
    assert stores, "the workload offloads"
    assert loads, "the workload reloads offloaded chunks"
    assert all(entry[2] is not None and not entry[2][1] for entry in stores), "no evictions"
    assert kvcm["log"] == vllm["log"]
    assert kvcm["hits"] == vllm["hits"]
    # The KV events (device and CPU) are the same stream.
    assert [e for e in kvcm["events"] if getattr(e, "medium", None) == "CPU"]
    assert repr(kvcm["events"]) == repr(vllm["events"])
    host = kvcm["manager"].host
    assert host.pinned() == {}
    assert host.pending_keys() == set()


def test_with_a_small_buffer_they_differ_only_in_eviction_order(
    tight: dict[str, dict[str, Any]],
) -> None:
    vllm, kvcm = tight["CPUOffloadingSpec"], tight["KvcmOffloadingSpec"]
    assert vllm["finished"] == kvcm["finished"] == NUM_REQUESTS
    first = next(
        (i for i, (a, b) in enumerate(zip(vllm["log"], kvcm["log"], strict=False)) if a != b),
        None,
    )
    assert first is not None, "a small buffer evicts, and the policies rank differently"
    a, b = vllm["log"][first], kvcm["log"][first]
    # The first difference: the same call, the same chunks to store, other chunks evicted.
    assert a[0] == b[0] == "store"
    assert a[1] == b[1]
    assert a[2] is not None
    assert b[2] is not None
    assert a[2][0] == b[2][0]
    assert len(a[2][1]) == len(b[2][1])
    assert a[2][1] != b[2][1]
    evictions = sum(
        1 for entry in vllm["log"][:first] if entry[0] == "store" and entry[2] and entry[2][1]
    )
    assert evictions >= 1, "they agreed on earlier evictions"
    host_hits = {}
    for name, result in tight.items():
        host_hits[name] = sum(len(entry[2]) for entry in result["log"] if entry[0] == "load")
    # Both reload chunks from the host after the orders part (how many differs with the order:
    # on this workload kvcm's keeps the chunks stored last, which the next turns reuse).
    assert host_hits["KvcmOffloadingSpec"] > 0
    assert host_hits["CPUOffloadingSpec"] > 0
    host = kvcm["manager"].host
    assert host.pinned() == {}
    assert host.num_free + len(host.keys()) == host.num_blocks


def test_the_manager_pins_loads_releases_failed_stores_and_resets(vllm: ModuleType) -> None:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    from kvcm.integrations.vllm import KvcmOffloadingManager

    manager = KvcmOffloadingManager(2, enable_events=True)
    ctx = ReqContext(req_id="r")
    a, b, c = (make_offload_key(bytes([i]) * 32, 0) for i in range(3))
    out = manager.prepare_store([a, b], ctx)
    assert out is not None
    assert out.keys_to_store == [a, b]
    assert list(out.store_spec.block_ids) == [0, 1]  # type: ignore[attr-defined]
    assert manager.lookup(a, ctx) is LookupResult.HIT_PENDING
    manager.complete_store([a], ctx)
    manager.complete_store([b], ctx, success=False)  # the copy failed: b's block is free again
    assert manager.lookup(a, ctx) is LookupResult.HIT
    assert manager.lookup(b, ctx) is LookupResult.MISS
    spec = manager.prepare_load([a], ctx)
    assert list(spec.block_ids) == [0]  # type: ignore[attr-defined]
    # a is being loaded: a store that needs its block is refused, nothing changes.
    assert manager.prepare_store([b, c], ctx) is None
    manager.complete_load([a], ctx)
    out = manager.prepare_store([b, c], ctx)
    assert out is not None
    assert out.evicted_keys == [a]
    events = list(manager.take_events())
    assert [(e.removed, e.metadata_only, e.keys) for e in events] == [
        (False, False, [a]),
        (True, True, [b]),
        (True, False, [a]),
    ]
    assert all(e.medium.value == "CPU" for e in events)
    manager.reset_cache()
    assert manager.lookup(c, ctx) is LookupResult.MISS
    assert manager.host.num_free == 2
