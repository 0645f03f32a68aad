"""Two sides of the manager differential test: vLLM 0.33.0's KVCacheManager and kvcm's.

Each side builds its own specs, config, requests and hashing from one neutral description
(``Layout`` and ``RequestSpec``) and answers every manager call in one normalised form (block
ids per group, hit tokens, ``None`` for "does not fit", events as plain tuples with their
hashes in vLLM's external int form: kvcm's full-width hashes are read as vLLM reads them), so
the workload in ``_workloads`` can compare the two answers with ``==``. Nothing here decides
what the right answer is: both sides are driven the same way and must agree.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from kvcm.common.hashing import external_block_hash

# --------------------------------------------------------------------------- descriptions

FULL = "full"
MLA = "mla"
SINK = "sink"
SWA = "swa"
CHUNKED = "chunked"
MAMBA = "mamba"
CROSS = "cross"


@dataclass(frozen=True)
class GroupDesc:
    """One KV-cache group, independent of either implementation.

    Attributes:
        kind: One of the module constants (``FULL``, ``SWA``, ...).
        block_size: Tokens per block.
        window: Sliding window or attention chunk size (SWA, chunked local), sink length.
        dtype: Attention dtype name (mixed dtypes make workers zero new blocks).
        num_speculative_blocks: Mamba speculative state blocks.
        extra_retained_tokens: Sliding-window tokens kept below the window.
        mamba_cache_mode: Mamba ``"none"`` or ``"align"`` (prefix caching of hybrid models).
        num_prefill_checkpoint_blocks: Align-mode Mamba blocks for in-chunk checkpoints.
        prefill_checkpoint_alignment: Token granularity of such checkpoints.
    """

    kind: str
    block_size: int
    window: int = 0
    dtype: str = "float16"
    num_speculative_blocks: int = 0
    extra_retained_tokens: int = 0
    mamba_cache_mode: str = "none"
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None


@dataclass(frozen=True)
class Layout:
    """A pool: its groups, size and settings."""

    groups: tuple[GroupDesc, ...]
    num_blocks: int
    max_model_len: int
    enable_caching: bool = True
    hash_algorithm: str = "sha256"
    hash_seed: str = "kvcm-compat"
    watermark: float = 0.0
    max_in_flight_tokens: int | None = None
    # prefix_cache_retention_interval: None dense, 0 vLLM's CacheConfig default, n periodic.
    retention: int | None = None
    # vLLM's --prefix-match-unit: the hash block size of a cached hybrid pool, if set.
    prefix_match_unit: int | None = None
    # vLLM's decode_context_parallel_size: attention blocks span this many ranks' blocks.
    dcp_world_size: int = 1
    # EAGLE/MTP as vLLM's scheduler hands them to its manager: use_eagle (the trailing-block
    # drop; no group is marked, so every group drops), num_hash_lookahead_tokens (every
    # block hash also covers the tokens after it), num_prefill_lookahead.
    use_eagle: bool = False
    hash_lookahead: int = 0
    prefill_lookahead: int = 0
    # Groups marked as the drafter's (vLLM's is_eagle_group; none: every group with the drop)
    # and vLLM's enable_mamba_shared_prefix_checkpoint.
    eagle_groups: tuple[int, ...] = ()
    shared_prefix_checkpoint: bool = False

    @property
    def eagle_group_ids(self) -> tuple[int, ...]:
        """vLLM's coordinator's eagle_group_ids: the marked groups, or every group when
        none is marked and the drop is on."""
        if self.eagle_groups:
            return self.eagle_groups
        return tuple(range(len(self.groups))) if self.use_eagle else ()

    @property
    def block_sizes(self) -> list[int]:
        """Each group's block size as the scheduler sees it (vLLM's
        resolve_dcp_kv_block_size: attention blocks scaled by DCP, Mamba states not)."""
        return [g.block_size * (1 if g.kind == MAMBA else self.dcp_world_size) for g in self.groups]

    @property
    def scheduler_block_size(self) -> int:
        """vLLM's rule: the lcm of the groups' block sizes (16 with no group)."""
        sizes = self.block_sizes
        return math.lcm(*sizes) if sizes else 16

    @property
    def hash_block_size(self) -> int:
        """vLLM's rule: gcd of the block sizes for a cached hybrid pool, unless a Mamba group
        is outside align mode."""
        sizes = self.block_sizes
        if len(sizes) <= 1 or not self.enable_caching:
            return self.scheduler_block_size
        if any(g.kind == MAMBA and g.mamba_cache_mode != "align" for g in self.groups):
            return self.scheduler_block_size
        if self.prefix_match_unit is not None:
            return self.prefix_match_unit
        return math.gcd(*sizes)


@dataclass
class RequestSpec:
    """A request, as both sides build it."""

    request_id: str
    prompt: list[int]
    lora: tuple[str, int, str] | None = None
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False
    # vLLM's SamplingParams.extra_args["kv_cache_report_mode"] = "full" (kvcm's
    # report_cached_blocks): lookups that hit report the reused blocks as stored.
    report_full: bool = False


# The status names shared by both RequestStatus enums.
STATUSES = ("WAITING", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED", "FINISHED_STOPPED")

BlockIds = tuple[tuple[int, ...], ...]


def _copy_pair(copy: Any) -> tuple[int, int]:
    # vLLM hands KVCacheBlockCopy records, kvcm (source, destination) id pairs.
    if isinstance(copy, tuple):
        return (int(copy[0]), int(copy[1]))
    return (int(copy.src_block_id), int(copy.dst_block_id))


def _ids(blocks: Any) -> BlockIds:
    return tuple(tuple(block.block_id for block in group) for group in blocks)


def _cache_entries(cache: dict[Any, Any]) -> dict[bytes, tuple[int, ...]]:
    out: dict[bytes, tuple[int, ...]] = {}
    for key, value in cache.items():
        if isinstance(value, dict):
            out[bytes(key)] = tuple(value)
        else:
            out[bytes(key)] = (value.block_id,)
    return out


def _event_fields(event: Any) -> tuple[str, dict[str, Any]]:
    # vLLM's events are msgspec structs, kvcm's are dataclasses; compare by field name.
    name = type(event).__name__
    if is_dataclass(event):
        names = [f.name for f in fields(event)]
    else:
        names = list(getattr(type(event), "__struct_fields__", ()))
    values: dict[str, Any] = {}
    for field_name in names:
        value = getattr(event, field_name)
        if field_name == "block_hashes":
            value = [external_block_hash(h) if isinstance(h, bytes) else h for h in value]
        elif field_name == "parent_block_hash" and isinstance(value, bytes):
            value = external_block_hash(value)
        if isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        values[field_name] = value
    return name, values


def normalise_events(events: list[Any], field_names: set[str] | None) -> list[tuple[Any, ...]]:
    """Events as ``(type name, sorted (field, value) pairs)``, restricted to ``field_names``."""
    out: list[tuple[Any, ...]] = []
    for event in events:
        name, values = _event_fields(event)
        if field_names is not None:
            values = {k: v for k, v in values.items() if k in field_names}
        out.append((name, tuple(sorted(values.items()))))
    return out


@dataclass
class Snapshot:
    """The pool's whole state, in a comparable form."""

    free_ids: list[int]
    ref_cnts: list[int]
    block_hashes: list[bytes | None]
    cache: dict[bytes, tuple[int, ...]]
    tables: dict[str, BlockIds] = field(default_factory=dict)


