"""The shipping thread works between the engine's scheduler calls (``EngineTurns``).

vLLM's real ``EngineCore`` on ``KvcmAsyncScheduler`` with a kvcm server on 127.0.0.1. Every
unit of the shipping thread's work (building a batch, a Step call) is watched as it starts:
with a model that takes time (the engine asleep after every turn, as a GPU engine waits for
its batch), none starts while the engine is inside ``schedule()`` or
``update_from_output()``, unless the oldest unshipped step waited past the deferral bound;
an engine that never leaves the scheduler still has its steps shipped, after that bound.
Either way every step is verified and the server's copy equals the mirror's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from _engine_core import Setup, build_engine, plan_workload, run
from _program_replay import pool_state

from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

_SETUP = Setup(num_blocks=120, max_model_len=512, async_scheduling=True)


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A kvcm server on 127.0.0.1 (gRPC only)."""
    embedded = start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    try:
        yield embedded
    finally:
        embedded.stop()


def _engine(server: EmbeddedServer, pool_id: str) -> Any:
    from kvcm.integrations.vllm import KvcmAsyncScheduler

    config = {"kvcm": {"address": server.grpc_address, "pool_id": pool_id}}
    return build_engine(_SETUP, KvcmAsyncScheduler, config)


def _watch(shipper: Any, since_leave: list[float] | None = None) -> list[tuple[str, bool, float]]:
    """Each unit of work the shipping thread starts: (what, engine inside the scheduler,
    age of the oldest unshipped step); with ``since_leave``, also the seconds since the engine
    last left a scheduler call when each batch build started. The real calls run unchanged."""
    starts: list[tuple[str, bool, float]] = []

    def oldest_age() -> float:
        backlog = list(shipper._backlog)
        return time.monotonic() - backlog[0].closed_at if backlog else 0.0

    build, step = shipper._next_batch, shipper._client.step

    def watched_build() -> Any:
        if since_leave is not None:
            since_leave.append(time.perf_counter() - shipper.turns.left_at)
        starts.append(("build", shipper.turns.busy, oldest_age()))
        return build()

    def watched_step(*args: Any, **kwargs: Any) -> Any:
        starts.append(("step", shipper.turns.busy, oldest_age()))
        return step(*args, **kwargs)

    shipper._next_batch = watched_build
    shipper._client.step = watched_step
    return starts


def _server_equals_mirror(server: EmbeddedServer, engine: Any, pool_id: str) -> None:
    async def read() -> dict[str, Any]:
        pool = await server.server.state.pool(pool_id)
        return pool_state(pool.ready_manager(), [])

    manager = engine.scheduler.kv_cache_manager
    assert manager.flush(10.0)
    assert server.call(read()) == pool_state(manager.core, [])


def test_no_shipping_work_starts_inside_the_engine_s_scheduler_calls(
    server: EmbeddedServer, vllm: Any
) -> None:
    """A model that takes 3 ms: every build and Step call starts while the engine waits.

    Each ``update_from_output()`` also sleeps 2 ms inside (in the manager's ``take_events``),
    releasing the interpreter lock there: a shipping thread that ignored the marks would
    start work inside those calls (it does: the check fails without the marks)."""
    del vllm
    from kvcm.integrations.vllm._shipper import FRESH_S, MAX_DEFER_S

    engine = _engine(server, "turns-model-time")
    try:
        manager = engine.scheduler.kv_cache_manager
        shipper = manager.recorder.sink
        assert engine.scheduler._kvcm_turns is shipper.turns
        take_events = manager.take_events

        def slow_take_events() -> Any:
            time.sleep(0.002)
            return take_events()

        manager.take_events = slow_take_events
        since_leave: list[float] = []
        starts = _watch(shipper, since_leave)
        turns = 0
        for _ in run(engine, plan_workload(31, 30, _SETUP), record=False, max_steps=3000):
            time.sleep(0.003)  # the engine waits for its model, outside the scheduler
            turns += 1
        during = list(since_leave)
        _server_equals_mirror(server, engine, "turns-model-time")
        stats = shipper.stats
        print(f"{turns} turns, {len(starts)} units of work started, {stats}")
        assert turns > 50
        assert stats.steps_verified == stats.steps_submitted > 50
        assert stats.mismatches == 0
        assert sum(what == "step" for what, _, _ in starts) >= stats.step_rpcs > 5
        inside = [start for start in starts if start[1]]
        # Only a step that waited past the bound (a loaded machine) ships during a call.
        assert all(age >= MAX_DEFER_S * 0.9 for _, _, age in inside), inside
        # Builds start at the beginning of a wait (within FRESH_S of the engine's leave), not
        # late in it where the engine's next call would wait for them; a loaded machine may
        # push a few past it (the deferral bound, or a wake that came late).
        late = [gap for gap in during if gap > FRESH_S]
        assert len(late) <= max(2, len(during) // 10), (len(during), sorted(late))
    finally:
        engine.shutdown()


def test_an_engine_that_never_leaves_the_scheduler_is_shipped_after_the_bound(
    server: EmbeddedServer, vllm: Any
) -> None:
    """The engine marked inside the scheduler throughout: the steps still ship, each unit
    once the oldest step waited the deferral bound, without a flush."""
    del vllm
    from kvcm.integrations.vllm._shipper import MAX_DEFER_S

    engine = _engine(server, "turns-never-leaves")
    try:
        scheduler = engine.scheduler
        shipper = scheduler.kv_cache_manager.recorder.sink
        scheduler._kvcm_turns = None  # the engine's own marks no longer reach the shipper
        shipper.turns.enter()  # ... which sees it inside the scheduler from now on
        starts = _watch(shipper)
        plans = plan_workload(32, 12, _SETUP)
        closed = 0
        for _ in run(engine, plans, record=False, max_steps=40):
            time.sleep(0.002)
            closed += 1
        deadline = time.monotonic() + 10.0
        while shipper.lag().backlog_steps and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shipper.lag().backlog_steps == 0, shipper.lag()
        assert closed == 40
        assert starts, "nothing was shipped"
        assert all(busy for _, busy, _ in starts)
        assert all(age >= MAX_DEFER_S * 0.99 for _, _, age in starts), starts
        shipper.turns.leave()
        _server_equals_mirror(server, engine, "turns-never-leaves")
        assert shipper.stats.mismatches == 0
    finally:
        engine.shutdown()
