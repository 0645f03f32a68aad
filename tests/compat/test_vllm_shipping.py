"""vLLM 0.33's real schedulers on kvcm with a server: the mirror ships one Step per step.

Each case runs vLLM's scheduler as it ships and ``KvcmScheduler`` / ``KvcmAsyncScheduler``
configured with the address of a real kvcm server on 127.0.0.1 (``additional_config``), on the
same seeded workload, and checks every step's output against vLLM's. The server runs the
shipped programs through its interpreter; the shipper checks every answer against the
mirror's. At the end the server's pool (blocks, free queue, prefix cache, block tables) must
equal the mirror's. Faults: the pool deleted mid-run and the server restarted mid-run; the
engine keeps scheduling exactly as vLLM, and the server's copy converges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _program_replay import pool_state
from _vllm_engine import Setup, build_scheduler, plan_workload, run

from kvcm.client import LookupQuery, SchedulerClient
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

CASES = {
    # name: (setup, seed, number of requests)
    "prefix-hits-chunked": (Setup(), 11, 80),
    "async-preemption": (Setup(num_blocks=40, async_scheduling=True), 12, 80),
    "hybrid-swa": (Setup(sliding_window=64, num_blocks=80), 13, 60),
    "caching-off": (Setup(enable_caching=False, num_blocks=50), 14, 60),
    "lora-salts-no-stats": (Setup(lora=True, num_blocks=60, log_stats=False), 15, 60),
}


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A kvcm server on 127.0.0.1 (gRPC only)."""
    embedded = start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    try:
        yield embedded
    finally:
        embedded.stop()


def _classes() -> tuple[type, type]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    init_none_hash(sha256)  # EngineCore does, once the scheduler is built

    return KvcmScheduler, KvcmAsyncScheduler


def server_pool_state(server: EmbeddedServer, pool_id: str) -> dict[str, Any]:
    """The server pool's state, block tables keyed by vLLM's request ids."""

    async def read() -> dict[str, Any]:
        pool = await server.server.state.pool(pool_id)
        manager = pool.ready_manager()
        state = pool_state(manager, [])
        state["tables"] = {
            pool.request_ids[key]: manager.get_block_ids(request.request_id)
            for key, request in sorted(pool.requests.items())
            if manager.holds_blocks(request.request_id)
        }
        return state

    return server.call(read())


def vllm_prefix_stats(engine_output: Any, totals: dict[str, int]) -> None:
    """Add the prefix-cache stats an engine output reports (vLLM's manager's) to ``totals``."""
    if isinstance(engine_output, dict):
        for key, value in engine_output.items():
            if key == "prefix_cache_stats" and isinstance(value, dict):
                for name in ("requests", "queries", "hits"):
                    totals[name] += int(value.get(name) or 0)
            else:
                vllm_prefix_stats(value, totals)
    elif isinstance(engine_output, (list, tuple)):
        for item in engine_output:
            vllm_prefix_stats(item, totals)


def server_prefix_stats(server: EmbeddedServer, pool_id: str) -> dict[str, int]:
    """The server pool's cumulative prefix-cache counters."""

    async def read() -> dict[str, int]:
        pool = await server.server.state.pool(pool_id)
        pool.take_prefix_cache_stats()
        total, _ = pool.stats_totals()
        return {"requests": total.requests, "queries": total.queries, "hits": total.hits}

    return server.call(read())


def mirror_state(scheduler: Any) -> dict[str, Any]:
    """The mirror's state in the same form."""
    core = scheduler.kv_cache_manager.core
    ids = sorted(scheduler.requests)
    return pool_state(core, ids)


