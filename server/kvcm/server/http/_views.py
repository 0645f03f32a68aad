"""What the HTTP side reads from the server: the pool registry and each pool's snapshot.

The HTTP side depends on these read-only shapes, not on the core's classes, so it never reaches
into a pool's internals and a test can hand it anything with the same fields.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

__all__ = ["PoolLike", "PoolRegistryLike", "PoolSnapshotLike"]


class PoolSnapshotLike(Protocol):
    """A pool's state at one instant (the core's ``PoolSnapshot``).

    Counters (``requests`` ... ``allocations_not_fit_total``) are cumulative since the pool was
    created; gauges describe the instant.
    """

    @property
    def name(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def registered_workers(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def groups(self) -> tuple[tuple[int, str, int, int], ...]: ...
    @property
    def num_requests(self) -> int: ...
    @property
    def requests(self) -> int: ...
    @property
    def queries(self) -> int: ...
    @property
    def hits(self) -> int: ...
    @property
    def preempted_requests(self) -> int: ...
    @property
    def preempted_queries(self) -> int: ...
    @property
    def preempted_hits(self) -> int: ...
    @property
    def recent_hit_rate(self) -> float: ...
    @property
    def evicted_blocks_total(self) -> int: ...
    @property
    def events_emitted_total(self) -> int: ...
    @property
    def allocations_not_fit_total(self) -> int: ...


class PoolLike(Protocol):
    """A pool as the HTTP side sees it: something that can be snapshotted.

    Attributes:
        name: The pool's id (what the tokens' globs match).
        lent: True while a worker thread runs a long call on the pool (skip it meanwhile).
    """

    name: str
    lent: bool

    def snapshot(self) -> PoolSnapshotLike:
        """Copy the pool's state out."""
        ...


class PoolRegistryLike(Protocol):
    """The server's pool registry, read-only."""

    def list(self) -> Iterable[PoolLike]:
        """Every pool, in a stable order."""
        ...

    def get(self, name: str) -> PoolLike:
        """The pool called ``name``; raises ``kvcm.common.errors.NotFoundError`` if unknown."""
        ...
