"""kvcm.core.invariants: a healthy pool has no violation; each broken invariant is named.

Each case breaks one invariant of a real pool in memory (what a forged snapshot or a bug
would leave) and checks the first violation's path; listing every violation never raises,
whatever the damage.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcm.client import StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.invariants import check_pool, pool_violations
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.request import Request
from kvcm.core.stats import PrefixCacheStats

_SPEC = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=64,
    hash_seed="inv",
    enable_kv_cache_events=True,
    explicit_layout=KVCacheConfig(
        num_blocks=12,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l",), kv_cache_spec=_SPEC),),
    ),
)
HASHER = BlockHasher(4, CONFIG.hash_algorithm, "inv")


def _busy() -> Pool:
    """Request 1 holds 4 blocks (3 cached); request 2 finished (its 2 blocks cached, free)."""
    pool = Pool("p", CONFIG)
    step = StepBuilder()
    step.add_request(1, list(range(13)), HASHER.hash_token_ids(list(range(13))))
    step.allocate(1, 13, 0)
    step.add_request(2, [9] * 8, HASHER.hash_token_ids([9] * 8))
    step.allocate(2, 8, 0)
    pool.run_step(step.program)
    finish = StepBuilder()
    finish.finish(2)
    pool.run_step(finish.program)
    pool.publish_events(1.0)
    pool.take_prefix_cache_stats()
    return pool


def _cycle(pool: Pool) -> None:
    free = pool.ready_manager().block_pool.free_block_queue.get_all_free_blocks()
    free[2].next_free_block = free[0]


def _cached_elsewhere(pool: Pool) -> None:
    block_pool = pool.ready_manager().block_pool
    key = next(iter(block_pool._cached))
    block_pool._cached[key] = block_pool.blocks[11]


def _foreign_key(pool: Pool) -> None:
    pool.requests["1"] = pool.requests.pop(1)  # type: ignore[index]
    pool.request_ids["1"] = pool.request_ids.pop(1)  # type: ignore[index]


def _long_request(pool: Pool) -> None:
    pool.requests[1].all_token_ids.extend([1] * 60)


def _orphan_table(pool: Pool) -> None:
    manager = pool.ready_manager()
    manager._requests.add("77")
    manager.coordinator.single_type_managers[0].req_to_blocks["77"] = []


def _batch_gap(pool: Pool) -> None:
    log = pool._events
    seq, first, count, now = log._batches[-1]
    log._batches[-1] = (seq + 1, first, count, now)


CASES: dict[str, tuple[Callable[[Pool], None], str]] = {
    "a cycle in the free queue": (_cycle, "free_queue["),
    "a held block's ref count": (
        lambda p: setattr(p.ready_manager().block_pool.blocks[1], "ref_cnt", 2),
        "blocks[1].ref_cnt",
    ),
    "a cache entry pointing elsewhere": (_cached_elsewhere, "cached["),
    "a string request key": (_foreign_key, "requests['1']"),
    "a request past max_model_len": (_long_request, "requests[1].all_token_ids"),
    "computed tokens past the request": (
        lambda p: setattr(p.requests[1], "num_computed_tokens", 99),
        "requests[1].num_computed_tokens",
    ),
    "a table for a request that is not live": (_orphan_table, "requests_holding_blocks['77']"),
    "untaken counters beyond the totals": (
        lambda p: p.restore_stats_totals(
            PrefixCacheStats(), PrefixCacheStats(requests=1, queries=1)
        ),
        "stats_untaken.requests",
    ),
    "recent-requests aggregates that are not the sums": (
        lambda p: setattr(p.ready_manager().prefix_caching_metrics, "aggregated_query_hit", 5),
        "prefix_caching_metrics",
    ),
    "event batches with a gap": (_batch_gap, "events."),
    "a negative eviction count": (
        lambda p: setattr(p.ready_manager().block_pool, "num_evicted_blocks", -1),
        "num_evicted_blocks",
    ),
    "a request that is not a Request": (
        lambda p: p.requests.__setitem__(1, Request("2", [1])),
        "requests[1]",
    ),
}


def test_a_pool_the_core_built_keeps_every_invariant() -> None:
    pool = _busy()
    assert list(pool_violations(pool)) == []
    check_pool(pool)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_broken_invariant_is_named(name: str) -> None:
    breaks, where = CASES[name]
    pool = _busy()
    breaks(pool)
    violations = list(pool_violations(pool))  # listing all of them never raises
    assert violations, name
    assert any(where in str(v) for v in violations), violations
    with pytest.raises(InvalidArgumentError, match="breaks an invariant") as caught:
        check_pool(pool, field="data")
    assert caught.value.field == "data"
