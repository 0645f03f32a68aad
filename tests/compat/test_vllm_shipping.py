"""vLLM 0.33's real engine on kvcm with a server: the mirror ships one Step per step.

Each case builds vLLM's ``EngineCore`` (tests/compat/_engine_core.py) with vLLM's scheduler and
with ``KvcmScheduler`` / ``KvcmAsyncScheduler`` configured with the address of a real kvcm
server on 127.0.0.1 (``additional_config``), runs the same seeded workload through EngineCore's
own loop, and checks every turn's batches, engine outputs and KV events against vLLM's. The
server runs the shipped programs through its interpreter; the shipper checks every answer
against the mirror's. At the end the server's pool (blocks, free queue, prefix cache, block
tables) must equal the mirror's. Faults: the pool deleted mid-run and the server restarted
mid-run; the engine keeps scheduling exactly as vLLM, and the server's copy converges.
``KVCM_LONG=1`` runs four times the requests.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _engine_core import (
    Engine,
    Setup,
    assert_same_runs,
    build_engine,
    plan_streaming_session,
    plan_workload,
    run,
    workload_scale,
)
from _program_replay import pool_state

from kvcm.client import LookupQuery, SchedulerClient
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

_SMALL = {"max_model_len": 512}
CASES = {
    # name: (setup, seed, number of requests)
    "prefix-hits-chunked": (Setup(), 11, 60),
    "async-preemption": (Setup(num_blocks=40, async_scheduling=True, **_SMALL), 12, 60),
    "hybrid-swa": (
        Setup(sliding_window=64, num_blocks=80, retention_interval=None, **_SMALL),
        13,
        60,
    ),
    "caching-off": (Setup(enable_caching=False, num_blocks=50, **_SMALL), 14, 60),
    "async-lora-salts-no-stats": (
        Setup(lora=True, num_blocks=60, log_stats=False, async_scheduling=True, **_SMALL),
        15,
        60,
    ),
    # Two pipeline stages: the scheduler's config is the first stage's, whose
    # sliding-window group has no layer of its own.
    "pp2-hybrid-planned": (
        Setup(
            pipeline_parallel_size=2,
            sliding_window=64,
            retention_interval=None,
            num_blocks=None,
            memory_blocks=90,
            **_SMALL,
        ),
        16,
        60,
    ),
    "serve-defaults": (Setup(serve_defaults=True, num_blocks=None, memory_blocks=600), 17, 60),
    # Decode context parallelism: the server's pool gets decode_context_parallel_size over the
    # wire and schedules 32-token blocks (2 ranks' 16-token blocks) as the mirror does.
    "tp8-dcp2": (
        Setup(tensor_parallel_size=8, decode_context_parallel_size=2, num_blocks=60, **_SMALL),
        18,
        60,
    ),
}


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A kvcm server on 127.0.0.1 (gRPC only)."""
    embedded = start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    try:
        yield embedded
    finally:
        embedded.stop()


def _kvcm_class(reference: Engine) -> type:
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    engine_async = reference.core.vllm_config.scheduler_config.async_scheduling
    return KvcmAsyncScheduler if engine_async else KvcmScheduler


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


def server_prefix_stats(server: EmbeddedServer, pool_id: str) -> dict[str, int]:
    """The server pool's cumulative prefix-cache counters."""

    async def read() -> dict[str, int]:
        pool = await server.server.state.pool(pool_id)
        pool.take_prefix_cache_stats()
        total, _ = pool.stats_totals()
        return {"requests": total.requests, "queries": total.queries, "hits": total.hits}

    return server.call(read())


def mirror_state(engine: Engine) -> dict[str, Any]:
    """The mirror's state in the same form."""
    scheduler = engine.scheduler
    return pool_state(scheduler.kv_cache_manager.core, sorted(scheduler.requests))


def _shipper(engine: Engine) -> Any:
    return engine.scheduler.kv_cache_manager.recorder.sink


