"""The collector turns snapshots into the declared families, parsable by Prometheus' parser.

The input here is a hand-built snapshot with the core's field names, so the families can be
checked value by value without a server; tests/integration/test_http.py reads real pools.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcm.server.http import METRICS, KVCMCollector
from kvcm.server.telemetry import RpcStats


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    name: str
    state: str = "READY"
    world_size: int = 2
    registered_workers: int = 1
    num_blocks: int = 100
    num_free_blocks: int = 60
    num_cached_blocks: int = 25
    usage: float = 0.4
    groups: tuple[tuple[int, str, int, int], ...] = ((0, "full_attention", 16, 30),)
    num_requests: int = 3
    requests: int = 10
    queries: int = 1600
    hits: int = 400
    preempted_requests: int = 1
    preempted_queries: int = 160
    preempted_hits: int = 150
    recent_hit_rate: float = 0.25
    evicted_blocks_total: int = 7
    events_emitted_total: int = 42
    allocations_not_fit_total: int = 2
    epoch: int = 1
    last_step_seq: int = 0
    scheduler_lease_s: float = 0.0
    host_tier_blocks: int = 64
    host_tier_used_blocks: int = 48
    host_tier_hit_tokens: int = 320
    host_tier_demoted_blocks: int = 30
    host_tier_loaded_blocks: int = 20
    host_tier_evicted_blocks: int = 5
    host_tier_swap_outs: int = 3
    host_tier_swap_ins: int = 2


class Pool:
    def __init__(self, snapshot: Snapshot, *, lent: bool = False) -> None:
        self._snapshot = snapshot
        self.name = snapshot.name
        self.lent = lent

    def snapshot(self) -> Snapshot:
        return self._snapshot


class Registry:
    def __init__(self, *snapshots: Snapshot) -> None:
        self.pools = [Pool(s) for s in snapshots]

    def list(self) -> list[Pool]:
        return self.pools

    def get(self, name: str) -> Pool:
        raise AssertionError(name)


def _samples(
    registry: Registry, stats: RpcStats
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    prometheus = CollectorRegistry(auto_describe=False)
    prometheus.register(KVCMCollector(registry, stats))
    text = generate_latest(prometheus).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_pool_snapshot_fields_become_series_per_pool() -> None:
    samples = _samples(Registry(Snapshot(name="a"), Snapshot(name="b", hits=0)), RpcStats())
    a = frozenset({("pool", "a")})
    assert samples["kvcm_prefix_cache_queries_total", a] == 1600
    assert samples["kvcm_prefix_cache_hits_total", a] == 400
    assert samples["kvcm_prefix_cache_hits_total", frozenset({("pool", "b")})] == 0
    assert samples["kvcm_prefix_cache_preempted_hits_total", a] == 150
    assert samples["kvcm_prefix_cache_recent_hit_rate", a] == 0.25
    assert samples["kvcm_kv_cache_usage_ratio", a] == 0.4
    assert samples["kvcm_blocks", a] == 100
    assert samples["kvcm_free_blocks", a] == 60
    assert samples["kvcm_cached_blocks", a] == 25
    assert samples["kvcm_evicted_blocks_total", a] == 7
    assert samples["kvcm_kv_events_emitted_total", a] == 42
    assert samples["kvcm_allocations_not_fit_total", a] == 2
    assert samples["kvcm_registered_workers", a] == 1
    assert samples["kvcm_pool_world_size", a] == 2
    assert samples["kvcm_host_tier_blocks", a] == 64
    assert samples["kvcm_host_tier_used_blocks", a] == 48
    assert samples["kvcm_host_tier_hit_tokens_total", a] == 320
    assert samples["kvcm_host_tier_demoted_blocks_total", a] == 30
    assert samples["kvcm_host_tier_loaded_blocks_total", a] == 20
    assert samples["kvcm_host_tier_evicted_blocks_total", a] == 5
    assert samples["kvcm_host_tier_swap_outs_total", a] == 3
    assert samples["kvcm_host_tier_swap_ins_total", a] == 2
    assert samples["kvcm_pool_info", a | {("state", "READY")}] == 1
    group = a | {
        ("group", "0"),
        ("kind", "full_attention"),
        ("block_size", "16"),
        ("num_layers", "30"),
    }
    assert samples["kvcm_kv_cache_group_info", group] == 1


def test_rpc_stats_become_a_histogram_and_a_counter() -> None:
    stats = RpcStats(buckets=(0.001, 0.01))
    stats.observe("Step", "OK", 0.0005)
    stats.observe("Step", "OK", 0.005)
    stats.observe("Step", "INVALID_ARGUMENT", 0.02)
    samples = _samples(Registry(), stats)
    step = frozenset({("method", "Step")})
    assert samples["kvcm_rpc_duration_seconds_bucket", step | {("le", "0.001")}] == 1
    assert samples["kvcm_rpc_duration_seconds_bucket", step | {("le", "0.01")}] == 2
    assert samples["kvcm_rpc_duration_seconds_bucket", step | {("le", "+Inf")}] == 3
    assert samples["kvcm_rpc_duration_seconds_count", step] == 3
    assert abs(samples["kvcm_rpc_duration_seconds_sum", step] - 0.0255) < 1e-12
    assert samples["kvcm_rpc_requests_total", step | {("code", "OK")}] == 2
    assert samples["kvcm_rpc_requests_total", step | {("code", "INVALID_ARGUMENT")}] == 1


def test_only_declared_families_are_emitted_and_all_of_them_are() -> None:
    prometheus = CollectorRegistry(auto_describe=False)
    prometheus.register(KVCMCollector(Registry(Snapshot(name="a")), RpcStats()))
    text = generate_latest(prometheus).decode()
    emitted = {family.name for family in text_string_to_metric_families(text)}
    assert emitted == {spec.name.removesuffix("_total") for spec in METRICS}
    build = [line for line in text.splitlines() if line.startswith("kvcm_build_info{")]
    assert len(build) == 1
    assert 'version="' in build[0]


def test_describe_names_every_metric_without_reading_pools() -> None:
    class Exploding(Registry):
        def list(self) -> list[Pool]:
            raise AssertionError("describe must not read pools")

    collector = KVCMCollector(Exploding(), RpcStats())
    described = {family.name for family in collector.describe()}
    assert described == {spec.name.removesuffix("_total") for spec in METRICS}
