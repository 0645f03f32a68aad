from kvcm.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("pool_id", "rank", "world_size", "layer_specs", "available_memory_bytes")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_SPECS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    rank: int
    world_size: int
    layer_specs: _containers.RepeatedCompositeFieldContainer[_common_pb2.LayerSpec]
    available_memory_bytes: int
    def __init__(self, pool_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., layer_specs: _Optional[_Iterable[_Union[_common_pb2.LayerSpec, _Mapping]]] = ..., available_memory_bytes: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("kv_cache_config", "hashing", "max_model_len")
    KV_CACHE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    HASHING_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    kv_cache_config: _common_pb2.KVCacheConfig
    hashing: _common_pb2.HashingParameters
    max_model_len: int
    def __init__(self, kv_cache_config: _Optional[_Union[_common_pb2.KVCacheConfig, _Mapping]] = ..., hashing: _Optional[_Union[_common_pb2.HashingParameters, _Mapping]] = ..., max_model_len: _Optional[int] = ...) -> None: ...
