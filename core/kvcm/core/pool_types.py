"""The value types of a pool: its options, hashing parameters, registrations and snapshot.

Split from :mod:`kvcm.core.pool` (which re-exports every name here) so that the pool's
behaviour reads on its own. Everything here is immutable and validated on construction.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from kvcm.common.config import KVCacheConfig, KVCacheLayout, pool_bytes_per_block
from kvcm.common.errors import InvalidArgumentError, shown
from kvcm.common.hashing import BlockHasher, HashAlgorithm
from kvcm.common.specs import UINT64_MAX, KVCacheSpec
from kvcm.core.planning import PlanningOptions

__all__ = [
    "DEFAULT_EVENT_RETENTION",
    "FreeMode",
    "HashingParameters",
    "PoolConfig",
    "PoolInfo",
    "PoolSnapshot",
    "PoolState",
    "PoolSummary",
    "PrefixCacheTotals",
    "Registration",
    "StepProgress",
    "Usage",
    "ZmqEventStream",
    "check_labels",
    "check_pool_id",
    "hash_length_bytes",
]

DEFAULT_EVENT_RETENTION: Final = 65536
MAX_LABELS: Final = 32
MAX_LABEL_VALUE_CHARS: Final = 256
# Decode context parallelism beyond this many ranks is a typo, not a deployment.
_MAX_DCP_SIZE: Final = 1024
# Bounds of the EAGLE/MTP settings: a drafter reads a few tokens ahead; group indices.
_MAX_LOOKAHEAD: Final = 64
_MAX_GROUPS: Final = 1024
_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,62}")
_POOL_ID_CHARS: Final = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
)
_HASH_LENGTH: Final = {
    HashAlgorithm.SHA256: 32,
    HashAlgorithm.SHA256_CBOR: 32,
    HashAlgorithm.XXHASH: 16,
    HashAlgorithm.XXHASH_CBOR: 16,
}


@enum.unique
class PoolState(enum.StrEnum):
    """Lifecycle of a pool (``str()`` is the name, as metrics and JSON print it)."""

    PENDING_WORKERS = "PENDING_WORKERS"
    READY = "READY"


@enum.unique
class LeaseExpiry(enum.IntEnum):
    """What a pool's expired scheduler lease reclaims (values equal ``kvcm.v1.LeaseExpiry``)."""

    FREE_REQUESTS = 1
    """Finish every request the dead scheduler left (their blocks stay in the prefix cache)."""
    CLEAR = 2
    """Finish every request and reset the prefix cache (AllBlocksCleared: routers drop it)."""


@enum.unique
class FreeMode(enum.IntEnum):
    """How ``free`` leaves a request (values equal ``kvcm.v1.FreeMode``)."""

    FINISHED = 1
    """Done: free its blocks and forget it (its key may be reused)."""
    PREEMPTED = 2
    """Preempted: free its blocks, keep its tokens and hashes, count the preemption."""


def hash_length_bytes(algorithm: HashAlgorithm) -> int:
    """Bytes of one block hash of ``algorithm`` (32 for sha256, 16 for xxhash)."""
    return _HASH_LENGTH[algorithm]


def check_pool_id(pool_id: str) -> None:
    """Reject a pool id that is not 1-128 characters of ``[A-Za-z0-9._-]``.

    Raises:
        InvalidArgumentError: It is not (the message names ``pool_id``).
    """
    if not 1 <= len(pool_id) <= 128 or not _POOL_ID_CHARS.issuperset(pool_id):
        raise InvalidArgumentError(
            f"pool_id must be 1-128 characters of [A-Za-z0-9._-], got {shown(pool_id)}",
            field="pool_id",
        )


