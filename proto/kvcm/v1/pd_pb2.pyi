from kvcm.v1 import common_pb2 as _common_pb2
from kvcm.v1 import lookup_pb2 as _lookup_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_HELD: _ClassVar[TransferState]
    TRANSFER_STATE_PLANNED: _ClassVar[TransferState]
    TRANSFER_STATE_COMPLETED: _ClassVar[TransferState]
    TRANSFER_STATE_RELEASED: _ClassVar[TransferState]
    TRANSFER_STATE_EXPIRED: _ClassVar[TransferState]
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_HELD: TransferState
TRANSFER_STATE_PLANNED: TransferState
TRANSFER_STATE_COMPLETED: TransferState
TRANSFER_STATE_RELEASED: TransferState
TRANSFER_STATE_EXPIRED: TransferState

class RoutePdRequest(_message.Message):
    __slots__ = ("tokens", "hashes", "prefill_scope", "decode_scope", "load_weight", "max_results", "bidirectional", "held")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SCOPE_FIELD_NUMBER: _ClassVar[int]
    DECODE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_RESULTS_FIELD_NUMBER: _ClassVar[int]
    BIDIRECTIONAL_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    tokens: _lookup_pb2.TokenPrompt
    hashes: _lookup_pb2.HashPrompt
    prefill_scope: _lookup_pb2.LookupScope
    decode_scope: _lookup_pb2.LookupScope
    load_weight: float
    max_results: int
    bidirectional: bool
    held: _containers.RepeatedCompositeFieldContainer[HeldRequest]
    def __init__(self, tokens: _Optional[_Union[_lookup_pb2.TokenPrompt, _Mapping]] = ..., hashes: _Optional[_Union[_lookup_pb2.HashPrompt, _Mapping]] = ..., prefill_scope: _Optional[_Union[_lookup_pb2.LookupScope, _Mapping]] = ..., decode_scope: _Optional[_Union[_lookup_pb2.LookupScope, _Mapping]] = ..., load_weight: _Optional[float] = ..., max_results: _Optional[int] = ..., bidirectional: _Optional[bool] = ..., held: _Optional[_Iterable[_Union[HeldRequest, _Mapping]]] = ...) -> None: ...

