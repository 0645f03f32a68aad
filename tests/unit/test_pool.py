"""Pool and PoolRegistry: the core side of the service, without any network."""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import (
    AlreadyExistsError,
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from kvcm.common.events import AllBlocksCleared, BlockRemoved
from kvcm.common.hashing import BlockHasher, HashAlgorithm
from kvcm.common.specs import FullAttentionSpec, MambaSpec
from kvcm.core.event_log import EventLog
from kvcm.core.limits import Limits
from kvcm.core.pool import (
    OutOfRangeError,
    Pool,
    PoolConfig,
    PoolRegistry,
    PoolState,
    check_pool_id,
    hash_length_bytes,
)
from kvcm.core.program import HitSpec

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=16,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)


def _pool(**overrides: object) -> Pool:
    options = {"max_model_len": 256, "explicit_layout": LAYOUT, **overrides}
    return Pool("p", PoolConfig(**options))  # type: ignore[arg-type]


def _hashes(pool: Pool, tokens: list[int]) -> bytes:
    hasher = BlockHasher(pool.hashing.hash_block_size, pool.hashing.algorithm, pool.hashing.seed)
    return b"".join(hasher.hash_token_ids(tokens))


def test_pool_ids_are_checked() -> None:
    check_pool_id("engine-0.a_b")
    for bad in ("", "a/b", "x" * 129, "spaced id"):
        with pytest.raises(InvalidArgumentError, match="pool_id"):
            check_pool_id(bad)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"max_model_len": 0}, "max_model_len"),
        ({"explicit_layout": None}, "world_size"),
        ({"watermark": 1.0}, "watermark"),
        ({"event_retention_num_events": 0}, "event_retention_num_events"),
        ({"hash_block_size": 0}, "hash_block_size"),
    ],
)
def test_options_name_the_bad_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        _pool(**overrides)


def test_explicit_layout_is_ready_at_once_with_resolved_hashing() -> None:
    pool = _pool(hash_algorithm=HashAlgorithm.XXHASH)
    assert pool.state is PoolState.READY
    assert str(pool.state) == "READY"
    assert pool.hashing.hash_block_size == 16
    assert pool.hashing.hash_length_bytes == hash_length_bytes(HashAlgorithm.XXHASH) == 16
    assert pool.hashing.seed  # random per pool for xxhash
    snapshot = pool.snapshot()
    assert snapshot.num_blocks == 16
    assert snapshot.groups == ((0, "full_attention", 16, 1),)


def test_requests_are_validated_before_they_change_anything() -> None:
    pool = _pool()
    prompt = list(range(40))
    pool.add_request(1, "r1", prompt, _hashes(pool, prompt))
    with pytest.raises(AlreadyExistsError):
        pool.add_request(1, "again", [1], b"")
    with pytest.raises(InvalidArgumentError, match="block_hashes"):
        pool.add_request(2, "r2", prompt, b"x" * 32)
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        pool.add_request(2, "r2", [1] * 257, b"")
    with pytest.raises(NotFoundError):
        pool.append_tokens(9, [1], b"")
    with pytest.raises(InvalidArgumentError, match="hashes"):
        pool.append_tokens(1, list(range(8)), b"h" * 64)  # fills one block: 1 hash, not 2
    assert pool.request(1).num_tokens == 40
    pool.append_tokens(1, list(range(8)), b"")  # no hash: the request stays unhashed beyond
    assert pool.request(1).num_tokens == 48
    assert len(pool.request(1).block_hashes) == 2  # stopped sending hashes: stays behind
    with pytest.raises(InvalidArgumentError, match="must be empty"):
        pool.append_tokens(1, list(range(16)), b"y" * 32)
    assert pool.request(1).num_tokens == 48
    assert sorted(pool.requests) == [1]


def test_allocation_does_not_fit_is_counted_and_free_forgets() -> None:
    pool = _pool()
    prompt = list(range(200))
    pool.add_request(1, "r1", prompt, _hashes(pool, prompt))
    assert pool.allocate(1, 200, 0) is not None  # 13 of 15 usable blocks
    assert pool.allocations_not_fit_total == 0
    pool.add_request(2, "r2", list(range(256)), b"")
    assert pool.allocate(2, 256, 0) is None
    assert pool.snapshot().allocations_not_fit_total == 1
    pool.free(2, preempt=True)
    assert pool.request(2).num_preemptions == 1
    pool.free(2, preempt=False)
    with pytest.raises(NotFoundError):
        pool.request(2)


