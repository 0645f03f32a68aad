"""A pool's planning inputs: the PoolConfig fields vLLM's planning reads, through a real Pool.

Each input changes the plan as it changes vLLM's (tests/compat/test_worker_planning_compat.py
compares the numbers with vLLM 0.33.0 itself); here: the mapping from the pool's config, the
refusals (naming the field, nothing kept) and each field's effect on a registered pool.
"""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheLayout
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
)
from kvcm.core.planning import PlanningOptions, plan_kv_cache
from kvcm.core.pool import Pool, PoolConfig, PoolState

ATTN = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": "float16"}
FULL = FullAttentionSpec(**ATTN)  # type: ignore[arg-type]
CHUNK = ChunkedLocalAttentionSpec(attention_chunk_size=256, **ATTN)  # type: ignore[arg-type]
CROSS = CrossAttentionSpec(**ATTN)  # type: ignore[arg-type]
PAGE = FULL.page_size_bytes


def _llama4_like() -> dict[str, KVCacheSpec]:
    # 3 chunked-local layers to 1 full-attention layer, as Llama 4.
    return {f"layers.{i}": FULL if i % 4 == 3 else CHUNK for i in range(8)}


def _whisper_like() -> dict[str, KVCacheSpec]:
    specs: dict[str, KVCacheSpec] = {}
    for i in range(4):
        specs[f"decoder.layers.{i}.self_attn.attn"] = FULL
        specs[f"decoder.layers.{i}.encoder_attn.attn"] = CROSS
    return specs


def _plan(config: PoolConfig, specs: dict[str, KVCacheSpec], memory: int) -> Pool:
    pool = Pool("p", config)
    for rank in range(config.world_size):
        pool.register_worker(rank, config.world_size, specs, memory)
    return pool


def test_planning_options_carry_every_input() -> None:
    config = PoolConfig(
        max_model_len=4096,
        world_size=2,
        num_blocks_override=100,
        max_in_flight_tokens=512,
        enable_caching=False,
        disable_hybrid_kv_cache_manager=True,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=1 << 30,
        auto_fit_max_model_len=True,
        kv_cache_layout="BLHNC",  # type: ignore[arg-type]
    )
    assert config.planning_options() == PlanningOptions(
        max_model_len=4096,
        max_in_flight_tokens=512,
        max_num_encoder_input_tokens=2048,  # vLLM's: max_num_batched_tokens
        num_gpu_blocks_override=100,
        kv_cache_memory_bytes=1 << 30,
        enable_hybrid_manager=False,
        auto_fit_max_model_len=True,
        kv_cache_layout=KVCacheLayout.BLHNC,
        enable_caching=False,
    )
    explicit = PoolConfig(
        max_model_len=8, world_size=1, max_num_batched_tokens=2048, max_num_encoder_input_tokens=0
    )
    assert explicit.planning_options().max_num_encoder_input_tokens == 0
    default = PoolConfig(max_model_len=8, world_size=1).planning_options()
    assert default.enable_hybrid_manager is True  # vLLM's default on every real platform
    assert default.max_num_encoder_input_tokens is None


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"max_num_batched_tokens": 0}, "config.max_num_batched_tokens"),
        ({"max_num_encoder_input_tokens": -1}, "config.max_num_encoder_input_tokens"),
        ({"kv_cache_memory_bytes": 0}, "config.kv_cache_memory_bytes"),
        ({"kv_cache_memory_bytes": 1 << 64}, "config.kv_cache_memory_bytes"),
        ({"kv_cache_layout": "LBXYZ"}, "config.kv_cache_layout"),
    ],
)
def test_bad_planning_inputs_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field) as caught:
        PoolConfig(max_model_len=8, world_size=1, **overrides)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_hybrid_manager_switch_changes_the_llama4_plan() -> None:
    specs = _llama4_like()
    memory = 1000 * PAGE
    on = _plan(PoolConfig(max_model_len=1024, world_size=2), specs, memory)
    off = _plan(
        PoolConfig(max_model_len=1024, world_size=2, disable_hybrid_kv_cache_manager=True),
        specs,
        memory,
    )
    # On: 3 chunked groups and 1 full group of 2 layers share 2-page blocks. Off: every
    # layer is full attention (recording its chunk) in one group of 8 pages per block.
    assert on.kv_cache_config is not None
    assert off.kv_cache_config is not None
    assert [len(g.layer_names) for g in on.kv_cache_config.kv_cache_groups] == [2, 2, 2, 2]
    assert on.kv_cache_config.num_blocks == 500
    (group,) = off.kv_cache_config.kv_cache_groups
    assert group.kv_cache_spec == FullAttentionSpec(attention_chunk_size=256, **ATTN)  # type: ignore[arg-type]
    assert off.kv_cache_config.num_blocks == 125
    explicit_on = _plan(
        PoolConfig(max_model_len=1024, world_size=1, disable_hybrid_kv_cache_manager=False),
        specs,
        memory,
    )
    assert explicit_on.kv_cache_config == on.kv_cache_config


