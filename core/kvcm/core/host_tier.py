"""The host tier: a second block pool in host memory behind a pool's device blocks.

A pool created with a host byte budget (``PoolConfig.host_tier_bytes``) keeps a
:class:`HostTier` of ``budget // bytes_per_block`` host blocks. It is an index and an
allocator, like the device :class:`~kvcm.core.block_pool.BlockPool`: it decides which host
block holds what and answers the copies the workers make; it moves no bytes.

* **Demotion.** A cached device block that the device pool evicts to reuse it (vLLM's
  ``get_new_blocks`` taking a free cached block) is demoted instead of lost: its key is stored
  in a host block and a device-to-host copy ``(device_block_id, host_block_id)`` is recorded.
  Blocks dropped by id (``evict_blocks``: their contents are bad) and a prefix-cache reset are
  not demoted. A key the tier already holds is only touched (no copy).
* **Eviction.** Keyed host blocks are kept in recency order; the least recent one that is
  neither pinned nor pending is evicted first. A block is used when it is stored, touched or
  loaded; pins do not change recency (vLLM's LRU keeps recency apart from transfer pins too).
  ``touch`` of a request's keys in prefix order leaves the head most recent, so a request's
  tail goes before its head (as in vLLM's LRU).
* **Loads.** A request whose prefix continues in the tier after its device hit is admitted
  with those tokens as external computed tokens; its new device blocks for them get
  host-to-device copies ``(host_block_id, device_block_id)``. The host copy stays: a key may
  be in both tiers (the host tier is *inclusive* after a load), so evicting the block from the
  device again costs no copy. A key is never in the host tier twice.
* **Swaps.** ``swap_out`` copies every block of a preempted request (its partial and decode
  blocks included) to pinned host blocks; ``swap_in`` maps them back to the device blocks of
  the re-admitted request and unpins them. A swapped request's host blocks are never evicted.
* **Pending stores** (for vLLM's offloading connector, whose copies complete asynchronously):
  ``store(..., ready=False)`` reserves blocks that are neither loadable nor evictable until
  ``complete_store``.
* **Events.** When events are on, the tier records ``BlockStored`` / ``BlockRemoved`` with
  ``medium="CPU"``, one key per event, in the placeholder form vLLM's offloading connector
  uses (``token_ids=[]``, ``block_size=0``, no parent): the device events already carried
  the tokens.

Copies are ordered for the workers: every device-to-host copy of a step runs before its
host-to-device copies, and all of them before the step's forward pass (a demoted device
block is rewritten by its new owner only after its copy).

Everything here is pure and deterministic: no I/O, no clocks.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError
from kvcm.common.events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from kvcm.common.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

if TYPE_CHECKING:
    from kvcm.core.manager import CacheHit, KVCacheBlocks, KVCacheManager
    from kvcm.core.request import Request

__all__ = [
    "HIT",
    "HOST_TIER_COUNTERS",
    "MISS",
    "PENDING",
    "HostAdmission",
    "SyncAction",
    "HostTier",
    "HostTierStats",
    "admit_with_host_hit",
    "apply_sync",
    "host_hit_tokens",
    "prefix_host_hit_tokens",
    "restore_swapped",
    "swap_in",
    "swap_out",
    "swap_out_tables",
]

MISS: Final = 0
"""``lookup``: the tier does not hold the key."""
HIT: Final = 1
"""``lookup``: the tier holds the key, ready to load."""
PENDING: Final = 2
"""``lookup``: the key's store has not completed."""


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """The tier's state and cumulative counters (for metrics).

    Attributes:
        num_blocks: Host blocks in the tier.
        num_used: Host blocks holding a key or a swapped block.
        num_pinned: Host blocks that cannot be evicted now (loads, swaps, pending stores).
        num_swapped_requests: Requests swapped out now.
        demotions: Device blocks copied to the tier on eviction.
        demotions_present: Evicted device blocks whose key the tier held (no copy).
        demotions_dropped: Evicted device blocks lost because every host block was pinned.
        evictions: Host blocks evicted to make room.
        stores: Blocks stored through ``store`` (vLLM's offloading connector).
        loads: Host-to-device block copies for hits.
        hit_tokens: Tokens admitted from the tier.
        swap_outs: Requests swapped out.
        swap_ins: Requests swapped in.
        swapped_blocks_out: Blocks copied to the tier by swap-outs.
        swapped_blocks_in: Blocks copied back by swap-ins.
    """

    num_blocks: int
    num_used: int
    num_pinned: int
    num_swapped_requests: int
    demotions: int
    demotions_present: int
    demotions_dropped: int
    evictions: int
    stores: int
    loads: int
    hit_tokens: int
    swap_outs: int
    swap_ins: int
    swapped_blocks_out: int
    swapped_blocks_in: int


HOST_TIER_COUNTERS: Final = (
    "demotions",
    "demotions_present",
    "demotions_dropped",
    "evictions",
    "stores",
    "loads",
    "hit_tokens",
    "swap_outs",
    "swap_ins",
    "swapped_blocks_out",
    "swapped_blocks_in",
)
"""The tier's cumulative counters, in the order snapshots write them."""


@dataclass(frozen=True, slots=True)
class _Swapped:
    # Per group, per block position: the host block (None for a null device block) and the
    # key it holds (None for a private, unkeyed block).
    tables: tuple[tuple[tuple[int, BlockHashWithGroupId | None] | None, ...], ...]
    num_tokens: int


