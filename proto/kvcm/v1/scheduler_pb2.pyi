from kvcm.v1 import admin_pb2 as _admin_pb2
from kvcm.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FreeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FREE_MODE_UNSPECIFIED: _ClassVar[FreeMode]
    FREE_MODE_FINISHED: _ClassVar[FreeMode]
    FREE_MODE_PREEMPTED: _ClassVar[FreeMode]

class StepOpKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_OP_KIND_UNSPECIFIED: _ClassVar[StepOpKind]
    STEP_OP_KIND_ADD_REQUEST: _ClassVar[StepOpKind]
    STEP_OP_KIND_APPEND_TOKENS: _ClassVar[StepOpKind]
    STEP_OP_KIND_ALLOCATE: _ClassVar[StepOpKind]
    STEP_OP_KIND_CACHE_BLOCKS: _ClassVar[StepOpKind]
    STEP_OP_KIND_REMOVE_SKIPPED_BLOCKS: _ClassVar[StepOpKind]
    STEP_OP_KIND_PREEMPT: _ClassVar[StepOpKind]
    STEP_OP_KIND_FINISH: _ClassVar[StepOpKind]
    STEP_OP_KIND_NEW_STEP_STARTS: _ClassVar[StepOpKind]
    STEP_OP_KIND_EVICT_BLOCKS: _ClassVar[StepOpKind]
    STEP_OP_KIND_RESET_PREFIX_CACHE: _ClassVar[StepOpKind]
    STEP_OP_KIND_RECORD_PREFIX_STATS: _ClassVar[StepOpKind]
    STEP_OP_KIND_FORK: _ClassVar[StepOpKind]
    STEP_OP_KIND_TAKE_BLOCK_COPIES: _ClassVar[StepOpKind]
    STEP_OP_KIND_SWAP_OUT: _ClassVar[StepOpKind]
    STEP_OP_KIND_SWAP_IN: _ClassVar[StepOpKind]
    STEP_OP_KIND_TAKE_HOST_COPIES: _ClassVar[StepOpKind]
    STEP_OP_KIND_ADMIT_WITH_HOST: _ClassVar[StepOpKind]
    STEP_OP_KIND_FINISH_DEFERRED: _ClassVar[StepOpKind]
    STEP_OP_KIND_TAKE_BLOCK_COPIES_RETAINED: _ClassVar[StepOpKind]
    STEP_OP_KIND_RELEASE_BLOCK_COPIES: _ClassVar[StepOpKind]
    STEP_OP_KIND_HOST_SYNC: _ClassVar[StepOpKind]
    STEP_OP_KIND_COMMON_BLOCKS: _ClassVar[StepOpKind]
    STEP_OP_KIND_EXTEND_PROMPT: _ClassVar[StepOpKind]
    STEP_OP_KIND_REPORT_HIT: _ClassVar[StepOpKind]

class HostSyncAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOST_SYNC_ACTION_UNSPECIFIED: _ClassVar[HostSyncAction]
    HOST_SYNC_ACTION_STORE: _ClassVar[HostSyncAction]
    HOST_SYNC_ACTION_STORED: _ClassVar[HostSyncAction]
    HOST_SYNC_ACTION_STORE_FAILED: _ClassVar[HostSyncAction]
    HOST_SYNC_ACTION_LOAD: _ClassVar[HostSyncAction]
    HOST_SYNC_ACTION_LOADED: _ClassVar[HostSyncAction]
    HOST_SYNC_ACTION_TOUCH: _ClassVar[HostSyncAction]
    HOST_SYNC_ACTION_CLEAR: _ClassVar[HostSyncAction]
