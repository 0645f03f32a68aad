"""vLLM's real EngineCore with n-gram speculative decoding, once on vLLM's own scheduler and
once on kvcm's, compared turn by turn.

The simulated executor (tests/compat/_engine_core.py) verifies the scheduled draft tokens
against the simulated model's tokens (accepting a run, rejecting the rest) and proposes new
drafts through ``take_draft_token_ids``, as vLLM's n-gram drafter does in the model runner;
EngineCore hands them to the scheduler (``update_draft_token_ids``), which schedules them as
speculative tokens, allocates their slots and rolls rejected tokens back. Every turn's
``SchedulerOutput`` (``scheduled_spec_decode_tokens`` included), engine outputs (spec-decoding
stats included) and KV events must be equal, on a full-attention model (mirror mode, its
programs replayed on the server's interpreter, and remote mode through a real kvcm server)
and on a hybrid full-attention + Mamba model in align mode, whose Mamba group holds
``num_speculative_tokens`` speculative state blocks per request (vLLM's
``MambaSpec.num_speculative_blocks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from _engine_core import (
    Engine,
    Setup,
    assert_same_runs,
    build_engine,
    executor_class,
    plan_workload,
    vllm_config,
    workload_scale,
)

NUM_SPEC = 3


def _spec_counts(engine: Engine) -> dict[str, int]:
    return dict(engine.scheduler.kvcm_spec_counts)


def _counting(cls: type) -> type:
    # Counts the scheduled draft tokens (the workload must exercise them).
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = cls.schedule(self, *args, **kwargs)
        counts = self.__dict__.setdefault("kvcm_spec_counts", {"drafts": 0, "steps": 0})
        drafts = sum(len(t) for t in output.scheduled_spec_decode_tokens.values())
        counts["drafts"] += drafts
        counts["steps"] += bool(drafts)
        return output

    return type(f"Counting{cls.__name__}", (cls,), {"schedule": schedule})


@pytest.fixture
def server() -> Iterator[Any]:
    """A kvcm server on 127.0.0.1 (gRPC only)."""
    from kvcm.server.embedded import start_embedded_server
    from kvcm.server.settings import ServerSettings

    embedded = start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    try:
        yield embedded
    finally:
        embedded.stop()


FULL = Setup(num_blocks=60, max_model_len=512, num_speculative_tokens=NUM_SPEC)


def test_ngram_engine_turns_equal_vllm_mirror_replayed(vllm: ModuleType) -> None:
    """Mirror mode: every turn equals vLLM's; Pool.run_step replays every program exactly."""
    from test_vllm_scheduler import ReplayCheckingSink

    from kvcm.integrations.vllm import KvcmScheduler

    del vllm

    def make_step_sink(self: Any, settings: Any) -> ReplayCheckingSink:
        del self, settings
        return ReplayCheckingSink()

    checked = type("CheckedKvcmScheduler", (KvcmScheduler,), {"make_step_sink": make_step_sink})
    plans = plan_workload(21, 40 * workload_scale(), FULL)
    reference = build_engine(FULL)
    mirrored = build_engine(FULL, _counting(checked))
    try:
        assert reference.core.vllm_config.speculative_config.method == "ngram"
        assert mirrored.scheduler.num_spec_tokens == reference.scheduler.num_spec_tokens
        sink = mirrored.scheduler.kv_cache_manager.recorder.sink
        sink.mirror = mirrored.scheduler.kv_cache_manager
        tally = assert_same_runs(reference, mirrored, plans, resets={40: False, 120: True})
        counts = _spec_counts(mirrored)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    print(
        f"ngram full attention, mirror: {tally.turns} turns, {tally.batches} batches, "
        f"{tally.events} events, {tally.hits} hits, {tally.preempted} preemptions, "
        f"{counts['drafts']} draft tokens in {counts['steps']} steps; "
        f"{sink.num_interpreted}/{sink.num_steps} steps verified on Pool.run_step"
    )
    assert sink.interpreter_error is None, sink.interpreter_error
    assert sink.num_interpreted == sink.num_steps >= tally.batches > 50
    assert counts["drafts"] > 100
    assert tally.hits > 0
    assert tally.preempted > 0


