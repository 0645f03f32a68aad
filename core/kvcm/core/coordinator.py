"""Coordinators: drive the per-group managers of one pool together.

Three shapes, chosen as vLLM 0.33 chooses them:

* ``KVCacheCoordinatorNoPrefixCache``: caching disabled; any number of groups, zero included.
* ``UnitaryKVCacheCoordinator``: one group with caching.
* ``HybridKVCacheCoordinator``: several groups with caching. A cache hit must hold for every
  group at one length, found by a fixed-point search (full attention first, since its
  left-to-right scan gives the tightest first bound) with hits aligned to the scheduler block
  size (the lcm of the groups' block sizes), or to the hash block size where vLLM serves
  sub-block hits (``partial_hash_hits_enabled``: an align-mode Mamba group with blocks larger
  than the hash block, and every other cached group able to look up hash-block boundaries).

Sparse prefix-cache retention (vLLM's ``prefix_cache_retention_interval``) decides which
sliding-window blocks enter the prefix cache: ``None`` keeps every block that can serve a hit,
``0`` (vLLM's default) only the windows before each request's replay boundary (its prompt
minus one token) and before a shared-prefix junction (where a full-attention group hit further
than the hybrid hit), ``n > 0`` those plus one window per ``n`` tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.specs import KVCacheSpec
from kvcm.core.block_pool import BlockPool
from kvcm.core.single_type_managers import (
    CrossAttentionManager,
    MambaManager,
    ManagerOptions,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    manager_class_for_spec,
)

if TYPE_CHECKING:
    from kvcm.common.config import KVCacheConfig
    from kvcm.common.hashing import BlockHash
    from kvcm.core.block import KVCacheBlock
    from kvcm.core.request import Request

__all__ = [
    "CoordinatorConfig",
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "PrefixHit",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
]


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def partial_hash_hits_enabled(
    kv_cache_config: KVCacheConfig, hash_block_size: int, dcp_world_size: int = 1
) -> bool:
    """Whether a hybrid pool serves sub-block prefix hits, as vLLM 0.33 decides it.

    It does when a group whose hits may end inside its blocks (``spec.partial_block_hits``:
    align-mode Mamba) has blocks larger than the hash block (at least as large under
    decode context parallelism, where the scaled full-attention blocks are the larger ones)
    and every other group either looks up hash-block boundaries itself or has blocks of one
    hash block.

    Args:
        kv_cache_config: The pool's groups (attention block sizes already scaled by DCP).
        hash_block_size: Tokens per request block hash.
        dcp_world_size: Decode context parallelism.

    Returns:
        Whether hits land on hash-block boundaries.
    """
    groups = kv_cache_config.kv_cache_groups
    # Under DCP a Mamba block equal to the hash block still qualifies (vLLM's rule).
    least = hash_block_size if dcp_world_size > 1 else hash_block_size + 1
    if not any(
        group.kv_cache_spec.partial_block_hits and group.kv_cache_spec.block_size >= least
        for group in groups
    ):
        return False
    return all(
        manager_class_for_spec(group.kv_cache_spec).supports_fine_grained_hash_lookup
        or group.kv_cache_spec.block_size == hash_block_size
        for group in groups
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    """Resolved settings of one pool's coordinator.

    Attributes:
        kv_cache_config: Groups (with scheduler-side specs) and the number of blocks.
        max_model_len: Longest sequence, in tokens.
        max_in_flight_tokens: Most tokens scheduled but not yet settled.
        scheduler_block_size: Token granularity of scheduling and of hybrid hits.
        hash_block_size: Tokens per request block hash.
        enable_caching: Whether prefix caching is on.
        enable_kv_cache_events: Whether the pool records KV events.
        needs_kv_cache_zeroing: Whether workers zero newly allocated attention blocks.
        prefix_cache_retention_interval: Sparse retention of sliding-window blocks (see the
            module docstring); ``None``: dense.
        dcp_world_size: Decode context parallelism (the attention specs in
            ``kv_cache_config`` already span its ranks; it decides sub-block hits).
        eagle_block_drop_group_ids: Groups whose hits drop their last matched block for an
            EAGLE/MTP drafter (vLLM's ``drop_eagle_group_ids``: the draft groups, or every
            group when none is marked, while the block drop is on).
        num_hash_lookahead_tokens: Tokens after each block that its hash also covers.
        num_prefill_lookahead: Prefill tokens past the computed range the drafter reads; the
            last ``num_prefill_lookahead - 1`` computed tokens are not cached yet (MTP).
    """

    kv_cache_config: KVCacheConfig
    max_model_len: int
    max_in_flight_tokens: int
    scheduler_block_size: int
    hash_block_size: int
    enable_caching: bool
    enable_kv_cache_events: bool
    needs_kv_cache_zeroing: bool = False
    prefix_cache_retention_interval: int | None = None
    dcp_world_size: int = 1
    eagle_block_drop_group_ids: tuple[int, ...] = ()
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead: int = 0


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest cache hit over all groups.

    Attributes:
        blocks: Hit blocks per group.
        num_tokens: The hit length in tokens.
        num_uncached: Tokens past the hit that some group alone had cached (a shared prefix
            a sparse-retention group has not cached; 0 unless hybrid).
    """

    blocks: tuple[list[KVCacheBlock], ...]
    num_tokens: int
    num_uncached: int = 0


