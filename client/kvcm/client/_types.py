"""The SDK's value types: what its calls take and answer, free of protobuf.

Pool records (``PoolConfig``, ``PoolInfo``, ``PoolState``, ``FreeMode``, ...), an
allocation's ``ItemStatus`` and ``allocate_slots``' ``SlotOptions`` are the core's own
classes, re-exported. Every record is a frozen, slotted dataclass (or a slotted class on the
hot path) with the names of the matching ``kvcm.v1`` message fields and of vLLM's
``KVCacheManager`` where one exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from kvcm.core.manager import SlotOptions

# One value type per concept: the pool's records are the core's, re-exported here so the
# SDK's public names stay where they were.
from kvcm.core.pool_types import (
    FreeMode,
    HashingParameters,
    LeaseExpiry,
    PoolConfig,
    PoolInfo,
    PoolState,
    PoolSummary,
    Usage,
)
from kvcm.core.program import ItemStatus
from kvcm.core.stats import PrefixCacheStats
from kvcm.wire.events import EventBatch

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "REGISTER_WORKER_TIMEOUT_S",
    "USE_CLIENT_DEFAULT",
    "CacheHit",
    "EventBatch",
    "FreeMode",
    "HashingParameters",
    "ItemStatus",
    "KVCacheBlocks",
    "LeaseExpiry",
    "PoolConfig",
    "PoolInfo",
    "PoolListing",
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


class PoolListing(list[PoolSummary]):
    """``list_pools``' answer: every pool, sorted by id (a list of ``PoolSummary``).

    Attributes:
        missing_replicas: In a kvcm cluster, the replicas that did not answer in time (their
            pools are not listed); empty when every replica answered, and from one server.
    """

    __slots__ = ("missing_replicas",)

    def __init__(
        self, pools: Sequence[PoolSummary], missing_replicas: tuple[str, ...] = ()
    ) -> None:
        """The pools, and the replicas the listing missed."""
        super().__init__(pools)
        self.missing_replicas = missing_replicas


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
