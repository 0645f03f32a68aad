"""vLLM 0.33's KV-cache manager surface, answered by kvcm's core in the scheduler process.

:class:`MirrorKVCacheManager` is what ``KvcmScheduler.kv_cache_manager`` is: every call vLLM's
``Scheduler`` and ``AsyncScheduler`` (and ``EngineCore``) make on ``kv_cache_manager``, with
vLLM's signatures and results, answered by an in-process :class:`kvcm.core.manager.
KVCacheManager` (the mirror of the pool). vLLM's requests are used as they are: the core reads
them through :class:`~kvcm.integrations.vllm._convert.RequestView`, so block hashes are vLLM's
``request.block_hashes``, never recomputed. Every mutation is also recorded into the step's
kvcm Step program (:class:`~kvcm.integrations.vllm._recorder.StepRecorder`), which the
manager's sink takes: the sink is what the mode picks (none: no server; the asynchronous
shipper: mirror mode; the shipper acknowledging each answer: remote mode; see
:mod:`kvcm.integrations.vllm._sinks`). The decisions are the core's in every mode.

Prefix-cache stats are vLLM's own ``PrefixCacheStats`` values, recorded where vLLM records
them (at admission), and KV events come out as vLLM's event structs, so
``vllm:prefix_cache_queries``/``hits`` and ``--kv-events-config`` see what vLLM's manager
would have produced.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcm.common.hashing import HashAlgorithm, external_block_hash
from kvcm.common.specs import MambaSpec, SlidingWindowSpec
from kvcm.core.manager import (
    DEFAULT_SLOT_OPTIONS,
    CacheHit,
    KVCacheBlocks,
    KVCacheManager,
    KVCacheManagerConfig,
    SlotOptions,
)
from kvcm.core.pool_types import PoolConfig
from kvcm.core.program import HitSpec
from kvcm.core.request import Request
from kvcm.core.snapshot import encode_state, fresh_extras, host_tier_state
from kvcm.integrations.vllm._convert import RequestView, convert_kv_cache_config, to_vllm_events
from kvcm.integrations.vllm._recorder import StepRecorder
from kvcm.integrations.vllm._sinks import NullSink, StepSink

if TYPE_CHECKING:
    from kvcm.core.host_tier import HostTier
    from kvcm.integrations.vllm._offload import KvcmOffloadingManager
    from kvcm.integrations.vllm._shipper import ShippingLag

__all__ = ["MirrorKVCacheManager", "MirrorManagerConfig"]


def _vllm_stored_maker(
    stored: Callable[..., Any], convert_hash: Callable[[bytes], Any]
) -> Callable[..., Any]:
    """A maker of vLLM's ``BlockStored`` with ``new_block_stored``'s parameters (kvcm's
    ``BlockPool.make_stored_event``): the same fields, hashes in the engine's published form,
    ``locality`` and ``ownership`` unset, as ``to_vllm_events`` converts kvcm's record."""
    same = convert_hash is _same_hash

    def make(  # noqa: PLR0917 (new_block_stored's positional parameters)
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
    ) -> Any:
        if not same:
            block_hashes = (
                [convert_hash(block_hashes[0])]
                if len(block_hashes) == 1
                else [convert_hash(h) for h in block_hashes]
            )
            if parent_block_hash is not None:
                parent_block_hash = convert_hash(parent_block_hash)
        return stored(
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
            kv_cache_spec_kind,
            kv_cache_spec_sliding_window,
            None,
            None,
            session_id,
            lookahead_token_ids,
        )

    return make


def _same_hash(block_hash: bytes) -> bytes:
    return block_hash


# Spec types whose blocks cover token ranges vLLM clips and estimates cached tokens over.
_UNCLIPPED_KINDS = frozenset({"CrossAttentionSpec", "EncoderOnlyAttentionSpec"})


