from kvcm.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_STATE_UNSPECIFIED: _ClassVar[PoolState]
    POOL_STATE_PENDING_WORKERS: _ClassVar[PoolState]
    POOL_STATE_READY: _ClassVar[PoolState]

class LeaseExpiry(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_EXPIRY_UNSPECIFIED: _ClassVar[LeaseExpiry]
    LEASE_EXPIRY_FREE_REQUESTS: _ClassVar[LeaseExpiry]
    LEASE_EXPIRY_CLEAR: _ClassVar[LeaseExpiry]
POOL_STATE_UNSPECIFIED: PoolState
POOL_STATE_PENDING_WORKERS: PoolState
POOL_STATE_READY: PoolState
LEASE_EXPIRY_UNSPECIFIED: LeaseExpiry
LEASE_EXPIRY_FREE_REQUESTS: LeaseExpiry
LEASE_EXPIRY_CLEAR: LeaseExpiry

class ExplicitLayout(_message.Message):
    __slots__ = ("num_blocks", "kv_cache_groups")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    kv_cache_groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.KVCacheGroupSpec]
    def __init__(self, num_blocks: _Optional[int] = ..., kv_cache_groups: _Optional[_Iterable[_Union[_common_pb2.KVCacheGroupSpec, _Mapping]]] = ...) -> None: ...

class PoolConfig(_message.Message):
    __slots__ = ("world_size", "explicit_layout", "num_blocks_override", "max_model_len", "scheduler_block_size", "hash_block_size", "max_in_flight_tokens", "enable_caching", "hash_algorithm", "hash_seed", "verify_block_hashes", "enable_kv_cache_events", "event_retention_num_events", "log_stats", "watermark", "scheduler_lease_s", "lease_expiry", "labels", "disable_hybrid_kv_cache_manager", "max_num_batched_tokens", "max_num_encoder_input_tokens", "kv_cache_memory_bytes", "auto_fit_max_model_len", "kv_cache_layout", "prefix_cache_retention_interval", "host_tier_bytes", "decode_context_parallel_size", "offload_host_blocks", "num_hash_lookahead_tokens", "num_prefill_lookahead", "eagle_block_drop_group_ids", "enable_mamba_shared_prefix_checkpoint")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_CACHING_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ENABLE_KV_CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    EVENT_RETENTION_NUM_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOG_STATS_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_LEASE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_HYBRID_KV_CACHE_MANAGER_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_ENCODER_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    AUTO_FIT_MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_RETENTION_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONTEXT_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HASH_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    EAGLE_BLOCK_DROP_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_MAMBA_SHARED_PREFIX_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    explicit_layout: ExplicitLayout
    num_blocks_override: int
    max_model_len: int
    scheduler_block_size: int
    hash_block_size: int
    max_in_flight_tokens: int
    enable_caching: bool
    hash_algorithm: _common_pb2.HashAlgorithm
    hash_seed: str
    verify_block_hashes: bool
    enable_kv_cache_events: bool
    event_retention_num_events: int
    log_stats: bool
    watermark: float
    scheduler_lease_s: float
    lease_expiry: LeaseExpiry
    labels: _containers.ScalarMap[str, str]
    disable_hybrid_kv_cache_manager: bool
    max_num_batched_tokens: int
    max_num_encoder_input_tokens: int
    kv_cache_memory_bytes: int
    auto_fit_max_model_len: bool
    kv_cache_layout: str
    prefix_cache_retention_interval: int
    host_tier_bytes: int
    decode_context_parallel_size: int
    offload_host_blocks: int
    num_hash_lookahead_tokens: int
    num_prefill_lookahead: int
    eagle_block_drop_group_ids: _containers.RepeatedScalarFieldContainer[int]
    enable_mamba_shared_prefix_checkpoint: bool
    def __init__(self, world_size: _Optional[int] = ..., explicit_layout: _Optional[_Union[ExplicitLayout, _Mapping]] = ..., num_blocks_override: _Optional[int] = ..., max_model_len: _Optional[int] = ..., scheduler_block_size: _Optional[int] = ..., hash_block_size: _Optional[int] = ..., max_in_flight_tokens: _Optional[int] = ..., enable_caching: _Optional[bool] = ..., hash_algorithm: _Optional[_Union[_common_pb2.HashAlgorithm, str]] = ..., hash_seed: _Optional[str] = ..., verify_block_hashes: _Optional[bool] = ..., enable_kv_cache_events: _Optional[bool] = ..., event_retention_num_events: _Optional[int] = ..., log_stats: _Optional[bool] = ..., watermark: _Optional[float] = ..., scheduler_lease_s: _Optional[float] = ..., lease_expiry: _Optional[_Union[LeaseExpiry, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., disable_hybrid_kv_cache_manager: _Optional[bool] = ..., max_num_batched_tokens: _Optional[int] = ..., max_num_encoder_input_tokens: _Optional[int] = ..., kv_cache_memory_bytes: _Optional[int] = ..., auto_fit_max_model_len: _Optional[bool] = ..., kv_cache_layout: _Optional[str] = ..., prefix_cache_retention_interval: _Optional[int] = ..., host_tier_bytes: _Optional[int] = ..., decode_context_parallel_size: _Optional[int] = ..., offload_host_blocks: _Optional[int] = ..., num_hash_lookahead_tokens: _Optional[int] = ..., num_prefill_lookahead: _Optional[int] = ..., eagle_block_drop_group_ids: _Optional[_Iterable[int]] = ..., enable_mamba_shared_prefix_checkpoint: _Optional[bool] = ...) -> None: ...

class CreatePoolRequest(_message.Message):
    __slots__ = ("pool_id", "config", "replication_mode")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_MODE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    config: PoolConfig
    replication_mode: str
    def __init__(self, pool_id: _Optional[str] = ..., config: _Optional[_Union[PoolConfig, _Mapping]] = ..., replication_mode: _Optional[str] = ...) -> None: ...

class CreatePoolResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolInfo
    def __init__(self, pool: _Optional[_Union[PoolInfo, _Mapping]] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolSummary]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolSummary, _Mapping]]] = ...) -> None: ...

class DescribePoolRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class DescribePoolResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolInfo
    def __init__(self, pool: _Optional[_Union[PoolInfo, _Mapping]] = ...) -> None: ...

class DeletePoolRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class DeletePoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolSummary(_message.Message):
    __slots__ = ("pool_id", "state", "num_blocks", "num_free_blocks", "num_requests")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    state: PoolState
    num_blocks: int
    num_free_blocks: int
    num_requests: int
    def __init__(self, pool_id: _Optional[str] = ..., state: _Optional[_Union[PoolState, str]] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("pool_id", "state", "config", "kv_cache_config", "hashing", "registered_ranks", "num_free_blocks", "num_requests", "usage", "last_event_sequence", "epoch", "zmq_events", "step_progress", "prefix_cache")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    HASHING_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ZMQ_EVENTS_FIELD_NUMBER: _ClassVar[int]
    STEP_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    state: PoolState
    config: PoolConfig
    kv_cache_config: _common_pb2.KVCacheConfig
    hashing: _common_pb2.HashingParameters
    registered_ranks: _containers.RepeatedScalarFieldContainer[int]
    num_free_blocks: int
    num_requests: int
    usage: float
    last_event_sequence: int
    epoch: int
    zmq_events: ZmqEventStream
    step_progress: StepProgress
    prefix_cache: PrefixCacheTotals
    def __init__(self, pool_id: _Optional[str] = ..., state: _Optional[_Union[PoolState, str]] = ..., config: _Optional[_Union[PoolConfig, _Mapping]] = ..., kv_cache_config: _Optional[_Union[_common_pb2.KVCacheConfig, _Mapping]] = ..., hashing: _Optional[_Union[_common_pb2.HashingParameters, _Mapping]] = ..., registered_ranks: _Optional[_Iterable[int]] = ..., num_free_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ..., usage: _Optional[float] = ..., last_event_sequence: _Optional[int] = ..., epoch: _Optional[int] = ..., zmq_events: _Optional[_Union[ZmqEventStream, _Mapping]] = ..., step_progress: _Optional[_Union[StepProgress, _Mapping]] = ..., prefix_cache: _Optional[_Union[PrefixCacheTotals, _Mapping]] = ...) -> None: ...

class PrefixCacheTotals(_message.Message):
    __slots__ = ("num_requests", "num_query_tokens", "num_hit_tokens", "num_preempted_requests", "num_preempted_query_tokens", "num_preempted_hit_tokens", "recent_hit_rate")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECENT_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    num_query_tokens: int
    num_hit_tokens: int
    num_preempted_requests: int
    num_preempted_query_tokens: int
    num_preempted_hit_tokens: int
    recent_hit_rate: float
    def __init__(self, num_requests: _Optional[int] = ..., num_query_tokens: _Optional[int] = ..., num_hit_tokens: _Optional[int] = ..., num_preempted_requests: _Optional[int] = ..., num_preempted_query_tokens: _Optional[int] = ..., num_preempted_hit_tokens: _Optional[int] = ..., recent_hit_rate: _Optional[float] = ...) -> None: ...

class StepProgress(_message.Message):
    __slots__ = ("last_step_seq", "last_step_age_s", "scheduler_step_seq", "steps_behind", "since_applied_s")
    LAST_STEP_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_STEP_SEQ_FIELD_NUMBER: _ClassVar[int]
    STEPS_BEHIND_FIELD_NUMBER: _ClassVar[int]
    SINCE_APPLIED_S_FIELD_NUMBER: _ClassVar[int]
    last_step_seq: int
    last_step_age_s: float
    scheduler_step_seq: int
    steps_behind: int
    since_applied_s: float
    def __init__(self, last_step_seq: _Optional[int] = ..., last_step_age_s: _Optional[float] = ..., scheduler_step_seq: _Optional[int] = ..., steps_behind: _Optional[int] = ..., since_applied_s: _Optional[float] = ...) -> None: ...

class ZmqEventStream(_message.Message):
    __slots__ = ("endpoint", "replay_endpoint", "topic", "last_seq", "data_parallel_rank", "dedicated")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    DEDICATED_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    replay_endpoint: str
    topic: str
    last_seq: int
    data_parallel_rank: int
    dedicated: bool
    def __init__(self, endpoint: _Optional[str] = ..., replay_endpoint: _Optional[str] = ..., topic: _Optional[str] = ..., last_seq: _Optional[int] = ..., data_parallel_rank: _Optional[int] = ..., dedicated: _Optional[bool] = ...) -> None: ...
