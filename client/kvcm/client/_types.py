"""The SDK's value types: what its calls take and answer, free of protobuf.

Every record is a frozen, slotted dataclass (or a slotted class on the hot path) with the names
of the matching ``kvcm.v1`` message fields and of vLLM's ``KVCacheManager`` where one exists.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

from kvcm.common.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvcm.common.config import KVCacheConfig
    from kvcm.common.hashing import BlockHasher, HashAlgorithm

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "REGISTER_WORKER_TIMEOUT_S",
    "USE_CLIENT_DEFAULT",
    "CacheHit",
    "FreeMode",
    "HashingParameters",
    "ItemStatus",
    "KVCacheBlocks",
    "PoolConfig",
    "PoolInfo",
    "PoolState",
    "PoolSummary",
    "PrefixCacheStats",
    "RequestBlocks",
    "SlotOptions",
    "Usage",
    "UseClientDefault",
]

# Deadline of every unary call unless the client or the call says otherwise, in seconds.
DEFAULT_TIMEOUT_S: Final = 10.0
# RegisterWorker waits for every rank of the pool: give slow ranks time.
REGISTER_WORKER_TIMEOUT_S: Final = 600.0


class UseClientDefault:
    """Type of :data:`USE_CLIENT_DEFAULT`: "the client's setting", as opposed to any value."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "USE_CLIENT_DEFAULT"


USE_CLIENT_DEFAULT: Final = UseClientDefault()


@enum.unique
class PoolState(enum.Enum):
    """Lifecycle of a pool."""

    PENDING_WORKERS = "pending_workers"
    """Waiting for every rank to register; scheduler calls fail with FAILED_PRECONDITION."""
    READY = "ready"
    """Planned and serving scheduler calls."""


@enum.unique
class ItemStatus(enum.IntEnum):
    """Outcome of one allocation of a Step (values are the wire values)."""

    OK = 1
    """Allocated."""
    DOES_NOT_FIT = 2
    """Not enough free blocks (vLLM's ``allocate_slots`` returning ``None``); nothing changed."""
    NO_TOKEN_BUDGET = 3
    """A lookup allocation found nothing to compute within the step's token budget."""
    NOT_EXECUTED = 4
    """The Step stopped before this allocation; nothing changed for it."""


@enum.unique
class FreeMode(enum.IntEnum):
    """How ``free`` leaves a request (values are the wire values)."""

    FINISHED = 1
    """Done: free its blocks and forget it (its key may be reused)."""
    PREEMPTED = 2
    """Preempted: free its blocks, keep its tokens and hashes, count the preemption."""


