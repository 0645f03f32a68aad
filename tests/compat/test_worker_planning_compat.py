"""Real model shapes registered over a real server plan exactly as vLLM 0.33.0's engine plans.

Each case builds the spec dicts vLLM's model runner would build (``get_kv_cache_spec()``:
the attention modules in module order, named as the model's modules are named), registers
every rank through ``WorkerClient`` with a kvcm server on 127.0.0.1, and compares the config
each rank receives with vLLM's ``get_kv_cache_configs`` for the same specs and memory: block
count, group membership and order, every tensor's layers, size, strides and byte offset.

The models: Llama-3.1-8B with tensor parallelism 2 (32 full-attention layers, 8 KV heads
split over 2 ranks); Gemma-3-4B (34 layers, 5 sliding-window layers of 1024 tokens to 1
global, inside the multimodal wrapper's ``language_model.`` prefix), alone and as 2 pipeline
stages; DeepSeek-V2-Lite (27 MLA layers, one 576-element latent per token, 64-token blocks
as FlashMLA needs), as 2 pipeline stages. More than 10 layers each, so a sorted layer order
(``model.layers.10`` before ``model.layers.2``) would change the plan.

The pool's planning inputs (``PoolConfig``: the hybrid manager's switch, the encoder budget,
``kv_cache_memory_bytes``, auto-fit, the layout) go through the same comparison, each turned
into vLLM's own setting independently of kvcm's mapping: Llama-4-Scout-17B-16E with tensor
parallelism 2 (48 layers, 3 chunked-local to 1 full attention) with the hybrid manager as
vLLM 0.33 leaves it by default (on: 5,461 blocks of 2 GiB) and as an engine that turned it off
resolves it (1,365); Whisper-large-v3 (32 decoder layers of self attention and 32 of cross
attention), refused without an encoder budget and planned with vLLM's
(``max_num_encoder_input_tokens``, which vLLM's own ``SchedulerConfig`` derives from
``max_num_batched_tokens``); and, with the hybrid manager off, refused by both.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
from test_planning_compat import VllmPlanner, _config_form

from kvcm.client import (
    PoolConfig,
    SchedulerClient,
    ServiceInvalidArgumentError,
    WorkerClient,
    WorkerRegistration,
)
from kvcm.common.dtypes import DType
from kvcm.common.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvcm.core import planning
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

GIB = 1 << 30


@dataclass(frozen=True)
class ModelCase:
    """One engine: each rank's specs (in the model runner's order), memory and pool inputs."""

    name: str
    rank_specs: list[dict[str, KVCacheSpec]]
    memory: list[int]
    max_model_len: int
    pool: dict[str, Any] = field(default_factory=dict)


def _llama_3_1_8b_tp2() -> ModelCase:
    # 32 decoder layers; 8 KV heads of 128 split over 2 ranks; bf16; 16-token blocks.
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=DType.BFLOAT16)
    specs: dict[str, KVCacheSpec] = {f"model.layers.{i}.self_attn.attn": spec for i in range(32)}
    return ModelCase("llama-3.1-8b-tp2", [specs, dict(specs)], [3 * GIB, 2 * GIB + 12345], 8192)


def _gemma_3_4b_specs() -> dict[str, KVCacheSpec]:
    # 34 layers; every 6th is global (layer_types: 5 sliding_attention, 1 full_attention);
    # 4 KV heads of 256; sliding window 1024; the multimodal wrapper's prefix.
    attention = {"block_size": 16, "num_kv_heads": 4, "head_size": 256, "dtype": DType.BFLOAT16}
    full = FullAttentionSpec(**attention)  # type: ignore[arg-type]
    local = SlidingWindowSpec(sliding_window=1024, **attention)  # type: ignore[arg-type]
    return {
        f"language_model.model.layers.{i}.self_attn.attn": full if (i + 1) % 6 == 0 else local
        for i in range(34)
    }


def _gemma_3_4b() -> ModelCase:
    return ModelCase("gemma-3-4b", [_gemma_3_4b_specs()], [6 * GIB], 32768)


def _gemma_3_4b_pp2() -> ModelCase:
    specs = _gemma_3_4b_specs()
    names = list(specs)
    stages = [{n: specs[n] for n in names[:17]}, {n: specs[n] for n in names[17:]}]
    return ModelCase("gemma-3-4b-pp2", stages, [3 * GIB, 3 * GIB + 4096], 32768)


def _deepseek_v2_lite_pp2() -> ModelCase:
    # 27 layers of MLA: kv_lora_rank 512 + qk_rope_head_dim 64 = one 576-element latent.
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=DType.BFLOAT16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(27)]
    stages: list[dict[str, KVCacheSpec]] = [
        dict.fromkeys(names[:14], spec),
        dict.fromkeys(names[14:], spec),
    ]
    return ModelCase("deepseek-v2-lite-pp2", stages, [GIB, GIB], 16384)


def _llama_4_scout_specs() -> dict[str, KVCacheSpec]:
    # 48 layers; every 4th (no_rope_layers[i] == 0) is global attention, the others chunked
    # local attention of 8192 tokens; 8 KV heads of 128 split over 2 ranks; bf16; the
    # multimodal wrapper's prefix.
    attention = {"block_size": 16, "num_kv_heads": 4, "head_size": 128, "dtype": DType.BFLOAT16}
    full = FullAttentionSpec(**attention)  # type: ignore[arg-type]
    chunked = ChunkedLocalAttentionSpec(attention_chunk_size=8192, **attention)  # type: ignore[arg-type]
    return {
        f"language_model.model.layers.{i}.self_attn.attn": full if i % 4 == 3 else chunked
        for i in range(48)
    }


def _llama_4_scout_tp2(**pool: Any) -> ModelCase:
    specs = _llama_4_scout_specs()
    suffix = "".join(f"-{k}" for k in pool)
    return ModelCase(f"llama-4-scout-tp2{suffix}", [specs, dict(specs)], [2 * GIB] * 2, 8192, pool)


def _whisper_large_v3_specs() -> dict[str, KVCacheSpec]:
    # 32 decoder layers, each a self attention and a cross attention over the encoder's
    # states; 20 heads of 64; fp16 (the encoder's own attention keeps no KV cache).
    attention = {"block_size": 16, "num_kv_heads": 20, "head_size": 64, "dtype": DType.FLOAT16}
    specs: dict[str, KVCacheSpec] = {}
    for i in range(32):
        specs[f"model.decoder.layers.{i}.self_attn.attn"] = FullAttentionSpec(**attention)  # type: ignore[arg-type]
        specs[f"model.decoder.layers.{i}.encoder_attn.attn"] = CrossAttentionSpec(**attention)  # type: ignore[arg-type]
    return specs


def _whisper_large_v3(memory: int = 2 * GIB, **pool: Any) -> ModelCase:
    # vLLM turns prefix caching off for encoder-decoder models; the pool says so.
    suffix = "".join(f"-{k}" for k in pool)
    inputs = {"enable_caching": False, **pool}
    specs = _whisper_large_v3_specs()
    return ModelCase(f"whisper-large-v3{suffix}", [specs], [memory], 448, inputs)


CASES = [
    _llama_3_1_8b_tp2(),
    _gemma_3_4b(),
    _gemma_3_4b_pp2(),
    _deepseek_v2_lite_pp2(),
    # vLLM 0.33's default: the hybrid manager stays on for chunked local attention.
    _llama_4_scout_tp2(),
    # An engine that resolved it off (a KV connector without hybrid support, EAGLE, ...).
    _llama_4_scout_tp2(disable_hybrid_kv_cache_manager=True),
    _whisper_large_v3(max_num_batched_tokens=8192),
    _whisper_large_v3(max_num_encoder_input_tokens=1500),
    # Every other input at once: auto-fit, a fixed memory, a block-outermost layout.
    ModelCase(
        "gemma-3-4b-pp2-inputs",
        _gemma_3_4b_pp2().rank_specs,
        [GIB, 5 * GIB],
        1 << 20,
        {
            "auto_fit_max_model_len": True,
            "kv_cache_memory_bytes": 3 * GIB // 2,
            "kv_cache_layout": "BLHNC",
            "max_in_flight_tokens": 4096,
        },
    ),
]


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    """A real kvcm server on 127.0.0.1 for this module."""
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", log_level="WARNING")
    )
    try:
        yield running
    finally:
        running.stop(grace_s=1.0)


def _vllm_options(vllm: ModuleType, case: ModelCase) -> planning.PlanningOptions:
    """The engine settings vLLM plans ``case`` with, derived by vLLM's own rules.

    Only a carrier for ``VllmPlanner.config``: each value comes from the pool's inputs as
    vLLM resolves them, never through kvcm's ``PoolConfig.planning_options``.
    """
    from vllm import envs
    from vllm.config import SchedulerConfig

    pool = case.pool
    disable = pool.get("disable_hybrid_kv_cache_manager")
    if disable is None:
        # VllmConfig.__post_init__ on a platform with hybrid support (every real one): off
        # only for chunked local attention when its environment switch says so.
        chunked = any(
            isinstance(spec, ChunkedLocalAttentionSpec)
            for specs in case.rank_specs
            for spec in specs.values()
        )
        disable = chunked and not envs.VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE
    encoder = pool.get("max_num_encoder_input_tokens")
    if encoder is None and "max_num_batched_tokens" in pool:
        encoder = SchedulerConfig(
            max_num_batched_tokens=pool["max_num_batched_tokens"],
            max_model_len=case.max_model_len,
            is_encoder_decoder=True,
        ).max_num_encoder_input_tokens
    return planning.PlanningOptions(
        max_model_len=case.max_model_len,
        max_in_flight_tokens=pool.get("max_in_flight_tokens"),
        max_num_encoder_input_tokens=encoder,
        enable_hybrid_manager=not disable,
        auto_fit_max_model_len=pool.get("auto_fit_max_model_len", False),
        kv_cache_layout=pool.get("kv_cache_layout", "LBNHC"),
        enable_caching=pool.get("enable_caching", True),
    )


def _vllm_configs(
    vllm: ModuleType, monkeypatch: pytest.MonkeyPatch, case: ModelCase
) -> tuple[Any, list[Any]]:
    """vLLM's engine config and per-rank KV-cache configs for ``case``."""
    planner = VllmPlanner(vllm, monkeypatch)
    cfg = planner.config(_vllm_options(vllm, case))
    vllm_specs = [{n: planner.spec(s) for n, s in rank.items()} for rank in case.rank_specs]
    memory = case.memory
    if "kv_cache_memory_bytes" in case.pool:
        # Every vLLM worker reports cache_config.kv_cache_memory_bytes instead of profiling.
        memory = [case.pool["kv_cache_memory_bytes"]] * len(memory)
    groups = planner.planning.get_global_kv_cache_groups(cfg, vllm_specs)
    return cfg, planner.planning.get_kv_cache_configs(cfg, vllm_specs, memory, groups)