@pytest.mark.parametrize("mode", ["mirror", "remote"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_shipped_steps_equal_vllm_and_the_server_copy_converges(
    case: str, mode: str, server: EmbeddedServer, vllm: Any
) -> None:
    """Every step equals vLLM's; every shipped step is verified; the copies end equal."""
    del vllm
    setup, seed, num_requests = CASES[case]
    plans = plan_workload(seed, num_requests, setup)
    reference = build_scheduler(setup)
    sync_cls, async_cls = _classes()
    config = {
        "kvcm": {
            "address": server.grpc_address,
            "pool_id": f"engine-{case}",
            "mode": mode,
            "labels": {"tenant": f"t-{case}-{mode}"},
        }
    }
    mirrored = build_scheduler(setup, async_cls if setup.async_scheduling else sync_cls, config)
    shipper = mirrored.kv_cache_manager.recorder.sink
    num_steps = 0
    vllm_stats = {"requests": 0, "queries": 0, "hits": 0}
    for expected, actual in zip(run(reference, plans), run(mirrored, plans), strict=True):
        vllm_prefix_stats(expected[2], vllm_stats)
        assert actual[1] == expected[1], f"step {expected[0]}: SchedulerOutput differs"
        assert actual[2] == expected[2], f"step {expected[0]}: engine outputs differ"
        assert actual[3] == expected[3], f"step {expected[0]}: KV events differ"
        num_steps += 1
    assert mirrored.kv_cache_manager.flush(30.0), shipper.stats
    stats = shipper.stats
    print(f"{case} {mode}: {num_steps} steps, {stats}")
    assert stats.mismatches == 0
    assert stats.resyncs == 0
    assert stats.steps_verified == stats.steps_submitted == stats.steps_shipped
    assert stats.steps_submitted >= num_steps > 50
    # One Step RPC per closed program, plus attaching (DescribePool, CreatePool). Mirror
    # mode closes at most one per schedule() (update_from_output()'s changes join the next
    # one); remote mode also one per allocate_slots (each answer waits for the server).
    assert stats.rpcs == stats.steps_submitted + 2
    if mode == "mirror":
        assert stats.steps_submitted <= num_steps + 1
    assert server_pool_state(server, f"engine-{case}") == mirror_state(mirrored)
    # The pool carries the engine's labels; a router scoped by them finds it.
    with SchedulerClient(server.grpc_address) as client:
        labels = client.describe_pool(f"engine-{case}").config.labels
        assert labels["tenant"] == f"t-{case}-{mode}"
        assert labels["data_parallel_rank"] == "0"
        assert labels["model"]
        scoped = client.lookup(LookupQuery(token_ids=[1, 2, 3], labels=dict(labels)))
        assert [hit.pool_id for hit in scoped.pools] == [f"engine-{case}"]
    # The server's kvcm_prefix_cache_* counters agree with vLLM's prefix-cache stats.
    if setup.log_stats and setup.enable_caching:
        assert vllm_stats["queries"] > 0
        assert server_prefix_stats(server, f"engine-{case}") == vllm_stats
    mirrored.shutdown()
    reference.shutdown()


def test_the_server_copy_equals_the_mirror_after_every_step(
    server: EmbeddedServer, vllm: Any
) -> None:
    """Flushed after each step, the server's pool equals the mirror's, step for step."""
    del vllm
    setup = Setup(num_blocks=100, sliding_window=32)
    plans = plan_workload(21, 40, setup)
    sync_cls, _ = _classes()
    config = {"kvcm": {"address": server.grpc_address, "pool_id": "engine-every-step"}}
    mirrored = build_scheduler(setup, sync_cls, config)
    shipper = mirrored.kv_cache_manager.recorder.sink
    compared = 0
    for step, *_ in run(mirrored, plans, max_steps=2000):
        assert mirrored.kv_cache_manager.flush(10.0), shipper.stats  # update_from_output's too
        assert server_pool_state(server, "engine-every-step") == mirror_state(mirrored), step
        compared += 1
    print(f"{compared} steps compared, {shipper.stats}")
    assert compared > 50
    assert shipper.stats.mismatches == 0
    mirrored.shutdown()


def _fault_run(
    server_address: str, faults: dict[int, Callable[[Any], None]], *, max_backlog: int = 4096
) -> tuple[Any, int]:
    """Run vLLM's scheduler and kvcm's side by side; after step ``n`` call ``faults[n]``
    with kvcm's scheduler. Every step must stay identical to vLLM's. Returns kvcm's scheduler
    (not shut down) and the number of steps."""
    setup = Setup(num_blocks=60)
    plans = plan_workload(31, 50, setup)
    reference = build_scheduler(setup)
    sync_cls, _ = _classes()
    config = {
        "kvcm": {
            "address": server_address,
            "pool_id": "engine-faults",
            "max_backlog": max_backlog,
            "step_timeout_s": 2,
        }
    }
    mirrored = build_scheduler(setup, sync_cls, config)
    num_steps = 0
    for expected, actual in zip(run(reference, plans), run(mirrored, plans), strict=True):
        assert actual[1:] == expected[1:], f"step {expected[0]} differs from vLLM"
        num_steps += 1
        fault = faults.get(num_steps)
        if fault is not None:
            fault(mirrored)
    reference.shutdown()
    assert num_steps > max(faults)
    return mirrored, num_steps


def _shipper(scheduler: Any) -> Any:
    return scheduler.kv_cache_manager.recorder.sink


def test_a_pool_deleted_mid_run_is_recreated_from_the_mirror(
    server: EmbeddedServer, vllm: Any
) -> None:
    """An operator deletes the pool twice: the engine never notices, the server converges."""
    from kvcm.client import SchedulerClient

    del vllm
    with SchedulerClient(server.grpc_address) as client:

        def delete(scheduler: Any) -> None:
            assert scheduler.kv_cache_manager.flush(10.0)  # the pool exists by now
            client.delete_pool("engine-faults")

        mirrored, num_steps = _fault_run(server.grpc_address, {40: delete, 120: delete})
    shipper = _shipper(mirrored)
    assert mirrored.kv_cache_manager.flush(30.0), shipper.stats
    stats = shipper.stats
    print(f"{num_steps} steps, {stats}")
    assert stats.resyncs == 2
    assert stats.mismatches == 0
    assert server_pool_state(server, "engine-faults") == mirror_state(mirrored)
    mirrored.shutdown()


def test_a_server_restarted_mid_run_is_resynchronised_and_a_backlog_overflow_too(
    vllm: Any,
) -> None:
    """The server dies (its pools with it) and comes back on the same port; later it is
    unreachable for longer than the backlog holds. The engine schedules as vLLM throughout."""
    del vllm
    servers = [start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))]
    address = servers[0].grpc_address

    def restart(scheduler: Any) -> None:
        assert scheduler.kv_cache_manager.flush(10.0)
        servers[0].stop()
        servers[0] = start_embedded_server(ServerSettings(grpc_address=address, http_address=""))

    def stop(scheduler: Any) -> None:
        assert scheduler.kv_cache_manager.flush(10.0)
        servers[0].stop()

    def start(scheduler: Any) -> None:
        del scheduler
        servers[0] = start_embedded_server(ServerSettings(grpc_address=address, http_address=""))

    try:
        mirrored, num_steps = _fault_run(
            address, {30: restart, 80: stop, 100: start}, max_backlog=8
        )
        shipper = _shipper(mirrored)
        assert mirrored.kv_cache_manager.flush(30.0), shipper.stats
        stats = shipper.stats
        print(f"{num_steps} steps, {stats}")
        assert stats.backlog_overflows >= 1
        assert stats.resyncs >= 2
        assert stats.mismatches == 0
        assert server_pool_state(servers[0], "engine-faults") == mirror_state(mirrored)
        mirrored.shutdown()
    finally:
        servers[0].stop()
