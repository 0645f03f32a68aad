from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_FLOAT16: _ClassVar[DataType]
    DATA_TYPE_BFLOAT16: _ClassVar[DataType]
    DATA_TYPE_FLOAT32: _ClassVar[DataType]
    DATA_TYPE_FLOAT8_E4M3FN: _ClassVar[DataType]
    DATA_TYPE_FLOAT8_E5M2: _ClassVar[DataType]
    DATA_TYPE_UINT8: _ClassVar[DataType]
    DATA_TYPE_INT8: _ClassVar[DataType]

class HashAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HASH_ALGORITHM_UNSPECIFIED: _ClassVar[HashAlgorithm]
    HASH_ALGORITHM_SHA256: _ClassVar[HashAlgorithm]
    HASH_ALGORITHM_SHA256_CBOR: _ClassVar[HashAlgorithm]
    HASH_ALGORITHM_XXHASH: _ClassVar[HashAlgorithm]
    HASH_ALGORITHM_XXHASH_CBOR: _ClassVar[HashAlgorithm]

class KVCacheSpecKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_SPEC_KIND_UNSPECIFIED: _ClassVar[KVCacheSpecKind]
    KV_CACHE_SPEC_KIND_FULL_ATTENTION: _ClassVar[KVCacheSpecKind]
    KV_CACHE_SPEC_KIND_MLA_ATTENTION: _ClassVar[KVCacheSpecKind]
    KV_CACHE_SPEC_KIND_SLIDING_WINDOW: _ClassVar[KVCacheSpecKind]
    KV_CACHE_SPEC_KIND_MAMBA: _ClassVar[KVCacheSpecKind]
    KV_CACHE_SPEC_KIND_CHUNKED_LOCAL_ATTENTION: _ClassVar[KVCacheSpecKind]
    KV_CACHE_SPEC_KIND_SINK_FULL_ATTENTION: _ClassVar[KVCacheSpecKind]
    KV_CACHE_SPEC_KIND_ENCODER_ONLY_ATTENTION: _ClassVar[KVCacheSpecKind]
    KV_CACHE_SPEC_KIND_CROSS_ATTENTION: _ClassVar[KVCacheSpecKind]

class ItemStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ITEM_STATUS_UNSPECIFIED: _ClassVar[ItemStatus]
    ITEM_STATUS_OK: _ClassVar[ItemStatus]
    ITEM_STATUS_DOES_NOT_FIT: _ClassVar[ItemStatus]
    ITEM_STATUS_NO_TOKEN_BUDGET: _ClassVar[ItemStatus]
    ITEM_STATUS_NOT_EXECUTED: _ClassVar[ItemStatus]
    ITEM_STATUS_HIT_STALE: _ClassVar[ItemStatus]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_FLOAT16: DataType
DATA_TYPE_BFLOAT16: DataType
DATA_TYPE_FLOAT32: DataType
DATA_TYPE_FLOAT8_E4M3FN: DataType
DATA_TYPE_FLOAT8_E5M2: DataType
DATA_TYPE_UINT8: DataType
DATA_TYPE_INT8: DataType
HASH_ALGORITHM_UNSPECIFIED: HashAlgorithm
HASH_ALGORITHM_SHA256: HashAlgorithm
HASH_ALGORITHM_SHA256_CBOR: HashAlgorithm
HASH_ALGORITHM_XXHASH: HashAlgorithm
HASH_ALGORITHM_XXHASH_CBOR: HashAlgorithm
KV_CACHE_SPEC_KIND_UNSPECIFIED: KVCacheSpecKind
KV_CACHE_SPEC_KIND_FULL_ATTENTION: KVCacheSpecKind
KV_CACHE_SPEC_KIND_MLA_ATTENTION: KVCacheSpecKind
KV_CACHE_SPEC_KIND_SLIDING_WINDOW: KVCacheSpecKind
KV_CACHE_SPEC_KIND_MAMBA: KVCacheSpecKind
KV_CACHE_SPEC_KIND_CHUNKED_LOCAL_ATTENTION: KVCacheSpecKind
KV_CACHE_SPEC_KIND_SINK_FULL_ATTENTION: KVCacheSpecKind
KV_CACHE_SPEC_KIND_ENCODER_ONLY_ATTENTION: KVCacheSpecKind
KV_CACHE_SPEC_KIND_CROSS_ATTENTION: KVCacheSpecKind
ITEM_STATUS_UNSPECIFIED: ItemStatus
ITEM_STATUS_OK: ItemStatus
ITEM_STATUS_DOES_NOT_FIT: ItemStatus
ITEM_STATUS_NO_TOKEN_BUDGET: ItemStatus
ITEM_STATUS_NOT_EXECUTED: ItemStatus
ITEM_STATUS_HIT_STALE: ItemStatus

