"""Every enum table between kvcm's values and ``kvcm.v1`` enum values, in one place.

Encoding never fails for a member of the Python enum; decoding an unknown wire value raises
:class:`~kvcm.common.errors.InvalidArgumentError` naming the field
(``"config.hash_algorithm: unknown value 7"``). UNSPECIFIED (0) decodes to the documented
default where the .proto gives one, else it is an unknown value too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar

from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from kvcm.common.hashing import HashAlgorithm
from kvcm.core.pool_types import FreeMode, PoolState
from kvcm.core.program import ItemStatus
from kvcm.v1 import admin_pb2, common_pb2, events_pb2, scheduler_pb2

__all__ = [
    "DTYPE_TO_PROTO",
    "FREE_MODE_TO_PROTO",
    "HASH_ALGORITHM_TO_PROTO",
    "ITEM_STATUS_TO_PROTO",
    "MEDIUM_TO_PROTO",
    "POOL_STATE_TO_PROTO",
    "SPEC_KIND_TO_PROTO",
    "decode_enum",
    "dtype_from_proto",
    "dtype_to_proto",
    "free_mode_from_proto",
    "hash_algorithm_from_proto",
    "hash_algorithm_to_proto",
    "item_status_from_proto",
    "medium_from_proto",
    "medium_to_proto",
    "pool_state_from_proto",
    "pool_state_to_proto",
    "spec_kind_from_proto",
    "spec_kind_to_proto",
]

_V = TypeVar("_V")

HASH_ALGORITHM_TO_PROTO: Final[Mapping[HashAlgorithm, int]] = {
    HashAlgorithm.SHA256: common_pb2.HASH_ALGORITHM_SHA256,
    HashAlgorithm.SHA256_CBOR: common_pb2.HASH_ALGORITHM_SHA256_CBOR,
    HashAlgorithm.XXHASH: common_pb2.HASH_ALGORITHM_XXHASH,
    HashAlgorithm.XXHASH_CBOR: common_pb2.HASH_ALGORITHM_XXHASH_CBOR,
}
DTYPE_TO_PROTO: Final[Mapping[DType, int]] = {
    DType.FLOAT16: common_pb2.DATA_TYPE_FLOAT16,
    DType.BFLOAT16: common_pb2.DATA_TYPE_BFLOAT16,
    DType.FLOAT32: common_pb2.DATA_TYPE_FLOAT32,
    DType.FLOAT8_E4M3FN: common_pb2.DATA_TYPE_FLOAT8_E4M3FN,
    DType.FLOAT8_E5M2: common_pb2.DATA_TYPE_FLOAT8_E5M2,
    DType.UINT8: common_pb2.DATA_TYPE_UINT8,
    DType.INT8: common_pb2.DATA_TYPE_INT8,
}
# Event spec kinds travel as vLLM's kind strings on the Python side.
SPEC_KIND_TO_PROTO: Final[Mapping[str, int]] = {
    "full_attention": common_pb2.KV_CACHE_SPEC_KIND_FULL_ATTENTION,
    "mla_attention": common_pb2.KV_CACHE_SPEC_KIND_MLA_ATTENTION,
    "sliding_window": common_pb2.KV_CACHE_SPEC_KIND_SLIDING_WINDOW,
    "mamba": common_pb2.KV_CACHE_SPEC_KIND_MAMBA,
    "chunked_local_attention": common_pb2.KV_CACHE_SPEC_KIND_CHUNKED_LOCAL_ATTENTION,
    "sink_full_attention": common_pb2.KV_CACHE_SPEC_KIND_SINK_FULL_ATTENTION,
    "encoder_only_attention": common_pb2.KV_CACHE_SPEC_KIND_ENCODER_ONLY_ATTENTION,
    "cross_attention": common_pb2.KV_CACHE_SPEC_KIND_CROSS_ATTENTION,
}
MEDIUM_TO_PROTO: Final[Mapping[str, int]] = {
    MEDIUM_GPU: events_pb2.MEDIUM_GPU,
    MEDIUM_CPU: events_pb2.MEDIUM_CPU,
    MEDIUM_STORAGE: events_pb2.MEDIUM_STORAGE,
}
POOL_STATE_TO_PROTO: Final[Mapping[PoolState, int]] = {
    PoolState.PENDING_WORKERS: admin_pb2.POOL_STATE_PENDING_WORKERS,
    PoolState.READY: admin_pb2.POOL_STATE_READY,
}
ITEM_STATUS_TO_PROTO: Final[Mapping[ItemStatus, int]] = {
    status: int(status) for status in ItemStatus
}
FREE_MODE_TO_PROTO: Final[Mapping[FreeMode, int]] = {
    FreeMode.FINISHED: scheduler_pb2.FREE_MODE_FINISHED,
    FreeMode.PREEMPTED: scheduler_pb2.FREE_MODE_PREEMPTED,
}


def _invert(table: Mapping[_V, int]) -> dict[int, _V]:
    return {wire: value for value, wire in table.items()}


_HASH_ALGORITHM_FROM_PROTO: Final = {
    common_pb2.HASH_ALGORITHM_UNSPECIFIED: HashAlgorithm.SHA256,  # the .proto's default
    **_invert(HASH_ALGORITHM_TO_PROTO),
}
_DTYPE_FROM_PROTO: Final = _invert(DTYPE_TO_PROTO)
_SPEC_KIND_FROM_PROTO: Final = _invert(SPEC_KIND_TO_PROTO)
_MEDIUM_FROM_PROTO: Final = _invert(MEDIUM_TO_PROTO)
_POOL_STATE_FROM_PROTO: Final = {
    admin_pb2.POOL_STATE_UNSPECIFIED: PoolState.PENDING_WORKERS,
    **_invert(POOL_STATE_TO_PROTO),
}
_ITEM_STATUS_FROM_PROTO: Final = _invert(ITEM_STATUS_TO_PROTO)
_FREE_MODE_FROM_PROTO: Final = _invert(FREE_MODE_TO_PROTO)


def decode_enum(table: Mapping[int, _V], value: int, field: str) -> _V:
    """``table[value]``, or an error naming ``field`` when the wire value is unknown.

    Raises:
        InvalidArgumentError: ``value`` is not in ``table``.
    """
    try:
        return table[value]
    except KeyError:
        raise InvalidArgumentError(f"{field}: unknown value {value}", field=field) from None


def hash_algorithm_to_proto(algorithm: HashAlgorithm | str) -> int:
    """The wire value of a hash algorithm (a member or its name).

    Raises:
        InvalidArgumentError: ``algorithm`` names no algorithm.
    """
    try:
        return HASH_ALGORITHM_TO_PROTO[HashAlgorithm(algorithm)]
    except ValueError:
        known = [a.value for a in HashAlgorithm]
        raise InvalidArgumentError(
            f"hash_algorithm must be one of {known}, got {algorithm!r}", field="hash_algorithm"
        ) from None


def hash_algorithm_from_proto(value: int, field: str = "hash_algorithm") -> HashAlgorithm:
    """The hash algorithm of a wire value (UNSPECIFIED: sha256)."""
    return decode_enum(_HASH_ALGORITHM_FROM_PROTO, value, field)


def dtype_to_proto(dtype: DType | str, field: str = "dtype") -> int:
    """The wire value of an element type.

    Raises:
        InvalidArgumentError: The type has no wire form.
    """
    try:
        return DTYPE_TO_PROTO[DType(dtype)]
    except (KeyError, ValueError):
        raise InvalidArgumentError(f"{field}: {dtype!r} has no wire form", field=field) from None


def dtype_from_proto(value: int, field: str = "dtype") -> DType:
    """The element type of a wire value."""
    return decode_enum(_DTYPE_FROM_PROTO, value, field)


def spec_kind_to_proto(kind: str | None) -> int:
    """The wire value of an event's spec kind (``None`` or unknown: UNSPECIFIED)."""
    return SPEC_KIND_TO_PROTO.get(kind or "", common_pb2.KV_CACHE_SPEC_KIND_UNSPECIFIED)


