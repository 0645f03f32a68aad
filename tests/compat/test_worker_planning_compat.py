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
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
from test_planning_compat import VllmPlanner, _config_form

from kvcm.client import PoolConfig, SchedulerClient, WorkerClient, WorkerRegistration
from kvcm.common.dtypes import DType
from kvcm.common.specs import (
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
    """One engine: each rank's specs (in the model runner's order) and memory."""

    name: str
    rank_specs: list[dict[str, KVCacheSpec]]
    memory: list[int]
    max_model_len: int


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


CASES = [_llama_3_1_8b_tp2(), _gemma_3_4b(), _gemma_3_4b_pp2(), _deepseek_v2_lite_pp2()]


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
    planner = VllmPlanner(vllm, monkeypatch)
    options = planning.PlanningOptions(max_model_len=case.max_model_len)
    cfg = planner.config(options)
    vllm_specs = [{n: planner.spec(s) for n, s in rank.items()} for rank in case.rank_specs]
    groups = planner.planning.get_global_kv_cache_groups(cfg, vllm_specs)
    expected = planner.planning.get_kv_cache_configs(cfg, vllm_specs, case.memory, groups)

    world_size = len(case.rank_specs)
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool(
            case.name, PoolConfig(max_model_len=case.max_model_len, world_size=world_size)
        )
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
    assert registrations[0].max_model_len == case.max_model_len


def test_a_sorted_layer_order_would_differ_from_vllm(vllm: ModuleType) -> None:
    """The guard for the cases above: sorting Gemma-3's layers changes its groups."""
    del vllm
    specs = _gemma_3_4b_specs()
    options = planning.PlanningOptions(max_model_len=32768)
    in_order = planning.plan_kv_cache([specs], [6 * GIB], options)
    by_name = planning.plan_kv_cache([dict(sorted(specs.items()))], [6 * GIB], options)
    assert in_order.kv_cache_groups != by_name.kv_cache_groups