class AttentionSpec(_message.Message):
    __slots__ = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "page_size_padded_bytes")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_V_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_PADDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: DataType
    page_size_padded_bytes: int
    def __init__(self, block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., head_size_v: _Optional[int] = ..., dtype: _Optional[_Union[DataType, str]] = ..., page_size_padded_bytes: _Optional[int] = ...) -> None: ...

class FullAttentionSpec(_message.Message):
    __slots__ = ("attention", "sliding_window", "attention_chunk_size")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionSpec
    sliding_window: int
    attention_chunk_size: int
    def __init__(self, attention: _Optional[_Union[AttentionSpec, _Mapping]] = ..., sliding_window: _Optional[int] = ..., attention_chunk_size: _Optional[int] = ...) -> None: ...

class MLAAttentionSpec(_message.Message):
    __slots__ = ("attention", "cache_dtype_str")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_STR_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionSpec
    cache_dtype_str: str
    def __init__(self, attention: _Optional[_Union[AttentionSpec, _Mapping]] = ..., cache_dtype_str: _Optional[str] = ...) -> None: ...

class SinkFullAttentionSpec(_message.Message):
    __slots__ = ("attention", "sink_len")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SINK_LEN_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionSpec
    sink_len: int
    def __init__(self, attention: _Optional[_Union[AttentionSpec, _Mapping]] = ..., sink_len: _Optional[int] = ...) -> None: ...

class SlidingWindowSpec(_message.Message):
    __slots__ = ("attention", "sliding_window")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionSpec
    sliding_window: int
    def __init__(self, attention: _Optional[_Union[AttentionSpec, _Mapping]] = ..., sliding_window: _Optional[int] = ...) -> None: ...

class ChunkedLocalAttentionSpec(_message.Message):
    __slots__ = ("attention", "attention_chunk_size")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionSpec
    attention_chunk_size: int
    def __init__(self, attention: _Optional[_Union[AttentionSpec, _Mapping]] = ..., attention_chunk_size: _Optional[int] = ...) -> None: ...

class CrossAttentionSpec(_message.Message):
    __slots__ = ("attention",)
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionSpec
    def __init__(self, attention: _Optional[_Union[AttentionSpec, _Mapping]] = ...) -> None: ...

class EncoderOnlyAttentionSpec(_message.Message):
    __slots__ = ("attention",)
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionSpec
    def __init__(self, attention: _Optional[_Union[AttentionSpec, _Mapping]] = ...) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class MambaSpec(_message.Message):
    __slots__ = ("block_size", "shapes", "dtypes", "page_size_padded_bytes", "mamba_type", "mamba_cache_mode", "num_speculative_blocks", "num_prefill_checkpoint_blocks", "prefill_checkpoint_alignment")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_PADDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAMBA_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_CACHE_MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_CHECKPOINT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHECKPOINT_ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    shapes: _containers.RepeatedCompositeFieldContainer[TensorShape]
    dtypes: _containers.RepeatedScalarFieldContainer[DataType]
    page_size_padded_bytes: int
    mamba_type: str
    mamba_cache_mode: str
    num_speculative_blocks: int
    num_prefill_checkpoint_blocks: int
    prefill_checkpoint_alignment: int
    def __init__(self, block_size: _Optional[int] = ..., shapes: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., dtypes: _Optional[_Iterable[_Union[DataType, str]]] = ..., page_size_padded_bytes: _Optional[int] = ..., mamba_type: _Optional[str] = ..., mamba_cache_mode: _Optional[str] = ..., num_speculative_blocks: _Optional[int] = ..., num_prefill_checkpoint_blocks: _Optional[int] = ..., prefill_checkpoint_alignment: _Optional[int] = ...) -> None: ...

class UniformTypeKVCacheSpecs(_message.Message):
    __slots__ = ("block_size", "kv_cache_specs")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPECS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    kv_cache_specs: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    def __init__(self, block_size: _Optional[int] = ..., kv_cache_specs: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ...) -> None: ...