def spec_kind_from_proto(value: int) -> str | None:
    """An event's spec kind (UNSPECIFIED or newer kinds: ``None``, events are advisory)."""
    return _SPEC_KIND_FROM_PROTO.get(value)


def medium_to_proto(medium: str | None) -> int:
    """The wire value of an event's medium (``None`` or unknown: UNSPECIFIED)."""
    return MEDIUM_TO_PROTO.get(medium or "", events_pb2.MEDIUM_UNSPECIFIED)


def medium_from_proto(value: int) -> str | None:
    """An event's medium (UNSPECIFIED or newer media: ``None``)."""
    return _MEDIUM_FROM_PROTO.get(value)


def pool_state_to_proto(state: PoolState) -> int:
    """The wire value of a pool state."""
    return POOL_STATE_TO_PROTO[state]


def pool_state_from_proto(value: int, field: str = "state") -> PoolState:
    """The pool state of a wire value (UNSPECIFIED: PENDING_WORKERS)."""
    return decode_enum(_POOL_STATE_FROM_PROTO, value, field)


def item_status_from_proto(value: int, field: str = "status") -> ItemStatus:
    """The item status of a wire value."""
    return decode_enum(_ITEM_STATUS_FROM_PROTO, value, field)


def free_mode_from_proto(value: int, field: str = "mode") -> FreeMode:
    """The free mode of a wire value (UNSPECIFIED is refused: a free must say which).

    Raises:
        InvalidArgumentError: UNSPECIFIED or unknown; the message names ``field``.
    """
    return decode_enum(_FREE_MODE_FROM_PROTO, value, field)
