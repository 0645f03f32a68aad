"""KV-cache specs, layer specs, KV-cache configs, tensors and layouts on the wire.

Each spec kind is one row of two tables (its encoder keyed by class, its decoder keyed by
the ``KVCacheSpec.spec`` oneof name), so adding a kind touches its own functions and the
tables. Decoders name the field at fault: ``layer_specs[3].spec.full_attention.attention.dtype``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec, KVCacheLayout, KVCacheTensor
from kvcm.common.errors import InvalidArgumentError, KVCMError
from kvcm.common.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
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
    return {
        "block_size": message.block_size,
        "num_kv_heads": message.num_kv_heads,
        "head_size": message.head_size,
        "dtype": dtype_from_proto(message.dtype, f"{field}.attention.dtype"),
        "head_size_v": message.head_size_v if message.HasField("head_size_v") else None,
        "page_size_padded": (
            message.page_size_padded_bytes if message.HasField("page_size_padded_bytes") else None
        ),
    }


def _optional(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


# --------------------------------------------------------------------------- encoders
def _full_to_proto(spec: FullAttentionSpec, message: common_pb2.KVCacheSpec) -> None:
    _attention_to_proto(spec, message.full_attention.attention)
    if spec.sliding_window is not None:
        message.full_attention.sliding_window = spec.sliding_window
    if spec.attention_chunk_size is not None:
        message.full_attention.attention_chunk_size = spec.attention_chunk_size


def _mla_to_proto(spec: MLAAttentionSpec, message: common_pb2.KVCacheSpec) -> None:
    _attention_to_proto(spec, message.mla_attention.attention)
    if spec.cache_dtype_str is not None:
        message.mla_attention.cache_dtype_str = spec.cache_dtype_str


def _sink_to_proto(spec: SinkFullAttentionSpec, message: common_pb2.KVCacheSpec) -> None:
    _attention_to_proto(spec, message.sink_full_attention.attention)
    if spec.sink_len is not None:
        message.sink_full_attention.sink_len = spec.sink_len


def _window_to_proto(spec: SlidingWindowSpec, message: common_pb2.KVCacheSpec) -> None:
    _attention_to_proto(spec, message.sliding_window.attention)
    message.sliding_window.sliding_window = spec.sliding_window


def _chunked_to_proto(spec: ChunkedLocalAttentionSpec, message: common_pb2.KVCacheSpec) -> None:
    _attention_to_proto(spec, message.chunked_local_attention.attention)
    message.chunked_local_attention.attention_chunk_size = spec.attention_chunk_size


def _cross_to_proto(spec: CrossAttentionSpec, message: common_pb2.KVCacheSpec) -> None:
    _attention_to_proto(spec, message.cross_attention.attention)


def _encoder_only_to_proto(spec: EncoderOnlyAttentionSpec, message: common_pb2.KVCacheSpec) -> None:
    _attention_to_proto(spec, message.encoder_only_attention.attention)


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


def _uniform_to_proto(spec: UniformTypeKVCacheSpecs, message: common_pb2.KVCacheSpec) -> None:
    message.uniform_type.block_size = spec.block_size
    message.uniform_type.kv_cache_specs.extend(layer_specs_to_proto(spec.kv_cache_specs))


# Keyed by exact class; a subclass without its own row uses its nearest base's.
_ENCODERS: Final[Mapping[type, Callable[[Any, common_pb2.KVCacheSpec], None]]] = {
    FullAttentionSpec: _full_to_proto,
    MLAAttentionSpec: _mla_to_proto,
    SinkFullAttentionSpec: _sink_to_proto,
    SlidingWindowSpec: _window_to_proto,
    ChunkedLocalAttentionSpec: _chunked_to_proto,
    CrossAttentionSpec: _cross_to_proto,
    EncoderOnlyAttentionSpec: _encoder_only_to_proto,
    MambaSpec: _mamba_to_proto,
    UniformTypeKVCacheSpecs: _uniform_to_proto,
}


def spec_to_proto(spec: KVCacheSpec) -> common_pb2.KVCacheSpec:
    """The wire form of a KV-cache spec.

    Raises:
        InvalidArgumentError: The spec type has no wire form.
    """
    for cls in type(spec).__mro__:
        encoder = _ENCODERS.get(cls)
        if encoder is not None:
            message = common_pb2.KVCacheSpec()
            encoder(spec, message)
            return message
    raise InvalidArgumentError(f"spec {type(spec).__name__} has no wire form", field="spec")


# --------------------------------------------------------------------------- decoders
def _full_from_proto(message: common_pb2.KVCacheSpec, field: str) -> KVCacheSpec:
    full = message.full_attention
    return FullAttentionSpec(
        **_attention_fields(full.attention, field),
        sliding_window=_optional(full, "sliding_window"),
        attention_chunk_size=_optional(full, "attention_chunk_size"),
    )


def _mla_from_proto(message: common_pb2.KVCacheSpec, field: str) -> KVCacheSpec:
    mla = message.mla_attention
    fields = _attention_fields(mla.attention, field)
    if fields["head_size_v"] is None:
        fields["head_size_v"] = 0  # MLA's default: one latent, no separate V
    return MLAAttentionSpec(**fields, cache_dtype_str=_optional(mla, "cache_dtype_str"))


def _sink_from_proto(message: common_pb2.KVCacheSpec, field: str) -> KVCacheSpec:
    sink = message.sink_full_attention
    return SinkFullAttentionSpec(
        **_attention_fields(sink.attention, field), sink_len=_optional(sink, "sink_len")
    )


def _window_from_proto(message: common_pb2.KVCacheSpec, field: str) -> KVCacheSpec:
    window = message.sliding_window
    return SlidingWindowSpec(
        **_attention_fields(window.attention, field), sliding_window=window.sliding_window
    )


def _chunked_from_proto(message: common_pb2.KVCacheSpec, field: str) -> KVCacheSpec:
    chunked = message.chunked_local_attention
    return ChunkedLocalAttentionSpec(
        **_attention_fields(chunked.attention, field),
        attention_chunk_size=chunked.attention_chunk_size,
    )


def _cross_from_proto(message: common_pb2.KVCacheSpec, field: str) -> KVCacheSpec:
    return CrossAttentionSpec(**_attention_fields(message.cross_attention.attention, field))


def _encoder_only_from_proto(message: common_pb2.KVCacheSpec, field: str) -> KVCacheSpec:
    attention = message.encoder_only_attention.attention
    return EncoderOnlyAttentionSpec(**_attention_fields(attention, field))


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
    )


def _uniform_from_proto(message: common_pb2.KVCacheSpec, field: str) -> KVCacheSpec:
    uniform = message.uniform_type
    return UniformTypeKVCacheSpecs(
        block_size=uniform.block_size,
        kv_cache_specs=layer_specs_from_proto(
            uniform.kv_cache_specs, f"{field}.kv_cache_specs", allow_empty=True
        ),
    )


_DECODERS: Final[Mapping[str, Callable[[common_pb2.KVCacheSpec, str], KVCacheSpec]]] = {
    "full_attention": _full_from_proto,
    "mla_attention": _mla_from_proto,
    "sink_full_attention": _sink_from_proto,
    "sliding_window": _window_from_proto,
    "chunked_local_attention": _chunked_from_proto,
    "cross_attention": _cross_from_proto,
    "encoder_only_attention": _encoder_only_from_proto,
    "mamba": _mamba_from_proto,
    "uniform_type": _uniform_from_proto,
}


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