class KVCacheSpec(_message.Message):
    __slots__ = ("full_attention", "mla_attention", "sliding_window", "chunked_local_attention", "mamba", "cross_attention", "encoder_only_attention", "sink_full_attention", "uniform_type")
    FULL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    MLA_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_LOCAL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    MAMBA_FIELD_NUMBER: _ClassVar[int]
    CROSS_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    ENCODER_ONLY_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SINK_FULL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    UNIFORM_TYPE_FIELD_NUMBER: _ClassVar[int]
    full_attention: FullAttentionSpec
    mla_attention: MLAAttentionSpec
    sliding_window: SlidingWindowSpec
    chunked_local_attention: ChunkedLocalAttentionSpec
    mamba: MambaSpec
    cross_attention: CrossAttentionSpec
    encoder_only_attention: EncoderOnlyAttentionSpec
    sink_full_attention: SinkFullAttentionSpec
    uniform_type: UniformTypeKVCacheSpecs
    def __init__(self, full_attention: _Optional[_Union[FullAttentionSpec, _Mapping]] = ..., mla_attention: _Optional[_Union[MLAAttentionSpec, _Mapping]] = ..., sliding_window: _Optional[_Union[SlidingWindowSpec, _Mapping]] = ..., chunked_local_attention: _Optional[_Union[ChunkedLocalAttentionSpec, _Mapping]] = ..., mamba: _Optional[_Union[MambaSpec, _Mapping]] = ..., cross_attention: _Optional[_Union[CrossAttentionSpec, _Mapping]] = ..., encoder_only_attention: _Optional[_Union[EncoderOnlyAttentionSpec, _Mapping]] = ..., sink_full_attention: _Optional[_Union[SinkFullAttentionSpec, _Mapping]] = ..., uniform_type: _Optional[_Union[UniformTypeKVCacheSpecs, _Mapping]] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("layer_name", "spec")
    LAYER_NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    layer_name: str
    spec: KVCacheSpec
    def __init__(self, layer_name: _Optional[str] = ..., spec: _Optional[_Union[KVCacheSpec, _Mapping]] = ...) -> None: ...

class KVCacheTensor(_message.Message):
    __slots__ = ("size_bytes", "shared_by", "offset_bytes", "layer_stride_bytes", "block_stride_bytes")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    shared_by: _containers.RepeatedScalarFieldContainer[str]
    offset_bytes: int
    layer_stride_bytes: int
    block_stride_bytes: int
    def __init__(self, size_bytes: _Optional[int] = ..., shared_by: _Optional[_Iterable[str]] = ..., offset_bytes: _Optional[int] = ..., layer_stride_bytes: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ...) -> None: ...

class KVCacheGroupSpec(_message.Message):
    __slots__ = ("layer_names", "kv_cache_spec")
    LAYER_NAMES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_FIELD_NUMBER: _ClassVar[int]
    layer_names: _containers.RepeatedScalarFieldContainer[str]
    kv_cache_spec: KVCacheSpec
    def __init__(self, layer_names: _Optional[_Iterable[str]] = ..., kv_cache_spec: _Optional[_Union[KVCacheSpec, _Mapping]] = ...) -> None: ...

class KVCacheConfig(_message.Message):
    __slots__ = ("num_blocks", "kv_cache_tensors", "kv_cache_groups", "kv_cache_layout")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    kv_cache_tensors: _containers.RepeatedCompositeFieldContainer[KVCacheTensor]
    kv_cache_groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroupSpec]
    kv_cache_layout: str
    def __init__(self, num_blocks: _Optional[int] = ..., kv_cache_tensors: _Optional[_Iterable[_Union[KVCacheTensor, _Mapping]]] = ..., kv_cache_groups: _Optional[_Iterable[_Union[KVCacheGroupSpec, _Mapping]]] = ..., kv_cache_layout: _Optional[str] = ...) -> None: ...

class HashingParameters(_message.Message):
    __slots__ = ("algorithm", "seed", "hash_block_size", "hash_length_bytes", "num_lookahead_tokens")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    algorithm: HashAlgorithm
    seed: str
    hash_block_size: int
    hash_length_bytes: int
    num_lookahead_tokens: int
    def __init__(self, algorithm: _Optional[_Union[HashAlgorithm, str]] = ..., seed: _Optional[str] = ..., hash_block_size: _Optional[int] = ..., hash_length_bytes: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ...) -> None: ...

class GroupedBlockIds(_message.Message):
    __slots__ = ("block_ids", "num_block_ids")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...
