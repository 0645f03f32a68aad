"""What the HTTP side reads from the server: the pool registry and each pool's snapshot.

The HTTP side depends on these read-only shapes, not on the core's classes, so it never reaches
into a pool's internals and a test can hand it anything with the same fields. It reads pools
through one :class:`PoolReader`, so no single pool's state can fail a scrape or a listing for
the others.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeVar

__all__ = ["PoolLike", "PoolReader", "PoolRegistryLike", "PoolSnapshotLike"]

_LOG = logging.getLogger("kvcm.server.http")
_T = TypeVar("_T")


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
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def epoch(self) -> int: ...
    @property
    def last_step_seq(self) -> int: ...
    @property
    def scheduler_lease_s(self) -> float: ...
    @property
    def host_tier_blocks(self) -> int: ...
    @property
    def host_tier_used_blocks(self) -> int: ...
    @property
    def host_tier_hit_tokens(self) -> int: ...
    @property
    def host_tier_demoted_blocks(self) -> int: ...
    @property
    def host_tier_loaded_blocks(self) -> int: ...
    @property
    def host_tier_evicted_blocks(self) -> int: ...
    @property
    def host_tier_swap_outs(self) -> int: ...
    @property
    def host_tier_swap_ins(self) -> int: ...


class PoolLike(Protocol):
    """A pool as the HTTP side sees it: something that can be snapshotted.

    Attributes:
        name: The pool's id (what the tokens' globs match).
        lent: True while a worker thread runs a long call on the pool (skip it meanwhile).
        last_step_seq: The last applied Step's step_seq (0: none).
    """

    name: str
    lent: bool
    last_step_seq: int

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


# The numbers a snapshot carries; each must be a finite int or float for the exposition.
_NUMBERS = (
    "world_size", "registered_workers", "num_blocks", "num_free_blocks", "num_cached_blocks",
    "usage", "num_requests", "requests", "queries", "hits", "preempted_requests",
    "preempted_queries", "preempted_hits", "recent_hit_rate", "evicted_blocks_total",
    "events_emitted_total", "allocations_not_fit_total", "epoch", "last_step_seq",
    "scheduler_lease_s", "host_tier_blocks", "host_tier_used_blocks", "host_tier_hit_tokens",
    "host_tier_demoted_blocks", "host_tier_loaded_blocks", "host_tier_evicted_blocks",
    "host_tier_swap_outs", "host_tier_swap_ins",
)  # fmt: skip


def checked_snapshot(snapshot: PoolSnapshotLike) -> PoolSnapshotLike:
    """``snapshot``, once every number in it is a finite int or float and its groups are
    ``(int, str, int, int)`` (what the exposition and the JSON summaries write).

    Raises:
        ValueError: A field is not.
    """
    for name in _NUMBERS:
        value = getattr(snapshot, name)
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ValueError(f"{name} is {value!r}")
    for group in snapshot.groups:
        if [type(v) for v in group] != [int, str, int, int]:
            raise ValueError(f"group {group!r}")
    if type(snapshot.name) is not str:
        raise ValueError("name")
    return snapshot


class PoolReader:
    """Reads pools for the HTTP side, one pool at a time: a pool whose state cannot be read is
    left out of the answer (counted in ``kvcm_pool_read_errors_total``, logged with its
    traceback the 1st, 2nd, 4th, 8th... time) instead of failing ``/metrics`` or ``/v1/pools``
    for every pool.

    Attributes:
        failures: Failed reads by pool id, since the server started.
    """

    def __init__(self) -> None:
        """No failure yet."""
        self.failures: dict[str, int] = {}

    def read(
        self, pools: Iterable[PoolLike], convert: Callable[[PoolSnapshotLike], _T]
    ) -> list[_T]:
        """``convert(checked_snapshot(pool.snapshot()))`` of each pool not lent to a worker
        thread, leaving out (and counting) the pools where that raises."""
        out: list[_T] = []
        for pool in pools:
            if pool.lent:
                continue
            try:
                out.append(convert(checked_snapshot(pool.snapshot())))
            except Exception:  # any fault of one pool stays that pool's
                name = str(pool.name)
                count = self.failures[name] = self.failures.get(name, 0) + 1
                if count & (count - 1) == 0:  # the 1st, 2nd, 4th, ... time: scrapes repeat
                    _LOG.exception(
                        "pool %r could not be read (%d times); it is left out of the answer",
                        name,
                        count,
                    )
        return out