# Remote mode (a round trip per allocate_slots) runs the cases whose layouts differ from
# the others' only where the mirror already ships them.
PARAMS = [
    (case, mode)
    for case in sorted(CASES)
    for mode in ("mirror", "remote")
    if mode == "mirror" or case not in {"pp2-hybrid-planned", "serve-defaults"}
]
# The shipper process (``shipper: process``) ships the cases whose notes differ most: hits
# and chunked prefills, preemptions with async scheduling, a hybrid pool, caching off (no
# hashes), LoRA with salts.
PARAMS += [
    (case, "mirror-process")
    for case in (
        "prefix-hits-chunked",
        "async-preemption",
        "hybrid-swa",
        "caching-off",
        "async-lora-salts-no-stats",
    )
]


@pytest.mark.parametrize(("case", "mode"), PARAMS)
def test_shipped_steps_equal_vllm_and_the_server_copy_converges(
    case: str, mode: str, server: EmbeddedServer, vllm: Any
) -> None:
    """Every turn equals vLLM's; every shipped step is verified; the copies end equal."""
    del vllm
    setup, seed, num_requests = CASES[case]
    # Remote mode pays a loopback round trip per allocation: two thirds of the requests.
    shipper_kind = "process" if mode == "mirror-process" else "thread"
    mode = mode.removesuffix("-process")
    num_requests = num_requests * workload_scale() * (3 if mode == "mirror" else 2) // 3
    plans = plan_workload(seed, num_requests, setup)
    pool_id = f"engine-{case}"
    config = {
        "kvcm": {
            "address": server.grpc_address,
            "pool_id": pool_id,
            "mode": mode,
            "labels": {"tenant": f"t-{case}-{mode}"},
            "shipper": shipper_kind,
        }
    }
    reference = build_engine(setup)
    mirrored = build_engine(setup, _kvcm_class(reference), config)
    try:
        tally = assert_same_runs(reference, mirrored, plans)
        manager = mirrored.scheduler.kv_cache_manager
        shipper = _shipper(mirrored)
        assert manager.flush(30.0), shipper.stats
        stats = shipper.stats
        print(f"{case} {mode}/{shipper_kind}: {tally.turns} turns, {tally.batches} batches")
        print(stats)
        assert stats.mismatches == 0
        assert stats.resyncs == 0
        assert stats.steps_verified == stats.steps_submitted == stats.steps_shipped
        assert stats.steps_submitted >= tally.batches > 50
        # At most one Step RPC per closed program, plus attaching (DescribePool, CreatePool).
        # Mirror mode closes at most one per schedule() (update_from_output()'s changes join
        # the next one) and coalesces what queued while a call was out; remote mode sends
        # one per allocate_slots (each answer waits).
        assert stats.rpcs == stats.step_rpcs + 2
        assert stats.step_rpcs <= stats.steps_submitted
        if mode == "remote":
            assert stats.step_rpcs == stats.steps_submitted
        if mode == "mirror":
            assert stats.steps_submitted <= tally.batches + 1
        assert server_pool_state(server, pool_id) == mirror_state(mirrored)
        # The pool carries the engine's labels; a router scoped by them finds it.
        with SchedulerClient(server.grpc_address) as client:
            labels = client.describe_pool(pool_id).config.labels
            assert labels["tenant"] == f"t-{case}-{mode}"
            assert labels["data_parallel_rank"] == "0"
            assert labels["model"]
            scoped = client.lookup(LookupQuery(token_ids=[1, 2, 3], labels=dict(labels)))
            assert [hit.pool_id for hit in scoped.pools] == [pool_id]
        # The server's kvcm_prefix_cache_* counters agree with vLLM's prefix-cache stats.
        if setup.log_stats and setup.enable_caching:
            assert tally.prefix_stats["queries"] > 0
            assert server_prefix_stats(server, pool_id) == tally.prefix_stats
    finally:
        mirrored.shutdown()
        reference.shutdown()


