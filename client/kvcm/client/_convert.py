"""Translate between ``kvcm.common`` values and ``kvcm.v1`` messages.

Specs, KV-cache configs, hashing parameters, pool configs and events. Every function is a
pure translation; the server checks the values (the SDK does not duplicate its validation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

from kvcm.client._types import HashingParameters, PoolConfig
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec, KVCacheLayout, KVCacheTensor
from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from kvcm.common.hashing import HashAlgorithm, external_block_hash
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
from kvcm.v1 import admin_pb2, common_pb2, events_pb2

if TYPE_CHECKING:
    from kvcm.common.events import KVCacheEvent

__all__ = [
    "EventBatch",
    "decode_event_batch",
    "hashing_from_proto",
    "kv_cache_config_from_proto",
    "kv_cache_config_to_proto",
    "layer_specs_to_proto",
    "pool_config_from_proto",
    "pool_config_to_proto",
    "spec_from_proto",
    "spec_to_proto",
]

# ------------------------------------------------------------------------------ enums
_HASH_ALGORITHM_TO_PROTO: Final = {
    HashAlgorithm.SHA256: common_pb2.HASH_ALGORITHM_SHA256,
    HashAlgorithm.SHA256_CBOR: common_pb2.HASH_ALGORITHM_SHA256_CBOR,
    HashAlgorithm.XXHASH: common_pb2.HASH_ALGORITHM_XXHASH,
    HashAlgorithm.XXHASH_CBOR: common_pb2.HASH_ALGORITHM_XXHASH_CBOR,
}
_HASH_ALGORITHM_FROM_PROTO: Final = {v: k for k, v in _HASH_ALGORITHM_TO_PROTO.items()}

_DTYPE_TO_PROTO: Final = {
    "float16": common_pb2.DATA_TYPE_FLOAT16,
    "bfloat16": common_pb2.DATA_TYPE_BFLOAT16,
    "float32": common_pb2.DATA_TYPE_FLOAT32,
    "float8_e4m3fn": common_pb2.DATA_TYPE_FLOAT8_E4M3FN,
    "float8_e5m2": common_pb2.DATA_TYPE_FLOAT8_E5M2,
    "uint8": common_pb2.DATA_TYPE_UINT8,
    "int8": common_pb2.DATA_TYPE_INT8,
}
_DTYPE_FROM_PROTO: Final = {v: k for k, v in _DTYPE_TO_PROTO.items()}

_SPEC_KIND_FROM_PROTO: Final = {
    common_pb2.KV_CACHE_SPEC_KIND_FULL_ATTENTION: "full_attention",
    common_pb2.KV_CACHE_SPEC_KIND_MLA_ATTENTION: "mla_attention",
    common_pb2.KV_CACHE_SPEC_KIND_SLIDING_WINDOW: "sliding_window",
    common_pb2.KV_CACHE_SPEC_KIND_MAMBA: "mamba",
    common_pb2.KV_CACHE_SPEC_KIND_CHUNKED_LOCAL_ATTENTION: "chunked_local_attention",
    common_pb2.KV_CACHE_SPEC_KIND_SINK_FULL_ATTENTION: "sink_full_attention",
    common_pb2.KV_CACHE_SPEC_KIND_ENCODER_ONLY_ATTENTION: "encoder_only_attention",
    common_pb2.KV_CACHE_SPEC_KIND_CROSS_ATTENTION: "cross_attention",
}

_MEDIUM_FROM_PROTO: Final = {
    events_pb2.MEDIUM_GPU: MEDIUM_GPU,
    events_pb2.MEDIUM_CPU: MEDIUM_CPU,
    events_pb2.MEDIUM_STORAGE: MEDIUM_STORAGE,
}


def hash_algorithm_to_proto(algorithm: HashAlgorithm | str) -> common_pb2.HashAlgorithm:
    """The wire value of a hash algorithm (member or wire name)."""
    try:
        return _HASH_ALGORITHM_TO_PROTO[HashAlgorithm(algorithm)]
    except ValueError:
        raise InvalidArgumentError(
            f"hash_algorithm must be one of {[a.value for a in HashAlgorithm]}, got {algorithm!r}"
        ) from None


def _dtype_to_proto(dtype: DType) -> common_pb2.DataType:
    try:
        return _DTYPE_TO_PROTO[DType(dtype).value]
    except (KeyError, ValueError):
        raise InvalidArgumentError(f"dtype {dtype!r} has no wire form") from None


def _dtype_from_proto(value: int) -> DType:
    name = _DTYPE_FROM_PROTO.get(value)  # type: ignore[call-overload]
    if name is None:
        raise InvalidArgumentError(f"data type {value} is not a known DataType")
    return DType(name)


# ------------------------------------------------------------------------------ specs
def _attention_to_proto(spec: AttentionSpec, message: common_pb2.AttentionSpec) -> None:
    message.block_size = spec.block_size
    message.num_kv_heads = spec.num_kv_heads
    message.head_size = spec.head_size
    if spec.head_size_v is not None and spec.head_size_v != spec.head_size:
        message.head_size_v = spec.head_size_v
    message.dtype = _dtype_to_proto(spec.dtype)
    if spec.page_size_padded is not None:
        message.page_size_padded_bytes = spec.page_size_padded


def _attention_fields(message: common_pb2.AttentionSpec) -> _AttentionFields:
    return _AttentionFields(
        block_size=message.block_size,
        num_kv_heads=message.num_kv_heads,
        head_size=message.head_size,
        dtype=_dtype_from_proto(message.dtype),
        head_size_v=message.head_size_v if message.HasField("head_size_v") else None,
        page_size_padded=(
            message.page_size_padded_bytes if message.HasField("page_size_padded_bytes") else None
        ),
    )


class _AttentionFields(NamedTuple):
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: DType
    head_size_v: int | None
    page_size_padded: int | None


def spec_to_proto(spec: KVCacheSpec) -> common_pb2.KVCacheSpec:
    """The wire form of a KV-cache spec (subclasses before their bases).

    Raises:
        InvalidArgumentError: The spec type has no wire form.
    """
    message = common_pb2.KVCacheSpec()
    if isinstance(spec, UniformTypeKVCacheSpecs):
        message.uniform_type.block_size = spec.block_size
        message.uniform_type.kv_cache_specs.extend(layer_specs_to_proto(spec.kv_cache_specs))
    elif isinstance(spec, MLAAttentionSpec):
        _attention_to_proto(spec, message.mla_attention.attention)
        if spec.cache_dtype_str is not None:
            message.mla_attention.cache_dtype_str = spec.cache_dtype_str
    elif isinstance(spec, SinkFullAttentionSpec):
        _attention_to_proto(spec, message.sink_full_attention.attention)
        if spec.sink_len is not None:
            message.sink_full_attention.sink_len = spec.sink_len
    elif isinstance(spec, FullAttentionSpec):
        _attention_to_proto(spec, message.full_attention.attention)
        if spec.sliding_window is not None:
            message.full_attention.sliding_window = spec.sliding_window
        if spec.attention_chunk_size is not None:
            message.full_attention.attention_chunk_size = spec.attention_chunk_size
    elif isinstance(spec, SlidingWindowSpec):
        _attention_to_proto(spec, message.sliding_window.attention)
        message.sliding_window.sliding_window = spec.sliding_window
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        _attention_to_proto(spec, message.chunked_local_attention.attention)
        message.chunked_local_attention.attention_chunk_size = spec.attention_chunk_size
    elif isinstance(spec, CrossAttentionSpec):
        _attention_to_proto(spec, message.cross_attention.attention)
    elif isinstance(spec, EncoderOnlyAttentionSpec):
        _attention_to_proto(spec, message.encoder_only_attention.attention)
    elif isinstance(spec, MambaSpec):
        mamba = message.mamba
        mamba.block_size = spec.block_size
        for shape in spec.shapes:
            mamba.shapes.add().dims.extend(shape)
        mamba.dtypes.extend(_dtype_to_proto(dtype) for dtype in spec.dtypes)
        if spec.page_size_padded is not None:
            mamba.page_size_padded_bytes = spec.page_size_padded
        mamba.mamba_type = spec.mamba_type
        mamba.mamba_cache_mode = spec.mamba_cache_mode
        mamba.num_speculative_blocks = spec.num_speculative_blocks
    else:
        raise InvalidArgumentError(f"spec {type(spec).__name__} has no wire form")
    return message


def spec_from_proto(message: common_pb2.KVCacheSpec) -> KVCacheSpec:
    """The ``kvcm.common.specs`` value of a wire spec.

    Raises:
        InvalidArgumentError: No spec is set, or a field is out of its domain.
    """
    kind = message.WhichOneof("spec")
    if kind == "full_attention":
        full = message.full_attention
        return FullAttentionSpec(
            **_attention_fields(full.attention)._asdict(),
            sliding_window=full.sliding_window if full.HasField("sliding_window") else None,
            attention_chunk_size=(
                full.attention_chunk_size if full.HasField("attention_chunk_size") else None
            ),
        )
    if kind == "mla_attention":
        mla = message.mla_attention
        fields = _attention_fields(mla.attention)._asdict()
        if fields["head_size_v"] is None:
            fields["head_size_v"] = 0  # MLA's default: one latent, no separate V
        return MLAAttentionSpec(
            **fields,
            cache_dtype_str=mla.cache_dtype_str if mla.HasField("cache_dtype_str") else None,
        )
    if kind == "sink_full_attention":
        sink = message.sink_full_attention
        return SinkFullAttentionSpec(
            **_attention_fields(sink.attention)._asdict(),
            sink_len=sink.sink_len if sink.HasField("sink_len") else None,
        )
    if kind == "sliding_window":
        window = message.sliding_window
        return SlidingWindowSpec(
            **_attention_fields(window.attention)._asdict(), sliding_window=window.sliding_window
        )
    if kind == "chunked_local_attention":
        chunked = message.chunked_local_attention
        return ChunkedLocalAttentionSpec(
            **_attention_fields(chunked.attention)._asdict(),
            attention_chunk_size=chunked.attention_chunk_size,
        )
    if kind == "cross_attention":
        return CrossAttentionSpec(**_attention_fields(message.cross_attention.attention)._asdict())
    if kind == "encoder_only_attention":
        attention = message.encoder_only_attention.attention
        return EncoderOnlyAttentionSpec(**_attention_fields(attention)._asdict())
    if kind == "mamba":
        mamba = message.mamba
        return MambaSpec(
            block_size=mamba.block_size,
            shapes=tuple(tuple(shape.dims) for shape in mamba.shapes),
            dtypes=tuple(_dtype_from_proto(dtype) for dtype in mamba.dtypes),
            page_size_padded=(
                mamba.page_size_padded_bytes if mamba.HasField("page_size_padded_bytes") else None
            ),
            mamba_type=mamba.mamba_type or "mamba2",
            mamba_cache_mode=mamba.mamba_cache_mode or "none",
            num_speculative_blocks=mamba.num_speculative_blocks,
        )
    if kind == "uniform_type":
        uniform = message.uniform_type
        return UniformTypeKVCacheSpecs(
            block_size=uniform.block_size,
            kv_cache_specs={
                layer.layer_name: spec_from_proto(layer.spec) for layer in uniform.kv_cache_specs
            },
        )
    raise InvalidArgumentError("KVCacheSpec has no spec set")


def layer_specs_to_proto(specs: Mapping[str, KVCacheSpec]) -> list[common_pb2.LayerSpec]:
    """``LayerSpec`` entries for a ``{layer name: spec}`` mapping, in the mapping's order.

    The order is the model runner's layer order and decides planning (group membership,
    tensor order, byte offsets), so it is never sorted.
    """
    return [
        common_pb2.LayerSpec(layer_name=name, spec=spec_to_proto(spec))
        for name, spec in specs.items()
    ]


# ----------------------------------------------------------------------------- config
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


def kv_cache_config_from_proto(message: common_pb2.KVCacheConfig) -> KVCacheConfig:
    """The ``kvcm.common.config`` value of a wire ``KVCacheConfig``."""
    groups = tuple(
        KVCacheGroupSpec(
            layer_names=tuple(group.layer_names),
            kv_cache_spec=spec_from_proto(group.kv_cache_spec),
        )
        for group in message.kv_cache_groups
    )
    layout = KVCacheLayout.parse(message.kv_cache_layout or KVCacheLayout.LBNHC)
    return KVCacheConfig(
        num_blocks=message.num_blocks,
        kv_cache_layout=layout,
        kv_cache_tensors=tuple(_tensor_from_proto(tensor) for tensor in message.kv_cache_tensors),
        kv_cache_groups=groups,
    )


def hashing_from_proto(message: common_pb2.HashingParameters) -> HashingParameters:
    """The SDK's ``HashingParameters`` of a wire one."""
    return HashingParameters(
        algorithm=_HASH_ALGORITHM_FROM_PROTO.get(message.algorithm, HashAlgorithm.SHA256),
        seed=message.seed,
        hash_block_size=message.hash_block_size,
        hash_length_bytes=message.hash_length_bytes,
    )


