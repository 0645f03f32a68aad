"""vLLM 0.33's real engine on kvcm's mirror, turn for turn against vLLM's own scheduler.

Every case builds vLLM's ``EngineCore`` twice from the same config (tests/compat/_engine_core.py:
a simulated executor reports the ranks' layer specs, memory and layouts; EngineCore plans the
KV cache and resolves the block sizes, hash block size and cache-hit alignment itself), once
with vLLM's scheduler and once with ``scheduler_cls`` naming ``KvcmScheduler`` /
``KvcmAsyncScheduler``, drives both with the same seeded workload through EngineCore's own
``step()`` / ``step_with_batch_queue()``, and compares every turn's ``SchedulerOutput``,
``EngineCoreOutputs`` (``SchedulerStats`` included) and KV events. The kvcm side also runs every
Step program it recorded through kvcm's one interpreter (``Pool.run_step``) on a fresh pool
with the same explicit layout, and checks after every step that it answered what the mirror
answered and that the pool's blocks, free queue, prefix cache and block tables equal the
mirror's. ``KVCM_LONG=1`` runs four times the requests.
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType
from typing import Any

import pytest
from _engine_core import (
    Setup,
    assert_same_runs,
    build_engine,
    plan_streaming_session,
    plan_workload,
    vllm_config,
    workload_scale,
)
from _program_replay import ProgramReplayer, pool_state

from kvcm.common.errors import ConfigError
from kvcm.core.manager import KVCacheManager
from kvcm.core.pool import Pool
from kvcm.core.pool_types import PoolConfig
from kvcm.integrations.vllm._sinks import LocalSink


class ReplayCheckingSink(LocalSink):
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
                prefix_cache_retention_interval=config.prefix_cache_retention_interval,
                decode_context_parallel_size=config.dcp_world_size,
                num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
                num_prefill_lookahead=config.num_prefill_lookahead,
                eagle_block_drop_group_ids=tuple(config.eagle_block_drop_group_ids),
                enable_mamba_shared_prefix_checkpoint=config.enable_mamba_shared_prefix_checkpoint,
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

    def close(self, timeout_s: float = 5.0) -> None:
        del timeout_s
        self.closed = True


@pytest.fixture(scope="module")
def kvcm_classes(vllm: ModuleType) -> tuple[type, type]:
    """Test subclasses of kvcm's schedulers whose programs go to a ReplayCheckingSink."""
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    del vllm

    def make_step_sink(self: Any, settings: Any) -> ReplayCheckingSink:
        del self, settings
        return ReplayCheckingSink()

    sync_cls = type("CheckedKvcmScheduler", (KvcmScheduler,), {"make_step_sink": make_step_sink})
    async_cls = type(
        "CheckedKvcmAsyncScheduler", (KvcmAsyncScheduler,), {"make_step_sink": make_step_sink}
    )
    return sync_cls, async_cls


# Prefix-cache resets (turn -> reset_running_requests) made in every case: one that fails
# while requests hold blocks, one that preempts everything and succeeds.
RESETS = {40: False, 120: True}

