"""vLLM 0.33's real Scheduler and AsyncScheduler on kvcm's mirror, step for step against vLLM.

Each case builds vLLM's scheduler twice from the same config, once as vLLM ships it and once
through ``scheduler_cls`` (KvcmScheduler / KvcmAsyncScheduler), drives both with the same
seeded workload through a simulated engine (tests/compat/_vllm_engine.py), and compares every
step's SchedulerOutput, engine outputs (stats included) and published KV events. The kvcm side
also runs every Step program it recorded through kvcm's one interpreter (``Pool.run_step``) on
a fresh pool with the same explicit layout, and checks after every step that it answered what
the mirror answered and that the pool's blocks, free queue, prefix cache and block tables equal
the mirror's.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import pytest
from _program_replay import ProgramReplayer, pool_state
from _vllm_engine import Setup, build_scheduler, plan_workload, run

from kvcm.common.errors import ConfigError
from kvcm.core.manager import KVCacheManager
from kvcm.core.pool import Pool
from kvcm.core.pool_types import PoolConfig


class ReplayCheckingSink:
    """Runs each closed step through ``Pool.run_step`` on a fresh pool; compares with the mirror."""

    def __init__(self) -> None:
        self.mirror: Any = None
        self.replayer: ProgramReplayer | None = None
        self.pool: Pool | None = None
        self.interpreter_error: str | None = None
        self.num_interpreted = 0
        self.num_steps = 0
        self.num_ops = 0
        self.closed = False

    def _make_pool(self) -> Pool:
        config = self.mirror.core.config
        return Pool(
            "replay",
            PoolConfig(
                max_model_len=config.max_model_len,
                explicit_layout=config.kv_cache_config,
                scheduler_block_size=config.scheduler_block_size,
                hash_block_size=config.hash_block_size,
                max_in_flight_tokens=config.max_in_flight_tokens,
                enable_caching=config.enable_caching,
                enable_kv_cache_events=config.enable_kv_cache_events,
                log_stats=config.log_stats,
                watermark=config.watermark,
            ),
        )

    def submit(self, step: Any) -> None:
        core = self.mirror.core
        if self.replayer is None:
            self.replayer = ProgramReplayer(KVCacheManager(core.config))
            self.pool = self._make_pool()
        outcome = self.replayer.run(step.program)
        assert outcome == step.expected, f"step {step.program.step_seq}: answers differ"
        request_ids = [r.request_id for r in self.replayer.requests.values()]
        assert pool_state(self.replayer.manager, request_ids) == pool_state(core, request_ids), (
            f"step {step.program.step_seq}: the replayed pool drifted from the mirror"
        )
        if self.interpreter_error is None:
            self._interpret(step, core, request_ids)
        self.num_steps += 1
        self.num_ops += len(step.program.ops)

    def _interpret(self, step: Any, core: Any, request_ids: list[str]) -> None:
        # The real interpreter; its first disagreement is kept (not raised) so the comparison
        # with vLLM goes on, and the test decides what it expects per case.
        pool = self.pool
        assert pool is not None
        assert pool.manager is not None
        seq = step.program.step_seq
        try:
            outcome = pool.run_step(step.program)
        except Exception as exc:
            self.interpreter_error = f"step {seq}: refused: {exc}"
            return
        if outcome != step.expected:
            self.interpreter_error = f"step {seq}: answers differ"
            return
        keys = {rid: str(key) for key, rid in pool.request_ids.items()}
        state = pool_state(pool.manager, [])
        state["tables"] = {
            rid: pool.manager.get_block_ids(key)
            for rid, key in sorted(keys.items())
            if pool.manager.holds_blocks(key)
        }
        if state != pool_state(core, sorted(set(request_ids) | set(keys))):
            self.interpreter_error = f"step {seq}: the interpreted pool drifted from the mirror"
            return
        self.num_interpreted += 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def kvcm_classes(vllm: ModuleType) -> tuple[type, type]:
    """Test subclasses of kvcm's schedulers whose programs go to a ReplayCheckingSink."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    del vllm
    init_none_hash(sha256)

    def make_step_sink(self: Any, settings: Any) -> ReplayCheckingSink:
        del self, settings
        return ReplayCheckingSink()

    sync_cls = type("CheckedKvcmScheduler", (KvcmScheduler,), {"make_step_sink": make_step_sink})
    async_cls = type(
        "CheckedKvcmAsyncScheduler", (KvcmAsyncScheduler,), {"make_step_sink": make_step_sink}
    )
    return sync_cls, async_cls


# Prefix-cache resets (step -> reset_running_requests) made in every case: one that fails
# while requests hold blocks, one that preempts everything and succeeds.
RESETS = {40: False, 120: True}

