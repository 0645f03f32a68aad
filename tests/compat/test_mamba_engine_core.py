"""vLLM's real EngineCore serving a hybrid full attention + Mamba model with prefix caching, once
on vLLM's own scheduler and once on kvcm's (mirror mode), compared turn by turn.

The simulated workers report the layer specs of a hybrid model in vLLM's Mamba "align" mode
(what vLLM picks for hybrid Mamba models with prefix caching on): a full-attention layer and
a Mamba layer, both with 256-token blocks (the Mamba state page padded to the attention page,
as vLLM unifies them), and ``--prefix-match-unit 64``. EngineCore resolves the hash block size
(64), the scheduler block size (256) and the hit alignment (64: sub-block hits); vLLM's
scheduler then splits prefill chunks at Mamba checkpoints, and hits ending inside a Mamba block
are served through block copies that travel in ``SchedulerOutput.kv_cache_block_copies``.
Every turn's ``SchedulerOutput`` (block ids and copies included), engine outputs (stats
included) and KV events must be equal.
"""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest
from _engine_core import (
    HEAD_SIZE,
    NUM_KV_HEADS,
    VOCAB,
    Engine,
    RequestPlan,
    Setup,
    SimulatedWorker,
    assert_same_runs,
    executor_class,
    vllm_config,
    workload_scale,
)

MAMBA_BLOCK = 256
HASH_BLOCK = 64


def _layer_specs(block_size: int) -> dict[str, Any]:
    # Layer 0 full attention, layer 1 a Mamba mixer in align mode (its page padded to the
    # attention page, as vLLM unifies the pages of a hybrid model).
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    attention = FullAttentionSpec(
        block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16
    )
    mamba = MambaSpec(
        block_size=MAMBA_BLOCK,
        shapes=((4, 32), (8, 16)),
        dtypes=(torch.float16, torch.float32),
        page_size_padded=attention.page_size_bytes,
        mamba_cache_mode="align",
    )
    return {"model.layers.0.self_attn.attn": attention, "model.layers.1.mixer": mamba}


class _HybridMambaWorker(SimulatedWorker):
    """Reports the hybrid model's layer specs."""

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return _layer_specs(self.vllm_config.cache_config.block_size)


def _build(
    setup: Setup,
    scheduler_cls: Any = None,
    match_unit: int = HASH_BLOCK,
    additional_config: Any = None,
) -> Engine:
    from vllm.v1.engine.core import EngineCore

    base = executor_class(setup)

    def init_executor(self: Any) -> None:
        base._init_executor(self)
        world = self.vllm_config.parallel_config.world_size
        self.workers = [_HybridMambaWorker(self.vllm_config, r, setup) for r in range(world)]

    executor = type("HybridMambaExecutor", (base,), {"_init_executor": init_executor})
    config = vllm_config(setup, scheduler_cls, additional_config)
    # What vLLM's hybrid-model config sets with prefix caching on, and the user's prefix
    # match unit (EngineCore resolves the hash block size and hit alignment from them).
    config.cache_config.mamba_cache_mode = "align"
    config.cache_config.mamba_block_size = MAMBA_BLOCK
    config.cache_config.prefix_match_unit = match_unit
    config.parallel_config.distributed_executor_backend = executor
    core = EngineCore(config, executor, setup.log_stats)
    return Engine(core, setup)


