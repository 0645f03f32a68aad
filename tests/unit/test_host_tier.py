"""The host tier (kvcm.core.host_tier): demotion, host hits, swaps, events, through real Pools."""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError
from kvcm.common.events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored
from kvcm.common.hashing import BlockHash, BlockHasher, make_block_hash_with_group_id
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.host_tier import HIT, MISS, PENDING, HostTier
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import HitSpec
from kvcm.core.request import RequestStatus

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
BLOCK_BYTES = SPEC.page_size_bytes  # one layer
LAYOUT = KVCacheConfig(
    num_blocks=16,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)


def _pool(host_blocks: int, **overrides: object) -> Pool:
    options = {
        "max_model_len": 512,
        "explicit_layout": LAYOUT,
        "host_tier_bytes": host_blocks * BLOCK_BYTES + BLOCK_BYTES // 2,  # rounds down
        **overrides,
    }
    return Pool("p", PoolConfig(**options))  # type: ignore[arg-type]


def _add(pool: Pool, key: int, tokens: list[int]) -> None:
    hasher = BlockHasher(pool.hashing.hash_block_size, pool.hashing.algorithm, pool.hashing.seed)
    pool.add_request(key, f"r{key}", tokens, b"".join(hasher.hash_token_ids(tokens)))


def _run(pool: Pool, key: int, tokens: list[int]) -> list[int]:
    """Admit a request for all its tokens (device hit only), as a plain pool does."""
    _add(pool, key, tokens)
    ids = pool.allocate(key, len(tokens), 0)
    assert ids is not None
    return ids[0]


def _flood(pool: Pool, key: int, num_blocks: int, base: int) -> None:
    # A request of fresh tokens taking num_blocks blocks, then finished: evicts cached blocks.
    _run(pool, key, [base + i for i in range(num_blocks * 16)])
    pool.free(key, preempt=False)


def test_off_by_default_and_the_budget_is_checked() -> None:
    pool = Pool("p", PoolConfig(max_model_len=256, explicit_layout=LAYOUT))
    assert pool.host_tier is None
    assert pool.manager is not None
    assert pool.manager.block_pool.demote is None
    with pytest.raises(FailedPreconditionError, match="no host tier"):
        pool.take_host_copies()
    with pytest.raises(InvalidArgumentError) as info:
        PoolConfig(max_model_len=256, explicit_layout=LAYOUT, host_tier_bytes=-1)
    assert info.value.field == "config.host_tier_bytes"
    host = _pool(3).host_tier
    assert host is not None
    assert host.num_blocks == 3
    assert host.block_bytes == BLOCK_BYTES


def test_evicted_blocks_demote_and_a_later_request_loads_them_back() -> None:
    pool = _pool(32)
    host = pool.host_tier
    assert host is not None
    prompt = list(range(1000, 1064))  # four full blocks
    first_ids = _run(pool, 1, prompt)
    pool.free(1, preempt=False)
    _flood(pool, 2, 15, 5000)  # every usable block: all four cached blocks are reused
    d2h, h2d = pool.take_host_copies()
    assert h2d == []
    # The four blocks went to host blocks 0..3 in eviction order (the tail first: vLLM frees
    # a request's blocks tail first, so its tail is evicted first).
    assert sorted(device for device, _ in d2h) == sorted(first_ids)
    assert [host_id for _, host_id in d2h] == [0, 1, 2, 3]
    assert host.stats().demotions == 4
    assert host.stats().num_used == 4

    _add(pool, 3, [*prompt, *range(7000, 7016)])
    hit, num_host = pool.lookup_tiers(3)
    assert (hit.num_computed_tokens, num_host) == (0, 64)
    admission = pool.admit_with_host(3, 16)
    assert admission is not None
    assert (admission.num_device_hit_tokens, admission.num_host_hit_tokens) == (0, 64)
    table = pool.manager.get_block_ids("3")[0]  # type: ignore[union-attr]
    keys_by_host = {host_id: device for device, host_id in d2h}
    # Each of the prompt's blocks is loaded from the host block its key went to.
    assert len(admission.host_to_device) == 4
    for position, (host_id, device) in enumerate(admission.host_to_device):
        assert device == table[position]
        assert first_ids.index(keys_by_host[host_id]) == position
    # Its five new device blocks evicted five of the flood's cached blocks: demoted in the
    # same step, so the workers copy them out before the loads write into them.
    d2h_now, h2d_now = pool.take_host_copies()
    assert h2d_now == admission.host_to_device
    assert len(d2h_now) == 5
    assert {device for device, _ in d2h_now} == set(table)
    request = pool.request(3)
    assert request.status is RequestStatus.RUNNING
    assert request.num_computed_tokens == 64
    # The loaded blocks are cached on the device again; the host keeps its copies (inclusive).
    blocks = pool.manager.block_pool.blocks  # type: ignore[union-attr]
    assert all(blocks[device].block_hash is not None for device in table)
    assert host.stats().num_used == 9
    assert host.stats().hit_tokens == 64


