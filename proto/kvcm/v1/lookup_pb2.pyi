from kvcm.v1 import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("tokens", "hashes", "scope", "load_weight", "max_results", "packed")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_RESULTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenPrompt
    hashes: HashPrompt
    scope: LookupScope
    load_weight: float
    max_results: int
    packed: bool
    def __init__(self, tokens: _Optional[_Union[TokenPrompt, _Mapping]] = ..., hashes: _Optional[_Union[HashPrompt, _Mapping]] = ..., scope: _Optional[_Union[LookupScope, _Mapping]] = ..., load_weight: _Optional[float] = ..., max_results: _Optional[int] = ..., packed: _Optional[bool] = ...) -> None: ...

class TokenPrompt(_message.Message):
    __slots__ = ("token_ids", "lora_name", "lora_path", "cache_salt", "mm_features")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MM_FEATURES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_name: str
    lora_path: str
    cache_salt: str
    mm_features: _containers.RepeatedCompositeFieldContainer[_scheduler_pb2.MultiModalFeature]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., cache_salt: _Optional[str] = ..., mm_features: _Optional[_Iterable[_Union[_scheduler_pb2.MultiModalFeature, _Mapping]]] = ...) -> None: ...

class HashPrompt(_message.Message):
    __slots__ = ("block_hashes", "num_tokens")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: bytes
    num_tokens: int
    def __init__(self, block_hashes: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class LookupScope(_message.Message):
    __slots__ = ("pool_ids", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, pool_ids: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PoolLoad(_message.Message):
    __slots__ = ("usage", "num_free_blocks", "num_running", "num_waiting")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    usage: float
    num_free_blocks: int
    num_running: int
    num_waiting: int
    def __init__(self, usage: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ...) -> None: ...

class PoolHit(_message.Message):
    __slots__ = ("pool_id", "num_hit_tokens", "group_hit_tokens", "tier_hit_tokens", "num_tokens", "load", "score")
    class TierHitTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUP_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    num_hit_tokens: int
    group_hit_tokens: _containers.RepeatedScalarFieldContainer[int]
    tier_hit_tokens: _containers.ScalarMap[str, int]
    num_tokens: int
    load: PoolLoad
    score: float
    def __init__(self, pool_id: _Optional[str] = ..., num_hit_tokens: _Optional[int] = ..., group_hit_tokens: _Optional[_Iterable[int]] = ..., tier_hit_tokens: _Optional[_Mapping[str, int]] = ..., num_tokens: _Optional[int] = ..., load: _Optional[_Union[PoolLoad, _Mapping]] = ..., score: _Optional[float] = ...) -> None: ...

class SkippedPool(_message.Message):
    __slots__ = ("pool_id", "reason")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    reason: str
    def __init__(self, pool_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PackedPoolHits(_message.Message):
    __slots__ = ("pool_id", "num_hit_tokens", "num_tokens", "score", "usage", "num_free_blocks", "num_running", "num_waiting", "num_groups", "group_hit_tokens", "num_tiers", "tier", "tier_hit_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIERS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: _containers.RepeatedScalarFieldContainer[str]
    num_hit_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    score: _containers.RepeatedScalarFieldContainer[float]
    usage: _containers.RepeatedScalarFieldContainer[float]
    num_free_blocks: _containers.RepeatedScalarFieldContainer[int]
    num_running: _containers.RepeatedScalarFieldContainer[int]
    num_waiting: _containers.RepeatedScalarFieldContainer[int]
    num_groups: _containers.RepeatedScalarFieldContainer[int]
    group_hit_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_tiers: _containers.RepeatedScalarFieldContainer[int]
    tier: _containers.RepeatedScalarFieldContainer[str]
    tier_hit_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool_id: _Optional[_Iterable[str]] = ..., num_hit_tokens: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., score: _Optional[_Iterable[float]] = ..., usage: _Optional[_Iterable[float]] = ..., num_free_blocks: _Optional[_Iterable[int]] = ..., num_running: _Optional[_Iterable[int]] = ..., num_waiting: _Optional[_Iterable[int]] = ..., num_groups: _Optional[_Iterable[int]] = ..., group_hit_tokens: _Optional[_Iterable[int]] = ..., num_tiers: _Optional[_Iterable[int]] = ..., tier: _Optional[_Iterable[str]] = ..., tier_hit_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("pools", "skipped", "num_pools_in_scope", "packed")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_POOLS_IN_SCOPE_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolHit]
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedPool]
    num_pools_in_scope: int
    packed: PackedPoolHits
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolHit, _Mapping]]] = ..., skipped: _Optional[_Iterable[_Union[SkippedPool, _Mapping]]] = ..., num_pools_in_scope: _Optional[int] = ..., packed: _Optional[_Union[PackedPoolHits, _Mapping]] = ...) -> None: ...