def pool_config_to_proto(config: PoolConfig) -> admin_pb2.PoolConfig:
    """The wire form of a ``PoolConfig`` (``None`` fields stay unset)."""
    message = admin_pb2.PoolConfig(
        world_size=config.world_size,
        max_model_len=config.max_model_len,
        hash_algorithm=hash_algorithm_to_proto(config.hash_algorithm),
        verify_block_hashes=config.verify_block_hashes,
        enable_kv_cache_events=config.enable_kv_cache_events,
        watermark=config.watermark,
    )
    if config.explicit_layout is not None:
        layout = kv_cache_config_to_proto(config.explicit_layout)
        message.explicit_layout.num_blocks = layout.num_blocks
        message.explicit_layout.kv_cache_groups.extend(layout.kv_cache_groups)
    for field in (
        "num_blocks_override",
        "scheduler_block_size",
        "hash_block_size",
        "max_in_flight_tokens",
        "hash_seed",
        "event_retention_num_events",
    ):
        value = getattr(config, field)
        if value is not None:
            setattr(message, field, value)
    if not config.enable_caching:
        message.enable_caching = False
    if not config.log_stats:
        message.log_stats = False
    return message


def pool_config_from_proto(message: admin_pb2.PoolConfig) -> PoolConfig:
    """The SDK's ``PoolConfig`` of a wire one (unset fields as ``None`` / defaults)."""

    def optional(field: str) -> int | None:
        if not message.HasField(field):
            return None
        value: int = getattr(message, field)
        return value

    explicit_layout = None
    if message.HasField("explicit_layout"):
        layout = common_pb2.KVCacheConfig(
            num_blocks=message.explicit_layout.num_blocks,
            kv_cache_groups=message.explicit_layout.kv_cache_groups,
        )
        explicit_layout = kv_cache_config_from_proto(layout)
    algorithm = _HASH_ALGORITHM_FROM_PROTO.get(message.hash_algorithm, HashAlgorithm.SHA256)
    return PoolConfig(
        max_model_len=message.max_model_len,
        world_size=message.world_size,
        explicit_layout=explicit_layout,
        num_blocks_override=optional("num_blocks_override"),
        scheduler_block_size=optional("scheduler_block_size"),
        hash_block_size=optional("hash_block_size"),
        max_in_flight_tokens=optional("max_in_flight_tokens"),
        enable_caching=message.enable_caching if message.HasField("enable_caching") else True,
        hash_algorithm=algorithm.value,
        hash_seed=message.hash_seed if message.HasField("hash_seed") else None,
        verify_block_hashes=message.verify_block_hashes,
        enable_kv_cache_events=message.enable_kv_cache_events,
        event_retention_num_events=optional("event_retention_num_events"),
        log_stats=message.log_stats if message.HasField("log_stats") else True,
        watermark=message.watermark,
    )


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True, slots=True, kw_only=True)
class EventBatch:
    """Consecutive events of one pool, as one stream message carried them.

    Attributes:
        first_sequence: Sequence number of ``events[0]`` (of the next event when empty).
        events: The events with vLLM's field names; hashes in vLLM's int form (low 64 bits).
        timestamp_unix_seconds: When the server published them.
        oldest_sequence: Oldest sequence still kept for resuming (first message only, else 0).
    """

    first_sequence: int
    events: list[KVCacheEvent]
    timestamp_unix_seconds: float
    oldest_sequence: int = 0

    @property
    def last_sequence(self) -> int:
        """Sequence number of the last event (``first_sequence - 1`` when empty)."""
        return self.first_sequence + len(self.events) - 1