_SMALL = {"max_model_len": 512}
CASES = {
    # name: (setup, seed, number of requests)
    "prefix-hits-chunked": (Setup(), 1, 80),
    "preemption": (Setup(num_blocks=40, **_SMALL), 2, 80),
    "async-preemption": (Setup(num_blocks=40, async_scheduling=True, **_SMALL), 3, 80),
    "async-lora-salts": (Setup(lora=True, num_blocks=60, async_scheduling=True, **_SMALL), 4, 70),
    "hybrid-swa": (
        Setup(sliding_window=64, num_blocks=80, retention_interval=None, **_SMALL),
        5,
        70,
    ),
    # vLLM's defaults: sparse sliding-window retention (interval 0): only the windows before
    # each prompt's replay boundary and each shared-prefix junction enter the prefix cache.
    "hybrid-swa-default-retention": (Setup(sliding_window=64, num_blocks=80, **_SMALL), 14, 70),
    "hybrid-swa-default-retention-async": (
        Setup(sliding_window=32, num_blocks=100, async_scheduling=True, **_SMALL),
        15,
        70,
    ),
    "hybrid-swa-retention-64": (
        Setup(sliding_window=32, num_blocks=100, retention_interval=64, **_SMALL),
        16,
        60,
    ),
    "hybrid-swa-async-watermark": (
        Setup(
            sliding_window=32,
            num_blocks=100,
            async_scheduling=True,
            watermark=0.05,
            retention_interval=32,  # dense for a 32-token window: every block is reachable
            **_SMALL,
        ),
        6,
        70,
    ),
    # fp16 full attention beside a bf16 sliding window: new blocks must be zeroed, so every
    # SchedulerOutput carries new_block_ids_to_zero from the manager.
    "hybrid-mixed-precision": (
        Setup(
            sliding_window=64,
            sliding_window_dtype="bfloat16",
            num_blocks=80,
            retention_interval=None,
            **_SMALL,
        ),
        13,
        60,
    ),
    "caching-off": (Setup(enable_caching=False, num_blocks=50, **_SMALL), 7, 70),
    "no-stats": (
        Setup(log_stats=False, num_blocks=48, max_num_batched_tokens=128, **_SMALL),
        8,
        70,
    ),
    # Several ranks report specs; the pool is planned from the memory they report.
    "tp2-planned": (
        Setup(tensor_parallel_size=2, num_blocks=None, memory_blocks=90, **_SMALL),
        9,
        70,
    ),
    "pp2-hybrid-planned": (
        Setup(
            pipeline_parallel_size=2,
            sliding_window=64,
            retention_interval=None,
            num_blocks=None,
            memory_blocks=90,
            **_SMALL,
        ),
        10,
        70,
    ),
    "tp2-pp2-async": (
        Setup(
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            async_scheduling=True,
            num_blocks=None,
            memory_blocks=60,
            **_SMALL,
        ),
        11,
        70,
    ),
    # Decode context parallelism: the scheduler's blocks span 2 ranks' 16-token blocks. vLLM
    # allows DCP up to tensor-parallel ranks / KV heads, and this model's 8 attention heads
    # cap TP at 8 over 4 KV heads, so DCP 2 is the most EngineCore builds here (DCP 4 is
    # compared on the manager: test_dcp_compat.py).
    "tp8-dcp2-planned": (
        Setup(
            tensor_parallel_size=8,
            decode_context_parallel_size=2,
            num_blocks=None,
            memory_blocks=90,
            **_SMALL,
        ),
        13,
        70,
    ),
    "tp8-dcp2-async-preemption": (
        Setup(
            tensor_parallel_size=8,
            decode_context_parallel_size=2,
            async_scheduling=True,
            num_blocks=30,
            **_SMALL,
        ),
        15,
        70,
    ),
    # `vllm serve MODEL --scheduler-cls ...`: async scheduling, 2048-token batches, 256
    # sequences, the model's 8192-token context, the pool planned from memory.
    "serve-defaults": (Setup(serve_defaults=True, num_blocks=None, memory_blocks=600), 12, 70),
    # `--kv-cache-dtype fp8`: the layers report uint8 storage and per-tensor fp8 quantization.
    "fp8-kv-cache": (Setup(kv_cache_dtype="fp8", num_blocks=60, **_SMALL), 15, 60),
    # Half the requests ask for kv_cache_report_mode="full" (SamplingParams.extra_args): their
    # hits are reported as BlockStored events at every lookup, as vLLM reports them.
    "report-full": (Setup(report_full=0.5, num_blocks=60, **_SMALL), 17, 70),
    "report-full-hybrid-swa-async": (
        Setup(report_full=0.5, sliding_window=64, num_blocks=80, async_scheduling=True, **_SMALL),
        18,
        70,
    ),
}