def restore_swapped(
    num_tokens: int,
    rows: Sequence[Sequence[int]],
    keyed: dict[int, BlockHashWithGroupId],
    private: set[int],
) -> _Swapped:
    """A swapped request's record from its host blocks per group (-1: a null device block),
    as a snapshot saved it (a private block holds no key; any other its block's key)."""
    return _Swapped(
        tuple(
            tuple(None if h < 0 else (h, None if h in private else keyed[h]) for h in row)
            for row in rows
        ),
        num_tokens,
    )


class HostTier:
    """Host blocks of one pool: a keyed LRU store, swapped requests, and pending copies.

    Attributes:
        num_blocks: Host blocks in the tier.
        block_bytes: Bytes one host block holds (0: not known).
        enable_events: Whether events are recorded for ``take_events``.
        medium: Medium reported in events.
        connector: Kept by an engine's offloading connector (HOST_SYNC ops).
    """

    # NOTE: the tier's state.
    # * _where maps each key the tier holds to its host block; _key_of is its inverse.
    # * _order holds every key of _where, least recent first; the evictable ones (ready, no
    #   pin) are counted in _num_evictable. Eviction walks _order from the front.
    # * _pins counts pins per host block (loads in flight, swapped requests); _pending holds
    #   keys whose store has not completed. Private (unkeyed) blocks of swapped requests are
    #   in _private and always pinned by their request.
    # * Every host block is exactly one of: free (_free), keyed (_key_of), private (_private).
    __slots__ = (
        "_counters",
        "_d2h",
        "_events",
        "_free",
        "_guard",
        "_h2d",
        "_key_of",
        "_num_evictable",
        "_order",
        "_pending",
        "_pins",
        "_private",
        "_swapped",
        "_where",
        "block_bytes",
        "connector",
        "enable_events",
        "medium",
        "num_blocks",
    )

    def __init__(
        self,
        num_blocks: int,
        *,
        block_bytes: int = 0,
        enable_events: bool = False,
        medium: str = MEDIUM_CPU,
        connector: bool = False,
    ) -> None:
        """Create an empty tier.

        Args:
            num_blocks: Host blocks (>= 0).
            block_bytes: Bytes per host block, for usage reports (>= 0).
            enable_events: Record events for ``take_events``.
            medium: Medium reported in events.
            connector: An engine's offloading connector keeps the tier (HOST_SYNC): prefix
                hits are answered as its lookup finds them, sliding-window groups included.

        Raises:
            InvalidArgumentError: A count is negative or not an int.
        """
        for name, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes)):
            if type(value) is not int or value < 0:
                raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}", field=name)
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.enable_events = bool(enable_events)
        self.medium = medium
        self.connector = connector
        self._where: dict[BlockHashWithGroupId, int] = {}
        self._key_of: dict[int, BlockHashWithGroupId] = {}
        # An OrderedDict: a plain dict walked from the front after many deletions there skips
        # their dead slots (O(deleted) per walk); this one's links make it O(1).
        self._order: OrderedDict[BlockHashWithGroupId, None] = OrderedDict()
        self._num_evictable = 0
        self._pins: dict[int, int] = {}
        self._pending: set[BlockHashWithGroupId] = set()
        self._private: set[int] = set()
        self._swapped: dict[str, _Swapped] = {}
        # Keys an admission is about to load: demotions during its allocation skip them.
        self._guard: frozenset[BlockHashWithGroupId] = frozenset()
        # Lowest host block ids are used first (popped from the end).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._d2h: list[tuple[int, int]] = []
        self._h2d: list[tuple[int, int]] = []
        self._events: list[KVCacheEvent] = []
        self._counters = dict.fromkeys(HOST_TIER_COUNTERS, 0)

    # ------------------------------------------------------------------------- reads
    def __contains__(self, key: object) -> bool:
        """Whether the tier holds ``key`` (ready or pending)."""
        return key in self._where

    def lookup(self, key: BlockHashWithGroupId) -> int:
        """:data:`HIT`, :data:`PENDING` (stored, not completed) or :data:`MISS`."""
        if key not in self._where:
            return MISS
        return PENDING if key in self._pending else HIT

    def host_block(self, key: BlockHashWithGroupId) -> int | None:
        """The host block holding ``key``, or ``None``."""
        return self._where.get(key)

    def match_prefix(self, keys: Iterable[BlockHashWithGroupId]) -> int:
        """How many of ``keys``, from the first, the tier holds ready to load."""
        where = self._where
        pending = self._pending
        count = 0
        for key in keys:
            if key not in where or key in pending:
                break
            count += 1
        return count

    def lru_keys(self) -> list[BlockHashWithGroupId]:
        """The evictable keys, next to evict first. O(tier)."""
        return [key for key in self._order if self._evictable(key)]

    def recency(self) -> list[BlockHashWithGroupId]:
        """Every key, least recently used first (pinned and pending ones included). O(tier)."""
        return list(self._order)

    def keys(self) -> dict[BlockHashWithGroupId, int]:
        """Every key the tier holds and its host block. O(tier)."""
        return dict(self._where)

    def swapped(self) -> dict[str, tuple[int, tuple[tuple[int | None, ...], ...]]]:
        """Swapped requests: owner -> (tokens, host block per group and position)."""
        return {
            owner: (
                record.num_tokens,
                tuple(
                    tuple(None if entry is None else entry[0] for entry in table)
                    for table in record.tables
                ),
            )
            for owner, record in self._swapped.items()
        }

    def pinned(self) -> dict[int, int]:
        """Pins per pinned host block. O(pinned)."""
        return dict(self._pins)

    def pending_keys(self) -> set[BlockHashWithGroupId]:
        """Keys whose store has not completed."""
        return set(self._pending)

    def private_blocks(self) -> set[int]:
        """Host blocks of swapped requests that hold no key."""
        return set(self._private)

    @property
    def num_free(self) -> int:
        """Host blocks holding nothing."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Host blocks that an allocation may evict now."""
        return self._num_evictable

    def stats(self) -> HostTierStats:
        """The tier's state and counters."""
        counters = self._counters
        return HostTierStats(
            num_blocks=self.num_blocks,
            num_used=self.num_blocks - len(self._free),
            num_pinned=len(self._pins),
            num_swapped_requests=len(self._swapped),
            **counters,
        )

    # ---------------------------------------------------------------------- mapping
    @property
    def num_pending_copies(self) -> int:
        """Copies recorded and not taken yet (both directions)."""
        return len(self._d2h) + len(self._h2d)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Drain the copies recorded since the last take: ``(device_to_host, host_to_device)``.

        ``device_to_host`` pairs are ``(device_block_id, host_block_id)``,
        ``host_to_device`` pairs ``(host_block_id, device_block_id)``; the workers run the
        first list before the second.
        """
        d2h, h2d = self._d2h, self._h2d
        self._d2h, self._h2d = [], []
        return d2h, h2d

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the recorded events, oldest first (empty when events are off)."""
        events = self._events
        self._events = []
        return events

    # ------------------------------------------------------------------------ writes
    def touch(self, keys: Sequence[BlockHashWithGroupId]) -> None:
        """Mark keys (a request's, head first) used: the head ends most recent."""
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)

    def demote(self, key: BlockHashWithGroupId, device_block_id: int) -> int | None:
        """Keep an evicted device block's key: the host block it is copied to, or ``None``.

        ``None`` when the tier holds the key already (touched, no copy) or has no block to
        give (every block pinned; the key is lost, as without a tier).
        """
        if key in self._where:
            self._counters["demotions_present"] += 1
            self._order.move_to_end(key)
            return None
        host_id = self._take_block(())
        if host_id is None:
            self._counters["demotions_dropped"] += 1
            return None
        self._insert(key, host_id, ready=True)
        self._d2h.append((device_block_id, host_id))
        self._counters["demotions"] += 1
        return host_id

    def store(
        self,
        keys: Sequence[BlockHashWithGroupId],
        *,
        ready: bool = True,
    ) -> tuple[list[BlockHashWithGroupId], list[int], list[BlockHashWithGroupId]] | None:
        """Reserve host blocks for the keys the tier does not hold yet (all or nothing).

        Keys held already are left as they are; the offered keys are never evicted to make
        room. With ``ready=False`` the new blocks are pending until ``complete_store``.

        Returns:
            ``(stored_keys, host_block_ids, evicted_keys)``, or ``None`` when the tier cannot
            give enough blocks (nothing changes then).
        """
        new: list[BlockHashWithGroupId] = []
        seen: set[BlockHashWithGroupId] = set()
        for key in keys:
            if key not in self._where and key not in seen:
                new.append(key)
                seen.add(key)
        protected = set(keys)
        if not self._can_take(len(new), protected):
            return None
        evicted: list[BlockHashWithGroupId] = []
        host_ids: list[int] = []
        for key in new:
            host_id = self._take_block(protected, evicted)
            assert host_id is not None
            self._insert(key, host_id, ready=ready)
            host_ids.append(host_id)
        self._counters["stores"] += len(new)
        return new, host_ids, evicted

    def complete_store(self, keys: Iterable[BlockHashWithGroupId], *, success: bool) -> None:
        """Make pending keys loadable (``success``) or release them (failed copies)."""
        for key in keys:
            if key not in self._pending:
                continue
            self._pending.discard(key)
            host_id = self._where[key]
            if success:
                if host_id not in self._pins:
                    self._num_evictable += 1
                if self.enable_events:
                    self._stored_event(key)
            else:
                del self._where[key]
                del self._key_of[host_id]
                del self._order[key]
                self._pins.pop(host_id, None)
                self._free.append(host_id)

    def pin(self, keys: Iterable[BlockHashWithGroupId]) -> list[int]:
        """Protect held, ready keys from eviction (a load in flight); their host blocks.

        Raises:
            FailedPreconditionError: A key is not held or not ready; nothing changes.
        """
        keys = list(keys)
        for key in keys:
            if key not in self._where or key in self._pending:
                raise FailedPreconditionError(f"host tier holds no ready block for key {key!r}")
        host_ids = []
        for key in keys:
            host_id = self._where[key]
            self._pin_block(host_id, key)
            host_ids.append(host_id)
        return host_ids

    def unpin(self, keys: Iterable[BlockHashWithGroupId]) -> None:
        """Drop one pin per key (a finished load).

        Raises:
            FailedPreconditionError: A key is not pinned; nothing changes.
        """
        keys = list(keys)
        drops: dict[BlockHashWithGroupId, int] = {}
        for key in keys:
            drops[key] = drops.get(key, 0) + 1
            if self._pins.get(self._where.get(key, -1), 0) < drops[key]:
                raise FailedPreconditionError(f"host tier key {key!r} is not pinned")
        for key in keys:
            self._unpin_block(self._where[key], key)

    def load(self, pairs: Sequence[tuple[BlockHashWithGroupId, int]]) -> list[tuple[int, int]]:
        """Record host-to-device copies of held keys into device blocks; touch the keys.

        Args:
            pairs: ``(key, device_block_id)`` per block, a request's in prefix order.

        Returns:
            The ``(host_block_id, device_block_id)`` copies (also kept for ``take_copies``).

        Raises:
            FailedPreconditionError: A key is not held or not ready; nothing changes.
        """
        for key, _ in pairs:
            if key not in self._where or key in self._pending:
                raise FailedPreconditionError(f"host tier holds no ready block for key {key!r}")
        copies = [(self._where[key], device_id) for key, device_id in pairs]
        self.touch([key for key, _ in pairs])
        self._h2d.extend(copies)
        self._counters["loads"] += len(copies)
        return copies

    def swap_out(
        self,
        owner: str,
        tables: Sequence[Sequence[tuple[BlockHashWithGroupId | None, int] | None]],
        num_tokens: int,
    ) -> list[tuple[int, int]] | None:
        """Copy a preempted request's blocks to pinned host blocks (all or nothing).

        Args:
            owner: The request id (at most one swap per owner).
            tables: Per group, per block position: ``(key or None, device_block_id)``, or
                ``None`` for a null (skipped) device block. A keyed block whose key the tier
                holds is pinned without a copy.
            num_tokens: The request's computed tokens the blocks hold.

        Returns:
            The ``(device_block_id, host_block_id)`` copies, or ``None`` when the tier cannot
            give enough blocks (nothing changes).

        Raises:
            FailedPreconditionError: ``owner`` is swapped out already.
        """
        if owner in self._swapped:
            raise FailedPreconditionError(f"request {owner!r} is swapped out already")
        where, pending = self._where, self._pending
        held = {
            entry[0]
            for table in tables
            for entry in table
            if entry is not None and entry[0] in where and entry[0] not in pending
        }
        needed = sum(
            1 for table in tables for entry in table if entry is not None and entry[0] not in held
        )
        # Keys appearing twice (two groups never share a key; a table never repeats one)
        # would need one block: counted as two, which only makes the check stricter.
        if not self._can_take(needed, held):
            return None
        copies: list[tuple[int, int]] = []
        out_tables = []
        for table in tables:
            out: list[tuple[int, BlockHashWithGroupId | None] | None] = []
            for entry in table:
                if entry is None:
                    out.append(None)
                    continue
                key, device_id = entry
                if key is not None and key in self._where and key not in self._pending:
                    host_id = self._where[key]
                    self._pin_block(host_id, key)
                    out.append((host_id, key))
                    continue
                new_id = self._take_block(held)
                assert new_id is not None
                if key is not None and key not in self._where:
                    self._insert(key, new_id, ready=True)
                    self._pin_block(new_id, key)
                    out.append((new_id, key))
                else:  # unkeyed, or its key's store is pending: a private copy
                    self._private.add(new_id)
                    self._pins[new_id] = 1
                    out.append((new_id, None))
                copies.append((device_id, new_id))
            out_tables.append(tuple(out))
        self._swapped[owner] = _Swapped(tuple(out_tables), num_tokens)
        self._d2h.extend(copies)
        self._counters["swap_outs"] += 1
        self._counters["swapped_blocks_out"] += len(copies)
        return copies

    def swap_out_group(
        self,
        members: Sequence[
            tuple[str, Sequence[Sequence[tuple[BlockHashWithGroupId | None, int] | None]], int]
        ],
    ) -> dict[str, list[tuple[int, int]]] | None:
        """``swap_out`` of several requests, all or none: ``(owner, tables, num_tokens)`` each.

        A block the members share (a prefix one hit in another's cache) is copied once and
        pinned by each. Returns each owner's copies, or ``None`` when the tier cannot give
        the group enough blocks (nothing changes).

        Raises:
            FailedPreconditionError: An owner is swapped out already or named twice.
        """
        owners = [owner for owner, _, _ in members]
        if len(set(owners)) != len(owners):
            raise FailedPreconditionError("a request is named twice in the group")
        for owner in owners:
            if owner in self._swapped:
                raise FailedPreconditionError(f"request {owner!r} is swapped out already")
        where, pending = self._where, self._pending
        held: set[BlockHashWithGroupId] = set()
        new_keys: set[BlockHashWithGroupId] = set()
        needed = 0
        for _, tables, _ in members:
            for table in tables:
                for entry in table:
                    if entry is None:
                        continue
                    key = entry[0]
                    if key is not None and key in where and key not in pending:
                        held.add(key)
                    elif key is None or key in where or key not in new_keys:
                        needed += 1  # a private copy, or the first copy of a new key
                        if key is not None and key not in where:
                            new_keys.add(key)
        if not self._can_take(needed, held):
            return None
        # No member's block may be evicted for another's.
        self._guard = frozenset(held)
        try:
            out: dict[str, list[tuple[int, int]]] = {}
            for owner, tables, num_tokens in members:
                copies = self.swap_out(owner, tables, num_tokens)
                assert copies is not None
                out[owner] = copies
        finally:
            self._guard = frozenset()
        return out

    def swapped_tokens(self, owner: str) -> int | None:
        """The tokens a swapped request keeps in the tier, or ``None`` if it is not swapped."""
        record = self._swapped.get(owner)
        return None if record is None else record.num_tokens

    def swapped_keys(self, owner: str) -> tuple[tuple[BlockHashWithGroupId | None, ...], ...]:
        """Per group and position, the key each swapped block holds (``None``: unkeyed)."""
        record = self._swapped[owner]
        return tuple(
            tuple(None if entry is None else entry[1] for entry in table) for table in record.tables
        )

    def swap_in(
        self, owner: str, device_tables: Sequence[Sequence[int | None]]
    ) -> list[tuple[int, int]]:
        """Map a swapped request's host blocks back to device blocks and release them.

        Args:
            owner: The swapped request.
            device_tables: Per group, per block position: the device block to copy into, or
                ``None`` where no copy is needed (a device hit, a null block, past the end).

        Returns:
            The ``(host_block_id, device_block_id)`` copies.

        Raises:
            FailedPreconditionError: ``owner`` is not swapped out.
        """
        record = self._swapped.pop(owner, None)
        if record is None:
            raise FailedPreconditionError(f"request {owner!r} is not swapped out")
        copies: list[tuple[int, int]] = []
        for group, table in enumerate(record.tables):
            targets = device_tables[group] if group < len(device_tables) else ()
            for position, entry in enumerate(table):
                if entry is None:
                    continue
                host_id, key = entry
                device_id = targets[position] if position < len(targets) else None
                if device_id is not None:
                    copies.append((host_id, device_id))
                self._release_swapped(host_id, key)
        self._h2d.extend(copies)
        self._counters["swap_ins"] += 1
        self._counters["swapped_blocks_in"] += len(copies)
        return copies

    def drop_swapped(self, owner: str) -> bool:
        """Forget a swapped request without copying it back (it finished or was aborted)."""
        record = self._swapped.pop(owner, None)
        if record is None:
            return False
        for table in record.tables:
            for entry in table:
                if entry is not None:
                    self._release_swapped(*entry)
        return True

    def release(self, keys: Iterable[BlockHashWithGroupId]) -> None:
        """Drop one pin per key that has one left (keys not pinned are ignored)."""
        pins, where = self._pins, self._where
        for key in keys:
            host_id = where.get(key)
            if host_id is not None and pins.get(host_id, 0) > 0:
                self._unpin_block(host_id, key)

    def note_loads(self, num_blocks: int, num_tokens: int) -> None:
        """Count host-to-device loads an engine's connector runs itself (its ``prepare_load``)."""
        self._counters["loads"] += num_blocks
        self._counters["hit_tokens"] += num_tokens

    def note_hit_tokens(self, num_tokens: int) -> None:
        """Count tokens admitted from the tier (hit-rate metrics)."""
        self._counters["hit_tokens"] += num_tokens

    def reset(self) -> bool:
        """Forget every key, if nothing is pinned, pending or swapped; ``False`` otherwise."""
        if self._pins or self._pending or self._swapped:
            return False
        for key in list(self._where):
            self._removed_event(key)
        self._where.clear()
        self._key_of.clear()
        self._order.clear()
        self._num_evictable = 0
        self._free = list(range(self.num_blocks - 1, -1, -1))
        return True

    def clear(self) -> None:
        """Forget everything, pins, pending stores and swapped requests included (an engine's
        cache reset, after which it ignores the copies in flight)."""
        for key in list(self._where):
            if key not in self._pending:
                self._removed_event(key)
        self._where.clear()
        self._key_of.clear()
        self._order.clear()
        self._num_evictable = 0
        self._pins.clear()
        self._pending.clear()
        self._private.clear()
        self._swapped.clear()
        self._d2h, self._h2d = [], []
        self._free = list(range(self.num_blocks - 1, -1, -1))

    # --------------------------------------------------------------------- internals
    def _evictable(self, key: BlockHashWithGroupId) -> bool:
        return key not in self._pending and self._where[key] not in self._pins

    def _can_take(self, num_blocks: int, protected: set[BlockHashWithGroupId]) -> bool:
        # Whether `num_blocks` blocks can be had from the free list and evictions that spare
        # `protected` and the guard (walks the order only as far as it must).
        short = num_blocks - len(self._free)
        if short <= 0:
            return True
        if short > self._num_evictable:
            return False
        guard = self._guard
        evictable = self._evictable
        for key in self._order:
            if key not in protected and key not in guard and evictable(key):
                short -= 1
                if short == 0:
                    return True
        return False

    def _insert(self, key: BlockHashWithGroupId, host_id: int, *, ready: bool) -> None:
        self._where[key] = host_id
        self._key_of[host_id] = key
        self._order[key] = None
        if ready:
            self._num_evictable += 1
            if self.enable_events:
                self._stored_event(key)
        else:
            self._pending.add(key)

    def _take_block(
        self,
        protected: Iterable[BlockHashWithGroupId] | set[BlockHashWithGroupId],
        evicted: list[BlockHashWithGroupId] | None = None,
    ) -> int | None:
        if self._free:
            return self._free.pop()
        guard = self._guard
        evictable = self._evictable
        for key in self._order:
            if key not in protected and key not in guard and evictable(key):
                break
        else:
            return None
        del self._order[key]
        self._num_evictable -= 1
        host_id = self._where.pop(key)
        del self._key_of[host_id]
        self._counters["evictions"] += 1
        self._removed_event(key)
        if evicted is not None:
            evicted.append(key)
        return host_id

    def _pin_block(self, host_id: int, key: BlockHashWithGroupId | None) -> None:
        count = self._pins.get(host_id, 0)
        self._pins[host_id] = count + 1
        if count == 0 and key is not None and key not in self._pending:
            self._num_evictable -= 1

    def _unpin_block(self, host_id: int, key: BlockHashWithGroupId | None) -> None:
        count = self._pins[host_id] - 1
        if count:
            self._pins[host_id] = count
            return
        del self._pins[host_id]
        if key is not None and key not in self._pending:
            self._num_evictable += 1

    def _release_swapped(self, host_id: int, key: BlockHashWithGroupId | None) -> None:
        if key is None:
            del self._pins[host_id]
            self._private.discard(host_id)
            self._free.append(host_id)
        else:
            self._unpin_block(host_id, key)

    def _stored_event(self, key: BlockHashWithGroupId) -> None:
        self._events.append(
            BlockStored(
                block_hashes=[get_block_hash(key)],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=self.medium,
                lora_name=None,
                group_idx=get_group_id(key),
            )
        )

    def _removed_event(self, key: BlockHashWithGroupId) -> None:
        if self.enable_events and key not in self._pending:
            self._events.append(
                BlockRemoved(
                    block_hashes=[get_block_hash(key)],
                    medium=self.medium,
                    group_idx=get_group_id(key),
                )
            )


