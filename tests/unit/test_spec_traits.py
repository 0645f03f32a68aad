"""Attention-type traits are declared once per spec class and agree with the other tables."""

from __future__ import annotations

import pytest

from kvcm.common import specs
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
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


def _instance(cls: type[KVCacheSpec]) -> KVCacheSpec:
    # One valid spec of each concrete class.
    if cls is specs.MambaSpec:
        return specs.MambaSpec(
            block_size=16, shapes=((4, 8),), dtypes=("float32",), mamba_cache_mode="align"
        )  # type: ignore[arg-type]
    if cls is specs.UniformTypeKVCacheSpecs:
        layer = _attention(specs.FullAttentionSpec)
        return specs.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": layer})
    extra: dict[str, object] = {
        specs.SlidingWindowSpec: {"sliding_window": 64},
        specs.ChunkedLocalAttentionSpec: {"attention_chunk_size": 64},
    }.get(cls, {})
    return _attention(cls, **extra)  # type: ignore[arg-type]


def test_the_type_tables_are_derived_from_each_spec_class_traits() -> None:
    # The tables that used to list spec classes by hand (the wire's fields left off, the
    # snapshot's allowed classes, the vLLM converter's class names, the coordinator's
    # partial-hit and retention checks) are built from specs.spec_classes() and each class's
    # declared traits, so a new attention type declares them once, on its class.
    from kvcm.core import _snapshot_codec
    from kvcm.core.coordinator import partial_hash_hits_enabled
    from kvcm.integrations.vllm import _convert
    from kvcm.wire import specs as wire_specs

    assert specs.spec_classes() == tuple(CONCRETE)
    for cls in CONCRETE:
        traits = cls.traits
        # Wire: exactly the declared fields stay off (test_wire checks the rest travel).
        assert wire_specs.NOT_ON_THE_WIRE.get(cls, frozenset()) == traits.not_on_the_wire
        # Snapshot: the class may be named in a snapshot iff its traits allow it, and then
        # an instance round-trips through the snapshot codec.
        assert (_snapshot_codec._DATACLASSES.get(cls.__name__) is cls) is traits.snapshot
        spec = _instance(cls)
        if traits.snapshot:
            writer = _snapshot_codec.Writer()
            writer.value(spec)
            assert _snapshot_codec.Reader(bytes(writer.out)).value() == spec
        # vLLM: the converter accepts the class its traits name, and only that.
        if traits.vllm_class is None:
            assert cls not in _convert._SPEC_FOR_VLLM_CLASS.values()
        else:
            assert _convert._SPEC_FOR_VLLM_CLASS[traits.vllm_class] is cls
    assert set(_convert._SPEC_FOR_VLLM_CLASS) == {
        cls.traits.vllm_class for cls in CONCRETE if cls.traits.vllm_class
    }
    # Coordinator: sub-block hits follow spec.partial_block_hits, retention the trait.
    for cls in CONCRETE:
        spec = _instance(cls)
        assert spec.partial_block_hits is (cls is specs.MambaSpec)
        assert cls.traits.sparse_retention is (cls in (specs.SlidingWindowSpec, specs.MambaSpec))
        if cls is specs.UniformTypeKVCacheSpecs:
            continue
        config = KVCacheConfig(
            num_blocks=8,
            kv_cache_tensors=(),
            kv_cache_groups=(KVCacheGroupSpec(layer_names=("a",), kv_cache_spec=spec),),
        )
        assert partial_hash_hits_enabled(config, 4) is spec.partial_block_hits


def test_the_derived_tables_name_no_attention_type() -> None:
    # The codec and coordinator modules whose tables are derived name no attention spec
    # class: a class name in them would be a hand-kept entry a new type could miss. (Mamba
    # and the uniform wrapper keep wire codecs of their own shape. The vLLM converter speaks
    # of vLLM's class names by design; the test above checks its table.)
    import inspect

    from kvcm.core import _snapshot_codec, coordinator
    from kvcm.wire import specs as wire_specs

    own_codec = (specs.MambaSpec, specs.UniformTypeKVCacheSpecs)
    for module in (_snapshot_codec, coordinator, wire_specs):
        source = inspect.getsource(module)
        for cls in CONCRETE:
            if module is wire_specs and cls in own_codec:
                continue
            assert cls.__name__ not in source, (module.__name__, cls.__name__)