class KVCacheCoordinator:
    """What every coordinator does: fan calls out to the per-group managers.

    Attributes:
        block_pool: The pool shared by all groups.
        single_type_managers: One manager per group, in group order.
        scheduler_block_size: Token granularity of hits.
    """

    def __init__(self, config: CoordinatorConfig, enable_caching: bool) -> None:
        """Build the pool and the per-group managers.

        Args:
            config: Resolved settings.
            enable_caching: Whether the managers cache blocks (False for no-prefix-cache).
        """
        kv_cache_config = config.kv_cache_config
        self.scheduler_block_size = config.scheduler_block_size
        self.hash_block_size = config.hash_block_size
        # Sub-block hits: only a hybrid pool with caching (vLLM's hybrid coordinator).
        self.enable_partial_hash_hits = (
            enable_caching
            and len(kv_cache_config.kv_cache_groups) > 1
            and partial_hash_hits_enabled(
                kv_cache_config, config.hash_block_size, config.dcp_world_size
            )
        )
        self.cache_hit_alignment_tokens = (
            config.hash_block_size if self.enable_partial_hash_hits else config.scheduler_block_size
        )
        self.block_pool = BlockPool(
            num_gpu_blocks=kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            hash_block_size=config.hash_block_size,
            enable_kv_cache_events=config.enable_kv_cache_events,
            num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
        )
        # EAGLE/MTP: the groups whose hits drop a block, and the trailing computed tokens a
        # multi-module MTP drafter may still rewrite (not cached until final).
        self.drop_eagle_group_ids = frozenset(config.eagle_block_drop_group_ids)
        self.num_reprefillable_tokens = max(0, config.num_prefill_lookahead - 1)
        options = ManagerOptions(
            enable_caching=enable_caching,
            scheduler_block_size=config.scheduler_block_size,
            max_model_len=config.max_model_len,
            max_in_flight_tokens=config.max_in_flight_tokens,
            records_new_block_ids=config.needs_kv_cache_zeroing,
            retention_interval=config.prefix_cache_retention_interval,
            cache_hit_alignment_tokens=self.cache_hit_alignment_tokens,
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, self.block_pool, group_id, options)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        )
        managers = self.single_type_managers
        if self.drop_eagle_group_ids:
            # With the drop on, Mamba checkpoints land where full attention's hits do.
            for manager in managers:
                if isinstance(manager, MambaManager):
                    manager.drop_eagle_checkpoint_block = True
        # Hoisted per-call branches: which managers can free early, which are cross attention.
        self._skipping_managers = tuple(m for m in managers if m.skips_tokens)
        self._is_cross = tuple(isinstance(m, CrossAttentionManager) for m in managers)
        self._caching_managers = tuple(
            m for m in managers if m.enable_caching and not isinstance(m, CrossAttentionManager)
        )
        self._empty_hit = PrefixHit(tuple([] for _ in managers), 0)
        self.retention_interval = config.prefix_cache_retention_interval
        # Shared-prefix junction of each request's last lookup (vLLM keeps it on the request);
        # only non-zero entries, and only sparse retention reads them.
        self._junctions: dict[str, int] = {}

    # ------------------------------------------------------------------------ estimates
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        *,
        num_encoder_tokens: int,
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        num_local_computed_tokens: int = 0,
        num_tokens_main_model: int | None = None,
        prefill_end: int = 0,
    ) -> int:
        """Free blocks an allocation would consume over all groups.

        Args:
            request_id: The request.
            num_tokens: Token slots needed in total (decoder side).
            new_computed_blocks: Hit blocks per group about to be adopted.
            num_encoder_tokens: Encoder tokens (cross-attention groups).
            total_computed_tokens: Local plus external computed tokens.
            apply_admission_cap: Apply the recycling types' per-request cap.
            num_local_computed_tokens: Locally computed tokens, hit included.
            num_tokens_main_model: ``num_tokens`` without lookahead slots (None: the same).
            prefill_end: Where the request's prefill ends; align-mode Mamba reserves a
                prefill checkpoint only on the chunk reaching it when retention keeps only
                the replay boundaries (interval 0), so it is ignored otherwise.

        Returns:
            The number of blocks.
        """
        if self.retention_interval != 0:
            prefill_end = 0
        total = 0
        for manager, is_cross, group_blocks in zip(
            self.single_type_managers, self._is_cross, new_computed_blocks, strict=True
        ):
            if is_cross:
                # One static allocation sized by the encoder input.
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, (), 0, apply_admission_cap
                )
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    group_blocks,
                    total_computed_tokens,
                    apply_admission_cap,
                    num_local_computed_tokens=num_local_computed_tokens,
                    num_tokens_main_model=num_tokens_main_model,
                    prefill_end=prefill_end,
                )
        return total

    # ----------------------------------------------------------------------- allocation
    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> None:
        """Adopt a new request's hit blocks, then allocate blocks for external tokens.

        Touching every group's hits before any external allocation keeps one group's new
        blocks from evicting another group's hits. A running request adopts nothing.

        Args:
            request_id: The request.
            new_computed_blocks: Hit blocks per group.
            num_local_computed_tokens: Locally computed tokens, hits included.
            num_external_computed_tokens: Tokens computed by a KV connector.
            skip_zeroing_group_ids: Groups whose external blocks are not recorded for zeroing
                (an asynchronous load writes them).
        """
        managers = self.single_type_managers
        for manager in managers:
            if request_id in manager.num_cached_block:
                return
        num_total = num_local_computed_tokens + num_external_computed_tokens
        for manager, group_blocks in zip(managers, new_computed_blocks, strict=True):
            manager.add_local_computed_blocks(
                request_id, group_blocks, num_total, num_local_computed_tokens
            )
        if num_external_computed_tokens > 0:
            for manager in managers:
                manager.allocate_external_computed_blocks(
                    request_id,
                    num_local_computed_tokens,
                    num_external_computed_tokens,
                    record_for_zeroing=manager.kv_cache_group_id not in skip_zeroing_group_ids,
                )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_encoder_tokens: int = 0,
        num_tokens_main_model: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Grow every group's table to ``num_tokens`` slots (encoder tokens for cross).

        Args:
            request_id: The request.
            num_tokens: Token slots needed in total.
            num_encoder_tokens: Encoder tokens, for cross-attention groups.
            num_tokens_main_model: ``num_tokens`` without lookahead slots (None: the same).

        Returns:
            The new blocks per group.
        """
        return tuple(
            manager.allocate_new_blocks(request_id, num_encoder_tokens)
            if is_cross
            else manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            for manager, is_cross in zip(self.single_type_managers, self._is_cross, strict=True)
        )

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Drain every group's queued (source, copy) block pairs, in group order."""
        copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        for manager in self.single_type_managers:
            copies.extend(manager.take_pending_cow_copies())
        return copies

    def get_num_cacheable_tokens(
        self, num_computed_tokens: int, manager: SingleTypeKVCacheManager
    ) -> int:
        """Prefix of the computed tokens that ``manager`` may cache (all but the tokens a
        multi-module MTP drafter may still re-prefill)."""
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def _replay_boundaries(self, request: Request) -> tuple[int, ...]:
        # Where a later request may resume: a resend of the prompt hits at most its length
        # minus one token. With the EAGLE drop a hit matches a block further and drops it:
        # a resend lands one block below its aligned hit, a longer sibling one block below
        # the prompt's last full block (vLLM's replay_boundaries).
        num_prompt = request.num_prompt_tokens
        if not self.drop_eagle_group_ids:
            return (num_prompt - 1,)
        block = self.scheduler_block_size
        resend = (num_prompt - 1) // block * block
        extension = num_prompt // block * block
        return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))

    @property
    def caching_managers(self) -> tuple[SingleTypeKVCacheManager, ...]:
        """The managers whose blocks enter the prefix cache."""
        return self._caching_managers

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's blocks that became full.

        Args:
            request: The request.
            num_computed_tokens: Tokens to cache, including those cached already.
        """
        # Where a later request may resume: the replay boundaries, and the junction where a
        # sibling sharing a prefix resumes (for an EAGLE group also one block below it: a
        # sibling diverging right after the junction cannot use the block past it).
        junction = self._junctions.get(request.request_id, 0)
        replay = self._replay_boundaries(request)
        boundaries = (*replay, junction) if junction else replay
        for manager in self._caching_managers:
            num_tokens = self.get_num_cacheable_tokens(num_computed_tokens, manager)
            if junction and manager.use_eagle:
                manager.cache_blocks(
                    request,
                    num_tokens,
                    (*boundaries, junction - manager.block_size),
                    junction=junction,
                )
            else:
                manager.cache_blocks(request, num_tokens, boundaries, junction=junction)

    def emit_cached_block_counts(self, request: Request, counts: Sequence[int]) -> None:
        """Report a hit's blocks as stored, one event per group that hit (vLLM's "full" mode).

        Args:
            request: The request whose lookup hit.
            counts: Per group, the hit's length in blocks (null blocks included).
        """
        for manager, count in zip(self.single_type_managers, counts, strict=True):
            if count:
                self.block_pool.emit_cached_block_events(
                    request, count, manager.block_size, manager.kv_cache_group_id
                )

    def set_shared_prefix_boundary(self, request_id: str, boundary: int) -> None:
        """Record the shared-prefix junction of the request's latest lookup (0: none).

        Args:
            request_id: The request.
            boundary: Token position of the junction, or 0.
        """
        if boundary:
            self._junctions[request_id] = boundary
        else:
            self._junctions.pop(request_id, None)

    def get_shared_prefix_boundary(self, request_id: str) -> int:
        """The junction recorded by ``set_shared_prefix_boundary`` (0: none)."""
        return self._junctions.get(request_id, 0)

    def check_cacheable(self, request: Request, num_computed_tokens: int) -> None:
        """Raise unless every caching group holds the blocks ``cache_blocks`` would cache.

        Args:
            request: The request.
            num_computed_tokens: Tokens to cache, including those cached already.

        Raises:
            InvalidArgumentError: A group holds fewer blocks than the tokens need.
        """
        num_hashed_tokens = len(request.block_hashes) * self.hash_block_size
        for manager in self._caching_managers:
            num_tokens = min(
                self.get_num_cacheable_tokens(num_computed_tokens, manager), num_hashed_tokens
            )
            blocks = manager.req_to_blocks.get(request.request_id, ())
            if num_tokens // manager.block_size > len(blocks):
                raise InvalidArgumentError(
                    f"request {request.request_id!r}: cannot cache {num_computed_tokens} "
                    f"tokens, group {manager.kv_cache_group_id} holds only {len(blocks)} "
                    f"blocks of {manager.block_size}"
                )

    # -------------------------------------------------------------------------- release
    def free(self, request_id: str) -> None:
        """Release the request's blocks in every group (unknown ids are ignored)."""
        self._junctions.pop(request_id, None)
        for manager in self.single_type_managers:
            manager.free(request_id)

    def free_in_one_call(self, request_id: str) -> None:
        """Release the request's blocks as vLLM's deferred free does (an asynchronous KV
        consumer's ``pop_blocks_for_free``, returned once the step in flight completed): every
        group's table, past its leading nulls, in group order, released by one pool call in
        reverse. One call per group (:meth:`free`) queues the cached blocks of the first group
        first; this queues the last group's first (unknown ids are ignored)."""
        self._junctions.pop(request_id, None)
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            blocks += manager.pop_blocks_for_free(request_id)
        if blocks:
            blocks.reverse()
            self.block_pool.free_blocks(blocks)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks outside every group's attention window, replacing them by nulls."""
        for manager in self._skipping_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash, unless blocks are in use (then nothing changes)."""
        return self.block_pool.reset_prefix_cache()

    # ---------------------------------------------------------------------------- views
    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's block table per group (empty lists where it holds none)."""
        return tuple(
            manager.req_to_blocks.get(request_id) or [] for manager in self.single_type_managers
        )

    def holds_blocks(self, request_id: str) -> bool:
        """Whether any group tracks the request."""
        return any(request_id in m.req_to_blocks for m in self.single_type_managers)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Leading blocks of ``request_id`` shared by all requests, per group."""
        return [m.get_num_common_prefix_blocks(request_id) for m in self.single_type_managers]

    def take_new_block_ids(self) -> list[int]:
        """Drain new attention block ids of every group, in group order."""
        ids: list[int] = []
        for manager in self.single_type_managers:
            if manager.new_block_ids:
                ids.extend(manager.take_new_block_ids())
        return ids

    def new_step_starts(self) -> None:
        """Tell every manager a scheduler step starts."""
        for manager in self.single_type_managers:
            manager.new_step_starts()

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> PrefixHit:
        """The longest prefix cached in every group, at most ``max_cache_hit_length`` tokens.

        Args:
            block_hashes: The request's hashes.
            max_cache_hit_length: Upper bound of the hit.

        Returns:
            Hit blocks per group and the hit length.
        """
        return self._empty_hit


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Coordinator without prefix caching; any number of groups, zero included."""

    def __init__(self, config: CoordinatorConfig) -> None:
        """Build the managers with caching off.

        Args:
            config: Resolved settings.
        """
        super().__init__(config, enable_caching=False)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> PrefixHit:
        """Never a hit."""
        return PrefixHit(tuple([] for _ in self.single_type_managers), 0)


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Coordinator of a single cached group."""

    def __init__(self, config: CoordinatorConfig) -> None:
        """Build the single manager.

        Args:
            config: Resolved settings (exactly one group).

        Raises:
            ConfigError: The hash block size differs from the group's block size.
        """
        super().__init__(config, enable_caching=True)
        manager = self.single_type_managers[0]
        if config.hash_block_size != manager.block_size:
            raise ConfigError(
                f"hash_block_size ({config.hash_block_size}) must equal the block size "
                f"({manager.block_size}) of the only KV-cache group"
            )
        self._manager = manager
        self._group_ids = (0,)
        self._block_size = manager.block_size
        self._drop_eagle_block = 0 in self.drop_eagle_group_ids
        manager.set_use_eagle(self._drop_eagle_block)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> PrefixHit:
        """The group's own longest hit."""
        hit = self._manager.find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            self._group_ids,
            self._block_size,
            self._drop_eagle_block,
        )
        return PrefixHit(hit.blocks, hit.num_tokens)