def test_lookup_stats_accumulate_and_drain_separately() -> None:
    pool = _pool()
    prompt = list(range(48))
    for key in (1, 2):
        pool.add_request(key, f"r{key}", prompt, _hashes(pool, prompt))
        hit = pool.get_computed_blocks(key, None)
        found = HitSpec(num_tokens=hit.num_computed_tokens, block_ids=hit.blocks.get_block_ids())
        assert pool.allocate(key, 48 - hit.num_computed_tokens, 0, hit=found) is not None
    snapshot = pool.snapshot()
    assert (snapshot.requests, snapshot.queries, snapshot.hits) == (2, 96, 32)
    taken = pool.take_prefix_cache_stats()
    assert taken is not None
    assert (taken.requests, taken.queries, taken.hits) == (2, 96, 32)
    again = pool.take_prefix_cache_stats()
    assert again is not None
    assert again.requests == 0
    assert pool.snapshot().requests == 2  # cumulative totals are not drained by takes


def test_snapshot_counts_cached_blocks_as_the_blocks_say() -> None:
    pool = _pool()
    prompt = list(range(40))  # two full blocks cached, the third partial
    pool.add_request(1, "r1", prompt, _hashes(pool, prompt))
    assert pool.allocate(1, 40, 0) is not None
    assert pool.manager is not None
    hashed = sum(1 for block in pool.manager.block_pool.blocks if block.block_hash is not None)
    assert hashed == 2
    assert pool.snapshot().num_cached_blocks == hashed
    pool.free(1, preempt=False)  # freed blocks stay cached until evicted
    assert pool.snapshot().num_cached_blocks == 2
    assert pool.manager.reset_prefix_cache()
    assert pool.snapshot().num_cached_blocks == 0


def test_event_log_numbers_resumes_and_forgets() -> None:
    pool = _pool(enable_kv_cache_events=True, event_retention_num_events=2)
    assert pool.check_event_start(None) == 1
    for key in range(3):
        prompt = [key * 100 + i for i in range(16)]
        pool.add_request(key, str(key), prompt, _hashes(pool, prompt))
        pool.allocate(key, 16, 0)
        assert pool.publish_events(float(key)) == 1
    assert pool.last_event_sequence == 3
    assert pool.oldest_event_sequence == 2
    with pytest.raises(OutOfRangeError):
        pool.check_event_start(1)
    with pytest.raises(InvalidArgumentError):
        pool.check_event_start(5)
    got = pool.events_from(2, 10)
    assert got is not None
    events, stamp = got
    assert len(events) == 2
    assert stamp == 2.0
    assert pool.events_from(1, 10) is None
    assert pool.events_from(4, 10) == ([], 0.0)
    with pytest.raises(FailedPreconditionError):
        _pool().check_event_start(None)


def test_registration_plans_once_every_rank_registered() -> None:
    pool = Pool("w", PoolConfig(max_model_len=64, world_size=2))
    with pytest.raises(FailedPreconditionError):
        pool.ready_manager()
    page = SPEC.page_size_bytes
    pool.register_worker(0, 2, {"l0": SPEC}, 40 * page)
    pool.register_worker(0, 2, {"l0": SPEC}, 40 * page)  # idempotent
    with pytest.raises(AlreadyExistsError):
        pool.register_worker(0, 2, {"l0": SPEC}, 41 * page)
    with pytest.raises(InvalidArgumentError, match="world_size"):
        pool.register_worker(1, 3, {"l0": SPEC}, 40 * page)
    other = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
    with pytest.raises(FailedPreconditionError, match="disagree"):
        pool.register_worker(1, 2, {"l0": other}, 40 * page)
    states = [pool.state]
    pool.register_worker(1, 2, {"l0": SPEC}, 30 * page)
    states.append(pool.state)
    assert states == [PoolState.PENDING_WORKERS, PoolState.READY]
    assert pool.rank_config(0).num_blocks == pool.rank_config(1).num_blocks == 30


def test_too_little_memory_is_rejected_and_not_kept() -> None:
    pool = Pool("m", PoolConfig(max_model_len=16, world_size=1))
    with pytest.raises((ResourceExhaustedError, InvalidArgumentError)):
        pool.register_worker(0, 1, {"l0": SPEC}, SPEC.page_size_bytes)
    assert pool.registrations == {}


