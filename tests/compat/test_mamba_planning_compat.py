"""Planning of hybrid attention + Mamba models in vLLM's "align" mode, against vLLM 0.33.0.

The layer shapes are those vLLM's model classes report per tensor-parallel rank for
Qwen3-Next (gated delta net), Nemotron-H, Granite-4.0-H (Mamba2), Jamba (Mamba1) and
Falcon-H1 (parallel attention + Mamba2): the attention block size is the one vLLM picks
for a hybrid model (``hybrid_attention_block_size``: the smallest multiple of the kernel
block whose attention page holds a Mamba state), the Mamba block equals it (align mode) and
the Mamba page is padded to the attention page. Each model is planned at 1, 2 and 4 ranks,
several context lengths and memory sizes, with and without speculative and prefill
checkpoint blocks and ``--prefix-match-unit``; both planners must agree on the groups, block
counts, every rank's tensors, the capacity report and the scheduler and hash block sizes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch
from test_planning_compat import Case, VllmPlanner, _compare

from kvcm.common.specs import FullAttentionSpec, KVCacheSpec, MambaSpec
from kvcm.core import planning


@dataclass(frozen=True)
class HybridModel:
    """A hybrid model's layers at tensor parallelism 1 (heads and state widths divide by TP)."""

    name: str
    num_layers: int
    attention_every: int  # 1: every layer has attention beside its Mamba mixer (Falcon-H1)
    num_kv_heads: int
    head_size: int
    # (per-TP-rank state shapes as a function of tp, dtypes)
    mamba_shapes: Any
    mamba_dtypes: tuple[str, ...]
    dtype: str = "bfloat16"