def test_the_server_copy_equals_the_mirror_after_every_step(
    server: EmbeddedServer, vllm: Any
) -> None:
    """Flushed after each turn, the server's pool equals the mirror's, turn for turn."""
    from kvcm.integrations.vllm import KvcmScheduler

    del vllm
    setup = Setup(num_blocks=100, sliding_window=32, retention_interval=None, max_model_len=512)
    plans = plan_workload(21, 40, setup)
    config = {"kvcm": {"address": server.grpc_address, "pool_id": "engine-every-step"}}
    mirrored = build_engine(setup, KvcmScheduler, config)
    try:
        shipper = _shipper(mirrored)
        compared = 0
        for record in run(mirrored, plans, record=False, max_steps=2000):
            # update_from_output()'s changes ship with the next step: flush them too.
            assert mirrored.scheduler.kv_cache_manager.flush(10.0), shipper.stats
            state = server_pool_state(server, "engine-every-step")
            assert state == mirror_state(mirrored), record.step
            compared += 1
        print(f"{compared} turns compared, {shipper.stats}")
        assert compared > 50
        assert shipper.stats.mismatches == 0
    finally:
        mirrored.shutdown()


def test_remote_mode_answers_nothing_the_server_has_not_acknowledged(
    server: EmbeddedServer, vllm: Any
) -> None:
    """Remote mode is the mirror with a sink that acknowledges each answer: when an
    ``allocate_slots`` returns to vLLM, the server has run its program (nothing is pending) and
    its pool equals the mirror's."""
    from kvcm.integrations.vllm import KvcmScheduler

    del vllm
    setup = Setup(num_blocks=70, sliding_window=32, retention_interval=None, max_model_len=512)
    plans = plan_workload(41, 12, setup)
    pool_id = "engine-remote-acks"
    config = {"kvcm": {"address": server.grpc_address, "pool_id": pool_id, "mode": "remote"}}
    mirrored = build_engine(setup, KvcmScheduler, config)
    manager = mirrored.scheduler.kv_cache_manager
    assert manager.sink.acknowledges_each_answer
    allocate = manager.allocate_slots
    answers: list[Any] = []

    def checked(*args: Any, **kwargs: Any) -> Any:
        blocks = allocate(*args, **kwargs)
        lag = manager.shipping_lag()
        assert lag is not None
        assert lag.backlog_steps == 0
        assert lag.last_acked_step_seq == lag.last_closed_step_seq == manager.recorder.num_steps
        assert server_pool_state(server, pool_id) == mirror_state(mirrored)
        answers.append(blocks)
        return blocks

    manager.allocate_slots = checked
    try:
        turns = sum(1 for _ in run(mirrored, plans, record=False, max_steps=2000))
        stats = _shipper(mirrored).stats
        print(f"{turns} turns, {len(answers)} answers, {stats}")
        assert len(answers) > 50
        assert any(blocks is None for blocks in answers)  # some did not fit: preemptions
        assert stats.mismatches == 0
        assert stats.resyncs == 0
    finally:
        mirrored.shutdown()