def _kvcm_class(engine_async: bool, classes: tuple[type, type]) -> type:
    return classes[1] if engine_async else classes[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_turns_equal_vllm(case: str, kvcm_classes: tuple[type, type]) -> None:
    """Every turn's batches, engine outputs and events equal vLLM's; programs replay exactly."""
    setup, seed, num_requests = CASES[case]
    plans = plan_workload(seed, num_requests * workload_scale(), setup)
    reference = build_engine(setup)
    engine_async = reference.core.vllm_config.scheduler_config.async_scheduling
    mirrored = build_engine(setup, _kvcm_class(engine_async, kvcm_classes))
    try:
        # EngineCore resolved the same pool for both, and read kvcm's manager as vLLM's.
        assert mirrored.scheduler.kv_cache_config == reference.scheduler.kv_cache_config
        ref_cache = reference.core.vllm_config.cache_config
        kvcm_cache = mirrored.core.vllm_config.cache_config
        assert (kvcm_cache.num_gpu_blocks, kvcm_cache.block_size) == (
            ref_cache.num_gpu_blocks,
            ref_cache.block_size,
        )
        assert kvcm_cache.effective_attention_block_size == ref_cache.effective_attention_block_size
        # What EngineCore serves event consumers (Dynamo) about the groups reads the manager.
        metadata = mirrored.core.get_kv_cache_group_metadata()
        assert metadata == reference.core.get_kv_cache_group_metadata()
        assert len(metadata) == len(reference.scheduler.kv_cache_config.kv_cache_groups)
        sink = mirrored.scheduler.kv_cache_manager.recorder.sink
        sink.mirror = mirrored.scheduler.kv_cache_manager
        tally = assert_same_runs(reference, mirrored, plans, resets=RESETS)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    assert sink.closed
    print(
        f"{case}: {tally.turns} turns, {tally.batches} batches, {tally.events} events; "
        f"{sink.num_interpreted}/{sink.num_steps} steps verified on Pool.run_step"
    )
    # Pool.run_step (the server's interpreter) ran every recorded program and agreed with the
    # mirror after every step.
    assert sink.interpreter_error is None, sink.interpreter_error
    assert sink.num_interpreted == sink.num_steps
    # The workload exercised what the case is about, and the replay saw every batch.
    assert tally.batches > 50
    # Every request finished, but those the client aborted (no output for an abort).
    num_aborted = sum(p.abort_step >= 0 for p in plans)
    assert len(plans) - num_aborted <= tally.finished <= len(plans)
    assert sink.num_steps >= tally.batches
    if setup.enable_caching:
        assert tally.hits > 0
        assert tally.events > 0
    if setup.log_stats and setup.enable_caching:
        assert tally.prefix_stats["hits"] > 0
    if "preemption" in case:
        assert tally.preempted > 0
    if "mixed-precision" in case:
        assert tally.zeroed > 0


@pytest.mark.parametrize("engine_async", [False, True], ids=["sync", "async"])
def test_streaming_input_sessions_equal_vllm(
    engine_async: bool, kvcm_classes: tuple[type, type]
) -> None:
    """A streaming-input session (a resumable request, then its next input chunks under the
    same id, then its end) runs on the mirror as on vLLM's own manager, on a hybrid
    sliding-window model, and on the server's copy as on the mirror: vLLM's session update
    drops the last sampled token, extends the prompt in place and moves
    ``num_prompt_tokens``; the mirror's request view follows it (before it did, the turn that
    applied the first chunk published other events) and tells the pool with EXTEND_PROMPT
    (before it did, the replayed pool drifted from the mirror one step after the chunk)."""
    plans = plan_streaming_session()
    setup = Setup(
        num_blocks=120, max_model_len=512, sliding_window=32, async_scheduling=engine_async
    )
    reference = build_engine(setup)
    mirrored = build_engine(setup, _kvcm_class(engine_async, kvcm_classes))
    seen: list[int] = []  # vLLM's prompt end after each turn
    told: list[int] = []  # the server's copy's, after each turn

    def prompt_end(_turns: int, engine: Any) -> None:
        request = engine.scheduler.requests.get("session")
        if request is not None:
            seen.append(request.num_prompt_tokens)
        pool = sink.pool
        if pool is not None:
            told.extend(
                pool.requests[key].num_prompt_tokens
                for key, request_id in pool.request_ids.items()
                if request_id == "session"
            )

    sink = mirrored.scheduler.kv_cache_manager.recorder.sink
    sink.mirror = mirrored.scheduler.kv_cache_manager
    try:
        tally = assert_same_runs(reference, mirrored, plans, after_turn=prompt_end)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    assert tally.finished >= 3
    assert len(set(seen)) >= 3  # the first prompt and two chunks' longer ones
    # Every step replayed and ran on Pool.run_step equal to the mirror, and the server's
    # copy held each prompt end vLLM had (a turn later: the chunk is applied at the end of a
    # turn and shipped with the next one's first allocation).
    assert sink.interpreter_error is None, sink.interpreter_error
    assert sink.num_interpreted == sink.num_steps
    assert set(told) == set(seen)


def test_kvcm_manager_replaces_vllms(kvcm_classes: tuple[type, type]) -> None:
    """The scheduler EngineCore built holds kvcm's mirror of the planned size."""
    from kvcm.integrations.vllm import MirrorKVCacheManager

    engine = build_engine(Setup(num_blocks=321), kvcm_classes[0])
    try:
        scheduler = engine.scheduler
        manager = scheduler.kv_cache_manager
        assert isinstance(manager, MirrorKVCacheManager)
        assert scheduler.kv_cache_config.num_blocks == 321
        # EngineCore's resolution reached kvcm as vLLM resolved it.
        assert scheduler.kv_cache_config.hash_block_size == 16
        assert scheduler.kv_cache_config.cache_hit_alignment_tokens == 16
        assert manager.core.kv_cache_config.num_blocks == 321
        assert manager.block_pool.get_num_free_blocks() == 320
        assert [m.block_size for m in manager.coordinator.single_type_managers] == [16]
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"additional_config": {"kvcm": {"mode": "remote"}}}, "mode 'remote' needs an address"),
        ({"additional_config": {"kvcm": {"mode": "later"}}}, "mode must be one of"),
        ({"additional_config": {"kvcm": {"pool": "x"}}}, "unknown keys"),
        ({"async_scheduling": True}, "KvcmAsyncScheduler, or pass --no-async-scheduling"),
    ],
)
def test_refused_when_engine_core_builds_it(
    change: dict[str, Any], message: str, kvcm_classes: tuple[type, type]
) -> None:
    """What kvcm cannot honour is refused when vLLM's EngineCore constructs the scheduler."""
    from kvcm.integrations.vllm import KvcmScheduler

    del kvcm_classes
    setup = change.get("setup", Setup(async_scheduling=change.get("async_scheduling", False)))
    with pytest.raises(ConfigError, match=message):
        build_engine(setup, KvcmScheduler, change.get("additional_config"))