FREE_MODE_UNSPECIFIED: FreeMode
FREE_MODE_FINISHED: FreeMode
FREE_MODE_PREEMPTED: FreeMode
STEP_OP_KIND_UNSPECIFIED: StepOpKind
STEP_OP_KIND_ADD_REQUEST: StepOpKind
STEP_OP_KIND_APPEND_TOKENS: StepOpKind
STEP_OP_KIND_ALLOCATE: StepOpKind
STEP_OP_KIND_CACHE_BLOCKS: StepOpKind
STEP_OP_KIND_REMOVE_SKIPPED_BLOCKS: StepOpKind
STEP_OP_KIND_PREEMPT: StepOpKind
STEP_OP_KIND_FINISH: StepOpKind
STEP_OP_KIND_NEW_STEP_STARTS: StepOpKind
STEP_OP_KIND_EVICT_BLOCKS: StepOpKind
STEP_OP_KIND_RESET_PREFIX_CACHE: StepOpKind
STEP_OP_KIND_RECORD_PREFIX_STATS: StepOpKind
STEP_OP_KIND_FORK: StepOpKind
STEP_OP_KIND_TAKE_BLOCK_COPIES: StepOpKind
STEP_OP_KIND_SWAP_OUT: StepOpKind
STEP_OP_KIND_SWAP_IN: StepOpKind
STEP_OP_KIND_TAKE_HOST_COPIES: StepOpKind
STEP_OP_KIND_ADMIT_WITH_HOST: StepOpKind
STEP_OP_KIND_FINISH_DEFERRED: StepOpKind
STEP_OP_KIND_TAKE_BLOCK_COPIES_RETAINED: StepOpKind
STEP_OP_KIND_RELEASE_BLOCK_COPIES: StepOpKind
STEP_OP_KIND_HOST_SYNC: StepOpKind
STEP_OP_KIND_COMMON_BLOCKS: StepOpKind
STEP_OP_KIND_EXTEND_PROMPT: StepOpKind
STEP_OP_KIND_REPORT_HIT: StepOpKind
HOST_SYNC_ACTION_UNSPECIFIED: HostSyncAction
HOST_SYNC_ACTION_STORE: HostSyncAction
HOST_SYNC_ACTION_STORED: HostSyncAction
HOST_SYNC_ACTION_STORE_FAILED: HostSyncAction
HOST_SYNC_ACTION_LOAD: HostSyncAction
HOST_SYNC_ACTION_LOADED: HostSyncAction
HOST_SYNC_ACTION_TOUCH: HostSyncAction
HOST_SYNC_ACTION_CLEAR: HostSyncAction