# ------------------------------------------------- an engine's offloading connector
@enum.unique
class SyncAction(enum.IntEnum):
    """One call of an engine's offloading connector into its host tier's index (vLLM's
    ``OffloadingManager``), as a HOST_SYNC Step op replays it on the server's copy.

    The engine's tier (``kvcm.integrations.vllm.KvcmOffloadingManager``) and the server's
    both apply each call with :func:`apply_sync`, so the two stay equal call for call.
    """

    STORE = 1
    """``prepare_store``: pending blocks for the keys not held (least recently used ready,
    unpinned keys evicted; the offered keys never); the new keys touched, head most recent.
    All or nothing."""
    STORED = 2
    """``complete_store``: the pending keys become loadable."""
    STORE_FAILED = 3
    """``complete_store(success=False)``: the pending keys are released."""
    LOAD = 4
    """``prepare_load``: a pin on each held, ready key; counted as loads and hit tokens."""
    LOADED = 5
    """``complete_load``: one pin dropped per pinned key."""
    TOUCH = 6
    """``touch``: the keys used, the first most recent."""
    CLEAR = 7
    """``reset_cache``: every key, pin and pending store forgotten (no keys)."""


def apply_sync(
    host: HostTier,
    action: int,
    keys: Sequence[BlockHashWithGroupId],
    tokens_per_key: Sequence[int],
) -> tuple[list[BlockHashWithGroupId], list[int], list[BlockHashWithGroupId]] | list[int] | None:
    """Apply one connector call to ``host`` (see :class:`SyncAction`); total on any keys.

    Keys an action cannot apply to are skipped (a load of a key not held ready, a completion
    of a key not pending, a release of a key not pinned), so a replay never raises; an engine
    whose connector follows vLLM's contract never sends such keys.

    Args:
        host: The tier.
        action: A :class:`SyncAction` value.
        keys: The call's keys, in the connector's order.
        tokens_per_key: Per KV-cache group, the tokens one key holds (hit-token counts; a
            group beyond it counts none).

    Returns:
        STORE: ``HostTier.store``'s answer (``None``: refused, nothing changed); LOAD: the
        pinned keys' host blocks; otherwise ``None``.
    """
    if action == SyncAction.STORE:
        stored = host.store(keys, ready=False)
        if stored is not None:
            host.touch(stored[0])
        return stored
    if action in (SyncAction.STORED, SyncAction.STORE_FAILED):
        host.complete_store(keys, success=action == SyncAction.STORED)
        return None
    if action == SyncAction.LOAD:
        held = [key for key in keys if host.lookup(key) == HIT]
        per_group: dict[int, int] = {}
        for key in held:
            group = get_group_id(key)
            per_group[group] = per_group.get(group, 0) + 1
        known = len(tokens_per_key)
        tokens = max(
            (count * tokens_per_key[group] for group, count in per_group.items() if group < known),
            default=0,
        )
        host.note_loads(len(held), tokens)
        return host.pin(held)
    if action == SyncAction.LOADED:
        host.release(keys)
        return None
    if action == SyncAction.TOUCH:
        host.touch(keys)
        return None
    if action == SyncAction.CLEAR:
        host.clear()
        return None
    raise InvalidArgumentError(f"unknown host sync action {action}", field="host_sync_actions")