def test_inputs_whose_hashes_kvcm_does_not_mirror_are_refused_before_any_request(
    kvcm_classes: tuple[type, type], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Multi-modal items and prompt embeddings change vLLM's block hashes (placeholder
    tokens' extra keys, embedding digests) in ways kvcm does not mirror yet: an engine that
    can receive them is refused at construction, naming the setting that avoids it, instead
    of failing at its first such request. A multi-modal config vLLM itself runs text-only is
    served."""
    from vllm.config import ModelConfig, MultiModalConfig

    from kvcm.integrations.vllm import check_supported

    del kvcm_classes
    config = vllm_config(Setup())
    check_supported(config)
    config.model_config.enable_prompt_embeds = True
    with pytest.raises(ConfigError, match="--enable-prompt-embeds"):
        check_supported(config)
    config.model_config.enable_prompt_embeds = False
    # A text-only architecture given a multi-modal config: vLLM runs it text-only.
    config.model_config.multimodal_config = MultiModalConfig()
    assert config.model_config.is_multimodal_model
    assert not config.model_config.supports_multimodal_inputs
    check_supported(config)
    # A real vision-language model needs its processor files to build on CPU; vLLM's answer
    # for one is stood in for here, the refusal reads nothing else.
    monkeypatch.setattr(ModelConfig, "supports_multimodal_inputs", property(lambda _: True))
    with pytest.raises(ConfigError, match="--language-model-only"):
        check_supported(config)
    config.model_config.multimodal_config = None
    check_supported(config)


def _vllm_config_with(**fields: Any) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    attn = {"block_size": 16, "num_kv_heads": 2, "head_size": 8, "dtype": torch.float16}
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(**attn)),
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(**attn, sliding_window=fields.pop("window"))),
    ]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups, **fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        # Partial hash hits (vLLM's Mamba align mode) land hits on hash blocks.
        ({"window": 64, "cache_hit_alignment_tokens": 8}, "--prefix-match-unit 16"),
        ({"window": 64, "hash_block_size": 8}, "differs from the scheduler's hash_block_size=16"),
    ],
)
def test_engine_resolution_kvcm_would_compute_differently_is_refused(
    fields: dict[str, Any], message: str, vllm: ModuleType
) -> None:
    """The resolved fields are accepted only where kvcm computes the same (every retention
    interval: the core applies vLLM's sparse retention)."""
    from kvcm.integrations.vllm._convert import check_engine_resolution

    del vllm
    config = _vllm_config_with(**fields)
    with pytest.raises(ConfigError, match=message):
        check_engine_resolution(
            config, scheduler_block_size=16, hash_block_size=16, enable_caching=True
        )
    # The same values pass where they are what kvcm computes, or where caching is off.
    accepted = _vllm_config_with(
        window=64,
        hash_block_size=16,
        cache_hit_alignment_tokens=16,
        prefix_cache_retention_interval=64,
    )
    for interval in (None, 0, 64, 128):
        accepted.prefix_cache_retention_interval = interval
        check_engine_resolution(
            accepted, scheduler_block_size=16, hash_block_size=16, enable_caching=True
        )


@pytest.mark.parametrize(
    ("group_fields", "message"),
    [
        ({"host_resident": True}, "host-resident groups"),
        ({"role": "hisparse_source"}, "HiSparse groups"),
    ],
)
def test_group_roles_kvcm_does_not_model_are_refused(
    group_fields: dict[str, Any], message: str, vllm: ModuleType
) -> None:
    """A group vLLM gives a role kvcm's core does not model is refused, naming the group."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupRole,
        KVCacheGroupSpec,
    )

    from kvcm.integrations.vllm._convert import convert_kv_cache_config

    del vllm
    if "role" in group_fields:
        group_fields = {"role": KVCacheGroupRole(group_fields["role"])}
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    groups = [
        KVCacheGroupSpec(["a"], spec),
        KVCacheGroupSpec(["b"], spec, **group_fields),
    ]
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    with pytest.raises(ConfigError, match=rf"kv_cache_groups\[1\]: {message}"):
        convert_kv_cache_config(config)
    # An EAGLE/MTP draft group is an ordinary group to the pool (which groups drop a block on
    # a hit reaches the manager separately, as vLLM's coordinator resolves it).
    groups[1] = KVCacheGroupSpec(["b"], spec, is_eagle_group=True)
    assert convert_kv_cache_config(config).kv_cache_groups[1].layer_names == ("b",)
    # A group with no layer names (a later pipeline stage's) is named by its place.
    groups[1] = KVCacheGroupSpec([], spec)
    converted = convert_kv_cache_config(config)
    assert converted.kv_cache_groups[1].layer_names == (
        "kv_cache_groups[1] (layers on later pipeline stages)",
    )


def test_unsupported_spec_refused(vllm: ModuleType) -> None:
    """A KV-cache spec kvcm does not model (cross attention) is refused before vLLM builds
    anything (Mamba's tokens_per_state: tests/compat/test_mamba_limits_compat.py)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from kvcm.integrations.vllm._convert import convert_kv_cache_config

    del vllm
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["c"], cross)]
    )
    with pytest.raises(ConfigError, match="CrossAttentionSpec"):
        convert_kv_cache_config(config)