def _register_all(address: str, case: ModelCase) -> list[WorkerRegistration]:
    world_size = len(case.rank_specs)
    results: dict[int, WorkerRegistration] = {}
    failures: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            with WorkerClient(address, timeout=60.0) as worker:
                results[index] = worker.register(
                    case.name, index, world_size, case.rank_specs[index], case.memory[index]
                )
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not failures, failures
    return [results[i] for i in range(world_size)]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_rank_receives_vllms_config(
    vllm: ModuleType, monkeypatch: pytest.MonkeyPatch, server: EmbeddedServer, case: ModelCase
) -> None:
    cfg, expected = _vllm_configs(vllm, monkeypatch, case)

    world_size = len(case.rank_specs)
    config = PoolConfig(max_model_len=case.max_model_len, world_size=world_size, **case.pool)
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool(case.name, config)
        try:
            registrations = _register_all(server.grpc_address, case)
        finally:
            client.delete_pool(case.name)

    for registration, theirs, specs in zip(registrations, expected, case.rank_specs, strict=True):
        ours = registration.kv_cache_config
        assert _config_form(ours) == _config_form(theirs, set(specs)), registration.rank
        # Every group lists its layers in the model runner's order, never sorted.
        order = list(specs)
        for group in ours.kv_cache_groups:
            own = [name for name in group.layer_names if name in specs]
            assert own == sorted(own, key=order.index)
    assert registrations[0].max_model_len == cfg.model_config.max_model_len