# ------------------------------------------------------------------ pool-level glue
def _group_keys(
    manager: KVCacheManager,
    hashes: Sequence[BlockHash],
    group_id: int,
    start_block: int,
    end_block: int,
) -> list[BlockHashWithGroupId]:
    block_size = manager.coordinator.single_type_managers[group_id].block_size
    scale = block_size // manager.hash_block_size
    return [
        make_block_hash_with_group_id(hashes[(i + 1) * scale - 1], group_id)
        for i in range(start_block, end_block)
    ]


def _host_capable(manager: KVCacheManager) -> bool:
    from kvcm.core.single_type_managers import FullAttentionManager

    managers = manager.coordinator.single_type_managers
    return bool(managers) and all(type(m) is FullAttentionManager for m in managers)


def host_hit_tokens(
    manager: KVCacheManager,
    host: HostTier,
    request: Request,
    num_device_hit_tokens: int,
    max_hit_tokens: int | None = None,
) -> int:
    """Tokens past the device hit that the host tier holds for every group, whole blocks.

    Host hits are answered for pools whose groups are all full attention (0 otherwise).
    Like a device hit, the last token is left to compute (``max_hit_tokens`` defaults to
    ``num_tokens - 1``).
    """
    if request.skip_reading_prefix_cache:
        return 0
    limit = request.num_tokens - 1 if max_hit_tokens is None else max_hit_tokens
    return prefix_host_hit_tokens(manager, host, request.block_hashes, num_device_hit_tokens, limit)


