"""Per-attention-type KV-cache managers: one block table per request for one KV-cache group.

Each manager answers four questions for its attention type, with vLLM 0.33's answers:

* which cached blocks a request may reuse (``find_longest_cache_hit``),
* which computed tokens attention never reads again (``get_num_skipped_tokens``; their blocks
  are freed by ``remove_skipped_blocks`` and replaced by the null block),
* how many free blocks an allocation consumes (``get_num_blocks_to_allocate``, which counts
  evictable hit blocks because touching them takes them off the free queue),
* how blocks are allocated, cached and freed.

In scope: full attention (also MLA and sink), sliding window (with vLLM's sparse prefix-cache
retention), chunked local attention, Mamba (with prefix caching in vLLM's "align" mode), and
cross attention. Sub-block ("partial") hash hits are served where vLLM 0.33 serves them: in a
hybrid pool with an align-mode Mamba group whose block is larger than the hash block, full
attention and Mamba find hits on hash-block boundaries, and a hit ending inside a block is
served through a private copy of that block (``take_pending_cow_copies``).

EAGLE/MTP drafters (vLLM's hidden-state speculative decoding): where vLLM drops the last
matched block of a hit (``use_eagle`` on a group: the drafter needs the hidden state of the
token before the generation point recomputed), full attention drops one block (one hash block
when it serves sub-block hits) and sliding window needs one more contiguous block and drops it;
lookahead block hashes (``BlockPool.num_hash_lookahead_tokens``) move the Mamba prefill
checkpoint back by the lookahead, and the drop by one hash block, as vLLM's
``get_mamba_prefill_checkpoint_position``. The drop with chunked local attention (vLLM
asserts), DCP/PCP and KV-connector boundary-state offloads are not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from kvcm.common.errors import ConfigError, FailedPreconditionError
from kvcm.common.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

if TYPE_CHECKING:
    from kvcm.common.hashing import BlockHash, BlockHashWithGroupId
    from kvcm.core.block import KVCacheBlock
    from kvcm.core.block_pool import BlockPool
    from kvcm.core.request import Request

__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "GroupHit",
    "ManagerOptions",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "get_manager_for_kv_cache_spec",
]


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def hashes_at_block_size(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    """View hashes computed every ``hash_block_size`` tokens at ``block_size`` granularity.

    Hashes are chained over the whole prefix, so the hash at the last hash boundary inside a
    larger block fingerprints that block's prefix.
    """
    if block_size == hash_block_size:
        return block_hashes
    scale = block_size // hash_block_size
    return block_hashes[scale - 1 :: scale]


class GroupHit(NamedTuple):
    """A cache hit for the groups of one spec: hit blocks per group, and the hit length."""

    blocks: tuple[list[KVCacheBlock], ...]
    num_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ManagerOptions:
    """Construction settings shared by every manager of one coordinator.

    Attributes:
        enable_caching: Whether managers cache and look up full blocks.
        scheduler_block_size: Token granularity of hits (lcm of the groups' block sizes).
        max_model_len: Longest sequence, in tokens.
        max_in_flight_tokens: Most tokens scheduled but not yet settled, for admission caps.
        records_new_block_ids: Whether attention managers record new block ids for zeroing.
        retention_interval: Which sliding-window blocks enter the prefix cache (vLLM's
            ``prefix_cache_retention_interval``): ``None`` every block that can serve a hit;
            ``0`` only the window before each replay boundary or shared-prefix junction;
            ``n > 0`` those plus the window before every ``n``-token boundary.
        cache_hit_alignment_tokens: Granularity of hits when it differs from the scheduler
            block size: the hash block size of a hybrid pool serving sub-block hits.
    """

    enable_caching: bool
    scheduler_block_size: int
    max_model_len: int
    max_in_flight_tokens: int
    records_new_block_ids: bool
    retention_interval: int | None = None
    cache_hit_alignment_tokens: int | None = None


class SingleTypeKVCacheManager:
    """Block tables of one KV-cache group, for one attention type.

    Attributes:
        kv_cache_spec: The group's spec.
        block_size: Tokens per block.
        block_pool: The shared block pool.
        kv_cache_group_id: Index of the group in the KV-cache config.
        enable_caching: Whether this group caches and looks up full blocks.
        cache_hit_alignment_tokens: Granularity of cache hits (the scheduler block size, or
            the hash block size where sub-block hits are served).
        req_to_blocks: Request id -> its block table (null blocks stand for skipped blocks).
        num_cached_block: Request id -> how many leading blocks are already cached.
        use_eagle: Whether this group's hits drop their last matched block for an EAGLE/MTP
            drafter (set by the coordinator, as vLLM's); it also moves what is cached.
    """

    # Whether the manager can find hits on hash-block boundaries inside its blocks.
    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    # NOTE: the null block's ref_cnt is not maintained; it is never freed or touched here.

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        options: ManagerOptions,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        """Create the manager of one group.

        Args:
            kv_cache_spec: The group's spec.
            block_pool: The pool shared by all groups.
            kv_cache_group_id: Index of the group.
            options: Settings shared by all managers.
            max_admission_blocks_per_request: Per-request cap used by the full-sequence
                admission check for attention types that recycle blocks; ``None``: no cap.
        """
        self.kv_cache_spec = kv_cache_spec
        self.block_size: int = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = options.enable_caching
        self.cache_hit_alignment_tokens = (
            options.cache_hit_alignment_tokens or options.scheduler_block_size
        )
        self.retention_interval = options.retention_interval
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        # Only attention blocks are zeroed by workers; Mamba states are written before read.
        self.records_new_block_ids = options.records_new_block_ids and isinstance(
            kv_cache_spec, AttentionSpec
        )
        self.new_block_ids: list[int] = []
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        # Sub-block hits: request -> (index, shared block) of a hit ending inside a block,
        # redirected to a private copy at the next allocation; copies not yet handed out.
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self.use_eagle = False

    def set_use_eagle(self, use_eagle: bool) -> None:
        """Mark the group as one whose hits drop their last block (vLLM's ``use_eagle``)."""
        self.use_eagle = use_eagle

    # ----------------------------------------------------------------- attention window
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens attention no longer reads once ``num_computed_tokens`` are computed.

        Args:
            num_computed_tokens: Tokens computed so far.

        Returns:
            The number of skipped tokens (0 for full attention).
        """
        return 0

    @property
    def skips_tokens(self) -> bool:
        """Whether this attention type ever frees blocks before the request finishes."""
        return False

    # ----------------------------------------------------------------------- estimates
    def _has_partial_local_hit(
        self, new_computed_blocks: Sequence[KVCacheBlock], num_local_computed_tokens: int
    ) -> bool:
        # A hit ending inside one of this group's blocks: that shared block is copied.
        return bool(new_computed_blocks) and num_local_computed_tokens % self.block_size != 0

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        *,
        num_local_computed_tokens: int = 0,
        num_tokens_main_model: int | None = None,
        prefill_end: int = 0,
    ) -> int:
        """Free blocks an allocation up to ``num_tokens`` slots would consume.

        Args:
            request_id: The request.
            num_tokens: Token slots needed in total (including those already allocated).
            new_computed_blocks: Cache-hit blocks about to be adopted.
            total_computed_tokens: Local plus external computed tokens.
            apply_admission_cap: Apply the per-request cap of recycling attention types
                (full-sequence admission check only).
            num_local_computed_tokens: Locally computed tokens, hit included (a hit ending
                inside a block needs one more block for its private copy).
            num_tokens_main_model: ``num_tokens`` without lookahead (draft) slots; ``None``:
                ``num_tokens``. Read by align-mode Mamba only.
            prefill_end: Where the request's prefill ends when only the prefill-end
                checkpoint is retained (0 otherwise). Read by align-mode Mamba only.

        Returns:
            New blocks to take from the free queue, plus hit blocks that are evictable.
        """
        num_blocks = self._num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens, apply_admission_cap
        )
        if num_local_computed_tokens and self._has_partial_local_hit(
            new_computed_blocks, num_local_computed_tokens
        ):
            # The private copy of the hit's last block.
            num_blocks += 1
        return num_blocks

    def _num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool,
    ) -> int:
        num_required_blocks = _cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required_blocks = min(num_required_blocks, self.max_admission_blocks_per_request)
        req_blocks = self.req_to_blocks.get(request_id)
        num_req_blocks = 0 if req_blocks is None else len(req_blocks)
        if request_id in self.num_cached_block:
            # A running request gets no new hits; draft tokens may have over-allocated.
            return max(num_required_blocks - num_req_blocks, 0)

        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed_blocks = len(new_computed_blocks) + num_req_blocks
        num_new_blocks = max(
            num_required_blocks - max(num_skipped_blocks, num_local_computed_blocks), 0
        )
        # Hit blocks before the window become null blocks and are never touched.
        first_kept = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = 0
        for block in new_computed_blocks[first_kept:]:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        return num_new_blocks + num_evictable

    # ---------------------------------------------------------------------- allocation
    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_total_computed_tokens: int,
        num_local_computed_tokens: int = 0,
    ) -> None:
        """Adopt a new request's cache-hit blocks, touching them so they cannot be evicted.

        Args:
            request_id: The request (it holds no blocks yet).
            new_computed_blocks: Its hit blocks (null blocks for skipped positions allowed).
            num_total_computed_tokens: Local plus external computed tokens.
            num_local_computed_tokens: Locally computed tokens, hit included; a hit ending
                inside a block is redirected to a private copy at the next allocation.
        """
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_skipped_blocks = self.get_num_skipped_tokens(num_total_computed_tokens) // (
            self.block_size
        )
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        if num_skipped_blocks > 0:
            req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        # Hits (and the null padding) are cached already; cache_blocks starts after them.
        self.num_cached_block[request_id] = len(req_blocks)
        if num_local_computed_tokens and self._has_partial_local_hit(
            new_computed_blocks, num_local_computed_tokens
        ):
            # The shared last block is copied at allocation; the copy is cached again once
            # full, so the cached count stops before it.
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, new_computed_blocks[-1])
            self.num_cached_block[request_id] = block_idx

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Allocate blocks for tokens a KV connector computed, skipping those out of window.

        Runs after every group adopted its hits, so it cannot evict another group's hits.

        Args:
            request_id: The request.
            num_local_computed_tokens: Tokens computed locally (including cache hits).
            num_external_computed_tokens: Tokens computed by the connector.
            record_for_zeroing: Whether the new blocks need zeroing (not when an
                asynchronous load writes them after this step).
        """
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(
                num_total - num_skipped_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = max(0, _cdiv(num_total, self.block_size) - len(req_blocks))
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.records_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend([block.block_id for block in new_blocks])

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        """Grow the request's table to at least ``num_tokens`` slots.

        A hit that ended inside a block first gets its private copy of that block.

        Args:
            request_id: The request.
            num_tokens: Token slots needed in total.
            num_tokens_main_model: ``num_tokens`` without lookahead slots (align-mode Mamba
                only; ``None``: ``num_tokens``).

        Returns:
            The newly allocated blocks (possibly none), the private copy first.
        """
        cow_blocks: list[KVCacheBlock] = []
        if self._partial_hit_reqs:
            partial = self._partial_hit_reqs.pop(request_id, None)
            if partial is not None:
                cow_block = self.block_pool.get_new_blocks(1)[0]
                self._apply_cow(request_id, partial[0], partial[1], cow_block)
                # vLLM records the copy's id for zeroing whatever the group's type.
                self.new_block_ids.append(cow_block.block_id)
                cow_blocks.append(cow_block)
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_new_blocks = _cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return cow_blocks
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.records_new_block_ids:
            self.new_block_ids.extend([block.block_id for block in new_blocks])
        return cow_blocks + new_blocks if cow_blocks else new_blocks

    def _apply_cow(
        self, request_id: str, block_idx: int, source: KVCacheBlock, cow_block: KVCacheBlock
    ) -> None:
        # Put the private copy in the shared block's place and queue the copy. Both ends
        # stay referenced until the copy ran: the source keeps the request's reference, the
        # copy takes one more than the request's (released with take_pending_cow_copies).
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks[block_idx] is not source or source.is_null or source.ref_cnt <= 0:
            raise FailedPreconditionError(
                f"request {request_id!r}: block {block_idx} of group {self.kv_cache_group_id} "
                "is not the shared block its sub-block hit adopted"
            )
        req_blocks[block_idx] = cow_block
        self._pending_cow_copies.append((source, cow_block))
        cow_block.ref_cnt += 1

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Drain the (source, copy) block pairs queued since the last call.

        Each pair holds one extra reference on both blocks, which the caller drops (after
        the copy ran) with ``block_pool.free_blocks``.
        """
        copies = self._pending_cow_copies
        self._pending_cow_copies = []
        return copies

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids of blocks allocated since the last call (for worker-side zeroing)."""
        ids = self.new_block_ids
        self.new_block_ids = []
        return ids

    # ------------------------------------------------------------------------- caching
    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        boundaries: Sequence[int] = (),
        *,
        junction: int = 0,
    ) -> None:
        """Cache the request's blocks that became full within its first ``num_tokens`` tokens.

        Args:
            request: The request (its ``block_hashes`` name the blocks).
            num_tokens: Tokens to cache, including those cached already.
            boundaries: Token positions a later request may resume at (its replay boundary
                and any shared-prefix junction); sparse retention keeps the blocks a hit
                there needs. Dense managers ignore them.
            junction: The request's shared-prefix junction (0: none; align-mode Mamba keys
                a state there).
        """
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_hashed_tokens = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full_blocks = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            num_cached_blocks,
            num_full_blocks,
            self.block_size,
            self.kv_cache_group_id,
            self._block_mask(num_cached_blocks, num_full_blocks, boundaries),
        )
        self.num_cached_block[request_id] = num_full_blocks

    def _block_mask(
        self, start_block: int, end_block: int, boundaries: Sequence[int]
    ) -> list[bool] | None:
        """Which of the blocks ``[start_block, end_block)`` to cache (None: all)."""
        return None

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        alignment_tokens: int,
        drop_eagle_block: bool = False,
    ) -> GroupHit:
        """Longest prefix of at most ``max_length`` tokens cached for every listed group.

        The manager acts for all groups of its spec; it reads only its spec and pool.

        Args:
            block_hashes: The request's hashes at the pool's hash block size.
            max_length: Upper bound of the hit, in tokens.
            kv_cache_group_ids: Groups that must all hit (they share this spec).
            alignment_tokens: The hit length is a multiple of this.
            drop_eagle_block: Drop the last matched block (EAGLE/MTP), as vLLM's.

        Returns:
            Hit blocks per group (null blocks where the window skips) and the hit length.
        """
        raise ConfigError(
            f"{type(self).__name__} of group {self.kv_cache_group_id} does not support "
            "prefix caching"
        )

    # ------------------------------------------------------------------------- release
    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first so tails are evicted before heads.

        Args:
            request_id: The request; unknown ids are ignored (aborted before allocation).
        """
        req_blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if self._partial_hit_reqs:
            self._partial_hit_reqs.pop(request_id, None)
        if not req_blocks:
            return
        start = 0
        null_block = self._null_block
        if req_blocks[0] is null_block:
            # Skipped blocks are a leading run of nulls; they are not pool-owned.
            while start < len(req_blocks) and req_blocks[start] is null_block:
                start += 1
        self.block_pool.free_blocks(req_blocks[: start - 1 if start else None : -1])

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget a request as :meth:`free` does, but hand its blocks back instead of
        releasing them (vLLM's deferred free: the caller releases every group's blocks in one
        pool call, :meth:`~kvcm.core.coordinator.KVCacheCoordinator.free_in_one_call`).

        Returns:
            The request's blocks in table order, past its leading null blocks (none for an
            unknown id).
        """
        req_blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if self._partial_hit_reqs:
            self._partial_hit_reqs.pop(request_id, None)
        if not req_blocks:
            return []
        start = 0
        null_block = self._null_block
        while start < len(req_blocks) and req_blocks[start] is null_block:
            start += 1
        return req_blocks[start:] if start else req_blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks attention no longer reads and put the null block in their place.

        Args:
            request_id: The request.
            num_computed_tokens: Processed (committed) computed tokens.
        """
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        last_block = min(num_skipped_tokens // self.block_size, len(blocks))
        null_block = self._null_block
        freed: list[KVCacheBlock] = []
        # Walk backwards and stop at the first null: everything before it was removed earlier.
        for i in range(last_block - 1, -1, -1):
            block = blocks[i]
            if block is null_block:
                break
            freed.append(block)
            blocks[i] = null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of ``request_id`` shared by every request this manager tracks.

        Args:
            request_id: A running request.

        Returns:
            The number of leading blocks whose ref_cnt equals the number of requests here;
            0 for attention types whose tables start with null blocks.
        """
        return 0

    def new_step_starts(self) -> None:
        """Hook called at the start of every scheduler step."""
        return


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (also MLA and sink attention): every block is kept until the end."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        alignment_tokens: int,
        drop_eagle_block: bool = False,
    ) -> GroupHit:
        """Scan left to right; the first miss ends the hit (hashes are chained)."""
        block_size = self.block_size
        hashes = hashes_at_block_size(block_hashes, self.block_pool.hash_block_size, block_size)
        max_num_blocks = min(max_length // block_size, len(hashes))
        get_cached_block = self.block_pool.get_cached_block
        group_ids = list(kv_cache_group_ids)
        computed: tuple[list[KVCacheBlock], ...]
        if len(group_ids) == 1:
            hit: list[KVCacheBlock] = []
            for i in range(max_num_blocks):
                cached = get_cached_block(hashes[i], group_ids)
                if not cached:
                    break
                hit.append(cached[0])
            computed = (hit,)
        else:
            computed = tuple([] for _ in group_ids)
            for i in range(max_num_blocks):
                cached = get_cached_block(hashes[i], group_ids)
                if not cached:
                    break
                for group_blocks, block in zip(computed, cached, strict=True):
                    group_blocks.append(block)
        hit_length = len(computed[0]) * block_size
        if alignment_tokens < block_size:
            # Sub-block hits: extend into the first block that missed, at its last cached
            # hash boundary.
            extended = self._extend_into_partial_block(
                block_hashes, max_length, group_ids, alignment_tokens, computed, hit_length
            )
            if not (drop_eagle_block and extended.num_tokens):
                return extended
            computed, hit_length = extended
        if drop_eagle_block and hit_length:
            # The drafter needs the tokens before the generation point recomputed: one hash
            # unit fewer with sub-block hits (the tail block still covers it), else a block.
            hit_length -= min(alignment_tokens, block_size)
        hit_length -= hit_length % alignment_tokens
        num_blocks = _cdiv(hit_length, block_size)
        for group_blocks in computed:
            del group_blocks[num_blocks:]
        return GroupHit(computed, hit_length)

    def _extend_into_partial_block(  # noqa: PLR0917
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: list[int],
        hash_block_size: int,
        computed: tuple[list[KVCacheBlock], ...],
        hit_length: int,
    ) -> GroupHit:
        # `block_hashes` are hash-block granular here (the alignment is the hash block).
        scale = self.block_size // hash_block_size
        first = len(computed[0]) * scale
        last = min(first + scale - 1, max_length // hash_block_size, len(block_hashes))
        get_cached_block = self.block_pool.get_cached_block
        for fine_idx in range(last - 1, first - 1, -1):
            cached = get_cached_block(block_hashes[fine_idx], group_ids)
            if cached:
                for group_blocks, block in zip(computed, cached, strict=True):
                    group_blocks.append(block)
                return GroupHit(computed, (fine_idx + 1) * hash_block_size)
        return GroupHit(computed, hit_length)

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        boundaries: Sequence[int] = (),
        *,
        junction: int = 0,
    ) -> None:
        """Cache full blocks, then the prompt's last hash boundary inside a block, if any."""
        super().cache_blocks(request, num_tokens)
        hash_block_size = self.block_pool.hash_block_size
        if self.block_size != hash_block_size:
            self._cache_partial_tail_block(request, num_tokens, hash_block_size)

    def _cache_partial_tail_block(
        self, request: Request, num_tokens: int, hash_block_size: int
    ) -> None:
        # A resend of the same prompt hits at most num_prompt_tokens - 1 tokens (an EAGLE
        # lookup reads the whole prompt, then drops a hash unit); when that boundary falls
        # inside one of this group's (larger) blocks, vLLM registers the block under the
        # boundary's hash as a secondary, partial entry.
        token_limit = request.num_prompt_tokens - (0 if self.use_eagle else 1)
        boundary_tokens = (
            min(token_limit // hash_block_size, len(request.block_hashes)) * hash_block_size
        )
        if boundary_tokens == 0 or boundary_tokens > num_tokens:
            return
        if boundary_tokens % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        block_idx = boundary_tokens // self.block_size
        if block_idx >= len(blocks):
            return
        self.block_pool.cache_partial_block(
            request, blocks[block_idx], boundary_tokens, self.kv_cache_group_id, self.block_size
        )

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        """Count leading blocks held by every request of this group."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        num_requests = len(self.req_to_blocks)
        num_common = 0
        for block in blocks:
            if block.ref_cnt != num_requests:
                break
            num_common += 1
        return num_common


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: only the last ``sliding_window - 1`` tokens stay readable."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        options: ManagerOptions,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        """Create the manager; see ``SingleTypeKVCacheManager``."""
        super().__init__(
            kv_cache_spec, block_pool, kv_cache_group_id, options, max_admission_blocks_per_request
        )
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        self.sliding_window: int = kv_cache_spec.sliding_window
        # Tokens kept below the window (never read) for multi-token speculative re-prefill.
        self.extra_retained_tokens: int = kv_cache_spec.extra_retained_tokens
        # Contiguous cached blocks that make a hit: the window before the next token.
        self._window_blocks = _cdiv(self.sliding_window - 1, self.block_size)
        self.contiguous_blocks_for_hit = self._window_blocks
        self._mask_period = self._cache_mask_period()
        # Blocks are block-granular; a sub-block alignment cannot be masked (cache all).
        self._maskable = self.cache_hit_alignment_tokens % self.block_size == 0

    def set_use_eagle(self, use_eagle: bool) -> None:
        """As the base class; an EAGLE group's hit needs one more block (the one dropped),
        so what the mask keeps moves one block up."""
        super().set_use_eagle(use_eagle)
        self.contiguous_blocks_for_hit = self._window_blocks + int(use_eagle)
        self._mask_period = self._cache_mask_period()

    def _cache_mask_period(self) -> int | None:
        # Hits land on multiples of the alignment; only the last `contiguous_blocks_for_hit`
        # blocks before each segment's end can serve one. The segment is the alignment when
        # dense, the retention interval when periodic; None: no periodic segments (retention
        # 0); 0: every block is kept.
        alignment = self.cache_hit_alignment_tokens
        if alignment % self.block_size != 0:
            return 0
        retention = self.retention_interval
        if retention == 0:
            return None
        segment = alignment if retention is None else retention
        per_segment = segment // self.block_size
        if self.contiguous_blocks_for_hit >= per_segment:
            return 0
        return per_segment

    @property
    def skips_tokens(self) -> bool:
        """Sliding windows free blocks as the window moves."""
        return True

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token (and its extra retained tail)."""
        return max(0, num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens)

    def _block_mask(
        self, start_block: int, end_block: int, boundaries: Sequence[int]
    ) -> list[bool] | None:
        if not self._maskable:
            return None
        period = self._mask_period
        if period == 0:
            return None
        need = self.contiguous_blocks_for_hit
        # An EAGLE hit's run ends one block past the boundary (the block it drops).
        shift = int(self.use_eagle)
        if period is None:
            mask = [False] * (end_block - start_block)
        else:
            first_kept = period - need
            mask = [
                i >= shift and (i - shift) % period >= first_kept
                for i in range(start_block, end_block)
            ]
        if self.retention_interval is not None:
            # Sparse retention: keep the window that ends on each resume point (floored to
            # the alignment), whatever the periodic segments keep.
            alignment = self.cache_hit_alignment_tokens
            block_size = self.block_size
            for boundary in boundaries:
                end = boundary // alignment * alignment // block_size + shift
                for i in range(max(start_block, end - need), min(end_block, end)):
                    mask[i - start_block] = True
        return mask

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        alignment_tokens: int,
        drop_eagle_block: bool = False,
    ) -> GroupHit:
        """Scan right to left for the last run of cached blocks that covers a window (and,
        for EAGLE, one block more, dropped after the match)."""
        block_size = self.block_size
        pool = self.block_pool
        hashes = hashes_at_block_size(block_hashes, pool.hash_block_size, block_size)
        group_ids = list(kv_cache_group_ids)
        need = self._window_blocks + int(drop_eagle_block)
        max_num_blocks = min(max_length // block_size, len(hashes))
        computed = tuple([pool.null_block] * max_num_blocks for _ in group_ids)
        aligned = block_size == alignment_tokens
        num_contiguous = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            cached = pool.get_cached_block(hashes[i], group_ids)
            if not cached:
                num_contiguous = 0
                continue
            # A run must end on an aligned boundary (after the EAGLE drop, if any).
            if (
                num_contiguous == 0
                and not aligned
                and ((i + 1 - int(drop_eagle_block)) * block_size) % alignment_tokens
            ):
                continue
            for group_blocks, block in zip(computed, cached, strict=True):
                group_blocks[i] = block
            num_contiguous += 1
            if num_contiguous >= need:
                for group_blocks in computed:
                    del group_blocks[i + num_contiguous :]
                match_found = True
                break
        if not match_found:
            # A run reaching the first block is a hit even if shorter than the window.
            for group_blocks in computed:
                del group_blocks[num_contiguous:]
            if not aligned:
                while len(computed[0]) * block_size % alignment_tokens:
                    for group_blocks in computed:
                        group_blocks.pop()
        if drop_eagle_block and computed[0]:
            for group_blocks in computed:
                group_blocks.pop()
            if not aligned:
                while len(computed[0]) * block_size % alignment_tokens:
                    for group_blocks in computed:
                        group_blocks.pop()
        return GroupHit(computed, len(computed[0]) * block_size)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: a token reads only the tokens of its own chunk."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        options: ManagerOptions,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        """Create the manager; see ``SingleTypeKVCacheManager``."""
        super().__init__(
            kv_cache_spec, block_pool, kv_cache_group_id, options, max_admission_blocks_per_request
        )
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        self.attention_chunk_size: int = kv_cache_spec.attention_chunk_size

    @property
    def skips_tokens(self) -> bool:
        """Whole chunks behind the current one are freed."""
        return True

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the chunk of the next token."""
        chunk = self.attention_chunk_size
        return num_computed_tokens // chunk * chunk

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        alignment_tokens: int,
        drop_eagle_block: bool = False,
    ) -> GroupHit:
        """Blocks before the current chunk count as hits (null); scan the chunk's blocks
        (never with an EAGLE drop: the coordinator refuses one, as vLLM does)."""
        block_size = self.block_size
        pool = self.block_pool
        hashes = hashes_at_block_size(block_hashes, pool.hash_block_size, block_size)
        group_ids = list(kv_cache_group_ids)
        max_num_blocks = min(max_length // block_size, len(hashes))
        chunk = self.attention_chunk_size
        local_start_block = (max_length // chunk * chunk if max_length > 0 else 0) // block_size
        computed = tuple([pool.null_block] * local_start_block for _ in group_ids)
        for i in range(local_start_block, max_num_blocks):
            cached = pool.get_cached_block(hashes[i], group_ids)
            if not cached:
                break
            for group_blocks, block in zip(computed, cached, strict=True):
                group_blocks.append(block)
        return GroupHit(computed, len(computed[0]) * block_size)


def _checkpoint_position(
    num_tokens: int, granularity: int, num_lookahead: int = 0, drop_eagle_block: bool = False
) -> int:
    """The last reusable Mamba state of a ``num_tokens`` prefill, on a ``granularity`` boundary.

    At least one token is left to recompute (a resend needs its logits), and with lookahead
    block hashes the ``num_lookahead`` tokens the checkpoint's hash covers, so the position is
    strictly below ``num_tokens``. With EAGLE's trailing-block drop the checkpoint is one unit
    below the last boundary, where full attention's hit lands after its drop.
    """
    if drop_eagle_block:
        return max(num_tokens // granularity * granularity - granularity, 0)
    return max((num_tokens - max(1, num_lookahead)) // granularity * granularity, 0)


class MambaManager(SingleTypeKVCacheManager):
    """Mamba state blocks.

    Without prefix caching ("none" mode) only the latest state (and the speculative blocks)
    is kept. In vLLM's "align" mode (prefix caching) the state after every block boundary is
    a checkpoint that may enter the prefix cache: the table holds one block per
    ``block_size`` tokens, null except for the states still needed (the running one, the one
    it was read from, the speculative blocks, a prefill checkpoint) and states whose blocks
    were cached. A hit is the last cached checkpoint at or below the candidate length.
    """

    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        options: ManagerOptions,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        """Create the manager; prefix caching needs "align" mode, as in vLLM."""
        super().__init__(
            kv_cache_spec, block_pool, kv_cache_group_id, options, max_admission_blocks_per_request
        )
        assert isinstance(kv_cache_spec, MambaSpec)
        self.align = kv_cache_spec.mamba_cache_mode == "align"
        # EAGLE's trailing-block drop in the pool (any group): checkpoints back off a unit.
        self.drop_eagle_checkpoint_block = False
        # vLLM's shared-prefix checkpoint (set by the manager when its predicate holds): the
        # state at a request's junction is keyed as well as the prompt's last hash boundary.
        self.shared_prefix_checkpoint = False
        if options.enable_caching and not self.align:
            raise ConfigError(
                f"group {kv_cache_group_id}: Mamba prefix caching requires mamba_cache_mode='align'"
            )
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        # Speculative decoding keeps extra state blocks after the running one.
        self._num_speculative_tokens = kv_cache_spec.num_speculative_blocks * self.block_size
        self._has_prefill_checkpoint_blocks = (
            self.align and kv_cache_spec.num_prefill_checkpoint_blocks > 0
        )
        self._checkpoint_alignment = kv_cache_spec.prefill_checkpoint_alignment
        # Keys cached this step: another request's state there is written by this step's
        # forward, so a hit on it waits for the next step.
        self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()
        # Align-mode bookkeeping per request: where the previous step's running state is,
        # how many leading blocks were retired, whether it allocated since its hit, and
        # the prefill checkpoint (position, block index) of the current allocation.
        self._last_state_block_idx: dict[str, int] = {}
        self._num_retired_blocks: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()
        self._checkpoints: dict[str, tuple[int, int]] = {}
        # KV-connector hand-offs of align-mode boundary states (vLLM's
        # take_boundary_state_offloads / finalize_partial_tail_offload), kept only once
        # enable_boundary_state_offloads() was called (an engine with a KV connector drains
        # them every step; a pool nobody drains must not collect them). Entries are
        # (request_id, group_id, block, boundary_tokens); a producer's partial tail is the
        # block that holds the state at its prompt's last hash boundary inside a block.
        self.records_boundary_state_offloads = False
        self._pending_boundary_state_offloads: list[tuple[str, int, KVCacheBlock, int]] = []
        self._producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]] = {}

    def enable_boundary_state_offloads(self) -> None:
        """Collect boundary-state hand-offs for a KV connector (align mode only)."""
        self.records_boundary_state_offloads = self.align

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """Drain the boundary states offered to a KV connector since the last call.

        Returns:
            ``(request_id, group_id, block, boundary_tokens)`` in the order they were made:
            every state block cached (its block keyed at ``boundary_tokens``), and the copy of
            a producer's partial tail when a copy-on-write preserved it.
        """
        pending = self._pending_boundary_state_offloads
        if not pending:
            return []
        self._pending_boundary_state_offloads = []
        return pending

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """A finishing producer's partial tail, if its table block still holds that state.

        The block is valid only if no token after the boundary was computed or is in flight.
        The tail is consumed either way.
        """
        tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if tail is None:
            return None
        block, boundary_tokens = tail
        if num_in_flight_tokens != 0 or num_computed_tokens != boundary_tokens:
            return None
        return self.kv_cache_group_id, block, boundary_tokens

    @property
    def skips_tokens(self) -> bool:
        """Every state but the last is freed."""
        return True

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Only the state after the last computed token is needed."""
        return num_computed_tokens - 1

    # ------------------------------------------------------------------------- lookups
    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        alignment_tokens: int,
        drop_eagle_block: bool = False,
    ) -> GroupHit:
        """Scan right to left for the last cached state; blocks before it are null.

        A Mamba finder never drops (draft models have no Mamba layers), as vLLM's.

        With sub-block hits (alignment below the block size) every hash boundary is probed;
        otherwise every block boundary that lands on the alignment.
        """
        pool = self.block_pool
        null_block = self._null_block
        group_ids = list(kv_cache_group_ids)
        block_size = self.block_size
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            scale = block_size // alignment_tokens
            num_units = min(max_length // alignment_tokens, len(block_hashes))
            for fine_idx in range(num_units - 1, -1, -1):
                cached = pool.get_cached_block(block_hashes[fine_idx], group_ids)
                if cached:
                    num_null = fine_idx // scale
                    blocks = tuple([null_block] * num_null + [block] for block in cached)
                    return GroupHit(blocks, (fine_idx + 1) * alignment_tokens)
            return GroupHit(tuple([] for _ in group_ids), 0)
        hashes = hashes_at_block_size(block_hashes, pool.hash_block_size, block_size)
        for i in range(min(max_length // block_size, len(hashes)) - 1, -1, -1):
            cached = pool.get_cached_block(hashes[i], group_ids)
            if not cached:
                continue
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens:
                continue
            blocks = tuple([null_block] * i + [block] for block in cached)
            return GroupHit(blocks, (i + 1) * block_size)
        return GroupHit(tuple([] for _ in group_ids), 0)

    # ----------------------------------------------------------------------- estimates
    def _needs_internal_checkpoint(
        self,
        request_id: str,
        query_start: int,
        query_end: int,
        checkpoint_position: int,
        prefill_end: int,
    ) -> bool:
        # Whether this chunk exports a prefill checkpoint into a reserved block: the backend
        # must be able to (vLLM's is_mamba_prefill_checkpoint_valid), and the checkpoint's
        # column must not already hold a live state.
        alignment = self._checkpoint_alignment
        if not self._has_prefill_checkpoint_blocks or query_end < prefill_end or not alignment:
            return False
        block_size = self.block_size
        hash_block_size = self.block_pool.hash_block_size
        checkpoint_idx = _cdiv(query_end, block_size) - 2
        initial_state_idx = (query_start - 1) // block_size
        if not (
            query_start % hash_block_size == 0
            and checkpoint_idx > initial_state_idx
            and query_start + hash_block_size <= checkpoint_position
            and query_start < checkpoint_position < query_end
            and (checkpoint_position - query_start) % alignment == 0
            and checkpoint_idx >= 0
        ):
            return False
        blocks = self.req_to_blocks.get(request_id, ())
        return (
            checkpoint_idx >= len(blocks)
            or blocks[checkpoint_idx].is_null
            or (
                request_id in self._allocated_block_reqs
                and checkpoint_idx >= len(blocks) - self.num_speculative_blocks
            )
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        *,
        num_local_computed_tokens: int = 0,
        num_tokens_main_model: int | None = None,
        prefill_end: int = 0,
    ) -> int:
        """As the base class, with the speculative state blocks; align mode counts states.

        A hit on a state cached by another request this step answers more blocks than the
        pool holds, so the request waits for the next step.
        """
        if new_computed_blocks and new_computed_blocks[-1].block_hash in (
            self.cached_blocks_this_step
        ):
            return self.block_pool.num_gpu_blocks + 1
        if not self.align:
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self._num_speculative_tokens,
                new_computed_blocks,
                total_computed_tokens,
                apply_admission_cap,
                num_local_computed_tokens=num_local_computed_tokens,
            )
        # Draft models have no Mamba layers: lookahead slots need no state.
        if num_tokens_main_model is not None:
            num_tokens = num_tokens_main_model
        block_size = self.block_size
        num_required = _cdiv(num_tokens, block_size) + self.num_speculative_blocks
        num_new = (
            num_required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        )
        has_partial_hit = (
            self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens)
            or request_id in self._partial_hit_reqs
        )
        if has_partial_hit:
            num_new = max(num_new, 0) + 1
        checkpoint_position = _checkpoint_position(
            num_tokens,
            self.cache_hit_alignment_tokens,
            self.block_pool.num_hash_lookahead_tokens,
            self.drop_eagle_checkpoint_block,
        )
        if not self._needs_internal_checkpoint(
            request_id, total_computed_tokens, num_tokens, checkpoint_position, prefill_end
        ):
            checkpoint_position = 0
        if not apply_admission_cap:
            if checkpoint_position > 0:
                self._checkpoints[request_id] = (
                    checkpoint_position,
                    _cdiv(num_tokens, block_size) - 2,
                )
            else:
                self._checkpoints.pop(request_id, None)
        if num_new > 0:
            # At most: the next state, a partial hit's copy, a checkpoint, and (first
            # allocation only) the speculative blocks.
            cap = 1 + int(has_partial_hit) + int(checkpoint_position > 0)
            if request_id not in self._allocated_block_reqs:
                cap += self.num_speculative_blocks
            num_new = min(num_new, cap)
        num_evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        # May be negative when earlier steps over-allocated, as in vLLM.
        return num_new + num_evictable

    # ---------------------------------------------------------------------- allocation
    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        """As the base class with the speculative blocks; align mode places the states.

        In align mode the table gets null blocks up to the state before the running one,
        a block for the running state (and a reserved prefill checkpoint), the speculative
        blocks; speculative blocks left behind move to the end of the table; a sub-block
        hit is copied into a private block.
        """
        if not self.align:
            return super().allocate_new_blocks(
                request_id, num_tokens + self._num_speculative_tokens
            )
        if num_tokens_main_model is not None:
            num_tokens = num_tokens_main_model
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_spec = self.num_speculative_blocks
        num_required = _cdiv(num_tokens, self.block_size) + num_spec
        checkpoint_block = int(request_id in self._checkpoints)
        partial_hit = self._partial_hit_reqs.get(request_id)
        allocated_before = request_id in self._allocated_block_reqs
        if num_required <= len(req_blocks) and partial_hit is None and not checkpoint_block:
            self._allocated_block_reqs.add(request_id)
            return []
        prev_len = len(req_blocks)
        # Where the state this step reads sits: behind the speculative blocks of a running
        # request, or the last hit block of a new one.
        if allocated_before:
            self._last_state_block_idx[request_id] = prev_len - 1 - num_spec
        elif prev_len > 0:
            self._last_state_block_idx[request_id] = prev_len - 1
        num_skipped = num_required - num_spec - 1
        null_end = num_skipped - checkpoint_block
        if prev_len < num_skipped and prev_len < null_end:
            req_blocks.extend([self._null_block] * (null_end - prev_len))
        if allocated_before:
            # Speculative scratch blocks this step leaves behind move to the end.
            for block_idx in range(prev_len - num_spec, prev_len):
                if block_idx >= null_end:
                    break
                self._relocate_speculative_block(request_id, req_blocks, block_idx)
        num_new = max(num_required - len(req_blocks), 0)
        if partial_hit is not None:
            num_new += 1
        new_blocks = self.block_pool.get_new_blocks(num_new)
        returned = req_blocks[prev_len:]
        if partial_hit is not None:
            block_idx, source = partial_hit
            cow_block = new_blocks[0]
            new_blocks = new_blocks[1:]
            if allocated_before:
                # A running request keeps writing its table's block (workers' tables only
                # grow), so the cache entry moves to the copy instead, filled by the copy
                # queued before this step's forward; hits on it wait for the next step.
                self.block_pool.move_block_hashes(source, cow_block)
                self._pending_cow_copies.append((source, cow_block))
                source.ref_cnt += 1
                tail = self._producer_partial_tail_reqs.pop(request_id, None)
                if tail is not None:
                    # The copy preserves the producer's own boundary state: offer the copy
                    # to the connector (it reads it once the copy ran).
                    self._pending_boundary_state_offloads.append(
                        (request_id, self.kv_cache_group_id, cow_block, tail[1])
                    )
                if cow_block.block_hash is not None:
                    self.cached_blocks_this_step.add(cow_block.block_hash)
            else:
                self._apply_cow(request_id, block_idx, source, cow_block)
                returned = [cow_block, *returned]
        req_blocks.extend(new_blocks)
        self._allocated_block_reqs.add(request_id)
        self._partial_hit_reqs.pop(request_id, None)
        returned.extend(new_blocks)
        return returned

    def _relocate_speculative_block(
        self, request_id: str, req_blocks: list[KVCacheBlock], block_idx: int
    ) -> None:
        block = req_blocks[block_idx]
        if block.is_null or block.ref_cnt != 1 or block.block_hash is not None:
            raise FailedPreconditionError(
                f"request {request_id!r}: speculative Mamba block {block_idx} of group "
                f"{self.kv_cache_group_id} is shared or cached and cannot move"
            )
        req_blocks.append(block)
        req_blocks[block_idx] = self._null_block

    # ------------------------------------------------------------------------- release
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free states no longer needed; align mode also frees the state read two steps ago."""
        if not self.align:
            super().remove_skipped_blocks(request_id, num_computed_tokens)
            return
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        num_skipped_tokens = num_computed_tokens - 1
        if num_skipped_tokens > 0:
            # Retire every state below the running one; nulls between states are skipped.
            first = self._num_retired_blocks.get(request_id, 0)
            last = min(num_skipped_tokens // self.block_size, len(blocks))
            if first < last:
                freed: list[KVCacheBlock] = []
                for i in range(last - 1, first - 1, -1):
                    block = blocks[i]
                    if block.is_null:
                        continue
                    freed.append(block)
                    blocks[i] = self._null_block
                if freed:
                    self.block_pool.free_blocks(freed)
                self._num_retired_blocks[request_id] = last
        last_state = self._last_state_block_idx.get(request_id)
        if last_state is not None and last_state < _cdiv(num_computed_tokens, self.block_size) - 1:
            block = blocks[last_state]
            if not block.is_null:
                self.block_pool.free_blocks([block])
                blocks[last_state] = self._null_block

    def free(self, request_id: str) -> None:
        """Release the request's blocks and its align-mode bookkeeping."""
        if self.align:
            self._forget_align(request_id)
        super().free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """:meth:`free`'s bookkeeping, the blocks handed back (see the base class)."""
        if self.align:
            self._forget_align(request_id)
        return super().pop_blocks_for_free(request_id)

    def _forget_align(self, request_id: str) -> None:
        self._allocated_block_reqs.discard(request_id)
        self._last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        self._checkpoints.pop(request_id, None)
        if self.records_boundary_state_offloads:
            # Its blocks go back to the pool now: offers not yet taken would name blocks
            # another request may be handed.
            self._producer_partial_tail_reqs.pop(request_id, None)
            pending = self._pending_boundary_state_offloads
            if pending:
                self._pending_boundary_state_offloads = [
                    entry for entry in pending if entry[0] != request_id
                ]

    # ------------------------------------------------------------------------- caching
    def _block_mask(
        self, start_block: int, end_block: int, boundaries: Sequence[int]
    ) -> list[bool] | None:
        # Sparse retention: one state per retention segment, plus the state at each
        # boundary a later request may resume at (floored to the hit alignment).
        interval = self.retention_interval
        if interval is None:
            return None
        block_size = self.block_size
        mask = [False] * (end_block - start_block)
        if interval > 0:
            per_segment = interval // block_size
            if per_segment <= 1:
                return None
            first = (start_block + per_segment) // per_segment * per_segment - 1
            for i in range(first - start_block, len(mask), per_segment):
                mask[i] = True
        alignment = self.cache_hit_alignment_tokens
        for boundary in boundaries:
            boundary_block = boundary // alignment * alignment // block_size - 1
            if start_block <= boundary_block < end_block:
                mask[boundary_block - start_block] = True
        return mask

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        boundaries: Sequence[int] = (),
        *,
        junction: int = 0,
    ) -> None:
        """Cache full states; align mode also keys the prefill checkpoint or prompt tail.

        Args:
            request: The request.
            num_tokens: Tokens to cache, including those cached already.
            boundaries: The replay boundaries and the shared-prefix junction, if any.
            junction: The shared-prefix junction (0: none).
        """
        request_id = request.request_id
        num_before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request, num_tokens, boundaries)
        num_after = self.num_cached_block.get(request_id, 0)
        cached_this_step = self.cached_blocks_this_step
        if self.align:
            key = self._cache_partial_tail_block(request, num_tokens, junction)
            if key is not None:
                cached_this_step.add(key)
        if num_after > num_before:
            blocks = self.req_to_blocks[request_id]
            offer = self.records_boundary_state_offloads
            for block in blocks[num_before:num_after]:
                if block.is_null or block.block_hash is None:
                    continue
                cached_this_step.add(block.block_hash)
                if offer:
                    # Every retained boundary state, with its exact block.
                    self._pending_boundary_state_offloads.append(
                        (
                            request_id,
                            self.kv_cache_group_id,
                            block,
                            block.block_hash_num_tokens or 0,
                        )
                    )

    def _cache_partial_tail_block(
        self, request: Request, num_tokens: int, junction: int
    ) -> BlockHashWithGroupId | None:
        block_size = self.block_size
        blocks = self.req_to_blocks[request.request_id]
        checkpoint = self._checkpoints.get(request.request_id)
        if checkpoint is not None:
            # The reserved block holds the state at the checkpoint: key it there, unless
            # nothing can reach it (then its state is transient and no key may stay).
            position, block_idx = checkpoint
            block = blocks[block_idx]
            reachable = position == _checkpoint_position(
                request.num_prompt_tokens,
                self.cache_hit_alignment_tokens,
                self.block_pool.num_hash_lookahead_tokens,
                self.drop_eagle_checkpoint_block,
            )
            if not reachable and position % block_size == 0:
                state_idx = position // block_size - 1
                mask = self._block_mask(state_idx, state_idx + 1, ())
                reachable = mask is None or mask[0]
            if not reachable and position != junction:
                self.block_pool.drop_cached_block(block)
                return None
            if block.block_hash_num_tokens == position:
                return None
            return self.block_pool.cache_partial_block(
                request,
                block,
                position,
                self.kv_cache_group_id,
                block_size,
                replace_existing_hashes=True,
            )
        hash_block_size = self.block_pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hash_block_size:
            return None
        # The prompt's last hash boundary (where a resend resumes) is keyed; with the
        # shared-prefix checkpoint also the junction, when this chunk of the prompt ends
        # there (the scheduler ends one there). Past the prompt the running state changes
        # in place and holds the key's state only after the step's forward.
        if num_tokens != _checkpoint_position(
            request.num_prompt_tokens,
            hash_block_size,
            self.block_pool.num_hash_lookahead_tokens,
            self.drop_eagle_checkpoint_block,
        ) and not (
            self.shared_prefix_checkpoint
            and num_tokens == junction
            and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens
        ):
            return None
        block_idx = _cdiv(num_tokens, block_size) - 1
        if block_idx >= len(blocks):
            return None
        source = blocks[block_idx]
        if source.is_null or source.block_hash_num_tokens == num_tokens:
            return None
        key = self.block_pool.cache_partial_block(
            request, source, num_tokens, self.kv_cache_group_id, block_size
        )
        if key is not None and num_tokens % block_size:
            # The next step's forward overwrites this state: copy it at the next allocation.
            self._partial_hit_reqs[request.request_id] = (block_idx, source)
            self.num_cached_block[request.request_id] = block_idx
            if self.records_boundary_state_offloads:
                # This request produced the partial tail: its copy-on-write (or, if it
                # finishes first, this block) goes to the connector.
                self._producer_partial_tail_reqs[request.request_id] = (source, num_tokens)
        return key

    def new_step_starts(self) -> None:
        """States cached last step are complete now."""
        if self.cached_blocks_this_step:
            self.cached_blocks_this_step.clear()


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross attention of encoder-decoder models: one static table for the encoder tokens."""

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_total_computed_tokens: int,
        num_local_computed_tokens: int = 0,
    ) -> None:
        """Encoder states are never shared; there is nothing to adopt."""
        return

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Connectors do not load cross-attention KV."""
        return

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        boundaries: Sequence[int] = (),
        *,
        junction: int = 0,
    ) -> None:
        """Cross-attention blocks are never cached."""
        return


# The spec-to-manager table: the one place that names a spec type's manager. Subclasses
# without an entry of their own (MLA and sink specs are full attention) use their base's.
_MANAGER_FOR_SPEC: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
}


