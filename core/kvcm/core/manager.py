"""KVCacheManager: the allocation core's entry point, with vLLM 0.33 V1 decisions.

The scheduler-facing surface of one pool: look up prefix-cache hits, allocate slots for new
tokens (or answer ``None`` when they do not fit), cache full blocks, free requests, and drain
events and stats. Contract violations raise ``kvcm.common.errors`` classes before any state
changes; "does not fit" is the value ``None``.

``allocate_slots`` works on this layout of a request's tokens::

    | comp | new_comp | ext_comp | new | lookahead |
           |<------- to be allocated ------------>|
           |<-- to be cached (up to num_tokens) ->|
    |<-- prefix: may be freed when out of window ->|

    comp      = request.num_computed_tokens
    new_comp  = hit.num_computed_tokens (prefix-cache hits adopted now)
    ext_comp  = options.num_external_computed_tokens (computed by a KV connector)
    new       = num_new_tokens (draft tokens included; only verified tokens are cached)
    lookahead = options.num_lookahead_tokens (unset: 0)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, Literal, NamedTuple, overload

from kvcm.common.errors import (
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from kvcm.common.events import BlockStored
from kvcm.common.specs import (
    AttentionSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
    pins_hash_block_size,
)
from kvcm.core.coordinator import (
    CoordinatorConfig,
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
    lcm_of_block_sizes,
)
from kvcm.core.fork import copy_shared_tail, fork_granule
from kvcm.core.request import RequestStatus
from kvcm.core.single_type_managers import (
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from kvcm.core.stats import PrefixCacheStats, PrefixCachingMetrics

if TYPE_CHECKING:
    from kvcm.common.config import KVCacheConfig
    from kvcm.common.events import KVCacheEvent
    from kvcm.core.block import KVCacheBlock
    from kvcm.core.block_pool import BlockPool
    from kvcm.core.request import Request

__all__ = [
    "DEFAULT_SLOT_OPTIONS",
    "CacheHit",
    "KVCacheBlocks",
    "KVCacheManager",
    "KVCacheManagerConfig",
    "SlotOptions",
]

# Block size vLLM schedules with when a pool has no KV-cache group at all.
_DEFAULT_BLOCK_SIZE = 16
# Requests the recent-requests hit rate aggregates over (vLLM's CachingMetrics default).
_MAX_RECENT_REQUESTS = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheManagerConfig:
    """Settings of one pool's KV-cache manager.

    Attributes:
        kv_cache_config: Groups, specs and the number of blocks.
        max_model_len: Longest sequence, in tokens.
        scheduler_block_size: Scheduling granularity; ``None``: lcm of the groups' block sizes.
        hash_block_size: Tokens per request block hash; ``None``: vLLM's default (the gcd of
            the block sizes for a cached hybrid model, else the scheduler block size).
        max_in_flight_tokens: Most tokens scheduled but not settled; ``None``: max_model_len.
        enable_caching: Prefix caching on or off.
        enable_kv_cache_events: Record BlockStored / BlockRemoved / AllBlocksCleared events.
        log_stats: Collect prefix-cache stats (drained by ``make_prefix_cache_stats``).
        watermark: Fraction of all blocks kept free when admitting waiting or preempted
            requests while others are scheduled.
        prefix_cache_retention_interval: Which sliding-window blocks enter the prefix cache
            (vLLM's setting of that name): ``None`` (vLLM's ``KVCacheConfig`` default) every
            block that can serve a hit; ``0`` (vLLM's ``CacheConfig`` default) only the
            windows a request's replay boundary or a shared-prefix junction needs; ``n > 0``
            those plus one window per ``n`` tokens (a multiple of the scheduler block size).
        dcp_world_size: Decode context parallelism (vLLM's ``decode_context_parallel_size``):
            each attention block holds ``block_size`` tokens on each of this many ranks, so
            the manager's attention blocks span ``block_size * dcp_world_size`` tokens (hits,
            hashes, events); Mamba states are replicated on every rank and keep their size.
            vLLM 0.33 supports it with full-attention (and MLA) and Mamba groups only.
        eagle_block_drop_group_ids: EAGLE/MTP speculative decoding with the trailing-block
            drop (vLLM's ``use_eagle`` with its ``drop_eagle_group_ids``): these groups' hits
            drop their last matched block (one hash block with sub-block hits) and cache the
            block past each aligned boundary. An engine passes its draft groups, or every
            group when none is marked; empty: no drop (vLLM's default with prefix caching,
            whose lookahead block hashes make the drop unnecessary).
        num_hash_lookahead_tokens: Tokens after each block that its hash also covers (vLLM's
            ``num_hash_lookahead_tokens``: EAGLE/MTP's lookahead block hashes; events carry
            them in ``lookahead_token_ids``; the Mamba prefill checkpoint moves back by them).
        num_prefill_lookahead: vLLM's ``num_prefill_lookahead_tokens``: the prefill tokens an
            EAGLE/MTP drafter reads past the computed range; the last
            ``num_prefill_lookahead - 1`` computed tokens (multi-module MTP) are cached only
            once final.
        enable_mamba_shared_prefix_checkpoint: vLLM's
            ``CacheConfig.enable_mamba_shared_prefix_checkpoint`` for an engine with an
            EAGLE/MTP group (vLLM ignores it without one): an align-mode Mamba group also
            keys the state at a request's shared-prefix junction, where a sibling resumes.
            It takes effect only with sub-block hits and no re-prefillable tokens, as in
            vLLM (``KVCacheManager.mamba_shared_prefix_checkpoint``).
    """

    kv_cache_config: KVCacheConfig
    max_model_len: int
    scheduler_block_size: int | None = None
    hash_block_size: int | None = None
    max_in_flight_tokens: int | None = None
    enable_caching: bool = True
    enable_kv_cache_events: bool = False
    log_stats: bool = True
    watermark: float = 0.0
    prefix_cache_retention_interval: int | None = None
    dcp_world_size: int = 1
    eagle_block_drop_group_ids: tuple[int, ...] = ()
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead: int = 0
    enable_mamba_shared_prefix_checkpoint: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotOptions:
    """The rarely used knobs of ``allocate_slots`` (vLLM's keyword arguments of these names).

    One type for the core, the wire codec (``kvcm.wire``) and the SDK (``kvcm.client``
    re-exports it). A request's in-flight tokens are not a knob: vLLM reads them from the
    request, and kvcm carries them beside the options (``Pool.allocate``, ``AllocOptions``).

    Attributes:
        num_lookahead_tokens: Extra slots for speculative tokens (never cached); ``None``:
            unset, which ``allocate_slots`` reads as 0 and a Step as its
            ``default_num_lookahead_tokens`` (so does 0 in a Step). The unary wire sends an
            explicit 0 and leaves ``None`` out.
        num_external_computed_tokens: Tokens a KV connector computed, after the local hit.
        delay_cache_blocks: Do not cache this step (blocks are filled by a later transfer).
        num_encoder_tokens: Encoder tokens for cross-attention groups.
        full_sequence_must_fit: Admit only if the whole sequence fits now (admission gate).
        reserved_blocks: Free blocks to leave for other in-flight sequences.
        has_scheduled_reqs: Whether other requests are scheduled this step (watermark gate).

    Raises:
        InvalidArgumentError: A count that is not a non-negative int (names the field).
    """

    num_lookahead_tokens: int | None = None
    num_external_computed_tokens: int = 0
    delay_cache_blocks: bool = False
    num_encoder_tokens: int = 0
    full_sequence_must_fit: bool = False
    reserved_blocks: int = 0
    has_scheduled_reqs: bool = True

    def __post_init__(self) -> None:
        for name in _SLOT_OPTION_COUNTS:
            value = getattr(self, name)
            if (value is None and name == "num_lookahead_tokens") or (
                type(value) is int and value >= 0
            ):
                continue
            raise InvalidArgumentError(
                f"options.{name} must be a non-negative int, got {value!r}",
                field=f"options.{name}",
            )

    @property
    def is_default(self) -> bool:
        """Whether every knob has its default (the options need not travel)."""
        return self == DEFAULT_SLOT_OPTIONS


_SLOT_OPTION_COUNTS = (
    "num_lookahead_tokens",
    "num_external_computed_tokens",
    "num_encoder_tokens",
    "reserved_blocks",
)
DEFAULT_SLOT_OPTIONS: Final = SlotOptions()


class KVCacheBlocks:
    """Blocks per KV-cache group: ``blocks[group][i]`` is the group's i-th block.

    The manager hands out one preallocated empty instance whenever no group has blocks.
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> None:
        """Wrap per-group block sequences.

        Args:
            blocks: One sequence per group.
        """
        self.blocks = blocks

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple([*mine, *theirs] for mine, theirs in zip(self.blocks, other.blocks, strict=True))
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVCacheBlocks):
            return NotImplemented
        return self.get_block_ids() == other.get_block_ids()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()!r})"

    @overload
    def get_block_ids(
        self, allow_none: Literal[False] = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(
        self, allow_none: bool, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None: ...

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        """Block ids per group (vLLM's signature).

        Args:
            allow_none: Answer ``None`` when every selected group is empty.
            group_ids: Groups to include; ``None``: all.

        Returns:
            One list of block ids per selected group, or ``None`` (see ``allow_none``).
        """
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if allow_none and not any(groups):
            return None
        return tuple([block.block_id for block in group] for group in groups)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks without a hash, for a single-group pool.

        Raises:
            InvalidArgumentError: The pool has more than one group.
        """
        if len(self.blocks) != 1:
            raise InvalidArgumentError("get_unhashed_block_ids needs exactly one group")
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Ids of the non-null blocks without a hash, per group."""
        return [
            [b.block_id for b in group if b.block_hash is None and not b.is_null]
            for group in self.blocks
        ]

    def new_empty(self) -> KVCacheBlocks:
        """An instance with the same number of groups and no blocks."""
        return KVCacheBlocks(tuple(() for _ in self.blocks))


def _running_fast_groups(
    coordinator: KVCacheCoordinator, hash_block_size: int
) -> tuple[SingleTypeKVCacheManager, ...]:
    # The groups of a cached pool whose running requests take _allocate_running_groups: full
    # attention and sliding window only (no admission caps, encoder or per-step state);
    # empty where the single-group path applies or another type is present.
    managers = coordinator.single_type_managers
    if type(coordinator) not in (UnitaryKVCacheCoordinator, HybridKVCacheCoordinator):
        return ()
    if not all(type(m) in (FullAttentionManager, SlidingWindowManager) for m in managers):
        return ()
    only = managers[0]
    if (
        len(managers) == 1
        and type(only) is FullAttentionManager
        and only.block_size == hash_block_size
    ):
        return ()  # the single-group path
    return managers


class CacheHit(NamedTuple):
    """What ``get_computed_blocks`` finds: hit blocks per group and the hit length."""

    blocks: KVCacheBlocks
    num_computed_tokens: int


def _scheduler_spec(spec: KVCacheSpec) -> KVCacheSpec:
    # All layers of a uniform-type group need the same slots; any one speaks for the group.
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def _dcp_spec(spec: KVCacheSpec, dcp_world_size: int, group_id: int) -> KVCacheSpec:
    # vLLM 0.33 shards every attention layer's token positions over the DCP ranks (a block
    # of block_size tokens per rank, so the scheduler's block spans dcp of them) and keeps
    # Mamba states whole on every rank. Of the sharded kinds it serves full attention only:
    # its hybrid coordinator refuses the others with this reason, and alone a sliding-window
    # or chunked-local group asserts at its first lookup (its planning refuses sliding
    # windows first); kvcm refuses all of them when the pool is built.
    if dcp_world_size == 1 or not isinstance(spec, AttentionSpec):
        return spec
    if not spec.traits.full_attention:
        raise ConfigError(
            f"dcp_world_size={dcp_world_size}: group {group_id}: DCP with hybrid KV cache "
            "layouts only supports full-attention, Mamba, and replicated draft groups, got: "
            f"{type(spec).__name__}."
        )
    return spec.copy_with_new_block_size(spec.block_size * dcp_world_size)


def _needs_kv_cache_zeroing(specs: Sequence[KVCacheSpec]) -> bool:
    # Mamba states are read before they are fully written; mixed precisions can decode stale
    # bytes of another group's block as NaN.
    if any(spec.traits.needs_kv_cache_zeroing for spec in specs):
        return True
    dtypes = {spec.attention_dtype() for spec in specs} - {None}
    return len(dtypes) > 1


def _resolve_block_sizes(
    config: KVCacheManagerConfig, specs: Sequence[KVCacheSpec]
) -> tuple[int, int]:
    block_sizes = [spec.block_size for spec in specs]
    scheduler_block_size = config.scheduler_block_size
    if scheduler_block_size is None:
        scheduler_block_size = (
            lcm_of_block_sizes(block_sizes) if block_sizes else _DEFAULT_BLOCK_SIZE
        )
    hash_block_size = config.hash_block_size
    if hash_block_size is None:
        if (
            len(specs) <= 1
            or not config.enable_caching
            or any(pins_hash_block_size(spec) for spec in specs)
        ):
            hash_block_size = scheduler_block_size
        else:
            hash_block_size = math.gcd(*block_sizes)
    return scheduler_block_size, hash_block_size


def _validate_config(config: KVCacheManagerConfig) -> None:
    if type(config.max_model_len) is not int or config.max_model_len <= 0:
        raise ConfigError(f"max_model_len must be a positive int, got {config.max_model_len!r}")
    for field in ("scheduler_block_size", "hash_block_size", "max_in_flight_tokens"):
        value = getattr(config, field)
        if value is not None and (type(value) is not int or value <= 0):
            raise ConfigError(f"{field} must be a positive int or None, got {value!r}")
    if type(config.dcp_world_size) is not int or config.dcp_world_size < 1:
        raise ConfigError(f"dcp_world_size must be an int >= 1, got {config.dcp_world_size!r}")
    if not (0.0 <= config.watermark < 1.0):
        raise ConfigError(f"watermark must be in [0, 1), got {config.watermark!r}")
    if config.kv_cache_config.num_blocks < 1:
        raise ConfigError(
            f"kv_cache_config.num_blocks must be >= 1, got {config.kv_cache_config.num_blocks}"
        )


class KVCacheManager:
    """One pool's KV-cache manager (vLLM's V1 ``KVCacheManager``).

    Attributes:
        max_model_len: Longest sequence, in tokens.
        enable_caching: Whether prefix caching is on.
        log_stats: Whether prefix-cache stats are collected.
        scheduler_block_size: Scheduling granularity, in tokens.
        hash_block_size: Tokens per request block hash (what the pool's hasher must use).
        num_kv_cache_groups: Number of KV-cache groups.
        coordinator: The coordinator of the per-group managers.
        block_pool: The block pool.
        empty_kv_cache_blocks: The shared empty result.
        retained_copy_batches: Drained block copies whose blocks stay referenced until
            :meth:`release_block_copies` (per drain, both ends of each copy in drained
            order; oldest first).
        on_hit_reported: Called as ``(request, blocks per group)`` right after a lookup
            reported its hit as stored (vLLM's ``kv_cache_report_mode="full"``), with the hit's
            length in blocks per group; ``None``: nobody listens. The vLLM mirror sets it to
            send the report to the server's copy (a REPORT_HIT op).
    """

    def __init__(self, config: KVCacheManagerConfig) -> None:
        """Build the manager, its coordinator and its block pool.

        Args:
            config: The pool's settings.

        Raises:
            ConfigError: The settings are inconsistent or unsupported.
        """
        _validate_config(config)
        groups = [
            replace(
                group,
                kv_cache_spec=_dcp_spec(
                    _scheduler_spec(group.kv_cache_spec), config.dcp_world_size, group_id
                ),
            )
            for group_id, group in enumerate(config.kv_cache_config.kv_cache_groups)
        ]
        kv_cache_config = replace(config.kv_cache_config, kv_cache_groups=groups)
        specs = [group.kv_cache_spec for group in groups]
        self.scheduler_block_size, self.hash_block_size = _resolve_block_sizes(config, specs)
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_caching
        self.log_stats = config.log_stats
        self.num_kv_cache_groups = len(groups)
        self.coordinator: KVCacheCoordinator = get_kv_cache_coordinator(
            CoordinatorConfig(
                kv_cache_config=kv_cache_config,
                max_model_len=config.max_model_len,
                max_in_flight_tokens=config.max_in_flight_tokens or config.max_model_len,
                scheduler_block_size=self.scheduler_block_size,
                hash_block_size=self.hash_block_size,
                enable_caching=config.enable_caching,
                enable_kv_cache_events=config.enable_kv_cache_events,
                needs_kv_cache_zeroing=_needs_kv_cache_zeroing(specs),
                prefix_cache_retention_interval=config.prefix_cache_retention_interval,
                dcp_world_size=config.dcp_world_size,
                eagle_block_drop_group_ids=tuple(config.eagle_block_drop_group_ids),
                num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
                num_prefill_lookahead=config.num_prefill_lookahead,
            )
        )
        coordinator = self.coordinator
        # vLLM's one predicate, read by its scheduler (a chunk ends at the junction) and the
        # Mamba managers (the state there is keyed): a multi-module MTP drafter's cached
        # count trails the chunk end, so no junction is ever reached exactly.
        self.mamba_shared_prefix_checkpoint = bool(
            config.enable_mamba_shared_prefix_checkpoint
            and coordinator.enable_partial_hash_hits
            and coordinator.num_reprefillable_tokens == 0
        )
        if self.mamba_shared_prefix_checkpoint:
            for group in coordinator.single_type_managers:
                if isinstance(group, MambaManager):
                    group.shared_prefix_checkpoint = True
        self.block_pool: BlockPool = coordinator.block_pool
        self.watermark_blocks = int(config.watermark * kv_cache_config.num_blocks)
        self._event_metadata = tuple((spec.kind, spec.event_sliding_window()) for spec in specs)
        # The pool writes them into each BlockStored as it records it (no copy per event here).
        self.block_pool.event_metadata = self._event_metadata
        self.prefix_cache_stats: PrefixCacheStats | None = (
            PrefixCacheStats() if config.log_stats else None
        )
        self.prefix_caching_metrics = PrefixCachingMetrics(max_recent_requests=_MAX_RECENT_REQUESTS)
        # Requests holding a block table (allocated at least once, not freed since).
        self._requests: set[str] = set()
        self.on_hit_reported: Callable[[Request, tuple[int, ...]], None] | None = None
        # Immutable, shared "no blocks" result: callers must not mutate returned blocks.
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in groups))
        self._empty_hit = CacheHit(self.empty_kv_cache_blocks, 0)
        # The decode fast path: one cached full-attention group hashed at its own block size
        # (no window to free, no partial tail to cache, nothing to coordinate).
        managers = self.coordinator.single_type_managers
        only = managers[0] if len(managers) == 1 else None
        # The fast paths cache every computed token at its group's own alignment: not for
        # an EAGLE drop or an MTP drafter's re-prefillable tokens.
        plain = not (
            self.coordinator.drop_eagle_group_ids or self.coordinator.num_reprefillable_tokens
        )
        self._fast_group: FullAttentionManager | None = (
            only
            if plain
            and type(self.coordinator) is UnitaryKVCacheCoordinator
            and type(only) is FullAttentionManager
            and only.block_size == self.hash_block_size
            else None
        )
        # The running fast path of every other cached pool of full-attention and
        # sliding-window groups (hybrid models): the general path's decisions, in its order,
        # without its per-call generality (hits, external tokens, encoder, watermark).
        self._fast_groups = (
            _running_fast_groups(self.coordinator, self.hash_block_size) if plain else ()
        )
        self._fast_windows = tuple(m for m in managers if type(m) is SlidingWindowManager)
        # Full attention registers a prompt's partial tail block whenever it caches with a
        # hash block smaller than its block: then caching cannot be skipped by a count.
        self._fast_cache_always = any(
            type(m) is FullAttentionManager and m.block_size != self.hash_block_size
            for m in managers
        )
        # The hybrid coordinator caches only scheduler-block-aligned prefixes.
        self._fast_cache_alignment = (
            self.scheduler_block_size if type(self.coordinator) is HybridKVCacheCoordinator else 1
        )
        # Fork and copy-on-write (kvcm.core.fork): the lcm of the block sizes where the pool
        # can fork (0: it cannot), the copies answered since the last take, and the requests
        # that may share a partial block (forked ones; derived state: None until found from
        # the block tables, as after a snapshot's restore).
        self.fork_granule = fork_granule(self)
        self.fork_copies: list[tuple[int, int]] = []
        self._forked: set[str] | None = None if self.fork_granule else set()
        # Copy retentions kept past their drain (vLLM's scheduler when it defers frees: an
        # asynchronous KV consumer): per drain, both ends of each copy in drained order,
        # oldest drain first (see retain_block_copies).
        self.retained_copy_batches: deque[list[KVCacheBlock]] = deque()

    # --------------------------------------------------------------------------- state
    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use, 0..1."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (cached free blocks included)."""
        return self.block_pool.get_num_free_blocks()

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit rate (hit tokens / queried tokens) over the most recent requests, 0..1.

        Updated whenever stats are drained by ``make_prefix_cache_stats``.
        """
        return self.prefix_caching_metrics.hit_rate

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Drain the prefix-cache stats collected since the last call.

        Returns:
            The stats, or ``None`` when ``log_stats`` is off.
        """
        if self.prefix_cache_stats is None:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        self.prefix_caching_metrics.observe(stats)
        return stats

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one admitted request's lookup (vLLM records at admission, not at lookup).

        Args:
            request: The admitted request.
            num_hits: Its local prefix-cache hit, in tokens.

        Raises:
            InvalidArgumentError: ``num_hits`` is negative or longer than the request.
        """
        if num_hits < 0 or num_hits > request.num_tokens:
            raise InvalidArgumentError(
                f"num_hits must be in [0, {request.num_tokens}], got {num_hits}"
            )
        stats = self.prefix_cache_stats
        if stats is None or not self.enable_caching or request.skip_reading_prefix_cache:
            return
        stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    # ------------------------------------------------------------------------- lookups
    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> CacheHit:
        """Find the request's longest prefix-cache hit (full blocks only).

        When every token hits, the last one must still be computed for its logits, so the
        hit is capped at ``num_tokens - 1`` by default. The lookup also records the request's
        shared-prefix junction (``get_shared_prefix_boundary``), as vLLM's scheduler does.

        Args:
            request: The request.
            max_cache_hit_length: Upper bound of the hit; ``None``: ``num_tokens - 1``.

        Returns:
            The hit (the shared empty hit when caching is off or the request opts out).

        Raises:
            InvalidArgumentError: The bound is negative, the request is longer than
                max_model_len, or it carries more block hashes than full blocks.
        """
        self._check_request(request)
        if max_cache_hit_length is not None and max_cache_hit_length < 0:
            raise InvalidArgumentError(
                f"max_cache_hit_length must be >= 0, got {max_cache_hit_length}"
            )
        coordinator = self.coordinator
        if not self.enable_caching or request.skip_reading_prefix_cache:
            coordinator.set_shared_prefix_boundary(request.request_id, 0)
            return self._empty_hit
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        hit = coordinator.find_longest_cache_hit(request.block_hashes, max_cache_hit_length)
        if (
            hit.num_tokens
            and request.report_cached_blocks
            and self.block_pool.enable_kv_cache_events
        ):
            # vLLM's kv_cache_report_mode="full": the reused blocks are reported as stored.
            counts = tuple(map(len, hit.blocks))
            coordinator.emit_cached_block_counts(request, counts)
            if self.on_hit_reported is not None:
                self.on_hit_reported(request, counts)
        # The junction to keep is where the longest single-group hit ends.
        junction = hit.num_tokens + hit.num_uncached if hit.num_uncached else 0
        coordinator.set_shared_prefix_boundary(request.request_id, junction)
        return CacheHit(self._make_blocks(hit.blocks), hit.num_tokens)

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[CacheHit, bool]:
        """vLLM's local lookup for a request scheduled with a KV connector.

        For a hybrid Mamba model (with a full-attention group) each group is looked up on its
        own: full attention's hit is the local prefix (the connector transfers the rest, the
        Mamba state included) unless another group hit deeper, in which case the reconciled
        hit of :meth:`get_computed_blocks` is answered. ``hit_diverged`` says a group lags
        behind full attention's hit, so the caller must look up again with
        :meth:`get_computed_blocks` when the connector supplies no tokens. Other pools answer
        :meth:`get_computed_blocks`. The shared-prefix junction recorded is 0, as vLLM's.

        Returns:
            The hit and ``hit_diverged``.

        Raises:
            InvalidArgumentError: As :meth:`get_computed_blocks`.
        """
        coordinator = self.coordinator
        full_attention = getattr(coordinator, "full_attention_group_id", None)
        if not (
            isinstance(coordinator, HybridKVCacheCoordinator)
            and full_attention is not None
            and any(isinstance(m, MambaManager) for m in coordinator.single_type_managers)
        ):
            return self.get_computed_blocks(request, max_cache_hit_length), False
        self._check_request(request)
        if max_cache_hit_length is not None and max_cache_hit_length < 0:
            raise InvalidArgumentError(
                f"max_cache_hit_length must be >= 0, got {max_cache_hit_length}"
            )
        if not self.enable_caching or request.skip_reading_prefix_cache:
            coordinator.set_shared_prefix_boundary(request.request_id, 0)
            return self._empty_hit, False
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        blocks, hits = coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, max_cache_hit_length
        )
        num_local = hits[full_attention]
        if any(hit > num_local for hit in hits):
            # Full attention's blocks were evicted below a deeper group's hit: answer the
            # boundary every group agrees on.
            return self.get_computed_blocks(request, max_cache_hit_length), False
        coordinator.set_shared_prefix_boundary(request.request_id, 0)
        return CacheHit(self._make_blocks(blocks), num_local), min(hits) < num_local

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """A lookup's blocks cut at ``num_computed_tokens`` (vLLM's, a pure slice).

        A Mamba group keeps what it has up to there (an external hit can supply its final
        state); every other group must cover the endpoint.

        Raises:
            InvalidArgumentError: The endpoint is not a multiple of a group's block size, or
                a non-Mamba group's blocks do not reach it.
        """
        groups = blocks.blocks
        if len(groups) != self.num_kv_cache_groups:
            raise InvalidArgumentError(
                f"blocks has {len(groups)} groups, the pool has {self.num_kv_cache_groups}"
            )
        truncated: list[list[KVCacheBlock]] = []
        for group_blocks, manager in zip(
            groups, self.coordinator.single_type_managers, strict=True
        ):
            block_size = manager.block_size
            num_blocks, rest = divmod(num_computed_tokens, block_size)
            if rest or num_computed_tokens < 0:
                raise InvalidArgumentError(
                    f"num_computed_tokens {num_computed_tokens} is not a multiple of group "
                    f"{manager.kv_cache_group_id}'s block size {block_size}"
                )
            if isinstance(manager, MambaManager):
                num_blocks = min(num_blocks, len(group_blocks))
            elif num_blocks > len(group_blocks):
                raise InvalidArgumentError(
                    f"group {manager.kv_cache_group_id} has {len(group_blocks)} blocks, fewer "
                    f"than the {num_blocks} num_computed_tokens {num_computed_tokens} needs"
                )
            truncated.append(list(group_blocks[:num_blocks]))
        return self._make_blocks(tuple(truncated))

    def enable_boundary_state_offloads(self) -> None:
        """Collect align-mode Mamba boundary states for a KV connector.

        An engine with a KV connector drains them every step
        (:meth:`take_boundary_state_offloads`); a pool that nobody drains leaves them off.
        """
        for manager in self.coordinator.single_type_managers:
            if isinstance(manager, MambaManager):
                manager.enable_boundary_state_offloads()

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Drain this step's boundary-state hand-offs for a KV connector (vLLM's).

        Returns:
            ``{request_id: [(group_id, block_id, boundary_tokens), ...]}``: the align-mode
            Mamba states cached since the last call and the copies that preserved a
            producer's partial tail; empty unless :meth:`enable_boundary_state_offloads`.
        """
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for manager in self.coordinator.single_type_managers:
            if not isinstance(manager, MambaManager):
                continue
            for (
                request_id,
                group_id,
                block,
                tokens,
            ) in manager.take_pending_boundary_state_offloads():
                offloads.setdefault(request_id, []).append((group_id, block.block_id, tokens))
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """A finishing producer's partial tails still valid in its table (vLLM's).

        Returns:
            ``(group_id, block_id, boundary_tokens)`` per Mamba group whose tail block holds
            the state at the boundary (no later token computed or in flight); consumed.
        """
        offloads: list[tuple[int, int, int]] = []
        for manager in self.coordinator.single_type_managers:
            if not isinstance(manager, MambaManager):
                continue
            finalized = manager.finalize_partial_tail_offload(
                request.request_id, request.num_computed_tokens, request.num_in_flight_tokens
            )
            if finalized is not None:
                group_id, block, tokens = finalized
                offloads.append((group_id, block.block_id, tokens))
        return offloads

    def get_shared_prefix_boundary(self, request_id: str) -> int:
        """vLLM's third answer of ``get_computed_blocks`` for the request's latest lookup.

        Where a shared prefix that a sparse-retention group has not cached yet ends: the
        longest single-group hit, when it is longer than the hit of all groups (0: none).
        The manager keeps it until the request is freed or looks up again, and sparse
        retention keeps the blocks a hit there needs when the request caches.

        Args:
            request_id: The request.

        Returns:
            The boundary in tokens, or 0.
        """
        return self.coordinator.get_shared_prefix_boundary(request_id)

    def set_shared_prefix_boundary(self, request_id: str, boundary: int) -> None:
        """Record a shared-prefix junction found by a lookup made elsewhere (0: none).

        A replica that adopts a hit looked up by another copy of the pool sets what that
        lookup found, so both cache the same sliding-window blocks.

        Args:
            request_id: The request.
            boundary: The junction in tokens, or 0.
        """
        self.coordinator.set_shared_prefix_boundary(request_id, boundary)

    def _check_request(self, request: Request) -> None:
        num_tokens = request.num_tokens
        if num_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"request {request.request_id!r} has {num_tokens} tokens, more than "
                f"max_model_len {self.max_model_len}"
            )
        if len(request.block_hashes) > num_tokens // self.hash_block_size:
            raise InvalidArgumentError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block_hashes "
                f"but only {num_tokens // self.hash_block_size} full blocks of "
                f"{self.hash_block_size} tokens"
            )
        if request.num_computed_tokens < 0 or request.num_in_flight_tokens < 0:
            raise InvalidArgumentError(
                f"request {request.request_id!r}: num_computed_tokens and "
                "num_in_flight_tokens must be >= 0"
            )

    # ---------------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        options: SlotOptions = DEFAULT_SLOT_OPTIONS,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` new tokens (see the module diagram).

        Three stages: free blocks that left the attention window and check that the rest
        fits; adopt the hit (and allocate blocks for external tokens); allocate blocks for
        the tokens to compute, then cache the blocks that became full.

        Args:
            request: The request.
            num_new_tokens: Tokens to compute this step (unverified draft tokens included).
            hit: The hit from ``get_computed_blocks`` to adopt (new requests only).
            options: The rarely used knobs.
            skip_zeroing_group_ids: Groups whose blocks for external tokens an asynchronous
                KV load writes (vLLM's argument): they are not recorded for zeroing, which
                would race the load.

        Returns:
            The newly allocated blocks per group, or ``None`` when they do not fit (the only
            change then is that blocks out of the attention window were freed).

        Raises:
            InvalidArgumentError: A count is negative, the request would exceed max_model_len,
                its hashes do not match its tokens, it has nothing to compute or adopt, or a
                running request brings a hit.
        """
        forked = self._forked if self._forked is not None else self.forked_requests()
        if (
            forked
            and request.request_id in forked
            and num_new_tokens > 0
            and request.num_computed_tokens % self.fork_granule
            and not copy_shared_tail(self, request, num_new_tokens, options)
        ):
            return None  # a shared partial block's copy and the new blocks do not fit
        fast = self._fast_group
        if (
            fast is not None
            and hit is None
            and options is DEFAULT_SLOT_OPTIONS
            and request.status is RequestStatus.RUNNING
        ):
            req_blocks = fast.req_to_blocks.get(request.request_id)
            if req_blocks is not None:
                return self._allocate_running(fast, req_blocks, request, num_new_tokens)
        elif (
            self._fast_groups
            and hit is None
            and options is DEFAULT_SLOT_OPTIONS
            and request.status is RequestStatus.RUNNING
            and request.request_id in self._fast_groups[0].req_to_blocks
        ):
            return self._allocate_running_groups(request, num_new_tokens)
        new_computed, num_new_computed = self._check_allocation(
            request, num_new_tokens, hit, options
        )
        request_id = request.request_id
        coordinator = self.coordinator
        num_external = options.num_external_computed_tokens
        num_local_computed = request.num_computed_tokens + num_new_computed
        total_computed = min(num_local_computed + num_external, self.max_model_len)
        watermark_blocks = 0
        if options.has_scheduled_reqs and (
            request.status is RequestStatus.WAITING or request.status is RequestStatus.PREEMPTED
        ):
            watermark_blocks = self.watermark_blocks
        # Where the prefill ends (the scheduler splits chunks against it; resumed requests
        # replay their output tokens).
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if options.full_sequence_must_fit and not self._full_sequence_fits(
            request,
            new_computed,
            total_computed,
            watermark_blocks,
            options.num_encoder_tokens,
            num_local_computed,
            prefill_end,
        ):
            return None

        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(
            num_tokens_main_model + (options.num_lookahead_tokens or 0), self.max_model_len
        )
        # Free out-of-window blocks first (even if the request then does not fit), so the
        # allocation below evicts fewer cached blocks. In-flight steps still read below the
        # optimistic boundary, so free on the processed-token basis.
        coordinator.remove_skipped_blocks(
            request_id, max(0, total_computed - request.num_in_flight_tokens)
        )
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens_need_slot,
            new_computed,
            num_encoder_tokens=options.num_encoder_tokens,
            total_computed_tokens=num_local_computed + num_external,
            num_local_computed_tokens=num_local_computed,
            num_tokens_main_model=num_tokens_main_model,
            prefill_end=prefill_end,
        )
        available_blocks = self.block_pool.get_num_free_blocks() - options.reserved_blocks
        if num_blocks_to_allocate + watermark_blocks > available_blocks:
            return None

        if new_computed is not self.empty_kv_cache_blocks.blocks or num_external > 0:
            # Adopt the hit before allocating, so new blocks cannot evict it.
            coordinator.allocate_new_computed_blocks(
                request_id, new_computed, num_local_computed, num_external, skip_zeroing_group_ids
            )
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, options.num_encoder_tokens, num_tokens_main_model
        )
        self._requests.add(request_id)
        if self.enable_caching and not options.delay_cache_blocks:
            # Cache only finalized tokens: draft tokens beyond num_tokens may be rejected.
            coordinator.cache_blocks(
                request, min(total_computed + num_new_tokens, request.num_tokens)
            )
        return self._make_blocks(new_blocks)

    def _allocate_running(
        self,
        group: FullAttentionManager,
        req_blocks: list[KVCacheBlock],
        request: Request,
        num_new_tokens: int,
    ) -> KVCacheBlocks | None:
        # allocate_slots for a running request of a single full-attention group with default
        # options: the same checks and decisions without the per-group machinery (no hit, no
        # window, no watermark for a running request, caching only when a block completed).
        self._check_request(request)
        num_computed = request.num_computed_tokens
        if num_new_tokens <= 0 or num_computed + num_new_tokens > self.max_model_len:
            # Invalid counts: the general checks raise the error that names them.
            self._check_allocation(request, num_new_tokens, None, DEFAULT_SLOT_OPTIONS)
        num_new_blocks = -(-(num_computed + num_new_tokens) // group.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            new_blocks: list[KVCacheBlock] = []
        else:
            pool = self.block_pool
            if num_new_blocks > pool.get_num_free_blocks():
                return None
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            if group.records_new_block_ids:
                group.new_block_ids.extend([block.block_id for block in new_blocks])
        num_cacheable = min(num_computed + num_new_tokens, request.num_tokens)
        num_full = min(num_cacheable, len(request.block_hashes) * group.block_size)
        if num_full // group.block_size > group.num_cached_block.get(request.request_id, 0):
            group.cache_blocks(request, num_cacheable)
        if not new_blocks:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks((new_blocks,))

    def _allocate_running_groups(
        self, request: Request, num_new_tokens: int
    ) -> KVCacheBlocks | None:
        # allocate_slots for a running request of full-attention and sliding-window groups
        # with default options: the general path's steps and decisions in its order (free out
        # of window, estimate, allocate group by group, cache), without a hit, external or
        # encoder tokens, lookahead or watermark, which a running request never has here.
        self._check_request(request)
        num_computed = request.num_computed_tokens
        if num_new_tokens <= 0 or num_computed + num_new_tokens > self.max_model_len:
            self._check_allocation(request, num_new_tokens, None, DEFAULT_SLOT_OPTIONS)
        request_id = request.request_id
        num_processed = num_computed - request.num_in_flight_tokens
        null_block = self.block_pool.null_block
        for window in self._fast_windows:
            # Most steps free nothing: the last block before the window is null already
            # (removal walks back from it to the first null) or there is none yet.
            block_size = window.block_size
            num_skipped = num_processed - window.sliding_window + 1 - window.extra_retained_tokens
            if num_skipped >= block_size:
                blocks = window.req_to_blocks[request_id]
                last = min(num_skipped // block_size, len(blocks))
                if last and blocks[last - 1] is not null_block:
                    window.remove_skipped_blocks(request_id, num_processed)
        num_tokens = num_computed + num_new_tokens
        groups = self._fast_groups
        num_to_allocate = 0
        for manager in groups:
            block_size = manager.block_size
            num_held = len(manager.req_to_blocks[request_id])
            if request_id not in manager.num_cached_block:
                # Not cached yet: blocks before the window need no new block.
                num_skipped = manager.get_num_skipped_tokens(num_computed) // block_size
                num_held = max(num_held, num_skipped)
            num_missing = -(-num_tokens // block_size) - num_held
            if num_missing > 0:
                num_to_allocate += num_missing
        pool = self.block_pool
        if num_to_allocate > pool.get_num_free_blocks():
            return None
        new_blocks: list[list[KVCacheBlock]] | None = None
        for index, manager in enumerate(groups):
            req_blocks = manager.req_to_blocks[request_id]
            num_new_blocks = -(-num_tokens // manager.block_size) - len(req_blocks)
            if num_new_blocks <= 0:
                continue
            allocated = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(allocated)
            if manager.records_new_block_ids:
                manager.new_block_ids.extend([block.block_id for block in allocated])
            if new_blocks is None:
                new_blocks = [[] for _ in groups]
            new_blocks[index] = allocated
        num_cacheable = min(num_tokens, request.num_tokens)
        if self._fast_cache_always or self._completes_block(request, num_cacheable):
            self.coordinator.cache_blocks(request, num_cacheable)
        if new_blocks is None:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(tuple(new_blocks))

    def _completes_block(self, request: Request, num_cacheable: int) -> bool:
        # Whether caching num_cacheable tokens would cache a block in some group (else the
        # coordinator's cache_blocks changes nothing).
        num_tokens = num_cacheable - num_cacheable % self._fast_cache_alignment
        num_tokens = min(num_tokens, len(request.block_hashes) * self.hash_block_size)
        request_id = request.request_id
        for manager in self._fast_groups:
            if num_tokens // manager.block_size > manager.num_cached_block.get(request_id, 0):
                return True
        return False

    def _check_allocation(
        self,
        request: Request,
        num_new_tokens: int,
        hit: CacheHit | None,
        options: SlotOptions,
    ) -> tuple[tuple[Sequence[KVCacheBlock], ...], int]:
        # Validates everything allocate_slots reads before it changes anything, and returns
        # the hit blocks (the shared empty tuple when there are none) and the hit length.
        # (SlotOptions checks its counts when it is made.)
        self._check_request(request)
        if num_new_tokens < 0:
            raise InvalidArgumentError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        new_computed: tuple[Sequence[KVCacheBlock], ...] = self.empty_kv_cache_blocks.blocks
        num_new_computed = 0
        if hit is not None:
            num_new_computed = hit.num_computed_tokens
            new_computed = self._check_hit(request, hit)
        if (
            num_new_tokens == 0
            and num_new_computed == 0
            and (options.num_external_computed_tokens == 0)
        ):
            raise InvalidArgumentError(
                "num_new_tokens must be > 0 when there are no computed tokens to adopt"
            )
        if request.num_computed_tokens + num_new_computed + num_new_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"request {request.request_id!r}: num_computed_tokens "
                f"({request.num_computed_tokens}) + hit ({num_new_computed}) + num_new_tokens "
                f"({num_new_tokens}) exceeds max_model_len {self.max_model_len}"
            )
        return new_computed, num_new_computed

    def _check_hit(self, request: Request, hit: CacheHit) -> tuple[Sequence[KVCacheBlock], ...]:
        blocks = hit.blocks.blocks
        if len(blocks) != self.num_kv_cache_groups:
            raise InvalidArgumentError(
                f"hit.blocks has {len(blocks)} groups, the pool has {self.num_kv_cache_groups}"
            )
        if not 0 <= hit.num_computed_tokens <= request.num_tokens:
            raise InvalidArgumentError(
                f"hit.num_computed_tokens must be in [0, {request.num_tokens}], "
                f"got {hit.num_computed_tokens}"
            )
        if not any(blocks):
            return self.empty_kv_cache_blocks.blocks
        if request.request_id in self._requests:
            raise InvalidArgumentError(
                f"request {request.request_id!r} already holds blocks and cannot adopt a hit"
            )
        if request.num_computed_tokens:
            # Hits start at token 0: only a new (or preempted, hence reset) request adopts one.
            raise InvalidArgumentError(
                f"request {request.request_id!r} has num_computed_tokens "
                f"{request.num_computed_tokens}; a hit is adopted only from token 0"
            )
        pool_blocks = self.block_pool.blocks
        for group in blocks:
            for block in group:
                if block.is_null:
                    continue
                block_id = block.block_id
                if not 0 < block_id < len(pool_blocks) or pool_blocks[block_id] is not block:
                    raise InvalidArgumentError(f"hit block {block.block_id} is not this pool's")
                if block.block_hash is None:
                    # Evicted (and maybe reused) since the lookup: adopting it would share a
                    # block that no longer holds this prefix.
                    raise FailedPreconditionError(
                        f"hit block {block.block_id} left the prefix cache after the lookup; "
                        "look the request up again"
                    )
        return blocks

    def _full_sequence_fits(  # noqa: PLR0917 (private; one call site)
        self,
        request: Request,
        new_computed: tuple[Sequence[KVCacheBlock], ...],
        total_computed: int,
        watermark_blocks: int,
        num_encoder_tokens: int,
        num_local_computed: int,
        prefill_end: int,
    ) -> bool:
        # Admission gate: would the whole sequence fit now, given the hit and the blocks that
        # recycling attention types can reuse (their per-request admission cap)?
        full_num_tokens = min(request.num_tokens, self.max_model_len)
        num_blocks = self.coordinator.get_num_blocks_to_allocate(
            request.request_id,
            full_num_tokens,
            new_computed,
            num_encoder_tokens=num_encoder_tokens,
            total_computed_tokens=total_computed,
            apply_admission_cap=True,
            num_local_computed_tokens=num_local_computed,
            num_tokens_main_model=full_num_tokens,
            prefill_end=prefill_end,
        )
        return num_blocks + watermark_blocks <= self.block_pool.get_num_free_blocks()

    def _make_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        # Share the empty result instead of building one per call.
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # ------------------------------------------------------------------------- release
    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (tails are evicted before heads).

        A request that never got blocks (aborted while waiting) is accepted and ignored.

        Args:
            request: The request.
        """
        self.coordinator.free(request.request_id)
        self._requests.discard(request.request_id)
        if self._forked:
            self._forked.discard(request.request_id)

    def free_deferred(self, request: Request) -> None:
        """Release the request's blocks as vLLM's deferred free does: every group's table
        released by one pool call (``block_pool.free_blocks`` over the tables, in group
        order, reversed), where :meth:`free` makes one call per group. An asynchronous KV
        consumer's scheduler frees a request this way once the step that may still write its
        blocks completed (``pop_blocks_for_free``); the two differ only in the order the
        groups' cached blocks join the free queue. Unknown requests are ignored.

        Args:
            request: The request.
        """
        self.coordinator.free_in_one_call(request.request_id)
        self._requests.discard(request.request_id)
        if self._forked:
            self._forked.discard(request.request_id)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the blocks outside the attention window and put null blocks in their place.

        Args:
            request_id: A request holding blocks.
            total_computed_tokens: Processed computed tokens, local and external.

        Raises:
            NotFoundError: The request holds no blocks.
            InvalidArgumentError: ``total_computed_tokens`` is negative.
        """
        self._check_known(request_id)
        if total_computed_tokens < 0:
            raise InvalidArgumentError(
                f"total_computed_tokens must be >= 0, got {total_computed_tokens}"
            )
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks from the prefix cache (blocks in use stay allocated).

        Args:
            block_ids: Block ids, e.g. blocks a KV connector failed to load.

        Raises:
            InvalidArgumentError: An id is outside the pool (nothing is evicted).
        """
        ids = set(block_ids)
        num_blocks = self.kv_cache_config.num_blocks
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                raise InvalidArgumentError(
                    f"block_ids must be ints in [0, {num_blocks}), got {block_id!r}"
                )
        self.block_pool.evict_blocks(ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (after a weight update, or for benchmarking).

        Returns:
            ``True`` on success; ``False`` (and no change) while any block is in use.
        """
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    # --------------------------------------------------------------------------- views
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks of the request that every request holding blocks shares.

        A block counts when its ref_cnt equals the number of requests holding blocks in that
        group (seed 001's definition; vLLM 0.33 returns zeros). Sliding-window, chunked-local,
        Mamba and cross-attention groups report 0: their tables start with null blocks or are
        private.

        Args:
            running_request_id: Any request holding blocks.

        Returns:
            One count per group.

        Raises:
            NotFoundError: The request holds no blocks.
        """
        self._check_known(running_request_id)
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the pool's KV events, BlockStored ones annotated with their group's spec.

        Returns:
            The events since the last call, in order.
        """
        events = self.block_pool.take_events()
        metadata = self._event_metadata
        for index, event in enumerate(events):
            if (
                isinstance(event, BlockStored)
                and event.kv_cache_spec_kind is None  # recorded before the pool knew them
                and event.group_idx is not None
                and 0 <= event.group_idx < len(metadata)
            ):
                kind, sliding_window = metadata[event.group_idx]
                events[index] = replace(
                    event, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=sliding_window
                )
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's block tables (the live lists: do not mutate them).

        A request holding no blocks (waiting, preempted, or unknown here) has an empty list per
        group, as in vLLM (whose per-group tables default to empty lists).
        """
        return self._make_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (empty lists when it holds none)."""
        return self.get_blocks(request_id).get_block_ids()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks within its first ``num_computed_tokens`` tokens.

        Args:
            request: A request holding blocks.
            num_computed_tokens: Tokens to cache, including those cached already.

        Raises:
            NotFoundError: The request holds no blocks.
            InvalidArgumentError: ``num_computed_tokens`` is negative, or the request is
                inconsistent (see ``get_computed_blocks``).
        """
        self._check_known(request.request_id)
        self._check_request(request)
        if num_computed_tokens < 0:
            raise InvalidArgumentError(
                f"num_computed_tokens must be >= 0, got {num_computed_tokens}"
            )
        if self.enable_caching:
            self.coordinator.check_cacheable(request, num_computed_tokens)
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def check_cacheable(self, request: Request, num_computed_tokens: int) -> None:
        """Raise unless the request's blocks hold the tokens ``cache_blocks`` would cache.

        Raises:
            InvalidArgumentError: A caching group holds fewer blocks than the tokens need.
        """
        if self.enable_caching:
            self.coordinator.check_cacheable(request, num_computed_tokens)

    def num_cacheable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """``num_computed_tokens``, capped at what every caching group's blocks hold."""
        try:
            self.check_cacheable(request, num_computed_tokens)
        except InvalidArgumentError:
            request_id = request.request_id
            return min(
                num_computed_tokens,
                *(
                    len(m.req_to_blocks.get(request_id, ())) * m.block_size
                    for m in self.coordinator.caching_managers
                ),
            )
        return num_computed_tokens

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Record the request's attention blocks from ``start_token`` on for zeroing again,
        as vLLM's manager does for blocks a failed asynchronous KV load left unwritten (taken
        with :meth:`take_new_block_ids`; only where new blocks are recorded at all).

        Raises:
            InvalidArgumentError: ``start_token`` is not on a recording group's block
                boundary (zeroing part of a block would wipe its valid tokens), or negative.
        """
        if start_token < 0:
            raise InvalidArgumentError(f"start_token must be >= 0, got {start_token}")
        managers = [m for m in self.coordinator.single_type_managers if m.records_new_block_ids]
        for manager in managers:
            if start_token % manager.block_size:
                raise InvalidArgumentError(
                    f"start_token {start_token} is not a multiple of group "
                    f"{manager.kv_cache_group_id}'s block size {manager.block_size}"
                )
        for manager in managers:
            blocks = manager.req_to_blocks.get(request_id, ())
            start = start_token // manager.block_size
            manager.new_block_ids.extend([block.block_id for block in blocks[start:]])

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids of attention blocks allocated since the last call, for zeroing.

        Only recorded when workers must zero new blocks (Mamba or mixed-precision pools).
        """
        return self.coordinator.take_new_block_ids()

    def take_kv_cache_block_copies(self) -> tuple[list[tuple[int, int]], list[KVCacheBlock]]:
        """Drain the block copies workers must run before this step's forward.

        A sub-block prefix hit is served through a private copy of the shared block that
        holds it (vLLM's ``take_kv_cache_block_copies``).

        Returns:
            ``(source_block_id, destination_block_id)`` pairs in queue order, and the blocks
            (both ends of each pair) holding one extra reference each until the copies ran:
            the caller drops those with ``block_pool.free_blocks`` afterwards.
        """
        pairs = self.coordinator.take_pending_cow_copies()
        copies = [(source.block_id, cow.block_id) for source, cow in pairs]
        return copies, [block for pair in pairs for block in pair]

    def retain_block_copies(self, retained: Sequence[KVCacheBlock]) -> None:
        """Keep a drain's retained blocks (:meth:`take_kv_cache_block_copies`) referenced
        until :meth:`release_block_copies`: vLLM's scheduler does so when it defers frees,
        until the step that runs the copies completed. Drains are released oldest first.

        Args:
            retained: The drain's retained blocks, in drained order (may be empty).
        """
        self.retained_copy_batches.append(list(retained))

    def release_block_copies(self) -> list[int]:
        """Release the oldest retained drain's blocks (one pool call, in drained order).

        Returns:
            The released block ids.

        Raises:
            FailedPreconditionError: No drain is retained.
        """
        if not self.retained_copy_batches:
            raise FailedPreconditionError("no retained block copies to release")
        blocks = self.retained_copy_batches.popleft()
        self.block_pool.free_blocks(blocks)
        return [block.block_id for block in blocks]

    def new_step_starts(self) -> None:
        """Tell the managers a scheduler step starts."""
        self.coordinator.new_step_starts()

    @property
    def requests_holding_blocks(self) -> frozenset[str]:
        """The ids of the requests holding a block table (a copy; for fingerprints)."""
        return frozenset(self._requests)

    def note_fork(self, parent_id: str, child_id: str) -> None:
        """Count a forked request's block table (set up by ``kvcm.core.fork``) and mark
        both requests as possibly sharing a partial block (copy-on-write is checked for
        them only)."""
        self._requests.add(child_id)
        self.forked_requests().update((parent_id, child_id))

    def forked_requests(self) -> set[str]:
        """The requests that may share a partial block: the forked ones, found from the
        block tables when unknown (a request holding an uncached block that another holds)."""
        if self._forked is None:
            self._forked = {
                request_id
                for group in self.coordinator.single_type_managers
                for request_id, blocks in group.req_to_blocks.items()
                if any(block.ref_cnt > 1 and block.block_hash is None for block in blocks)
            }
        return self._forked

    def holds_blocks(self, request_id: str) -> bool:
        """Whether the request holds a block table (allocated and not freed)."""
        return request_id in self._requests

    def _check_known(self, request_id: str) -> None:
        if request_id not in self._requests:
            raise NotFoundError(f"request {request_id!r} holds no blocks in this pool")