class KVCacheBlocks:
    """Block ids per KV-cache group, as the SDK receives them.

    The id-only counterpart of the core's ``KVCacheBlocks`` (which holds block objects): the
    same ``get_block_ids``, ``+`` and ``new_empty``, so scheduler code reads both alike.

    Attributes:
        block_ids: One list of block ids per group. Treat as read-only.
    """

    __slots__ = ("block_ids",)

    def __init__(self, block_ids: tuple[list[int], ...]) -> None:
        """Wrap per-group block ids.

        Args:
            block_ids: One list per group, in group order.
        """
        self.block_ids = block_ids

    def get_block_ids(self, group_ids: Sequence[int] | None = None) -> tuple[list[int], ...]:
        """Block ids per group.

        Args:
            group_ids: Groups to include; ``None``: all.

        Returns:
            One list of block ids per selected group (the held lists: do not mutate them).
        """
        if group_ids is None:
            return self.block_ids
        return tuple(self.block_ids[g] for g in group_ids)

    def new_empty(self) -> KVCacheBlocks:
        """An instance with the same number of groups and no blocks."""
        return KVCacheBlocks(tuple([] for _ in self.block_ids))

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups."""
        return len(self.block_ids)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        pairs = zip(self.block_ids, other.block_ids, strict=True)
        return KVCacheBlocks(tuple([*mine, *theirs] for mine, theirs in pairs))

    def __bool__(self) -> bool:
        return any(self.block_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVCacheBlocks):
            return NotImplemented
        return self.block_ids == other.block_ids

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.block_ids!r})"


class CacheHit(NamedTuple):
    """What ``get_computed_blocks`` finds: hit blocks per group and the hit length in tokens."""

    blocks: KVCacheBlocks
    num_computed_tokens: int


def _check_count(field: str, value: object) -> None:
    if type(value) is not int or value < 0:
        raise InvalidArgumentError(f"{field} must be a non-negative int, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotOptions:
    """The rarely used knobs of ``allocate_slots`` (vLLM's keyword arguments of these names).

    Attributes:
        num_lookahead_tokens: Slots for speculative tokens beyond ``num_new_tokens``;
            ``None``: 0 (in a Step: the step's ``default_num_lookahead_tokens``).
        num_external_computed_tokens: Tokens a KV connector provides.
        delay_cache_blocks: Do not cache the new blocks yet (a KV transfer fills them).
        num_encoder_tokens: Encoder tokens for cross-attention groups.
        full_sequence_must_fit: Allocate only if the whole sequence would fit (admission gate).
        reserved_blocks: Free blocks that must stay free after this allocation.
        has_scheduled_reqs: Whether other requests are scheduled this step (watermark gate).
        num_in_flight_tokens: Tokens scheduled but not settled (async scheduling).
    """

    num_lookahead_tokens: int | None = None
    num_external_computed_tokens: int = 0
    delay_cache_blocks: bool = False
    num_encoder_tokens: int = 0
    full_sequence_must_fit: bool = False
    reserved_blocks: int = 0
    has_scheduled_reqs: bool = True
    num_in_flight_tokens: int = 0

    def __post_init__(self) -> None:
        for field in (
            "num_external_computed_tokens",
            "num_encoder_tokens",
            "reserved_blocks",
            "num_in_flight_tokens",
        ):
            _check_count(f"options.{field}", getattr(self, field))
        if self.num_lookahead_tokens is not None:
            _check_count("options.num_lookahead_tokens", self.num_lookahead_tokens)

    @property
    def is_default(self) -> bool:
        """Whether every knob has its default (the option need not travel)."""
        return self == DEFAULT_SLOT_OPTIONS


DEFAULT_SLOT_OPTIONS: Final = SlotOptions()


@dataclass(frozen=True, slots=True, kw_only=True)
class HashingParameters:
    """How a pool's clients hash token blocks (algorithm, seed and block size).

    Attributes:
        algorithm: The block hash algorithm.
        seed: The NONE_HASH seed. For xxhash algorithms it is a secret.
        hash_block_size: Tokens per hashed block.
        hash_length_bytes: Bytes per block hash (32 for sha256, 16 for xxhash algorithms).
    """

    algorithm: HashAlgorithm
    seed: str
    hash_block_size: int
    hash_length_bytes: int

    def block_hasher(self) -> BlockHasher:
        """A hasher whose hashes equal the server's (and vLLM's) for this pool."""
        from kvcm.common.hashing import BlockHasher

        return BlockHasher(self.hash_block_size, self.algorithm, self.seed)

    def __repr__(self) -> str:
        # The seed of an xxhash pool is a secret: keep it out of logs.
        return (
            f"HashingParameters(algorithm={self.algorithm!s}, seed=<hidden>, "
            f"hash_block_size={self.hash_block_size}, hash_length_bytes={self.hash_length_bytes})"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    """Everything a pool is created with (``kvcm.v1.PoolConfig``).

    Exactly one way of planning: ``world_size`` ranks register (``RegisterWorker``), or an
    ``explicit_layout`` (its ``num_blocks`` and ``kv_cache_groups``) plans the pool at once.

    Attributes:
        max_model_len: The model's context length, in tokens.
        world_size: Ranks that will register; 0 with an explicit layout.
        explicit_layout: Groups and block count that plan the pool at once; its
            ``kv_cache_tensors`` are ignored.
        num_blocks_override: With registrations: this many blocks instead of what memory allows.
        scheduler_block_size: Scheduling granularity; ``None``: lcm of the groups' block sizes.
        hash_block_size: Tokens per hashed block; ``None``: vLLM's default for the config.
        max_in_flight_tokens: Most tokens scheduled but not settled; ``None``: max_model_len.
        enable_caching: Prefix caching.
        hash_algorithm: Block hash algorithm (wire name, e.g. ``"sha256_cbor"``).
        hash_seed: NONE_HASH seed; ``None``: vLLM's resolution.
        verify_block_hashes: The server recomputes every hash a client sends (for testing).
        enable_kv_cache_events: Publish KV events.
        event_retention_num_events: Events kept for resuming subscribers; ``None``: 65536.
        log_stats: Prefix-cache hit statistics.
        watermark: Fraction of blocks kept free when admitting while others run, in [0, 1).
    """

    max_model_len: int
    world_size: int = 0
    explicit_layout: KVCacheConfig | None = None
    num_blocks_override: int | None = None
    scheduler_block_size: int | None = None
    hash_block_size: int | None = None
    max_in_flight_tokens: int | None = None
    enable_caching: bool = True
    hash_algorithm: str = "sha256"
    hash_seed: str | None = None
    verify_block_hashes: bool = False
    enable_kv_cache_events: bool = False
    event_retention_num_events: int | None = None
    log_stats: bool = True
    watermark: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSummary:
    """One line of ``list_pools``.

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
class PoolInfo:
    """Everything about a pool (``describe_pool``).

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


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """A pool's block usage (``get_usage``).

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


@dataclass(slots=True, kw_only=True)
class PrefixCacheStats:
    """Prefix-cache hit counters since the last take, with vLLM's field names.

    Attributes:
        reset: ``reset_prefix_cache`` succeeded since the last take.
        requests: Requests looked up for the first time.
        queries: Their tokens.
        hits: Their tokens found in the cache.
        preempted_requests: Requests looked up again after a preemption.
        preempted_queries: Their tokens.
        preempted_hits: Their tokens found in the cache.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestBlocks:
    """A request's blocks with their state (``get_blocks``), for debugging.

    Attributes:
        blocks: Block ids per group.
        ref_cnts: Reference count of each block, in the order of the flattened groups.
        is_cached: Whether each block is cached, same order.
        block_hashes: Hashes of the cached blocks, in block order.
    """

    blocks: KVCacheBlocks
    ref_cnts: tuple[int, ...]
    is_cached: tuple[bool, ...]
    block_hashes: tuple[bytes, ...]