class HeldRequest(_message.Message):
    __slots__ = ("pool_id", "request_id")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    request_id: str
    def __init__(self, pool_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class RoutePdResponse(_message.Message):
    __slots__ = ("prefill", "decode", "skipped", "num_tokens", "decode_hit_tokens", "decode_pull_tokens", "remote_num_tokens", "prefill_compute_tokens", "num_prefill_pools_in_scope", "num_decode_pools_in_scope", "held_request_id")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PULL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_POOLS_IN_SCOPE_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_POOLS_IN_SCOPE_FIELD_NUMBER: _ClassVar[int]
    HELD_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    prefill: _containers.RepeatedCompositeFieldContainer[_lookup_pb2.PoolHit]
    decode: _containers.RepeatedCompositeFieldContainer[_lookup_pb2.PoolHit]
    skipped: _containers.RepeatedCompositeFieldContainer[_lookup_pb2.SkippedPool]
    num_tokens: int
    decode_hit_tokens: int
    decode_pull_tokens: int
    remote_num_tokens: int
    prefill_compute_tokens: int
    num_prefill_pools_in_scope: int
    num_decode_pools_in_scope: int
    held_request_id: str
    def __init__(self, prefill: _Optional[_Iterable[_Union[_lookup_pb2.PoolHit, _Mapping]]] = ..., decode: _Optional[_Iterable[_Union[_lookup_pb2.PoolHit, _Mapping]]] = ..., skipped: _Optional[_Iterable[_Union[_lookup_pb2.SkippedPool, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., decode_hit_tokens: _Optional[int] = ..., decode_pull_tokens: _Optional[int] = ..., remote_num_tokens: _Optional[int] = ..., prefill_compute_tokens: _Optional[int] = ..., num_prefill_pools_in_scope: _Optional[int] = ..., num_decode_pools_in_scope: _Optional[int] = ..., held_request_id: _Optional[str] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("pool_id", "transfer_id", "state", "record_only", "request_key", "request_id", "num_tokens", "source_blocks", "lease_s", "lease_remaining_s", "destination_pool_id", "hit_tokens", "pull_tokens", "hit_blocks", "pull_blocks", "blocks_pulled", "started_at", "ended_at", "reason", "block_size", "source_freed", "pool_epoch")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RECORD_ONLY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FREED_FIELD_NUMBER: _ClassVar[int]
    POOL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    transfer_id: str
    state: TransferState
    record_only: bool
    request_key: int
    request_id: str
    num_tokens: int
    source_blocks: _common_pb2.GroupedBlockIds
    lease_s: float
    lease_remaining_s: float
    destination_pool_id: str
    hit_tokens: int
    pull_tokens: int
    hit_blocks: int
    pull_blocks: int
    blocks_pulled: int
    started_at: float
    ended_at: float
    reason: str
    block_size: int
    source_freed: bool
    pool_epoch: int
    def __init__(self, pool_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., record_only: _Optional[bool] = ..., request_key: _Optional[int] = ..., request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., source_blocks: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ..., lease_s: _Optional[float] = ..., lease_remaining_s: _Optional[float] = ..., destination_pool_id: _Optional[str] = ..., hit_tokens: _Optional[int] = ..., pull_tokens: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., pull_blocks: _Optional[int] = ..., blocks_pulled: _Optional[int] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., reason: _Optional[str] = ..., block_size: _Optional[int] = ..., source_freed: _Optional[bool] = ..., pool_epoch: _Optional[int] = ...) -> None: ...

class HoldSourceRequest(_message.Message):
    __slots__ = ("pool_id", "transfer_id", "request_key", "lease_s", "record_only", "request_id", "num_tokens", "source_blocks")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    RECORD_ONLY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    transfer_id: str
    request_key: int
    lease_s: float
    record_only: bool
    request_id: str
    num_tokens: int
    source_blocks: _common_pb2.GroupedBlockIds
    def __init__(self, pool_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., request_key: _Optional[int] = ..., lease_s: _Optional[float] = ..., record_only: _Optional[bool] = ..., request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., source_blocks: _Optional[_Union[_common_pb2.GroupedBlockIds, _Mapping]] = ...) -> None: ...

class HoldSourceResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class PlanTransferRequest(_message.Message):
    __slots__ = ("pool_id", "transfer_id", "destination_pool_id", "hit_tokens", "pull_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    transfer_id: str
    destination_pool_id: str
    hit_tokens: int
    pull_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., destination_pool_id: _Optional[str] = ..., hit_tokens: _Optional[int] = ..., pull_tokens: _Optional[int] = ...) -> None: ...

class PlanTransferResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class CommitTransferRequest(_message.Message):
    __slots__ = ("pool_id", "transfer_id", "blocks_pulled")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    transfer_id: str
    blocks_pulled: int
    def __init__(self, pool_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., blocks_pulled: _Optional[int] = ...) -> None: ...

class CommitTransferResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class ReleaseTransferRequest(_message.Message):
    __slots__ = ("pool_id", "transfer_id", "reason")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    transfer_id: str
    reason: str
    def __init__(self, pool_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseTransferResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class ExpireTransferRequest(_message.Message):
    __slots__ = ("pool_id", "transfer_id", "reason", "source_freed")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FREED_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    transfer_id: str
    reason: str
    source_freed: bool
    def __init__(self, pool_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., reason: _Optional[str] = ..., source_freed: _Optional[bool] = ...) -> None: ...

class ExpireTransferResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class DescribeTransferRequest(_message.Message):
    __slots__ = ("pool_id", "transfer_id")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    transfer_id: str
    def __init__(self, pool_id: _Optional[str] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class DescribeTransferResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class ListTransfersRequest(_message.Message):
    __slots__ = ("pool_id", "states")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    states: _containers.RepeatedScalarFieldContainer[TransferState]
    def __init__(self, pool_id: _Optional[str] = ..., states: _Optional[_Iterable[_Union[TransferState, str]]] = ...) -> None: ...

class ListTransfersResponse(_message.Message):
    __slots__ = ("transfers",)
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    def __init__(self, transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ...) -> None: ...