def manager_class_for_spec(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class for a spec.

    Args:
        kv_cache_spec: A group's spec.

    Returns:
        The manager class.

    Raises:
        ConfigError: kvcm has no manager for this spec type.
    """
    for spec_type in type(kv_cache_spec).__mro__:
        manager_type = _MANAGER_FOR_SPEC.get(spec_type)
        if manager_type is not None:
            return manager_type
    raise ConfigError(f"no KV-cache manager for spec type {type(kv_cache_spec).__name__}")


def _max_admission_blocks(kv_cache_spec: KVCacheSpec, options: ManagerOptions) -> int | None:
    # Recycling types cap the full-sequence admission reservation at what they can hold at
    # once (the spec's own bound, which also sizes the pool); the others answer None.
    return kv_cache_spec.max_admission_blocks_per_request(
        options.max_in_flight_tokens, options.max_model_len
    )


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    block_pool: BlockPool,
    kv_cache_group_id: int,
    options: ManagerOptions,
) -> SingleTypeKVCacheManager:
    """Build the manager of one KV-cache group.

    Args:
        kv_cache_spec: The group's spec.
        block_pool: The shared pool.
        kv_cache_group_id: Index of the group.
        options: Settings shared by all managers.

    Returns:
        The manager.

    Raises:
        ConfigError: The spec type is unsupported or its settings are inconsistent.
    """
    manager_type = manager_class_for_spec(kv_cache_spec)
    return manager_type(
        kv_cache_spec,
        block_pool,
        kv_cache_group_id,
        options,
        _max_admission_blocks(kv_cache_spec, options),
    )
