"""KV-cache specs, layer specs, KV-cache configs, tensors and layouts on the wire.

An attention spec's wire form follows from its class: ``traits.wire_tag`` names its
``KVCacheSpec.spec`` oneof message, whose ``attention`` carries the common attention fields and
whose other fields carry the spec fields of the same names (``traits.not_on_the_wire`` names
the spec fields that do not travel, gathered in ``NOT_ON_THE_WIRE``). Mamba and the
uniform-type wrapper have codecs of their own.
Decoders name the field at fault: ``layer_specs[3].spec.full_attention.attention.dtype``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec, KVCacheLayout, KVCacheTensor
from kvcm.common.errors import InvalidArgumentError, KVCMError
from kvcm.common.specs import (
    AttentionSpec,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    spec_classes,
)
from kvcm.v1 import common_pb2
from kvcm.wire.enums import dtype_from_proto, dtype_to_proto

__all__ = [
    "kv_cache_config_from_proto",
    "kv_cache_config_to_proto",
    "layer_specs_from_proto",
    "layer_specs_to_proto",
    "spec_from_proto",
    "spec_to_proto",
]


# ------------------------------------------------------------------------- attention
# Every attention spec travels the same way: the ``AttentionSpec`` sub-message carries the
# fields of :class:`AttentionSpec`, and each other field of the spec's own oneof message (named
# by ``traits.wire_tag``) carries the spec field of the same name. So a new attention type needs
# its spec class and its proto message, and no code here.
_ATTENTION_PLAIN: Final = ("block_size", "num_kv_heads", "head_size")

# Spec fields that do not travel (each class's ``traits.not_on_the_wire``): the server never
# needs them (they shape the engine's own kernels or only its scheduler), so the decoded spec
# has their defaults. A field neither on the wire nor listed fails the wire tests, so none is
# dropped without a decision.
NOT_ON_THE_WIRE: Final[Mapping[type, frozenset[str]]] = {
    cls: cls.traits.not_on_the_wire for cls in spec_classes() if cls.traits.not_on_the_wire
}


def _attention_to_proto(spec: AttentionSpec, message: common_pb2.AttentionSpec) -> None:
    message.block_size = spec.block_size
    message.num_kv_heads = spec.num_kv_heads
    message.head_size = spec.head_size
    if spec.head_size_v is not None and spec.head_size_v != spec.head_size:
        message.head_size_v = spec.head_size_v
    message.dtype = dtype_to_proto(spec.dtype)  # type: ignore[assignment]
    if spec.page_size_padded is not None:
        message.page_size_padded_bytes = spec.page_size_padded


def _attention_fields(message: common_pb2.AttentionSpec, field: str) -> dict[str, Any]:
    fields: dict[str, Any] = {name: getattr(message, name) for name in _ATTENTION_PLAIN}
    fields["dtype"] = dtype_from_proto(message.dtype, f"{field}.attention.dtype")
    if message.HasField("head_size_v"):
        fields["head_size_v"] = message.head_size_v
    if message.HasField("page_size_padded_bytes"):
        fields["page_size_padded"] = message.page_size_padded_bytes
    return fields


def _optional(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


def _own_fields(message: Any) -> list[Any]:
    """The fields of an attention spec's oneof message besides its ``attention``."""
    return [f for f in message.DESCRIPTOR.fields if f.name != "attention"]


def _attention_spec_to_proto(spec: AttentionSpec, message: common_pb2.KVCacheSpec) -> None:
    own = getattr(message, type(spec).traits.wire_tag)
    _attention_to_proto(spec, own.attention)
    for descriptor in _own_fields(own):
        value = getattr(spec, descriptor.name)
        if value is not None or not descriptor.has_presence:
            setattr(own, descriptor.name, value)


def _attention_spec_from_proto(
    cls: type[AttentionSpec], message: common_pb2.KVCacheSpec, field: str
) -> KVCacheSpec:
    own = getattr(message, cls.traits.wire_tag)
    fields = _attention_fields(own.attention, field)
    for descriptor in _own_fields(own):
        if not descriptor.has_presence or own.HasField(descriptor.name):
            fields[descriptor.name] = getattr(own, descriptor.name)
    return cls(**fields)


