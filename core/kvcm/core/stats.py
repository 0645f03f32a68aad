"""Prefix-cache statistics: drained per-interval counters and a recent-requests hit rate.

The manager counts into a :class:`PrefixCacheStats` as requests are admitted and hands the
record out when drained (``make_prefix_cache_stats``), so metrics never reach into the core.
:class:`PrefixCachingMetrics` folds drained records into the hit rate over the most recent
requests. Both mirror vLLM 0.33.0 (``PrefixCacheStats`` and ``CachingMetrics`` in
``vllm/v1/metrics/stats.py``): same fields, same arithmetic.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvcm.common.errors import InvalidArgumentError

__all__ = ["EXTERNAL_UNSPECIFIED_SOURCE", "PrefixCacheStats", "PrefixCachingMetrics"]

EXTERNAL_UNSPECIFIED_SOURCE = "external_unspecified"
"""Hit source that takes a connector's hits when its per-source split does not add up."""


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups of the requests admitted since the last drain.

    Requests that were preempted before are counted apart, so re-admissions (which hit
    their own blocks) do not inflate the hit rate of new traffic.

    Attributes:
        reset: Whether the prefix cache was reset during the interval.
        requests: New requests counted.
        queries: Tokens those requests looked up.
        hits: Tokens of those lookups found in the cache.
        preempted_requests: Previously preempted requests counted.
        preempted_queries: Tokens the preempted requests looked up.
        preempted_hits: Tokens of those lookups found in the cache.
        hits_by_source: ``hits`` split by the tier that supplied them (connector stats only;
            only non-zero entries).
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict[str, int] = field(default_factory=dict)

    def record(
        self,
        num_tokens: int,
        num_hits: int,
        preempted: bool,
        hits_by_source: dict[str, int] | None = None,
    ) -> None:
        """Count one request's lookup.

        Args:
            num_tokens: Tokens the request looked up.
            num_hits: Tokens found in the cache.
            preempted: Whether the request was preempted before (counted apart).
            hits_by_source: Optional split of ``num_hits`` by source tier; a split that
                does not add up to ``num_hits`` is reported under
                :data:`EXTERNAL_UNSPECIFIED_SOURCE`.
        """
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
        if hits_by_source is None:
            return
        if sum(hits_by_source.values()) != num_hits:
            hits_by_source = {EXTERNAL_UNSPECIFIED_SOURCE: num_hits}
        totals = self.hits_by_source
        for source, num_source_hits in hits_by_source.items():
            if num_source_hits:
                totals[source] = totals.get(source, 0) + num_source_hits


class PrefixCachingMetrics:
    """Hit rate (hit tokens / queried tokens) over the most recent requests.

    Drained intervals are kept whole: when the window holds more than ``max_recent_requests``
    requests, the oldest intervals are dropped, but the newest one is always kept, even if it
    alone exceeds the limit. Intervals without requests are ignored so idle steps do not push
    useful history out. A reset of the prefix cache clears the window.

    Attributes:
        max_recent_requests: Requests the window aims to cover.
        aggregated_requests: Requests in the window.
        aggregated_query_total: Queried tokens in the window.
        aggregated_query_hit: Hit tokens in the window.
    """

    __slots__ = (
        "_intervals",
        "aggregated_query_hit",
        "aggregated_query_total",
        "aggregated_requests",
        "max_recent_requests",
    )

    def __init__(self, max_recent_requests: int = 1000) -> None:
        """Create an empty window.

        Args:
            max_recent_requests: Requests the window aims to cover (> 0).

        Raises:
            InvalidArgumentError: ``max_recent_requests`` is not a positive int.
        """
        if type(max_recent_requests) is not int or max_recent_requests <= 0:
            raise InvalidArgumentError(
                f"max_recent_requests must be a positive int, got {max_recent_requests!r}"
            )
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        # NOTE: the aggregates are always the sums over _intervals (requests, queries, hits).
        self._intervals: deque[tuple[int, int, int]] = deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        """Fold one drained interval into the window.

        Only new requests count; preempted re-admissions are left out of the hit rate.

        Args:
            stats: The interval's stats.
        """
        if stats.reset:
            # The reset happened before these lookups: older history no longer applies.
            self.reset()
        if stats.requests == 0:
            return
        self._intervals.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        intervals = self._intervals
        while len(intervals) > 1 and self.aggregated_requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = intervals.popleft()
            self.aggregated_requests -= old_requests
            self.aggregated_query_total -= old_queries
            self.aggregated_query_hit -= old_hits

    def reset(self) -> None:
        """Empty the window."""
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self._intervals.clear()

    @property
    def empty(self) -> bool:
        """Whether no request is in the window."""
        return self.aggregated_requests == 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens in the window, 0..1 (0.0 when nothing was queried)."""
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total
