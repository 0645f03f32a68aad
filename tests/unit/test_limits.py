"""Limits: the block limits the registry checks before any block is built, and their domain."""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import AlreadyExistsError, ResourceExhaustedError
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.limits import DEFAULT_LIMITS, Limits, check_pool_blocks
from kvcm.core.pool import PoolConfig, PoolRegistry, PoolState

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LIMITS = Limits(max_blocks_per_pool=100, max_total_blocks=150, max_pools=4)


def _explicit(num_blocks: int) -> PoolConfig:
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    )
    return PoolConfig(max_model_len=256, explicit_layout=layout)


def test_check_names_the_limit_it_hits() -> None:
    check_pool_blocks(LIMITS, "p", 100, 50)
    with pytest.raises(ResourceExhaustedError, match="max_blocks_per_pool 100"):
        check_pool_blocks(LIMITS, "p", 101, 0)
    with pytest.raises(ResourceExhaustedError, match="max_total_blocks 150"):
        check_pool_blocks(LIMITS, "p", 100, 51)


def test_a_2_31_block_layout_is_refused_before_anything_is_built() -> None:
    registry = PoolRegistry()
    with pytest.raises(ResourceExhaustedError, match="max_blocks_per_pool"):
        registry.create("huge", _explicit(2**31 - 1))
    assert len(registry) == 0
    assert registry.num_blocks() == 0
    registry.create("huge", _explicit(16))  # the name was not kept


def test_the_server_total_counts_every_pool_and_frees_on_delete() -> None:
    registry = PoolRegistry(limits=LIMITS)
    registry.create("a", _explicit(100))
    with pytest.raises(ResourceExhaustedError, match="max_total_blocks"):
        registry.create("b", _explicit(51))
    assert [pool.name for pool in registry.list()] == ["a"]
    registry.create("b", _explicit(50))
    assert registry.num_blocks() == 150
    registry.delete("a")
    registry.create("c", _explicit(100))


def test_a_reservation_holds_the_name_and_blocks_until_added_or_released() -> None:
    registry = PoolRegistry(limits=LIMITS)
    registry.reserve("big", _explicit(100))
    assert registry.list() == []
    with pytest.raises(AlreadyExistsError):
        registry.create("big", _explicit(2))
    with pytest.raises(ResourceExhaustedError, match="max_total_blocks"):
        registry.create("other", _explicit(51))
    pool = registry.build("big", _explicit(100))
    assert registry.list() == []  # building changes nothing in the registry
    registry.add(pool)
    assert registry.get("big") is pool
    registry.reserve("gone", _explicit(50))
    registry.release("gone")
    assert registry.num_blocks() == 100
    registry.create("gone", _explicit(50))


def test_planning_refuses_a_planned_count_over_the_limits_and_keeps_nothing() -> None:
    registry = PoolRegistry(limits=LIMITS)
    registry.create("a", _explicit(100))
    options = PoolConfig(max_model_len=256, world_size=1, num_blocks_override=60)
    pool = registry.create("planned", options)
    with pytest.raises(ResourceExhaustedError, match="max_total_blocks"):
        pool.register_worker(0, 1, {"l0": SPEC}, 1 << 30)
    assert pool.state is PoolState.PENDING_WORKERS
    assert pool.registrations == {}
    registry.delete("a")
    pool.register_worker(0, 1, {"l0": SPEC}, 1 << 30)
    assert pool.state is PoolState.READY
    assert registry.num_blocks() == 60


def test_planning_refuses_more_than_max_blocks_per_pool() -> None:
    registry = PoolRegistry(limits=LIMITS)
    options = PoolConfig(max_model_len=256, world_size=1, num_blocks_override=101)
    pool = registry.create("planned", options)
    with pytest.raises(ResourceExhaustedError, match="max_blocks_per_pool"):
        pool.register_worker(0, 1, {"l0": SPEC}, 1 << 30)


@pytest.mark.parametrize(
    ("name", "value"),
    [("max_blocks_per_pool", 0), ("max_step_tokens", -1), ("max_pools", True)],
)
def test_limits_are_positive_ints(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        Limits(**{name: value})  # type: ignore[arg-type]


def test_registry_takes_max_pools_from_limits() -> None:
    assert PoolRegistry().max_pools == DEFAULT_LIMITS.max_pools
    assert PoolRegistry(limits=LIMITS).max_pools == 4
    assert PoolRegistry(max_pools=2, limits=LIMITS).limits.max_pools == 2