def _mamba_to_proto(spec: MambaSpec, message: common_pb2.KVCacheSpec) -> None:
    mamba = message.mamba
    mamba.block_size = spec.block_size
    for shape in spec.shapes:
        mamba.shapes.add().dims.extend(shape)
    mamba.dtypes.extend(dtype_to_proto(dtype) for dtype in spec.dtypes)
    if spec.page_size_padded is not None:
        mamba.page_size_padded_bytes = spec.page_size_padded
    mamba.mamba_type = spec.mamba_type
    mamba.mamba_cache_mode = spec.mamba_cache_mode
    mamba.num_speculative_blocks = spec.num_speculative_blocks
    mamba.num_prefill_checkpoint_blocks = spec.num_prefill_checkpoint_blocks
    if spec.prefill_checkpoint_alignment is not None:
        mamba.prefill_checkpoint_alignment = spec.prefill_checkpoint_alignment


def _uniform_to_proto(spec: UniformTypeKVCacheSpecs, message: common_pb2.KVCacheSpec) -> None:
    message.uniform_type.block_size = spec.block_size
    message.uniform_type.kv_cache_specs.extend(layer_specs_to_proto(spec.kv_cache_specs))


# The specs with a wire form of their own shape; every other spec class with a ``wire_tag``
# is an attention spec and takes the generic path above.
_ENCODERS: Final[Mapping[type, Callable[[Any, common_pb2.KVCacheSpec], None]]] = {
    MambaSpec: _mamba_to_proto,
    UniformTypeKVCacheSpecs: _uniform_to_proto,
}


def spec_to_proto(spec: KVCacheSpec) -> common_pb2.KVCacheSpec:
    """The wire form of a KV-cache spec.

    Raises:
        InvalidArgumentError: The spec type has no wire form.
    """
    message = common_pb2.KVCacheSpec()
    for cls in type(spec).__mro__:
        encoder = _ENCODERS.get(cls)
        if encoder is not None:
            encoder(spec, message)
            return message
    if isinstance(spec, AttentionSpec) and type(spec).traits.wire_tag:
        _attention_spec_to_proto(spec, message)
        return message
    raise InvalidArgumentError(f"spec {type(spec).__name__} has no wire form", field="spec")


# --------------------------------------------------------------------------- decoders
def _mamba_from_proto(message: common_pb2.KVCacheSpec, field: str) -> KVCacheSpec:
    mamba = message.mamba
    return MambaSpec(
        block_size=mamba.block_size,
        shapes=tuple(tuple(shape.dims) for shape in mamba.shapes),
        dtypes=tuple(
            dtype_from_proto(dtype, f"{field}.dtypes[{i}]") for i, dtype in enumerate(mamba.dtypes)
        ),
        page_size_padded=_optional(mamba, "page_size_padded_bytes"),
        mamba_type=mamba.mamba_type or "mamba2",
        mamba_cache_mode=mamba.mamba_cache_mode or "none",
        num_speculative_blocks=mamba.num_speculative_blocks,
        num_prefill_checkpoint_blocks=mamba.num_prefill_checkpoint_blocks,
        prefill_checkpoint_alignment=_optional(mamba, "prefill_checkpoint_alignment"),
    )


def _uniform_from_proto(message: common_pb2.KVCacheSpec, field: str) -> KVCacheSpec:
    uniform = message.uniform_type
    return UniformTypeKVCacheSpecs(
        block_size=uniform.block_size,
        kv_cache_specs=layer_specs_from_proto(
            uniform.kv_cache_specs, f"{field}.kv_cache_specs", allow_empty=True
        ),
    )


def _decoders() -> dict[str, Callable[[common_pb2.KVCacheSpec, str], KVCacheSpec]]:
    decoders: dict[str, Callable[[common_pb2.KVCacheSpec, str], KVCacheSpec]] = {
        "mamba": _mamba_from_proto,
        "uniform_type": _uniform_from_proto,
    }
    for cls in spec_classes():
        tag = cls.traits.wire_tag
        if issubclass(cls, AttentionSpec) and tag not in decoders:
            decoders[tag] = partial(_attention_spec_from_proto, cls)
    return decoders


# oneof name -> decoder: every attention spec class with its own wire_tag, Mamba, uniform.
_DECODERS: Final = _decoders()


