"""Unit tests for kvcm.core.planning: grouping, sizing, fit checks, unification."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec, KVCacheLayout
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.specs import (
    ChunkedLocalAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvcm.core import planning
from kvcm.core.planning import PlanningOptions, plan_kv_cache

GiB = 1 << 30


def full(block_size: int = 16, heads: int = 2, head: int = 64, **kw: object) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head, dtype="float16", **kw
    )


def swa(window: int = 128, block_size: int = 16, heads: int = 2, head: int = 64) -> KVCacheSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head,
        dtype="float16",
        sliding_window=window,
    )


ENC = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": "float16"}
PAGE = 16 * 2 * 128 * 2  # block_size x heads x (k + v head sizes) x fp16 bytes = 8192


def opts(**kw: object) -> PlanningOptions:
    kw.setdefault("max_model_len", 1024)
    return PlanningOptions(**kw)  # type: ignore[arg-type]


def names(plan: planning.UnifiedPlan) -> list[tuple[str, ...]]:
    return [g.layer_names for g in plan.kv_cache_groups]


# ----------------------------------------------------------------------------- grouping
def test_uniform_model_is_one_group_with_merged_spec() -> None:
    specs = {f"l{i}": full() for i in range(4)}
    plan = plan_kv_cache([specs], [GiB], opts())
    assert names(plan) == [("l0", "l1", "l2", "l3")]
    assert plan.kv_cache_groups[0].kv_cache_spec == full()
    (tensor,) = plan.ranks[0].kv_cache_config.kv_cache_tensors
    # Layer-outermost: each layer owns num_blocks pages.
    assert tensor.block_stride == PAGE
    assert tensor.layer_stride == PAGE * plan.num_blocks
    assert plan.num_blocks == GiB // (4 * PAGE)


def test_two_full_four_sliding_window_layers_make_three_strided_groups() -> None:
    specs = {
        "full.0": full(),
        "sw.0": swa(),
        "sw.1": swa(),
        "full.1": full(),
        "sw.2": swa(),
        "sw.3": swa(),
    }
    plan = plan_kv_cache([specs], [GiB], opts())
    assert names(plan) == [("full.0", "full.1"), ("sw.0", "sw.2"), ("sw.1", "sw.3")]
    kinds = [type(g.kv_cache_spec) for g in plan.kv_cache_groups]
    assert kinds == [FullAttentionSpec, SlidingWindowSpec, SlidingWindowSpec]
    # Groups overlay the same bytes: a block is two layers' pages.
    assert planning.pool_bytes_per_block(plan.kv_cache_groups) == 2 * PAGE
    assert plan.num_blocks == GiB // (2 * PAGE)
    offsets = {t.offset for t in plan.ranks[0].kv_cache_config.kv_cache_tensors}
    assert offsets == {0}


def test_uneven_bucket_pads_its_last_group() -> None:
    specs = {"f0": full(), "f1": full(), "s0": swa(), "s1": swa(), "s2": swa()}
    plan = plan_kv_cache([specs], [GiB], opts())
    # 3 sliding layers in groups of 2: (s0, s2) and (s1, <padding>).
    assert names(plan) == [("f0", "f1"), ("s0", "s2"), ("s1",)]
    assert planning.pool_bytes_per_block(plan.kv_cache_groups) == 2 * PAGE


def test_nearly_equal_buckets_use_the_larger_count() -> None:
    specs = {f"s{i}": swa() for i in range(12)} | {f"f{i}": full() for i in range(13)}
    groups = planning.get_kv_cache_groups(specs, opts())
    assert [len(g.layer_names) for g in groups] == [12, 13]


def test_page_sizes_unify_by_block_size_or_padding() -> None:
    big = full(heads=4)  # page 2 x PAGE
    specs = {"f": big, "s": swa()}
    groups = planning.get_kv_cache_groups(specs, opts())
    assert groups[1].kv_cache_spec.block_size == 32
    assert groups[1].kv_cache_spec.page_size_bytes == big.page_size_bytes
    odd = {"f": full(heads=3), "s": swa(heads=2)}  # 3:2 pages, no integer ratio
    padded = planning.unify_kv_cache_spec_page_size(odd)
    assert padded["s"].page_size_bytes == odd["f"].page_size_bytes
    assert padded["s"].block_size == 16


def test_mla_page_that_cannot_be_padded_is_rejected_naming_the_layer() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="float16")
    specs: dict[str, KVCacheSpec] = {"mla": mla, "big": full(heads=7, head=64)}
    with pytest.raises(ConfigError, match="Layer mla"):
        planning.unify_kv_cache_spec_page_size(specs)


def test_mixed_heads_of_one_type_form_a_uniform_type_group() -> None:
    specs = {"a": full(heads=2), "b": full(heads=4)}
    plan = plan_kv_cache([specs], [GiB], opts())
    (group,) = plan.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.kv_cache_spec.page_size_bytes == 3 * PAGE
    tensors = plan.ranks[0].kv_cache_config.kv_cache_tensors
    assert [t.layers for t in tensors] == [("a",), ("b",)]
    assert tensors[1].offset == tensors[0].layer_stride  # layer-outermost regions follow
    assert plan.scheduler_kv_cache_config.kv_cache_groups[0].kv_cache_spec == full(heads=2)


def test_attention_free_model_has_no_groups_and_only_the_null_block() -> None:
    plan = plan_kv_cache([{}], [0], opts())
    assert plan.kv_cache_groups == ()
    assert plan.num_blocks == 1
    assert plan.ranks[0].kv_cache_config.kv_cache_tensors == ()


# ----------------------------------------------------------------------------- hybrid off
def test_unify_hybrid_promotes_local_layers_and_records_windows() -> None:
    chunk = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float16", attention_chunk_size=256
    )
    promoted = planning.unify_hybrid_kv_cache_specs({"f": full(), "s": swa(window=64)})
    assert promoted["s"] == full(sliding_window=64)
    promoted = planning.unify_hybrid_kv_cache_specs({"f": full(), "c": chunk})
    assert promoted["c"] == full(attention_chunk_size=256)
    plan = plan_kv_cache(
        [{"f": full(), "s": swa(window=64)}], [GiB], opts(enable_hybrid_manager=False)
    )
    assert names(plan) == [("f", "s")]


def test_unify_hybrid_rejects_what_cannot_become_one_type() -> None:
    with pytest.raises(ConfigError, match="same window size"):
        planning.unify_hybrid_kv_cache_specs({"f": full(), "a": swa(64), "b": swa(128)})
    mamba = MambaSpec(block_size=16, shapes=((4, 64),), dtypes=("float16",))
    with pytest.raises(ConfigError, match="Failed to promote"):
        planning.unify_hybrid_kv_cache_specs({"s": swa(), "m": mamba})
    same = {"a": full(), "b": full()}
    assert planning.unify_hybrid_kv_cache_specs(same) == same


# ----------------------------------------------------------------------------- sizing
def test_null_block_is_reserved_before_the_fit_check() -> None:
    specs = {"l": full()}
    need = 1024 // 16 * PAGE  # one max_model_len request
    plan = plan_kv_cache([specs], [need + PAGE], opts())  # + the null block
    assert plan.num_blocks == 65
    with pytest.raises(ConfigError, match="estimated maximum model length is 1008"):
        plan_kv_cache([specs], [need + PAGE - 1], opts())
    with pytest.raises(ConfigError, match="No available memory for the cache blocks"):
        plan_kv_cache([specs], [PAGE], opts())
    with pytest.raises(ConfigError, match="No available memory"):
        plan_kv_cache([specs], [0], opts())


def test_fit_message_is_vllms() -> None:
    with pytest.raises(ConfigError) as info:
        plan_kv_cache([{"l": full()}], [GiB // 4], opts(max_model_len=1 << 20))
    message = str(info.value)
    assert message.startswith(
        "To serve at least one request with the model's max seq len (1048576), (0.5 GiB KV "
        "cache is needed, which is larger than the available KV cache memory (0.25 GiB). "
        "Based on the available memory, the estimated maximum model length is 524272. "
    )


def test_estimate_max_model_len_binary_search() -> None:
    groups = planning.get_kv_cache_groups({"l": full()}, opts())
    assert planning.estimate_max_model_len(groups, 10 * PAGE, opts()) == 160
    assert planning.estimate_max_model_len(groups, PAGE - 1, opts()) == 0
    assert planning.estimate_max_model_len(groups, GiB, opts(max_model_len=100)) == 100
    window = planning.get_kv_cache_groups({"s": swa(window=32)}, opts())
    # A window's blocks stop growing (window + in-flight tokens): any length fits.
    capped = opts(max_model_len=9999, max_in_flight_tokens=64)
    assert planning.estimate_max_model_len(window, 7 * PAGE, capped) == 9999
    assert planning.estimate_max_model_len(window, 6 * PAGE, capped) == 80


def test_override_sets_the_block_count_and_keeps_the_null_block_check() -> None:
    plan = plan_kv_cache([{"l": full()}], [GiB], opts(num_gpu_blocks_override=100))
    assert plan.num_blocks == 100
    assert plan.ranks[0].kv_cache_config.kv_cache_tensors[0].size == 100 * PAGE
    with pytest.raises(ConfigError, match="No available memory"):
        plan_kv_cache([{"l": full()}], [GiB], opts(num_gpu_blocks_override=1))
    with pytest.raises(ConfigError, match="To serve"):
        plan_kv_cache([{"l": full()}], [GiB], opts(num_gpu_blocks_override=10))


def test_auto_fit_shrinks_max_model_len_to_the_tightest_rank() -> None:
    specs = {"l": full()}
    memory = [GiB, 11 * PAGE]  # rank 1: 10 usable pages = 160 tokens
    plan = plan_kv_cache([specs, specs], memory, opts(auto_fit_max_model_len=True))
    assert plan.max_model_len == 160
    assert plan.capacity.max_model_len == 160
    with pytest.raises(ConfigError, match="Cannot auto-fit"):
        plan_kv_cache([specs], [PAGE + 1], opts(auto_fit_max_model_len=True))


# ----------------------------------------------------------------------------- ranks
def test_every_rank_gets_the_minimum_block_count() -> None:
    specs = {"l": full()}
    memory = [300 * PAGE, 200 * PAGE + 5, 250 * PAGE]
    plan = plan_kv_cache([specs] * 3, memory, opts(max_model_len=128))
    assert plan.num_blocks == 200
    assert [r.num_blocks_fit for r in plan.ranks] == [300, 200, 250]
    for rank in plan.ranks:
        assert rank.kv_cache_config.num_blocks == 200
        assert rank.kv_cache_config.kv_cache_tensors[0].size == 200 * PAGE
    assert plan.kv_cache_config(2) is plan.ranks[2].kv_cache_config
    with pytest.raises(InvalidArgumentError):
        plan.kv_cache_config(3)


def test_pipeline_stages_get_their_own_layers_and_global_groups() -> None:
    stage0 = {"f0": full(), "s0": swa(), "s1": swa()}
    stage1 = {"f1": full(), "s2": swa(), "s3": swa()}
    plan = plan_kv_cache([stage0, stage1], [GiB, GiB], opts())
    assert names(plan) == [("f0", "f1"), ("s0", "s2"), ("s1", "s3")]
    rank0 = plan.ranks[0].kv_cache_config
    assert [g.layer_names for g in rank0.kv_cache_groups] == [("f0",), ("s0",), ("s1",)]
    layers = {name for t in rank0.kv_cache_tensors for name in t.layers}
    assert layers == {"f0", "s0", "s1"}


def test_inconsistent_specs_between_ranks_name_the_layer() -> None:
    with pytest.raises(ConfigError, match=r"'model\.layers\.3'.*rank 0 and rank 1"):
        plan_kv_cache(
            [{"model.layers.3": full()}, {"model.layers.3": full(heads=4)}],
            [GiB, GiB],
            opts(),
        )


@pytest.mark.parametrize(
    ("specs", "memory", "match"),
    [
        ([], [], "at least one rank"),
        ([{"l": full()}], [GiB, GiB], "2 entries for 1 ranks"),
        ([{"l": full()}], [-1], r"available_memory\[0\]"),
        ([{"l": full()}], [1.5], r"available_memory\[0\]"),
        ([{"": full()}], [GiB], "layer names"),
        ([{"l": "full"}], [GiB], "layer 'l' has no KVCacheSpec"),
        (
            [{"l": full(), "enc": EncoderOnlyAttentionSpec(**ENC)}],
            [GiB],
            "layer 'enc' is encoder-only",
        ),
    ],
)
def test_bad_plan_input(specs: list[dict[str, object]], memory: list[object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_kv_cache(specs, memory, opts())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_model_len", 0),
        ("max_in_flight_tokens", -5),
        ("num_gpu_blocks_override", 0),
        ("prefix_match_unit", 0),
        ("max_num_encoder_input_tokens", -1),
        ("kv_cache_layout", "XYZ"),
    ],
)
def test_bad_options_name_the_field(field: str, value: object) -> None:
    kw: dict[str, object] = {"max_model_len": 16, field: value}
    with pytest.raises(InvalidArgumentError, match=field):
        PlanningOptions(**kw)  # type: ignore[arg-type]


def test_zero_and_negative_spec_fields_are_rejected_by_name() -> None:
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        full(heads=0)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float13")


# ----------------------------------------------------------------------------- scheduler view
def test_scheduler_and_hash_block_sizes() -> None:
    one = planning.get_kv_cache_groups({"l": full(block_size=32)}, opts())
    assert planning.resolve_kv_cache_block_sizes(one, opts()) == (32, 32)
    with pytest.raises(ConfigError, match="prefix_match_unit=16"):
        planning.resolve_kv_cache_block_sizes(one, opts(prefix_match_unit=16))
    hybrid = planning.get_kv_cache_groups({"f": full(heads=4), "s": swa()}, opts())
    assert [g.kv_cache_spec.block_size for g in hybrid] == [16, 32]
    assert planning.resolve_kv_cache_block_sizes(hybrid, opts()) == (32, 16)
    assert planning.resolve_kv_cache_block_sizes(hybrid, opts(enable_caching=False)) == (32, 32)
    with pytest.raises(ConfigError, match="divisible"):
        planning.resolve_kv_cache_block_sizes(hybrid, opts(prefix_match_unit=12))


def test_capacity_report_uses_vllms_wording() -> None:
    plan = plan_kv_cache([{"l": full()}], [1000 * PAGE], opts(max_model_len=1024))
    # 1000 blocks / 64 blocks per request.
    assert plan.capacity.max_concurrency == 1000 / 64
    assert plan.capacity.num_tokens == 16000
    assert plan.capacity.report == (
        "GPU KV cache size: 16,000 tokens, Maximum concurrency for 1,024 tokens per request: 15.62x"
    )


# ----------------------------------------------------------------------------- layouts
def test_block_outermost_layout_packs_every_layer_page_into_a_block() -> None:
    specs = {"a": full(), "b": full()}
    plan = plan_kv_cache([specs], [GiB], opts(kv_cache_layout=KVCacheLayout.BLHNC))
    (tensor,) = plan.ranks[0].kv_cache_config.kv_cache_tensors
    assert (tensor.layer_stride, tensor.block_stride) == (PAGE, 2 * PAGE)
    assert plan.ranks[0].kv_cache_config.kv_cache_layout is KVCacheLayout.BLHNC


def test_block_outermost_layout_packs_mixed_pages_side_by_side() -> None:
    # Full attention repeats a (2-head, 4-head) pattern twice; six sliding-window layers.
    a, b, s = full(heads=2), full(heads=4), swa()
    specs: dict[str, KVCacheSpec] = {
        "a0": a, "b0": b, "s0": s, "s1": s, "s2": s, "a1": a, "b1": b, "s3": s, "s4": s, "s5": s
    }  # fmt: skip
    plan = plan_kv_cache([specs], [GiB], opts(kv_cache_layout=KVCacheLayout.BLHNC))
    # The pattern's 2 repeats set the group size: the sliding layers are cut into 3 strided
    # groups of 2; nothing is padded or re-blocked, every group is uniform-type.
    assert names(plan) == [("a0", "b0", "a1", "b1"), ("s0", "s3"), ("s1", "s4"), ("s2", "s5")]
    assert all(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in plan.kv_cache_groups)
    assert [g.kv_cache_spec.block_size for g in plan.kv_cache_groups] == [16] * 4
    block = 2 * PAGE + 2 * 2 * PAGE  # the widest group: both repeats of the pattern
    assert planning.pool_bytes_per_block(plan.kv_cache_groups) == block
    tensors = plan.ranks[0].kv_cache_config.kv_cache_tensors
    placed = [(t.layers, t.offset, t.layer_stride, t.block_stride) for t in tensors]
    assert placed == [
        (("a0", "a1"), 0, PAGE, block),
        (("b0", "b1"), 2 * PAGE, 2 * PAGE, block),
        (("s0", "s3"), 0, PAGE, block),
        (("s1", "s4"), 0, PAGE, block),
        (("s2", "s5"), 0, PAGE, block),
    ]
    assert plan.num_blocks == GiB // block


def test_block_outermost_sliding_layers_fill_the_block_others_need() -> None:
    # No repeating pattern: sliding-window layers are states cut to fit the full layer's block.
    specs: dict[str, KVCacheSpec] = {"f": full(heads=4), "s0": swa(), "s1": swa(), "s2": swa()}
    groups = planning.get_kv_cache_groups(specs, opts(kv_cache_layout="BLNHC"))  # type: ignore[arg-type]
    assert [g.layer_names for g in groups] == [("f",), ("s0", "s2"), ("s1",)]


def test_block_outermost_unequal_state_bucket_is_refused() -> None:
    # Sliding layers of two page sizes in unequal numbers cannot be cut evenly (vLLM 0.33
    # loses layers or crashes here).
    specs: dict[str, KVCacheSpec] = {
        "f": full(heads=1),
        "s0": swa(heads=2),
        "s1": swa(heads=1),
        "s2": swa(heads=1),
    }
    with pytest.raises(ConfigError, match="unequal page-size counts"):
        planning.get_kv_cache_groups(specs, opts(kv_cache_layout="BLHNC"))  # type: ignore[arg-type]


def test_block_outermost_layout_without_compact_pages_cannot_mix_pages() -> None:
    specs: dict[str, KVCacheSpec] = {"f": full(heads=4), "s": swa()}
    with pytest.raises(ConfigError, match="cannot express"):
        plan_kv_cache([specs], [GiB], opts(kv_cache_layout=KVCacheLayout.BHLNC))


def test_layout_strides_follow_the_axis_order() -> None:
    spec = full(heads=2, head=64)
    content = 128 * 2
    lbnhc = planning.compute_layout_strides(spec, 10, 3, KVCacheLayout.LBNHC)
    assert lbnhc == (10 * PAGE, PAGE, content, 2 * content, 1)
    lbhnc = planning.compute_layout_strides(spec, 10, 3, KVCacheLayout.LBHNC)
    assert lbhnc == (10 * PAGE, PAGE, 16 * content, content, 1)
    blhnc = planning.compute_layout_strides(spec, 10, 3, KVCacheLayout.BLHNC, block_stride=3 * PAGE)
    assert blhnc == (PAGE, 3 * PAGE, 16 * content, content, 1)


# ----------------------------------------------------------------------------- vLLM's numbers
# The cases of vLLM's own planning tests (tests/v1/core/test_kv_cache_utils.py), restated in
# kvcm's terms. Their reference layer: block 16, 2 KV heads, head 64, float32 -> 16 KiB pages.
def vfull(**kw: object) -> FullAttentionSpec:
    kw = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": "float32"} | kw
    return FullAttentionSpec(**kw)  # type: ignore[arg-type]


def vswa(**kw: object) -> SlidingWindowSpec:
    kw = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": "float32"} | kw
    kw.setdefault("sliding_window", 1)
    return SlidingWindowSpec(**kw)  # type: ignore[arg-type]


VPAGE = 16 * 2 * 64 * 4 * 2  # vLLM's mem_per_block_per_layer


def regions(config: KVCacheConfig) -> list[tuple[int, list[str]]]:
    """Each layer region of a layer-outermost config as (bytes, layers sharing it).

    This is vLLM's older ``KVCacheTensor(size, shared_by)`` view of the same placement:
    layers of different groups whose block 0 starts at the same byte share a region.
    """
    by_start: dict[int, tuple[int, list[str]]] = {}
    for tensor in config.kv_cache_tensors:
        for index, name in enumerate(tensor.layers):
            start = tensor.offset + index * tensor.layer_stride
            size, layers = by_start.setdefault(start, (tensor.layer_stride, []))
            assert size == tensor.layer_stride
            layers.append(name)
    return [by_start[start] for start in sorted(by_start)]


def layer_names_of(config: KVCacheConfig) -> list[tuple[str, ...]]:
    return [g.layer_names for g in config.kv_cache_groups]


def one_worker(specs: dict[str, KVCacheSpec], memory: int, **kw: object) -> KVCacheConfig:
    return plan_kv_cache([specs], [memory], opts(max_model_len=16, **kw)).kv_cache_config(0)


def ln(*indices: int) -> list[str]:
    return [f"layer_{i}" for i in indices]


@pytest.mark.parametrize(
    ("num_full", "num_swa", "memory_pages", "num_blocks", "groups", "shared"),
    [
        # Uniform: one group, a region per layer.
        (2, 0, 2 * 32, 32, [ln(1, 2)], [ln(1), ln(2)]),
        (0, 2, 2 * 32, 32, [ln(1, 2)], [ln(1), ln(2)]),
        # Hybrid 1 + 1: two groups of one layer overlay one region of twice the blocks.
        (1, 1, 2 * 32, 64, [ln(1), ln(2)], [ln(1, 2)]),
        # 2 full + 4 sliding: groups of 2 layers, the sliding ones strided.
        (2, 4, 2 * 32, 32, [ln(1, 2), ln(3, 5), ln(4, 6)], [ln(1, 3, 4), ln(2, 5, 6)]),
        # 3 full + 7 sliding: groups of 3, the last sliding groups padded to 3.
        (
            3,
            7,
            3 * 32,
            32,
            [ln(1, 2, 3), ln(4, 7, 10), ln(5, 8), ln(6, 9)],
            [ln(1, 4, 5, 6), ln(2, 7, 8, 9), ln(3, 10)],
        ),
        # 6 full + 5 sliding (gpt-oss with EAGLE): nearly equal, one group each, padded to 6.
        (
            6,
            5,
            6 * 32,
            32,
            [ln(1, 2, 3, 4, 5, 6), ln(7, 8, 9, 10, 11)],
            [ln(1, 7), ln(2, 8), ln(3, 9), ln(4, 10), ln(5, 11), ln(6)],
        ),
    ],
)
def test_vllm_one_worker_groupings(
    num_full: int,
    num_swa: int,
    memory_pages: int,
    num_blocks: int,
    groups: list[list[str]],
    shared: list[list[str]],
) -> None:
    specs: dict[str, KVCacheSpec] = {}
    for i in range(1, num_full + num_swa + 1):
        specs[f"layer_{i}"] = vfull() if i <= num_full else vswa()
    config = one_worker(specs, VPAGE * memory_pages)
    assert config.num_blocks == num_blocks
    assert layer_names_of(config) == [tuple(g) for g in groups]
    assert regions(config) == [(VPAGE * num_blocks, layers) for layers in shared]


def test_vllm_one_worker_hybrid_disabled_records_the_window() -> None:
    config = one_worker(
        {"layer_1": vfull(), "layer_2": vswa()}, VPAGE * 2 * 32, enable_hybrid_manager=False
    )
    assert config.num_blocks == 32
    assert config.kv_cache_groups == (KVCacheGroupSpec(ln(1, 2), vfull(sliding_window=1)),)
    assert regions(config) == [(VPAGE * 32, ln(1)), (VPAGE * 32, ln(2))]


def test_vllm_one_worker_page_size_unification() -> None:
    # Same type, different head size: one uniform-type group, regions of each layer's page.
    specs: dict[str, KVCacheSpec] = {"layer_1": vfull(head_size=128), "layer_2": vfull()}
    config = one_worker(specs, VPAGE * 3 * 32)
    assert config.num_blocks == 32
    assert config.kv_cache_groups == (
        KVCacheGroupSpec(ln(1, 2), UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs)),
    )
    assert regions(config) == [(2 * VPAGE * 32, ln(1)), (VPAGE * 32, ln(2))]
    # Different type, half the page: the sliding layer's block size doubles.
    config = one_worker({"layer_1": vfull(), "layer_2": vswa(head_size=32)}, VPAGE * 32)
    assert config.num_blocks == 32
    assert [g.kv_cache_spec for g in config.kv_cache_groups] == [
        vfull(),
        vswa(head_size=32, block_size=32),
    ]
    assert regions(config) == [(VPAGE * 32, ln(1, 2))]
    # 2:3 pages cannot be unified by block size: vLLM 0.33 pads the smaller page.
    config = one_worker({"layer_1": vfull(), "layer_2": vswa(head_size=96)}, 3 * VPAGE * 32)
    padded = config.kv_cache_groups[0].kv_cache_spec
    assert padded == vfull(page_size_padded=3 * VPAGE // 2)
    assert config.num_blocks == 64


def test_vllm_one_worker_block_override() -> None:
    config = one_worker(
        {"layer_1": vfull(), "layer_2": vfull()}, VPAGE * 2 * 32, num_gpu_blocks_override=16
    )
    assert config.num_blocks == 16
    assert regions(config) == [(VPAGE * 16, ln(1)), (VPAGE * 16, ln(2))]


def test_vllm_multiple_workers() -> None:
    def plan(specs: list[dict[str, KVCacheSpec]], pages: list[int]) -> list[KVCacheConfig]:
        planned = plan_kv_cache(specs, [VPAGE * p for p in pages], opts(max_model_len=16))
        return [rank.kv_cache_config for rank in planned.ranks]

    same = {"layer1": vfull(), "layer2": vfull()}
    # TP with different memory: every rank gets the smallest rank's blocks.
    for config in plan([same, same], [2 * 10, 2 * 20]):
        assert config.num_blocks == 10
        assert regions(config) == [(VPAGE * 10, ["layer1"]), (VPAGE * 10, ["layer2"])]
    # PP: each stage its own layers, one global group.
    stage0, stage1 = plan([{"layer1": vfull()}, {"layer2": vfull(), "layer3": vfull()}], [20, 20])
    assert (stage0.num_blocks, stage1.num_blocks) == (10, 10)
    assert layer_names_of(stage0) == [("layer1",)]
    assert layer_names_of(stage1) == [("layer2", "layer3")]
    # Hybrid + PP: each stage keeps every global group, empty where it holds none of its layers.
    stage0, stage1 = plan(
        [{"layer1": vfull(), "layer2": vfull()}, {"layer3": vswa(), "layer4": vswa()}], [20, 20]
    )
    assert layer_names_of(stage0) == [("layer1", "layer2"), ()]
    assert layer_names_of(stage1) == [(), ("layer3", "layer4")]
    assert [g.kv_cache_spec for g in stage1.kv_cache_groups] == [vfull(), vswa()]
    assert regions(stage1) == [(VPAGE * 10, ["layer3"]), (VPAGE * 10, ["layer4"])]
    # Groups of similar size across stages: 2 full + 4 sliding -> 3 groups of 2.
    stage0, stage1 = plan(
        [
            {"layer1": vfull(), "layer2": vswa(), "layer3": vswa()},
            {"layer4": vfull(), "layer5": vswa(), "layer6": vswa()},
        ],
        [10, 10],
    )
    assert layer_names_of(stage0) == [("layer1",), ("layer2",), ("layer3",)]
    assert layer_names_of(stage1) == [("layer4",), ("layer5",), ("layer6",)]
    assert regions(stage0) == [(VPAGE * 10, ["layer1", "layer2", "layer3"])]
    # A layer whose spec differs between ranks.
    with pytest.raises(ConfigError, match="'layer1'"):
        plan([{"layer1": vfull()}, {"layer1": vswa()}], [20, 20])


@pytest.mark.parametrize("memory_factor", [1, 2], ids=["symmetric", "asymmetric"])
def test_vllm_pipeline_stages_need_only_their_own_layers(memory_factor: int) -> None:
    expected_blocks = 512 // 16 + 1  # one max_model_len request plus the null block
    memory = [VPAGE * expected_blocks, VPAGE * expected_blocks * memory_factor]
    plan = plan_kv_cache(
        [{"layer1": vfull()}, {"layer2": vfull()}], memory, opts(max_model_len=512)
    )
    assert plan.num_blocks == expected_blocks
    for rank, layer in enumerate(["layer1", "layer2"]):
        config = plan.kv_cache_config(rank)
        assert regions(config) == [(VPAGE * expected_blocks, [layer])]


@pytest.mark.parametrize(("max_model_len", "estimated"), [(16385, 16384), (16383, 16383)])
def test_vllm_estimate_max_model_len(max_model_len: int, estimated: int) -> None:
    # Qwen1.5-7B's shape: 32 layers of 32 KV heads x 128, float16; 16,384 tokens take 8 GiB.
    layer = FullAttentionSpec(block_size=16, num_kv_heads=32, head_size=128, dtype="float16")
    options = opts(max_model_len=max_model_len, max_in_flight_tokens=32768)
    groups = planning.get_kv_cache_groups({f"layer_{i}": layer for i in range(32)}, options)
    assert planning.estimate_max_model_len(groups, 8 * GiB, options) == estimated


def test_vllm_max_concurrency() -> None:
    full_spec = FullAttentionSpec(block_size=16, num_kv_heads=32, head_size=128, dtype="float16")
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=32, head_size=128, dtype="float16", sliding_window=1024
    )
    limits = opts(max_model_len=16384, max_in_flight_tokens=1024).limits()
    full_layers = [f"layer_{i}" for i in range(32)]
    window_layers = [f"layer_{i}" for i in range(32, 64)]

    def concurrency(num_blocks: int, *groups: KVCacheGroupSpec) -> float:
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=(), kv_cache_groups=groups)
        return planning.get_kv_cache_capacity(config, limits).max_concurrency

    # 16,384 tokens: 1,024 full-attention blocks; a 1,024 window with 1,024 tokens in flight:
    # 128 + 1 blocks.
    assert concurrency(1536, KVCacheGroupSpec(full_layers, full_spec)) == 1.5
    assert concurrency(129 * 3, KVCacheGroupSpec(full_layers, window)) == 3
    hybrid = (KVCacheGroupSpec(full_layers, full_spec), KVCacheGroupSpec(window_layers, window))
    assert concurrency((1024 + 129) * 3, *hybrid) == 3


def test_a_tensor_past_a_uint64_is_refused_and_mamba_align_is_planned() -> None:
    big = FullAttentionSpec(
        block_size=1 << 10, num_kv_heads=1 << 16, head_size=1 << 16, dtype="float32"
    )
    options = PlanningOptions(max_model_len=64, num_gpu_blocks_override=1 << 20)
    with pytest.raises(ConfigError, match="uint64") as caught:
        plan_kv_cache([{"layer.0": big}], [1 << 40], options)
    assert caught.value.field == "layer_specs"
    # vLLM's "align" mode (prefix caching of hybrid Mamba models) is planned: a request holds
    # the running state, the state it was read from, a prefill checkpoint and its speculative
    # blocks; an unknown mode is refused, naming the field.
    align = MambaSpec(
        block_size=16,
        shapes=((4, 64),),
        dtypes=("float32",),
        mamba_cache_mode="align",
        num_speculative_blocks=1,
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=16,
    )
    limits = PlanningOptions(max_model_len=64).limits()
    assert align.max_memory_usage_bytes(limits) == 4 * align.page_size_bytes
    assert align.max_num_blocks_per_req(limits, 64) == 64 // 16 + 1
    none = replace(align, mamba_cache_mode="none")
    assert none.max_memory_usage_bytes(limits) == 2 * align.page_size_bytes
    plan = plan_kv_cache(
        [{"model.layers.3.mixer": align}], [1 << 30], PlanningOptions(max_model_len=64)
    )
    assert plan.kv_cache_groups[0].kv_cache_spec == align
    with pytest.raises(InvalidArgumentError, match=r"'model.layers.3.mixer'.*'all'") as mode:
        plan_kv_cache(
            [{"model.layers.3.mixer": replace(align, mamba_cache_mode="all")}],
            [1 << 30],
            PlanningOptions(max_model_len=64),
        )
    assert mode.value.field == "rank_specs[0][model.layers.3.mixer].mamba_cache_mode"


def test_hybrid_attention_block_size_fits_a_mamba_state_in_one_attention_page() -> None:
    """vLLM's choice for a hybrid model: the smallest kernel-aligned block whose attention
    page holds a Mamba state; a larger configured block stays; align-mode checkpoints and
    MLA kernels widen the alignment; a model without Mamba state keeps its block."""
    per_token = 2 * 8 * 128 * 2  # K and V, 8 heads of 128, bf16
    for mamba_page in (1, per_token * 16, per_token * 16 + 1, 3_000_000):
        block = planning.hybrid_attention_block_size(per_token, mamba_page)
        assert block % 16 == 0
        assert block * per_token >= mamba_page
        assert block == 16 or (block - 16) * per_token < mamba_page
    assert planning.hybrid_attention_block_size(per_token, 100, block_size=64) == 64
    assert planning.hybrid_attention_block_size(per_token, 3_000_000) == 736
    assert (
        planning.hybrid_attention_block_size(per_token, 3_000_000, checkpoint_alignment=64) == 768
    )
    assert planning.hybrid_attention_block_size(per_token, 3_000_000, mla=True) == 768
    assert (
        planning.hybrid_attention_block_size(per_token, 3_000_000, backend_block_alignment=48)
        == 768
    )
    assert planning.hybrid_attention_block_size(per_token, 0) == 16
    with pytest.raises(ConfigError, match="kernel_block_alignment") as bad:
        planning.hybrid_attention_block_size(per_token, 1, kernel_block_alignment=0)
    assert bad.value.field == "kernel_block_alignment"