def _plans(seed: int, num_requests: int, max_len: int) -> list[RequestPlan]:
    # Shared prefixes of every length (hits at hash boundaries inside Mamba blocks), exact
    # resends (hits at the prompt's tail boundary), long prompts (chunked at checkpoints).
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(VOCAB) for _ in range(max_len)) for _ in range(3)]
    plans: list[RequestPlan] = []
    step = 0
    for index in range(num_requests):
        step += rng.choice((0, 1, 1, 2, 3))
        if plans and rng.random() < 0.2:
            prompt = rng.choice(plans).prompt
        else:
            shared = rng.choice(prefixes)[: rng.randrange(0, max_len // 2)]
            own = tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 300)))
            prompt = (shared + own)[: max_len // 2 + 200]
        plans.append(
            RequestPlan(
                arrival_step=step,
                request_id=f"r{index}",
                prompt=prompt,
                max_tokens=rng.choice((1, 8, 30, 80)),
            )
        )
    return plans


CASES = {
    "sync": Setup(
        block_size=MAMBA_BLOCK,
        num_blocks=60,
        max_model_len=2048,
        max_num_batched_tokens=512,
        max_num_seqs=8,
    ),
    "async-pressure": Setup(
        block_size=MAMBA_BLOCK,
        num_blocks=30,
        max_model_len=2048,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        async_scheduling=True,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hybrid_mamba_engine_turns_equal_vllm(case: str, vllm: ModuleType) -> None:
    """kvcm's scheduler answers EngineCore exactly as vLLM's, sub-block hits and copies too."""
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    del vllm
    setup = CASES[case]
    plans = _plans(len(case), 32 * workload_scale(), setup.max_model_len)
    reference = _build(setup)
    kvcm_cls = KvcmAsyncScheduler if setup.async_scheduling else KvcmScheduler
    mirrored = _build(setup, kvcm_cls)
    copies = {"n": 0}
    try:
        ref_config = reference.scheduler.kv_cache_config
        assert mirrored.scheduler.kv_cache_config == ref_config
        assert ref_config.hash_block_size == HASH_BLOCK
        assert ref_config.cache_hit_alignment_tokens == HASH_BLOCK
        assert reference.scheduler.mamba_partial_cache_hit
        assert mirrored.scheduler.mamba_partial_cache_hit
        manager = mirrored.scheduler.kv_cache_manager
        assert manager.coordinator.enable_partial_hash_hits
        original = manager.take_kv_cache_block_copies

        def counting() -> tuple[list[Any], list[Any]]:
            found = original()
            copies["n"] += len(found[0])
            return found

        manager.take_kv_cache_block_copies = counting
        tally = assert_same_runs(reference, mirrored, plans)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    print(
        f"{case}: {tally.turns} turns, {tally.batches} batches, {tally.events} events, "
        f"{tally.hits} hits, {copies['n']} block copies, {tally.preempted} preemptions"
    )
    assert tally.batches > 50
    assert tally.hits > 0
    assert copies["n"] > 0
    assert tally.finished == len(plans)


@pytest.mark.parametrize("match_unit", [MAMBA_BLOCK, HASH_BLOCK])
def test_align_mode_programs_replay_on_the_server_interpreter(
    match_unit: int, vllm: ModuleType
) -> None:
    """The Step programs the mirror records replay on ``Pool.run_step`` (a kvcm server's
    interpreter) to the mirror's state after every step, while the engine matches vLLM's:
    with one hash block per Mamba block (no sub-block hits), and with sub-block hits, whose
    copies the programs drain (TAKE_BLOCK_COPIES) where vLLM's scheduler drains them. Every
    answer's drained copies equal the mirror's; and the same steps coalesced three at a time
    (as a shipper catching up sends them) drain the same copies in the same order, each drain
    counted apart, and leave a second pool equal to the first at every batch's end."""
    from _program_replay import pool_state
    from test_vllm_scheduler import ReplayCheckingSink

    from kvcm.integrations.vllm import KvcmScheduler
    from kvcm.integrations.vllm._shipper import coalesce, outcomes_agree

    del vllm

    def state_of(pool: Any) -> dict[str, Any]:
        state = pool_state(pool.manager, [])
        state["tables"] = {
            key: pool.manager.get_block_ids(request.request_id)
            for key, request in sorted(pool.requests.items())
            if pool.manager.holds_blocks(request.request_id)
        }
        return state

    class PoolSink(ReplayCheckingSink):
        # Only the real interpreter (Pool.run_step), compared with the mirror after each step.
        coalesced_pool: Any = None
        batch: list[Any]
        num_drains = num_coalesced_drains = num_batches = 0

        def submit(self, step: Any) -> None:
            core = self.mirror.core
            if self.pool is None:
                self.pool = self._make_pool()
                self.coalesced_pool = self._make_pool()
                self.batch = []
            if self.interpreter_error is None:
                self._interpret(step, core, sorted(core.requests_holding_blocks))
                answer = self.pool.last_step_outcome
                if self.interpreter_error is None and not outcomes_agree(step.expected, answer):
                    self.interpreter_error = f"step {step.step_seq}: drained copies differ"
                self.num_drains += len(step.expected.drained_num_copies)
            self.batch.append(step)
            if len(self.batch) == 3 and self.interpreter_error is None:
                program, expected = coalesce(self.batch)
                self.batch = []
                answer = self.coalesced_pool.run_step(program)
                if not outcomes_agree(expected, answer):
                    self.interpreter_error = f"steps to {program.step_seq}: coalesced answers"
                elif state_of(self.coalesced_pool) != state_of(self.pool):
                    self.interpreter_error = f"steps to {program.step_seq}: coalesced pool"
                self.num_coalesced_drains += len(answer.drained_num_copies)
                self.num_batches += 1
            self.num_steps += 1
            self.num_ops += len(step.program.ops)

    def make_step_sink(self: Any, settings: Any) -> ReplayCheckingSink:
        del self, settings
        return PoolSink()

    checked = type("ReplayedKvcmScheduler", (KvcmScheduler,), {"make_step_sink": make_step_sink})
    setup = CASES["sync"]
    plans = _plans(7, 24 * workload_scale(), setup.max_model_len)
    reference = _build(setup, match_unit=match_unit)
    mirrored = _build(setup, checked, match_unit=match_unit)
    try:
        assert mirrored.scheduler.mamba_partial_cache_hit == (match_unit < MAMBA_BLOCK)
        sink = mirrored.scheduler.kv_cache_manager.recorder.sink
        sink.mirror = mirrored.scheduler.kv_cache_manager
        tally = assert_same_runs(reference, mirrored, plans)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    print(
        f"align replay: {tally.turns} turns, {tally.hits} hits; "
        f"{sink.num_interpreted}/{sink.num_steps} steps verified on Pool.run_step, "
        f"{sink.num_drains} drains; {sink.num_batches} coalesced batches, "
        f"{sink.num_coalesced_drains} drains in them"
    )
    assert tally.hits > 0
    assert sink.interpreter_error is None, sink.interpreter_error
    assert sink.num_interpreted == sink.num_steps > 50
    assert sink.num_batches == sink.num_steps // 3
    if match_unit < MAMBA_BLOCK:
        assert sink.num_coalesced_drains > 0