def test_cross_attention_needs_an_encoder_budget() -> None:
    specs = _whisper_like()
    # vLLM turns prefix caching off for encoder-decoder models; a kvcm pool says so.
    whisper = {"max_model_len": 448, "world_size": 1, "enable_caching": False}
    pool = Pool("whisper", PoolConfig(**whisper))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"encoder_attn.*max_num_encoder_input_tokens") as caught:
        pool.register_worker(0, 1, specs, 1000 * PAGE)
    assert caught.value.field == "max_num_encoder_input_tokens"
    assert pool.state is PoolState.PENDING_WORKERS
    assert not pool.registrations
    assert pool.failed_plans == 0  # refused before it was recorded, no round to drop
    pool.register_worker(0, 1, {"decoder.layers.0.self_attn.attn": FULL}, 1000 * PAGE)
    assert pool.state is PoolState.READY  # a decoder-only rank needs no encoder budget
    # With the budget (vLLM's max_num_batched_tokens), one request needs 448 decoder tokens
    # (28 blocks) and 1,500 encoder tokens (94 blocks) in groups of 4-page blocks.
    budget = _plan(
        PoolConfig(**whisper, max_num_batched_tokens=1500),  # type: ignore[arg-type]
        specs,
        4 * PAGE * 123,
    )
    assert budget.kv_cache_config is not None
    assert budget.kv_cache_config.num_blocks == 123
    with pytest.raises(ConfigError, match="To serve at least one request"):
        _plan(
            PoolConfig(**whisper, max_num_encoder_input_tokens=1500),  # type: ignore[arg-type]
            specs,
            4 * PAGE * 122,
        )
    # A hybrid-off engine cannot plan full + cross attention at all (vLLM refuses too).
    with pytest.raises(ConfigError, match="one unified type"):
        _plan(
            PoolConfig(
                **whisper,  # type: ignore[arg-type]
                max_num_batched_tokens=1500,
                disable_hybrid_kv_cache_manager=True,
            ),
            specs,
            1000 * PAGE,
        )


def test_kv_cache_memory_bytes_replaces_what_ranks_offer() -> None:
    config = PoolConfig(max_model_len=64, world_size=2, kv_cache_memory_bytes=50 * PAGE)
    pool = Pool("fixed", config)
    pool.register_worker(0, 2, {"l0": FULL}, 10 * PAGE)
    pool.register_worker(1, 2, {"l0": FULL}, 1000 * PAGE)
    assert pool.kv_cache_config is not None
    assert pool.kv_cache_config.num_blocks == 50
    assert pool.plan is not None
    assert [r.available_memory_bytes for r in pool.plan.ranks] == [10 * PAGE, 1000 * PAGE]


def test_auto_fit_and_layout_reach_the_ranks() -> None:
    config = PoolConfig(
        max_model_len=1 << 20,
        world_size=1,
        auto_fit_max_model_len=True,
        kv_cache_layout="BLHNC",  # type: ignore[arg-type]
    )
    pool = _plan(config, {"l0": FULL, "l1": FULL}, 101 * 2 * PAGE)
    # 100 usable blocks of 16 tokens after the null block.
    assert pool.max_model_len == 1600
    rank = pool.rank_config(0)
    assert rank.kv_cache_layout is KVCacheLayout.BLHNC
    expected = plan_kv_cache(
        [{"l0": FULL, "l1": FULL}],
        [101 * 2 * PAGE],
        PlanningOptions(
            max_model_len=1 << 20, auto_fit_max_model_len=True, kv_cache_layout="BLHNC"
        ),  # type: ignore[arg-type]
    )
    assert rank == expected.kv_cache_config(0)