def test_quantized_caches_are_served_where_kvcm_computes_their_page(vllm: ModuleType) -> None:
    """fp8 (per-tensor scales outside the page) converts with vLLM's storage dtype and the same
    page bytes (the EngineCore case ``fp8-kv-cache`` runs it); a backend's page laid out
    otherwise (per-token-head scales inside it) is refused, naming the mode, both page sizes
    and what to serve instead."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, get_kv_quant_mode

    from kvcm.integrations.vllm._convert import convert_spec

    del vllm
    common = {"block_size": 16, "num_kv_heads": 2, "head_size": 64}
    fp8 = FullAttentionSpec(**common, dtype=torch.uint8, kv_quant_mode=get_kv_quant_mode("fp8"))
    converted = convert_spec(fp8)
    assert converted.page_size_bytes == fp8.page_size_bytes == 2 * 16 * 128
    per_head = FullAttentionSpec(
        **common,
        dtype=torch.int8,
        kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
        state_content_bytes=128 + 8,  # the codes and a scale per token and head
    )
    with pytest.raises(ConfigError) as refused:
        convert_spec(per_head, "kv_cache_groups[0]")
    message = str(refused.value)
    assert "INT8_PER_TOKEN_HEAD" in message
    assert "kv_cache_groups[0]" in message
    assert f"{per_head.page_size_bytes} bytes" in message
    assert "4096" in message
    assert "--kv-cache-dtype auto" in message


def test_mamba_align_converts_and_its_sub_block_alignment_is_accepted(vllm: ModuleType) -> None:
    """A hybrid full attention + align-mode Mamba config (hash block 64 under a Mamba block of
    256) converts field for field, and the hash-block hit alignment EngineCore resolves for
    it is what kvcm's core uses; the same alignment without the Mamba group is refused."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from kvcm.integrations.vllm._convert import check_engine_resolution, convert_kv_cache_config

    del vllm
    full = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    mamba = MambaSpec(
        block_size=256,
        shapes=((2, 4), (8,)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
        num_speculative_blocks=1,
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=64,
    )
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["attn"], full), KVCacheGroupSpec(["mixer"], mamba)],
        hash_block_size=64,
        cache_hit_alignment_tokens=64,
    )
    converted = convert_kv_cache_config(config).kv_cache_groups[1].kv_cache_spec
    assert (converted.mamba_cache_mode, converted.num_speculative_blocks) == ("align", 1)
    assert converted.num_prefill_checkpoint_blocks == 1
    assert converted.prefill_checkpoint_alignment == 64
    assert converted.page_size_bytes == mamba.page_size_bytes
    check_engine_resolution(
        config, scheduler_block_size=256, hash_block_size=64, enable_caching=True
    )
    config.kv_cache_groups[1] = KVCacheGroupSpec(["attn2"], replace(full, block_size=256))
    with pytest.raises(ConfigError, match="kvcm on 256"):
        check_engine_resolution(
            config, scheduler_block_size=256, hash_block_size=64, enable_caching=True
        )