@pytest.mark.parametrize(
    ("mode", "shipper_kind", "engine_async"),
    [
        ("mirror", "thread", False),
        ("mirror", "process", True),
        ("remote", "thread", False),
    ],
    ids=["mirror-thread", "mirror-process-async", "remote"],
)
def test_a_streaming_session_ships_its_prompt_ends(
    mode: str, shipper_kind: str, engine_async: bool, server: EmbeddedServer, vllm: Any
) -> None:
    """A streaming-input session's later chunks move its prompt end on the server's copy
    (EXTEND_PROMPT) as vLLM moves it in the engine, flushed after every turn: the server's
    session holds vLLM's prompt tokens, every shipped step is verified, nothing is resynced,
    and the copies are equal after every turn, on a hybrid sliding-window model (whose
    replay boundaries read the prompt end)."""
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    del vllm
    setup = Setup(
        num_blocks=120,
        max_model_len=512,
        sliding_window=32,
        retention_interval=None,
        async_scheduling=engine_async,
    )
    pool_id = f"engine-session-{mode}-{shipper_kind}"
    config = {
        "kvcm": {
            "address": server.grpc_address,
            "pool_id": pool_id,
            "mode": mode,
            "shipper": shipper_kind,
        }
    }
    reference = build_engine(setup)
    mirrored = build_engine(setup, KvcmAsyncScheduler if engine_async else KvcmScheduler, config)
    manager = mirrored.scheduler.kv_cache_manager
    seen: set[int] = set()
    told: set[int] = set()

    async def server_session() -> tuple[int, list[int]] | None:
        pool = await server.server.state.pool(pool_id)
        for key, request_id in pool.request_ids.items():
            if request_id == "session":
                request = pool.requests[key]
                return request.num_prompt_tokens, list(request.prompt_token_ids)
        return None

    def after_turn(_turns: int, engine: Engine) -> None:
        assert manager.flush(10.0), _shipper(engine).stats
        assert server_pool_state(server, pool_id) == mirror_state(engine)
        request = engine.scheduler.requests.get("session")
        if request is not None:
            seen.add(request.num_prompt_tokens)
        found = server.call(server_session())
        if found is not None:
            end, prompt = found
            told.add(end)
            assert request is not None
            assert prompt == list(request.all_token_ids[:end])

    try:
        tally = assert_same_runs(
            reference, mirrored, plan_streaming_session(), after_turn=after_turn
        )
        stats = _shipper(mirrored).stats
        print(f"{mode}/{shipper_kind}: {tally.turns} turns, prompt ends {sorted(told)}, {stats}")
        assert stats.mismatches == 0
        assert stats.resyncs == 0
        assert stats.steps_verified == stats.steps_submitted
        assert len(seen) >= 3
        assert told == seen
    finally:
        mirrored.shutdown()
        reference.shutdown()


def _fault_run(
    server_address: str,
    faults: dict[int, Callable[[Engine], None]],
    *,
    max_backlog: int = 4096,
    shipper: str = "thread",
) -> tuple[Engine, int]:
    """Run vLLM's engine and kvcm's side by side; after turn ``n`` call ``faults[n]`` with
    kvcm's engine. Every turn must stay identical to vLLM's. Returns kvcm's engine (not shut
    down) and the number of turns."""
    from kvcm.integrations.vllm import KvcmScheduler

    setup = Setup(num_blocks=60, max_model_len=512)
    plans = plan_workload(31, 50, setup)
    config = {
        "kvcm": {
            "address": server_address,
            "pool_id": "engine-faults",
            "max_backlog": max_backlog,
            "step_timeout_s": 2,
            "shipper": shipper,
        }
    }
    reference = build_engine(setup)
    mirrored = build_engine(setup, KvcmScheduler, config)

    def after_turn(turns: int, engine: Engine) -> None:
        fault = faults.get(turns)
        if fault is not None:
            fault(engine)

    try:
        tally = assert_same_runs(reference, mirrored, plans, after_turn=after_turn)
    except BaseException:
        mirrored.shutdown()
        raise
    finally:
        reference.shutdown()
    assert tally.turns > max(faults)
    return mirrored, tally.turns


@pytest.mark.parametrize("shipper", ["thread", "process"])
def test_a_pool_deleted_mid_run_is_recreated_from_the_mirror(
    shipper: str, server: EmbeddedServer, vllm: Any
) -> None:
    """An operator deletes the pool twice: the engine never notices, the server converges."""
    del vllm
    with SchedulerClient(server.grpc_address) as client:

        def delete(engine: Engine) -> None:
            assert engine.scheduler.kv_cache_manager.flush(10.0)  # the pool exists by now
            client.delete_pool("engine-faults")

        mirrored, num_turns = _fault_run(
            server.grpc_address, {40: delete, 120: delete}, shipper=shipper
        )
    try:
        sink = _shipper(mirrored)
        assert mirrored.scheduler.kv_cache_manager.flush(30.0), sink.stats
        stats = sink.stats
        print(f"{num_turns} turns, {stats}")
        assert stats.resyncs == 2
        assert stats.mismatches == 0
        assert server_pool_state(server, "engine-faults") == mirror_state(mirrored)
    finally:
        mirrored.shutdown()