def _mamba2(n_groups: int, state: int, heads: int, head_dim: int, conv: int = 4) -> Any:
    def shapes(tp: int) -> tuple[tuple[int, ...], ...]:
        groups = max(n_groups // tp, 1) if n_groups % tp == 0 else n_groups
        intermediate = heads * head_dim // tp
        return ((conv - 1, intermediate + 2 * groups * state), (heads // tp, head_dim, state))

    return shapes


def _gated_delta_net(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> Any:
    def shapes(tp: int) -> tuple[tuple[int, ...], ...]:
        conv = (2 * key_heads * key_dim + value_heads * value_dim) // tp
        return ((3, conv), (value_heads // tp, key_dim, value_dim))

    return shapes


def _mamba1(inner: int, state: int, conv: int = 4) -> Any:
    def shapes(tp: int) -> tuple[tuple[int, ...], ...]:
        return ((inner // tp, conv - 1), (inner // tp, state))

    return shapes


MODELS = (
    HybridModel(
        "qwen3-next-80b-a3b",
        48,
        4,
        2,
        256,
        _gated_delta_net(16, 32, 128, 128),
        ("bfloat16", "bfloat16"),
    ),
    HybridModel("nemotron-h-8b", 52, 13, 8, 128, _mamba2(8, 128, 128, 64), ("bfloat16", "float32")),
    HybridModel(
        "granite-4.0-h-small", 40, 10, 8, 128, _mamba2(1, 128, 128, 64), ("bfloat16", "float32")
    ),
    HybridModel("jamba-v0.1", 32, 8, 8, 128, _mamba1(8192, 16), ("bfloat16", "float32")),
    HybridModel("falcon-h1-7b", 44, 1, 2, 128, _mamba2(1, 256, 48, 64), ("bfloat16", "float32")),
)


def _page(spec_shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...]) -> int:
    return sum(
        math.prod(shape) * torch.empty((), dtype=getattr(torch, d)).element_size()
        for shape, d in zip(spec_shapes, dtypes, strict=True)
    )


def _specs(
    model: HybridModel, tp: int, spec_blocks: int, checkpoint_blocks: int
) -> dict[str, KVCacheSpec]:
    shapes = model.mamba_shapes(tp)
    kv_heads = max(model.num_kv_heads // tp, 1)
    per_token = FullAttentionSpec(
        block_size=1, num_kv_heads=kv_heads, head_size=model.head_size, dtype=model.dtype
    ).page_size_bytes
    block_size = planning.hybrid_attention_block_size(
        per_token,
        _page(shapes, model.mamba_dtypes),
        kernel_block_alignment=16,
        checkpoint_alignment=64 if checkpoint_blocks else None,
    )
    attention = FullAttentionSpec(
        block_size=block_size, num_kv_heads=kv_heads, head_size=model.head_size, dtype=model.dtype
    )
    mamba = MambaSpec(
        block_size=block_size,
        shapes=shapes,
        dtypes=model.mamba_dtypes,
        page_size_padded=attention.page_size_bytes,
        mamba_cache_mode="align",
        num_speculative_blocks=spec_blocks,
        num_prefill_checkpoint_blocks=checkpoint_blocks,
        prefill_checkpoint_alignment=64 if checkpoint_blocks else None,
    )
    specs: dict[str, KVCacheSpec] = {}
    for layer in range(model.num_layers):
        if model.attention_every == 1:
            specs[f"model.layers.{layer}.self_attn.attn"] = attention
            specs[f"model.layers.{layer}.mamba.mixer"] = mamba
        elif layer % model.attention_every == model.attention_every - 1:
            specs[f"model.layers.{layer}.self_attn.attn"] = attention
        else:
            specs[f"model.layers.{layer}.mixer"] = mamba
    return specs


class _AlignPlanner(VllmPlanner):
    """vLLM's planning with the engine in Mamba align mode and the Mamba fields carried."""

    def config(self, options: planning.PlanningOptions) -> Any:
        config = super().config(options)
        config.cache_config.mamba_cache_mode = "align"
        return config

    def spec(self, spec: KVCacheSpec) -> Any:
        if isinstance(spec, MambaSpec):
            return self.iface.MambaSpec(
                block_size=spec.block_size,
                shapes=spec.shapes,
                dtypes=tuple(getattr(torch, d.value) for d in spec.dtypes),
                page_size_padded=spec.page_size_padded,
                mamba_cache_mode=spec.mamba_cache_mode,
                num_speculative_blocks=spec.num_speculative_blocks,
                num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
                prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment,
            )
        return super().spec(spec)


def _cases() -> list[tuple[str, Case]]:
    cases = []
    for model, tp, (spec_blocks, checkpoint_blocks), max_len, unit in itertools.product(
        MODELS, (1, 2, 4), ((0, 0), (1, 1)), (4096, 131072), (None, 64)
    ):
        scale = 0.2 if tp == 2 else 3.0  # two ranks: too little memory for long contexts
        specs = _specs(model, tp, spec_blocks, checkpoint_blocks)
        block_size = next(iter(specs.values())).block_size
        if unit is not None and block_size % unit:
            continue  # EngineCore refuses a match unit that does not divide the blocks
        page = next(iter(specs.values())).page_size_bytes
        memory = int(page * len(specs) * 400 * scale)
        options = planning.PlanningOptions(
            max_model_len=max_len,
            max_in_flight_tokens=8192,
            prefix_match_unit=unit,
        )
        name = f"{model.name}-tp{tp}-spec{spec_blocks}-len{max_len}-x{scale}-unit{unit}"
        cases.append((name, Case(rank_specs=[specs] * tp, memory=[memory] * tp, options=options)))
    return cases


def test_hybrid_mamba_models_plan_as_vllm(
    vllm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real hybrid shapes in align mode: kvcm plans exactly as vLLM 0.33.0."""
    planner = _AlignPlanner(vllm, monkeypatch)
    outcomes: dict[str, int] = {}
    for name, case in _cases():
        try:
            outcome = _compare(planner, case)
        except AssertionError as exc:
            raise AssertionError(name) from exc
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\nhybrid Mamba planning compat: {sum(outcomes.values())} cases {outcomes}")
    assert outcomes.get("planned", 0) >= sum(outcomes.values()) // 2, outcomes


def test_align_mode_live_states_differ_from_none(vllm: ModuleType) -> None:
    """What a request holds in align mode (two states, a prefill checkpoint, speculative
    blocks) is what vLLM sizes, and more than in "none" mode."""
    del vllm
    from vllm.v1.kv_cache_interface import MambaSpec as VllmMambaSpec

    specs = _specs(MODELS[1], 1, 1, 1)
    mamba = next(s for s in specs.values() if isinstance(s, MambaSpec))
    theirs = VllmMambaSpec(
        block_size=mamba.block_size,
        shapes=mamba.shapes,
        dtypes=tuple(getattr(torch, d.value) for d in mamba.dtypes),
        page_size_padded=mamba.page_size_padded,
        mamba_cache_mode="align",
        num_speculative_blocks=1,
        num_prefill_checkpoint_blocks=1,
    )
    for mode in ("align", "none"):
        config: Any = type("C", (), {})()
        config.cache_config = type("Cache", (), {"mamba_cache_mode": mode})()
        config.model_config = type("Model", (), {"max_model_len": 8192})()
        limits = planning.PlanningOptions(max_model_len=8192).limits()
        ours = (
            mamba
            if mode == "align"
            else mamba.__class__(**{**_fields(mamba), "mamba_cache_mode": "none"})
        )
        assert ours.max_memory_usage_bytes(limits) == theirs.max_memory_usage_bytes(config)
        assert ours.max_num_blocks_per_req(limits, 8192) == theirs.max_num_blocks_per_req(
            config, 8192
        )


def _fields(spec: MambaSpec) -> dict[str, Any]:
    return {
        "block_size": spec.block_size,
        "shapes": spec.shapes,
        "dtypes": spec.dtypes,
        "page_size_padded": spec.page_size_padded,
        "num_speculative_blocks": spec.num_speculative_blocks,
        "num_prefill_checkpoint_blocks": spec.num_prefill_checkpoint_blocks,
        "prefill_checkpoint_alignment": spec.prefill_checkpoint_alignment,
    }
