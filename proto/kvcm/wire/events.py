"""KV-cache events on the wire, both ways.

The core publishes vLLM's external hashes (ints, the low 64 bits of each block hash); they
travel as ``hash_length_bytes``-byte big-endian values concatenated in one ``bytes`` field,
and :func:`kvcm.common.hashing.external_block_hash` reads each back to the same int.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcm.common.hashing import external_block_hash
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
        events: The events with vLLM's field names; hashes in vLLM's int form (low 64 bits).
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
def _hashes_to_bytes(hashes: Sequence[int], length: int) -> bytes:
    return b"".join(value.to_bytes(length, "big") for value in hashes)


def _stored_to_proto(event: BlockStored, message: events_pb2.KVEvent, length: int) -> None:
    stored = message.block_stored
    stored.block_hashes = _hashes_to_bytes(event.block_hashes, length)
    if event.parent_block_hash is not None:
        stored.parent_block_hash = event.parent_block_hash.to_bytes(length, "big")
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


def events_to_proto(events: Sequence[KVCacheEvent], hash_length: int) -> list[events_pb2.KVEvent]:
    """Wire events of core events.

    Args:
        events: The events, hashes in vLLM's int form.
        hash_length: Bytes per hash on the wire (the pool's ``hash_length_bytes``).
    """
    out: list[events_pb2.KVEvent] = []
    for event in events:
        message = events_pb2.KVEvent()
        if isinstance(event, BlockStored):
            _stored_to_proto(event, message, hash_length)
        elif isinstance(event, BlockRemoved):
            removed = message.block_removed
            removed.block_hashes = _hashes_to_bytes(event.block_hashes, hash_length)
            removed.medium = medium_to_proto(event.medium)  # type: ignore[assignment]
            if event.group_idx is not None:
                removed.group_idx = event.group_idx
        else:
            message.all_blocks_cleared.SetInParent()
        out.append(message)
    return out


# ----------------------------------------------------------------------------- decode
def _split_hashes(raw: bytes, hash_length_bytes: int) -> list[int]:
    if not raw:
        return []
    step = hash_length_bytes or len(raw)
    return [external_block_hash(raw[i : i + step]) for i in range(0, len(raw), step)]


def event_from_proto(message: events_pb2.KVEvent, hash_length_bytes: int) -> KVCacheEvent:
    """The core event of a wire event (hashes read back to vLLM's int form)."""
    kind = message.WhichOneof("event")
    if kind == "block_stored":
        stored = message.block_stored
        return BlockStored(
            block_hashes=_split_hashes(stored.block_hashes, hash_length_bytes),
            parent_block_hash=(
                external_block_hash(stored.parent_block_hash)
                if stored.HasField("parent_block_hash")
                else None
            ),
            token_ids=list(stored.token_ids),
            block_size=stored.block_size,
            lora_id=stored.lora_id if stored.HasField("lora_id") else None,
            medium=medium_from_proto(stored.medium),
            lora_name=stored.lora_name if stored.HasField("lora_name") else None,
            group_idx=stored.group_idx if stored.HasField("group_idx") else None,
            kv_cache_spec_kind=spec_kind_from_proto(stored.kv_cache_spec_kind),
            kv_cache_spec_sliding_window=(
                stored.kv_cache_spec_sliding_window
                if stored.HasField("kv_cache_spec_sliding_window")
                else None
            ),
        )
    if kind == "block_removed":
        removed = message.block_removed
        return BlockRemoved(
            block_hashes=_split_hashes(removed.block_hashes, hash_length_bytes),
            medium=medium_from_proto(removed.medium),
            group_idx=removed.group_idx if removed.HasField("group_idx") else None,
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