# --------------------------------------------------------------------------------- vLLM


class VllmSide:
    """vLLM 0.33.0's KVCacheManager behind the neutral interface."""

    name = "vllm"

    def __init__(self, layout: Layout) -> None:
        """Build vLLM's manager for ``layout`` and initialise its global NONE_HASH."""
        from vllm.utils import hashing
        from vllm.v1.core import kv_cache_utils as kcu
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

        self.layout = layout
        self.report_failed = False
        self._kcu = kcu
        hash_fn = hashing.get_hash_fn_by_name(layout.hash_algorithm)
        # vLLM's NONE_HASH is process-global and seeded from PYTHONHASHSEED.
        saved = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = layout.hash_seed
        try:
            kcu.init_none_hash(hash_fn)
        finally:
            if saved is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = saved
        self._block_hasher = kcu.get_request_block_hasher(
            layout.hash_block_size, hash_fn, layout.hash_lookahead
        )
        groups = [
            KVCacheGroupSpec(
                layer_names=(f"layer.{i}",),
                kv_cache_spec=self._spec(g),
                is_eagle_group=i in layout.eagle_groups,
            )
            for i, g in enumerate(layout.groups)
        ]
        config = KVCacheConfig(
            num_blocks=layout.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=layout.retention,
        )
        self.manager = KVCacheManager(
            kv_cache_config=config,
            max_model_len=layout.max_model_len,
            scheduler_block_size=layout.scheduler_block_size,
            hash_block_size=layout.hash_block_size,
            max_in_flight_tokens=layout.max_in_flight_tokens,
            enable_caching=layout.enable_caching,
            log_stats=True,
            enable_kv_cache_events=True,
            watermark=layout.watermark,
            dcp_world_size=layout.dcp_world_size,
            use_eagle=layout.use_eagle,
            num_hash_lookahead_tokens=layout.hash_lookahead,
            num_prefill_lookahead=layout.prefill_lookahead,
            enable_mamba_shared_prefix_checkpoint=layout.shared_prefix_checkpoint,
        )
        from vllm.v1.metrics.stats import CachingMetrics

        self.metrics = CachingMetrics()
        self.requests: dict[str, Any] = {}
        self._hits: dict[str, Any] = {}
        self._popped: dict[str, Any] = {}
        self._retained: deque[list[Any]] = deque()

    @staticmethod
    def _spec(g: GroupDesc) -> Any:
        import torch
        from vllm.v1 import kv_cache_interface as kci

        dtype = getattr(torch, g.dtype)
        attn = {"block_size": g.block_size, "num_kv_heads": 2, "head_size": 8, "dtype": dtype}
        if g.kind == FULL:
            return kci.FullAttentionSpec(**attn)
        if g.kind == MLA:
            return kci.MLAAttentionSpec(**{**attn, "num_kv_heads": 1})
        if g.kind == SINK:
            return kci.SinkFullAttentionSpec(**attn, sink_len=g.window)
        if g.kind == SWA:
            return kci.SlidingWindowSpec(
                **attn, sliding_window=g.window, extra_retained_tokens=g.extra_retained_tokens
            )
        if g.kind == CHUNKED:
            return kci.ChunkedLocalAttentionSpec(**attn, attention_chunk_size=g.window)
        if g.kind == CROSS:
            return kci.CrossAttentionSpec(**attn)
        if g.kind == MAMBA:
            return kci.MambaSpec(
                block_size=g.block_size,
                shapes=((2, 4), (4,)),
                dtypes=(dtype, dtype),
                mamba_cache_mode=g.mamba_cache_mode,
                num_speculative_blocks=g.num_speculative_blocks,
                num_prefill_checkpoint_blocks=g.num_prefill_checkpoint_blocks,
                prefill_checkpoint_alignment=g.prefill_checkpoint_alignment,
            )
        raise ValueError(g.kind)

    # ------------------------------------------------------------------ requests
    def add_request(self, spec: RequestSpec) -> None:
        """Create the request (hashing its prompt)."""
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra_args = {"kv_cache_report_mode": "full"} if spec.report_full else None
        params = SamplingParams(max_tokens=1 << 20, extra_args=extra_args)
        if spec.skip_reading_prefix_cache:
            params.skip_reading_prefix_cache = True
        lora = None if spec.lora is None else LoRARequest(*spec.lora)
        request = Request(
            request_id=spec.request_id,
            prompt_token_ids=list(spec.prompt),
            sampling_params=params,
            pooling_params=None,
            lora_request=lora,
            cache_salt=spec.cache_salt,
            block_hasher=self._block_hasher,
        )
        request.skip_reading_prefix_cache = spec.skip_reading_prefix_cache
        self.requests[spec.request_id] = request

    def update(self, request_id: str, **values: Any) -> None:
        """Set request fields (``status`` by name, counts by value)."""
        from vllm.v1.request import RequestStatus

        request = self.requests[request_id]
        for name, value in values.items():
            setattr(request, name, RequestStatus[value] if name == "status" else value)

    def append_tokens(self, request_id: str, tokens: list[int]) -> None:
        """Append output tokens (hashing newly full blocks)."""
        self.requests[request_id].append_output_token_ids(list(tokens))

    def block_hashes(self, request_id: str) -> list[bytes]:
        """The request's block hashes."""
        return [bytes(h) for h in self.requests[request_id].block_hashes]

    def drop_request(self, request_id: str) -> None:
        """Forget a finished request."""
        self.requests.pop(request_id, None)
        self._hits.pop(request_id, None)

    # ------------------------------------------------------------------ manager calls
    def get_computed_blocks(
        self, request_id: str, max_len: int | None
    ) -> tuple[BlockIds, int, int]:
        """Look up the hit (blocks, length, shared-prefix junction); keep it to allocate.

        vLLM's "full" report raises IndexError for a Mamba hit ending inside a block the
        request's tokens do not fill (no hash to report): then the events of the earlier groups
        are dropped, the lookup (which changed nothing) is done again unreported and
        ``report_failed`` is set.
        """
        request = self.requests[request_id]
        queue = self.manager.block_pool.kv_event_queue
        num_events = len(queue)
        try:
            blocks, num, junction = self.manager.get_computed_blocks(request, max_len)
        except IndexError:
            if request.kv_cache_report_mode != "full":
                raise
            self.report_failed = True
            del queue[num_events:]  # the groups reported before the one that raised
            request.kv_cache_report_mode = "incremental"
            try:
                blocks, num, junction = self.manager.get_computed_blocks(request, max_len)
            finally:
                request.kv_cache_report_mode = "full"
        # As vLLM's scheduler does after every lookup: sparse retention keeps the junction.
        request.shared_prefix_boundary = junction
        self._hits[request_id] = (blocks, num)
        return _ids(blocks.blocks), num, junction

    def get_computed_blocks_for_connector(
        self, request_id: str, max_len: int | None
    ) -> tuple[BlockIds, int, int, bool]:
        """The lookup for a KV connector (plus ``hit_diverged``); keep it to allocate."""
        request = self.requests[request_id]
        blocks, num, junction, diverged = self.manager.get_computed_blocks_for_connector(
            request, max_len
        )
        request.shared_prefix_boundary = junction
        self._hits[request_id] = (blocks, num)
        return _ids(blocks.blocks), num, junction, diverged

    def truncate_hit(self, request_id: str, num_tokens: int) -> BlockIds:
        """Cut the kept hit at ``num_tokens`` (``truncate_computed_blocks``)."""
        blocks, _ = self._hits[request_id]
        truncated = self.manager.truncate_computed_blocks(blocks, num_tokens)
        self._hits[request_id] = (truncated, num_tokens)
        return _ids(truncated.blocks)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Drain the Mamba boundary-state hand-offs."""
        return self.manager.take_boundary_state_offloads()

    def finalize_partial_tail_offloads(self, request_id: str) -> list[tuple[int, int, int]]:
        """A finishing producer's partial tails."""
        return self.manager.finalize_partial_tail_offloads(self.requests[request_id])

    def allocate_slots(
        self, request_id: str, num_new_tokens: int, use_hit: bool, **options: Any
    ) -> BlockIds | None:
        """Allocate; adopt the kept hit when ``use_hit``."""
        blocks, num = (None, 0)
        if use_hit:
            blocks, num = self._hits.pop(request_id)
        result = self.manager.allocate_slots(
            self.requests[request_id],
            num_new_tokens,
            num_new_computed_tokens=num,
            new_computed_blocks=blocks,
            **options,
        )
        return None if result is None else _ids(result.blocks)

    def free(self, request_id: str) -> None:
        """Free the request's blocks."""
        self.manager.free(self.requests[request_id])

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        """Cache the request's blocks up to ``num_tokens``."""
        self.manager.cache_blocks(self.requests[request_id], num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_tokens: int) -> None:
        """Free blocks out of the attention window."""
        self.manager.remove_skipped_blocks(request_id, num_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Evict cached blocks by id."""
        self.manager.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Reset the prefix cache."""
        return bool(self.manager.reset_prefix_cache())

    def get_block_ids(self, request_id: str) -> BlockIds:
        """The request's block ids per group."""
        return tuple(tuple(ids) for ids in self.manager.get_block_ids(request_id))

    def num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Seed 001's definition, read from vLLM's state (vLLM 0.33 itself answers zeros).

        Full-attention groups: leading blocks of the request whose ref_cnt equals the number of
        requests holding a block table in that group; every other group 0.
        """
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

        counts: list[int] = []
        for manager in self.manager.coordinator.single_type_managers:
            if not isinstance(manager, FullAttentionManager):
                counts.append(0)
                continue
            num_requests = len(manager.req_to_blocks)
            num = 0
            for block in manager.req_to_blocks.get(request_id, ()):
                if block.ref_cnt != num_requests:
                    break
                num += 1
            counts.append(num)
        return counts

    def take_events(self) -> list[Any]:
        """Drain the events."""
        return list(self.manager.take_events())

    def make_prefix_cache_stats(self) -> tuple[Any, ...] | None:
        """Drain the stats; feed them to vLLM's CachingMetrics."""
        stats = self.manager.make_prefix_cache_stats()
        if stats is None:
            return None
        self.metrics.observe(stats)
        return (
            stats.reset,
            stats.requests,
            stats.queries,
            stats.hits,
            stats.preempted_requests,
            stats.preempted_queries,
            stats.preempted_hits,
        )

    def record_prefix_cache_stats(self, request_id: str, num_hits: int) -> None:
        """Count an admitted request's lookup."""
        self.manager.record_prefix_cache_stats(self.requests[request_id], num_hits)

    def hit_rate(self) -> float:
        """The recent-requests hit rate."""
        return float(self.metrics.hit_rate)

    def take_new_block_ids(self) -> list[int]:
        """Drain the new block ids for zeroing."""
        return list(self.manager.take_new_block_ids())

    def new_step_starts(self) -> None:
        """Start a scheduler step."""
        self.manager.new_step_starts()

    def take_copies(self) -> list[tuple[int, int]]:
        """Drain the block copies (sub-block hits) and release their retained blocks."""
        copies, retained = self.manager.take_kv_cache_block_copies()
        self.manager.block_pool.free_blocks(retained)
        return [_copy_pair(copy) for copy in copies]

    # vLLM's scheduler when it defers frees (an asynchronous KV consumer): a finished
    # request's blocks popped, returned in one call at its fence; a drain's retained blocks
    # kept (queued reversed) and returned at theirs, in drained order.
    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Pop a finished request's blocks (``pop_blocks_for_free``); their ids."""
        blocks = self.manager.pop_blocks_for_free(self.requests[request_id])
        self._popped[request_id] = blocks
        return [b.block_id for b in blocks]

    def free_popped(self, request_id: str) -> None:
        """Return a popped request's blocks as ``_drain_deferred_frees`` does."""
        self.manager.block_pool.free_blocks(reversed(self._popped.pop(request_id)))

    def take_copies_retained(self) -> list[tuple[int, int]]:
        """Drain the copies, keeping a non-empty drain's retained blocks."""
        copies, retained = self.manager.take_kv_cache_block_copies()
        if copies:
            self._retained.append(retained[::-1])
        return [_copy_pair(copy) for copy in copies]

    def release_copies(self) -> list[int]:
        """Return the oldest kept drain's blocks (``_drain_deferred_frees``); their ids."""
        blocks = list(reversed(self._retained.popleft()))
        self.manager.block_pool.free_blocks(blocks)
        return [b.block_id for b in blocks]

    def num_free_blocks(self) -> int:
        """Blocks allocatable now."""
        return int(self.manager.block_pool.get_num_free_blocks())

    def usage(self) -> float:
        """Pool usage."""
        return float(self.manager.usage)

    def snapshot(self) -> Snapshot:
        """The pool's whole state."""
        pool = self.manager.block_pool
        return Snapshot(
            free_ids=[b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            ref_cnts=[b.ref_cnt for b in pool.blocks[1:]],
            block_hashes=[
                None if b.block_hash is None else bytes(b.block_hash) for b in pool.blocks
            ],
            cache=_cache_entries(pool.cached_block_hash_to_block._cache),
        )

    def event_field_names(self) -> set[str]:
        """Every field name of vLLM's event records."""
        from vllm.distributed import kv_events

        names: set[str] = set()
        for cls in (kv_events.BlockStored, kv_events.BlockRemoved, kv_events.AllBlocksCleared):
            names.update(getattr(cls, "__struct_fields__", ()))
        return names


# --------------------------------------------------------------------------------- kvcm


class KvcmSide:
    """kvcm's KVCacheManager behind the neutral interface."""

    name = "kvcm"

    def __init__(self, layout: Layout) -> None:
        """Build kvcm's manager for ``layout`` (block sizes left to kvcm's defaults)."""
        from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
        from kvcm.common.hashing import BlockHasher
        from kvcm.core.manager import KVCacheManager, KVCacheManagerConfig

        self.layout = layout
        groups = [
            KVCacheGroupSpec(layer_names=(f"layer.{i}",), kv_cache_spec=self._spec(g))
            for i, g in enumerate(layout.groups)
        ]
        config = KVCacheConfig(
            num_blocks=layout.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        self.manager = KVCacheManager(
            KVCacheManagerConfig(
                kv_cache_config=config,
                max_model_len=layout.max_model_len,
                max_in_flight_tokens=layout.max_in_flight_tokens,
                enable_caching=layout.enable_caching,
                enable_kv_cache_events=True,
                log_stats=True,
                watermark=layout.watermark,
                prefix_cache_retention_interval=layout.retention,
                hash_block_size=(
                    None if layout.prefix_match_unit is None else layout.hash_block_size
                ),
                dcp_world_size=layout.dcp_world_size,
                # vLLM's fallback when no group is marked as a draft group: all drop.
                eagle_block_drop_group_ids=(
                    layout.eagle_group_ids if layout.use_eagle and layout.enable_caching else ()
                ),
                num_hash_lookahead_tokens=layout.hash_lookahead,
                num_prefill_lookahead=layout.prefill_lookahead,
                # An engine sends the flag only with a drafter's group, as vLLM acts on it.
                enable_mamba_shared_prefix_checkpoint=(
                    layout.shared_prefix_checkpoint and bool(layout.eagle_group_ids)
                ),
            )
        )
        self.hasher = BlockHasher(
            self.manager.hash_block_size,
            layout.hash_algorithm,
            layout.hash_seed,
            num_lookahead_tokens=layout.hash_lookahead,
        )
        self.requests: dict[str, Any] = {}
        self._hits: dict[str, Any] = {}
        self._popped: dict[str, Any] = {}

    @staticmethod
    def _spec(g: GroupDesc) -> Any:
        from kvcm.common import specs
        from kvcm.common.dtypes import DType

        dtype = DType(g.dtype)
        attn = {"block_size": g.block_size, "num_kv_heads": 2, "head_size": 8, "dtype": dtype}
        if g.kind == FULL:
            return specs.FullAttentionSpec(**attn)
        if g.kind == MLA:
            return specs.MLAAttentionSpec(**{**attn, "num_kv_heads": 1})
        if g.kind == SINK:
            return specs.SinkFullAttentionSpec(**attn, sink_len=g.window)
        if g.kind == SWA:
            return specs.SlidingWindowSpec(
                **attn, sliding_window=g.window, extra_retained_tokens=g.extra_retained_tokens
            )
        if g.kind == CHUNKED:
            return specs.ChunkedLocalAttentionSpec(**attn, attention_chunk_size=g.window)
        if g.kind == CROSS:
            return specs.CrossAttentionSpec(**attn)
        if g.kind == MAMBA:
            return specs.MambaSpec(
                block_size=g.block_size,
                shapes=((2, 4), (4,)),
                dtypes=(dtype, dtype),
                mamba_cache_mode=g.mamba_cache_mode,
                num_speculative_blocks=g.num_speculative_blocks,
                num_prefill_checkpoint_blocks=g.num_prefill_checkpoint_blocks,
                prefill_checkpoint_alignment=g.prefill_checkpoint_alignment,
            )
        raise ValueError(g.kind)

    # ------------------------------------------------------------------ requests
    def add_request(self, spec: RequestSpec) -> None:
        """Create the request (hashing its prompt)."""
        from kvcm.core.request import Request

        lora_name, lora_id, lora_path = spec.lora if spec.lora else (None, None, None)
        self.requests[spec.request_id] = Request(
            spec.request_id,
            spec.prompt,
            block_hasher=self.hasher,
            lora_name=lora_name,
            lora_id=lora_id,
            lora_path=lora_path,
            cache_salt=spec.cache_salt,
            skip_reading_prefix_cache=spec.skip_reading_prefix_cache,
            report_cached_blocks=spec.report_full,
        )

    def update(self, request_id: str, **values: Any) -> None:
        """Set request fields (``status`` by name, counts by value)."""
        from kvcm.core.request import RequestStatus

        request = self.requests[request_id]
        for name, value in values.items():
            setattr(request, name, RequestStatus[value] if name == "status" else value)

    def append_tokens(self, request_id: str, tokens: list[int]) -> None:
        """Append output tokens (hashing newly full blocks)."""
        self.requests[request_id].append_output_token_ids(list(tokens))

    def block_hashes(self, request_id: str) -> list[bytes]:
        """The request's block hashes."""
        return [bytes(h) for h in self.requests[request_id].block_hashes]

    def drop_request(self, request_id: str) -> None:
        """Forget a finished request."""
        self.requests.pop(request_id, None)
        self._hits.pop(request_id, None)

    # ------------------------------------------------------------------ manager calls
    def get_computed_blocks(
        self, request_id: str, max_len: int | None, report: bool = True
    ) -> tuple[BlockIds, int, int]:
        """Look up the hit (blocks, length, shared-prefix junction); keep it to allocate.

        ``report=False`` looks a "full"-mode request up unreported (where vLLM's report raised).
        """
        request = self.requests[request_id]
        reported = request.report_cached_blocks
        request.report_cached_blocks = reported and report
        try:
            hit = self.manager.get_computed_blocks(request, max_len)
        finally:
            request.report_cached_blocks = reported
        self._hits[request_id] = hit
        junction = self.manager.get_shared_prefix_boundary(request_id)
        return _ids(hit.blocks.blocks), hit.num_computed_tokens, junction

    def get_computed_blocks_for_connector(
        self, request_id: str, max_len: int | None
    ) -> tuple[BlockIds, int, int, bool]:
        """The lookup for a KV connector (plus ``hit_diverged``); keep it to allocate."""
        hit, diverged = self.manager.get_computed_blocks_for_connector(
            self.requests[request_id], max_len
        )
        self._hits[request_id] = hit
        junction = self.manager.get_shared_prefix_boundary(request_id)
        return _ids(hit.blocks.blocks), hit.num_computed_tokens, junction, diverged

    def truncate_hit(self, request_id: str, num_tokens: int) -> BlockIds:
        """Cut the kept hit at ``num_tokens`` (``truncate_computed_blocks``)."""
        from kvcm.core.manager import CacheHit

        hit = self._hits[request_id]
        truncated = self.manager.truncate_computed_blocks(hit.blocks, num_tokens)
        self._hits[request_id] = CacheHit(truncated, num_tokens)
        return _ids(truncated.blocks)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Drain the Mamba boundary-state hand-offs."""
        return self.manager.take_boundary_state_offloads()

    def finalize_partial_tail_offloads(self, request_id: str) -> list[tuple[int, int, int]]:
        """A finishing producer's partial tails."""
        return self.manager.finalize_partial_tail_offloads(self.requests[request_id])

    def allocate_slots(
        self, request_id: str, num_new_tokens: int, use_hit: bool, **options: Any
    ) -> BlockIds | None:
        """Allocate; adopt the kept hit when ``use_hit``."""
        from kvcm.core.manager import DEFAULT_SLOT_OPTIONS, SlotOptions

        skip_zeroing = tuple(options.pop("skip_zeroing_group_ids", ()))
        hit = self._hits.pop(request_id) if use_hit else None
        if not options.get("num_lookahead_tokens"):
            options.pop("num_lookahead_tokens", None)  # vLLM's 0: unset
        slot_options = SlotOptions(**options)
        if slot_options == DEFAULT_SLOT_OPTIONS:
            # As the server does: plain calls take the manager's fast path for running requests.
            slot_options = DEFAULT_SLOT_OPTIONS
        result = self.manager.allocate_slots(
            self.requests[request_id], num_new_tokens, hit, slot_options, skip_zeroing
        )
        return None if result is None else _ids(result.blocks)

    def free(self, request_id: str) -> None:
        """Free the request's blocks."""
        self.manager.free(self.requests[request_id])

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        """Cache the request's blocks up to ``num_tokens``."""
        self.manager.cache_blocks(self.requests[request_id], num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_tokens: int) -> None:
        """Free blocks out of the attention window."""
        self.manager.remove_skipped_blocks(request_id, num_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Evict cached blocks by id."""
        self.manager.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Reset the prefix cache."""
        return bool(self.manager.reset_prefix_cache())

    def get_block_ids(self, request_id: str) -> BlockIds:
        """The request's block ids per group."""
        return tuple(tuple(ids) for ids in self.manager.get_block_ids(request_id))

    def num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """kvcm's answer."""
        return list(self.manager.get_num_common_prefix_blocks(request_id))

    def take_events(self) -> list[Any]:
        """Drain the events."""
        return list(self.manager.take_events())

    def make_prefix_cache_stats(self) -> tuple[Any, ...] | None:
        """Drain the stats (kvcm feeds its own hit-rate metric)."""
        stats = self.manager.make_prefix_cache_stats()
        if stats is None:
            return None
        return (
            stats.reset,
            stats.requests,
            stats.queries,
            stats.hits,
            stats.preempted_requests,
            stats.preempted_queries,
            stats.preempted_hits,
        )

    def record_prefix_cache_stats(self, request_id: str, num_hits: int) -> None:
        """Count an admitted request's lookup."""
        self.manager.record_prefix_cache_stats(self.requests[request_id], num_hits)

    def hit_rate(self) -> float:
        """The recent-requests hit rate."""
        return float(self.manager.prefix_cache_hit_rate)

    def take_new_block_ids(self) -> list[int]:
        """Drain the new block ids for zeroing."""
        return list(self.manager.take_new_block_ids())

    def new_step_starts(self) -> None:
        """Start a scheduler step."""
        self.manager.new_step_starts()

    def take_copies(self) -> list[tuple[int, int]]:
        """Drain the block copies (sub-block hits) and release their retained blocks."""
        copies, retained = self.manager.take_kv_cache_block_copies()
        self.manager.block_pool.free_blocks(retained)
        return [_copy_pair(copy) for copy in copies]

    # The same deferred frees on kvcm's manager: the request keeps its blocks until
    # free_deferred, a drain's are retained in the manager until release_block_copies.
    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """What vLLM's pop hands back: every group's table past its nulls, in group order."""
        request = self.requests[request_id]
        self._popped[request_id] = request
        null = self.manager.block_pool.null_block
        ids: list[int] = []
        if self.manager.holds_blocks(request_id):
            for group in self.manager.get_blocks(request_id).blocks:
                start = 0
                while start < len(group) and group[start] is null:
                    start += 1
                ids += [b.block_id for b in group[start:]]
        return ids

    def free_popped(self, request_id: str) -> None:
        """FINISH_DEFERRED's core call."""
        self.manager.free_deferred(self._popped.pop(request_id))

    def take_copies_retained(self) -> list[tuple[int, int]]:
        """Drain the copies, retaining a non-empty drain in the manager."""
        copies, retained = self.manager.take_kv_cache_block_copies()
        if copies:
            self.manager.retain_block_copies(retained)
        return [_copy_pair(copy) for copy in copies]

    def release_copies(self) -> list[int]:
        """Release the oldest retained drain."""
        return self.manager.release_block_copies()

    def num_free_blocks(self) -> int:
        """Blocks allocatable now."""
        return int(self.manager.num_free_blocks)

    def usage(self) -> float:
        """Pool usage."""
        return float(self.manager.usage)

    def snapshot(self) -> Snapshot:
        """The pool's whole state."""
        pool = self.manager.block_pool
        return Snapshot(
            free_ids=[b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            ref_cnts=[b.ref_cnt for b in pool.blocks[1:]],
            block_hashes=[
                None if b.block_hash is None else bytes(b.block_hash) for b in pool.blocks
            ],
            cache={bytes(k): tuple(v) for k, v in pool.cached_block_ids().items()},
        )