def test_a_server_restarted_mid_run_is_resynchronised_and_a_backlog_overflow_too(
    vllm: Any,
) -> None:
    """The server dies (its pools with it) and comes back on the same port; later it is
    unreachable for longer than the backlog holds. The engine schedules as vLLM throughout."""
    del vllm
    servers = [start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))]
    address = servers[0].grpc_address

    def restart(engine: Engine) -> None:
        assert engine.scheduler.kv_cache_manager.flush(10.0)
        servers[0].stop()
        servers[0] = start_embedded_server(ServerSettings(grpc_address=address, http_address=""))

    def stop(engine: Engine) -> None:
        assert engine.scheduler.kv_cache_manager.flush(10.0)
        servers[0].stop()

    def start(engine: Engine) -> None:
        del engine
        servers[0] = start_embedded_server(ServerSettings(grpc_address=address, http_address=""))

    try:
        mirrored, num_turns = _fault_run(
            address, {30: restart, 80: stop, 100: start}, max_backlog=8
        )
        try:
            shipper = _shipper(mirrored)
            assert mirrored.scheduler.kv_cache_manager.flush(30.0), shipper.stats
            stats = shipper.stats
            print(f"{num_turns} turns, {stats}")
            assert stats.backlog_overflows >= 1
            assert stats.resyncs >= 2
            assert stats.mismatches == 0
            assert server_pool_state(servers[0], "engine-faults") == mirror_state(mirrored)
        finally:
            mirrored.shutdown()
    finally:
        servers[0].stop()


def test_a_killed_shipper_process_is_replaced_and_the_pool_resynchronised(
    server: EmbeddedServer, vllm: Any
) -> None:
    """``shipper: process``: the child is killed with SIGKILL twice mid-run, once with steps
    in its pipe and once idle. The engine keeps scheduling exactly as vLLM's; at its next
    step boundaries it starts a new child and reseeds it from a snapshot of the mirror; what
    the server acknowledged before stays, and the server's copy ends equal to the mirror's."""
    del vllm
    from kvcm.integrations.vllm._procship import ProcessStepShipper

    pids: list[int] = []
    acked_before: list[int] = []

    def kill(engine: Engine) -> None:
        sink = _shipper(engine)
        assert isinstance(sink, ProcessStepShipper)
        pid = sink.pid
        assert pid is not None
        lag = sink.lag()
        acked_before.append(lag.last_acked_step_seq)
        os.kill(pid, signal.SIGKILL)
        pids.append(pid)

    def kill_idle(engine: Engine) -> None:
        assert engine.scheduler.kv_cache_manager.flush(10.0)
        kill(engine)

    def resynced(engine: Engine) -> None:
        # The second child is up and has repaired the pool (its start takes ~1-3 s);
        # the next turns' steps are then in its pipe or its backlog when it is killed.
        assert engine.scheduler.kv_cache_manager.flush(30.0)
        assert _shipper(engine).stats.resyncs == 1

    mirrored, num_turns = _fault_run(
        server.grpc_address, {50: kill_idle, 105: resynced, 110: kill}, shipper="process"
    )
    try:
        sink = _shipper(mirrored)
        manager = mirrored.scheduler.kv_cache_manager
        assert manager.flush(30.0), sink.stats
        stats = sink.stats
        print(f"{num_turns} turns, {sink.child_restarts} restarts, {stats}")
        assert len(pids) == 2
        assert sink.pid is not None
        assert sink.pid not in pids
        assert sink.child_restarts == 2
        assert stats.resyncs == 2
        assert stats.mismatches == 0
        assert 0 < acked_before[0] < acked_before[1]
        lag = sink.lag()
        assert lag.backlog_steps == 0
        assert lag.last_acked_step_seq == lag.last_closed_step_seq == manager.recorder.num_steps
        assert server_pool_state(server, "engine-faults") == mirror_state(mirrored)
    finally:
        mirrored.shutdown()
    assert sink.pid is None  # shut down with the scheduler
