from kvcm.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_UNSPECIFIED: _ClassVar[Medium]
    MEDIUM_GPU: _ClassVar[Medium]
    MEDIUM_CPU: _ClassVar[Medium]
    MEDIUM_STORAGE: _ClassVar[Medium]
MEDIUM_UNSPECIFIED: Medium
MEDIUM_GPU: Medium
MEDIUM_CPU: Medium
MEDIUM_STORAGE: Medium

class ExtraKey(_message.Message):
    __slots__ = ("text", "data", "mm", "integer")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MM_FIELD_NUMBER: _ClassVar[int]
    INTEGER_FIELD_NUMBER: _ClassVar[int]
    text: str
    data: bytes
    mm: MultiModalKey
    integer: int
    def __init__(self, text: _Optional[str] = ..., data: _Optional[bytes] = ..., mm: _Optional[_Union[MultiModalKey, _Mapping]] = ..., integer: _Optional[int] = ...) -> None: ...

class MultiModalKey(_message.Message):
    __slots__ = ("identifier", "offset")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class BlockExtraKeys(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ExtraKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[ExtraKey, _Mapping]]] = ...) -> None: ...

class ExtraKeysList(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockExtraKeys]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockExtraKeys, _Mapping]]] = ...) -> None: ...

class LookaheadTokens(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "lora_name", "medium", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "extra_keys", "locality", "ownership", "session_id", "lookahead_token_ids", "has_lookahead_token_ids")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_KIND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    OWNERSHIP_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOOKAHEAD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: bytes
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_id: int
    lora_name: str
    medium: Medium
    group_idx: int
    kv_cache_spec_kind: _common_pb2.KVCacheSpecKind
    kv_cache_spec_sliding_window: int
    extra_keys: ExtraKeysList
    locality: str
    ownership: str
    session_id: str
    lookahead_token_ids: _containers.RepeatedCompositeFieldContainer[LookaheadTokens]
    has_lookahead_token_ids: bool
    def __init__(self, block_hashes: _Optional[bytes] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_id: _Optional[int] = ..., lora_name: _Optional[str] = ..., medium: _Optional[_Union[Medium, str]] = ..., group_idx: _Optional[int] = ..., kv_cache_spec_kind: _Optional[_Union[_common_pb2.KVCacheSpecKind, str]] = ..., kv_cache_spec_sliding_window: _Optional[int] = ..., extra_keys: _Optional[_Union[ExtraKeysList, _Mapping]] = ..., locality: _Optional[str] = ..., ownership: _Optional[str] = ..., session_id: _Optional[str] = ..., lookahead_token_ids: _Optional[_Iterable[_Union[LookaheadTokens, _Mapping]]] = ..., has_lookahead_token_ids: _Optional[bool] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium", "group_idx", "locality", "ownership")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    OWNERSHIP_FIELD_NUMBER: _ClassVar[int]
    block_hashes: bytes
    medium: Medium
    group_idx: int
    locality: str
    ownership: str
    def __init__(self, block_hashes: _Optional[bytes] = ..., medium: _Optional[_Union[Medium, str]] = ..., group_idx: _Optional[int] = ..., locality: _Optional[str] = ..., ownership: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class SubscribeEventsRequest(_message.Message):
    __slots__ = ("pool_id", "start_sequence", "max_events_per_message", "expected_epoch")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    START_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    start_sequence: int
    max_events_per_message: int
    expected_epoch: int
    def __init__(self, pool_id: _Optional[str] = ..., start_sequence: _Optional[int] = ..., max_events_per_message: _Optional[int] = ..., expected_epoch: _Optional[int] = ...) -> None: ...

class SubscribeEventsResponse(_message.Message):
    __slots__ = ("first_sequence", "events", "timestamp_unix_seconds", "hash_length_bytes", "oldest_sequence", "pool_epoch")
    FIRST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HASH_LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    POOL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    first_sequence: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    timestamp_unix_seconds: float
    hash_length_bytes: int
    oldest_sequence: int
    pool_epoch: int
    def __init__(self, first_sequence: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., timestamp_unix_seconds: _Optional[float] = ..., hash_length_bytes: _Optional[int] = ..., oldest_sequence: _Optional[int] = ..., pool_epoch: _Optional[int] = ...) -> None: ...
