"""Specs, dtypes and config: page sizes, sizing limits, merge rules, validation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcm.common.dtypes import DType, dtype_size
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SizingLimits,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

ATTN = {"num_kv_heads": 8, "head_size": 128, "dtype": DType.BFLOAT16}


def test_dtype_names_sizes_and_aliases() -> None:
    assert dtype_size("bfloat16") == 2
    assert dtype_size(DType.FLOAT8_E4M3FN) == 1
    assert DType.parse("torch.float32") is DType.FLOAT32
    assert DType.parse("half") is DType.FLOAT16
    with pytest.raises(InvalidArgumentError, match="cache_dtype: unknown dtype 'float7'"):
        DType.parse("float7", "cache_dtype")


def test_dtype_round_trips_through_torch() -> None:
    torch = pytest.importorskip("torch")
    from kvcm.client.tensors import from_torch, to_torch

    for dtype in DType:
        assert from_torch(to_torch(dtype)) is dtype
        assert torch.empty((), dtype=to_torch(dtype)).element_size() == dtype.itemsize


def test_attention_page_size_counts_keys_and_values() -> None:
    spec = FullAttentionSpec(block_size=16, **ATTN)
    assert spec.head_size_v == 128
    assert spec.page_size_bytes == 16 * 8 * (128 + 128) * 2
    asym = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=192, head_size_v=128, dtype="float16"
    )
    assert asym.dtype is DType.FLOAT16
    assert asym.page_size_bytes == 16 * 8 * (192 + 128) * 2


def test_mla_page_has_no_values_and_pads_to_alignment() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=DType.BFLOAT16)
    assert mla.page_size_bytes == 16 * 576 * 2
    padded = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=575, dtype=DType.UINT8, alignment=512
    )
    assert padded.real_page_size_bytes == 16 * 575
    assert padded.page_size_bytes == 9216
    assert mla.kind == "mla_attention"


def test_max_memory_usage_per_type() -> None:
    limits = SizingLimits(
        max_model_len=1000, max_in_flight_tokens=64, max_num_encoder_input_tokens=1500
    )
    full = FullAttentionSpec(block_size=16, **ATTN)
    assert full.max_memory_usage_bytes(limits) == 63 * full.page_size_bytes
    swa = SlidingWindowSpec(block_size=16, sliding_window=128, **ATTN)
    # window - 1 + in-flight tokens, plus one block for an unaligned window start
    assert swa.max_memory_usage_bytes(limits) == (-(-(127 + 64) // 16) + 1) * swa.page_size_bytes
    chunked = ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=256, **ATTN)
    assert chunked.max_memory_usage_bytes(limits) == 20 * chunked.page_size_bytes
    cross = CrossAttentionSpec(block_size=16, **ATTN)
    assert cross.max_memory_usage_bytes(limits) == 94 * cross.page_size_bytes
    assert EncoderOnlyAttentionSpec(block_size=16, **ATTN).max_memory_usage_bytes(limits) == 0
    mamba = MambaSpec(
        block_size=1000,
        shapes=((4, 8), (16,)),
        dtypes=("float32", "float16"),
        num_speculative_blocks=2,
    )
    assert mamba.page_size_bytes == 4 * 8 * 4 + 16 * 2
    assert mamba.max_memory_usage_bytes(limits) == 3 * mamba.page_size_bytes
    assert SizingLimits(max_model_len=10).in_flight_tokens == 10


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: FullAttentionSpec(block_size=0, **ATTN), "FullAttentionSpec.block_size"),
        (
            lambda: FullAttentionSpec(
                block_size=16, num_kv_heads=-1, head_size=8, dtype=DType.FLOAT16
            ),
            "num_kv_heads",
        ),
        (
            lambda: FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="fp7"),
            "FullAttentionSpec.dtype",
        ),
        (lambda: SlidingWindowSpec(block_size=16, sliding_window=0, **ATTN), "sliding_window"),
        (lambda: MambaSpec(block_size=16, shapes=((0,),), dtypes=("float16",)), "shapes"),
        (lambda: MambaSpec(block_size=16, shapes=((2,),), dtypes=()), "dtypes"),
        (lambda: FullAttentionSpec(block_size=16, page_size_padded=8, **ATTN), "page_size_padded"),
        (lambda: SizingLimits(max_model_len=0), "max_model_len"),
        (
            lambda: KVCacheConfig(num_blocks=-1, kv_cache_tensors=(), kv_cache_groups=()),
            "num_blocks",
        ),
        (lambda: KVCacheTensor(size=-5, layers=("a",), layer_stride=0, block_stride=0), "size"),
    ],
)
def test_bad_fields_are_named(build: object, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        build()  # type: ignore[operator]


def test_full_attention_merge_keeps_recorded_window_and_rejects_mixes() -> None:
    a = FullAttentionSpec(block_size=16, **ATTN)
    b = FullAttentionSpec(block_size=16, sliding_window=128, **ATTN)
    assert FullAttentionSpec.merge([a, b]).sliding_window == 128
    c = FullAttentionSpec(block_size=16, sliding_window=64, **ATTN)
    with pytest.raises(ConfigError, match="same window size"):
        FullAttentionSpec.merge([b, c])
    d = FullAttentionSpec(block_size=16, attention_chunk_size=64, **ATTN)
    with pytest.raises(ConfigError, match="both sliding window"):
        FullAttentionSpec.merge([b, d])
    other_heads = FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=128, dtype=DType.BFLOAT16
    )
    with pytest.raises(ConfigError, match="same attention spec"):
        FullAttentionSpec.merge([a, other_heads])
    swa = SlidingWindowSpec(block_size=16, sliding_window=8, **ATTN)
    with pytest.raises(ConfigError, match="must be the same"):
        SlidingWindowSpec.merge([swa, SlidingWindowSpec(block_size=16, sliding_window=9, **ATTN)])


def test_uniform_type_groups_full_mla_and_sink_but_not_windows() -> None:
    full = FullAttentionSpec(block_size=16, **ATTN)
    sink = SinkFullAttentionSpec(block_size=16, sink_len=4, **ATTN)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=DType.BFLOAT16)
    uniform = UniformTypeKVCacheSpecs.from_specs({"a": full, "b": sink, "c": mla})
    assert uniform is not None
    assert uniform.page_size_bytes == 2 * full.page_size_bytes + mla.page_size_bytes
    assert uniform.kind == "full_attention"
    # Mixed full-attention variants report full attention whichever layer comes first.
    mla_first = UniformTypeKVCacheSpecs.from_specs({"c": mla, "a": full})
    assert mla_first is not None
    assert mla_first.kind == "full_attention"
    only_mla = UniformTypeKVCacheSpecs.from_specs({"c": mla, "d": replace(mla, head_size=512)})
    assert only_mla is not None
    assert only_mla.kind == "mla_attention"
    sw8 = SlidingWindowSpec(block_size=16, sliding_window=8, **ATTN)
    sw9 = SlidingWindowSpec(block_size=16, sliding_window=9, **ATTN)
    assert UniformTypeKVCacheSpecs.from_specs({"a": sw8, "b": sw9}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": full, "b": sw8}) is None
    other_block = FullAttentionSpec(block_size=32, **ATTN)
    assert UniformTypeKVCacheSpecs.from_specs({"a": full, "b": other_block}) is None


def test_config_is_frozen_and_holds_tuples() -> None:
    spec = FullAttentionSpec(block_size=16, **ATTN)
    group = KVCacheGroupSpec(["l0", "l1"], spec)
    config = KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[group])
    assert config.kv_cache_groups == (group,)
    assert group.layer_names == ("l0", "l1")
    with pytest.raises(AttributeError):
        config.num_blocks = 3  # type: ignore[misc]
    with pytest.raises(InvalidArgumentError, match="kv_cache_spec"):
        KVCacheGroupSpec(["l0"], "full")  # type: ignore[arg-type]
