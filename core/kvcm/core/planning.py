"""KV-cache planning: from each rank's layer specs to one KVCacheConfig per rank.

The decisions are vLLM 0.33's (``vllm/v1/core/kv_cache_planning.py``, non-DCP, non-HiSparse,
Mamba "none" mode); the code is kvcm's. The flow, for ``world_size`` ranks::

    rank specs ──merge──> model specs ──group──> global groups (layers sharing a block table)
                                                     │ project onto each rank's layers
                                                     v
    per rank: bytes per block ── null block reserved ── fit check / auto-fit max_model_len
                                                     │ num_blocks = memory // bytes per block
                                                     v
    every rank re-planned with the minimum block count ──> UnifiedPlan (RankPlan per rank)

Grouping (which layers share a block table) lives in :mod:`kvcm.core.grouping`;
planning re-exports its public names.

Everything here is pure and deterministic; bad input raises
:class:`~kvcm.common.errors.ConfigError` naming the layer or field, and nothing half-built is
returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvcm.common.config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    compute_layout_strides,
    get_kv_cache_config_from_groups,
    layer_spec,
    pool_bytes_per_block,
)
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.specs import (
    UINT64_MAX,
    CrossAttentionSpec,
    KVCacheSpec,
    SizingLimits,
    UniformTypeKVCacheSpecs,
    pins_hash_block_size,
)
from kvcm.core.grouping import (
    get_kv_cache_groups,
    merge_rank_specs,
    project_groups_to_rank,
    unify_hybrid_kv_cache_specs,
    unify_kv_cache_spec_page_size,
)

__all__ = [
    "GiB_BYTES",
    "KVCacheCapacity",
    "PlanningOptions",
    "RankPlan",
    "UnifiedPlan",
    "check_enough_kv_cache_memory",
    "compute_layout_strides",
    "estimate_max_model_len",
    "get_kv_cache_capacity",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "hybrid_attention_block_size",
    "layer_spec",
    "max_memory_usage_bytes",
    "merge_rank_specs",
    "plan_kv_cache",
    "pool_bytes_per_block",
    "project_groups_to_rank",
    "resolve_kv_cache_block_sizes",
    "resolve_planning_options",
    "scheduler_kv_cache_config",
    "unify_hybrid_kv_cache_specs",
    "unify_kv_cache_spec_page_size",
]

GiB_BYTES = 1 << 30
"""Bytes in a GiB (the unit of vLLM's memory messages)."""


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def _format_gib(num_bytes: int) -> str:
    return f"{round(num_bytes / GiB_BYTES, 2)}"


# ----------------------------------------------------------------------------- options
@dataclass(frozen=True, slots=True, kw_only=True)
class PlanningOptions:
    """The engine settings planning depends on.

    Attributes:
        max_model_len: Longest sequence (prompt + output) one request may reach. With
            ``auto_fit_max_model_len`` it is the upper bound of the search.
        max_in_flight_tokens: Tokens scheduled but not yet settled (vLLM's
            ``max_in_flight_tokens``, at least ``max_num_batched_tokens``); sizes
            sliding-window and chunked-local layers. ``None``: ``max_model_len``.
        max_num_encoder_input_tokens: Encoder length cross-attention layers cache (vLLM's
            ``scheduler_config.max_num_encoder_input_tokens``, which vLLM sets to
            ``max_num_batched_tokens``). ``None``: unknown, and a model with cross-attention
            layers is refused (vLLM never plans them without an encoder budget).
        num_gpu_blocks_override: Plan exactly this many blocks per rank, whatever the memory.
        kv_cache_memory_bytes: Every rank gives exactly this many bytes, whatever it offered
            (vLLM's ``cache_config.kv_cache_memory_bytes``, which replaces each worker's
            profiled memory). ``None``: each rank's own figure.
        enable_hybrid_manager: ``False`` promotes local-attention layers to full attention
            (vLLM's ``scheduler_config.disable_hybrid_kv_cache_manager`` as the engine
            resolved it: ``--disable-hybrid-kv-cache-manager``, or turned off by vLLM for a
            platform without hybrid support, a KV connector without it, or chunked local
            attention with EAGLE or ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0``).
        auto_fit_max_model_len: Shrink ``max_model_len`` to what the memory of every rank
            holds (vLLM's ``max_model_len=-1``).
        kv_cache_layout: Physical axis order of the workers' KV cache.
        enable_caching: Whether prefix caching is on (decides the hash block size).
        prefix_match_unit: Hash block size override for hybrid models (vLLM's
            ``prefix_match_unit``); ``None``: the gcd of the groups' block sizes.
        device_name: How the capacity report names the device pool (``"GPU"``).
    """

    max_model_len: int
    max_in_flight_tokens: int | None = None
    max_num_encoder_input_tokens: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_hybrid_manager: bool = True
    auto_fit_max_model_len: bool = False
    kv_cache_layout: KVCacheLayout = KVCacheLayout.LBNHC
    enable_caching: bool = True
    prefix_match_unit: int | None = None
    device_name: str = "GPU"

    def __post_init__(self) -> None:
        for name in ("max_model_len",):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"PlanningOptions.{name} must be a positive int, got {value!r}")
        for name in (
            "max_in_flight_tokens",
            "num_gpu_blocks_override",
            "kv_cache_memory_bytes",
            "prefix_match_unit",
        ):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(
                    f"PlanningOptions.{name} must be a positive int or None, got {value!r}"
                )
        encoder = self.max_num_encoder_input_tokens
        if encoder is not None and (type(encoder) is not int or encoder < 0):
            raise ConfigError(
                "PlanningOptions.max_num_encoder_input_tokens must be a non-negative int or "
                f"None, got {encoder!r}",
                field="max_num_encoder_input_tokens",
            )
        object.__setattr__(
            self,
            "kv_cache_layout",
            KVCacheLayout.parse(self.kv_cache_layout, "PlanningOptions.kv_cache_layout"),
        )

    def limits(self, max_model_len: int | None = None) -> SizingLimits:
        """The sizing limits at ``max_model_len`` (default: the configured one)."""
        return SizingLimits(
            max_model_len=self.max_model_len if max_model_len is None else max_model_len,
            max_in_flight_tokens=self.max_in_flight_tokens,
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens or 0,
        )


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheCapacity:
    """How much the unified pool holds, as vLLM reports it at start-up.

    Attributes:
        num_tokens: Tokens the pool holds for requests of ``max_model_len`` tokens
            (concurrency times ``max_model_len``, rounded down).
        max_concurrency: Requests of ``max_model_len`` tokens that fit at once.
        max_model_len: The request length the figures are for.
        device_name: The pool's device name in the report.
    """

    num_tokens: int
    max_concurrency: float
    max_model_len: int
    device_name: str = "GPU"

    @property
    def report(self) -> str:
        """vLLM's start-up line: ``GPU KV cache size: N tokens, Maximum concurrency ...``."""
        return (
            f"{self.device_name} KV cache size: {self.num_tokens:,} tokens, "
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
            f"{self.max_concurrency:.2f}x"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlan:
    """One rank's share of a unified plan.

    Attributes:
        rank: The rank, in registration order.
        kv_cache_config: The rank's config: the unified block count, its own layers' tensors.
        available_memory_bytes: The memory the rank offered.
        num_blocks_fit: Blocks the rank's memory held before unification.
    """

    rank: int
    kv_cache_config: KVCacheConfig
    available_memory_bytes: int
    num_blocks_fit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class UnifiedPlan:
    """The plan every rank and the scheduler of one engine share.

    Attributes:
        kv_cache_groups: The model's groups (all ranks' layers).
        ranks: Each rank's plan, in rank order.
        num_blocks: Blocks of the pool (the minimum over ranks; the null block included).
        max_model_len: The context length planned for (after auto-fit).
        scheduler_kv_cache_config: The scheduler's view (one representative spec per group).
        scheduler_block_size: Token granularity of scheduling (lcm of group block sizes).
        hash_block_size: Tokens per request block hash.
        capacity: Tokens and concurrency the pool holds.
    """

    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    ranks: tuple[RankPlan, ...]
    num_blocks: int
    max_model_len: int
    scheduler_kv_cache_config: KVCacheConfig
    scheduler_block_size: int
    hash_block_size: int
    capacity: KVCacheCapacity

    def kv_cache_config(self, rank: int) -> KVCacheConfig:
        """The config of ``rank``.

        Raises:
            InvalidArgumentError: No such rank.
        """
        if type(rank) is not int or not 0 <= rank < len(self.ranks):
            raise InvalidArgumentError(f"rank must be in [0, {len(self.ranks)}), got {rank!r}")
        return self.ranks[rank].kv_cache_config


# ----------------------------------------------------------------------------- sizing
def _group_pages_per_request(group: KVCacheGroupSpec, limits: SizingLimits) -> int:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return max(
            _cdiv(s.max_memory_usage_bytes(limits), s.page_size_bytes)
            for s in spec.kv_cache_specs.values()
        )
    return _cdiv(spec.max_memory_usage_bytes(limits), spec.page_size_bytes)


def max_memory_usage_bytes(groups: Sequence[KVCacheGroupSpec], limits: SizingLimits) -> int:
    """Bytes one request of ``limits.max_model_len`` tokens takes from the pool.

    Every group draws its blocks from the one pool, so the request needs the sum of the
    groups' blocks, each block ``pool_bytes_per_block`` bytes (padding layers included).
    """
    if not groups:
        return 0
    total_blocks = sum(_group_pages_per_request(group, limits) for group in groups)
    return pool_bytes_per_block(groups) * total_blocks


def estimate_max_model_len(
    groups: Sequence[KVCacheGroupSpec],
    available_memory: int,
    options: PlanningOptions,
    upper_bound: int | None = None,
) -> int:
    """The longest ``max_model_len`` whose request fits in ``available_memory`` (binary search).

    Args:
        groups: One rank's groups.
        available_memory: Bytes for requests (the null block already taken off).
        options: Planning options (in-flight and encoder tokens).
        upper_bound: Largest length tried; ``None``: ``options.max_model_len``.

    Returns:
        The length, or 0 when not even one token fits.
    """
    high = options.max_model_len if upper_bound is None else upper_bound

    def fits(model_len: int) -> bool:
        return max_memory_usage_bytes(groups, options.limits(model_len)) <= available_memory

    if not fits(1):
        return 0
    low, best = 1, 1
    while low <= high:
        mid = (low + high) // 2
        if fits(mid):
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


def _check_enough_memory(
    available_memory: int,
    needed_memory: Callable[[], int],
    max_model_len: int,
    estimate: Callable[[int], int],
) -> None:
    if available_memory <= 0:
        raise ConfigError(
            "No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine (this flag also controls "
            "CPU memory reservation on the CPU backend, despite its name). See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
        )
    needed = needed_memory()
    if needed <= available_memory:
        return
    estimated = estimate(available_memory)
    estimated_msg = (
        f"Based on the available memory, the estimated maximum model length is {estimated}. "
        if estimated > 0
        else ""
    )
    raise ConfigError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({_format_gib(needed)} GiB KV cache is needed, which is larger than the available "
        f"KV cache memory ({_format_gib(available_memory)} GiB). {estimated_msg}"
        "Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU "
        "backend) or decreasing `max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )


def check_enough_kv_cache_memory(
    groups: Sequence[KVCacheGroupSpec],
    available_memory: int,
    options: PlanningOptions,
    max_model_len: int | None = None,
) -> None:
    """Raise unless one request of ``max_model_len`` tokens fits next to the null block.

    Args:
        groups: One rank's groups.
        available_memory: Bytes the rank offers (the null block is taken off here).
        options: Planning options.
        max_model_len: Length to check; ``None``: ``options.max_model_len``.

    Raises:
        ConfigError: vLLM's message: no memory left after the null block, or the KV cache
            needed (GiB) with the estimated maximum model length.
    """
    if not groups:
        return
    model_len = options.max_model_len if max_model_len is None else max_model_len
    usable = available_memory - pool_bytes_per_block(groups)
    _check_enough_memory(
        usable,
        lambda: max_memory_usage_bytes(groups, options.limits(model_len)),
        model_len,
        lambda memory: estimate_max_model_len(groups, memory, options, model_len),
    )


# ----------------------------------------------------------------------------- scheduler view
def scheduler_kv_cache_config(config: KVCacheConfig) -> KVCacheConfig:
    """The scheduler's config: each uniform-type group speaks through its first layer's spec."""
    groups = tuple(
        KVCacheGroupSpec(
            layer_names=group.layer_names, kv_cache_spec=group.kv_cache_spec.first_spec
        )
        if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
        else group
        for group in config.kv_cache_groups
    )
    return replace(config, kv_cache_groups=groups)


def hybrid_attention_block_size(
    attention_page_per_token: int,
    mamba_page_size: int,
    *,
    block_size: int = 16,
    kernel_block_alignment: int = 16,
    backend_block_alignment: int = 1,
    checkpoint_alignment: int | None = None,
    mla: bool = False,
) -> int:
    """The attention block size vLLM 0.33 picks for a hybrid attention + Mamba model.

    Every group of a hybrid model shares one page size, so the attention page must hold a
    Mamba state: vLLM takes the smallest multiple of the kernel block alignment whose
    attention page is at least the Mamba page (then pads the Mamba page up to it), rounded up
    to the alignment every attention backend of the model needs, unless the configured block
    size is larger already. In "align" mode the Mamba block is this size too, and in-chunk
    prefill checkpoints must land on block boundaries.

    Args:
        attention_page_per_token: Bytes of one token's attention KV (all heads of a rank).
        mamba_page_size: Bytes of one Mamba state block (the largest, unpadded).
        block_size: The configured block size (``--block-size``).
        kernel_block_alignment: The attention backend's smallest kernel block size.
        backend_block_alignment: The lcm of the smallest kernel blocks of every non-Mamba
            backend of the model.
        checkpoint_alignment: Align mode: the granularity of in-chunk prefill checkpoints.
        mla: The attention layers are MLA (whose decode kernels need 128-token multiples).

    Returns:
        The attention block size (the Mamba block size in align mode).

    Raises:
        ConfigError: A size is not positive.
    """
    for name, value in (
        ("attention_page_per_token", attention_page_per_token),
        ("block_size", block_size),
        ("kernel_block_alignment", kernel_block_alignment),
        ("backend_block_alignment", backend_block_alignment),
    ):
        if type(value) is not int or value <= 0:
            raise ConfigError(f"{name} must be a positive int, got {value!r}", field=name)
    if mamba_page_size <= 0:
        return block_size
    alignment = max(kernel_block_alignment, block_size)
    if mla:
        alignment = max(alignment, 128)
    if checkpoint_alignment:
        alignment = math.lcm(alignment, checkpoint_alignment)
    attention_block = alignment * _cdiv(mamba_page_size, alignment * attention_page_per_token)
    attention_block = backend_block_alignment * _cdiv(attention_block, backend_block_alignment)
    return max(block_size, attention_block)


def resolve_kv_cache_block_sizes(
    groups: Sequence[KVCacheGroupSpec], options: PlanningOptions
) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` for these groups.

    One group: both are its block size. Several: the scheduler aligns to the lcm of the
    block sizes; hashes are the gcd (or ``prefix_match_unit``) when prefix caching is on and
    no Mamba group forbids finer hashing.

    Raises:
        ConfigError: ``prefix_match_unit`` does not divide every group's block size, or is
            set for a single-group model with a different block size.
    """
    if not groups:
        return 16, 16
    block_sizes = [group.kv_cache_spec.block_size for group in groups]
    requested = options.prefix_match_unit
    if len(groups) == 1:
        size = block_sizes[0]
        if requested not in (None, size) and options.enable_caching:
            raise ConfigError(
                f"Invalid prefix_match_unit={requested}; with a single KV cache group, "
                f"prefix-cache hits land on the block size ({size}). Unset it or set it to "
                f"{size}."
            )
        return size, size
    scheduler_block_size = math.lcm(*block_sizes)
    if not options.enable_caching:
        return scheduler_block_size, scheduler_block_size
    if any(
        pins_hash_block_size(spec)
        for group in groups
        for spec in _group_layer_specs(group.kv_cache_spec)
    ):
        return scheduler_block_size, scheduler_block_size
    hash_block_size = requested if requested is not None else math.gcd(*block_sizes)
    if any(size % hash_block_size for size in block_sizes):
        raise ConfigError(
            f"Invalid prefix_match_unit={hash_block_size}; prefix-cacheable KV cache group "
            "block sizes must be divisible by prefix_match_unit. Got group block sizes="
            f"{block_sizes}."
        )
    return scheduler_block_size, hash_block_size


def _group_layer_specs(spec: KVCacheSpec) -> tuple[KVCacheSpec, ...]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return tuple(spec.kv_cache_specs.values())
    return (spec,)


def get_kv_cache_capacity(
    config: KVCacheConfig, limits: SizingLimits, device_name: str = "GPU"
) -> KVCacheCapacity:
    """Tokens and concurrency the pool holds for requests of ``limits.max_model_len``.

    A request takes, from every group, the blocks its spec needs at that length; the
    concurrency is the pool's blocks over their sum (vLLM counts the null block too).
    """
    blocks_per_request = sum(
        _cdiv(g.kv_cache_spec.max_memory_usage_bytes(limits), g.kv_cache_spec.page_size_bytes)
        for g in config.kv_cache_groups
    )
    concurrency = config.num_blocks / blocks_per_request if blocks_per_request else math.inf
    num_tokens = int(concurrency * limits.max_model_len) if math.isfinite(concurrency) else 0
    return KVCacheCapacity(
        num_tokens=num_tokens,
        max_concurrency=concurrency,
        max_model_len=limits.max_model_len,
        device_name=device_name,
    )


# ----------------------------------------------------------------------------- the whole plan
def resolve_planning_options(
    options: PlanningOptions, specs: Mapping[str, KVCacheSpec]
) -> PlanningOptions:
    """``options`` resolved for this model (every rank's layers).

    ``max_num_encoder_input_tokens=None`` becomes 0 for a model without cross attention
    (its value changes nothing there).

    Raises:
        ConfigError: The model has cross-attention layers and no encoder budget
            (``max_num_encoder_input_tokens``): vLLM sizes their blocks by it.
    """
    encoder = options.max_num_encoder_input_tokens
    if encoder is None:
        cross = next((n for n, s in specs.items() if isinstance(s, CrossAttentionSpec)), None)
        if cross is not None:
            raise ConfigError(
                f"layer {cross!r} is cross attention, whose blocks vLLM sizes by the encoder "
                "budget (scheduler_config.max_num_encoder_input_tokens, which vLLM sets to "
                "max_num_batched_tokens); the pool has none: set max_num_encoder_input_tokens "
                "(or max_num_batched_tokens) to the engine's value",
                field="max_num_encoder_input_tokens",
            )
        encoder = 0
    return replace(options, max_num_encoder_input_tokens=encoder)


def _validate_ranks(
    rank_specs: Sequence[Mapping[str, KVCacheSpec]], available_memory: Sequence[int]
) -> None:
    if not rank_specs:
        raise ConfigError("rank_specs must name at least one rank")
    if len(available_memory) != len(rank_specs):
        raise ConfigError(
            f"available_memory has {len(available_memory)} entries for {len(rank_specs)} ranks"
        )
    for rank, memory in enumerate(available_memory):
        if type(memory) is not int or memory < 0:
            raise ConfigError(
                f"available_memory[{rank}] must be a non-negative int of bytes, got {memory!r}"
            )
    for rank, specs in enumerate(rank_specs):
        for name in specs:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"rank {rank}: layer names must be non-empty strings")


def _auto_fit_max_model_len(
    rank_groups: Sequence[Sequence[KVCacheGroupSpec]],
    usable_memory: Sequence[int],
    options: PlanningOptions,
) -> int:
    """The longest ``max_model_len`` (up to the configured one) every rank holds."""
    best = options.max_model_len
    for groups, memory in zip(rank_groups, usable_memory, strict=True):
        if groups:
            best = min(best, estimate_max_model_len(groups, memory, options))
    if best <= 0:
        raise ConfigError(
            "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a "
            "single token. Try increasing `gpu_memory_utilization`."
        )
    return best


def _check_uint64_tensors(ranks: Sequence[RankPlan], num_blocks: int) -> None:
    """Every tensor's byte counts must fit a uint64 (the wire's and allocators' type)."""
    for rank_plan in ranks:
        for tensor in rank_plan.kv_cache_config.kv_cache_tensors:
            if max(tensor.size, tensor.offset, tensor.layer_stride, tensor.block_stride) > (
                UINT64_MAX
            ):
                raise ConfigError(
                    f"rank {rank_plan.rank}: the tensor of layers {list(tensor.layers)} needs "
                    f"{tensor.size} bytes at {num_blocks} blocks, more than a uint64 holds "
                    "(its pages are too large for the block count)",
                    field="layer_specs",
                )


def plan_kv_cache(
    rank_specs: Sequence[Mapping[str, KVCacheSpec]],
    available_memory: Sequence[int],
    options: PlanningOptions,
) -> UnifiedPlan:
    """Plan the KV cache of one engine: groups, the unified block count and every rank's config.

    Args:
        rank_specs: Each rank's layers and their specs (vLLM's ``get_kv_cache_spec()``).
            Tensor-parallel ranks list the same layers; pipeline stages list their own.
        available_memory: Bytes each rank gives the KV cache.
        options: Planning options (resolved by :func:`resolve_planning_options`).

    Returns:
        The plan; every rank's ``num_blocks`` is the minimum over the ranks.

    Raises:
        ConfigError: Inconsistent specs (a layer differs between ranks), specs that cannot
            be grouped, cross attention without an encoder budget, no memory left after the
            null block, a model that cannot hold one request of ``max_model_len`` tokens
            (vLLM's message), or a tensor whose byte count does not fit a uint64.
    """
    _validate_ranks(rank_specs, available_memory)
    merged = merge_rank_specs(rank_specs)
    options = resolve_planning_options(options, merged)
    groups = get_kv_cache_groups(merged, options)
    rank_groups = [project_groups_to_rank(groups, specs) for specs in rank_specs]
    memory = list(available_memory)
    if options.kv_cache_memory_bytes is not None:
        # vLLM's workers report kv_cache_memory_bytes instead of what they profiled.
        memory = [options.kv_cache_memory_bytes] * len(memory)
    override = options.num_gpu_blocks_override
    if override is not None:
        # The override decouples the pool from the profiled memory: plan, fit-check and
        # auto-fit against the memory the override actually takes.
        memory = [
            override * pool_bytes_per_block(g) if g else m
            for g, m in zip(rank_groups, memory, strict=True)
        ]
    # The null block is never handed out: checks plan against the usable blocks.
    usable = [
        m - pool_bytes_per_block(g) if g else m for g, m in zip(rank_groups, memory, strict=True)
    ]
    max_model_len = options.max_model_len
    if options.auto_fit_max_model_len and any(rank_groups):
        max_model_len = _auto_fit_max_model_len(rank_groups, usable, options)
    for g, m in zip(rank_groups, usable, strict=True):
        if g:
            check_enough_kv_cache_memory(g, m + pool_bytes_per_block(g), options, max_model_len)
    layout = options.kv_cache_layout
    fitted = [
        (m // pool_bytes_per_block(g) if g else 1) for g, m in zip(rank_groups, memory, strict=True)
    ]
    if override is not None:
        fitted = [override if g else 1 for g in rank_groups]
    num_blocks = min(fitted)
    ranks = tuple(
        RankPlan(
            rank=rank,
            kv_cache_config=get_kv_cache_config_from_groups(g, num_blocks, layout),
            available_memory_bytes=available_memory[rank],
            num_blocks_fit=fitted[rank],
        )
        for rank, g in enumerate(rank_groups)
    )
    _check_uint64_tensors(ranks, num_blocks)
    scheduler_config = scheduler_kv_cache_config(ranks[0].kv_cache_config)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(groups, options)
    return UnifiedPlan(
        kv_cache_groups=groups,
        ranks=ranks,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        scheduler_kv_cache_config=scheduler_config,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        capacity=get_kv_cache_capacity(
            ranks[0].kv_cache_config, options.limits(max_model_len), options.device_name
        ),
    )