REMOTE = {
    "ngram-sync": dataclasses.replace(FULL, num_blocks=50),
    "draft-model-async": dataclasses.replace(
        FULL, num_blocks=50, speculative_method="draft_model", async_scheduling=True
    ),
    "eagle-async": dataclasses.replace(
        FULL, num_blocks=50, speculative_method="eagle", async_scheduling=True
    ),
    "eagle3-drop-sync": dataclasses.replace(
        FULL, num_blocks=50, speculative_method="eagle3", disable_lookahead_block_hashes=True
    ),
}


@pytest.mark.parametrize("case", sorted(REMOTE))
def test_engine_turns_equal_vllm_remote(case: str, server: Any, vllm: ModuleType) -> None:
    """Remote mode: each allocation (draft slots included) answered by a real kvcm server
    equals vLLM's; the server's pool ends equal to the engine's mirror. Under async
    scheduling the server's Step validation takes computed tokens running ahead of the known
    ones by the tokens in flight (unverified drafts)."""
    from _program_replay import pool_state
    from test_vllm_shipping import server_pool_state

    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    del vllm
    setup = REMOTE[case]
    plans = plan_workload(22, 30 * workload_scale(), setup)
    config = {"kvcm": {"address": server.grpc_address, "pool_id": "spec", "mode": "remote"}}
    reference = build_engine(setup)
    kvcm_cls = KvcmAsyncScheduler if setup.async_scheduling else KvcmScheduler
    mirrored = build_engine(setup, _counting(kvcm_cls), config)
    try:
        tally = assert_same_runs(reference, mirrored, plans)
        manager = mirrored.scheduler.kv_cache_manager
        shipper = manager.recorder.sink
        assert manager.flush(30.0), shipper.stats
        stats = shipper.stats
        counts = _spec_counts(mirrored)
        assert stats.mismatches == 0
        assert stats.steps_verified == stats.steps_submitted == stats.step_rpcs
        scheduler = mirrored.scheduler
        mirror = pool_state(manager.core, sorted(scheduler.requests))
        assert server_pool_state(server, "spec") == mirror
        # The server's pool decides with the engine's EAGLE settings (lookahead, drop).

        async def options() -> Any:
            return (await server.server.state.pool("spec")).options

        served = server.call(options())
        assert served.num_hash_lookahead_tokens == scheduler.num_hash_lookahead_tokens
        drop = (0,) if scheduler.use_eagle_block_drop else ()
        assert served.eagle_block_drop_group_ids == drop
    finally:
        mirrored.shutdown()
        reference.shutdown()
    print(
        f"{case}, remote: {tally.turns} turns, {tally.batches} batches, "
        f"{counts['drafts']} draft tokens, {stats.step_rpcs} Step RPCs"
    )
    assert counts["drafts"] > 50
    assert tally.batches > 50


def test_draft_model_engine_turns_equal_vllm_mirror_replayed(vllm: ModuleType) -> None:
    """Draft-model drafting: every allocation also reserves ``num_speculative_tokens``
    lookahead slots (``num_lookahead_tokens``); turns equal vLLM's, programs replay exactly."""
    from test_vllm_scheduler import ReplayCheckingSink

    from kvcm.integrations.vllm import KvcmScheduler

    del vllm

    def make_step_sink(self: Any, settings: Any) -> ReplayCheckingSink:
        del self, settings
        return ReplayCheckingSink()

    checked = type("CheckedKvcmScheduler", (KvcmScheduler,), {"make_step_sink": make_step_sink})
    setup = dataclasses.replace(FULL, num_blocks=50, speculative_method="draft_model")
    plans = plan_workload(24, 30 * workload_scale(), setup)
    reference = build_engine(setup)
    mirrored = build_engine(setup, _counting(checked))
    try:
        assert reference.scheduler.num_lookahead_tokens == NUM_SPEC
        assert mirrored.scheduler.num_lookahead_tokens == NUM_SPEC
        sink = mirrored.scheduler.kv_cache_manager.recorder.sink
        sink.mirror = mirrored.scheduler.kv_cache_manager
        tally = assert_same_runs(reference, mirrored, plans)
        counts = _spec_counts(mirrored)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    print(
        f"draft model, mirror: {tally.turns} turns, {tally.batches} batches, "
        f"{tally.preempted} preemptions, {counts['drafts']} draft tokens; "
        f"{sink.num_interpreted}/{sink.num_steps} steps verified on Pool.run_step"
    )
    assert sink.interpreter_error is None, sink.interpreter_error
    assert sink.num_interpreted == sink.num_steps >= tally.batches > 50
    assert counts["drafts"] > 50