def _refusals(address: str, case: ModelCase) -> list[BaseException]:
    """Register every rank of ``case`` in a fresh pool; what each rank was answered."""
    world_size = len(case.rank_specs)
    answers: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            with WorkerClient(address, timeout=60.0) as worker:
                worker.register(
                    case.name, index, world_size, case.rank_specs[index], case.memory[index]
                )
        except BaseException as exc:  # the answer under test
            answers.append(exc)

    config = PoolConfig(max_model_len=case.max_model_len, world_size=world_size, **case.pool)
    with SchedulerClient(address) as client:
        client.create_pool(case.name, config)
        try:
            threads = [threading.Thread(target=rank, args=(i,)) for i in range(world_size)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=90)
            assert client.describe_pool(case.name).registered_ranks == ()  # the round dropped
        finally:
            client.delete_pool(case.name)
    assert len(answers) == world_size, answers
    return answers


def test_whisper_without_an_encoder_budget_is_refused_naming_it(
    vllm: ModuleType, server: EmbeddedServer
) -> None:
    """vLLM always sizes cross attention by its encoder budget; a pool without one refuses."""
    del vllm
    case = _whisper_large_v3()
    (answer,) = _refusals(server.grpc_address, case)
    assert isinstance(answer, ServiceInvalidArgumentError), answer
    assert "model.decoder.layers.0.encoder_attn.attn" in str(answer)
    assert "max_num_encoder_input_tokens" in str(answer)