@dataclass(frozen=True, slots=True, kw_only=True)
class MirrorManagerConfig:
    """What vLLM's ``Scheduler.__init__`` hands its KV-cache manager, as one value.

    Attributes:
        kv_cache_config: vLLM's ``KVCacheConfig`` (the real one, with the real block count).
        max_model_len: Longest sequence, in tokens.
        scheduler_block_size: vLLM's scheduler block size.
        hash_block_size: Tokens per request block hash.
        max_in_flight_tokens: vLLM's ``vllm_config.max_in_flight_tokens``.
        enable_caching: Prefix caching on or off.
        log_stats: Collect prefix-cache stats.
        enable_kv_cache_events: Produce KV events.
        watermark: vLLM's scheduler watermark.
        hash_algorithm: vLLM's ``--prefix-caching-hash-algo`` (the pool hashes alike).
        dcp_world_size: vLLM's ``decode_context_parallel_size`` (the scheduler's
            ``dcp_world_size``; vLLM's scheduler builds its manager with no PCP).
        defer_block_free: vLLM's scheduler defers block frees (its ``defer_block_free``: an
            asynchronous KV consumer), copy retentions of sub-block hits included.
        eagle_group_ids: The groups vLLM's coordinator flags as EAGLE/MTP groups.
        eagle_block_drop_group_ids: The groups whose hits drop their last block (vLLM's
            coordinator's ``drop_eagle_group_ids``: empty unless the block drop is on).
        num_hash_lookahead_tokens: vLLM's ``num_hash_lookahead_tokens``.
        num_prefill_lookahead: vLLM's ``num_prefill_lookahead_tokens``.
        enable_mamba_shared_prefix_checkpoint: vLLM's
            ``CacheConfig.enable_mamba_shared_prefix_checkpoint`` (the core gets it only with
            an EAGLE/MTP group, as vLLM's manager acts on it only then).
    """

    kv_cache_config: Any
    max_model_len: int
    scheduler_block_size: int
    hash_block_size: int
    max_in_flight_tokens: int | None = None
    enable_caching: bool = True
    log_stats: bool = False
    enable_kv_cache_events: bool = False
    watermark: float = 0.0
    hash_algorithm: str = "sha256"
    dcp_world_size: int = 1
    defer_block_free: bool = False
    eagle_group_ids: tuple[int, ...] = ()
    eagle_block_drop_group_ids: tuple[int, ...] = ()
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead: int = 0
    enable_mamba_shared_prefix_checkpoint: bool = False


