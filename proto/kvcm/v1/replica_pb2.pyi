from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICATION_MODE_UNSPECIFIED: _ClassVar[ReplicationMode]
    REPLICATION_MODE_SYNC: _ClassVar[ReplicationMode]
    REPLICATION_MODE_ASYNC: _ClassVar[ReplicationMode]

class ShipStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHIP_STATUS_UNSPECIFIED: _ClassVar[ShipStatus]
    SHIP_STATUS_OK: _ClassVar[ShipStatus]
    SHIP_STATUS_STALE_EPOCH: _ClassVar[ShipStatus]
    SHIP_STATUS_NEED_SEED: _ClassVar[ShipStatus]
    SHIP_STATUS_DIGEST_MISMATCH: _ClassVar[ShipStatus]
    SHIP_STATUS_NOT_STANDBY: _ClassVar[ShipStatus]
REPLICATION_MODE_UNSPECIFIED: ReplicationMode
REPLICATION_MODE_SYNC: ReplicationMode
REPLICATION_MODE_ASYNC: ReplicationMode
SHIP_STATUS_UNSPECIFIED: ShipStatus
SHIP_STATUS_OK: ShipStatus
SHIP_STATUS_STALE_EPOCH: ShipStatus
SHIP_STATUS_NEED_SEED: ShipStatus
SHIP_STATUS_DIGEST_MISMATCH: ShipStatus
SHIP_STATUS_NOT_STANDBY: ShipStatus

class ReplicaRecord(_message.Message):
    __slots__ = ("method", "request", "time", "pool_epoch")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    POOL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    method: str
    request: bytes
    time: float
    pool_epoch: int
    def __init__(self, method: _Optional[str] = ..., request: _Optional[bytes] = ..., time: _Optional[float] = ..., pool_epoch: _Optional[int] = ...) -> None: ...

class ReplicaSeed(_message.Message):
    __slots__ = ("config", "data", "last", "pool_epoch", "kv_event_base", "exists", "transfers")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    POOL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_EVENT_BASE_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    config: bytes
    data: bytes
    last: bool
    pool_epoch: int
    kv_event_base: int
    exists: bool
    transfers: bytes
    def __init__(self, config: _Optional[bytes] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., pool_epoch: _Optional[int] = ..., kv_event_base: _Optional[int] = ..., exists: _Optional[bool] = ..., transfers: _Optional[bytes] = ...) -> None: ...

class ShipRecordsRequest(_message.Message):
    __slots__ = ("pool_id", "placement_epoch", "seq", "record", "seed", "digest")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    placement_epoch: int
    seq: int
    record: ReplicaRecord
    seed: ReplicaSeed
    digest: bytes
    def __init__(self, pool_id: _Optional[str] = ..., placement_epoch: _Optional[int] = ..., seq: _Optional[int] = ..., record: _Optional[_Union[ReplicaRecord, _Mapping]] = ..., seed: _Optional[_Union[ReplicaSeed, _Mapping]] = ..., digest: _Optional[bytes] = ...) -> None: ...

class ShipRecordsResponse(_message.Message):
    __slots__ = ("pool_id", "placement_epoch", "seq", "status", "detail")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    placement_epoch: int
    seq: int
    status: ShipStatus
    detail: str
    def __init__(self, pool_id: _Optional[str] = ..., placement_epoch: _Optional[int] = ..., seq: _Optional[int] = ..., status: _Optional[_Union[ShipStatus, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class SetPlacementRequest(_message.Message):
    __slots__ = ("pool_id", "primary", "standby", "placement_epoch", "mode")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    primary: str
    standby: str
    placement_epoch: int
    mode: ReplicationMode
    def __init__(self, pool_id: _Optional[str] = ..., primary: _Optional[str] = ..., standby: _Optional[str] = ..., placement_epoch: _Optional[int] = ..., mode: _Optional[_Union[ReplicationMode, str]] = ...) -> None: ...

class SetPlacementResponse(_message.Message):
    __slots__ = ("role", "placement_epoch")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    role: str
    placement_epoch: int
    def __init__(self, role: _Optional[str] = ..., placement_epoch: _Optional[int] = ...) -> None: ...

class GetReplicaStateRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class GetReplicaStateResponse(_message.Message):
    __slots__ = ("role", "placement_epoch", "seq", "acked_seq", "digest", "mode", "digest_checks", "digest_mismatches", "has_copy")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_CHECKS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    HAS_COPY_FIELD_NUMBER: _ClassVar[int]
    role: str
    placement_epoch: int
    seq: int
    acked_seq: int
    digest: bytes
    mode: ReplicationMode
    digest_checks: int
    digest_mismatches: int
    has_copy: bool
    def __init__(self, role: _Optional[str] = ..., placement_epoch: _Optional[int] = ..., seq: _Optional[int] = ..., acked_seq: _Optional[int] = ..., digest: _Optional[bytes] = ..., mode: _Optional[_Union[ReplicationMode, str]] = ..., digest_checks: _Optional[int] = ..., digest_mismatches: _Optional[int] = ..., has_copy: _Optional[bool] = ...) -> None: ...
