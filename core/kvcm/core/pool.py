"""Pools: one engine instance's KV-cache bookkeeping, and the registry of a server's pools.

A :class:`Pool` wraps one :class:`~kvcm.core.KVCacheManager` with what the service adds
around it: the request table (keyed by the scheduler's request keys), worker registrations and
planning, the resolved hashing parameters, a sequenced event log for resuming subscribers, the
exactly-once Step guard and cumulative counters for metrics. It is pure: no I/O, no clocks (the
caller stamps event batches), no grpc. Every method validates before it changes anything, and
raises the :mod:`kvcm.common.errors` classes (plus :class:`OutOfRangeError` for events).
The value types live in :mod:`~kvcm.core.pool_types` and the event log in
:mod:`~kvcm.core.event_log`; this module re-exports their public names.

::

    PoolRegistry ── name ──> Pool ── PENDING_WORKERS ──(all ranks registered)──> READY
                                 └── explicit layout ───────────────────────────> READY
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from kvcm.common.config import KVCacheConfig, pool_bytes_per_block
from kvcm.common.errors import (
    AlreadyExistsError,
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCMError,
    NotFoundError,
    ResourceExhaustedError,
)
from kvcm.common.events import AllBlocksCleared, KVCacheEvent
from kvcm.common.hashing import BlockHash, resolve_none_hash_seed
from kvcm.common.specs import UINT64_MAX, KVCacheSpec, check_plannable_spec
from kvcm.core.event_log import EventBatchRecord, EventLog, OutOfRangeError
from kvcm.core.host_tier import (
    HostAdmission,
    HostTier,
    admit_with_host_hit,
    host_hit_tokens,
    swap_in,
    swap_out,
    swap_out_tables,
)
from kvcm.core.limits import DEFAULT_LIMITS, Limits, check_pool_blocks
from kvcm.core.lookup import (
    LookupAnswer,
    LookupQuery,
    PrefixIndex,
    Profile,
    hashing_work,
    lookup,
    scope_pools,
)
from kvcm.core.manager import (
    DEFAULT_SLOT_OPTIONS,
    CacheHit,
    KVCacheManager,
    KVCacheManagerConfig,
    SlotOptions,
)
from kvcm.core.op_table import KEYED
from kvcm.core.planning import (
    UnifiedPlan,
    get_kv_cache_config_from_groups,
    layer_spec,
    plan_kv_cache,
    project_groups_to_rank,
    resolve_planning_options,
)
from kvcm.core.pool_types import (
    DEFAULT_EVENT_RETENTION,
    HashingParameters,
    PoolConfig,
    PoolSnapshot,
    PoolState,
    Registration,
    check_pool_id,
    hash_length_bytes,
)
from kvcm.core.program import (
    AllocOptions,
    HitSpec,
    ItemStatus,
    OpKind,
    StepOutcome,
    StepProgram,
)
from kvcm.core.request import Request, RequestStatus
from kvcm.core.stats import PrefixCacheStats
from kvcm.core.step import (
    PhaseHook,
    check_append,
    check_new_request,
    execute_program,
    run_step,
    validate_program,
)

__all__ = [
    "DEFAULT_EVENT_RETENTION",
    "HashingParameters",
    "OutOfRangeError",
    "Pool",
    "PoolConfig",
    "PoolRegistry",
    "PoolSnapshot",
    "PoolState",
    "Registration",
    "check_pool_id",
    "hash_length_bytes",
]


def _add_stats(total: PrefixCacheStats, drained: PrefixCacheStats) -> None:
    total.reset = total.reset or drained.reset
    total.requests += drained.requests
    total.queries += drained.queries
    total.hits += drained.hits
    total.preempted_requests += drained.preempted_requests
    total.preempted_queries += drained.preempted_queries
    total.preempted_hits += drained.preempted_hits


def _delayed_keys(program: StepProgram, outcome: StepOutcome) -> list[int]:
    """The keys of ``outcome``'s executed ALLOCATEs of ``program`` that fit with
    ``delay_cache_blocks`` (what the interpreter lists in ``StepOutcome.delayed_keys``)."""
    keys: list[int] = []
    options, statuses = program.alloc_options, outcome.alloc_statuses
    k = n = 0
    for op in program.ops[: outcome.num_ops_executed]:
        if op == OpKind.ALLOCATE:
            entry = options.get(n)
            if (
                entry is not None
                and entry.slot_options.delay_cache_blocks
                and n < len(statuses)
                and statuses[n] == ItemStatus.OK
                and k < len(program.request_keys)  # a retry is not validated again
            ):
                keys.append(program.request_keys[k])
            n += 1
        k += KEYED.get(op, 0)
    return keys


class Pool:
    """One engine instance's KV-cache bookkeeping (see the module docstring).

    Attributes:
        name: The pool id.
        options: What the pool was created with.
        state: PENDING_WORKERS until planned, then READY.
        hashing: The resolved hashing parameters (block size known once READY).
        manager: The KV-cache manager; ``None`` until READY.
        kv_cache_config: The planned pool-level config (no tensors); ``None`` until READY.
        max_model_len: The planned context length.
        registrations: Registered ranks.
        requests: Live requests by request key.
        last_step_seq: The last applied Step sequence number (0: none yet).
        last_step_outcome: The outcome of ``last_step_seq`` (answered again for a retry).
        limits: The service's hard limits.
        epoch: The pool's incarnation, set by :class:`PoolRegistry` when it is added (a
            registry-wide counter: a pool re-created under the same name gets a larger one;
            0 for a pool no registry added).
        allocations_not_fit_total: Allocations answered "does not fit" so far.
        failed_plans: Registration rounds whose plan failed (each dropped its ranks).
        lent: Whether a server runs a long call on the pool outside its event loop.
    """

    def __init__(
        self,
        name: str,
        options: PoolConfig,
        *,
        limits: Limits = DEFAULT_LIMITS,
        blocks_in_use: Callable[[], int] = lambda: 0,
    ) -> None:
        """Create a pool; one with an explicit layout is planned (READY) at once.

        ``blocks_in_use`` tells planning how many blocks the server's other pools hold.

        Raises:
            InvalidArgumentError: The name or the options are out of their domain.
            ConfigError: The explicit layout cannot be managed.
        """
        check_pool_id(name)
        self.name = name
        self.options = options
        self.limits = limits
        self.epoch = 0
        self._blocks_in_use = blocks_in_use
        algorithm = options.hash_algorithm
        self._seed = resolve_none_hash_seed(algorithm, options.hash_seed)
        self.hashing = HashingParameters(
            algorithm=algorithm,
            seed=self._seed,
            hash_block_size=options.hash_block_size or 0,
            hash_length_bytes=hash_length_bytes(algorithm),
            num_lookahead_tokens=options.num_hash_lookahead_tokens,
        )
        self.state = PoolState.PENDING_WORKERS
        self.manager: KVCacheManager | None = None
        self.host_tier: HostTier | None = None
        self.kv_cache_config: KVCacheConfig | None = None
        self.plan: UnifiedPlan | None = None
        self.max_model_len = options.max_model_len
        self.registrations: dict[int, Registration] = {}
        self.requests: dict[int, Request] = {}
        self.request_ids: dict[int, str] = {}
        self.last_step_seq = 0
        self.last_step_outcome: StepOutcome | None = None
        # NOTE: True while the server runs a long call on this pool in a worker thread; calls
        # wait for it, and readers that cannot wait (metrics) skip the pool meanwhile.
        self.lent = False
        self.allocations_not_fit_total = 0
        self.failed_plans = 0
        self._events = EventLog(options.event_retention_num_events)
        self._stats_total = PrefixCacheStats()
        self._stats_untaken = PrefixCacheStats()
        if options.explicit_layout is not None:
            self._make_ready(options.explicit_layout, options.max_model_len)

    # ------------------------------------------------------------------------ planning
    def _make_ready(self, config: KVCacheConfig, max_model_len: int) -> None:
        options = self.options
        scheduler_config = KVCacheConfig(
            num_blocks=config.num_blocks,
            kv_cache_tensors=(),
            kv_cache_groups=config.kv_cache_groups,
        )
        manager = KVCacheManager(
            KVCacheManagerConfig(
                kv_cache_config=scheduler_config,
                max_model_len=max_model_len,
                scheduler_block_size=options.scheduler_block_size,
                hash_block_size=options.hash_block_size,
                max_in_flight_tokens=options.max_in_flight_tokens,
                enable_caching=options.enable_caching,
                enable_kv_cache_events=options.enable_kv_cache_events,
                log_stats=options.log_stats,
                watermark=options.watermark,
                prefix_cache_retention_interval=options.prefix_cache_retention_interval,
                dcp_world_size=options.decode_context_parallel_size,
                eagle_block_drop_group_ids=options.eagle_block_drop_group_ids,
                num_hash_lookahead_tokens=options.num_hash_lookahead_tokens,
                num_prefill_lookahead=options.num_prefill_lookahead,
                enable_mamba_shared_prefix_checkpoint=(
                    options.enable_mamba_shared_prefix_checkpoint
                ),
            )
        )
        self.manager = manager
        block_bytes = pool_bytes_per_block(config.kv_cache_groups)
        if options.enable_caching and block_bytes and options.host_tier_bytes >= block_bytes:
            # A budget below one block (or a pool without caching) keeps no tier.
            self.host_tier = HostTier(
                options.host_tier_bytes // block_bytes,
                block_bytes=block_bytes,
                enable_events=options.enable_kv_cache_events,
            )
            manager.block_pool.demote = self.host_tier.demote
        elif options.offload_host_blocks:
            # Kept by the engine's offloading connector (HOST_SYNC ops); nothing demotes.
            self.host_tier = HostTier(
                options.offload_host_blocks,
                block_bytes=block_bytes,
                enable_events=options.enable_kv_cache_events,
                connector=True,
            )
        self.kv_cache_config = scheduler_config
        self.max_model_len = max_model_len
        self.hashing = HashingParameters(
            algorithm=self.hashing.algorithm,
            seed=self._seed,
            hash_block_size=manager.hash_block_size,
            hash_length_bytes=self.hashing.hash_length_bytes,
            num_lookahead_tokens=options.num_hash_lookahead_tokens,
        )
        self.state = PoolState.READY

    def register_worker(
        self,
        rank: int,
        world_size: int,
        specs: Mapping[str, KVCacheSpec],
        memory: int,
        *,
        limits: Limits | None = None,
    ) -> None:
        """Record one rank's registration; plan the pool once every rank has registered.

        ``specs`` is kept in the caller's order (the model runner's layer order), which
        decides group membership, tensor order and byte offsets as in vLLM. Idempotent for
        the same specs (in the same order) and memory. A rejected rank changes nothing.

        A plan that fails (the ranks' specs or memory together cannot be planned) fails the
        whole round: every registration is dropped, ``failed_plans`` counts it, and the
        error is raised, so the waiting ranks can be told and register again.

        Raises:
            InvalidArgumentError: rank or world_size out of range, no layers, memory or a
                page that does not fit a uint64 (names the field).
            ConfigError: A layer kvcm cannot plan yet (Mamba "align" mode) or cannot plan
                with the pool's inputs (cross attention without an encoder budget), or
                planning rejected the specs (the round is dropped).
            AlreadyExistsError: The rank registered before with other specs or memory.
            FailedPreconditionError: Specs disagree with another rank or the explicit layout.
            ResourceExhaustedError: More ranks than ``limits.max_pending_registrations``; or
                (the round is dropped) the memory holds fewer than 2 blocks or more than
                ``limits.max_blocks_per_pool``.
        """
        if limits is None:
            limits = self.limits
        self._check_registration(rank, world_size, specs, memory, limits)
        registration = Registration(specs=dict(specs), available_memory_bytes=memory)
        known = self.registrations.get(rank)
        if known is not None:
            if known == registration and list(known.specs) == list(specs):
                return
            raise AlreadyExistsError(
                f"rank {rank} of pool {self.name!r} registered before with other specs, layer "
                "order or memory",
                field="layer_specs",
            )
        layout = self.options.explicit_layout
        if layout is not None:
            self._check_against_layout(rank, specs, layout)
            self.registrations[rank] = registration
            return
        if len(self.registrations) >= limits.max_pending_registrations:
            raise ResourceExhaustedError(
                f"pool {self.name!r} holds its limit of {limits.max_pending_registrations} "
                "pending registrations (limits.max_pending_registrations)",
                field="rank",
            )
        self._check_against_ranks(rank, specs)
        registered = {**self.registrations, rank: registration}
        if len(registered) < world_size:
            self.registrations = registered
            return
        try:
            self._plan(registered, limits)
        except KVCMError:
            self.registrations = {}
            self.failed_plans += 1
            raise
        self.registrations = registered

    def _check_registration(
        self,
        rank: int,
        world_size: int,
        specs: Mapping[str, KVCacheSpec],
        memory: int,
        limits: Limits,
    ) -> None:
        pool_world = self.options.world_size
        if pool_world and world_size != pool_world:
            raise InvalidArgumentError(
                f"world_size {world_size} is not pool {self.name!r}'s world_size {pool_world}",
                field="world_size",
            )
        if world_size > limits.max_pending_registrations:
            raise ResourceExhaustedError(
                f"world_size {world_size} exceeds limits.max_pending_registrations "
                f"({limits.max_pending_registrations}): the pool could never be planned",
                field="world_size",
            )
        if not 0 <= rank < max(world_size, 1):
            raise InvalidArgumentError(
                f"rank must be in [0, {world_size}), got {rank}", field="rank"
            )
        if type(memory) is not int or not 0 <= memory <= UINT64_MAX:
            raise InvalidArgumentError(
                f"available_memory_bytes must be an int in [0, 2**64), got {memory!r}",
                field="available_memory_bytes",
            )
        if not specs:
            raise InvalidArgumentError("layer_specs must not be empty", field="layer_specs")
        for name, spec in specs.items():
            check_plannable_spec(name, spec)
        if self.options.explicit_layout is None:
            # What the specs need of the pool's planning inputs (an encoder budget for
            # cross attention) is refused before anything is recorded.
            resolve_planning_options(self.options.planning_options(), specs)

    def withdraw_worker(self, rank: int) -> bool:
        """Drop a pending rank's registration (its call ended before the pool was planned).

        Returns:
            Whether a registration was dropped (``False`` once READY or when unknown).
        """
        if self.manager is not None or rank not in self.registrations:
            return False
        self.registrations = {r: reg for r, reg in self.registrations.items() if r != rank}
        return True

    def _check_against_layout(
        self, rank: int, specs: Mapping[str, KVCacheSpec], layout: KVCacheConfig
    ) -> None:
        by_layer = {
            name: layer_spec(group, name)
            for group in layout.kv_cache_groups
            for name in group.layer_names
        }
        for name, spec in specs.items():
            expected = by_layer.get(name)
            if expected is None:
                raise FailedPreconditionError(
                    f"rank {rank}: layer {name!r} is not in pool {self.name!r}'s explicit layout"
                )
            if expected != spec:
                raise FailedPreconditionError(
                    f"rank {rank}: layer {name!r} has spec {spec!r}, the explicit layout "
                    f"{expected!r}"
                )

    def _check_against_ranks(self, rank: int, specs: Mapping[str, KVCacheSpec]) -> None:
        for other, registration in self.registrations.items():
            for name, spec in specs.items():
                known = registration.specs.get(name)
                if known is not None and known != spec:
                    raise FailedPreconditionError(
                        f"ranks {other} and {rank} disagree on layer {name!r}: "
                        f"{known!r} != {spec!r}"
                    )

    def _plan(self, registered: Mapping[int, Registration], limits: Limits) -> None:
        ranks = sorted(registered)
        options = self.options
        plan = plan_kv_cache(
            [registered[r].specs for r in ranks],
            [registered[r].available_memory_bytes for r in ranks],
            options.planning_options(),
        )
        if plan.num_blocks < 2:
            raise ResourceExhaustedError(
                f"pool {self.name!r}: the ranks' memory holds {plan.num_blocks} blocks, "
                "fewer than 2 (the null block and one usable block)",
                field="available_memory_bytes",
            )
        if plan.num_blocks > limits.max_blocks_per_pool:
            raise ResourceExhaustedError(
                f"pool {self.name!r}: the ranks' memory holds {plan.num_blocks} blocks, more "
                f"than limits.max_blocks_per_pool ({limits.max_blocks_per_pool}); offer less "
                "available_memory_bytes or set num_blocks_override",
                field="available_memory_bytes",
            )
        check_pool_blocks(self.limits, self.name, plan.num_blocks, self._blocks_in_use())
        self.plan = plan
        self._make_ready(plan.scheduler_kv_cache_config, plan.max_model_len)

    def rank_config(self, rank: int) -> KVCacheConfig:
        """The planned config of a registered rank (its own tensors).

        Raises:
            FailedPreconditionError: The pool is not READY.
            NotFoundError: The rank has not registered.
        """
        registration = self.registrations.get(rank)
        if registration is None:
            raise NotFoundError(f"rank {rank} has not registered with pool {self.name!r}")
        if self.plan is not None:
            return self.plan.kv_cache_config(rank)
        config = self.kv_cache_config
        if config is None:
            raise FailedPreconditionError(f"pool {self.name!r} is not READY")
        groups = project_groups_to_rank(config.kv_cache_groups, registration.specs)
        placed = get_kv_cache_config_from_groups(
            groups, config.num_blocks, self.options.kv_cache_layout
        )
        return KVCacheConfig(
            num_blocks=config.num_blocks,
            kv_cache_tensors=placed.kv_cache_tensors,
            kv_cache_groups=config.kv_cache_groups,
            kv_cache_layout=placed.kv_cache_layout,
        )

    # ------------------------------------------------------------------------ requests
    def ready_manager(self) -> KVCacheManager:
        """The manager of a READY pool.

        Raises:
            FailedPreconditionError: The pool is still waiting for workers.
        """
        manager = self.manager
        if manager is None:
            raise FailedPreconditionError(
                f"pool {self.name!r} is PENDING_WORKERS: "
                f"{len(self.registrations)} of {self.options.world_size} ranks registered"
            )
        return manager

    def request(self, key: int) -> Request:
        """The live request with this key.

        Raises:
            NotFoundError: No live request has the key.
        """
        request = self.requests.get(key)
        if request is None:
            raise NotFoundError(f"request key {key} is not live in pool {self.name!r}")
        return request

    def split_hashes(self, field_name: str, raw: bytes, expected: int) -> list[BlockHash]:
        """Split concatenated hashes, checking their count.

        Raises:
            InvalidArgumentError: ``raw`` is not ``expected`` hashes (names ``field_name``).
        """
        size = self.hashing.hash_length_bytes
        if len(raw) != expected * size:
            raise InvalidArgumentError(
                f"{field_name} must hold {expected} hashes of {size} bytes, got {len(raw)} bytes"
            )
        return [BlockHash(raw[i : i + size]) for i in range(0, len(raw), size)]

    def expected_num_hashes(self, num_tokens: int) -> int:
        """Block hashes a request of ``num_tokens`` tokens carries."""
        if not self.options.enable_caching:
            return 0
        # A lookahead hash also covers the tokens after its block.
        num_hashed = num_tokens - self.options.num_hash_lookahead_tokens
        return max(num_hashed, 0) // self.hashing.hash_block_size

    def add_request(
        self,
        key: int,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_hashes: bytes,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
        report_cached_blocks: bool = False,
    ) -> Request:
        """Start tracking a request.

        Raises:
            FailedPreconditionError: The pool is not READY.
            AlreadyExistsError: The key is live.
            InvalidArgumentError: Empty or too long prompt, wrong hashes, negative lora_id.
        """
        self.ready_manager()
        if key in self.requests:
            raise AlreadyExistsError(self.live_key_message(key))
        check_new_request(self, key, prompt_token_ids, block_hashes, lora_id)
        hashes = self.split_hashes(
            "block_hashes", block_hashes, len(block_hashes) // self.hashing.hash_length_bytes
        )
        request = Request(
            str(key),
            prompt_token_ids,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
            report_cached_blocks=report_cached_blocks,
        )
        if self.options.verify_block_hashes:
            self._verify(request, hashes, 0)
        request.block_hashes = hashes
        self.requests[key] = request
        self.request_ids[key] = request_id
        return request

    def computed_hashes(
        self, token_ids: Sequence[int], lora_name: str | None, cache_salt: str | None
    ) -> list[BlockHash]:
        """The block hashes the server computes for ``token_ids`` (hash verification)."""
        from kvcm.common.hashing import BlockHasher

        hasher = BlockHasher(
            self.hashing.hash_block_size,
            self.hashing.algorithm,
            self._seed,
            num_lookahead_tokens=self.options.num_hash_lookahead_tokens,
        )
        return hasher.hash_token_ids(token_ids, lora_name=lora_name, cache_salt=cache_salt)

    def _verify(self, request: Request, sent: Sequence[BlockHash], first: int) -> None:
        computed = self.computed_hashes(
            request.all_token_ids, request.lora_name, request.cache_salt
        )[first:]
        if list(sent) != computed[: len(sent)]:
            raise InvalidArgumentError(
                f"request key {request.request_id}: block_hashes differ from the server's"
            )

    def append_tokens(self, key: int, token_ids: Sequence[int], block_hashes: bytes) -> None:
        """Append produced tokens and the hashes of the blocks they filled.

        Raises:
            NotFoundError: Unknown key.
            InvalidArgumentError: See :func:`kvcm.core.step.check_append`.
        """
        self.ready_manager()
        request = self.request(key)
        size = self.hashing.hash_length_bytes
        if len(block_hashes) % size:
            raise InvalidArgumentError(f"block_hashes must be a multiple of {size} bytes")
        num_hashes = len(block_hashes) // size
        check_append(
            self,
            key,
            len(token_ids),
            num_hashes,
            num_before=request.num_tokens,
            hashes_before=len(request.block_hashes),
        )
        self.apply_append(
            request, token_ids, self.split_hashes("block_hashes", block_hashes, num_hashes)
        )

    def apply_append(
        self, request: Request, token_ids: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        """Append validated tokens and hashes to a request."""
        before = len(request.block_hashes)
        request.all_token_ids.extend(token_ids)
        if self.options.verify_block_hashes and hashes:
            try:
                self._verify(request, hashes, before)
            except InvalidArgumentError:
                del request.all_token_ids[len(request.all_token_ids) - len(token_ids) :]
                raise
        request.block_hashes.extend(hashes)

    def free(self, key: int, *, preempt: bool, in_one_call: bool = False) -> None:
        """Free a request's blocks: preempt it (keep it) or finish it (forget it).

        ``in_one_call`` (a finish only): release every group's blocks in one pool call, as
        vLLM's deferred free does (:meth:`~kvcm.core.manager.KVCacheManager.free_deferred`).

        Raises:
            FailedPreconditionError: The pool is not READY.
            NotFoundError: Unknown key.
        """
        manager = self.ready_manager()
        request = self.request(key)
        if preempt:
            manager.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_preemptions += 1
            request.num_computed_tokens = 0
            return
        request.status = RequestStatus.FINISHED_STOPPED
        if in_one_call:
            manager.free_deferred(request)
        else:
            manager.free(request)
        if self.host_tier is not None:
            self.host_tier.drop_swapped(request.request_id)
        del self.requests[key]
        del self.request_ids[key]

    def get_computed_blocks(self, key: int, max_cache_hit_length: int | None) -> CacheHit:
        """Look a request up in the prefix cache and count the lookup (unary semantics).

        Raises:
            NotFoundError: Unknown key.
            InvalidArgumentError: A bad bound.
        """
        manager = self.ready_manager()
        request = self.request(key)
        hit = manager.get_computed_blocks(request, max_cache_hit_length)
        manager.record_prefix_cache_stats(request, hit.num_computed_tokens)
        return hit

    # ------------------------------------------------------------------------ host tier
    def _host(self) -> tuple[KVCacheManager, HostTier]:
        manager = self.ready_manager()
        if self.host_tier is None:
            raise FailedPreconditionError(
                f"pool {self.name!r} has no host tier (config.host_tier_bytes is 0)"
            )
        if self.options.offload_host_blocks:
            raise FailedPreconditionError(
                f"pool {self.name!r}'s host tier is kept by an engine's offloading connector "
                "(config.offload_host_blocks): it takes HOST_SYNC ops only"
            )
        return manager, self.host_tier

    def lookup_tiers(self, key: int) -> tuple[CacheHit, int]:
        """A waiting request's device hit and the tokens the host tier holds after it.

        Raises:
            FailedPreconditionError: The pool has no host tier.
            NotFoundError: Unknown key.
        """
        manager, host = self._host()
        request = self.request(key)
        hit = manager.get_computed_blocks(request)
        return hit, host_hit_tokens(manager, host, request, hit.num_computed_tokens)

    def admit_with_host(
        self, key: int, num_new_tokens: int, *, looked_up: tuple[CacheHit, int] | None = None
    ) -> HostAdmission | None:
        """Admit a waiting request with its device hit and its host hit.

        ``looked_up`` is what ``lookup_tiers`` answered just before (else it is looked up
        here). The host tokens come back as host-to-device copies; the request is RUNNING
        with both hits computed. ``None`` when it does not fit.

        Raises:
            FailedPreconditionError: The pool has no host tier, or the request holds blocks.
            NotFoundError: Unknown key.
            InvalidArgumentError: The host hit is not whole blocks the tier holds.
        """
        manager, host = self._host()
        request = self.request(key)
        if manager.holds_blocks(request.request_id):
            raise FailedPreconditionError(f"request key {key} holds blocks already")
        hit, num_host = self.lookup_tiers(key) if looked_up is None else looked_up
        request.num_computed_tokens = 0
        admission = admit_with_host_hit(
            manager, host, request, num_new_tokens, hit=hit, num_host_hit_tokens=num_host
        )
        if admission is None:
            self.allocations_not_fit_total += 1
            return None
        manager.record_prefix_cache_stats(request, hit.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit.num_computed_tokens + num_host
        return admission

    def swap_out(self, key: int) -> list[tuple[int, int]] | None:
        """Preempt a running request by swapping its blocks to the host tier.

        Returns the device-to-host copies, or ``None`` (nothing changed) when the tier has
        no room: then preempt by recomputation (``free(key, preempt=True)``).

        Raises:
            FailedPreconditionError: No host tier, the request holds no blocks, or it is
                swapped out already.
            NotFoundError: Unknown key.
        """
        manager, host = self._host()
        request = self.request(key)
        if not manager.holds_blocks(request.request_id):
            raise FailedPreconditionError(f"request key {key} holds no blocks")
        copies = swap_out(manager, host, request)
        if copies is None:
            return None
        self.free(key, preempt=True)
        return copies

    def swap_out_group(self, keys: Sequence[int]) -> dict[int, list[tuple[int, int]]] | None:
        """Preempt several running requests by swapping them out together, all or none.

        Blocks they share are copied once. Returns each key's device-to-host copies, or
        ``None`` (nothing changed) when the tier has no room for the whole group.

        Raises:
            FailedPreconditionError: No host tier, a request holds no blocks, or is named twice.
            NotFoundError: Unknown key.
        """
        manager, host = self._host()
        requests = [self.request(key) for key in keys]
        for key, request in zip(keys, requests, strict=True):
            if not manager.holds_blocks(request.request_id):
                raise FailedPreconditionError(f"request key {key} holds no blocks")
        out = host.swap_out_group(
            [
                (request.request_id, swap_out_tables(manager, request), request.num_computed_tokens)
                for request in requests
            ]
        )
        if out is None:
            return None
        for key in keys:
            self.free(key, preempt=True)
        return {key: out[request.request_id] for key, request in zip(keys, requests, strict=True)}

    def swap_in(self, key: int, num_new_tokens: int) -> HostAdmission | None:
        """Re-admit a swapped request (device hit first, the rest copied back from host).

        ``None`` when it does not fit (it stays swapped).

        Raises:
            FailedPreconditionError: No host tier, or the request is not swapped out.
            NotFoundError: Unknown key.
        """
        manager, host = self._host()
        request = self.request(key)
        request.num_computed_tokens = 0
        admission = swap_in(manager, host, request, num_new_tokens)
        if admission is None:
            self.allocations_not_fit_total += 1
            return None
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = (
            admission.num_device_hit_tokens + admission.num_host_hit_tokens
        )
        return admission

    def take_host_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's copies since the last take (see ``HostTier.take_copies``)."""
        _, host = self._host()
        return host.take_copies()

    # ------------------------------------------------------------------- Step programs
    def run_step(self, program: StepProgram, *, phase: PhaseHook | None = None) -> StepOutcome:
        """Run a Step program (:func:`kvcm.core.step.run_step`: limits, step_seq, validate,
        execute; ``phase`` wraps the last two). A rejected program changes nothing.

        Raises:
            KVCMError: See :func:`kvcm.core.step.run_step`.
        """
        seq = program.step_seq
        restored = self.last_step_outcome
        if seq is None or seq != self.last_step_seq or restored is None or restored.delayed_keys:
            return run_step(self, program, phase=phase)
        # A retry answered from an outcome restored from a snapshot written before snapshots
        # kept the answer's delayed_keys (an older checkpoint): derive them from the retried
        # program, so the server tracks its P/D transfers again as for the first answer.
        outcome = run_step(self, program, phase=phase)
        if outcome is restored:
            outcome.delayed_keys = _delayed_keys(program, outcome)
        return outcome

    def _run_one(self, program: StepProgram) -> StepOutcome:
        # A unary call: the same rules as the op in a Step, reported without the op prefix.
        manager = self.ready_manager()
        try:
            deferred_hits = validate_program(self, manager, program)
        except KVCMError as exc:
            raise exc.unlocated() from None
        return execute_program(self, manager, program, deferred_hits)

    def allocate(
        self,
        key: int,
        num_new_tokens: int,
        num_computed_tokens: int,
        *,
        hit: HitSpec | None = None,
        options: SlotOptions = DEFAULT_SLOT_OPTIONS,
        num_in_flight_tokens: int = 0,
    ) -> tuple[list[int], ...] | None:
        """allocate_slots of a live request (unary AllocateSlots): one ALLOCATE program.

        Args:
            key: The request key.
            num_new_tokens: vLLM's num_new_tokens.
            num_computed_tokens: The request's computed tokens before the call; a caller that
                counted the hit into it (equal to ``hit.num_tokens``) means 0.
            hit: A hit the caller looked up before (checked against the cache now).
            options: allocate_slots' rarely used knobs.
            num_in_flight_tokens: vLLM's request.num_in_flight_tokens.

        Returns:
            The new block ids per group, or ``None`` when they do not fit.

        Raises:
            NotFoundError: Unknown key.
            InvalidArgumentError: A count out of range (names the field).
            FailedPreconditionError: A hit block no longer holds the request's hash.
        """
        if hit is not None and num_computed_tokens and num_computed_tokens == hit.num_tokens:
            num_computed_tokens = 0
        program = StepProgram(
            ops=[OpKind.ALLOCATE],
            request_keys=[key],
            alloc_num_new_tokens=[num_new_tokens],
            alloc_num_computed_tokens=[num_computed_tokens],
        )
        if hit is not None or options is not DEFAULT_SLOT_OPTIONS or num_in_flight_tokens:
            program.alloc_options[0] = AllocOptions(
                hit=hit, slot_options=options, num_in_flight_tokens=num_in_flight_tokens
            )
        outcome = self._run_one(program)
        if outcome.alloc_statuses[0] != 1:
            return None
        ids = outcome.alloc_block_ids
        groups: list[list[int]] = []
        start = 0
        for count in outcome.alloc_num_block_ids:
            groups.append(ids[start : start + count])
            start += count
        return tuple(groups)

    def cache_blocks(self, key: int, num_computed_tokens: int) -> None:
        """cache_blocks of a request holding blocks (one CACHE_BLOCKS program).

        Raises:
            NotFoundError: Unknown key, or it holds no blocks.
            InvalidArgumentError: The count is beyond the request's tokens or blocks.
        """
        self._run_one(
            StepProgram(
                ops=[OpKind.CACHE_BLOCKS],
                request_keys=[key],
                cache_num_computed_tokens=[num_computed_tokens],
            )
        )

    def remove_skipped_blocks(self, key: int, total_computed_tokens: int) -> None:
        """remove_skipped_blocks of a request holding blocks (one op program).

        Raises:
            NotFoundError: Unknown key, or it holds no blocks.
            InvalidArgumentError: The count is beyond the request's tokens.
        """
        self._run_one(
            StepProgram(
                ops=[OpKind.REMOVE_SKIPPED_BLOCKS],
                request_keys=[key],
                remove_skipped_total_computed_tokens=[total_computed_tokens],
            )
        )

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop blocks from the prefix cache (one EVICT_BLOCKS program).

        Raises:
            InvalidArgumentError: An id outside [1, num_blocks) (names ``block_ids[i]``).
        """
        self._run_one(
            StepProgram(
                ops=[OpKind.EVICT_BLOCKS],
                evict_num_block_ids=[len(block_ids)],
                evict_block_ids=list(block_ids),
            )
        )

    def reset_prefix_cache(self) -> bool:
        """reset_prefix_cache (one op program): ``False`` while blocks are in use."""
        return self._run_one(StepProgram(ops=[OpKind.RESET_PREFIX_CACHE])).reset[0]

    def state_fingerprint(self) -> bytes:
        """A canonical serialization of everything any call can change (O(state)).

        See :func:`kvcm.core.fingerprint.state_fingerprint`.
        """
        from kvcm.core.fingerprint import state_fingerprint

        return state_fingerprint(self)

    # ---------------------------------------------------------------------- statistics
    def _drain_stats(self) -> None:
        manager = self.manager
        if manager is None:
            return
        drained = manager.make_prefix_cache_stats()
        if drained is not None:
            _add_stats(self._stats_total, drained)
            _add_stats(self._stats_untaken, drained)

    def take_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix-cache counters since the last take (``None`` when log_stats is off).

        Raises:
            FailedPreconditionError: The pool is not READY.
        """
        self.ready_manager()
        if not self.options.log_stats:
            return None
        self._drain_stats()
        taken = self._stats_untaken
        self._stats_untaken = PrefixCacheStats()
        return taken

    # -------------------------------------------------------------------------- events
    def publish_events(self, now: float) -> int:
        """Move the manager's new events into the sequenced log; how many were published."""
        manager = self.manager
        if manager is None or not self.options.enable_kv_cache_events:
            return 0
        events = manager.take_events()
        if self.host_tier is not None:
            events += self.host_tier.take_events()
        return self._events.append(events, now) if events else 0

    def publish_cleared(self, now: float) -> int:
        """Publish ``AllBlocksCleared`` as the last batch of a pool that is deleted or replaced:
        whatever it cached is gone for its subscribers. How many events (0: it publishes none)."""
        if self.manager is None or not self.options.enable_kv_cache_events:
            return 0
        return self._events.append([AllBlocksCleared()], now)

    def event_log_contents(self) -> list[tuple[KVCacheEvent, float]]:
        """The kept events with their timestamps, oldest first (for fingerprints)."""
        return self._events.contents()

    def stats_totals(self) -> tuple[PrefixCacheStats, PrefixCacheStats]:
        """The cumulative and the not yet taken prefix-cache counters (for fingerprints)."""
        return self._stats_total, self._stats_untaken

    def restore_stats_totals(self, total: PrefixCacheStats, untaken: PrefixCacheStats) -> None:
        """Install counters saved by :meth:`stats_totals` (:mod:`kvcm.core.snapshot`)."""
        self._stats_total = total
        self._stats_untaken = untaken

    def restore_events(
        self,
        next_sequence: int,
        entries: Sequence[tuple[KVCacheEvent, float]],
        batches: tuple[int, Sequence[EventBatchRecord]] = (0, ()),
    ) -> None:
        """Install a saved event log: the kept events end right before ``next_sequence``;
        ``batches`` is the next batch number and the kept batches (:meth:`event_batches`)."""
        self._events.restore(next_sequence, entries)
        self._events.restore_batches(*batches)

    def event_batches(self) -> tuple[int, list[EventBatchRecord]]:
        """The next batch number and the kept batches (for snapshots)."""
        return self._events.next_batch, self._events.batches()

    def last_event_batch(self) -> tuple[int, list[KVCacheEvent], float] | None:
        """The batch the last publication made: (batch sequence, events, timestamp)."""
        return self._events.last_batch()

    def event_batches_from(self, start: int) -> list[tuple[int, list[KVCacheEvent], float]]:
        """Every kept batch numbered ``start`` or later (a ZMQ replay)."""
        return self._events.batches_from(start)

    @property
    def last_event_sequence(self) -> int:
        """Sequence number of the last published event (0: none yet)."""
        return self._events.last_sequence

    @property
    def oldest_event_sequence(self) -> int:
        """Oldest sequence number still kept (== next one when none are kept)."""
        return self._events.oldest_sequence

    def check_event_start(self, start: int | None) -> int:
        """The first sequence a subscription starting at ``start`` reads.

        Raises:
            FailedPreconditionError: The pool publishes no events.
            OutOfRangeError: ``start`` is older than the oldest kept event.
            InvalidArgumentError: ``start`` is beyond the next event.
        """
        if not self.options.enable_kv_cache_events:
            raise FailedPreconditionError(f"pool {self.name!r} publishes no KV events")
        return self._events.check_start(start)

    def events_from(
        self, sequence: int, max_events: int
    ) -> tuple[list[KVCacheEvent], float] | None:
        """Up to ``max_events`` events from ``sequence`` on, with the newest one's timestamp.

        Returns:
            ``([], 0.0)`` when none is published yet, ``None`` when ``sequence`` was dropped.
        """
        return self._events.read(sequence, max_events)

    def live_key_message(self, key: int) -> str:
        """Why adding ``key`` fails while it is live, whose it likely is and what to do."""
        seq = self.last_step_seq
        driver = (
            f"another scheduler is likely driving this pool (its last step was {seq})"
            if seq
            else "another client (or an earlier run of this one) added it and did not free it"
        )
        return (
            f"request key {key} is live in pool {self.name!r}: {driver}. A pool takes one "
            "scheduler: give this one its own pool (a new pool id), or free the key first "
            "(Free, or FINISH in a Step)"
        )

    # ------------------------------------------------------------------------ snapshot
    def snapshot(self) -> PoolSnapshot:
        """Copy the pool's state out (drains the manager's stats into the totals)."""
        self._drain_stats()
        manager = self.manager
        total = self._stats_total
        groups: tuple[tuple[int, str, int, int], ...] = ()
        num_blocks = num_free = num_cached = evicted = 0
        usage = recent = 0.0
        if manager is not None and self.kv_cache_config is not None:
            groups = tuple(
                (
                    index,
                    group.kv_cache_spec.kind,
                    group.kv_cache_spec.block_size,
                    len(group.layer_names),
                )
                for index, group in enumerate(self.kv_cache_config.kv_cache_groups)
            )
            pool = manager.block_pool
            num_blocks = pool.num_gpu_blocks
            num_free = manager.num_free_blocks
            num_cached = pool.num_cached_blocks
            evicted = pool.num_evicted_blocks
            usage = manager.usage
            recent = manager.prefix_cache_hit_rate
        return PoolSnapshot(
            name=self.name,
            state=self.state,
            world_size=self.options.world_size,
            registered_workers=len(self.registrations),
            num_blocks=num_blocks,
            num_free_blocks=num_free,
            usage=usage,
            num_cached_blocks=num_cached,
            groups=groups,
            num_requests=len(self.requests),
            requests=total.requests,
            queries=total.queries,
            hits=total.hits,
            preempted_requests=total.preempted_requests,
            preempted_queries=total.preempted_queries,
            preempted_hits=total.preempted_hits,
            recent_hit_rate=recent,
            evicted_blocks_total=evicted,
            events_emitted_total=self.last_event_sequence,
            allocations_not_fit_total=self.allocations_not_fit_total,
            labels=dict(self.options.labels),
            epoch=self.epoch,
            last_step_seq=self.last_step_seq,
            scheduler_lease_s=self.options.scheduler_lease_s,
            **self._host_tier_counters(),
        )

    def _host_tier_counters(self) -> dict[str, int]:
        host = self.host_tier
        if host is None:
            return {}
        stats = host.stats()
        return {
            "host_tier_blocks": stats.num_blocks,
            "host_tier_used_blocks": stats.num_used,
            "host_tier_hit_tokens": stats.hit_tokens,
            # Device-to-host copies: demotions, or an engine connector's stores.
            "host_tier_demoted_blocks": stats.demotions + stats.stores,
            "host_tier_loaded_blocks": stats.loads,
            "host_tier_evicted_blocks": stats.evictions,
            "host_tier_swap_outs": stats.swap_outs,
            "host_tier_swap_ins": stats.swap_ins,
        }


class PoolRegistry:
    """The server's pools by name, within the server's :class:`~kvcm.core.limits.Limits`.

    ``create`` is ``reserve`` + ``build`` + ``add``; a server calls the three itself to build
    a large pool off its event loop: ``build`` changes nothing in the registry, and while a
    pool is built its name and blocks stay reserved (a second create of the name is
    ``AlreadyExistsError``; ``get`` and ``list`` do not see it yet).

    Attributes:
        epoch: The last epoch handed out (0: none yet); ``add`` gives each pool the next one,
            so a pool's epoch names its incarnation (a plain int, for a journal to persist).
    """

    def __init__(
        self, max_pools: int | None = None, *, limits: Limits = DEFAULT_LIMITS, epoch: int = 0
    ) -> None:
        """An empty registry within ``limits`` (``max_pools`` overrides ``limits.max_pools``).

        ``epoch`` is the last epoch handed out before (a restored registry continues from it).
        """
        if max_pools is not None:
            limits = replace(limits, max_pools=max_pools)
        self.limits = limits
        self.epoch = epoch
        self.max_pools = limits.max_pools
        self._pools: dict[str, Pool] = {}
        # Every pool, as a lookup's scope, with the (epoch, number of pools) it was made at: a
        # tuple made once per change, so a lookup makes no list of 1,000 pools that its own
        # allocations' garbage collections would traverse (a cache miss per pool).
        self._every: tuple[tuple[int, int], tuple[Pool, ...]] = ((-1, -1), ())
        self._building: dict[str, int] = {}
        self.index = PrefixIndex()

    def num_blocks(self) -> int:
        """Blocks the server's pools hold or are being built with."""
        held = sum(
            pool.manager.block_pool.num_gpu_blocks
            for pool in self._pools.values()
            if pool.manager is not None
        )
        return held + sum(self._building.values())

    def create(self, name: str, options: PoolConfig) -> Pool:
        """Create and register a pool.

        Raises:
            InvalidArgumentError: Bad name or options (ConfigError for a bad layout).
            AlreadyExistsError: The name is taken.
            ResourceExhaustedError: The registry is full, or the pool's blocks exceed a limit.
        """
        self.reserve(name, options)
        try:
            pool = self.build(name, options)
        except BaseException:
            self.release(name)
            raise
        self.add(pool)
        return pool

    def reserve(self, name: str, options: PoolConfig) -> None:
        """Check a creation and hold its name and blocks until ``add`` or ``release``.

        Raises:
            See :meth:`create`.
        """
        check_pool_id(name)
        if name in self._pools or name in self._building:
            raise AlreadyExistsError(f"pool {name!r} already exists")
        if len(self._pools) + len(self._building) >= self.max_pools:
            raise ResourceExhaustedError(f"the server holds its limit of {self.max_pools} pools")
        layout = options.explicit_layout
        num_blocks = 0 if layout is None else layout.num_blocks
        check_pool_blocks(self.limits, name, num_blocks, self.num_blocks())
        self._building[name] = num_blocks

    def build(self, name: str, options: PoolConfig) -> Pool:
        """Build a reserved pool; touches nothing in the registry (safe off the loop).

        Raises:
            InvalidArgumentError: Bad options (ConfigError for a bad layout).
        """
        try:
            return Pool(name, options, limits=self.limits, blocks_in_use=self.num_blocks)
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, KVCMError):
                raise
            raise ConfigError(f"config: {exc}") from exc

    def add(self, pool: Pool) -> None:
        """Register a pool built for a reservation, giving it the next epoch."""
        del self._building[pool.name]
        self.epoch += 1
        pool.epoch = self.epoch
        self._pools[pool.name] = pool

    def release(self, name: str) -> None:
        """Drop a reservation whose build failed or was abandoned."""
        self._building.pop(name, None)

    def get(self, name: str) -> Pool:
        """The pool called ``name``.

        Raises:
            NotFoundError: No such pool.
        """
        pool = self._pools.get(name)
        if pool is None:
            raise NotFoundError(f"pool {name!r} not found")
        return pool

    def list(self) -> list[Pool]:
        """Every pool, sorted by name."""
        return [self._pools[name] for name in sorted(self._pools)]

    def delete(self, name: str) -> Pool:
        """Remove a pool and return it.

        Raises:
            NotFoundError: No such pool.
        """
        pool = self.get(name)
        del self._pools[name]
        self.index.remove(name)
        return pool

    def scope(self, query: LookupQuery) -> Sequence[Pool]:
        """The pools ``query``'s scope matches.

        Raises:
            NotFoundError: The scope names a pool that does not exist.
        """
        if not query.pool_ids and not query.labels:
            made_at, every = self._every
            now = (self.epoch, len(self._pools))  # an add moves the epoch, a delete the count
            if made_at != now:
                every = tuple(self._pools.values())
                self._every = (now, every)
            return every
        return scope_pools(self._pools.values(), self._pools, query)

    def lookup(
        self, query: LookupQuery, hashed: Mapping[Profile, Sequence[BlockHash]] | None = None
    ) -> LookupAnswer:
        """Where ``query``'s prompt is cached, over its scope (:mod:`kvcm.core.lookup`).

        ``hashed``: the prompt's hashes, from :func:`~kvcm.core.lookup.hash_prompt` over
        :meth:`scope` (a server computes them off its event loop for long prompts).

        Raises:
            NotFoundError: The scope names a pool that does not exist.
            ResourceExhaustedError: Hashing a token prompt for the scope is too much work
                (:func:`~kvcm.core.lookup.hashing_work`).
        """
        pools = self.scope(query)
        if hashed is None:
            hashing_work(pools, query, self.index)
        return lookup(pools, self.index, query, hashed)

    def __len__(self) -> int:
        return len(self._pools)

    def __contains__(self, name: object) -> bool:
        """Whether a pool called ``name`` is registered (being built does not count)."""
        return name in self._pools