def test_a_full_tier_evicts_least_recently_used_and_events_carry_the_medium() -> None:
    pool = _pool(2, enable_kv_cache_events=True)
    host = pool.host_tier
    assert host is not None
    _run(pool, 1, list(range(64)))  # four blocks
    pool.free(1, preempt=False)
    pool.publish_events(0.0)
    _flood(pool, 2, 15, 5000)
    pool.publish_events(1.0)
    events = [event for event, _ in pool.event_log_contents()]
    cpu = [e for e in events if e.medium == MEDIUM_CPU]
    gpu_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_GPU]
    assert len(gpu_removed) == 4
    stored = [e for e in cpu if isinstance(e, BlockStored)]
    removed = [e for e in cpu if isinstance(e, BlockRemoved)]
    assert len(stored) == 4
    assert len(removed) == 2
    # The two demoted first were evicted from the host: the two kept are the last two.
    kept = {make_block_hash_with_group_id(BlockHash(e.block_hashes[0]), 0) for e in stored[2:]}
    assert set(host.keys()) == kept
    assert host.lru_keys() == [
        make_block_hash_with_group_id(BlockHash(e.block_hashes[0]), 0) for e in stored[2:]
    ]
    assert all(e.token_ids == [] and e.group_idx == 0 for e in stored)
    assert host.stats().evictions == 2


def test_the_device_path_decides_as_without_a_tier() -> None:
    def trace(pool: Pool) -> list[object]:
        out: list[object] = []
        for round_ in range(6):
            for key in range(3):
                k = round_ * 3 + key + 1
                tokens = [key * 100 + i for i in range(16 * (1 + (round_ + key) % 5))]
                _add(pool, k, tokens)
                out.append(pool.allocate(k, len(tokens), 0))
            for key in range(3):
                pool.free(round_ * 3 + key + 1, preempt=False)
        pool.publish_events(0.0)
        out.append([e for e, _ in pool.event_log_contents() if e.medium == MEDIUM_GPU])
        return out

    with_tier = _pool(4, enable_kv_cache_events=True)
    without = _pool(0, enable_kv_cache_events=True)
    assert without.host_tier is None
    assert trace(with_tier) == trace(without)
    assert with_tier.host_tier is not None
    assert with_tier.host_tier.stats().demotions > 0


