"""The block pool: every KV-cache block of one engine, its free queue and its prefix cache.

The pool makes vLLM 0.33.0's ``BlockPool`` decisions (same block ids, same free-queue order,
same hits, same events) with its own code:

* ``get_new_blocks`` takes blocks from the front of the free queue; a cached block taken
  this way is evicted from the prefix cache first (``BlockRemoved``).
* ``free_blocks`` returns blocks whose last reference went away: uncached blocks to the
  *front* of the queue (reused first, for locality), cached ones to the *back* (LRU).
* ``touch`` revives cache hits: a free cached block leaves the queue.
* ``cache_full_blocks`` / ``cache_partial_block`` put blocks in the prefix cache under
  ``hash + group id`` keys (``BlockStored``).

The prefix cache maps a key to the blocks cached under it. Blocks are not de-duplicated: two
requests that fill identical blocks at the same time both cache theirs, so a block id, once
in a block table, never changes. A lookup answers with the block inserted first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, TypeAlias

from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError
from kvcm.common.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    new_block_stored,
)
from kvcm.common.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    to_event_extra_keys,
)
from kvcm.core.block import FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from kvcm.core._key_index import KeyIndexLike
    from kvcm.core.request import Request

__all__ = ["BlockPool"]

_CacheEntry: TypeAlias = KVCacheBlock | dict[int, KVCacheBlock]
_INDEX_BATCH = 4096  # keys per index call when a whole cache is attached (~1 ms)

# Key suffixes of the first group ids, so lookups concatenate instead of encoding an int.
_NUM_PRECOMPUTED_GROUPS = 64
_GROUP_SUFFIXES: tuple[bytes, ...] = tuple(
    make_block_hash_with_group_id(BlockHash(b""), group_id)
    for group_id in range(_NUM_PRECOMPUTED_GROUPS)
)


def _group_suffix(group_id: int) -> bytes:
    if 0 <= group_id < _NUM_PRECOMPUTED_GROUPS:
        return _GROUP_SUFFIXES[group_id]
    return make_block_hash_with_group_id(BlockHash(b""), group_id)


def _has_no_extra_keys(request: Request) -> bool:
    # No block of the request carries extra keys (see kvcm.common.hashing's key rules).
    return (
        not request.lora_name
        and not request.cache_salt
        and not request.mm_features
        and request.prompt_embeds is None
    )


class BlockPool:
    """All blocks of one pool: allocation, release, prefix caching and KV events.

    Attributes:
        num_gpu_blocks: Blocks in the pool, the null block included.
        enable_caching: Whether released blocks stay in the prefix cache.
        hash_block_size: Tokens per request block hash; every group's block size is a
            multiple of it.
        enable_kv_cache_events: Whether events are recorded for ``take_events``.
        num_hash_lookahead_tokens: Tokens after each block that its hash also covers.
        medium: Medium reported in events.
        event_metadata: Per group id, the ``(kv_cache_spec_kind,
            kv_cache_spec_sliding_window)`` a ``BlockStored`` of the group carries (the
            manager sets it; empty: left unset, and the manager annotates when taking them).
        blocks: Every block, indexed by block id.
        free_block_queue: Free blocks in eviction order (cached free blocks included).
        null_block: Block 0, the shared placeholder for skipped blocks.
        num_evicted_blocks: Cached blocks evicted so far (reused or evicted by id).
    """

    # NOTE: the prefix cache.
    # * _cached maps a key to the one block cached under it, or, once a second block is
    #   cached under the same key, to {block_id: block} in insertion order. The first block
    #   answers lookups. A dict left with one block stays a dict (same answers).
    # * A block's first key is its primary key (block.block_hash). Further keys of the same
    #   block (partial entries registered after the primary) are in _secondary_keys; a block
    #   with secondary keys always has a primary key.
    # * Evicting a block removes all its keys; the map never points at a block whose
    #   block_hash is None.
    # * _index, when set, is a cross-pool map key -> the slots of the pools caching the key
    #   (kvcm.core.lookup.PrefixIndex, kvcm.core._key_index); this pool keeps its slot
    #   (_index_slot) in the set of exactly the keys of _cached, updated where a key enters or
    #   leaves _cached.
    __slots__ = (
        "_cached",
        "_index",
        "_index_batch",
        "_index_lock",
        "_index_slot",
        "_num_cached_blocks",
        "_num_events_taken",
        "_secondary_keys",
        "blocks",
        "demote",
        "enable_caching",
        "enable_kv_cache_events",
        "event_metadata",
        "free_block_queue",
        "hash_block_size",
        "kv_event_queue",
        "make_stored_event",
        "medium",
        "null_block",
        "num_evicted_blocks",
        "num_gpu_blocks",
        "num_hash_lookahead_tokens",
    )

    def __init__(  # noqa: PLR0917 (vLLM's positional signature)
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        num_hash_lookahead_tokens: int = 0,
        medium: str = MEDIUM_GPU,
    ) -> None:
        """Create a pool whose blocks are all free; block 0 becomes the null block.

        Args:
            num_gpu_blocks: Blocks in the pool (> 0), the null block included.
            enable_caching: Whether to keep released full blocks in the prefix cache.
            hash_block_size: Tokens per request block hash (> 0).
            enable_kv_cache_events: Whether to record events for ``take_events``.
            num_hash_lookahead_tokens: Tokens after each block covered by its hash (>= 0).
            medium: Medium reported in events.

        Raises:
            InvalidArgumentError: A count is out of range.
        """
        for name, value, low in (
            ("num_gpu_blocks", num_gpu_blocks, 1),
            ("hash_block_size", hash_block_size, 1),
            ("num_hash_lookahead_tokens", num_hash_lookahead_tokens, 0),
        ):
            if type(value) is not int or value < low:
                raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = bool(enable_caching)
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.medium = medium
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self._cached: dict[BlockHashWithGroupId, _CacheEntry] = {}
        self._secondary_keys: dict[int, dict[BlockHashWithGroupId, None]] = {}
        self._num_cached_blocks = 0
        self._index: KeyIndexLike | None = None
        self._index_slot = 0
        self._index_lock: AbstractContextManager[Any] = nullcontext()
        self._index_batch: list[BlockHashWithGroupId] | None = None  # keys gone, not yet cleared
        # NOTE: the null block's ref_cnt is not maintained; free_blocks and touch skip it.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] = []
        self.event_metadata: tuple[tuple[str | None, int | None], ...] = ()
        self._num_events_taken = 0
        self.num_evicted_blocks = 0
        # A pool with a host tier (kvcm.core.host_tier) sets this to HostTier.demote: a cached
        # block evicted for reuse gives its key and id to it first.
        self.demote: Callable[[BlockHashWithGroupId, int], object] | None = None
        # What each BlockStored is made by (new_block_stored's parameters): a mirror whose
        # events only ever leave as another record of the same fields (vLLM's, in its engine)
        # sets a maker of that record, so none is made twice. Pending events of another type
        # are never snapshotted (encode_state(drop_pending_events=True) is such a pool's).
        self.make_stored_event: Callable[..., Any] = new_block_stored

    # ------------------------------------------------------------------------ lookups
    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block of ``block_hash`` in each group, or ``None`` if any group misses.

        Args:
            block_hash: A request block hash.
            kv_cache_group_ids: The groups to look in.

        Returns:
            One block per group (the first cached under the key), or ``None``.
        """
        cached_get = self._cached.get
        found: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            suffix = (
                _GROUP_SUFFIXES[group_id]
                if 0 <= group_id < _NUM_PRECOMPUTED_GROUPS
                else _group_suffix(group_id)
            )
            entry = cached_get(block_hash + suffix)  # type: ignore[call-overload]
            if entry is None:
                return None
            if type(entry) is dict:
                entry = next(iter(entry.values()))
            found.append(entry)
        return found

    # -------------------------------------------------------------------- allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, each with ref_cnt 1.

        A cached block taken this way is evicted from the prefix cache. The prefix cache is
        not consulted for hits here.

        Args:
            num_blocks: Blocks to take.

        Returns:
            The blocks, in queue order.

        Raises:
            InvalidArgumentError: ``num_blocks`` is negative.
            FailedPreconditionError: Fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise FailedPreconditionError(
                f"cannot get {num_blocks} blocks: {self.free_block_queue.num_free_blocks} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            # Evicted keys leave the cross-pool index in one batch (one lock round).
            batch = self._index_batch = None if self._index is None else []
            demote = self.demote
            for block in blocks:
                if block.block_hash is not None:
                    if demote is not None:
                        demote(block.block_hash, block.block_id)
                    self._evict_cached_block(block)
                block.ref_cnt = 1
            if batch is not None:
                self._index_batch = None
                if batch:
                    self._unindex_keys(batch)
        else:
            for block in blocks:
                block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks; free ones leave the free queue.

        Args:
            blocks: Hit blocks of one group (null blocks are skipped).
        """
        remove = self.free_block_queue.remove
        for block in blocks:
            ref_cnt = block.ref_cnt
            if ref_cnt == 0:
                # The null block's ref_cnt stays 0, so it is only seen on this branch.
                if block.is_null:
                    continue
                remove(block)
            block.ref_cnt = ref_cnt + 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks left unreferenced become free.

        Uncached blocks go to the front of the free queue in the given order (reused
        first); cached blocks go to the back in the given order (evicted last, LRU). Pass
        a request's blocks tail first so its tail is evicted before its head.

        Args:
            ordered_blocks: Distinct blocks, in eviction order (null blocks are skipped).

        Raises:
            FailedPreconditionError: A block is not referenced; nothing changes.
        """
        if type(ordered_blocks) is not list:
            # A rejected call walks the blocks again to undo; an iterator would be spent.
            ordered_blocks = list(ordered_blocks)
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        if self.enable_caching:
            for block in ordered_blocks:
                if block.is_null:
                    continue
                ref_cnt = block.ref_cnt - 1
                block.ref_cnt = ref_cnt
                if ref_cnt == 0:
                    if block.block_hash is None:
                        evict_first.append(block)
                    else:
                        evict_last.append(block)
                elif ref_cnt < 0:
                    self._undo_free(ordered_blocks, block)
        else:
            for block in ordered_blocks:
                if block.is_null:
                    continue
                ref_cnt = block.ref_cnt - 1
                block.ref_cnt = ref_cnt
                if ref_cnt == 0:
                    evict_first.append(block)
                elif ref_cnt < 0:
                    self._undo_free(ordered_blocks, block)
        queue = self.free_block_queue
        if evict_first:
            queue.prepend_n(evict_first)
        if evict_last:
            queue.append_n(evict_last)

    def _undo_free(self, ordered_blocks: Iterable[KVCacheBlock], bad: KVCacheBlock) -> None:
        # Restore the references dropped before `bad` (and on it), then reject the call.
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt += 1
            if block is bad:
                break
        raise FailedPreconditionError(
            f"block {bad.block_id} is freed more often than it is referenced"
        )

    # ------------------------------------------------------------------------ caching
    def cache_full_blocks(  # noqa: PLR0917 (vLLM's positional signature)
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Put ``blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache.

        Block ``i`` is keyed by the request's hash of its first ``(i + 1) * block_size``
        tokens. Null blocks and blocks masked out by ``block_mask`` are skipped. A block
        that holds a shorter (partial) entry is promoted: its old keys are removed first.
        Emits one ``BlockStored`` for the run.

        Args:
            request: The request that filled the blocks (its ``block_hashes``, tokens, LoRA,
                multi-modal features and session for the event).
            blocks: The request's block table for the group.
            num_cached_blocks: Leading blocks already cached.
            num_full_blocks: Leading blocks full after this call.
            block_size: Tokens per block of the group (a multiple of ``hash_block_size``).
            kv_cache_group_id: The group.
            block_mask: Optional, one flag per block of the run: False skips the block.

        Raises:
            InvalidArgumentError: The range, block size, mask or hashes do not fit; nothing
                changes.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        hash_block_size = self.hash_block_size
        scale = block_size // hash_block_size
        if scale < 1 or block_size != scale * hash_block_size:
            raise InvalidArgumentError(
                f"block_size must be a multiple of hash_block_size {hash_block_size}, "
                f"got {block_size}"
            )
        if num_cached_blocks < 0 or num_full_blocks > len(blocks):
            raise InvalidArgumentError(
                f"blocks [{num_cached_blocks}, {num_full_blocks}) are not in a table of "
                f"{len(blocks)} blocks"
            )
        request_hashes = request.block_hashes
        if num_full_blocks * scale > len(request_hashes):
            raise InvalidArgumentError(
                f"request {request.request_id!r} has {len(request_hashes)} block hashes, "
                f"caching {num_full_blocks} blocks of {block_size} tokens needs "
                f"{num_full_blocks * scale}"
            )
        num_new = num_full_blocks - num_cached_blocks
        if block_mask is not None and len(block_mask) != num_new:
            raise InvalidArgumentError(
                f"block_mask must have {num_new} entries, got {len(block_mask)}"
            )
        if scale == 1:
            new_hashes = request_hashes[num_cached_blocks:num_full_blocks]
        else:
            new_hashes = request_hashes[
                (num_cached_blocks + 1) * scale - 1 : num_full_blocks * scale : scale
            ]
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        suffix = _group_suffix(kv_cache_group_id)
        cached = self._cached
        # The keys made in one pass; the loop below notes only the exceptions (positions
        # skipped, keys already mapped), so the usual call, where every block is cached under
        # a new key, hands the index and the event these lists as they are, with no append
        # per block.
        keys: list[BlockHashWithGroupId] = [
            block_hash + suffix  # type: ignore[misc]
            for block_hash in new_hashes
        ]
        skipped: list[int] = []
        mapped: list[int] = []  # positions whose key had an entry already
        num_tokens = num_cached_blocks * block_size
        for position, (block, key) in enumerate(zip(new_blocks, keys, strict=True)):
            num_tokens += block_size
            if block.is_null or (block_mask is not None and not block_mask[position]):
                skipped.append(position)
                continue
            if block.block_hash is not None:
                # A partial entry of this block grows into a full one.
                self._emit_removed(self._drop_block_keys(block))
            entry = cached.get(key)
            if entry is None:
                cached[key] = block
            else:
                mapped.append(position)
                if isinstance(entry, dict):
                    entry[block.block_id] = block
                else:
                    cached[key] = {entry.block_id: entry, block.block_id: block}
            block.block_hash = key
            block.block_hash_num_tokens = num_tokens
        self._num_cached_blocks += len(keys) - len(skipped)
        if self._index is not None:
            if skipped or mapped:
                left_out = {*skipped, *mapped}
                new_keys = [key for i, key in enumerate(keys) if i not in left_out]
            else:
                new_keys = keys
            if new_keys:
                self._index_keys(new_keys)
        if self.enable_kv_cache_events:
            stored: list[bytes]
            if skipped:
                left_out = set(skipped)
                stored = [h for i, h in enumerate(new_hashes) if i not in left_out]
            else:
                stored = list(new_hashes)  # the event's own list
            self.kv_event_queue.append(
                self._full_blocks_stored_event(
                    request,
                    blocks,
                    stored,
                    num_cached_blocks,
                    num_full_blocks,
                    block_size,
                    kv_cache_group_id,
                    block_mask,
                )
            )

    def cache_partial_block(  # noqa: PLR0917 (vLLM's positional signature)
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId | None:
        """Make ``block`` reachable from a prefix boundary inside it (a partial entry).

        The key is the request's hash of its first ``num_tokens`` tokens. It becomes the
        block's primary key if the block has none, or replaces a shorter primary entry;
        otherwise it is added as a secondary key. Emits ``BlockStored`` (one hash block of
        tokens) unless the block was already cached under the key.

        Args:
            request: The request whose hashes and tokens define the entry.
            block: A block of the request.
            num_tokens: Prefix length of the entry: a positive multiple of
                ``hash_block_size``, at most the request's hashed tokens.
            kv_cache_group_id: The block's group.
            block_size: Tokens per block of the group (a multiple of ``hash_block_size``).
            replace_existing_hashes: Remove every existing key of the block first (its
                contents were rewritten).

        Returns:
            The key, or ``None`` for the null block.

        Raises:
            InvalidArgumentError: ``num_tokens`` or ``block_size`` does not fit; nothing
                changes.
        """
        if block.is_null:
            return None
        hash_block_size = self.hash_block_size
        if block_size <= 0 or block_size % hash_block_size:
            raise InvalidArgumentError(
                f"block_size must be a multiple of hash_block_size {hash_block_size}, "
                f"got {block_size}"
            )
        num_hash_blocks, remainder = divmod(num_tokens, hash_block_size)
        request_hashes = request.block_hashes
        if remainder or not 0 < num_hash_blocks <= len(request_hashes):
            raise InvalidArgumentError(
                f"num_tokens must be a positive multiple of {hash_block_size} covered by the "
                f"request's {len(request_hashes)} block hashes, got {num_tokens}"
            )
        block_hash = request_hashes[num_hash_blocks - 1]
        key = BlockHashWithGroupId(block_hash + _group_suffix(kv_cache_group_id))
        already_cached = block.block_hash == key or self._maps_to(key, block.block_id)
        if replace_existing_hashes:
            self._emit_removed(self._drop_block_keys(block))
            already_cached = False
        elif (
            not already_cached
            and block.block_hash_num_tokens is not None
            and block.block_hash_num_tokens < num_tokens
        ):
            self._emit_removed(self._drop_block_keys(block))
        self._add_key(key, block, num_tokens)
        if self.enable_kv_cache_events and not already_cached:
            self.kv_event_queue.append(
                self._partial_block_stored_event(request, num_hash_blocks, kv_cache_group_id)
            )
        return key

    def move_block_hashes(self, source: KVCacheBlock, target: KVCacheBlock) -> None:
        """Re-key ``source``'s prefix-cache entries to ``target`` (no events: they stay live).

        Used when the request owning ``source`` keeps writing into it while a private copy
        (``target``, uncached) holds the cached contents.

        Args:
            source: A cached block.
            target: An uncached block.

        Raises:
            FailedPreconditionError: ``target`` is cached already; nothing changes.
        """
        if target.block_hash is not None:
            raise FailedPreconditionError(
                f"block {target.block_id} is cached and cannot take block {source.block_id}'s "
                "prefix-cache entries"
            )
        num_tokens = source.block_hash_num_tokens
        for key in self._drop_block_keys(source):
            # The first key becomes the target's primary key, with the source's length.
            self._add_key(key, target, num_tokens if num_tokens is not None else 0)

    def drop_cached_block(self, block: KVCacheBlock) -> None:
        """Remove every prefix-cache entry of ``block`` (in use or not), emitting removals."""
        self._evict_cached_block(block)

    # ----------------------------------------------------------------------- eviction
    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks from the prefix cache; blocks in use stay allocated.

        Uncached ids are ignored. A free block stays where it is in the free queue.

        Args:
            block_ids: Block ids of this pool.

        Raises:
            InvalidArgumentError: An id is outside the pool; nothing is evicted.
        """
        ids = list(block_ids)
        num_blocks = self.num_gpu_blocks
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                raise InvalidArgumentError(
                    f"block_ids must be ints in [0, {num_blocks}), got {block_id!r}"
                )
        blocks = self.blocks
        batch = self._index_batch = None if self._index is None else []
        for block_id in ids:
            block = blocks[block_id]
            if block.block_hash is not None:
                self._evict_cached_block(block)
        if batch is not None:
            self._index_batch = None
            if batch:
                self._unindex_keys(batch)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, if no block is in use.

        Returns:
            ``True`` on success (an ``AllBlocksCleared`` event is recorded); ``False``, with
            nothing changed, while any block other than the null block is allocated.
        """
        if self.num_gpu_blocks - self.free_block_queue.num_free_blocks != 1:
            return False
        if self._index is not None:
            self._unindex_keys(self._cached)
        self._cached = {}
        self._secondary_keys.clear()
        for block in self.blocks:
            block.block_hash = None
            block.block_hash_num_tokens = None
        self._num_cached_blocks = 0
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -------------------------------------------------------------------------- state
    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free cached blocks included)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) in use, 0..1."""
        num_usable = self.num_gpu_blocks - 1
        if num_usable == 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / num_usable

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently in the prefix cache (in use or free)."""
        return self._num_cached_blocks

    @property
    def num_events_emitted(self) -> int:
        """Events recorded since the pool was created (taken or still queued)."""
        return self._num_events_taken + len(self.kv_event_queue)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the recorded events, oldest first (always empty when events are off)."""
        if not self.enable_kv_cache_events:
            return []
        events = self.kv_event_queue
        self.kv_event_queue = []
        self._num_events_taken += len(events)
        return events

    def cached_block_ids(self) -> dict[BlockHashWithGroupId, list[int]]:
        """The prefix cache as key -> block ids, first (answering) block first. O(cache)."""
        return {
            key: list(entry) if isinstance(entry, dict) else [entry.block_id]
            for key, entry in self._cached.items()
        }

    def attach_index(
        self,
        index: KeyIndexLike,
        slot: int,
        lock: AbstractContextManager[Any],
    ) -> None:
        """Keep ``slot`` in ``index``'s set of exactly the keys this pool caches.

        ``index`` maps a cache key to the slots of the pools caching it
        (:class:`kvcm.core.lookup.PrefixIndex` owns it, and ``lock``, held for every change
        since pools change it from several threads); the keys cached now are added at once
        (O(cache)), later changes as they happen. A pool is attached to at most one index.
        """
        self.detach_index()
        self._index = index
        self._index_slot = slot
        self._index_lock = lock
        # In batches: the compiled index holds the GIL for a whole call, and a server attaches
        # a large cache in a worker thread while its event loop keeps serving.
        keys = list(self._cached)
        for start in range(0, len(keys), _INDEX_BATCH):
            self._index_keys(keys[start : start + _INDEX_BATCH])

    def detach_index(self) -> None:
        """Clear this pool's bit from its index (O(cache)) and stop maintaining it."""
        if self._index is None:
            return
        self._unindex_keys(self._cached)
        self._index = None
        self._index_slot = 0
        self._index_lock = nullcontext()

    # ---------------------------------------------------------------------- internals
    def _index_keys(self, keys: Iterable[BlockHashWithGroupId]) -> None:
        index = self._index
        assert index is not None
        with self._index_lock:
            index.add(keys, self._index_slot)

    def _unindex_keys(self, keys: Iterable[BlockHashWithGroupId]) -> None:
        index = self._index
        assert index is not None
        with self._index_lock:
            index.discard(keys, self._index_slot)

    def _maps_to(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        entry = self._cached.get(key)
        if entry is None:
            return False
        if isinstance(entry, dict):
            return block_id in entry
        return entry.block_id == block_id

    def _add_key(self, key: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int) -> None:
        # Map `key` to `block`: as its primary key if it has none, else as a secondary one.
        if block.block_hash == key or self._maps_to(key, block.block_id):
            return
        if block.block_hash is None:
            block.block_hash = key
            block.block_hash_num_tokens = num_tokens
            self._num_cached_blocks += 1
        else:
            self._secondary_keys.setdefault(block.block_id, {})[key] = None
        cached = self._cached
        entry = cached.get(key)
        if entry is None:
            cached[key] = block
            if self._index is not None:
                self._index_keys((key,))
        elif isinstance(entry, dict):
            entry[block.block_id] = block
        else:
            cached[key] = {entry.block_id: entry, block.block_id: block}

    def _drop_block_keys(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        # Remove every key of `block` from the map; return the keys that mapped to it.
        primary = block.block_hash
        if primary is None:
            return []
        keys = [primary]
        secondary = self._secondary_keys.pop(block.block_id, None)
        if secondary:
            keys.extend(secondary)
        cached = self._cached
        block_id = block.block_id
        # Keys that leave the map leave the cross-pool index: into the eviction's batch when
        # one is open (appended here, no call per key: this is the allocator's hot path).
        batch = self._index_batch
        indexed = self._index is not None
        removed: list[BlockHashWithGroupId] = []
        for key in keys:
            entry = cached.get(key)
            if entry is None:
                continue
            if isinstance(entry, dict):
                if entry.pop(block_id, None) is None:
                    continue
                if not entry:
                    del cached[key]
                    if batch is not None:
                        batch.append(key)
                    elif indexed:
                        self._unindex_keys((key,))
            elif entry.block_id == block_id:
                del cached[key]
                if batch is not None:
                    batch.append(key)
                elif indexed:
                    self._unindex_keys((key,))
            else:
                continue
            removed.append(key)
        block.block_hash = None
        block.block_hash_num_tokens = None
        self._num_cached_blocks -= 1
        return removed

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        removed = self._drop_block_keys(block)
        if removed:
            self.num_evicted_blocks += 1
            self._emit_removed(removed)

    def _emit_removed(self, keys: list[BlockHashWithGroupId]) -> None:
        if not self.enable_kv_cache_events or not keys:
            return
        medium = self.medium
        append = self.kv_event_queue.append
        for key in keys:
            append(
                BlockRemoved(
                    block_hashes=[get_block_hash(key)],
                    medium=medium,
                    group_idx=get_group_id(key),
                )
            )

    def emit_cached_block_events(
        self, request: Request, num_cached_blocks: int, block_size: int, kv_cache_group_id: int
    ) -> None:
        """Record one ``BlockStored`` for the first ``num_cached_blocks`` blocks of a hit.

        vLLM's ``kv_cache_report_mode="full"``: blocks reused from the prefix cache are
        reported as if stored again (a contiguous prefix from block 0, so no parent), with
        the fields :meth:`cache_full_blocks` gives. Nothing about the blocks changes.

        Args:
            request: The request whose lookup hit.
            num_cached_blocks: The group's hit length in blocks (null blocks included); the
                blocks past the request's last full block are left out.
            block_size: The group's block size (a multiple of ``hash_block_size``).
            kv_cache_group_id: The group.
        """
        scale = block_size // self.hash_block_size
        hashes = request.block_hashes
        # A Mamba group's hit may end inside a block the request's tokens do not fill yet: that
        # block has no hash (vLLM raises IndexError there), so the report stops before it.
        num_cached_blocks = min(num_cached_blocks, len(hashes) // scale)
        if not self.enable_kv_cache_events or num_cached_blocks <= 0:
            return
        stored: list[bytes] = [hashes[(i + 1) * scale - 1] for i in range(num_cached_blocks)]
        lookahead: list[list[int]] | None = [] if self.num_hash_lookahead_tokens else None
        event_keys: list[tuple[Any, ...] | None] | None
        if lookahead is None and _has_no_extra_keys(request):
            event_keys = [None] * num_cached_blocks
        else:
            extra_keys: list[tuple[Any, ...] | None] = []
            mm_idx = 0
            for i in range(num_cached_blocks):
                end = (i + 1) * block_size
                keys, mm_idx = self._extra_keys(request, end - block_size, end, mm_idx)
                extra_keys.append(keys)
                if lookahead is not None:
                    lookahead.append(self._lookahead_ids(request, end))
            event_keys = to_event_extra_keys(extra_keys)
        self.kv_event_queue.append(
            self._stored_event(
                request,
                stored,
                None,
                request.all_token_ids[: num_cached_blocks * block_size],
                block_size,
                event_keys,
                kv_cache_group_id,
                lookahead,
            )
        )

    def _stored_event(  # noqa: PLR0917 (the event's own fields)
        self,
        request: Request,
        stored: list[bytes],
        parent: bytes | None,
        token_ids: list[int],
        block_size: int,
        event_keys: list[tuple[Any, ...] | None] | None,
        kv_cache_group_id: int,
        lookahead: list[list[int]] | None,
    ) -> BlockStored:
        """A ``BlockStored`` of ``stored`` with the request's LoRA and session, this pool's
        medium and the group's spec kind and window (``None`` when unset)."""
        metadata = self.event_metadata
        kind, sliding_window = (
            metadata[kv_cache_group_id] if 0 <= kv_cache_group_id < len(metadata) else (None, None)
        )
        return self.make_stored_event(  # type: ignore[no-any-return]
            stored,
            parent,
            token_ids,
            block_size,
            request.lora_id,
            self.medium,
            request.lora_name,
            event_keys,
            kv_cache_group_id,
            kind,
            sliding_window,
            request.session_id,
            lookahead,
        )

    def _extra_keys(
        self, request: Request, start: int, end: int, mm_idx: int
    ) -> tuple[tuple[Any, ...] | None, int]:
        # Event extra keys cover the same token window as the block hash.
        if self.num_hash_lookahead_tokens:
            return generate_lookahead_block_hash_extra_keys(
                request, start, end, end + self.num_hash_lookahead_tokens, mm_idx
            )
        return generate_block_hash_extra_keys(request, start, end, mm_idx)

    def _lookahead_ids(self, request: Request, end: int) -> list[int]:
        return request.all_token_ids[end : end + self.num_hash_lookahead_tokens]

    def _full_blocks_stored_event(  # noqa: PLR0917 (mirrors cache_full_blocks)
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        stored: list[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None,
    ) -> BlockStored:
        scale = block_size // self.hash_block_size
        parent = (
            None if num_cached_blocks == 0 else request.block_hashes[num_cached_blocks * scale - 1]
        )
        lookahead: list[list[int]] | None = [] if self.num_hash_lookahead_tokens else None
        event_keys: list[tuple[Any, ...] | None] | None
        if lookahead is None and _has_no_extra_keys(request):
            # Most requests: no LoRA, salt, multi-modal items or embeddings, so every stored
            # block's keys are None (what to_event_extra_keys makes of them); skip the
            # per-block key generation.
            event_keys = [None] * len(stored) if stored else None
        else:
            event_keys = to_event_extra_keys(
                self._stored_extra_keys(
                    request,
                    blocks,
                    num_cached_blocks,
                    num_full_blocks,
                    block_size,
                    block_mask,
                    lookahead,
                )
            )
        # ``stored`` is the caller's fresh list: the event owns it.
        return self._stored_event(
            request,
            stored,
            parent,
            request.all_token_ids[num_cached_blocks * block_size : num_full_blocks * block_size],
            block_size,
            event_keys,
            kv_cache_group_id,
            lookahead,
        )

    def _stored_extra_keys(  # noqa: PLR0917 (mirrors cache_full_blocks)
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        block_mask: Sequence[bool] | None,
        lookahead: list[list[int]] | None,
    ) -> list[tuple[Any, ...] | None]:
        # One entry per stored block (and its lookahead tokens, if on), skipping as caching did.
        extra_keys: list[tuple[Any, ...] | None] = []
        mm_idx = 0
        for i in range(num_cached_blocks, num_full_blocks):
            if blocks[i].is_null or (
                block_mask is not None and not block_mask[i - num_cached_blocks]
            ):
                continue
            start = i * block_size
            keys, mm_idx = self._extra_keys(request, start, start + block_size, mm_idx)
            extra_keys.append(keys)
            if lookahead is not None:
                lookahead.append(self._lookahead_ids(request, start + block_size))
        return extra_keys

    def _partial_block_stored_event(
        self, request: Request, num_hash_blocks: int, kv_cache_group_id: int
    ) -> BlockStored:
        # The event describes the last hash block of the prefix, chained to the one before.
        hash_block_size = self.hash_block_size
        request_hashes = request.block_hashes
        parent = request_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None
        end = num_hash_blocks * hash_block_size
        start = end - hash_block_size
        keys, _ = self._extra_keys(request, start, end, 0)
        return BlockStored(
            block_hashes=[request_hashes[num_hash_blocks - 1]],
            parent_block_hash=parent,
            token_ids=request.all_token_ids[start:end],
            block_size=hash_block_size,
            lora_id=request.lora_id,
            medium=self.medium,
            lora_name=request.lora_name,
            extra_keys=to_event_extra_keys([keys]),
            group_idx=kv_cache_group_id,
            session_id=request.session_id,
            lookahead_token_ids=(
                [self._lookahead_ids(request, end)] if self.num_hash_lookahead_tokens else None
            ),
        )