@dataclass(frozen=True, slots=True)
class _SpecGroup:
    """Groups sharing one spec, looked up together."""

    spec: KVCacheSpec
    group_ids: tuple[int, ...]
    manager: SingleTypeKVCacheManager
    is_full_attention: bool
    # EAGLE: any member drops (the members are looked up, so dropped, together), and the
    # tokens matched past the candidate before the drop (0: no drop).
    use_eagle: bool = False
    eagle_margin: int = 0


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Coordinator of several cached groups of different attention types or block sizes."""

    def __init__(self, config: CoordinatorConfig) -> None:
        """Build the managers and the lookup order of the spec groups.

        Args:
            config: Resolved settings (two or more groups).

        Raises:
            ConfigError: Block sizes are not multiples of the hash block size, or a group's
                attention type cannot take part in a hybrid prefix cache.
        """
        super().__init__(config, enable_caching=True)
        for manager in self.single_type_managers:
            if manager.block_size % config.hash_block_size:
                raise ConfigError(
                    f"group {manager.kv_cache_group_id}: block_size {manager.block_size} is "
                    f"not a multiple of hash_block_size {config.hash_block_size}"
                )
            spec = manager.kv_cache_spec
            if (
                spec.traits.hit_needs_shared_block_size
                and manager.block_size != config.scheduler_block_size
            ):
                raise ConfigError(
                    f"group {manager.kv_cache_group_id}: chunked local attention needs every "
                    "group to share its block size when prefix caching is on"
                )
        self._spec_groups = self._split_by_spec()
        self._is_simple_hybrid = len(self._spec_groups) == 2 and (
            self._spec_groups[0].is_full_attention
        )
        self._num_groups = len(self.single_type_managers)
        # The dense reference group of per-group lookups (None without full attention).
        first = self._spec_groups[0]
        self.full_attention_group_id: int | None = (
            first.group_ids[0] if first.is_full_attention else None
        )

    def _split_by_spec(self) -> tuple[_SpecGroup, ...]:
        # Groups with equal specs (and manager types) are looked up together. Specs may hold
        # unhashable fields, so compare them pairwise.
        members: list[tuple[SingleTypeKVCacheManager, list[int]]] = []
        for manager in self.single_type_managers:
            for first, group_ids in members:
                if first.kv_cache_spec == manager.kv_cache_spec and type(first) is type(manager):
                    group_ids.append(manager.kv_cache_group_id)
                    break
            else:
                members.append((manager, [manager.kv_cache_group_id]))
        drop = self.drop_eagle_group_ids
        groups = []
        for first, group_ids in members:
            use_eagle = any(group_id in drop for group_id in group_ids)
            for group_id in group_ids:
                self.single_type_managers[group_id].set_use_eagle(use_eagle)
            # A fine-grained lookup drops one hash unit, others one block (vLLM's
            # eagle_proof_margin); Mamba's finder never drops, so it has no margin.
            margin = 0
            if use_eagle and not isinstance(first, MambaManager):
                fine = (
                    self.enable_partial_hash_hits
                    and first.supports_fine_grained_hash_lookup
                    and first.block_size > self.hash_block_size
                )
                margin = self.hash_block_size if fine else first.block_size
            groups.append(
                _SpecGroup(
                    first.kv_cache_spec,
                    tuple(group_ids),
                    first,
                    first.kv_cache_spec.traits.full_attention,
                    use_eagle,
                    margin,
                )
            )
        # Stable: full attention first, the rest in group order.
        groups.sort(key=lambda group: not group.is_full_attention)
        return tuple(groups)

    def _align_cacheable(self, num_tokens: int) -> int:
        if self.enable_partial_hash_hits:
            return num_tokens
        return num_tokens - num_tokens % self.scheduler_block_size

    def get_num_cacheable_tokens(
        self, num_computed_tokens: int, manager: SingleTypeKVCacheManager
    ) -> int:
        """Only scheduler-block-aligned prefixes can ever be hit (any with sub-block hits);
        an EAGLE group also caches the block past that boundary, which its hits match and
        drop (only finalized tokens: not those an MTP drafter may re-prefill)."""
        aligned = self._align_cacheable(num_computed_tokens)
        if manager.use_eagle and aligned > 0:
            finalized = max(0, num_computed_tokens - self.num_reprefillable_tokens)
            return min(finalized, self._align_cacheable(finalized) + manager.block_size)
        return aligned

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> PrefixHit:
        """Fixed point: each spec group keeps or shortens the candidate length until stable.

        Full attention is downward closed, so it is looked up once and later only trimmed.
        """
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * self._num_groups
        hit_lengths = [0] * self._num_groups
        alignment = self.cache_hit_alignment_tokens
        hit_length = max_cache_hit_length
        longest = 0
        max_hashed = len(block_hashes) * self.hash_block_size
        # Spec groups whose EAGLE drop is verified at the current candidate: each drops at
        # most once per candidate length (a shrinking candidate clears them).
        eagle_verified: set[int] = set()
        while True:
            candidate = hit_length
            for index, group in enumerate(self._spec_groups):
                first_id = group.group_ids[0]
                if group.is_full_attention and hit_blocks[first_id] is not None:
                    candidate = min(candidate, hit_lengths[first_id])
                    continue
                drop = group.use_eagle and index not in eagle_verified
                max_length = candidate
                if drop and group.eagle_margin:
                    max_length = min(candidate + group.eagle_margin, max_hashed)
                found = group.manager.find_longest_cache_hit(
                    block_hashes, max_length, group.group_ids, alignment, drop
                )
                if drop:
                    eagle_verified.add(index)
                elif found.num_tokens < candidate:
                    eagle_verified.clear()
                candidate = found.num_tokens
                longest = max(longest, candidate)
                for group_id, blocks in zip(group.group_ids, found.blocks, strict=True):
                    hit_blocks[group_id] = blocks
                    hit_lengths[group_id] = candidate
            if candidate >= hit_length:
                break
            hit_length = candidate
            if self._is_simple_hybrid:
                break
        for group in self._spec_groups:
            if not group.is_full_attention:
                continue
            num_blocks = _cdiv(hit_length, group.manager.block_size)
            for group_id in group.group_ids:
                kept = hit_blocks[group_id]
                if kept is not None:
                    del kept[num_blocks:]
        return PrefixHit(tuple(kept or [] for kept in hit_blocks), hit_length, longest - hit_length)

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Each spec group's own longest hit, not reconciled with the others.

        vLLM's lookup for a KV connector of a hybrid Mamba model: full attention's hit is
        the local prefix when no group hit deeper (the connector supplies the rest).

        Returns:
            Blocks and hit length per group.
        """
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in range(self._num_groups)]
        hit_lengths = [0] * self._num_groups
        alignment = self.cache_hit_alignment_tokens
        max_hashed = len(block_hashes) * self.hash_block_size
        for group in self._spec_groups:
            max_length = max_cache_hit_length
            if group.eagle_margin:
                max_length = min(max_length + group.eagle_margin, max_hashed)
            found = group.manager.find_longest_cache_hit(
                block_hashes, max_length, group.group_ids, alignment, group.use_eagle
            )
            for group_id, blocks in zip(group.group_ids, found.blocks, strict=True):
                hit_blocks[group_id] = blocks
                hit_lengths[group_id] = found.num_tokens
        return tuple(hit_blocks), tuple(hit_lengths)