def test_registration_checks_limits_memory_order_and_mamba_mode() -> None:
    pool = Pool("bound", PoolConfig(max_model_len=64, world_size=3))
    page = SPEC.page_size_bytes
    specs = {"model.layers.2.attn": SPEC, "model.layers.10.attn": SPEC}
    limits = Limits(max_pending_registrations=3)
    pool.register_worker(0, 3, specs, 40 * page, limits=limits)
    with pytest.raises(ResourceExhaustedError, match="max_pending_registrations") as bound:
        pool.register_worker(1, 3, specs, 40 * page, limits=Limits(max_pending_registrations=2))
    assert bound.value.field == "world_size"
    with pytest.raises(InvalidArgumentError, match="available_memory_bytes") as memory:
        pool.register_worker(1, 3, specs, 1 << 64, limits=limits)
    assert memory.value.field == "available_memory_bytes"
    # The layer order is part of a registration: the same layers in another order differ.
    with pytest.raises(AlreadyExistsError, match="order"):
        pool.register_worker(0, 3, dict(reversed(specs.items())), 40 * page, limits=limits)
    unknown_mode = MambaSpec(
        block_size=16, shapes=((4, 64),), dtypes=("float32",), mamba_cache_mode="all"
    )
    with pytest.raises(InvalidArgumentError, match=r"'model.layers.1.mixer'.*'all'") as mode:
        pool.register_worker(1, 3, {"model.layers.1.mixer": unknown_mode}, 40 * page, limits=limits)
    assert mode.value.field == "layer_specs[model.layers.1.mixer].mamba_cache_mode"
    assert list(pool.registrations) == [0]
    # A pending rank whose call ended is withdrawn; a planned pool keeps its ranks.
    assert pool.withdraw_worker(0)
    assert not pool.withdraw_worker(0)
    assert pool.registrations == {}


def test_a_failed_plan_drops_the_round() -> None:
    pool = Pool("round", PoolConfig(max_model_len=64, world_size=2))
    page = SPEC.page_size_bytes
    pool.register_worker(0, 2, {"l0": SPEC}, 40 * page)
    with pytest.raises(ConfigError, match="No available memory"):
        pool.register_worker(1, 2, {"l0": SPEC}, page)
    assert pool.registrations == {}
    assert (pool.failed_plans, pool.state) == (1, PoolState.PENDING_WORKERS)
    # A new round; too many blocks fails it too (before any block is built).
    pool.register_worker(1, 2, {"l0": SPEC}, 1 << 62)
    assert list(pool.registrations) == [1]
    with pytest.raises(ResourceExhaustedError, match="max_blocks_per_pool"):
        pool.register_worker(0, 2, {"l0": SPEC}, 1 << 62, limits=Limits())
    assert pool.failed_plans == 2
    assert pool.registrations == {}


def test_registry_creates_lists_and_deletes() -> None:
    registry = PoolRegistry(max_pools=2)
    registry.create("b", PoolConfig(max_model_len=64, explicit_layout=LAYOUT))
    registry.create("a", PoolConfig(max_model_len=64, explicit_layout=LAYOUT))
    assert [pool.name for pool in registry.list()] == ["a", "b"]
    with pytest.raises(AlreadyExistsError):
        registry.create("a", PoolConfig(max_model_len=64, explicit_layout=LAYOUT))
    with pytest.raises(ResourceExhaustedError):
        registry.create("c", PoolConfig(max_model_len=64, explicit_layout=LAYOUT))
    assert registry.delete("a").name == "a"
    with pytest.raises(NotFoundError, match="'a'"):
        registry.get("a")
    assert len(registry) == 1


def test_verified_hashes_must_be_the_servers() -> None:
    pool = _pool(verify_block_hashes=True)
    prompt = list(range(32))
    with pytest.raises(InvalidArgumentError, match="differ"):
        pool.add_request(1, "r1", prompt, b"z" * 64)
    assert pool.requests == {}
    pool.add_request(1, "r1", prompt, _hashes(pool, prompt))
    more = list(range(100, 116))
    with pytest.raises(InvalidArgumentError, match="differ"):
        pool.append_tokens(1, more, b"z" * 32)
    assert pool.request(1).num_tokens == 32
    pool.append_tokens(1, more, _hashes(pool, prompt + more)[64:])
    assert len(pool.request(1).block_hashes) == 3


def test_event_log_keeps_the_newest_when_one_batch_exceeds_retention() -> None:
    log = EventLog(retention=3)
    removed = [BlockRemoved(block_hashes=[n], medium=None) for n in range(1, 6)]
    assert log.check_start(None) == 1
    assert log.append(removed, 7.0) == 5
    assert (log.oldest_sequence, log.last_sequence, log.next_sequence) == (3, 5, 6)
    got = log.read(3, 10)
    assert got is not None
    assert [event.block_hashes for event in got[0]] == [[3], [4], [5]]  # type: ignore[union-attr]
    assert got[1] == 7.0
    assert log.read(4, 1) == ([removed[3]], 7.0)
    assert log.read(2, 10) is None
    with pytest.raises(OutOfRangeError):
        log.check_start(2)
    assert log.check_start(6) == 6
    assert log.read(6, 10) == ([], 0.0)
    log.append([AllBlocksCleared()], 8.0)
    assert log.read(6, 10) == ([AllBlocksCleared()], 8.0)
    assert log.oldest_sequence == 4
