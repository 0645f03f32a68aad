"""Attention-type traits are declared once per spec class and agree with the other tables."""

from __future__ import annotations

import pytest

from kvcm.common import specs
from kvcm.common.errors import ConfigError
from kvcm.common.specs import KVCacheSpec, SpecTraits, StatePacking
from kvcm.core.single_type_managers import (
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
    manager_class_for_spec,
)
from kvcm.v1 import common_pb2

CONCRETE = [
    specs.FullAttentionSpec,
    specs.MLAAttentionSpec,
    specs.SinkFullAttentionSpec,
    specs.SlidingWindowSpec,
    specs.ChunkedLocalAttentionSpec,
    specs.CrossAttentionSpec,
    specs.EncoderOnlyAttentionSpec,
    specs.MambaSpec,
    specs.UniformTypeKVCacheSpecs,
]


def test_every_spec_class_declares_its_own_traits() -> None:
    exported = {
        getattr(specs, name)
        for name in specs.__all__
        if isinstance(getattr(specs, name), type) and issubclass(getattr(specs, name), KVCacheSpec)
    }
    abstract = {KVCacheSpec, specs.AttentionSpec}
    assert exported - abstract == set(CONCRETE)
    for cls in CONCRETE:
        assert "traits" in vars(cls), cls.__name__  # not inherited by accident
        assert isinstance(cls.traits, SpecTraits)


def test_wire_tags_name_the_proto_oneof_fields() -> None:
    oneof = common_pb2.KVCacheSpec.DESCRIPTOR.oneofs_by_name["spec"]
    assert sorted(cls.traits.wire_tag for cls in CONCRETE) == sorted(f.name for f in oneof.fields)


def test_event_kind_is_the_wire_tag_for_single_layer_types() -> None:
    for cls in CONCRETE:
        if cls is not specs.UniformTypeKVCacheSpecs:
            assert cls.kind == cls.traits.wire_tag


def _attention(cls: type[specs.AttentionSpec], **extra: object) -> specs.AttentionSpec:
    return cls(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16", **extra)  # type: ignore[arg-type]


def test_trait_driven_answers() -> None:
    full = _attention(specs.FullAttentionSpec)
    window = _attention(specs.SlidingWindowSpec, sliding_window=64)
    mamba = specs.MambaSpec(block_size=16, shapes=((4, 8),), dtypes=("float32",))  # type: ignore[arg-type]
    assert manager_class_for_spec(full) is FullAttentionManager
    assert manager_class_for_spec(_attention(specs.MLAAttentionSpec)) is FullAttentionManager
    assert manager_class_for_spec(window) is SlidingWindowManager
    assert manager_class_for_spec(mamba) is MambaManager
    with pytest.raises(ConfigError, match="EncoderOnlyAttentionSpec"):
        manager_class_for_spec(_attention(specs.EncoderOnlyAttentionSpec))
    assert window.max_admission_blocks_per_request(32, 4096) == 7
    assert full.max_admission_blocks_per_request(32, 4096) is None
    promoted = window.promoted_to_full_attention(32)
    assert (promoted.block_size, promoted.sliding_window) == (32, 64)
    assert window.event_sliding_window() == 64
    assert full.event_sliding_window() is None
    assert mamba.traits.state_packing is StatePacking.ALWAYS
    assert mamba.attention_dtype() is None
    assert full.attention_dtype() is full.dtype
    assert mamba.with_padded_page(4096).page_size_bytes == 4096
    with pytest.raises(ConfigError, match="cannot be padded"):
        specs.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full}).with_padded_page(
            1 << 20
        )
