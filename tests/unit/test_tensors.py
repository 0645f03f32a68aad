"""Unit tests for kvcm.client.tensors: per-layer views of one backing allocation (CPU)."""

from __future__ import annotations

import pytest
import torch

from kvcm.client.tensors import allocate_kv_cache_tensors, kv_cache_views, layer_placements
from kvcm.common.config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    compute_layout_strides,
)
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from kvcm.core.planning import PlanningOptions, plan_kv_cache

FULL = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float16")
SWA = SlidingWindowSpec(
    block_size=4, num_kv_heads=2, head_size=8, dtype="float16", sliding_window=8
)
PAGE = FULL.page_size_bytes  # 4 tokens x 2 heads x 16 values x 2 bytes = 256


def hybrid_config(layout: KVCacheLayout, num_blocks: int = 12) -> KVCacheConfig:
    specs: dict[str, KVCacheSpec] = {
        "f0": FULL,
        "s0": SWA,
        "s1": SWA,
        "f1": FULL,
        "s2": SWA,
        "s3": SWA,
    }
    options = PlanningOptions(
        max_model_len=8, kv_cache_layout=layout, num_gpu_blocks_override=num_blocks
    )
    return plan_kv_cache([specs], [1 << 20], options).ranks[0].kv_cache_config


LAYOUTS = list(KVCacheLayout)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_block_patterns_written_through_a_view_land_at_the_promised_offset(
    layout: KVCacheLayout,
) -> None:
    config = hybrid_config(layout)
    views = allocate_kv_cache_tensors(config, device="cpu")
    tensor = next(t for t in config.kv_cache_tensors if "s2" in t.layers)
    index = tensor.layers.index("s2")
    view = views["s2"]
    assert view.dtype == torch.float16
    assert tuple(view.shape) == (config.num_blocks, 2, 4, 16)
    for block_id in range(config.num_blocks):
        view[block_id] = float(block_id + 1)
    backing = torch.frombuffer(bytearray(view.untyped_storage()), dtype=torch.int8)
    # The head and token strides the layout promises (a page of a strided layout, LHBNC or
    # BHLNC, has its heads apart).
    *_, head_stride, token_stride, _ = compute_layout_strides(
        SWA,
        config.num_blocks,
        len(tensor.layers),
        layout,
        block_stride=tensor.block_stride,
        layer_stride=tensor.layer_stride,
    )
    cell = 2 * 8 * 2  # key + value of one head and token, float16
    touched = torch.zeros_like(backing, dtype=torch.bool)
    for block_id in range(config.num_blocks):
        start = tensor.offset + index * tensor.layer_stride + block_id * tensor.block_stride
        page = backing.as_strided((2, 4, cell), (head_stride, token_stride, 1), start)
        touched.as_strided((2, 4, cell), (head_stride, token_stride, 1), start).fill_(True)
        values = page.contiguous().view(torch.float16)
        assert torch.all(values == float(block_id + 1)), block_id
        if layout.is_block_compact:
            contiguous = backing[start : start + PAGE].view(torch.float16)
            assert torch.all(contiguous == float(block_id + 1)), block_id
    # Nothing outside s2's promised pages was written.
    assert int(touched.sum()) == config.num_blocks * PAGE
    assert torch.all(backing[~touched] == 0)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_one_block_id_addresses_the_same_bytes_in_every_group(layout: KVCacheLayout) -> None:
    config = hybrid_config(layout)
    views = allocate_kv_cache_tensors(config)
    # f0, s0, s1 are layer 0 of their groups: groups overlay, so block 3 is the same bytes.
    views["f0"][3].fill_(7.0)
    assert torch.all(views["s0"][3] == 7.0)
    assert torch.all(views["s1"][3] == 7.0)
    # ... and a block of one layer never touches another block or another layer's page.
    assert torch.all(views["f0"][2] == 0)
    assert torch.all(views["f1"][3] == 0)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_bytes_used_never_exceed_the_allocation(layout: KVCacheLayout) -> None:
    config = hybrid_config(layout)
    size = config.kv_cache_tensors[0].size
    assert size == 2 * PAGE * config.num_blocks
    for placement in layer_placements(config).values():
        last = placement.offset + sum(
            (n - 1) * s for n, s in zip(placement.size, placement.stride, strict=True)
        )
        assert last < size
    views = allocate_kv_cache_tensors(config)
    assert views["f0"].untyped_storage().nbytes() == size