EAGLE = {
    # vLLM's default for EAGLE with prefix caching: lookahead block hashes (each hash also
    # covers the next token), no block drop.
    "eagle-lookahead": dataclasses.replace(FULL, num_blocks=50, speculative_method="eagle"),
    # Lookahead hashes off: every hit drops its last matched block (use_eagle).
    "eagle3-drop": dataclasses.replace(
        FULL, num_blocks=50, speculative_method="eagle3", disable_lookahead_block_hashes=True
    ),
}
# Hidden-state drafters whose draft KV does not depend on the next token (DSpark): neither
# lookahead hashes nor the drop, one prefill lookahead token; mirror mode only.
MIRRORED = {
    **EAGLE,
    "dspark": dataclasses.replace(FULL, num_blocks=50, speculative_method="dspark"),
}
# (num_hash_lookahead_tokens, the drop) vLLM resolves for each.
RESOLVED = {"eagle-lookahead": (1, False), "eagle3-drop": (0, True), "dspark": (0, False)}


@pytest.mark.parametrize("case", sorted(MIRRORED))
def test_eagle_engine_turns_equal_vllm_mirror_replayed(case: str, vllm: ModuleType) -> None:
    """Hidden-state drafters (EAGLE, EAGLE3, DSpark): lookahead block hashes (hashes, events'
    lookahead_token_ids, the hashes a request carries) or the trailing-block drop on every
    hit, with the drafter's lookahead slots; turns equal vLLM's, programs replay exactly."""
    from test_vllm_scheduler import ReplayCheckingSink

    from kvcm.integrations.vllm import KvcmScheduler

    del vllm

    def make_step_sink(self: Any, settings: Any) -> ReplayCheckingSink:
        del self, settings
        return ReplayCheckingSink()

    checked = type("CheckedKvcmScheduler", (KvcmScheduler,), {"make_step_sink": make_step_sink})
    setup = MIRRORED[case]
    plans = plan_workload(26, 30 * workload_scale(), setup)
    reference = build_engine(setup)
    mirrored = build_engine(setup, _counting(checked))
    try:
        ref, kv = reference.scheduler, mirrored.scheduler
        assert ref.use_eagle
        assert kv.use_eagle
        lookahead, drop = RESOLVED[case]
        assert ref.num_hash_lookahead_tokens == kv.num_hash_lookahead_tokens == lookahead
        assert ref.use_eagle_block_drop == drop
        assert kv.num_prefill_lookahead == 1
        assert kv.kv_cache_manager.core.coordinator.drop_eagle_group_ids == (
            ref.kv_cache_manager.coordinator.drop_eagle_group_ids
        )
        assert kv.kv_cache_manager.core.coordinator.drop_eagle_group_ids == (
            frozenset({0}) if drop else frozenset()
        )
        assert kv.num_lookahead_tokens == NUM_SPEC
        sink = kv.kv_cache_manager.recorder.sink
        sink.mirror = kv.kv_cache_manager
        tally = assert_same_runs(reference, mirrored, plans, resets={60: True})
        counts = _spec_counts(mirrored)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    print(
        f"{case}, mirror: {tally.turns} turns, {tally.batches} batches, {tally.events} events, "
        f"{tally.hits} hits, {tally.preempted} preemptions, {counts['drafts']} draft tokens; "
        f"{sink.num_interpreted}/{sink.num_steps} steps verified on Pool.run_step"
    )
    assert sink.interpreter_error is None, sink.interpreter_error
    assert sink.num_interpreted == sink.num_steps >= tally.batches > 50
    assert counts["drafts"] > 50
    assert tally.hits > 0


def test_eagle_with_the_mamba_shared_prefix_checkpoint_is_not_refused(vllm: ModuleType) -> None:
    """A hidden-state drafter is served, with the Mamba shared-prefix checkpoint vLLM turns on
    with one when asked (cases below); kvcm refuses neither."""
    from kvcm.integrations.vllm._scheduler import check_supported

    del vllm
    config = vllm_config(EAGLE["eagle-lookahead"])
    check_supported(config)
    config.cache_config.enable_mamba_shared_prefix_checkpoint = True
    check_supported(config)