def prefix_host_hit_tokens(
    manager: KVCacheManager,
    host: HostTier,
    block_hashes: Sequence[BlockHash],
    num_device_hit_tokens: int,
    max_hit_tokens: int,
) -> int:
    """``host_hit_tokens`` of a prompt's block hashes (a Lookup's, with no request).

    A tier an engine's offloading connector keeps (``HostTier.connector``) also answers for
    pools of full-attention and sliding-window groups, as vLLM 0.33's offloading connector
    looks such a request up (:func:`_windowed_hit_tokens`).
    """
    if not manager.enable_caching:
        return 0
    if not _host_capable(manager):
        if host.connector:
            return _windowed_hit_tokens(
                manager, host, block_hashes, num_device_hit_tokens, max_hit_tokens
            )
        return 0
    hash_block_size = manager.hash_block_size
    num_hit = max_hit_tokens
    for group_id, single in enumerate(manager.coordinator.single_type_managers):
        block_size = single.block_size
        start = num_device_hit_tokens // block_size
        num_full = min(len(block_hashes) * hash_block_size, max_hit_tokens) // block_size
        if start >= num_full:
            return 0
        matched = host.match_prefix(_group_keys(manager, block_hashes, group_id, start, num_full))
        num_hit = min(num_hit, (start + matched) * block_size)
    return max(0, num_hit - num_device_hit_tokens)