def check_labels(labels: Mapping[str, str], field_name: str = "config.labels") -> None:
    """Reject labels a router could not match reliably.

    At most 32 labels; each key 1-63 characters of ``[A-Za-z0-9._/-]`` starting with a letter
    or digit; each value at most 256 printable characters (empty allowed).

    Raises:
        InvalidArgumentError: A label is out of its domain (the message names it).
    """
    if not isinstance(labels, Mapping):
        raise InvalidArgumentError(f"{field_name} must be a mapping, got {labels!r}")
    if len(labels) > MAX_LABELS:
        raise InvalidArgumentError(
            f"{field_name} has {len(labels)} labels, at most {MAX_LABELS} are allowed",
            field=field_name,
        )
    for key, value in labels.items():
        if not isinstance(key, str) or _LABEL_KEY.fullmatch(key) is None:
            raise InvalidArgumentError(
                f"{field_name}: key {shown(str(key))} must be 1-63 characters of [A-Za-z0-9._/-] "
                "starting with a letter or digit",
                field=field_name,
            )
        if (
            not isinstance(value, str)
            or len(value) > MAX_LABEL_VALUE_CHARS
            or not value.isprintable()
        ):
            raise InvalidArgumentError(
                f"{field_name}[{key}] must be at most {MAX_LABEL_VALUE_CHARS} printable "
                f"characters, got {shown(str(value))}",
                field=field_name,
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    """Everything a pool is created with (the core's reading of ``kvcm.v1.PoolConfig``).

    Attributes:
        max_model_len: The model's context length, in tokens.
        world_size: Ranks that register; 0 needs ``explicit_layout``.
        explicit_layout: Groups and block count that plan the pool at once.
        num_blocks_override: With registrations: this many blocks whatever the memory.
        scheduler_block_size: Scheduling granularity; ``None``: the manager's default.
        hash_block_size: Tokens per hashed block; ``None``: the manager's default.
        max_in_flight_tokens: Tokens scheduled but not settled; ``None``: max_model_len.
        enable_caching: Prefix caching.
        hash_algorithm: Block hash algorithm (a member or its name, e.g. ``"sha256_cbor"``).
        hash_seed: NONE_HASH seed; ``None``: vLLM's resolution.
        verify_block_hashes: Recompute every block hash a client sends.
        enable_kv_cache_events: Publish KV events.
        event_retention_num_events: Events kept for resuming subscribers.
        log_stats: Prefix-cache statistics.
        watermark: Fraction of blocks kept free when admitting, in [0, 1).
        prefix_cache_retention_interval: Which sliding-window blocks enter the prefix cache
            (vLLM's setting): ``None`` every block a hit can use (dense); ``0`` only those
            a request's replay boundary or shared-prefix junction needs (vLLM's
            ``CacheConfig`` default, which an engine passes); ``n > 0`` those plus one
            window per ``n`` tokens (a multiple of the scheduler block size).
        scheduler_lease_s: Seconds without a scheduler call (a SchedulerService call that may
            change the pool, or KeepAlive; pure reads such as GetUsage do not count) after
            which the lease expires; 0: never.
        lease_expiry: What an expired lease reclaims.
        labels: What the pool is, for routers' lookup scopes (``model``, ``role``,
            ``tenant``, ``data_parallel_rank``...): fixed at creation, read-only afterwards.
        disable_hybrid_kv_cache_manager: Planning: local attention next to full attention
            planned as full attention, as the engine resolved vLLM's flag; ``None``: unset,
            vLLM's default on every real platform (the hybrid manager on).
        max_num_batched_tokens: Planning: vLLM's scheduler token budget, the encoder budget
            when ``max_num_encoder_input_tokens`` is ``None``.
        max_num_encoder_input_tokens: Planning: encoder tokens a cross-attention layer
            caches per request; ``None``: ``max_num_batched_tokens`` (neither: a model with
            cross attention is refused).
        kv_cache_memory_bytes: Planning: bytes every rank gives, replacing what it offers.
        auto_fit_max_model_len: Planning: shrink ``max_model_len`` to what every rank holds.
        kv_cache_layout: Planning: the workers' KV-cache axis order.
        host_tier_bytes: Host memory for the pool's host tier (:mod:`kvcm.core.host_tier`):
            device blocks evicted from the prefix cache are demoted to it; 0: no host tier.
        offload_host_blocks: A host tier of this many blocks kept by an engine's offloading
            connector (vLLM's ``OffloadingConnector`` with ``KvcmOffloadingSpec``): HOST_SYNC
            Step ops replay its manager's calls, device evictions do not demote into it;
            exclusive with ``host_tier_bytes``. 0: none.
        decode_context_parallel_size: Decode context parallelism (vLLM's setting): the
            layout's attention blocks hold ``block_size`` tokens on each of this many ranks,
            so the manager's attention blocks span ``block_size * n`` tokens; Mamba states
            are whole on every rank. 1: none; above 1 needs ``explicit_layout`` (planning
            from registered workers does not model DCP).
        num_hash_lookahead_tokens: EAGLE/MTP lookahead block hashes (vLLM's
            ``num_hash_lookahead_tokens``): each block's hash also covers this many tokens
            after it, so a request carries ``(num_tokens - n) // hash_block_size`` hashes;
            events carry them as ``lookahead_token_ids``. 0: none.
        num_prefill_lookahead: vLLM's ``num_prefill_lookahead_tokens`` (EAGLE/MTP): the last
            ``n - 1`` computed tokens are cached only once final. 0: no drafter.
        eagle_block_drop_group_ids: Groups whose hits drop their last matched block (vLLM's
            EAGLE trailing-block drop, on when lookahead hashes are off); distinct group
            indices of the pool's layout. Empty: none.
        enable_mamba_shared_prefix_checkpoint: vLLM's
            ``enable_mamba_shared_prefix_checkpoint``, sent by an engine with an EAGLE/MTP
            group (vLLM ignores it without one): align-mode Mamba groups also key the state
            at a request's shared-prefix junction. It takes effect, as in vLLM, only with
            sub-block hits and no re-prefillable tokens (multi-module MTP).
    """

    max_model_len: int
    world_size: int = 0
    explicit_layout: KVCacheConfig | None = None
    num_blocks_override: int | None = None
    scheduler_block_size: int | None = None
    hash_block_size: int | None = None
    max_in_flight_tokens: int | None = None
    enable_caching: bool = True
    hash_algorithm: HashAlgorithm = HashAlgorithm.SHA256
    hash_seed: str | None = None
    verify_block_hashes: bool = False
    enable_kv_cache_events: bool = False
    event_retention_num_events: int = DEFAULT_EVENT_RETENTION
    log_stats: bool = True
    watermark: float = 0.0
    prefix_cache_retention_interval: int | None = None
    scheduler_lease_s: float = 0.0
    lease_expiry: LeaseExpiry = LeaseExpiry.FREE_REQUESTS
    labels: Mapping[str, str] = field(default_factory=dict)
    disable_hybrid_kv_cache_manager: bool | None = None
    max_num_batched_tokens: int | None = None
    max_num_encoder_input_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    auto_fit_max_model_len: bool = False
    kv_cache_layout: KVCacheLayout = KVCacheLayout.LBNHC
    host_tier_bytes: int = 0
    decode_context_parallel_size: int = 1
    offload_host_blocks: int = 0
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead: int = 0
    eagle_block_drop_group_ids: tuple[int, ...] = ()
    enable_mamba_shared_prefix_checkpoint: bool = False

    def __post_init__(self) -> None:
        check_labels(self.labels)
        object.__setattr__(
            self,
            "kv_cache_layout",
            KVCacheLayout.parse(self.kv_cache_layout, "config.kv_cache_layout"),
        )
        # A plain dict (sorted by key) so that configs copy and pickle; treat it as read-only.
        object.__setattr__(self, "labels", dict(sorted(self.labels.items())))
        named: object = self.hash_algorithm
        if not isinstance(named, HashAlgorithm):
            # Callers may name the algorithm as the CLI and the wire docs do.
            try:
                algorithm = HashAlgorithm(named)  # type: ignore[arg-type]
            except ValueError:
                known = [a.value for a in HashAlgorithm]
                raise InvalidArgumentError(
                    f"config.hash_algorithm must be one of {known}, got {self.hash_algorithm!r}",
                    field="config.hash_algorithm",
                ) from None
            object.__setattr__(self, "hash_algorithm", algorithm)
        if self.max_model_len < 1:
            raise InvalidArgumentError(
                f"config.max_model_len must be >= 1, got {self.max_model_len}"
            )
        if self.explicit_layout is None and self.world_size < 1:
            raise InvalidArgumentError(
                "config.world_size must be >= 1 when config.explicit_layout is unset"
            )
        layout = self.explicit_layout
        if layout is not None:
            if layout.num_blocks < 2:
                raise InvalidArgumentError(
                    f"config.explicit_layout.num_blocks must be >= 2, got {layout.num_blocks}"
                )
            if not layout.kv_cache_groups:
                raise InvalidArgumentError("config.explicit_layout.kv_cache_groups is empty")
            for index, group in enumerate(layout.kv_cache_groups):
                if not group.layer_names:
                    raise InvalidArgumentError(
                        f"config.explicit_layout.kv_cache_groups[{index}].layer_names is empty"
                    )
            # A worker's tensor spans every block: its byte size must fit the wire's uint64.
            bytes_per_block = pool_bytes_per_block(layout.kv_cache_groups)
            if bytes_per_block * layout.num_blocks > UINT64_MAX:
                raise InvalidArgumentError(
                    f"config.explicit_layout: {layout.num_blocks} blocks of {bytes_per_block} "
                    f"bytes need a {bytes_per_block * layout.num_blocks}-byte tensor, more than "
                    "a uint64 holds (fewer blocks or smaller pages)",
                    field="config.explicit_layout.num_blocks",
                )
        for name in ("num_blocks_override",):
            value = getattr(self, name)
            if value is not None and value < 2:
                raise InvalidArgumentError(f"config.{name} must be >= 2, got {value}")
        for name in (
            "scheduler_block_size",
            "hash_block_size",
            "max_in_flight_tokens",
            "max_num_batched_tokens",
            "kv_cache_memory_bytes",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidArgumentError(
                    f"config.{name} must be >= 1, got {value}", field=f"config.{name}"
                )
        host = self.host_tier_bytes
        if type(host) is not int or not 0 <= host <= UINT64_MAX:
            raise InvalidArgumentError(
                f"config.host_tier_bytes must be an int in [0, 2**64), got {host!r}",
                field="config.host_tier_bytes",
            )
        offload = self.offload_host_blocks
        if type(offload) is not int or not 0 <= offload < 1 << 32:
            raise InvalidArgumentError(
                f"config.offload_host_blocks must be an int in [0, 2**32), got {offload!r}",
                field="config.offload_host_blocks",
            )
        if offload and host:
            raise InvalidArgumentError(
                "config.offload_host_blocks and config.host_tier_bytes are exclusive (a "
                "pool's host tier is kept by an engine's connector or by demotion, not both)",
                field="config.offload_host_blocks",
            )
        memory = self.kv_cache_memory_bytes
        if memory is not None and memory > UINT64_MAX:
            raise InvalidArgumentError(
                f"config.kv_cache_memory_bytes must be < 2**64, got {memory}",
                field="config.kv_cache_memory_bytes",
            )
        encoder = self.max_num_encoder_input_tokens
        if encoder is not None and encoder < 0:
            raise InvalidArgumentError(
                f"config.max_num_encoder_input_tokens must be >= 0, got {encoder}",
                field="config.max_num_encoder_input_tokens",
            )
        if self.event_retention_num_events < 1:
            raise InvalidArgumentError(
                "config.event_retention_num_events must be >= 1, "
                f"got {self.event_retention_num_events}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise InvalidArgumentError(f"config.watermark must be in [0, 1), got {self.watermark}")
        retention = self.prefix_cache_retention_interval
        if retention is not None and (type(retention) is not int or retention < 0):
            raise InvalidArgumentError(
                f"config.prefix_cache_retention_interval must be None or an int >= 0, "
                f"got {retention!r}",
                field="config.prefix_cache_retention_interval",
            )
        dcp = self.decode_context_parallel_size
        if type(dcp) is not int or not 1 <= dcp <= _MAX_DCP_SIZE:
            raise InvalidArgumentError(
                "config.decode_context_parallel_size must be an int in "
                f"[1, {_MAX_DCP_SIZE}], got {dcp!r}",
                field="config.decode_context_parallel_size",
            )
        if dcp > 1 and self.explicit_layout is None:
            # Planning from registered workers sizes memory without DCP (vLLM divides a full
            # attention request's tokens over the ranks): refuse rather than plan otherwise.
            raise InvalidArgumentError(
                "config.decode_context_parallel_size > 1 needs config.explicit_layout: "
                "planning from registered workers does not model DCP",
                field="config.decode_context_parallel_size",
            )
        for name in ("num_hash_lookahead_tokens", "num_prefill_lookahead"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= _MAX_LOOKAHEAD:
                raise InvalidArgumentError(
                    f"config.{name} must be an int in [0, {_MAX_LOOKAHEAD}], got {value!r}",
                    field=f"config.{name}",
                )
        object.__setattr__(
            self, "eagle_block_drop_group_ids", tuple(self.eagle_block_drop_group_ids)
        )
        drop = self.eagle_block_drop_group_ids
        if len(set(drop)) != len(drop) or not all(
            type(group_id) is int and 0 <= group_id < _MAX_GROUPS for group_id in drop
        ):
            raise InvalidArgumentError(
                "config.eagle_block_drop_group_ids must be distinct group indices in "
                f"[0, {_MAX_GROUPS}), got {list(drop)}",
                field="config.eagle_block_drop_group_ids",
            )
        if type(self.enable_mamba_shared_prefix_checkpoint) is not bool:
            raise InvalidArgumentError(
                "config.enable_mamba_shared_prefix_checkpoint must be a bool, got "
                f"{self.enable_mamba_shared_prefix_checkpoint!r}",
                field="config.enable_mamba_shared_prefix_checkpoint",
            )
        if not 0.0 <= self.scheduler_lease_s <= 1e9:
            raise InvalidArgumentError(
                f"config.scheduler_lease_s must be in [0, 1e9], got {self.scheduler_lease_s}",
                field="config.scheduler_lease_s",
            )

    def planning_options(self) -> PlanningOptions:
        """What planning reads of this config, vLLM's defaults left to planning.

        The encoder budget falls back to ``max_num_batched_tokens``, as vLLM's
        ``SchedulerConfig`` sets one to the other.
        """
        encoder = self.max_num_encoder_input_tokens
        if encoder is None:
            encoder = self.max_num_batched_tokens
        return PlanningOptions(
            max_model_len=self.max_model_len,
            max_in_flight_tokens=self.max_in_flight_tokens,
            max_num_encoder_input_tokens=encoder,
            num_gpu_blocks_override=self.num_blocks_override,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_hybrid_manager=not self.disable_hybrid_kv_cache_manager,
            auto_fit_max_model_len=self.auto_fit_max_model_len,
            kv_cache_layout=self.kv_cache_layout,
            enable_caching=self.enable_caching,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HashingParameters:
    """How a pool's clients hash token blocks (``kvcm.v1.HashingParameters``).

    Attributes:
        algorithm: The block hash algorithm.
        seed: The NONE_HASH seed. For xxhash algorithms it is a secret (kept out of ``repr``).
        hash_block_size: Tokens per hashed block.
        hash_length_bytes: Bytes per block hash (32 for sha256, 16 for xxhash algorithms).
        num_lookahead_tokens: Tokens after each block that its hash also covers (an EAGLE/MTP
            engine's lookahead block hashes, ``PoolConfig.num_hash_lookahead_tokens``).
    """

    algorithm: HashAlgorithm
    seed: str
    hash_block_size: int
    hash_length_bytes: int
    num_lookahead_tokens: int = 0

    def block_hasher(self) -> BlockHasher:
        """A hasher whose hashes equal the server's (and vLLM's) for this pool."""
        return BlockHasher(
            self.hash_block_size,
            self.algorithm,
            self.seed,
            num_lookahead_tokens=self.num_lookahead_tokens,
        )

    def __repr__(self) -> str:
        # The seed of an xxhash pool is a secret: keep it out of logs.
        return (
            f"HashingParameters(algorithm={self.algorithm!s}, seed=<hidden>, "
            f"hash_block_size={self.hash_block_size}, hash_length_bytes={self.hash_length_bytes}, "
            f"num_lookahead_tokens={self.num_lookahead_tokens})"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Registration:
    """One rank's registration: its layers' specs and the bytes it gives the KV cache."""

    specs: Mapping[str, KVCacheSpec]
    available_memory_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSnapshot:
    """A pool's state copied out for metrics and summaries (read by ``kvcm.server.http``).

    Counters are cumulative since the pool was created; ``groups`` holds
    ``(group_id, kind, block_size, num_layers)`` per KV-cache group.
    """

    name: str
    state: PoolState
    world_size: int
    registered_workers: int
    num_blocks: int
    num_free_blocks: int
    usage: float
    num_cached_blocks: int
    groups: tuple[tuple[int, str, int, int], ...]
    num_requests: int
    requests: int
    queries: int
    hits: int
    preempted_requests: int
    preempted_queries: int
    preempted_hits: int
    recent_hit_rate: float
    evicted_blocks_total: int
    events_emitted_total: int
    allocations_not_fit_total: int
    # What the pool is and where its numbering stands (the inspector page and ``/v1/pools``).
    labels: Mapping[str, str] = field(default_factory=dict)
    epoch: int = 0
    last_step_seq: int = 0
    scheduler_lease_s: float = 0.0
    # The host tier (all 0 without one); counters cumulative since the pool was created.
    host_tier_blocks: int = 0
    host_tier_used_blocks: int = 0
    host_tier_hit_tokens: int = 0
    host_tier_demoted_blocks: int = 0
    host_tier_loaded_blocks: int = 0
    host_tier_evicted_blocks: int = 0
    host_tier_swap_outs: int = 0
    host_tier_swap_ins: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSummary:
    """One line of ``ListPools`` (``kvcm.v1.PoolSummary``).

    Attributes:
        pool_id: The pool's id.
        state: Its lifecycle state.
        num_blocks: Blocks in the pool (0 while PENDING_WORKERS).
        num_free_blocks: Blocks that can be allocated now.
        num_requests: Requests the pool tracks.
    """

    pool_id: str
    state: PoolState
    num_blocks: int
    num_free_blocks: int
    num_requests: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ZmqEventStream:
    """Where a pool's KV-event batches go out on vLLM's ZMQ wire (``kvcm.v1.ZmqEventStream``;
    docs/kv-events.md).

    Attributes:
        endpoint: The PUB endpoint (bound, port resolved; or the peer kvcm connects to).
        replay_endpoint: The ROUTER endpoint answering vLLM's replay request (``""``: none).
        topic: The ZMQ topic of the pool's batches.
        last_seq: Wire seq of the last batch published under the pool id, across its
            incarnations (-1: none yet).
        data_parallel_rank: The ``data_parallel_rank`` its batches carry.
        dedicated: Whether no other pool publishes on ``endpoint`` (a consumer that ignores
            topics reads the pool alone).
    """

    endpoint: str
    replay_endpoint: str
    topic: str
    last_seq: int
    data_parallel_rank: int
    dedicated: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class StepProgress:
    """How far a pool's copy is behind its scheduler (``kvcm.v1.StepProgress``).

    Attributes:
        last_step_seq: The last applied Step's step_seq (or a ResyncPool snapshot's step).
        last_step_age_s: Seconds since the scheduler closed that step.
        scheduler_step_seq: The newest step the scheduler had closed when it sent it (0: not
            reported).
        steps_behind: Steps the sender still had queued when it sent it.
        since_applied_s: Seconds since the server applied the last Step or ResyncPool.
    """

    last_step_seq: int
    last_step_age_s: float
    scheduler_step_seq: int
    steps_behind: int
    since_applied_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheTotals:
    """A pool's prefix-cache lookups since it was created (``kvcm.v1.PrefixCacheTotals``).

    Attributes:
        requests: Requests looked up for the first time.
        queries: Their prompt tokens looked up.
        hits: Of those, tokens found cached.
        preempted_requests: Requests looked up again after a preemption.
        preempted_queries: Their tokens looked up.
        preempted_hits: Of those, tokens found cached.
        recent_hit_rate: Hits / queries over the most recent requests, 0..1.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    recent_hit_rate: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Hits / queries over the pool's life (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolInfo:
    """Everything about a pool (``DescribePool``, ``kvcm.v1.PoolInfo``).

    Attributes:
        pool_id: The pool's id.
        state: Its lifecycle state.
        config: As created (defaults resolved where the wire leaves them unset).
        kv_cache_config: The planned config without tensors; ``None`` while PENDING_WORKERS.
        hashing: The resolved hashing parameters.
        registered_ranks: Ranks that have registered, ascending.
        num_free_blocks: Blocks that can be allocated now.
        num_requests: Requests the pool tracks.
        usage: Fraction of blocks in use, 0..1.
        last_event_sequence: Sequence number of the last published event (0: none yet).
        epoch: The pool's incarnation (larger for a pool created later; 0: unknown).
        zmq_events: The pool's stream on vLLM's ZMQ wire (``None``: the server publishes
            none for it).
        step_progress: How far the pool is behind its scheduler (``None``: no Step applied
            since the server started).
        prefix_cache: Its prefix-cache lookups since it was created.
    """

    pool_id: str
    state: PoolState
    config: PoolConfig
    kv_cache_config: KVCacheConfig | None
    hashing: HashingParameters
    registered_ranks: tuple[int, ...]
    num_free_blocks: int
    num_requests: int
    usage: float
    last_event_sequence: int
    epoch: int = 0
    zmq_events: ZmqEventStream | None = None
    step_progress: StepProgress | None = None
    prefix_cache: PrefixCacheTotals = field(default_factory=PrefixCacheTotals)


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """A pool's block usage (``GetUsage``).

    Attributes:
        usage: Fraction of blocks in use, 0..1 (vLLM's ``usage``).
        num_free_blocks: Blocks that can be allocated now.
        num_blocks: Blocks in the pool, null block included.
        num_requests: Requests the pool tracks.
    """

    usage: float
    num_free_blocks: int
    num_blocks: int
    num_requests: int
