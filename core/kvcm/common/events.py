"""KV-cache events: what a pool tells routers and indexers about its prefix cache.

The records carry vLLM 0.33.0's field names and meanings (``vllm.distributed.kv_events``), so a
consumer written for vLLM's event stream reads kvcm's unchanged. Block hashes are full width: the
block's digest as ``bytes`` (vLLM's form with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); an
edge that publishes vLLM's default int form converts each with
:func:`kvcm.common.hashing.external_block_hash` (the low 64 bits), so nothing is lost in the
core and the conversion costs nothing on the allocation path.

A pool emits, in order of the changes it makes:

* :class:`BlockStored` when blocks enter the prefix cache (one event per cache call, covering a
  run of consecutive blocks of one group),
* :class:`BlockRemoved` when a cached block loses a hash (evicted for reuse, evicted by id, or
  replaced by a longer entry of the same block),
* :class:`AllBlocksCleared` when the whole prefix cache is reset.

The records are frozen and slotted; list fields are never mutated after construction.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Final, TypeAlias

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
]

MEDIUM_GPU: Final = "GPU"
"""Medium of blocks held in accelerator memory (every block a kvcm pool manages)."""
MEDIUM_CPU: Final = "CPU"
"""Medium of blocks offloaded to host memory."""
MEDIUM_STORAGE: Final = "STORAGE"
"""Medium of blocks offloaded to storage."""


def _tuple_or_none(value: list[Any] | None) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """A run of consecutive full blocks of one group entered the prefix cache.

    Attributes:
        block_hashes: Digests of the stored blocks, in token order. Blocks the
            group does not cache (null or masked-out sliding-window blocks) are left out.
        parent_block_hash: Digest of the block before the run; ``None`` at the start
            of a sequence.
        token_ids: Token ids of the whole run, skipped blocks included.
        block_size: Tokens per block of the group.
        lora_id: Integer id of the request's LoRA adapter (kept for vLLM compatibility; the
            hash uses ``lora_name``).
        medium: Where the blocks live (:data:`MEDIUM_GPU` for a kvcm pool).
        lora_name: Name of the request's LoRA adapter, if any.
        extra_keys: One entry per stored block: the untagged extra keys of its hash (LoRA
            name, ``(mm_identifier, offset)`` pairs, cache salt, prompt-embeds digest), or
            ``None`` for a block without any.
        group_idx: The KV-cache group of the blocks.
        kv_cache_spec_kind: Attention kind of the group, annotated by the manager.
        kv_cache_spec_sliding_window: Window of a sliding-window group, annotated likewise.
        locality: ``LOCAL`` or ``REMOTE`` relative to the publisher; ``None``: unspecified.
        ownership: Identifier of a secondary offloading tier that produced the event.
        session_id: Session of the request that triggered the store.
        lookahead_token_ids: Per stored block, the tokens after it that its hash covers;
            ``None`` unless lookahead hashing is on.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None

    def __hash__(self) -> int:
        """Hash over every field, lists as tuples (events are counted across workers)."""
        return hash(
            (
                tuple(self.block_hashes),
                self.parent_block_hash,
                tuple(self.token_ids),
                self.block_size,
                self.lora_id,
                self.medium,
                self.lora_name,
                _tuple_or_none(self.extra_keys),
                self.group_idx,
                self.kv_cache_spec_kind,
                self.kv_cache_spec_sliding_window,
                self.locality,
                self.ownership,
                self.session_id,
                None
                if self.lookahead_token_ids is None
                else tuple(tuple(ids) for ids in self.lookahead_token_ids),
            )
        )


# Each BlockStored field's slot, in field order (new_block_stored's parameters), set directly
# (the frozen dataclass's __init__ goes through object.__setattr__ by name, field by field:
# ~3 us per event, on the allocation path).
_STORED_SLOTS = tuple(getattr(BlockStored, f.name).__set__ for f in fields(BlockStored))
assert len(_STORED_SLOTS) == len(BlockStored.__slots__)  # every slot is a field


def new_block_stored(  # noqa: PLR0917 (one per field, positional for speed)
    block_hashes: list[bytes],
    parent_block_hash: bytes | None,
    token_ids: list[int],
    block_size: int,
    lora_id: int | None,
    medium: str | None,
    lora_name: str | None,
    extra_keys: list[tuple[Any, ...] | None] | None,
    group_idx: int | None,
    kv_cache_spec_kind: str | None,
    kv_cache_spec_sliding_window: int | None,
    session_id: str | None,
    lookahead_token_ids: list[list[int]] | None,
) -> BlockStored:
    """A :class:`BlockStored` equal to the one its constructor makes from the same values
    (``locality`` and ``ownership`` unset), made without the frozen constructor's per-field
    ``object.__setattr__``: the block pool makes one per cache call."""
    (
        set_hashes,
        set_parent,
        set_tokens,
        set_size,
        set_lora_id,
        set_medium,
        set_lora_name,
        set_extra_keys,
        set_group,
        set_kind,
        set_window,
        set_locality,
        set_ownership,
        set_session,
        set_lookahead,
    ) = _STORED_SLOTS
    event = object.__new__(BlockStored)
    set_hashes(event, block_hashes)
    set_parent(event, parent_block_hash)
    set_tokens(event, token_ids)
    set_size(event, block_size)
    set_lora_id(event, lora_id)
    set_medium(event, medium)
    set_lora_name(event, lora_name)
    set_extra_keys(event, extra_keys)
    set_group(event, group_idx)
    set_kind(event, kv_cache_spec_kind)
    set_window(event, kv_cache_spec_sliding_window)
    set_locality(event, None)
    set_ownership(event, None)
    set_session(event, session_id)
    set_lookahead(event, lookahead_token_ids)
    return event


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    """Cached blocks lost their hash (evicted, or replaced by a longer entry).

    Attributes:
        block_hashes: Digests removed; a pool removes one per event.
        medium: Where the blocks lived.
        group_idx: The KV-cache group of the blocks.
        locality: ``LOCAL`` or ``REMOTE`` relative to the publisher; ``None``: unspecified.
        ownership: Identifier of a secondary offloading tier that produced the event.
    """

    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __hash__(self) -> int:
        """Hash over every field, the hash list as a tuple."""
        return hash(
            (tuple(self.block_hashes), self.medium, self.group_idx, self.locality, self.ownership)
        )


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: every previously stored block is gone."""


KVCacheEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
"""Any event a pool emits."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KVEventBatch:
    """Events published together, as vLLM's publisher batches them.

    Attributes:
        ts: Wall-clock time of publication, seconds since the epoch (set by the publisher;
            the core never reads clocks).
        events: The events, in the order the pool emitted them.
        data_parallel_rank: Data-parallel rank of the engine, if any.
    """

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None