def test_swap_out_and_in_copy_every_block_back() -> None:
    pool = _pool(8)
    host = pool.host_tier
    assert host is not None
    tokens = list(range(40))  # two full blocks and a partial one
    ids = _run(pool, 1, tokens)
    pool.request(1).num_computed_tokens = 40
    copies = pool.swap_out(1)
    assert copies is not None
    assert [device for device, _ in copies] == ids
    assert pool.request(1).status is RequestStatus.PREEMPTED
    assert not pool.manager.holds_blocks("1")  # type: ignore[union-attr]
    assert host.stats().num_pinned == 3
    assert host.swapped_tokens("1") == 40
    with pytest.raises(FailedPreconditionError):
        pool.swap_out(1)  # holds no blocks now
    # The two full blocks are still cached on the device: only the partial one is copied back.
    admission = pool.swap_in(1, 1)
    assert admission is not None
    assert (admission.num_device_hit_tokens, admission.num_host_hit_tokens) == (32, 8)
    table = pool.manager.get_block_ids("1")[0]  # type: ignore[union-attr]
    assert admission.host_to_device == [(copies[2][1], table[2])]
    assert host.stats().num_pinned == 0
    assert host.swapped_tokens("1") is None
    assert pool.request(1).num_computed_tokens == 40
    with pytest.raises(FailedPreconditionError, match="not swapped"):
        pool.swap_in(1, 1)


def test_swap_in_after_device_eviction_copies_all_and_finish_releases() -> None:
    pool = _pool(8)
    host = pool.host_tier
    assert host is not None
    _run(pool, 1, list(range(40)))
    pool.request(1).num_computed_tokens = 40
    out = pool.swap_out(1)
    assert out is not None
    _flood(pool, 2, 15, 5000)  # the device loses the two cached blocks (already in the tier)
    assert host.stats().demotions_present == 2
    assert host.stats().demotions == 0
    admission = pool.swap_in(1, 1)
    assert admission is not None
    assert admission.num_host_hit_tokens == 40
    assert [h for h, _ in admission.host_to_device] == [h for _, h in out]
    # A swapped request that finishes releases its host blocks.
    pool.request(1).num_computed_tokens = 41
    _run(pool, 3, list(range(9000, 9016)))
    pool.request(3).num_computed_tokens = 16
    assert pool.swap_out(3) is not None
    pool.free(3, preempt=False)
    assert host.stats().num_pinned == 0
    assert host.swapped() == {}


def test_a_tier_without_room_refuses_a_swap_and_changes_nothing() -> None:
    pool = _pool(1)
    _run(pool, 1, list(range(40)))
    pool.request(1).num_computed_tokens = 40
    before = pool.state_fingerprint()
    assert pool.swap_out(1) is None
    assert pool.state_fingerprint() == before
    assert pool.manager.holds_blocks("1")  # type: ignore[union-attr]


def test_pending_stores_pins_and_bad_input() -> None:
    host = HostTier(2, enable_events=True)
    a, b, c = (make_block_hash_with_group_id(BlockHash(bytes([i]) * 32), 0) for i in range(3))
    stored = host.store([a, b], ready=False)
    assert stored == ([a, b], [0, 1], [])
    assert host.lookup(a) == PENDING
    assert host.lookup(c) == MISS
    assert host.store([c]) is None  # nothing evictable: pending blocks are not
    host.complete_store([a], success=True)
    host.complete_store([b], success=False)
    assert host.lookup(a) == HIT
    assert host.lookup(b) == MISS
    assert host.num_free == 1
    assert host.pin([a]) == [0]
    assert host.store([b, c]) is None  # a is pinned
    with pytest.raises(FailedPreconditionError):
        host.pin([b])
    with pytest.raises(FailedPreconditionError):
        host.unpin([a, a])  # pinned once: nothing changes
    host.unpin([a])
    with pytest.raises(FailedPreconditionError):
        host.unpin([a])
    assert host.store([b, c]) == ([b, c], [1, 0], [a])
    events = host.take_events()
    # a stored on completion (b's failed store was never announced), then b, then c over a.
    assert [(type(e).__name__, e.block_hashes[0][0]) for e in events] == [
        ("BlockStored", 0),
        ("BlockStored", 1),
        ("BlockRemoved", 0),
        ("BlockStored", 2),
    ]
    assert all(e.medium == MEDIUM_CPU for e in events)
    with pytest.raises(InvalidArgumentError):
        HostTier(-1)
    assert host.reset()
    assert host.keys() == {}
    assert host.num_free == 2