def spec_from_proto(message: common_pb2.KVCacheSpec, field: str = "spec") -> KVCacheSpec:
    """The ``kvcm.common.specs`` value of a wire spec.

    Args:
        message: The wire spec.
        field: Its path in the request, for error messages.

    Raises:
        InvalidArgumentError: No spec is set, or a field is out of its domain (names it).
    """
    kind = message.WhichOneof("spec")
    if kind is None:
        raise InvalidArgumentError(f"{field} is unset", field=field)
    path = f"{field}.{kind}"
    try:
        return _DECODERS[kind](message, path)
    except KVCMError as exc:
        if exc.field is not None:
            raise
        raise type(exc)(f"{path}: {exc}", field=path) from exc
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{path}: {exc}", field=path) from exc


def layer_specs_to_proto(specs: Mapping[str, KVCacheSpec]) -> list[common_pb2.LayerSpec]:
    """``LayerSpec`` entries for a ``{layer name: spec}`` mapping, in the mapping's order.

    The order is the model runner's layer order and decides planning (group membership,
    tensor order, byte offsets), so it is never sorted.
    """
    return [
        common_pb2.LayerSpec(layer_name=name, spec=spec_to_proto(spec))
        for name, spec in specs.items()
    ]


def layer_specs_from_proto(
    layers: Sequence[common_pb2.LayerSpec], field: str = "layer_specs", *, allow_empty: bool = False
) -> dict[str, KVCacheSpec]:
    """``{layer name: spec}`` of ``LayerSpec`` entries.

    Raises:
        InvalidArgumentError: No layers (unless ``allow_empty``), an empty or duplicate name,
            an unset or invalid spec; the message names the entry.
    """
    if not layers and not allow_empty:
        raise InvalidArgumentError(f"{field} must not be empty", field=field)
    specs: dict[str, KVCacheSpec] = {}
    for index, layer in enumerate(layers):
        name = layer.layer_name
        entry = f"{field}[{index}]"
        if not name:
            raise InvalidArgumentError(
                f"{entry}.layer_name must not be empty", field=f"{entry}.layer_name"
            )
        if name in specs:
            raise InvalidArgumentError(
                f"{entry}.layer_name is a duplicate", field=f"{entry}.layer_name"
            )
        specs[name] = spec_from_proto(layer.spec, f"{entry}.spec")
    return specs


# ------------------------------------------------------------------------------ config
def kv_cache_config_to_proto(config: KVCacheConfig) -> common_pb2.KVCacheConfig:
    """The wire form of a ``KVCacheConfig`` (each tensor's size, layers and placement)."""
    message = common_pb2.KVCacheConfig(
        num_blocks=config.num_blocks, kv_cache_layout=config.kv_cache_layout.name
    )
    for tensor in config.kv_cache_tensors:
        message.kv_cache_tensors.add(
            size_bytes=tensor.size,
            shared_by=list(tensor.layers),
            offset_bytes=tensor.offset,
            layer_stride_bytes=tensor.layer_stride,
            block_stride_bytes=tensor.block_stride,
        )
    for group in config.kv_cache_groups:
        message.kv_cache_groups.add(
            layer_names=list(group.layer_names), kv_cache_spec=spec_to_proto(group.kv_cache_spec)
        )
    return message


def _tensor_from_proto(message: common_pb2.KVCacheTensor) -> KVCacheTensor:
    return KVCacheTensor(
        size=message.size_bytes,
        layers=tuple(message.shared_by),
        layer_stride=message.layer_stride_bytes,
        block_stride=message.block_stride_bytes,
        offset=message.offset_bytes,
    )


def kv_cache_config_from_proto(
    message: common_pb2.KVCacheConfig, field: str = "kv_cache_config"
) -> KVCacheConfig:
    """The ``kvcm.common.config`` value of a wire ``KVCacheConfig``.

    Raises:
        InvalidArgumentError: A spec, the layout or the config is invalid (names the field).
    """
    groups = tuple(
        KVCacheGroupSpec(
            layer_names=tuple(group.layer_names),
            kv_cache_spec=spec_from_proto(
                group.kv_cache_spec, f"{field}.kv_cache_groups[{index}].kv_cache_spec"
            ),
        )
        for index, group in enumerate(message.kv_cache_groups)
    )
    layout = KVCacheLayout.parse(
        message.kv_cache_layout or KVCacheLayout.LBNHC, f"{field}.kv_cache_layout"
    )
    try:
        return KVCacheConfig(
            num_blocks=message.num_blocks,
            kv_cache_layout=layout,
            kv_cache_tensors=tuple(_tensor_from_proto(t) for t in message.kv_cache_tensors),
            kv_cache_groups=groups,
        )
    except KVCMError:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{field}: {exc}", field=field) from exc