def test_draft_model_async_engine_turns_equal_vllm(vllm: ModuleType) -> None:
    """Draft-model drafting under async scheduling (vLLM's default for it): the scheduler
    schedules placeholder drafts the worker fills, counts them as computed before they are
    verified (an allocation's computed tokens run ahead of the request's known tokens by at
    most its tokens in flight) and corrects the counts a step later. KvcmAsyncScheduler's
    turns equal vLLM's AsyncScheduler's; Pool.run_step replays every program exactly."""
    from test_vllm_scheduler import ReplayCheckingSink

    from kvcm.integrations.vllm import KvcmAsyncScheduler

    del vllm

    def make_step_sink(self: Any, settings: Any) -> ReplayCheckingSink:
        del self, settings
        return ReplayCheckingSink()

    checked = type(
        "CheckedKvcmAsyncScheduler", (KvcmAsyncScheduler,), {"make_step_sink": make_step_sink}
    )
    setup = dataclasses.replace(
        FULL, num_blocks=40, speculative_method="draft_model", async_scheduling=True
    )
    plans = plan_workload(25, 30 * workload_scale(), setup)
    reference = build_engine(setup)
    mirrored = build_engine(setup, _counting(checked))
    try:
        assert reference.core.vllm_config.scheduler_config.async_scheduling
        sink = mirrored.scheduler.kv_cache_manager.recorder.sink
        sink.mirror = mirrored.scheduler.kv_cache_manager
        tally = assert_same_runs(reference, mirrored, plans)
        counts = _spec_counts(mirrored)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    print(
        f"draft model, async: {tally.turns} turns, {tally.batches} batches, "
        f"{tally.preempted} preemptions, {counts['drafts']} draft tokens; "
        f"{sink.num_interpreted}/{sink.num_steps} steps verified on Pool.run_step"
    )
    assert sink.interpreter_error is None, sink.interpreter_error
    assert sink.num_interpreted == sink.num_steps >= tally.batches > 50
    assert counts["drafts"] > 50


MAMBA = Setup(
    block_size=256,
    num_blocks=60,
    max_model_len=2048,
    max_num_batched_tokens=512,
    max_num_seqs=8,
    num_speculative_tokens=NUM_SPEC,
)


def _build_hybrid(
    setup: Setup,
    scheduler_cls: Any = None,
    additional_config: Any = None,
    *,
    shared_prefix_checkpoint: bool = False,
    draft_attention: bool = False,
) -> Engine:
    from test_mamba_engine_core import HASH_BLOCK, MAMBA_BLOCK, _HybridMambaWorker, _layer_specs
    from vllm.v1.engine.core import EngineCore

    class SpeculativeMambaWorker(_HybridMambaWorker):
        # vLLM's Mamba layers hold one state block per draft token (num_speculative_blocks).
        def get_kv_cache_spec(self) -> dict[str, Any]:
            specs = _layer_specs(self.vllm_config.cache_config.block_size)
            name = "model.layers.1.mixer"
            specs[name] = dataclasses.replace(
                specs[name], num_speculative_blocks=self.vllm_config.num_speculative_tokens
            )
            if draft_attention:
                # The attention layer reported as the drafter's (is_draft), so vLLM's planning
                # marks its group as the EAGLE group, as a real drafter's layers mark theirs.
                name = "model.layers.0.self_attn.attn"
                specs[name] = dataclasses.replace(specs[name], is_draft=True)
            return specs

    base = executor_class(setup)

    def init_executor(self: Any) -> None:
        base._init_executor(self)
        world = self.vllm_config.parallel_config.world_size
        self.workers = [SpeculativeMambaWorker(self.vllm_config, r, setup) for r in range(world)]

    executor = type("SpecMambaExecutor", (base,), {"_init_executor": init_executor})
    config = vllm_config(setup, scheduler_cls, additional_config)
    config.cache_config.enable_mamba_shared_prefix_checkpoint = shared_prefix_checkpoint
    config.cache_config.mamba_cache_mode = "align"
    config.cache_config.mamba_block_size = MAMBA_BLOCK
    config.cache_config.prefix_match_unit = HASH_BLOCK
    config.parallel_config.distributed_executor_backend = executor
    return Engine(EngineCore(config, executor, setup.log_stats), setup)