def _windowed_hit_tokens(
    manager: KVCacheManager,
    host: HostTier,
    block_hashes: Sequence[BlockHash],
    num_device_hit_tokens: int,
    max_hit_tokens: int,
) -> int:
    # vLLM 0.33's OffloadingConnector lookup of complete chunks (one chunk per block) for
    # full-attention and sliding-window groups: full-attention groups need every chunk from
    # the device hit on, a sliding-window group only the chunks of its window before the hit's
    # end (scanned from the right); a group that lowers the end makes the windows be checked
    # again at the new end. A store not completed is not a hit (vLLM waits for it). Groups of
    # other kinds (Mamba, chunked local attention) answer no host hit.
    from kvcm.core.single_type_managers import FullAttentionManager, SlidingWindowManager

    full: list[tuple[int, int, None]] = []
    windowed: list[tuple[int, int, int | None]] = []
    for group_id, single in enumerate(manager.coordinator.single_type_managers):
        size = single.block_size
        if type(single) is FullAttentionManager:
            full.append((group_id, size, None))
        elif type(single) is SlidingWindowManager:
            reach = max(
                single.sliding_window, single.sliding_window - 1 + single.extra_retained_tokens
            )
            windowed.append((group_id, size, -(-reach // size)))
        else:
            return 0
    windowed.sort(key=lambda group: -(group[2] or 0))
    order = [*full, *windowed]
    computed = num_device_hit_tokens
    num_tokens = len(block_hashes) * manager.hash_block_size
    limit = max_hit_tokens
    num_hit = 0
    pending_groups: list[tuple[int, int, int | None]] = order
    while pending_groups:
        groups, pending_groups = pending_groups, []
        looked_up_window = False
        for group_id, size, window in groups:
            num_keys = num_tokens // size
            limit = min(limit, num_keys * size)
            if limit - computed < size:
                return 0
            num_chunks = min(-(-limit // size), num_keys)
            start = computed // size
            keys = _group_keys(manager, block_hashes, group_id, start, num_chunks)
            if window is None:
                found = host.match_prefix(keys)
            else:
                found = _window_end(
                    host,
                    keys,
                    window,
                    _load_window(manager, group_id, size, window, min(limit, num_chunks * size)),
                )
            if found == 0:
                return 0
            limit = min(limit, size * (start + found))
            new = limit - computed
            if new < size:
                return 0
            if new < num_hit and looked_up_window and not pending_groups:
                pending_groups = list(windowed)  # the windows again, at the lower end
            looked_up_window |= window is not None
            num_hit = new
    return num_hit


def _load_window(manager: KVCacheManager, group_id: int, size: int, window: int, end: int) -> int:
    # The window an allocation keeps when the hit ends at `end` (vLLM's
    # load_window_size_in_chunks): rounding the end up may need one chunk more.
    from kvcm.core.single_type_managers import SlidingWindowManager

    single = manager.coordinator.single_type_managers[group_id]
    assert isinstance(single, SlidingWindowManager)
    reach = single.sliding_window - 1 + single.extra_retained_tokens + (-end % size)
    return max(window, -(-reach // size))


def _window_end(
    host: HostTier, keys: Sequence[BlockHashWithGroupId], window: int, first: int
) -> int:
    # The end (in keys) of the last run of `window` ready keys, scanning from the right; the
    # rightmost run may need `first` keys (a partial rightmost chunk). No such run: the run
    # ending at the front (0 when the front key misses).
    run = 0
    need = first
    for index in range(len(keys) - 1, -1, -1):
        if host.lookup(keys[index]) == HIT:
            run += 1
        else:
            run = 0
            need = window
        if run == need:
            return index + need
    return run


@dataclass(frozen=True, slots=True)
class HostAdmission:
    """What admitting a request with host hits gave.

    Attributes:
        blocks: The new device blocks per group (``allocate_slots``' answer).
        num_device_hit_tokens: Tokens hit on the device.
        num_host_hit_tokens: Tokens loaded from the host tier.
        host_to_device: The ``(host_block_id, device_block_id)`` copies.
    """

    blocks: KVCacheBlocks
    num_device_hit_tokens: int
    num_host_hit_tokens: int
    host_to_device: list[tuple[int, int]]


def admit_with_host_hit(
    manager: KVCacheManager,
    host: HostTier,
    request: Request,
    num_new_tokens: int,
    *,
    hit: CacheHit,
    num_host_hit_tokens: int,
) -> HostAdmission | None:
    """Admit a waiting request with its device hit and ``num_host_hit_tokens`` from the tier.

    The host tokens are the allocation's external computed tokens: their device blocks are
    allocated (and cached, as vLLM caches a connector's tokens), and each gets a host-to-device
    copy. ``None`` when the blocks do not fit (nothing changes but what ``allocate_slots``
    changes then).

    Raises:
        InvalidArgumentError: ``num_host_hit_tokens`` exceeds what the tier holds.
    """
    from kvcm.core.manager import SlotOptions

    start_tokens = hit.num_computed_tokens
    end = start_tokens + num_host_hit_tokens
    group_keys: list[tuple[int, list[BlockHashWithGroupId]]] = []
    if num_host_hit_tokens:
        # Whole blocks of every group, within the request's hashes, all held ready.
        fits = _host_capable(manager) and end <= len(request.block_hashes) * manager.hash_block_size
        for group_id, single in enumerate(manager.coordinator.single_type_managers):
            size = single.block_size
            if not fits or start_tokens % size or end % size:
                fits = False
                break
            keys = _group_keys(
                manager, request.block_hashes, group_id, start_tokens // size, end // size
            )
            if host.match_prefix(keys) < len(keys):
                fits = False
                break
            group_keys.append((size, keys))
        if not fits:
            raise InvalidArgumentError(
                f"num_host_hit_tokens {num_host_hit_tokens} after a device hit of "
                f"{start_tokens} is not a run of whole blocks the host tier holds",
                field="num_host_hit_tokens",
            )
    options = SlotOptions(num_external_computed_tokens=num_host_hit_tokens)
    # The allocation may evict device blocks, whose demotions must not evict the host
    # blocks about to be loaded.
    host._guard = frozenset(key for _, keys in group_keys for key in keys)
    try:
        blocks = manager.allocate_slots(request, num_new_tokens, hit, options)
    finally:
        host._guard = frozenset()
    if blocks is None:
        return None
    copies: list[tuple[int, int]] = []
    if num_host_hit_tokens:
        tables = manager.get_blocks(request.request_id).blocks
        pairs: list[tuple[BlockHashWithGroupId, int]] = []
        for group_id, (block_size, keys) in enumerate(group_keys):
            start = hit.num_computed_tokens // block_size
            table = tables[group_id]
            pairs.extend((key, table[start + i].block_id) for i, key in enumerate(keys))
        copies = host.load(pairs)
        host.note_hit_tokens(num_host_hit_tokens)
    return HostAdmission(blocks, hit.num_computed_tokens, num_host_hit_tokens, copies)


def swap_out(
    manager: KVCacheManager, host: HostTier, request: Request
) -> list[tuple[int, int]] | None:
    """Copy a running request's blocks to pinned host blocks (the copies).

    The caller then preempts the request (frees its device blocks). ``None`` when the tier
    has no room: nothing changes, and the caller preempts by recomputation as without a tier.
    """
    tables = swap_out_tables(manager, request)
    return host.swap_out(request.request_id, tables, request.num_computed_tokens)


def swap_out_tables(
    manager: KVCacheManager, request: Request
) -> list[list[tuple[BlockHashWithGroupId | None, int] | None]]:
    """A request's blocks as ``HostTier.swap_out`` takes them."""
    return [
        [None if block.is_null else (block.block_hash, block.block_id) for block in blocks]
        for blocks in manager.get_blocks(request.request_id).blocks
    ]


def swap_in(
    manager: KVCacheManager, host: HostTier, request: Request, num_new_tokens: int
) -> HostAdmission | None:
    """Re-admit a swapped request: its device hit, then its swapped blocks copied back.

    ``None`` when the blocks do not fit (the request stays swapped). The request's computed
    tokens after the call are ``num_device_hit_tokens + num_host_hit_tokens`` of the answer.

    Raises:
        FailedPreconditionError: The request is not swapped out.
    """
    from kvcm.core.manager import SlotOptions

    num_swapped = host.swapped_tokens(request.request_id)
    if num_swapped is None:
        raise FailedPreconditionError(f"request {request.request_id!r} is not swapped out")
    hit = manager.get_computed_blocks(request, num_swapped)
    num_external = num_swapped - hit.num_computed_tokens
    options = SlotOptions(num_external_computed_tokens=num_external)
    blocks = manager.allocate_slots(request, num_new_tokens, hit, options)
    if blocks is None:
        return None
    tables = manager.get_blocks(request.request_id).blocks
    device_tables: list[list[int | None]] = []
    for group_id, single in enumerate(manager.coordinator.single_type_managers):
        first = hit.num_computed_tokens // single.block_size
        device_tables.append(
            [
                None if i < first or block.is_null else block.block_id
                for i, block in enumerate(tables[group_id])
            ]
        )
    copies = host.swap_in(request.request_id, device_tables)
    return HostAdmission(blocks, hit.num_computed_tokens, num_external, copies)