def _check_retention(config: CoordinatorConfig) -> None:
    # vLLM's checks, with its reasons: a retention interval only means something with a
    # group that drops blocks behind a request (traits.sparse_retention: sliding window,
    # Mamba), and must land on hit boundaries.
    interval = config.prefix_cache_retention_interval
    if interval is None:
        return
    groups = config.kv_cache_config.kv_cache_groups
    if not any(g.kv_cache_spec.traits.sparse_retention for g in groups):
        if interval == 0:
            return
        raise ConfigError(
            "prefix_cache_retention_interval is set but this model has no sliding-window or "
            "Mamba KV cache group, so retention has no effect. Set it to 0 (it only applies "
            "to sliding-window and Mamba attention)."
        )
    if interval < 0 or interval % config.scheduler_block_size:
        raise ConfigError(
            f"prefix_cache_retention_interval ({interval}) must be non-negative and a "
            f"multiple of scheduler_block_size ({config.scheduler_block_size})."
        )


def _check_eagle(config: CoordinatorConfig) -> None:
    groups = config.kv_cache_config.kv_cache_groups
    for name in ("num_hash_lookahead_tokens", "num_prefill_lookahead"):
        value = getattr(config, name)
        if type(value) is not int or value < 0:
            raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    drop = config.eagle_block_drop_group_ids
    if len(set(drop)) != len(drop) or not all(
        type(group_id) is int and 0 <= group_id < len(groups) for group_id in drop
    ):
        raise ConfigError(
            f"eagle_block_drop_group_ids must be distinct group indices below {len(groups)}, "
            f"got {list(drop)}"
        )
    if not config.enable_caching or not drop:
        return
    if config.scheduler_block_size < config.num_prefill_lookahead:
        raise ConfigError(  # vLLM's check, with its reason
            "Multi-module MTP with prefix caching requires scheduler_block_size"
            f" (={config.scheduler_block_size}) >= num_speculative_tokens"
            f" (={config.num_prefill_lookahead})."
        )
    for group_id, group in enumerate(groups):
        if not group.kv_cache_spec.traits.eagle_block_drop and group_id in drop:
            raise ConfigError(  # vLLM asserts it
                "Hybrid KV cache is not supported for eagle + chunked local attention."
            )