def test_ngram_hybrid_mamba_align_turns_equal_vllm(vllm: ModuleType) -> None:
    """A hybrid Mamba model in align mode with speculative state blocks: kvcm's scheduler
    answers EngineCore exactly as vLLM's (sub-block hits, block copies, draft slots)."""
    from test_mamba_engine_core import _plans

    from kvcm.integrations.vllm import KvcmScheduler

    del vllm
    plans = _plans(23, 24 * workload_scale(), MAMBA.max_model_len)
    reference = _build_hybrid(MAMBA)
    mirrored = _build_hybrid(MAMBA, _counting(KvcmScheduler))
    try:
        groups = reference.scheduler.kv_cache_config.kv_cache_groups
        spec = next(
            g.kv_cache_spec for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec"
        )
        assert spec.num_speculative_blocks == NUM_SPEC
        assert mirrored.scheduler.kv_cache_config == reference.scheduler.kv_cache_config
        assert mirrored.scheduler.mamba_partial_cache_hit
        tally = assert_same_runs(reference, mirrored, plans)
        counts = _spec_counts(mirrored)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    print(
        f"ngram hybrid Mamba align: {tally.turns} turns, {tally.batches} batches, "
        f"{tally.events} events, {tally.hits} hits, {tally.preempted} preemptions, "
        f"{counts['drafts']} draft tokens in {counts['steps']} steps"
    )
    assert tally.batches > 50
    assert tally.hits > 0
    assert counts["drafts"] > 50
    assert tally.finished == len(plans)


@pytest.mark.parametrize("case", sorted(EAGLE))
def test_eagle_hybrid_mamba_align_turns_equal_vllm(case: str, vllm: ModuleType) -> None:
    """EAGLE on a hybrid Mamba model in align mode, with vLLM's default lookahead block hashes
    (every hash covers the next token) or EAGLE3 with the trailing-block drop (full attention
    drops a hash block, the Mamba prefill checkpoint backs off one: vLLM's
    drop_eagle_checkpoint_block); kvcm's scheduler answers EngineCore exactly as vLLM's
    (sub-block hits, block copies, draft slots)."""
    from test_mamba_engine_core import _plans

    from kvcm.integrations.vllm import KvcmScheduler

    del vllm
    drop = EAGLE[case].disable_lookahead_block_hashes
    setup = dataclasses.replace(
        MAMBA,
        speculative_method=EAGLE[case].speculative_method,
        disable_lookahead_block_hashes=drop,
    )
    plans = _plans(27, 24 * workload_scale(), setup.max_model_len)
    reference = _build_hybrid(setup)
    mirrored = _build_hybrid(setup, _counting(KvcmScheduler))
    try:
        core = mirrored.scheduler.kv_cache_manager.core
        assert reference.scheduler.num_hash_lookahead_tokens == (0 if drop else 1)
        assert core.block_pool.num_hash_lookahead_tokens == (0 if drop else 1)
        assert core.coordinator.drop_eagle_group_ids == (
            reference.scheduler.kv_cache_manager.coordinator.drop_eagle_group_ids
        )
        assert bool(core.coordinator.drop_eagle_group_ids) == drop
        assert mirrored.scheduler.mamba_partial_cache_hit
        tally = assert_same_runs(reference, mirrored, plans)
        counts = _spec_counts(mirrored)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    print(
        f"{case} hybrid Mamba align: {tally.turns} turns, {tally.batches} batches, "
        f"{tally.events} events, {tally.hits} hits, {tally.preempted} preemptions, "
        f"{counts['drafts']} draft tokens in {counts['steps']} steps"
    )
    assert tally.batches > 50
    assert tally.hits > 0
    assert counts["drafts"] > 50
    assert tally.finished == len(plans)


# vLLM's enable_mamba_shared_prefix_checkpoint with EAGLE on the hybrid Mamba model: chunks end
# at each request's shared-prefix junction (where full attention's hit outruns Mamba's) and the
# Mamba state there is keyed, so a sibling sharing the prefix resumes at it. Lookahead hashes
# (vLLM's default, the draft layer's group marked) in mirror mode; the drop (EAGLE3) in remote
# mode, each allocation answered by a kvcm server whose pool carries the setting.
SHARED_PREFIX = {"eagle-lookahead-mirror": "eagle-lookahead", "eagle3-drop-remote": "eagle3-drop"}


