"""PrefixCacheStats counting and the recent-requests hit rate (vLLM's CachingMetrics)."""

from __future__ import annotations

import pytest

from kvcm.common.errors import InvalidArgumentError
from kvcm.core.stats import (
    EXTERNAL_UNSPECIFIED_SOURCE,
    PrefixCacheStats,
    PrefixCachingMetrics,
)


def interval(*lookups: tuple[int, int], reset: bool = False) -> PrefixCacheStats:
    stats = PrefixCacheStats(reset=reset)
    for num_tokens, num_hits in lookups:
        stats.record(num_tokens=num_tokens, num_hits=num_hits, preempted=False)
    return stats


def test_record_splits_new_and_preempted() -> None:
    stats = PrefixCacheStats()
    stats.record(num_tokens=10, num_hits=4, preempted=False)
    stats.record(num_tokens=20, num_hits=16, preempted=True)
    stats.record(num_tokens=6, num_hits=0, preempted=False)
    assert (stats.requests, stats.queries, stats.hits) == (2, 16, 4)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 20, 16)
    assert stats.reset is False


def test_hits_by_source_adds_up_or_falls_back() -> None:
    stats = PrefixCacheStats()
    stats.record(10, 6, False, {"device": 4, "host": 2, "disk": 0})
    stats.record(10, 5, False, {"device": 1})
    stats.record(10, 5, True, {"device": 5})
    assert stats.hits_by_source == {"device": 4, "host": 2, EXTERNAL_UNSPECIFIED_SOURCE: 5}


def test_hit_rate_over_recent_requests() -> None:
    metrics = PrefixCachingMetrics(max_recent_requests=5)
    assert metrics.empty
    assert metrics.hit_rate == 0.0
    metrics.observe(interval((10, 5), (10, 5)))  # 2 requests
    metrics.observe(interval((10, 0), (10, 0), (10, 0)))  # 5 requests in the window
    assert metrics.aggregated_requests == 5
    assert metrics.hit_rate == pytest.approx(10 / 50)
    metrics.observe(interval((10, 10)))  # 6 > 5: the oldest interval goes
    assert (metrics.aggregated_requests, metrics.aggregated_query_total) == (4, 40)
    assert metrics.hit_rate == pytest.approx(10 / 40)


def test_newest_interval_is_kept_even_if_too_large() -> None:
    metrics = PrefixCachingMetrics(max_recent_requests=2)
    metrics.observe(interval((4, 4)))
    metrics.observe(interval((10, 1), (10, 1), (10, 1)))
    assert metrics.aggregated_requests == 3
    assert metrics.hit_rate == pytest.approx(3 / 30)


def test_empty_intervals_ignored_and_reset_clears() -> None:
    metrics = PrefixCachingMetrics(max_recent_requests=10)
    metrics.observe(interval((10, 8)))
    metrics.observe(PrefixCacheStats())
    assert metrics.hit_rate == pytest.approx(0.8)
    preempted_only = PrefixCacheStats()
    preempted_only.record(10, 0, True)
    metrics.observe(preempted_only)
    assert metrics.hit_rate == pytest.approx(0.8)
    metrics.observe(interval((10, 1), reset=True))
    assert metrics.aggregated_requests == 1
    assert metrics.hit_rate == pytest.approx(0.1)
    metrics.observe(PrefixCacheStats(reset=True))
    assert metrics.empty


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_window_size_validated(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="max_recent_requests"):
        PrefixCachingMetrics(max_recent_requests=bad)  # type: ignore[arg-type]
