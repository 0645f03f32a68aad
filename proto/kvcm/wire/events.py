"""KV-cache events on the wire, both ways.

The core publishes full block hashes (digests, ``bytes``); they travel concatenated in one
``bytes`` field, ``hash_length_bytes`` each, and come back as the same ``bytes``. (A pool
restored from a snapshot written before hashes were kept full width may still hold vLLM's
64-bit ints in its old events; those travel as their 8 big-endian bytes.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcm.v1 import events_pb2
from kvcm.wire.enums import (
    medium_from_proto,
    medium_to_proto,
    spec_kind_from_proto,
    spec_kind_to_proto,
)

__all__ = [
    "EventBatch",
    "decode_event_batch",
    "event_from_proto",
    "events_to_proto",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class EventBatch:
    """Consecutive events of one pool, as one stream message carried them.

    Attributes:
        first_sequence: Sequence number of ``events[0]`` (of the next event when empty).
        events: The events with vLLM's field names; hashes full width (``bytes``).
        timestamp_unix_seconds: When the server published them.
        oldest_sequence: Oldest sequence still kept for resuming (first message only, else 0).
        pool_epoch: The pool's epoch (its incarnation): resume with it as ``expected_epoch``.
    """

    first_sequence: int
    events: list[KVCacheEvent]
    timestamp_unix_seconds: float
    oldest_sequence: int = 0
    pool_epoch: int = 0

    @property
    def last_sequence(self) -> int:
        """Sequence number of the last event (``first_sequence - 1`` when empty)."""
        return self.first_sequence + len(self.events) - 1


# ----------------------------------------------------------------------------- encode
def _hash_bytes(value: bytes | int) -> bytes:
    return value if isinstance(value, bytes) else value.to_bytes(8, "big")


def _hashes_to_bytes(hashes: Sequence[bytes | int]) -> bytes:
    return b"".join([_hash_bytes(value) for value in hashes])


def _extra_key_to_proto(key: Any, out: events_pb2.ExtraKey) -> None:
    if isinstance(key, str):
        out.text = key
    elif isinstance(key, bytes):
        out.data = key
    elif isinstance(key, tuple) and len(key) == 2:
        out.mm.identifier = str(key[0])
        out.mm.offset = int(key[1])
    elif isinstance(key, int):
        out.integer = key
    else:
        raise TypeError(f"extra key {key!r} has no wire form")


def _extra_keys_to_proto(
    extra_keys: Sequence[tuple[Any, ...] | None], out: events_pb2.ExtraKeysList
) -> None:
    out.SetInParent()
    for keys in extra_keys:
        block = out.blocks.add()
        for key in keys or ():
            _extra_key_to_proto(key, block.keys.add())


def _stored_to_proto(event: BlockStored, message: events_pb2.KVEvent) -> None:
    stored = message.block_stored
    stored.block_hashes = _hashes_to_bytes(event.block_hashes)
    if event.parent_block_hash is not None:
        stored.parent_block_hash = _hash_bytes(event.parent_block_hash)
    stored.token_ids.extend(event.token_ids)
    stored.block_size = event.block_size
    if event.lora_id is not None:
        stored.lora_id = event.lora_id
    if event.lora_name is not None:
        stored.lora_name = event.lora_name
    stored.medium = medium_to_proto(event.medium)  # type: ignore[assignment]
    if event.group_idx is not None:
        stored.group_idx = event.group_idx
    stored.kv_cache_spec_kind = spec_kind_to_proto(event.kv_cache_spec_kind)  # type: ignore[assignment]
    if event.kv_cache_spec_sliding_window is not None:
        stored.kv_cache_spec_sliding_window = event.kv_cache_spec_sliding_window
    if event.extra_keys is not None:
        _extra_keys_to_proto(event.extra_keys, stored.extra_keys)
    if event.locality is not None:
        stored.locality = event.locality
    if event.ownership is not None:
        stored.ownership = event.ownership
    if event.session_id is not None:
        stored.session_id = event.session_id
    if event.lookahead_token_ids is not None:
        stored.has_lookahead_token_ids = True
        for ids in event.lookahead_token_ids:
            stored.lookahead_token_ids.add().token_ids.extend(ids)


def events_to_proto(events: Sequence[KVCacheEvent]) -> list[events_pb2.KVEvent]:
    """Wire events of core events (hashes full width, see the module docstring)."""
    out: list[events_pb2.KVEvent] = []
    for event in events:
        message = events_pb2.KVEvent()
        if isinstance(event, BlockStored):
            _stored_to_proto(event, message)
        elif isinstance(event, BlockRemoved):
            removed = message.block_removed
            removed.block_hashes = _hashes_to_bytes(event.block_hashes)
            removed.medium = medium_to_proto(event.medium)  # type: ignore[assignment]
            if event.group_idx is not None:
                removed.group_idx = event.group_idx
            if event.locality is not None:
                removed.locality = event.locality
            if event.ownership is not None:
                removed.ownership = event.ownership
        else:
            message.all_blocks_cleared.SetInParent()
        out.append(message)
    return out


# ----------------------------------------------------------------------------- decode
def _split_hashes(raw: bytes, hash_length_bytes: int) -> list[bytes]:
    if not raw:
        return []
    step = hash_length_bytes or len(raw)
    return [raw[i : i + step] for i in range(0, len(raw), step)]


def _extra_key_from_proto(key: events_pb2.ExtraKey) -> Any:
    kind = key.WhichOneof("key")
    if kind == "mm":
        return (key.mm.identifier, key.mm.offset)
    return getattr(key, kind) if kind is not None else None


def _extra_keys_from_proto(
    stored: events_pb2.BlockStored,
) -> list[tuple[Any, ...] | None] | None:
    if not stored.HasField("extra_keys"):
        return None
    return [
        tuple(_extra_key_from_proto(key) for key in block.keys) if block.keys else None
        for block in stored.extra_keys.blocks
    ]


def _optional(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


def event_from_proto(message: events_pb2.KVEvent, hash_length_bytes: int) -> KVCacheEvent:
    """The core event of a wire event (hashes full width)."""
    kind = message.WhichOneof("event")
    if kind == "block_stored":
        stored = message.block_stored
        return BlockStored(
            block_hashes=_split_hashes(stored.block_hashes, hash_length_bytes),
            parent_block_hash=_optional(stored, "parent_block_hash"),
            token_ids=list(stored.token_ids),
            block_size=stored.block_size,
            lora_id=_optional(stored, "lora_id"),
            medium=medium_from_proto(stored.medium),
            lora_name=_optional(stored, "lora_name"),
            group_idx=_optional(stored, "group_idx"),
            kv_cache_spec_kind=spec_kind_from_proto(stored.kv_cache_spec_kind),
            kv_cache_spec_sliding_window=_optional(stored, "kv_cache_spec_sliding_window"),
            extra_keys=_extra_keys_from_proto(stored),
            locality=_optional(stored, "locality"),
            ownership=_optional(stored, "ownership"),
            session_id=_optional(stored, "session_id"),
            lookahead_token_ids=(
                [list(block.token_ids) for block in stored.lookahead_token_ids]
                if stored.has_lookahead_token_ids
                else None
            ),
        )
    if kind == "block_removed":
        removed = message.block_removed
        return BlockRemoved(
            block_hashes=_split_hashes(removed.block_hashes, hash_length_bytes),
            medium=medium_from_proto(removed.medium),
            group_idx=_optional(removed, "group_idx"),
            locality=_optional(removed, "locality"),
            ownership=_optional(removed, "ownership"),
        )
    return AllBlocksCleared()


def decode_event_batch(
    message: events_pb2.SubscribeEventsResponse, hash_length_bytes: int
) -> EventBatch:
    """Decode one ``SubscribeEventsResponse``.

    Args:
        message: The stream message.
        hash_length_bytes: Bytes per hash (from the stream's first message).
    """
    return EventBatch(
        first_sequence=message.first_sequence,
        events=[event_from_proto(event, hash_length_bytes) for event in message.events],
        timestamp_unix_seconds=message.timestamp_unix_seconds,
        oldest_sequence=message.oldest_sequence,
        pool_epoch=message.pool_epoch,
    )