def _junction_counting(cls: type) -> type:
    # Counts the admissions whose lookup found a junction, and the chunks that ended there.
    counted = _counting(cls)

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = counted.schedule(self, *args, **kwargs)
        counts = self.__dict__.setdefault("kvcm_junctions", {"found": 0, "stops": 0})
        for new in output.scheduled_new_reqs:
            request = self.requests[new.req_id]
            junction = request.shared_prefix_boundary
            if junction:
                counts["found"] += 1
        for req_id, num in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            junction = request.shared_prefix_boundary
            if junction and request.num_computed_tokens == junction and num:
                counts["stops"] += 1
        return output

    return type(f"Junction{cls.__name__}", (counted,), {"schedule": schedule})


@pytest.mark.parametrize("case", sorted(SHARED_PREFIX))
def test_eagle_hybrid_mamba_shared_prefix_checkpoint_turns_equal_vllm(
    case: str, server: Any, vllm: ModuleType
) -> None:
    """EAGLE on the hybrid Mamba model with vLLM's Mamba shared-prefix checkpoint: kvcm's
    scheduler (vLLM's chunking on kvcm's manager) answers EngineCore turn for turn as vLLM's,
    in mirror mode and remote mode; the server's pool, created with the setting, verifies
    every step and ends equal to the mirror."""
    from _program_replay import pool_state
    from test_mamba_engine_core import _plans
    from test_vllm_shipping import server_pool_state

    from kvcm.integrations.vllm import KvcmScheduler

    del vllm
    eagle = EAGLE[SHARED_PREFIX[case]]
    mode = "remote" if case.endswith("remote") else "mirror"
    setup = dataclasses.replace(
        MAMBA,
        speculative_method=eagle.speculative_method,
        disable_lookahead_block_hashes=eagle.disable_lookahead_block_hashes,
    )
    config = {"kvcm": {"address": server.grpc_address, "pool_id": "spc", "mode": mode}}
    plans = _plans(29, 24 * workload_scale(), setup.max_model_len)
    # With lookahead hashes (no drop) vLLM acts on the setting only beside a marked draft group.
    marked = not eagle.disable_lookahead_block_hashes
    reference = _build_hybrid(setup, shared_prefix_checkpoint=True, draft_attention=marked)
    mirrored = _build_hybrid(
        setup,
        _junction_counting(KvcmScheduler),
        config,
        shared_prefix_checkpoint=True,
        draft_attention=marked,
    )
    try:
        ref, kv = reference.scheduler, mirrored.scheduler
        manager = kv.kv_cache_manager
        # vLLM's predicate holds on both sides, read by both schedulers and managers.
        assert ref.kv_cache_manager.mamba_shared_prefix_checkpoint
        assert ref.mamba_shared_prefix_checkpoint
        assert manager.mamba_shared_prefix_checkpoint
        assert manager.core.mamba_shared_prefix_checkpoint
        assert kv.mamba_shared_prefix_checkpoint
        assert bool(manager.core.coordinator.drop_eagle_group_ids) == bool(
            eagle.disable_lookahead_block_hashes
        )
        tally = assert_same_runs(reference, mirrored, plans)
        counts = _spec_counts(mirrored)
        junctions = dict(kv.kvcm_junctions)
        # The server's copy (shipped in the background in mirror mode, answering each
        # allocation in remote mode) took every step and ends equal to the engine's mirror.
        shipper = manager.recorder.sink
        assert manager.flush(30.0), shipper.stats
        stats = shipper.stats
        assert stats.mismatches == 0
        assert stats.steps_verified == stats.steps_submitted > 0
        assert server_pool_state(server, "spc") == pool_state(manager.core, sorted(kv.requests))

        async def options() -> Any:
            return (await server.server.state.pool("spc")).options

        assert server.call(options()).enable_mamba_shared_prefix_checkpoint
    finally:
        mirrored.shutdown()
        reference.shutdown()
    print(
        f"{case} hybrid Mamba shared-prefix checkpoint: {tally.turns} turns, "
        f"{tally.batches} batches, {tally.events} events, {tally.hits} hits, "
        f"{tally.preempted} preemptions, {counts['drafts']} draft tokens, "
        f"{junctions['found']} junctions found, {junctions['stops']} chunks ended there; "
        f"{stats.steps_verified} steps verified by the server in {stats.step_rpcs} Step RPCs"
    )
    assert tally.batches > 50
    assert tally.hits > 0
    assert junctions["stops"] > 0
    assert tally.finished == len(plans)