def _split_hashes(raw: bytes, hash_length_bytes: int) -> list[int]:
    if not raw:
        return []
    step = hash_length_bytes or len(raw)
    return [external_block_hash(raw[i : i + step]) for i in range(0, len(raw), step)]


def _event_from_proto(message: events_pb2.KVEvent, hash_length_bytes: int) -> KVCacheEvent:
    kind = message.WhichOneof("event")
    if kind == "block_stored":
        stored = message.block_stored
        return BlockStored(
            block_hashes=_split_hashes(stored.block_hashes, hash_length_bytes),
            parent_block_hash=(
                external_block_hash(stored.parent_block_hash)
                if stored.HasField("parent_block_hash")
                else None
            ),
            token_ids=list(stored.token_ids),
            block_size=stored.block_size,
            lora_id=stored.lora_id if stored.HasField("lora_id") else None,
            medium=_MEDIUM_FROM_PROTO.get(stored.medium),
            lora_name=stored.lora_name if stored.HasField("lora_name") else None,
            group_idx=stored.group_idx if stored.HasField("group_idx") else None,
            kv_cache_spec_kind=_SPEC_KIND_FROM_PROTO.get(stored.kv_cache_spec_kind),
            kv_cache_spec_sliding_window=(
                stored.kv_cache_spec_sliding_window
                if stored.HasField("kv_cache_spec_sliding_window")
                else None
            ),
        )
    if kind == "block_removed":
        removed = message.block_removed
        return BlockRemoved(
            block_hashes=_split_hashes(removed.block_hashes, hash_length_bytes),
            medium=_MEDIUM_FROM_PROTO.get(removed.medium),
            group_idx=removed.group_idx if removed.HasField("group_idx") else None,
        )
    return AllBlocksCleared()


def decode_event_batch(
    message: events_pb2.SubscribeEventsResponse, hash_length_bytes: int
) -> EventBatch:
    """Decode one ``SubscribeEventsResponse``.

    Args:
        message: The stream message.
        hash_length_bytes: Bytes per hash (from the stream's first message).
    """
    return EventBatch(
        first_sequence=message.first_sequence,
        events=[_event_from_proto(event, hash_length_bytes) for event in message.events],
        timestamp_unix_seconds=message.timestamp_unix_seconds,
        oldest_sequence=message.oldest_sequence,
    )