def test_mamba_layers_are_raw_byte_pages() -> None:
    mamba = MambaSpec(block_size=4, shapes=((2, 8), (4,)), dtypes=("float32", "float16"))
    config = (
        plan_kv_cache(
            [{"m": mamba}], [1 << 16], PlanningOptions(max_model_len=8, num_gpu_blocks_override=5)
        )
        .ranks[0]
        .kv_cache_config
    )
    view = allocate_kv_cache_tensors(config)["m"]
    assert view.dtype == torch.int8
    assert tuple(view.shape) == (5, 1, 1, mamba.page_size_bytes)


def test_views_over_a_callers_buffer() -> None:
    config = hybrid_config(KVCacheLayout.LBNHC)
    buffer = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    views = kv_cache_views(buffer, config)
    views["f1"][1].fill_(1.0)
    assert int(buffer.count_nonzero()) > 0
    with pytest.raises(InvalidArgumentError, match=r"torch\.int8"):
        kv_cache_views(buffer.view(torch.float16), config)
    with pytest.raises(InvalidArgumentError, match="needs"):
        kv_cache_views(buffer[:10], config)


def test_config_without_tensors_allocates_nothing() -> None:
    assert allocate_kv_cache_tensors(KVCacheConfig(1, (), ())) == {}


def _config(tensors: tuple[KVCacheTensor, ...]) -> KVCacheConfig:
    group = KVCacheGroupSpec(layer_names=("a", "b"), kv_cache_spec=FULL)
    return KVCacheConfig(num_blocks=4, kv_cache_tensors=tensors, kv_cache_groups=(group,))


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ((KVCacheTensor(4 * PAGE - 1, ("a",), 4 * PAGE, PAGE),), "beyond the KVCacheTensor.size"),
        ((KVCacheTensor(8 * PAGE, ("zz",), 4 * PAGE, PAGE),), "layer 'zz'"),
        (
            (
                KVCacheTensor(8 * PAGE, ("a",), 4 * PAGE, PAGE),
                KVCacheTensor(9 * PAGE, ("b",), 4 * PAGE, PAGE),
            ),
            "share one backing allocation",
        ),
        (
            (
                KVCacheTensor(8 * PAGE, ("a", "b"), 4 * PAGE, PAGE),
                KVCacheTensor(8 * PAGE, ("a",), 4 * PAGE, PAGE),
            ),
            "layer 'a' is placed by two",
        ),
    ],
)
def test_inconsistent_configs_are_rejected_before_allocating(
    tensors: tuple[KVCacheTensor, ...], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        allocate_kv_cache_tensors(_config(tensors))


@pytest.mark.parametrize("layout", [KVCacheLayout.BLHNC, KVCacheLayout.BLNHC])
def test_packed_pages_of_different_sizes_land_side_by_side(layout: KVCacheLayout) -> None:
    wide = FullAttentionSpec(block_size=4, num_kv_heads=4, head_size=8, dtype="float16")
    specs: dict[str, KVCacheSpec] = {"a0": FULL, "b0": wide, "a1": FULL, "b1": wide, "s0": SWA}
    options = PlanningOptions(max_model_len=8, kv_cache_layout=layout, num_gpu_blocks_override=9)
    config = plan_kv_cache([specs], [1 << 20], options).ranks[0].kv_cache_config
    views = allocate_kv_cache_tensors(config)
    tensor = next(t for t in config.kv_cache_tensors if "b1" in t.layers)
    start_of = {
        block_id: tensor.offset + tensor.layer_stride + block_id * tensor.block_stride
        for block_id in range(config.num_blocks)
    }
    for block_id in range(config.num_blocks):
        views["b1"][block_id] = float(10 + block_id)
    backing = torch.frombuffer(bytearray(views["b1"].untyped_storage()), dtype=torch.int8)
    for block_id, start in start_of.items():
        page = backing[start : start + wide.page_size_bytes].view(torch.float16)
        assert torch.all(page == float(10 + block_id)), block_id
    # The wide pages follow both narrow ones inside the block, and nothing else was written.
    assert tensor.offset == 2 * PAGE
    assert int((backing != 0).sum()) <= config.num_blocks * wide.page_size_bytes
    assert torch.all(views["a0"] == 0)
    assert torch.all(views["a1"] == 0)
    assert torch.all(views["b0"] == 0)