class _GroupView:
    """What the scheduler and EngineCore read from one of ``coordinator.single_type_managers``.

    Attributes:
        kv_cache_spec: vLLM's spec of the group (vLLM's scheduler checks its type).
        block_size: Tokens per block.
        kv_cache_group_id: The group's index.
    """

    __slots__ = ("block_size", "kv_cache_group_id", "kv_cache_spec")

    def __init__(self, kv_cache_spec: Any, block_size: int, kv_cache_group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = block_size
        self.kv_cache_group_id = kv_cache_group_id


class _CoordinatorView:
    """The parts of vLLM's coordinator that vLLM's scheduler and EngineCore read.

    Attributes:
        single_type_managers: One view per group.
        block_pool: kvcm's block pool.
        enable_partial_hash_hits: Whether hits land on hash blocks inside larger blocks
            (beside an align-mode Mamba group), as the core decided it.
        eagle_group_ids: The groups flagged for EAGLE/MTP (vLLM's coordinator's).
        num_reprefillable_tokens: Trailing computed tokens a multi-module MTP drafter may
            still rewrite (not cached yet), as the core decided it.
    """

    __slots__ = (
        "_coordinator",
        "block_pool",
        "eagle_group_ids",
        "enable_partial_hash_hits",
        "num_reprefillable_tokens",
        "single_type_managers",
    )

    def __init__(
        self,
        single_type_managers: list[_GroupView],
        block_pool: Any,
        coordinator: Any,
        eagle_group_ids: tuple[int, ...] = (),
    ) -> None:
        self.single_type_managers = single_type_managers
        self.block_pool = block_pool
        self._coordinator = coordinator
        self.eagle_group_ids = set(eagle_group_ids)
        self.num_reprefillable_tokens = coordinator.num_reprefillable_tokens
        self.enable_partial_hash_hits = False

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        *,
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Blocks an allocation would take (a read; vLLM's scheduler sizes what an in-flight
        prefill still needs with it when it admits an asynchronous KV load)."""
        # The local hit, the main model's tokens and the prefill end size Mamba groups.
        return int(
            self._coordinator.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks,
                num_encoder_tokens=num_encoder_tokens,
                total_computed_tokens=total_computed_tokens,
                apply_admission_cap=apply_admission_cap,
                num_local_computed_tokens=num_local_computed_tokens,
                num_tokens_main_model=num_tokens_main_model,
                prefill_end=prefill_end,
            )
        )


class _BlockPoolView:
    """kvcm's block pool as vLLM's scheduler reaches it through ``kv_cache_manager.block_pool``:
    every read goes to the pool; ``free_blocks`` of the blocks a deferred free popped frees
    their request (:meth:`MirrorKVCacheManager.pop_blocks_for_free`), of a retained copy
    drain's releases it (:meth:`MirrorKVCacheManager.take_kv_cache_block_copies`), other
    blocks go back to the pool as vLLM's would."""

    __slots__ = ("_free_deferred", "_pool")

    def __init__(self, pool: Any, free_deferred: Callable[[tuple[int, ...]], bool]) -> None:
        self._pool = pool
        self._free_deferred = free_deferred

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def free_blocks(self, ordered_blocks: Any) -> None:
        """Return blocks to the pool, in order (vLLM's signature)."""
        blocks = list(ordered_blocks)
        if blocks and not self._free_deferred(tuple(block.block_id for block in blocks)):
            self._pool.free_blocks(blocks)


class MirrorKVCacheManager:
    """vLLM 0.33's ``KVCacheManager`` surface over kvcm's core (see the module docstring).

    Attributes:
        core: kvcm's manager (the mirror of the pool).
        recorder: The step recorder.
        sink: Where closed steps go (see :mod:`kvcm.integrations.vllm._sinks`).
        coordinator: What vLLM reads from its coordinator.
        block_pool: kvcm's block pool.
        kv_cache_config: vLLM's KV-cache config.
        empty_kv_cache_blocks: The shared empty result.
        prefix_cache_stats: vLLM's stats value being filled, or ``None`` without log_stats.
    """

    use_eagle = False
    retained_hit_group_ids: tuple[int, ...] = ()
    # The engine's offloading tier, when the connector's index is kvcm's (attach_host_tier).
    host_tier: HostTier | None = None

    def __init__(self, config: MirrorManagerConfig, sink: StepSink | None = None) -> None:
        """Build the mirror (the whole pool, in process) and its recorder.

        Args:
            config: The manager's settings (vLLM's constructor arguments).
            sink: Where closed steps go; ``None``: dropped (a :class:`NullSink`).

        Raises:
            ConfigError: The KV-cache config needs something kvcm does not do.
        """
        from vllm import envs
        from vllm.distributed import kv_events
        from vllm.v1.metrics.stats import PrefixCacheStats

        # The engine's event hash form, read once as vLLM reads it (its default: the low 64
        # bits as an int; with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 the full digest).
        self._convert_hash: Callable[[bytes], Any] = (
            external_block_hash if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else _same_hash
        )
        self._kv_events = kv_events
        self._stats_type = PrefixCacheStats
        self.kv_cache_config = config.kv_cache_config
        self.config = config
        self.core = KVCacheManager(
            KVCacheManagerConfig(
                kv_cache_config=convert_kv_cache_config(config.kv_cache_config),
                max_model_len=config.max_model_len,
                scheduler_block_size=config.scheduler_block_size,
                hash_block_size=config.hash_block_size,
                max_in_flight_tokens=config.max_in_flight_tokens,
                enable_caching=config.enable_caching,
                enable_kv_cache_events=config.enable_kv_cache_events,
                log_stats=False,
                watermark=config.watermark,
                prefix_cache_retention_interval=(
                    config.kv_cache_config.prefix_cache_retention_interval
                ),
                dcp_world_size=config.dcp_world_size,
                eagle_block_drop_group_ids=config.eagle_block_drop_group_ids,
                num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
                num_prefill_lookahead=config.num_prefill_lookahead,
                enable_mamba_shared_prefix_checkpoint=(
                    config.enable_mamba_shared_prefix_checkpoint and bool(config.eagle_group_ids)
                ),
            )
        )
        core = self.core
        if config.enable_kv_cache_events:
            # The engine publishes vLLM's structs: the core makes them as it caches, as vLLM's
            # pool does, instead of its own records converted in update_from_output.
            core.block_pool.make_stored_event = _vllm_stored_maker(
                kv_events.BlockStored, self._convert_hash
            )
        self.use_eagle = bool(config.eagle_block_drop_group_ids)
        # vLLM's scheduler ends a prompt chunk at a request's shared-prefix junction when
        # this holds (the core's copy of vLLM's predicate; its Mamba groups key the state).
        self.mamba_shared_prefix_checkpoint: bool = core.mamba_shared_prefix_checkpoint
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_caching
        self.enable_kv_cache_events = config.enable_kv_cache_events
        self.log_stats = config.log_stats
        self.prefix_cache_stats: Any = PrefixCacheStats() if config.log_stats else None
        self.num_kv_cache_groups = core.num_kv_cache_groups
        # vLLM's scheduler returns a deferred free's blocks through block_pool.free_blocks.
        self.block_pool = _BlockPoolView(core.block_pool, self._free_deferred)
        self.watermark_blocks = core.watermark_blocks
        self.empty_kv_cache_blocks = core.empty_kv_cache_blocks
        self._specs = tuple(group.kv_cache_spec for group in config.kv_cache_config.kv_cache_groups)
        self._block_sizes = tuple(m.block_size for m in core.coordinator.single_type_managers)
        self.coordinator = _CoordinatorView(
            [
                _GroupView(spec, block_size, index)
                for index, (spec, block_size) in enumerate(
                    zip(self._specs, self._block_sizes, strict=True)
                )
            ],
            core.block_pool,
            core.coordinator,
            config.eagle_group_ids,
        )
        # vLLM's scheduler reads whether hits land inside blocks (Mamba align mode).
        self.coordinator.enable_partial_hash_hits = core.coordinator.enable_partial_hash_hits
        # vLLM's scheduler drains Mamba boundary-state hand-offs every step.
        core.enable_boundary_state_offloads()
        sink = sink if sink is not None else NullSink()
        self.recorder = StepRecorder(
            sink,
            num_groups=core.num_kv_cache_groups,
            hash_block_size=core.hash_block_size,
            send_hashes=config.enable_caching,
            no_blocks=core.empty_kv_cache_blocks,
            num_hash_lookahead_tokens=core.block_pool.num_hash_lookahead_tokens,
        )
        if config.enable_kv_cache_events:
            # A lookup's report (kv_cache_report_mode="full") goes to the server's copy too,
            # so the pool's own event stream carries it where the engine's does.
            core.on_hit_reported = self.recorder.report_hit  # type: ignore[assignment]
        # Remote mode: every allocate_slots closes a program of its own, which the sink ships
        # and the server acknowledges before the answer goes back to vLLM.
        self._acknowledge_each_answer = sink.acknowledges_each_answer
        self._views: dict[str, RequestView] = {}
        # Deferred frees (pop_blocks_for_free): the popped block ids in vLLM's free order ->
        # the request, freed when vLLM's scheduler hands those blocks back.
        self._deferred: dict[tuple[int, ...], RequestView] = {}
        # vLLM's scheduler defers frees: copy drains stay retained (in the core) until it
        # frees them, and a popped request of several groups is freed in one pool call.
        self._defers_frees = config.defer_block_free
        self._slot_options: dict[tuple[int, ...], SlotOptions] = {}
        # Under sparse retention every admission tells the server's copy the junction its
        # lookup found (0 included, so a stale one from an earlier lookup never lingers).
        # With the Mamba shared-prefix checkpoint the server's Mamba groups key the state at
        # the junction, which a lookup with no hit may find too.
        self._sends_junctions = core.mamba_shared_prefix_checkpoint or (
            core.config.prefix_cache_retention_interval is not None
            and any(
                isinstance(m.kv_cache_spec, (SlidingWindowSpec, MambaSpec))
                for m in core.coordinator.caching_managers
            )
        )
        # The groups whose cache_blocks completes blocks only (no partial tail entries, which
        # a group with blocks larger than a hash block adds): a no-op shows in their counts.
        self._hash_size = core.hash_block_size
        caching: tuple[Any, ...] = core.coordinator.caching_managers
        self._cache_groups = (
            caching if all(m.block_size == core.hash_block_size for m in caching) else ()
        )

    # ------------------------------------------------------------------ the sink
    @property
    def sink(self) -> StepSink:
        """Where closed steps go: what the mode picked (see :mod:`~kvcm.integrations.vllm.
        _sinks`). Set it before the first step; the current program goes to the new sink."""
        return self.recorder.sink

    @sink.setter
    def sink(self, sink: StepSink) -> None:
        self.recorder.sink = sink
        self._acknowledge_each_answer = sink.acknowledges_each_answer

    # ------------------------------------------------------------------ requests
    def _view(self, request: Any) -> RequestView:
        view = self._views.get(request.request_id)
        if view is None or view.source is not request:
            view = RequestView(request, self._hash_size)
            self._views[request.request_id] = view
        else:
            prompt_end = view.num_prompt_tokens
            view.sync()
            if view.num_prompt_tokens != prompt_end:  # a streaming session's next chunk
                self.recorder.extend_prompt(view)
        return view

    # ------------------------------------------------------------------ stats
    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use, 0..1."""
        return self.core.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> Any:
        """Drain the prefix-cache stats (vLLM's ``PrefixCacheStats``), or ``None``."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._stats_type()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """Whether a local prefix-cache lookup may run for ``request``."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Count one admitted request's lookup (vLLM records at admission)."""
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )
        # The server's pool counts it too (its kvcm_prefix_cache_* metrics agree with vLLM's).
        self.recorder.record_prefix_stats(self._view(request), num_hits)

    # ------------------------------------------------------------------ lookups
    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The request's longest prefix hit: ``(blocks, num_computed_tokens, boundary)``.

        The third value is vLLM's shared-prefix boundary: where a prefix that full attention
        cached and a sliding-window group did not ends (0: none); the core keeps it for the
        request, and the next allocation's hit hands it to the server's copy.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        view = self._view(request)
        hit = self.core.get_computed_blocks(view, max_cache_hit_length)
        junction = self.core.get_shared_prefix_boundary(view.request_id)
        return hit.blocks, hit.num_computed_tokens, junction

    def get_computed_blocks_for_connector(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """``get_computed_blocks`` plus vLLM's ``hit_diverged``: for a hybrid Mamba model
        full attention's own hit, each group looked up alone (the core's lookup for a KV
        connector); otherwise ``get_computed_blocks`` and ``False``."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0, False
        view = self._view(request)
        hit, diverged = self.core.get_computed_blocks_for_connector(view, max_cache_hit_length)
        junction = self.core.get_shared_prefix_boundary(view.request_id)
        return hit.blocks, hit.num_computed_tokens, junction, diverged

    # ------------------------------------------------------------------ allocation
    def allocate_slots(  # noqa: PLR0917 - vLLM's signature, positionals included
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """vLLM's ``allocate_slots`` (same arguments, same answer), recorded as one ALLOCATE."""
        view = self._view(request)
        if (
            num_lookahead_tokens == 0
            and num_external_computed_tokens == 0
            and num_encoder_tokens == 0
            and reserved_blocks == 0
            and has_scheduled_reqs is True
            and delay_cache_blocks is False
            and full_sequence_must_fit is False
        ):
            options = DEFAULT_SLOT_OPTIONS  # what vLLM passes for every running request
        else:
            options = self._options(
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                num_encoder_tokens,
                full_sequence_must_fit,
                reserved_blocks,
                has_scheduled_reqs,
            )
        hit: CacheHit | None = None
        hit_spec: HitSpec | None = None
        if new_computed_blocks is not None and (
            num_new_computed_tokens
            or new_computed_blocks is not self.empty_kv_cache_blocks
            # A request with computed tokens (an asynchronous KV load completed) did no
            # lookup: the server's copy keeps the junction its admission sent.
            or (self._sends_junctions and not view.num_computed_tokens)
        ):
            hit = CacheHit(new_computed_blocks, num_new_computed_tokens)
            hit_spec = HitSpec(
                num_tokens=num_new_computed_tokens,
                block_ids=new_computed_blocks.get_block_ids(),
                shared_prefix_boundary=self.core.get_shared_prefix_boundary(view.request_id),
            )
        result = self.core.allocate_slots(
            view, num_new_tokens, hit, options, skip_zeroing_group_ids
        )
        self.recorder.allocate(
            view,
            num_new_tokens,
            hit_spec,
            None if options is DEFAULT_SLOT_OPTIONS else options,
            result,
        )
        if self._acknowledge_each_answer:
            self.close_step()  # remote mode: the server acknowledges before vLLM sees it
        return result

    def _options(self, *values: Any) -> SlotOptions:
        # One SlotOptions per distinct combination; the all-default one is the core's
        # DEFAULT_SLOT_OPTIONS, which keeps the core's decode fast path.
        options = self._slot_options.get(values)
        if options is None:
            options = SlotOptions(
                num_lookahead_tokens=values[0] or None,  # vLLM passes 0 for unset
                num_external_computed_tokens=values[1],
                delay_cache_blocks=values[2],
                num_encoder_tokens=values[3],
                full_sequence_must_fit=values[4],
                reserved_blocks=values[5],
                has_scheduled_reqs=values[6],
            )
            if options == DEFAULT_SLOT_OPTIONS:
                options = DEFAULT_SLOT_OPTIONS
            self._slot_options[values] = options
        return options

    # ------------------------------------------------------------------ release
    def free(self, request: Any) -> None:
        """Free the request's blocks: FINISH when it finished, PREEMPT otherwise."""
        request_id = request.request_id
        finished = request.is_finished()
        self.core.free(self._view(request))
        self.recorder.free(request_id, finished=finished)
        if finished:
            self._views.pop(request_id, None)
            if not self._views:
                # The engine may go idle now (EngineCore stops calling schedule() when no
                # request is left): ship the last frees at once, not with a later step.
                self.close_step()

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Free blocks out of the attention window (vLLM's signature). vLLM's scheduler calls
        it directly only with a KV connector, when a request finishes; one that never got
        blocks (aborted before it was scheduled) has none to skip, as in vLLM's manager."""
        del num_prompt_tokens  # R-SWA gap eviction: R-SWA specs are refused
        if not self.core.holds_blocks(request_id):
            return
        self.core.remove_skipped_blocks(request_id, processed_computed_tokens)
        self.recorder.remove_skipped_blocks(self._views[request_id], processed_computed_tokens)

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        """vLLM's deferred free: an asynchronous KV-consumer engine (P/D decode) frees a
        request while a step that may still write its blocks is in flight. The blocks go to
        vLLM's scheduler, which hands them back through ``block_pool.free_blocks`` once that
        step completed; the request keeps them in kvcm until then and is freed (one FINISH,
        the same blocks in the same order) at that moment, on the server's copy too.

        With several KV-cache groups the blocks are every group's, in group order, and the
        free is FINISH_DEFERRED (vLLM returns them in one pool call, which queues the groups'
        cached blocks in another order than one call per group).
        """
        request_id = request.request_id
        if not self.core.holds_blocks(request_id):
            self.free(request)  # nothing to hand back: vLLM's scheduler forgets it now
            return []
        null_block = self.core.block_pool.null_block
        blocks: list[Any] = []
        for group in self.core.get_blocks(request_id).blocks:
            start = 0
            while start < len(group) and group[start] is null_block:
                start += 1  # vLLM hands back the blocks past the skipped (null) head
            blocks += group[start:]
        if not blocks:  # vLLM's scheduler defers nothing: the request is gone now
            self._finish_popped(self._view(request))
            return blocks
        self._deferred[tuple(block.block_id for block in reversed(blocks))] = self._view(request)
        return blocks

    def _free_deferred(self, block_ids: tuple[int, ...]) -> bool:
        # block_pool.free_blocks of a deferred free's blocks: free their request now.
        view = self._deferred.pop(block_ids, None)
        if view is None:
            return self._release_copies(block_ids)
        self._finish_popped(view)
        return True

    def _finish_popped(self, view: RequestView) -> None:
        request_id = view.request_id
        if self.num_kv_cache_groups > 1:
            self.core.free_deferred(view)
            self.recorder.free(request_id, finished=True, deferred=True)
        else:  # one group: FINISH releases its blocks in the same single call
            self.core.free(view)
            self.recorder.free(request_id, finished=True)
        self._views.pop(request_id, None)
        if not self._views:
            self.close_step()

    def _release_copies(self, block_ids: tuple[int, ...]) -> bool:
        # block_pool.free_blocks of the oldest retained copy drain (vLLM's scheduler frees
        # them in drained order, oldest drain first, once the step running them completed).
        batches = self.core.retained_copy_batches
        if not batches or block_ids != tuple(block.block_id for block in batches[0]):
            return False
        self.core.release_block_copies()
        self.recorder.release_block_copies()
        return True

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop blocks from the prefix cache by id."""
        self.core.evict_blocks(block_ids)
        self.recorder.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; ``False`` while blocks are in use."""
        reset = self.core.reset_prefix_cache()
        self.recorder.reset_prefix_cache(reset)
        if reset and self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return reset

    def new_step_starts(self) -> None:
        """A scheduler step starts."""
        self.core.new_step_starts()
        self.recorder.new_step_starts()

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Cache the request's full blocks up to ``num_computed_tokens`` (if caching is on)."""
        if not self.enable_caching:
            return
        # vLLM's async loop calls this for every running request after every step; most
        # calls complete no block. Then it is a no-op in every group (as in vLLM's manager),
        # on the server's copy too: neither the core nor the program needs to see it.
        groups = self._cache_groups
        if groups:
            request_id = request.request_id
            num_tokens = min(num_computed_tokens, len(request.block_hashes) * self._hash_size)
            for group in groups:
                if num_tokens // group.block_size > group.num_cached_block.get(request_id, 0):
                    break
            else:
                return
        view = self._view(request)
        self.core.cache_blocks(view, num_computed_tokens)
        self.recorder.cache_blocks(view, num_computed_tokens)

    # ------------------------------------------------------------------ views
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Zeros, as vLLM 0.33 answers (cascade attention is gone)."""
        del running_request_id
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list[Any]:
        """Drain the KV events as vLLM's event structs."""
        events = self.core.take_events()
        return to_vllm_events(events, self._kv_events, self._convert_hash) if events else []

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks (empty when it holds none, as vLLM answers)."""
        if not self.core.holds_blocks(request_id):
            return self.empty_kv_cache_blocks
        return self.core.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group."""
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """Block ids covering the request's computed tokens (attention groups clipped)."""
        clipped: list[list[int]] = []
        for spec, block_size, ids in zip(
            self._specs, self._block_sizes, self.get_block_ids(request_id), strict=True
        ):
            if type(spec).__name__ in _UNCLIPPED_KINDS:
                clipped.append(ids)
            else:
                clipped.append(ids[: -(-num_computed_tokens // block_size)])
        return tuple(clipped)

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request held in cached blocks (the minimum over groups)."""
        cached: int | None = None
        for group in self.get_blocks(request.request_id).blocks:
            group_cached = 0
            for block in group:
                group_cached = max(group_cached, block.block_hash_num_tokens or 0)
            cached = group_cached if cached is None else min(cached, group_cached)
        return cached or 0

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> KVCacheBlocks:
        """Wrap per-group blocks (the shared empty value when there are none)."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """A lookup result cut at an aligned token count (no reference counts change): the
        core's, which refuses what vLLM's asserts (a group other than Mamba that does not
        reach the endpoint)."""
        return self.core.truncate_computed_blocks(blocks, num_computed_tokens)

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids of new attention blocks workers must zero."""
        return self.core.take_new_block_ids()

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """A failed asynchronous KV load's unwritten blocks, from ``start_token`` on, are
        zeroed by the workers again (engine-side bookkeeping: the pool's state is
        unchanged, so nothing is shipped)."""
        self.core.record_blocks_for_zeroing(request_id, start_token)

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """Drain the block copies workers run before this step's forward (sub-block hits
        beside an align-mode Mamba group) as vLLM's ``KVCacheBlockCopy`` records.

        vLLM's scheduler drops the copies' extra references (``block_pool.free_blocks``) right
        after draining them unless it defers frees; the mirror then drops them here already,
        as the pool's TAKE_BLOCK_COPIES does, so the recorded op is one whole mutation, and
        answers no retained blocks. When it defers frees (an asynchronous KV consumer), the
        retained blocks are answered and stay referenced in the core
        (TAKE_BLOCK_COPIES_RETAINED) until vLLM's scheduler hands them back
        (``block_pool.free_blocks``: RELEASE_BLOCK_COPIES).
        """
        copies, retained = self.core.take_kv_cache_block_copies()
        if not copies:
            return [], []
        if self._defers_frees:
            self.core.retain_block_copies(retained)
            self.recorder.take_block_copies(copies, retain=True)
        else:
            self.core.block_pool.free_blocks(retained)
            self.recorder.take_block_copies(copies)
            retained = []
        if self._acknowledge_each_answer:
            self.close_step()  # remote mode: the server answers the same copies first
        from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

        return [KVCacheBlockCopy(src, dst) for src, dst in copies], retained

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Drain the align-mode Mamba boundary states offered to a KV connector this step
        (the core's; vLLM's scheduler drains them every step)."""
        return self.core.take_boundary_state_offloads()

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """A finishing KV producer's partial tails still valid in its table (the core's)."""
        return self.core.finalize_partial_tail_offloads(request)

    # ------------------------------------------------------------------ the server's pool
    def pool_config(self) -> PoolConfig:
        """How the server's pool is created: this mirror's layout, settings and hashing.

        Call it once the engine set vLLM's NONE_HASH (EngineCore does after building the
        scheduler): the pool gets the same seed, so kvcm hashes tokens as the engine does.
        """
        from vllm.v1.core import kv_cache_utils

        core = self.core.config
        seed = getattr(kv_cache_utils, "_NONE_HASH_SEED", None)
        return PoolConfig(
            max_model_len=core.max_model_len,
            explicit_layout=core.kv_cache_config,
            scheduler_block_size=core.scheduler_block_size,
            hash_block_size=core.hash_block_size,
            max_in_flight_tokens=core.max_in_flight_tokens,
            enable_caching=core.enable_caching,
            hash_algorithm=HashAlgorithm(self.config.hash_algorithm),
            hash_seed=seed if isinstance(seed, str) else None,
            enable_kv_cache_events=self.config.enable_kv_cache_events,
            log_stats=self.config.log_stats,
            watermark=core.watermark,
            prefix_cache_retention_interval=core.prefix_cache_retention_interval,
            decode_context_parallel_size=core.dcp_world_size,
            offload_host_blocks=0 if self.host_tier is None else self.host_tier.num_blocks,
            num_hash_lookahead_tokens=core.num_hash_lookahead_tokens,
            num_prefill_lookahead=core.num_prefill_lookahead,
            eagle_block_drop_group_ids=tuple(core.eagle_block_drop_group_ids),
            enable_mamba_shared_prefix_checkpoint=core.enable_mamba_shared_prefix_checkpoint,
        )

    def attach_host_tier(self, offloading: KvcmOffloadingManager) -> None:
        """Make the engine's offloading tier part of the server's pool: the pool is created
        with ``offload_host_blocks``, snapshots carry the tier, and every call that changes
        it is recorded as a HOST_SYNC op of the step's program."""
        self.host_tier = offloading.host
        offloading.sync = self.recorder.host_sync

    def snapshot(self) -> bytes:
        """The server's pool as it should be after the last closed step, as snapshot bytes
        (:mod:`kvcm.core.snapshot`; what ``ResyncPool`` uploads).

        Requests carry what the programs told the pool (tokens and hashes sent so far), keyed
        as the programs key them; the event log and counters start afresh.
        """
        recorder = self.recorder
        requests: dict[int, Request] = {}
        request_ids: dict[int, str] = {}
        for request_id, (key, num_tokens, num_hashes) in recorder.tracked().items():
            view = self._views[request_id]
            request = Request(
                request_id,
                view.prompt_token_ids,
                lora_id=view.lora_id,
                lora_name=view.lora_name,
                cache_salt=view.cache_salt,
                status=view.status,
                skip_reading_prefix_cache=view.skip_reading_prefix_cache,
                report_cached_blocks=view.report_cached_blocks,
            )
            request.all_token_ids = list(view.all_token_ids[:num_tokens])
            request.block_hashes = list(view.block_hashes[:num_hashes])
            request.num_computed_tokens = view.num_computed_tokens
            request.num_in_flight_tokens = view.num_in_flight_tokens
            request.num_preemptions = view.num_preemptions
            requests[key] = request
            request_ids[key] = request_id
        extras = fresh_extras(last_step_seq=recorder.num_steps, max_model_len=self.max_model_len)
        if self.host_tier is not None:
            extras["host_tier"] = host_tier_state(self.host_tier)
        return encode_state(
            self.core,
            requests,
            request_ids,
            extras=extras,
            drop_pending_events=True,
        )

    # ------------------------------------------------------------------ steps
    def shipping_lag(self) -> ShippingLag | None:
        """How far the server's copy is behind this mirror (``None``: nothing is shipped).

        See :class:`~kvcm.integrations.vllm._shipper.ShippingLag`: steps not acknowledged
        yet, the age of the oldest, close-to-acknowledgement percentiles.
        """
        return self.recorder.sink.lag()

    def flush(self, timeout_s: float) -> bool:
        """Close the current program and wait until the sink shipped everything (taking the
        snapshots it asks for meanwhile); ``False`` if that took longer than ``timeout_s``.
        For a step boundary (``shutdown()``, tests); a sink that does not ship is flushed.
        """
        self.close_step()
        sink = self.recorder.sink
        deadline = time.monotonic() + timeout_s
        while True:
            if sink.wants_snapshot:
                sink.submit_snapshot(self.recorder.num_steps, self.snapshot())
            left = deadline - time.monotonic()
            if sink.flush(max(0.0, min(left, 0.05))):
                return True
            if left <= 0:
                return False

    def close_step(self) -> None:
        """Close the step's program (if anything was recorded) and hand it to the sink.

        A sink that lost the server's copy asks for a snapshot of the mirror
        (``wants_snapshot``); it is taken here, at a step boundary, in the scheduler thread.
        """
        recorder = self.recorder
        recorder.close_step()
        sink = recorder.sink
        if sink.wants_snapshot:
            sink.submit_snapshot(recorder.num_steps, self.snapshot())
