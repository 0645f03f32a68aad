from kvcm.v1 import lookup_pb2 as _lookup_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