def _check_specs(config: CoordinatorConfig) -> None:
    _check_retention(config)
    _check_eagle(config)
    groups = config.kv_cache_config.kv_cache_groups
    for group_id, group in enumerate(groups):
        spec = group.kv_cache_spec
        if config.scheduler_block_size % spec.block_size:
            raise ConfigError(
                f"scheduler_block_size ({config.scheduler_block_size}) must be a multiple of "
                f"group {group_id}'s block_size ({spec.block_size})"
            )
        unsupported = spec.traits.prefix_caching_unsupported
        if config.enable_caching and unsupported is not None:
            raise ConfigError(f"group {group_id}: {unsupported}")
    if config.scheduler_block_size % config.hash_block_size:
        raise ConfigError(
            f"scheduler_block_size ({config.scheduler_block_size}) must be a multiple of "
            f"hash_block_size ({config.hash_block_size})"
        )


def get_kv_cache_coordinator(config: CoordinatorConfig) -> KVCacheCoordinator:
    """Pick and build the coordinator vLLM would pick for this config.

    Args:
        config: Resolved settings.

    Returns:
        The no-prefix-cache coordinator when caching is off, the unitary one for a single
        group, the hybrid one otherwise.

    Raises:
        ConfigError: The config is inconsistent or uses an unsupported combination.
    """
    _check_specs(config)
    if not config.enable_caching:
        return KVCacheCoordinatorNoPrefixCache(config)
    num_groups = len(config.kv_cache_config.kv_cache_groups)
    if num_groups == 0:
        raise ConfigError("prefix caching needs at least one KV-cache group")
    if num_groups == 1:
        return UnitaryKVCacheCoordinator(config)
    return HybridKVCacheCoordinator(config)


def lcm_of_block_sizes(block_sizes: Sequence[int]) -> int:
    """The lcm of the groups' block sizes (the scheduler block size of a hybrid model)."""
    return math.lcm(*block_sizes) if block_sizes else 1