CASES = {
    # name: (setup, seed, number of requests)
    "prefix-hits-chunked": (Setup(), 1, 120),
    "preemption": (Setup(num_blocks=40), 2, 120),
    "async-preemption": (Setup(num_blocks=40, async_scheduling=True), 3, 120),
    "lora-salts": (Setup(lora=True, num_blocks=60), 4, 100),
    "hybrid-swa": (Setup(sliding_window=64, num_blocks=80), 5, 100),
    "hybrid-swa-async-watermark": (
        Setup(sliding_window=32, num_blocks=100, async_scheduling=True, watermark=0.05),
        6,
        100,
    ),
    "caching-off": (Setup(enable_caching=False, num_blocks=50), 7, 100),
    "no-stats": (Setup(log_stats=False, num_blocks=48, max_num_batched_tokens=128), 8, 100),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_schedules_equal_vllm(case: str, kvcm_classes: tuple[type, type]) -> None:
    """Every step's output, engine output and events equal vLLM's; programs replay exactly."""
    setup, seed, num_requests = CASES[case]
    plans = plan_workload(seed, num_requests, setup)
    reference = build_scheduler(setup)
    mirrored = build_scheduler(setup, kvcm_classes[1 if setup.async_scheduling else 0])
    sink = mirrored.kv_cache_manager.recorder.sink
    sink.mirror = mirrored.kv_cache_manager
    num_steps = num_events = 0
    preempted = hits = 0
    for expected, actual in zip(
        run(reference, plans, resets=RESETS), run(mirrored, plans, resets=RESETS), strict=True
    ):
        step, output, engine, events = expected
        assert actual[0] == step
        assert actual[1] == output, f"step {step}: SchedulerOutput differs"
        assert actual[2] == engine, f"step {step}: engine outputs differ"
        assert actual[3] == events, f"step {step}: KV events differ"
        num_steps += 1
        num_events += len(events)
        preempted += len(output["preempted_req_ids"] or ())
        hits += sum(r["num_computed_tokens"] > 0 for r in output["scheduled_new_reqs"])
    mirrored.shutdown()
    reference.shutdown()
    assert sink.closed
    # Pool.run_step (the server's interpreter) ran every recorded program and agreed with the
    # mirror after every step.
    print(f"{case}: {sink.num_interpreted}/{sink.num_steps} steps verified on Pool.run_step")
    assert sink.interpreter_error is None, sink.interpreter_error
    assert sink.num_interpreted == sink.num_steps
    # The workload exercised what the case is about, and the replay saw every step.
    assert num_steps > 50
    assert sink.num_steps >= num_steps
    if setup.enable_caching:
        assert hits > 0
        assert num_events > 0
    if case.endswith("preemption"):
        assert preempted > 0


def test_kvcm_manager_replaces_vllms(kvcm_classes: tuple[type, type]) -> None:
    """The scheduler holds kvcm's mirror of the real size; vLLM's placeholder was tiny."""
    from kvcm.integrations.vllm import MirrorKVCacheManager

    setup = Setup(num_blocks=321)
    scheduler = build_scheduler(setup, kvcm_classes[0])
    manager = scheduler.kv_cache_manager
    assert isinstance(manager, MirrorKVCacheManager)
    assert scheduler.kv_cache_config.num_blocks == 321
    assert manager.core.kv_cache_config.num_blocks == 321
    assert manager.block_pool.get_num_free_blocks() == 320
    assert [m.block_size for m in manager.coordinator.single_type_managers] == [16]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"additional_config": {"kvcm": {"mode": "remote"}}}, "mode 'remote' needs an address"),
        ({"additional_config": {"kvcm": {"mode": "later"}}}, "mode must be one of"),
        ({"additional_config": {"kvcm": {"pool": "x"}}}, "unknown keys"),
        ({"async_scheduling": True}, "KvcmAsyncScheduler, or pass --no-async-scheduling"),
    ],
)
def test_refused_at_construction(
    change: dict[str, Any], message: str, kvcm_classes: tuple[type, type]
) -> None:
    """Settings kvcm cannot honour are refused when vLLM constructs the scheduler."""
    from kvcm.integrations.vllm import KvcmScheduler

    del kvcm_classes
    with pytest.raises(ConfigError, match=message):
        build_scheduler(
            Setup(async_scheduling=change.get("async_scheduling", False)),
            KvcmScheduler,
            change.get("additional_config"),
        )


def test_unsupported_spec_refused(kvcm_classes: tuple[type, type]) -> None:
    """A KV-cache spec kvcm does not model (Mamba) is refused before vLLM builds anything."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvcm.integrations.vllm._convert import convert_kv_cache_config

    del kvcm_classes
    spec = MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(torch.float16,))
    config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["m"], spec)]
    )
    with pytest.raises(ConfigError, match="MambaSpec"):
        convert_kv_cache_config(config)
    assert dataclasses.is_dataclass(config)