def test_whisper_whose_encoder_budget_does_not_fit_is_refused_as_vllm_refuses(
    vllm: ModuleType, monkeypatch: pytest.MonkeyPatch, server: EmbeddedServer
) -> None:
    """1 GiB holds 448 decoder tokens but not 8,192 encoder tokens: vLLM's message, both."""
    case = _whisper_large_v3(GIB, max_num_batched_tokens=8192)
    with pytest.raises(ValueError, match="To serve at least one request") as theirs:
        _vllm_configs(vllm, monkeypatch, case)
    (answer,) = _refusals(server.grpc_address, case)
    assert isinstance(answer, ServiceInvalidArgumentError), answer
    assert str(theirs.value) in str(answer)


def test_whisper_with_the_hybrid_manager_off_is_refused_by_both(
    vllm: ModuleType, monkeypatch: pytest.MonkeyPatch, server: EmbeddedServer
) -> None:
    """Full + cross attention cannot be one type: vLLM and kvcm both refuse the plan."""
    case = _whisper_large_v3(max_num_batched_tokens=8192, disable_hybrid_kv_cache_manager=True)
    with pytest.raises(ValueError, match="unified type"):
        _vllm_configs(vllm, monkeypatch, case)
    (answer,) = _refusals(server.grpc_address, case)
    assert isinstance(answer, ServiceInvalidArgumentError), answer
    assert "one unified type" in str(answer)


def test_vllm_leaves_the_hybrid_manager_on_for_chunked_local_attention(
    vllm: ModuleType,
) -> None:
    """The default kvcm takes for an unset switch is vLLM 0.33's: on, Llama 4 included.

    vLLM turns it off for chunked local attention only when its environment switch is 0
    (its default is 1). ``KVCM_LONG=1`` also builds vLLM's real ``VllmConfig`` for a tiny
    Llama-4 model (~1 minute) and reads the resolved flag.
    """
    from vllm import envs
    from vllm.config import SchedulerConfig

    assert os.environ.get("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE") is None
    assert envs.VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE is True
    assert SchedulerConfig.__dataclass_fields__["disable_hybrid_kv_cache_manager"].default is None
    if os.environ.get("KVCM_LONG") != "1":
        return
    assert _resolved_disable_hybrid(vllm) is False


def _resolved_disable_hybrid(vllm: ModuleType) -> bool:
    """``disable_hybrid_kv_cache_manager`` of a real VllmConfig for a tiny Llama-4 model,
    on a platform with hybrid support (the reference's CPU-only build has no platform)."""
    import json
    import sys
    import tempfile
    from pathlib import Path

    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform

    site = str(Path(vllm.__file__).parent.parent)
    registry._SUBPROCESS_COMMAND = [
        sys.executable,
        "-c",
        f"import sys, runpy; sys.path.append({site!r}); "
        "runpy.run_module('vllm.model_executor.models.registry', run_name='__main__')",
    ]
    model_dir = Path(tempfile.mkdtemp(prefix="kvcm-tiny-llama4-"))
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Llama4ForCausalLM"],
                "model_type": "llama4_text",
                "hidden_size": 64,
                "intermediate_size": 128,
                "intermediate_size_mlp": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "num_hidden_layers": 4,
                "vocab_size": 1000,
                "max_position_embeddings": 8192,
                "attention_chunk_size": 8192,
                "no_rope_layers": [1, 1, 1, 0],
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "torch_dtype": "bfloat16",
            }
        )
    )
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=8192)
    assert model.attention_chunk_size == 8192
    platform = type(current_platform)
    original = platform.__dict__.get("support_hybrid_kv_cache")
    platform.support_hybrid_kv_cache = classmethod(lambda cls: True)  # type: ignore[method-assign,assignment]
    try:
        config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(max_model_len=8192, is_encoder_decoder=False),
            device_config=DeviceConfig(device="cpu"),
            cache_config=CacheConfig(block_size=16),
        )
    finally:
        if original is None:
            del platform.support_hybrid_kv_cache
        else:
            platform.support_hybrid_kv_cache = original  # type: ignore[method-assign]
    return bool(config.scheduler_config.disable_hybrid_kv_cache_manager)


def test_a_sorted_layer_order_would_differ_from_vllm(vllm: ModuleType) -> None:
    """The guard for the cases above: sorting Gemma-3's layers changes its groups."""
    del vllm
    specs = _gemma_3_4b_specs()
    options = planning.PlanningOptions(max_model_len=32768)
    in_order = planning.plan_kv_cache([specs], [6 * GIB], options)
    by_name = planning.plan_kv_cache([dict(sorted(specs.items()))], [6 * GIB], options)
    assert in_order.kv_cache_groups != by_name.kv_cache_groups