class MultiModalFeature(_message.Message):
    __slots__ = ("identifier", "offset_tokens", "length_tokens")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset_tokens: int
    length_tokens: int
    def __init__(self, identifier: _Optional[str] = ..., offset_tokens: _Optional[int] = ..., length_tokens: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_key", "request_id", "prompt_token_ids", "block_hashes", "lora_id", "lora_name", "cache_salt", "mm_features", "skip_reading_prefix_cache", "report_cached_blocks")
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MM_FEATURES_FIELD_NUMBER: _ClassVar[int]
    SKIP_READING_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    REPORT_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_key: int
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: bytes
    lora_id: int
    lora_name: str
    cache_salt: str
    mm_features: _containers.RepeatedCompositeFieldContainer[MultiModalFeature]
    skip_reading_prefix_cache: bool
    report_cached_blocks: bool
    def __init__(self, request_key: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[bytes] = ..., lora_id: _Optional[int] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ..., mm_features: _Optional[_Iterable[_Union[MultiModalFeature, _Mapping]]] = ..., skip_reading_prefix_cache: _Optional[bool] = ..., report_cached_blocks: _Optional[bool] = ...) -> None: ...

class LookupOptions(_message.Message):
    __slots__ = ("max_cache_hit_length",)
    MAX_CACHE_HIT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    max_cache_hit_length: int
    def __init__(self, max_cache_hit_length: _Optional[int] = ...) -> None: ...

class SlotOptions(_message.Message):
    __slots__ = ("num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks", "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs", "num_in_flight_tokens")
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXTERNAL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELAY_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENCODER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FULL_SEQUENCE_MUST_FIT_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HAS_SCHEDULED_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_lookahead_tokens: int
    num_external_computed_tokens: int
    delay_cache_blocks: bool
    num_encoder_tokens: int
    full_sequence_must_fit: bool
    reserved_blocks: int
    has_scheduled_reqs: bool
    num_in_flight_tokens: int
    def __init__(self, num_lookahead_tokens: _Optional[int] = ..., num_external_computed_tokens: _Optional[int] = ..., delay_cache_blocks: _Optional[bool] = ..., num_encoder_tokens: _Optional[int] = ..., full_sequence_must_fit: _Optional[bool] = ..., reserved_blocks: _Optional[int] = ..., has_scheduled_reqs: _Optional[bool] = ..., num_in_flight_tokens: _Optional[int] = ...) -> None: ...

class AddRequestRequest(_message.Message):
    __slots__ = ("pool_id", "request")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request: NewRequest
    def __init__(self, pool_id: _Optional[str] = ..., request: _Optional[_Union[NewRequest, _Mapping]] = ...) -> None: ...

class AddRequestResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AppendTokensRequest(_message.Message):
    __slots__ = ("pool_id", "request_key", "token_ids", "block_hashes")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_key: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: bytes
    def __init__(self, pool_id: _Optional[str] = ..., request_key: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[bytes] = ...) -> None: ...

class AppendTokensResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("pool_id", "request_key", "mode")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_key: int
    mode: FreeMode
    def __init__(self, pool_id: _Optional[str] = ..., request_key: _Optional[int] = ..., mode: _Optional[_Union[FreeMode, str]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetComputedBlocksRequest(_message.Message):
    __slots__ = ("pool_id", "request_key", "lookup")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_key: int
    lookup: LookupOptions
    def __init__(self, pool_id: _Optional[str] = ..., request_key: _Optional[int] = ..., lookup: _Optional[_Union[LookupOptions, _Mapping]] = ...) -> None: ...

class GetComputedBlocksResponse(_message.Message):
    __slots__ = ("blocks", "num_computed_tokens")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    blocks: _common_pb2.GroupedBlockIds
    num_computed_tokens: int
    def __init__(self, blocks: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class ComputedBlocks(_message.Message):
    __slots__ = ("num_new_computed_tokens", "blocks", "shared_prefix_boundary")
    NUM_NEW_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    num_new_computed_tokens: int
    blocks: _common_pb2.GroupedBlockIds
    shared_prefix_boundary: int
    def __init__(self, num_new_computed_tokens: _Optional[int] = ..., blocks: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., shared_prefix_boundary: _Optional[int] = ...) -> None: ...

class AllocateSlotsRequest(_message.Message):
    __slots__ = ("pool_id", "request_key", "num_new_tokens", "num_computed_tokens", "new_computed", "options")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_key: int
    num_new_tokens: int
    num_computed_tokens: int
    new_computed: ComputedBlocks
    options: SlotOptions
    def __init__(self, pool_id: _Optional[str] = ..., request_key: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., new_computed: _Optional[_Union[ComputedBlocks, _Mapping]] = ..., options: _Optional[_Union[SlotOptions, _Mapping]] = ...) -> None: ...

class AllocateSlotsResponse(_message.Message):
    __slots__ = ("status", "new_blocks")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.ItemStatus
    new_blocks: _common_pb2.GroupedBlockIds
    def __init__(self, status: _Optional[_Union[_common_pb2.ItemStatus, str]] = ..., new_blocks: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ...) -> None: ...

class CacheBlocksRequest(_message.Message):
    __slots__ = ("pool_id", "request_key", "num_computed_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_key: int
    num_computed_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., request_key: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class CacheBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveSkippedBlocksRequest(_message.Message):
    __slots__ = ("pool_id", "request_key", "total_computed_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_key: int
    total_computed_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., request_key: _Optional[int] = ..., total_computed_tokens: _Optional[int] = ...) -> None: ...

class RemoveSkippedBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvictBlocksRequest(_message.Message):
    __slots__ = ("pool_id", "block_ids")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EvictBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset",)
    RESET_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    def __init__(self, reset: _Optional[bool] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("pool_id", "request_key")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_key: int
    def __init__(self, pool_id: _Optional[str] = ..., request_key: _Optional[int] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("blocks", "ref_cnts", "is_cached", "block_hashes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REF_CNTS_FIELD_NUMBER: _ClassVar[int]
    IS_CACHED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    blocks: _common_pb2.GroupedBlockIds
    ref_cnts: _containers.RepeatedScalarFieldContainer[int]
    is_cached: _containers.RepeatedScalarFieldContainer[bool]
    block_hashes: bytes
    def __init__(self, blocks: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., ref_cnts: _Optional[_Iterable[int]] = ..., is_cached: _Optional[_Iterable[bool]] = ..., block_hashes: _Optional[bytes] = ...) -> None: ...

class GetBlockIdsRequest(_message.Message):
    __slots__ = ("pool_id", "request_key")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_key: int
    def __init__(self, pool_id: _Optional[str] = ..., request_key: _Optional[int] = ...) -> None: ...

class GetBlockIdsResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _common_pb2.GroupedBlockIds
    def __init__(self, blocks: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ...) -> None: ...

class GetNumCommonPrefixBlocksRequest(_message.Message):
    __slots__ = ("pool_id", "running_request_key")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    running_request_key: int
    def __init__(self, pool_id: _Optional[str] = ..., running_request_key: _Optional[int] = ...) -> None: ...

class GetNumCommonPrefixBlocksResponse(_message.Message):
    __slots__ = ("num_common_prefix_blocks",)
    NUM_COMMON_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_common_prefix_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_common_prefix_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class TakeNewBlockIdsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class TakeNewBlockIdsResponse(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewStepStartsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class NewStepStartsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("usage", "num_free_blocks", "num_blocks", "num_requests")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    usage: float
    num_free_blocks: int
    num_blocks: int
    num_requests: int
    def __init__(self, usage: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("reset", "num_requests", "num_query_tokens", "num_hit_tokens", "num_preempted_requests", "num_preempted_query_tokens", "num_preempted_hit_tokens")
    RESET_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    num_requests: int
    num_query_tokens: int
    num_hit_tokens: int
    num_preempted_requests: int
    num_preempted_query_tokens: int
    num_preempted_hit_tokens: int
    def __init__(self, reset: _Optional[bool] = ..., num_requests: _Optional[int] = ..., num_query_tokens: _Optional[int] = ..., num_hit_tokens: _Optional[int] = ..., num_preempted_requests: _Optional[int] = ..., num_preempted_query_tokens: _Optional[int] = ..., num_preempted_hit_tokens: _Optional[int] = ...) -> None: ...

class TakePrefixCacheStatsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class TakePrefixCacheStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: PrefixCacheStats
    def __init__(self, stats: _Optional[_Union[PrefixCacheStats, _Mapping]] = ...) -> None: ...

class StepAllocOptions(_message.Message):
    __slots__ = ("alloc_index", "lookup", "options", "hit")
    ALLOC_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    alloc_index: int
    lookup: LookupOptions
    options: SlotOptions
    hit: ComputedBlocks
    def __init__(self, alloc_index: _Optional[int] = ..., lookup: _Optional[_Union[LookupOptions, _Mapping]] = ..., options: _Optional[_Union[SlotOptions, _Mapping]] = ..., hit: _Optional[_Union[ComputedBlocks, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("pool_id", "step_seq", "ops", "request_keys", "alloc_num_new_tokens", "alloc_num_computed_tokens", "alloc_options", "append_num_tokens", "append_token_ids", "append_num_block_hashes", "append_block_hashes", "cache_num_computed_tokens", "remove_skipped_total_computed_tokens", "new_requests", "default_num_lookahead_tokens", "token_budget", "continue_on_does_not_fit", "evict_num_block_ids", "evict_block_ids", "record_hit_tokens", "num_steps", "fork_child_keys", "fork_num_computed_tokens", "swap_out_num_computed_tokens", "swap_in_num_new_tokens", "admit_host_num_new_tokens", "host_sync_actions", "host_sync_num_keys", "host_sync_keys", "host_sync_group_ids", "common_num_keys", "common_keys", "extend_prompt_num_tokens", "report_hit_num_groups", "report_hit_num_blocks", "scheduler_step_seq", "step_age_s")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_SEQ_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEYS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    APPEND_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    APPEND_NUM_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    APPEND_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_SKIPPED_TOTAL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_ON_DOES_NOT_FIT_FIELD_NUMBER: _ClassVar[int]
    EVICT_NUM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    EVICT_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RECORD_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    FORK_CHILD_KEYS_FIELD_NUMBER: _ClassVar[int]
    FORK_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_HOST_NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_SYNC_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_SYNC_NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    HOST_SYNC_KEYS_FIELD_NUMBER: _ClassVar[int]
    HOST_SYNC_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMON_NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    COMMON_KEYS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_PROMPT_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPORT_HIT_NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REPORT_HIT_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_STEP_SEQ_FIELD_NUMBER: _ClassVar[int]
    STEP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    step_seq: int
    ops: _containers.RepeatedScalarFieldContainer[StepOpKind]
    request_keys: _containers.RepeatedScalarFieldContainer[int]
    alloc_num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    alloc_num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    alloc_options: _containers.RepeatedCompositeFieldContainer[StepAllocOptions]
    append_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    append_num_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    append_block_hashes: bytes
    cache_num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    remove_skipped_total_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    default_num_lookahead_tokens: int
    token_budget: int
    continue_on_does_not_fit: bool
    evict_num_block_ids: _containers.RepeatedScalarFieldContainer[int]
    evict_block_ids: _containers.RepeatedScalarFieldContainer[int]
    record_hit_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_steps: int
    fork_child_keys: _containers.RepeatedScalarFieldContainer[int]
    fork_num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    swap_out_num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    swap_in_num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    admit_host_num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    host_sync_actions: _containers.RepeatedScalarFieldContainer[int]
    host_sync_num_keys: _containers.RepeatedScalarFieldContainer[int]
    host_sync_keys: bytes
    host_sync_group_ids: _containers.RepeatedScalarFieldContainer[int]
    common_num_keys: _containers.RepeatedScalarFieldContainer[int]
    common_keys: _containers.RepeatedScalarFieldContainer[int]
    extend_prompt_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    report_hit_num_groups: _containers.RepeatedScalarFieldContainer[int]
    report_hit_num_blocks: _containers.RepeatedScalarFieldContainer[int]
    scheduler_step_seq: int
    step_age_s: float
    def __init__(self, pool_id: _Optional[str] = ..., step_seq: _Optional[int] = ..., ops: _Optional[_Iterable[_Union[StepOpKind, str]]] = ..., request_keys: _Optional[_Iterable[int]] = ..., alloc_num_new_tokens: _Optional[_Iterable[int]] = ..., alloc_num_computed_tokens: _Optional[_Iterable[int]] = ..., alloc_options: _Optional[_Iterable[_Union[StepAllocOptions, _Mapping]]] = ..., append_num_tokens: _Optional[_Iterable[int]] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., append_num_block_hashes: _Optional[_Iterable[int]] = ..., append_block_hashes: _Optional[bytes] = ..., cache_num_computed_tokens: _Optional[_Iterable[int]] = ..., remove_skipped_total_computed_tokens: _Optional[_Iterable[int]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., default_num_lookahead_tokens: _Optional[int] = ..., token_budget: _Optional[int] = ..., continue_on_does_not_fit: _Optional[bool] = ..., evict_num_block_ids: _Optional[_Iterable[int]] = ..., evict_block_ids: _Optional[_Iterable[int]] = ..., record_hit_tokens: _Optional[_Iterable[int]] = ..., num_steps: _Optional[int] = ..., fork_child_keys: _Optional[_Iterable[int]] = ..., fork_num_computed_tokens: _Optional[_Iterable[int]] = ..., swap_out_num_computed_tokens: _Optional[_Iterable[int]] = ..., swap_in_num_new_tokens: _Optional[_Iterable[int]] = ..., admit_host_num_new_tokens: _Optional[_Iterable[int]] = ..., host_sync_actions: _Optional[_Iterable[int]] = ..., host_sync_num_keys: _Optional[_Iterable[int]] = ..., host_sync_keys: _Optional[bytes] = ..., host_sync_group_ids: _Optional[_Iterable[int]] = ..., common_num_keys: _Optional[_Iterable[int]] = ..., common_keys: _Optional[_Iterable[int]] = ..., extend_prompt_num_tokens: _Optional[_Iterable[int]] = ..., report_hit_num_groups: _Optional[_Iterable[int]] = ..., report_hit_num_blocks: _Optional[_Iterable[int]] = ..., scheduler_step_seq: _Optional[int] = ..., step_age_s: _Optional[float] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("num_ops_executed", "alloc_statuses", "alloc_num_block_ids", "alloc_block_ids", "lookup_num_computed_tokens", "lookup_num_new_tokens", "token_budget_left", "step_seq", "reset", "copy_block_ids", "drained_copy_block_ids", "drained_num_copies", "swap_out_swapped", "host_alloc_statuses", "host_alloc_num_block_ids", "host_alloc_block_ids", "host_alloc_num_device_hit_tokens", "host_alloc_num_host_hit_tokens", "host_d2h_block_ids", "host_h2d_block_ids", "host_num_d2h", "host_num_h2d", "common_num_block_ids", "common_block_ids")
    NUM_OPS_EXECUTED_FIELD_NUMBER: _ClassVar[int]
    ALLOC_STATUSES_FIELD_NUMBER: _ClassVar[int]
    ALLOC_NUM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_LEFT_FIELD_NUMBER: _ClassVar[int]
    STEP_SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    COPY_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_COPY_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_NUM_COPIES_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    HOST_ALLOC_STATUSES_FIELD_NUMBER: _ClassVar[int]
    HOST_ALLOC_NUM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ALLOC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ALLOC_NUM_DEVICE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_ALLOC_NUM_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_D2H_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_H2D_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HOST_NUM_D2H_FIELD_NUMBER: _ClassVar[int]
    HOST_NUM_H2D_FIELD_NUMBER: _ClassVar[int]
    COMMON_NUM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMON_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    num_ops_executed: int
    alloc_statuses: _containers.RepeatedScalarFieldContainer[_common_pb2.ItemStatus]
    alloc_num_block_ids: _containers.RepeatedScalarFieldContainer[int]
    alloc_block_ids: _containers.RepeatedScalarFieldContainer[int]
    lookup_num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    lookup_num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_budget_left: int
    step_seq: int
    reset: _containers.RepeatedScalarFieldContainer[bool]
    copy_block_ids: _containers.RepeatedScalarFieldContainer[int]
    drained_copy_block_ids: _containers.RepeatedScalarFieldContainer[int]
    drained_num_copies: _containers.RepeatedScalarFieldContainer[int]
    swap_out_swapped: _containers.RepeatedScalarFieldContainer[bool]
    host_alloc_statuses: _containers.RepeatedScalarFieldContainer[_common_pb2.ItemStatus]
    host_alloc_num_block_ids: _containers.RepeatedScalarFieldContainer[int]
    host_alloc_block_ids: _containers.RepeatedScalarFieldContainer[int]
    host_alloc_num_device_hit_tokens: _containers.RepeatedScalarFieldContainer[int]
    host_alloc_num_host_hit_tokens: _containers.RepeatedScalarFieldContainer[int]
    host_d2h_block_ids: _containers.RepeatedScalarFieldContainer[int]
    host_h2d_block_ids: _containers.RepeatedScalarFieldContainer[int]
    host_num_d2h: _containers.RepeatedScalarFieldContainer[int]
    host_num_h2d: _containers.RepeatedScalarFieldContainer[int]
    common_num_block_ids: _containers.RepeatedScalarFieldContainer[int]
    common_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_ops_executed: _Optional[int] = ..., alloc_statuses: _Optional[_Iterable[_Union[_common_pb2.ItemStatus, str]]] = ..., alloc_num_block_ids: _Optional[_Iterable[int]] = ..., alloc_block_ids: _Optional[_Iterable[int]] = ..., lookup_num_computed_tokens: _Optional[_Iterable[int]] = ..., lookup_num_new_tokens: _Optional[_Iterable[int]] = ..., token_budget_left: _Optional[int] = ..., step_seq: _Optional[int] = ..., reset: _Optional[_Iterable[bool]] = ..., copy_block_ids: _Optional[_Iterable[int]] = ..., drained_copy_block_ids: _Optional[_Iterable[int]] = ..., drained_num_copies: _Optional[_Iterable[int]] = ..., swap_out_swapped: _Optional[_Iterable[bool]] = ..., host_alloc_statuses: _Optional[_Iterable[_Union[_common_pb2.ItemStatus, str]]] = ..., host_alloc_num_block_ids: _Optional[_Iterable[int]] = ..., host_alloc_block_ids: _Optional[_Iterable[int]] = ..., host_alloc_num_device_hit_tokens: _Optional[_Iterable[int]] = ..., host_alloc_num_host_hit_tokens: _Optional[_Iterable[int]] = ..., host_d2h_block_ids: _Optional[_Iterable[int]] = ..., host_h2d_block_ids: _Optional[_Iterable[int]] = ..., host_num_d2h: _Optional[_Iterable[int]] = ..., host_num_h2d: _Optional[_Iterable[int]] = ..., common_num_block_ids: _Optional[_Iterable[int]] = ..., common_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRejection(_message.Message):
    __slots__ = ("op_index", "field", "reason")
    OP_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    op_index: int
    field: str
    reason: str
    def __init__(self, op_index: _Optional[int] = ..., field: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("scheduler_lease_s",)
    SCHEDULER_LEASE_S_FIELD_NUMBER: _ClassVar[int]
    scheduler_lease_s: float
    def __init__(self, scheduler_lease_s: _Optional[float] = ...) -> None: ...

class ResyncPoolRequest(_message.Message):
    __slots__ = ("pool_id", "config", "step_seq", "data")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    STEP_SEQ_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    config: _admin_pb2.PoolConfig
    step_seq: int
    data: bytes
    def __init__(self, pool_id: _Optional[str] = ..., config: _Optional[_Union[_admin_pb2.PoolConfig, _Mapping]] = ..., step_seq: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ResyncPoolResponse(_message.Message):
    __slots__ = ("epoch", "num_blocks", "num_free_blocks", "num_requests")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_blocks: int
    num_free_blocks: int
    num_requests: int
    def __init__(self, epoch: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ...) -> None: ...