def test_a_host_hit_the_tier_does_not_hold_is_refused_before_any_change() -> None:
    pool = _pool(32)
    prompt = list(range(1000, 1064))
    _run(pool, 1, prompt)
    pool.free(1, preempt=False)
    _flood(pool, 2, 15, 5000)
    _add(pool, 3, [*prompt, *range(7000, 7016)])
    hit, num_host = pool.lookup_tiers(3)
    assert num_host == 64
    before = pool.state_fingerprint()
    for bad in (80, 40):  # past what the tier holds; not whole blocks
        with pytest.raises(InvalidArgumentError) as info:
            pool.admit_with_host(3, 80 - bad, looked_up=(hit, bad))
        assert info.value.field == "num_host_hit_tokens"
    assert pool.state_fingerprint() == before
    admission = pool.admit_with_host(3, 16, looked_up=(hit, num_host))
    assert admission is not None
    assert admission.num_host_hit_tokens == 64


def test_the_servers_metrics_read_the_tier() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvcm.core.pool import PoolRegistry
    from kvcm.server.http import KVCMCollector
    from kvcm.server.telemetry import RpcStats

    registry = PoolRegistry()
    pool = registry.create(
        "p",
        PoolConfig(max_model_len=512, explicit_layout=LAYOUT, host_tier_bytes=32 * BLOCK_BYTES),
    )
    registry.create("plain", PoolConfig(max_model_len=512, explicit_layout=LAYOUT))
    prompt = list(range(1000, 1064))
    _run(pool, 1, prompt)
    pool.free(1, preempt=False)
    _flood(pool, 2, 15, 5000)
    _add(pool, 3, [*prompt, *range(7000, 7016)])
    assert pool.admit_with_host(3, 16) is not None
    pool.request(3).num_computed_tokens = 80
    assert pool.swap_out(3) is not None
    prometheus = CollectorRegistry(auto_describe=False)
    prometheus.register(KVCMCollector(registry, RpcStats()))
    text = generate_latest(prometheus).decode()
    samples = {
        (s.name, s.labels["pool"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvcm_host_tier")
    }
    stats = pool.host_tier.stats()  # type: ignore[union-attr]
    assert samples["kvcm_host_tier_blocks", "p"] == 32
    assert samples["kvcm_host_tier_used_blocks", "p"] == stats.num_used
    assert samples["kvcm_host_tier_hit_tokens_total", "p"] == 64
    assert samples["kvcm_host_tier_demoted_blocks_total", "p"] == stats.demotions
    assert samples["kvcm_host_tier_loaded_blocks_total", "p"] == 4
    assert samples["kvcm_host_tier_swap_outs_total", "p"] == 1
    assert samples["kvcm_host_tier_swap_ins_total", "p"] == 0
    assert samples["kvcm_host_tier_blocks", "plain"] == 0
    assert samples["kvcm_host_tier_demoted_blocks_total", "plain"] == 0


def test_a_lookup_across_pools_reports_hits_per_tier() -> None:
    from kvcm.core.lookup import LookupQuery
    from kvcm.core.pool import PoolRegistry

    registry = PoolRegistry()
    tiered = registry.create(
        "tiered",
        PoolConfig(max_model_len=512, explicit_layout=LAYOUT, host_tier_bytes=32 * BLOCK_BYTES),
    )
    plain = registry.create("plain", PoolConfig(max_model_len=512, explicit_layout=LAYOUT))
    prompt = list(range(1000, 1064))
    for pool in (tiered, plain):
        _run(pool, 1, prompt)
        pool.free(1, preempt=False)
    # The tiered pool loses the last two blocks from the device (demoted), keeps the first two.
    head = tiered.manager.block_pool  # type: ignore[union-attr]
    _flood(tiered, 2, 13, 5000)
    assert head.num_cached_blocks == 15
    answer = registry.lookup(LookupQuery(token_ids=[*prompt, 7]))
    hits = {hit.pool_id: hit for hit in answer.pools}
    device = hits["tiered"].num_hit_tokens
    assert device == 32
    assert dict(hits["tiered"].tier_hit_tokens) == {"GPU": 32, "CPU": 32}
    assert dict(hits["plain"].tier_hit_tokens) == {"GPU": 64}
    # What the lookup answers is what admitting the request finds.
    _add(tiered, 3, [*prompt, 7])
    hit, num_host = tiered.lookup_tiers(3)
    assert (hit.num_computed_tokens, num_host) == (32, 32)


def test_a_group_sharing_a_prefix_swaps_out_together_or_not_at_all() -> None:
    def group_pool(host_blocks: int) -> Pool:
        pool = _pool(host_blocks)
        prefix = list(range(32))  # two full blocks the two requests share
        _run(pool, 1, [*prefix, 100, 101, 102])
        _add(pool, 2, [*prefix, 200, 201, 202, 203])
        hit = pool.get_computed_blocks(2, None)
        assert hit.num_computed_tokens == 32
        spec = HitSpec(num_tokens=32, block_ids=hit.blocks.get_block_ids())
        ids = pool.allocate(2, 4, 32, hit=spec)
        assert ids is not None
        pool.request(1).num_computed_tokens = 35
        pool.request(2).num_computed_tokens = 36
        return pool

    small = group_pool(3)  # the group needs 4: 2 shared blocks once, 2 partial ones
    before = small.state_fingerprint()
    assert small.swap_out_group([1, 2]) is None
    assert small.state_fingerprint() == before
    assert small.host_tier is not None
    assert small.host_tier.stats().num_used == 0

    pool = group_pool(4)
    tables = [pool.manager.get_block_ids(str(k))[0] for k in (1, 2)]  # type: ignore[union-attr]
    assert tables[0][:2] == tables[1][:2]
    out = pool.swap_out_group([1, 2])
    assert out is not None
    assert [d for d, _ in out[1]] == tables[0]
    assert [d for d, _ in out[2]] == [tables[1][2]]  # the shared blocks were copied once
    host = pool.host_tier
    assert host is not None
    assert host.stats().num_used == 4
    assert sorted(host.pinned().values()) == [1, 1, 2, 2]
    for key in (1, 2):
        assert pool.request(key).status is RequestStatus.PREEMPTED
        admission = pool.swap_in(key, 1)
        assert admission is not None
    assert host.pinned() == {}
    with pytest.raises(FailedPreconditionError, match="twice"):
        host.swap_out_group([("a", [], 0), ("a", [], 0)])


def test_a_device_prefix_cache_reset_keeps_the_tier_as_vllm_keeps_its_connector() -> None:
    # vLLM's KVCacheManager.reset_prefix_cache clears the device cache only; the offloading
    # connector's store is cleared by the scheduler's reset_connector_cache (reset_connector
    # =True), which kvcm's offloading manager answers with HostTier.clear().
    pool = _pool(8, enable_kv_cache_events=True)
    host = pool.host_tier
    assert host is not None
    prompt = list(range(64))
    _run(pool, 1, prompt)
    pool.free(1, preempt=False)
    _flood(pool, 2, 15, 5000)  # the prompt's four blocks are demoted
    kept = host.keys()
    assert len(kept) == 4
    pool.publish_events(0.0)
    assert pool.reset_prefix_cache()
    assert host.keys() == kept  # nothing demoted by the reset, nothing dropped
    pool.publish_events(1.0)
    last = [event for event, now in pool.event_log_contents() if now == 1.0]
    assert last
    assert all(getattr(event, "medium", None) != MEDIUM_CPU for event in last)
    _add(pool, 3, [*prompt, 7])
    hit, num_host = pool.lookup_tiers(3)
    assert (hit.num_computed_tokens, num_host) == (0, 64)
    host.clear()  # the connector's reset
    assert host.keys() == {}
    assert pool.lookup_tiers(3)[1] == 0
