"""The Prometheus collector: pool state and RPC statistics turned into metric families.

Nothing here runs on the hot path. The gRPC side mutates pools and bumps :class:`RpcStats`
counters in plain Python; this collector reads a snapshot of each pool and of the RPC stats only
when ``/metrics`` is scraped. The scrape handler runs on the server's event loop, so a snapshot is
never taken in the middle of an RPC's mutation.

Every metric kvcm exports is declared once in :data:`METRICS`; the collector refuses to emit a
family that is not declared there, and ``docs/metrics.md`` documents exactly this list.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvcm.common.errors import NotFoundError
from kvcm.server.http._views import PoolReader, PoolRegistryLike, PoolSnapshotLike
from kvcm.server.telemetry import (
    LoopLagMonitor,
    LoopLagSnapshot,
    RpcStats,
    RpcStatsSnapshot,
    StepProgressBook,
)

if TYPE_CHECKING:
    from kvcm.server.kv_events import KvEventCounters

__all__ = [
    "METRICS",
    "KVCMCollector",
    "MetricSpec",
    "kvcm_version",
    "loop_lag_family",
    "pool_families",
    "rpc_families",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One exported metric family.

    Attributes:
        name: the family name as it appears in the exposition, ``_total`` included for
            counters (the histogram's series add ``_bucket``, ``_sum`` and ``_count``).
        kind: ``"counter"``, ``"gauge"`` or ``"histogram"``.
        labels: the label names, in order.
        help: the HELP text.
    """

    name: str
    kind: str
    labels: tuple[str, ...]
    help: str


_POOL = ("pool",)
_PD_ROUTE_METRICS = (
    "kvcm_pd_routes_total",
    "kvcm_pd_route_prompt_tokens_total",
    "kvcm_pd_route_decode_hit_tokens_total",
    "kvcm_pd_route_prefill_computed_tokens_total",
    "kvcm_pd_route_remote_tokens_total",
)
_CLUSTER_METRICS = (
    "kvcm_cluster_etcd_session_up",
    "kvcm_cluster_etcd_session_losses_total",
    "kvcm_cluster_replicas",
    "kvcm_cluster_primary_pools",
    "kvcm_cluster_redirects_total",
    "kvcm_cluster_placement_changes_total",
    "kvcm_cluster_placement_failures_total",
    "kvcm_cluster_fanout_missed_total",
    "kvcm_cluster_standby_replacements_total",
    "kvcm_cluster_deleted_pools_dropped_total",
)
_REPLICATION_METRICS = (
    "kvcm_replication_role",
    "kvcm_replication_lag_records",
    "kvcm_replication_lag_seconds",
    "kvcm_replication_seeds_total",
    "kvcm_replication_digest_mismatches_total",
    "kvcm_replication_promotions_total",
    "kvcm_replication_stepdowns_total",
)
_TRANSFER_METRICS = (
    "kvcm_transfers_started_total",
    "kvcm_transfers_completed_total",
    "kvcm_transfers_expired_total",
    "kvcm_transfers_failed_total",
    "kvcm_transfer_blocks_pulled_total",
    "kvcm_transfer_blocks_saved_total",
    "kvcm_transfers_in_flight",
    "kvcm_transfers_past_lease",
    "kvcm_transfer_oldest_source_age_seconds",
)
_LOOKUP_PORT_METRICS = (
    "kvcm_lookup_port_connections",
    "kvcm_lookup_port_closed_total",
    "kvcm_lookup_port_requests_total",
)
_JOURNAL_METRICS = (
    "kvcm_journal_records_total",
    "kvcm_journal_fsyncs_total",
    "kvcm_journal_failures_total",
    "kvcm_journal_records_since_checkpoint",
    "kvcm_journal_pending_changes",
)


class JournalStatsLike(Protocol):
    """What the collector reads of the journal (``kvcm.server.journal.Journal``)."""

    num_records: int
    num_fsyncs: int
    num_failures: int
    records_since_checkpoint: int

    @property
    def pending_changes(self) -> int:
        """Records of changes already made waiting for the disk."""


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        name="kvcm_prefix_cache_requests_total",
        kind="counter",
        labels=_POOL,
        help="Requests that looked up the prefix cache (first scheduling, not preempted).",
    ),
    MetricSpec(
        name="kvcm_prefix_cache_queries_total",
        kind="counter",
        labels=_POOL,
        help="Prefix cache queries, in tokens looked up (requests not preempted before).",
    ),
    MetricSpec(
        name="kvcm_prefix_cache_hits_total",
        kind="counter",
        labels=_POOL,
        help="Prefix cache hits, in tokens found cached (requests not preempted before).",
    ),
    MetricSpec(
        name="kvcm_prefix_cache_preempted_requests_total",
        kind="counter",
        labels=_POOL,
        help="Previously preempted requests that looked up the prefix cache again.",
    ),
    MetricSpec(
        name="kvcm_prefix_cache_preempted_queries_total",
        kind="counter",
        labels=_POOL,
        help="Prefix cache queries of previously preempted requests, in tokens.",
    ),
    MetricSpec(
        name="kvcm_prefix_cache_preempted_hits_total",
        kind="counter",
        labels=_POOL,
        help="Prefix cache hits of previously preempted requests, in tokens.",
    ),
    MetricSpec(
        name="kvcm_prefix_cache_recent_hit_rate",
        kind="gauge",
        labels=_POOL,
        help="Prefix cache hit rate (hit tokens / queried tokens, 0..1) over the most recent "
        "requests; 0 before any request.",
    ),
    MetricSpec(
        name="kvcm_kv_cache_usage_ratio",
        kind="gauge",
        labels=_POOL,
        help="Fraction of the pool's KV-cache blocks in use (0..1).",
    ),
    MetricSpec(
        name="kvcm_blocks",
        kind="gauge",
        labels=_POOL,
        help="KV-cache blocks in the pool (0 until every worker has registered).",
    ),
    MetricSpec(
        name="kvcm_free_blocks",
        kind="gauge",
        labels=_POOL,
        help="KV-cache blocks not held by any request (cached ones included).",
    ),
    MetricSpec(
        name="kvcm_cached_blocks",
        kind="gauge",
        labels=_POOL,
        help="KV-cache blocks that hold a prefix-cache entry.",
    ),
    MetricSpec(
        name="kvcm_running_requests",
        kind="gauge",
        labels=_POOL,
        help="Requests that currently hold blocks in the pool.",
    ),
    MetricSpec(
        name="kvcm_evicted_blocks_total",
        kind="counter",
        labels=_POOL,
        help="Cached blocks whose prefix-cache entry was evicted to make room.",
    ),
    MetricSpec(
        name="kvcm_kv_events_emitted_total",
        kind="counter",
        labels=_POOL,
        help="KV-cache events (block stored, block removed, all cleared) emitted.",
    ),
    MetricSpec(
        name="kvcm_allocations_not_fit_total",
        kind="counter",
        labels=_POOL,
        help="Slot allocations answered 'does not fit' for lack of free blocks.",
    ),
    MetricSpec(
        name="kvcm_registered_workers",
        kind="gauge",
        labels=_POOL,
        help="Worker ranks registered with the pool.",
    ),
    MetricSpec(
        name="kvcm_pool_world_size",
        kind="gauge",
        labels=_POOL,
        help="Worker ranks the pool expects (tensor x pipeline parallel size).",
    ),
    MetricSpec(
        name="kvcm_host_tier_blocks",
        kind="gauge",
        labels=_POOL,
        help="Host blocks in the pool's host tier (0: no host tier).",
    ),
    MetricSpec(
        name="kvcm_host_tier_used_blocks",
        kind="gauge",
        labels=_POOL,
        help="Host blocks holding a key or a swapped request's block.",
    ),
    MetricSpec(
        name="kvcm_host_tier_hit_tokens_total",
        kind="counter",
        labels=_POOL,
        help="Prompt tokens admitted from the host tier, after their device hit.",
    ),
    MetricSpec(
        name="kvcm_host_tier_demoted_blocks_total",
        kind="counter",
        labels=_POOL,
        help="Evicted device blocks copied to the host tier (device-to-host copies).",
    ),
    MetricSpec(
        name="kvcm_host_tier_loaded_blocks_total",
        kind="counter",
        labels=_POOL,
        help="Host blocks copied to the device for host hits (host-to-device copies).",
    ),
    MetricSpec(
        name="kvcm_host_tier_evicted_blocks_total",
        kind="counter",
        labels=_POOL,
        help="Host blocks evicted from the host tier to make room.",
    ),
    MetricSpec(
        name="kvcm_host_tier_swap_outs_total",
        kind="counter",
        labels=_POOL,
        help="Preempted requests whose blocks were swapped out to the host tier.",
    ),
    MetricSpec(
        name="kvcm_host_tier_swap_ins_total",
        kind="counter",
        labels=_POOL,
        help="Swapped requests whose blocks were copied back to the device.",
    ),
    MetricSpec(
        name="kvcm_pool_info",
        kind="gauge",
        labels=("pool", "state"),
        help="Always 1; the pool's lifecycle state is in the state label.",
    ),
    MetricSpec(
        name="kvcm_kv_cache_group_info",
        kind="gauge",
        labels=("pool", "group", "kind", "block_size", "num_layers"),
        help="Always 1; one series per KV-cache group with its attention kind, block size in "
        "tokens and layer count.",
    ),
    MetricSpec(
        name="kvcm_pool_last_step_seq",
        kind="gauge",
        labels=_POOL,
        help="step_seq of the last Step applied to the pool (the newest step a coalesced Step "
        "carried).",
    ),
    MetricSpec(
        name="kvcm_pool_last_step_age_seconds",
        kind="gauge",
        labels=_POOL,
        help="Seconds since the pool's scheduler closed the last applied step (its age when "
        "sent plus the time since it was applied).",
    ),
    MetricSpec(
        name="kvcm_pool_steps_behind",
        kind="gauge",
        labels=_POOL,
        help="Steps the pool's scheduler had closed beyond the last applied one when it sent it.",
    ),
    MetricSpec(
        name="kvcm_lease_reclaims_total",
        kind="counter",
        labels=("pool", "kind"),
        help="Expired leases whose holder's leftovers were reclaimed (kind: scheduler, "
        "transfer, subscriber).",
    ),
    MetricSpec(
        name="kvcm_journal_records_total",
        kind="counter",
        labels=(),
        help="Records written to the data directory's journal since the server started.",
    ),
    MetricSpec(
        name="kvcm_journal_fsyncs_total",
        kind="counter",
        labels=(),
        help="fsyncs of the journal (each makes every record written before it durable).",
    ),
    MetricSpec(
        name="kvcm_journal_failures_total",
        kind="counter",
        labels=(),
        help="Journal writes and fsyncs the disk refused (full, failing); the calls waiting "
        "on each answered UNAVAILABLE having changed nothing.",
    ),
    MetricSpec(
        name="kvcm_journal_records_since_checkpoint",
        kind="gauge",
        labels=(),
        help="Records the journal holds after the last checkpoint (replayed at a restart).",
    ),
    MetricSpec(
        name="kvcm_journal_pending_changes",
        kind="gauge",
        labels=(),
        help="Records of changes already made (lease reclaims, planning rounds) kept in "
        "memory until the disk takes them.",
    ),
    MetricSpec(
        name="kvcm_zmq_event_batches_total",
        kind="counter",
        labels=("kind",),
        help="KV-event batches of the ZMQ stream (kind: sent, dropped for a full queue, "
        "replayed to a subscriber).",
    ),
    MetricSpec(
        name="kvcm_zmq_event_peers",
        kind="gauge",
        labels=(),
        help="Peers the ZMQ KV-event PUB socket is connected to.",
    ),
    MetricSpec(
        name="kvcm_zmq_event_queue_batches",
        kind="gauge",
        labels=(),
        help="KV-event batches queued for the ZMQ publisher thread and not sent yet.",
    ),
    MetricSpec(
        name="kvcm_zmq_event_oldest_unsent_age_seconds",
        kind="gauge",
        labels=(),
        help="How long the oldest queued KV-event batch has waited for the ZMQ publisher "
        "(0: none queued).",
    ),
    MetricSpec(
        name="kvcm_zmq_event_last_sent_sequence",
        kind="gauge",
        labels=("pool",),
        help="Wire seq of the last KV-event batch the ZMQ publisher sent for the pool id "
        "(never goes backwards, also across re-creations of the pool).",
    ),
    MetricSpec(
        name="kvcm_pool_read_errors_total",
        kind="counter",
        labels=_POOL,
        help="Reads of a pool's state that failed (the pool was left out of that scrape or "
        "listing; the others were answered).",
    ),
    MetricSpec(
        name="kvcm_pd_routes_total",
        kind="counter",
        labels=(),
        help="P/D routing calls answered with at least one pool (RoutePd, POST /v1/pd/route).",
    ),
    MetricSpec(
        name="kvcm_pd_route_prompt_tokens_total",
        kind="counter",
        labels=(),
        help="Prompt tokens of the P/D routing calls answered.",
    ),
    MetricSpec(
        name="kvcm_pd_route_decode_hit_tokens_total",
        kind="counter",
        labels=(),
        help="Of those, tokens the chosen decode engine already held (not pulled).",
    ),
    MetricSpec(
        name="kvcm_pd_route_prefill_computed_tokens_total",
        kind="counter",
        labels=(),
        help="Of those, tokens the chosen prefill engine computes (neither held nor pulled).",
    ),
    MetricSpec(
        name="kvcm_pd_route_remote_tokens_total",
        kind="counter",
        labels=(),
        help="Bidirectional routes: tokens the prefill engine may pull from the decode engine "
        "(remote_num_tokens).",
    ),
    # P/D transfer records (TransferService; docs/pd.md), by source pool.
    MetricSpec(
        name="kvcm_transfers_started_total",
        kind="counter",
        labels=_POOL,
        help="P/D transfers started (HoldSource) with the pool as their source.",
    ),
    MetricSpec(
        name="kvcm_transfers_completed_total",
        kind="counter",
        labels=_POOL,
        help="Of those, transfers committed (the destination has its blocks).",
    ),
    MetricSpec(
        name="kvcm_transfers_expired_total",
        kind="counter",
        labels=_POOL,
        help="Of those, transfers whose lease ran out (or ExpireTransfer).",
    ),
    MetricSpec(
        name="kvcm_transfers_failed_total",
        kind="counter",
        labels=_POOL,
        help="Of those, transfers released without completing (a failed or abandoned pull, "
        "a source freed outside the transfer).",
    ),
    MetricSpec(
        name="kvcm_transfer_blocks_pulled_total",
        kind="counter",
        labels=_POOL,
        help="Blocks destinations reported pulled from the pool's held sources.",
    ),
    MetricSpec(
        name="kvcm_transfer_blocks_saved_total",
        kind="counter",
        labels=_POOL,
        help="Blocks destinations already held at the plan (their own prefix hit: not pulled).",
    ),
    MetricSpec(
        name="kvcm_transfers_in_flight",
        kind="gauge",
        labels=_POOL,
        help="Transfers held or planned, not ended.",
    ),
    MetricSpec(
        name="kvcm_transfers_past_lease",
        kind="gauge",
        labels=_POOL,
        help="Sources still held past their transfer's lease (in flight past the deadline, or "
        "record-only transfers kvcm expired that their engine has not ended).",
    ),
    MetricSpec(
        name="kvcm_transfer_oldest_source_age_seconds",
        kind="gauge",
        labels=_POOL,
        help="Age of the oldest source the pool still holds for a transfer (0: none).",
    ),
    MetricSpec(
        name="kvcm_lookup_index_keys",
        kind="gauge",
        labels=(),
        help="Distinct prefix-cache keys in the cross-pool lookup index (one per cached key "
        "of every indexed pool, shared keys counted once).",
    ),
    MetricSpec(
        name="kvcm_lookup_index_pools",
        kind="gauge",
        labels=(),
        help="Pools the lookup index holds (single full-attention pools looked up at least "
        "once; others are answered by their own coordinator).",
    ),
    # The lookup port (lookup_address; docs/lookup.md): exported empty when it is off.
    MetricSpec(
        name="kvcm_lookup_port_connections",
        kind="gauge",
        labels=("state",),
        help="Open lookup-port connections: greeted, or waiting for their HELLO.",
    ),
    MetricSpec(
        name="kvcm_lookup_port_closed_total",
        kind="counter",
        labels=("code",),
        help="Lookup-port connections closed with an error frame, by its status code.",
    ),
    MetricSpec(
        name="kvcm_lookup_port_requests_total",
        kind="counter",
        labels=("code",),
        help="Requests answered over the lookup port, by status code (also counted in "
        'kvcm_rpc_requests_total{method="Lookup"}).',
    ),
    MetricSpec(
        name="kvcm_lookup_port_duration_seconds",
        kind="histogram",
        labels=(),
        help="Server-side duration of requests answered over the lookup port (also in "
        'kvcm_rpc_duration_seconds{method="Lookup"}).',
    ),
    MetricSpec(
        name="kvcm_rpc_duration_seconds",
        kind="histogram",
        labels=("method",),
        help="Server-side duration of gRPC calls, by method.",
    ),
    MetricSpec(
        name="kvcm_rpc_requests_total",
        kind="counter",
        labels=("method", "code"),
        help="Finished gRPC calls, by method and status code.",
    ),
    MetricSpec(
        name="kvcm_event_loop_lag_seconds",
        kind="histogram",
        labels=(),
        help="How late the server's event loop ran a periodic timer: what a call waits before "
        "the loop gets to it.",
    ),
    MetricSpec(
        name="kvcm_build_info",
        kind="gauge",
        labels=("version", "python_version"),
        help="Always 1; the running kvcm version and Python version.",
    ),
    # kvcm as a cluster (--etcd-endpoints; docs/cluster.md): exported empty on a lone server.
    MetricSpec(
        name="kvcm_cluster_etcd_session_up",
        kind="gauge",
        labels=(),
        help="1 while the replica holds its etcd session (lease refreshed), 0 while etcd is away.",
    ),
    MetricSpec(
        name="kvcm_cluster_etcd_session_losses_total",
        kind="counter",
        labels=(),
        help="Times the replica lost its etcd session (etcd unreachable, or its lease expired).",
    ),
    MetricSpec(
        name="kvcm_cluster_standby_replacements_total",
        kind="counter",
        labels=(),
        help="Standbys this replica replaced as a pool's primary for not acknowledging.",
    ),
    MetricSpec(
        name="kvcm_cluster_deleted_pools_dropped_total",
        kind="counter",
        labels=(),
        help="Copies of pools deleted while this replica was away that it dropped at return.",
    ),
    MetricSpec(
        name="kvcm_cluster_replicas",
        kind="gauge",
        labels=(),
        help="Live replicas this replica sees in etcd (itself included once registered).",
    ),
    MetricSpec(
        name="kvcm_cluster_primary_pools",
        kind="gauge",
        labels=(),
        help="Pools whose placement names this replica as primary.",
    ),
    MetricSpec(
        name="kvcm_cluster_redirects_total",
        kind="counter",
        labels=("method",),
        help="Calls for a pool another replica serves, answered with a redirect to it.",
    ),
    MetricSpec(
        name="kvcm_cluster_placement_changes_total",
        kind="counter",
        labels=(),
        help="Placement records this replica created, replaced or deleted (etcd transactions).",
    ),
    MetricSpec(
        name="kvcm_cluster_placement_failures_total",
        kind="counter",
        labels=(),
        help="Pool placements refused because etcd could not be reached.",
    ),
    MetricSpec(
        name="kvcm_cluster_fanout_missed_total",
        kind="counter",
        labels=("method",),
        help="Peer parts of cluster-wide calls (ListPools, Lookup, RoutePd) not answered in time.",
    ),
    # A hot standby per pool (--data-dir; docs/replication.md): empty without placements.
    MetricSpec(
        name="kvcm_replication_role",
        kind="gauge",
        labels=("pool", "state"),
        help="1 for this replica's role for the pool: primary, promoting, standby or fenced.",
    ),
    MetricSpec(
        name="kvcm_replication_lag_records",
        kind="gauge",
        labels=("pool",),
        help="Primary: records applied that the pool's standby has not acknowledged yet.",
    ),
    MetricSpec(
        name="kvcm_replication_lag_seconds",
        kind="gauge",
        labels=("pool",),
        help="Primary: age of the oldest record the pool's standby has not acknowledged (0: none).",
    ),
    MetricSpec(
        name="kvcm_replication_seeds_total",
        kind="counter",
        labels=("pool",),
        help="Primary: snapshots sent to seed the pool's standby (one per stream).",
    ),
    MetricSpec(
        name="kvcm_replication_digest_mismatches_total",
        kind="counter",
        labels=("pool",),
        help="Standby: digest checks its copy failed (each dropped the copy and asked for a seed).",
    ),
    MetricSpec(
        name="kvcm_replication_promotions_total",
        kind="counter",
        labels=(),
        help="Pools this replica took over as primary (promotions from standby).",
    ),
    MetricSpec(
        name="kvcm_replication_stepdowns_total",
        kind="counter",
        labels=(),
        help="Pools this replica stopped serving as primary because a newer epoch exists.",
    ),
)

_SPEC_BY_NAME = {spec.name: spec for spec in METRICS}


def kvcm_version() -> str:
    """The installed kvcm version, or ``"unknown"`` when running from an uninstalled tree."""
    try:
        return metadata.version("kvcm")
    except metadata.PackageNotFoundError:
        return "unknown"


def _scalar_family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty counter or gauge family for the declared metric ``name``."""
    spec = _SPEC_BY_NAME[name]
    if spec.kind == "counter":
        # prometheus_client appends the _total suffix itself.
        return CounterMetricFamily(name.removesuffix("_total"), spec.help, labels=spec.labels)
    if spec.kind == "gauge":
        return GaugeMetricFamily(name, spec.help, labels=spec.labels)
    raise AssertionError(f"{name} is a {spec.kind}, not a counter or gauge")


def _histogram_family(name: str) -> HistogramMetricFamily:
    spec = _SPEC_BY_NAME[name]
    return HistogramMetricFamily(name, spec.help, labels=spec.labels)


# Each per-pool metric that is one number, and how to read it from a snapshot.
_POOL_SCALARS: tuple[tuple[str, Callable[[PoolSnapshotLike], float]], ...] = (
    ("kvcm_prefix_cache_requests_total", lambda s: s.requests),
    ("kvcm_prefix_cache_queries_total", lambda s: s.queries),
    ("kvcm_prefix_cache_hits_total", lambda s: s.hits),
    ("kvcm_prefix_cache_preempted_requests_total", lambda s: s.preempted_requests),
    ("kvcm_prefix_cache_preempted_queries_total", lambda s: s.preempted_queries),
    ("kvcm_prefix_cache_preempted_hits_total", lambda s: s.preempted_hits),
    ("kvcm_prefix_cache_recent_hit_rate", lambda s: s.recent_hit_rate),
    ("kvcm_kv_cache_usage_ratio", lambda s: s.usage),
    ("kvcm_blocks", lambda s: s.num_blocks),
    ("kvcm_free_blocks", lambda s: s.num_free_blocks),
    ("kvcm_cached_blocks", lambda s: s.num_cached_blocks),
    ("kvcm_running_requests", lambda s: s.num_requests),
    ("kvcm_evicted_blocks_total", lambda s: s.evicted_blocks_total),
    ("kvcm_kv_events_emitted_total", lambda s: s.events_emitted_total),
    ("kvcm_allocations_not_fit_total", lambda s: s.allocations_not_fit_total),
    ("kvcm_registered_workers", lambda s: s.registered_workers),
    ("kvcm_pool_world_size", lambda s: s.world_size),
    ("kvcm_host_tier_blocks", lambda s: s.host_tier_blocks),
    ("kvcm_host_tier_used_blocks", lambda s: s.host_tier_used_blocks),
    ("kvcm_host_tier_hit_tokens_total", lambda s: s.host_tier_hit_tokens),
    ("kvcm_host_tier_demoted_blocks_total", lambda s: s.host_tier_demoted_blocks),
    ("kvcm_host_tier_loaded_blocks_total", lambda s: s.host_tier_loaded_blocks),
    ("kvcm_host_tier_evicted_blocks_total", lambda s: s.host_tier_evicted_blocks),
    ("kvcm_host_tier_swap_outs_total", lambda s: s.host_tier_swap_outs),
    ("kvcm_host_tier_swap_ins_total", lambda s: s.host_tier_swap_ins),
)


def pool_families(snapshots: Iterable[PoolSnapshotLike]) -> list[Metric]:
    """The per-pool metric families for ``snapshots``.

    Args:
        snapshots: one snapshot per pool.

    Returns:
        One family per per-pool metric of :data:`METRICS`, each with one series per pool
        (the group info family has one per group).
    """
    scalars = [(_scalar_family(name), read) for name, read in _POOL_SCALARS]
    pool_info = _scalar_family("kvcm_pool_info")
    group_info = _scalar_family("kvcm_kv_cache_group_info")
    for snapshot in snapshots:
        pool = [snapshot.name]
        for family, read in scalars:
            family.add_metric(pool, read(snapshot))
        pool_info.add_metric([snapshot.name, str(snapshot.state)], 1)
        for group_id, kind, block_size, num_layers in snapshot.groups:
            group_info.add_metric(
                [snapshot.name, str(group_id), str(kind), str(block_size), str(num_layers)], 1
            )
    return [*(family for family, _ in scalars), pool_info, group_info]


def rpc_families(stats: RpcStatsSnapshot) -> list[Metric]:
    """The RPC latency histogram and the per-(method, code) call counter.

    Args:
        stats: a snapshot of the server's :class:`RpcStats`.

    Returns:
        ``[kvcm_rpc_duration_seconds, kvcm_rpc_requests_total]``.
    """
    duration = _histogram_family("kvcm_rpc_duration_seconds")
    for latency in stats.latencies:
        # repr is the shortest text that parses back to the same float (what le needs).
        les = [repr(bound) for bound in latency.upper_bounds]
        les.append("+Inf")
        duration.add_metric(
            [latency.method],
            buckets=list(zip(les, latency.cumulative_counts, strict=True)),
            sum_value=latency.sum_seconds,
        )
    calls = _scalar_family("kvcm_rpc_requests_total")
    for method, code, count in stats.requests:
        calls.add_metric([method, code], count)
    return [duration, calls]


def lookup_port_duration_family(stats: RpcStats | None) -> Metric:
    """The lookup port's request latency histogram (no labels): zero buckets until its first
    request, no sample without a port.

    Args:
        stats: the port's own :class:`RpcStats` (method ``Lookup``), or ``None``.

    Returns:
        ``kvcm_lookup_port_duration_seconds``.
    """
    family = _histogram_family("kvcm_lookup_port_duration_seconds")
    if stats is None:
        return family
    les = [*(repr(bound) for bound in stats.buckets), "+Inf"]
    latencies = stats.snapshot().latencies
    counts = latencies[0].cumulative_counts if latencies else (0,) * len(les)
    total = latencies[0].sum_seconds if latencies else 0.0
    family.add_metric([], buckets=list(zip(les, counts, strict=True)), sum_value=total)
    return family


def loop_lag_family(lag: LoopLagSnapshot) -> Metric:
    """The event-loop lag histogram (no labels).

    Args:
        lag: a snapshot of the server's :class:`LoopLagMonitor`.

    Returns:
        ``kvcm_event_loop_lag_seconds``.
    """
    family = _histogram_family("kvcm_event_loop_lag_seconds")
    les = [*(repr(bound) for bound in lag.upper_bounds), "+Inf"]
    family.add_metric(
        [],
        buckets=list(zip(les, lag.cumulative_counts, strict=True)),
        sum_value=lag.sum_seconds,
    )
    return family


def _sampled_families(
    names: tuple[str, ...],
    source: Callable[[], Mapping[str, list[tuple[list[str], float]]]] | None,
) -> Iterator[Metric]:
    """One family per name, filled from ``source``'s samples by metric name (``(label values,
    value)`` each, read now); every family exported, empty without a source."""
    samples = source() if source is not None else {}
    for name in names:
        family = _scalar_family(name)
        for labels, value in samples.get(name, ()):
            family.add_metric(labels, value)
        yield family


class KVCMCollector:
    """Reads pool snapshots, RPC statistics and the loop's lag at scrape time.

    Args:
        registry: the server's pool registry.
        rpc_stats: the server's RPC statistics.
        loop_lag: the server's loop-lag monitor; ``None``: the family is exported empty.
        reclaims: lease reclaims by (pool, lease kind); ``None``: exported empty.
        progress: each pool's step progress; ``None``: exported empty.
        journal: the data directory's journal, read at each scrape (``None``, or it answers
            ``None``: exported empty).
        pd_routes: the P/D routing calls' counters by metric name (``None``: exported as 0).
        transfers: the ``kvcm_transfer*`` samples by metric name, ``(label values, value)``
            each, read at each scrape (``None``: exported empty).

    Attributes:
        reader: reads the pools (one pool that cannot be read is left out and counted); the
            app's ``/v1/pools`` routes read through it too.
        cluster: the ``kvcm_cluster_*`` samples by metric name, ``(label values, value)``
            each, read at each scrape (``None``: a lone server, exported empty).
        lookup_port: the ``kvcm_lookup_port_*`` samples, alike (``None``: exported empty).
        lookup_port_latency: the lookup port's own latencies, read at each scrape (``None``,
            or a ``None`` answer: the port is off, exported empty).
    """

    def __init__(
        self,
        registry: PoolRegistryLike,
        rpc_stats: RpcStats,
        loop_lag: LoopLagMonitor | None = None,
        reclaims: Mapping[tuple[str, str], int] | None = None,
        zmq_counters: KvEventCounters | None = None,
        *,
        progress: StepProgressBook | None = None,
        journal: Callable[[], JournalStatsLike | None] | None = None,
        pd_routes: Mapping[str, int] | None = None,
        transfers: Callable[[], Mapping[str, list[tuple[list[str], float]]]] | None = None,
    ) -> None:
        self._pd_routes = pd_routes if pd_routes is not None else {}
        self._transfers = transfers
        self._progress = progress
        self._journal = journal
        self._zmq = zmq_counters
        self._reclaims = reclaims if reclaims is not None else {}
        self._registry = registry
        self._rpc_stats = rpc_stats
        self._loop_lag = LoopLagMonitor() if loop_lag is None else loop_lag
        self._build_labels = [kvcm_version(), platform.python_version()]
        self.reader = PoolReader()
        self.cluster: Callable[[], Mapping[str, list[tuple[list[str], float]]]] | None = None
        self.replication: Callable[[], Mapping[str, list[tuple[list[str], float]]]] | None = None
        self.lookup_port: Callable[[], Mapping[str, list[tuple[list[str], float]]]] | None = None
        self.lookup_port_latency: Callable[[], RpcStats | None] | None = None

    def _zmq_wire_families(self) -> Iterator[Metric]:
        """The publisher's queue and the last seq it sent per pool (of pools that exist)."""
        depth = _scalar_family("kvcm_zmq_event_queue_batches")
        age = _scalar_family("kvcm_zmq_event_oldest_unsent_age_seconds")
        last_sent = _scalar_family("kvcm_zmq_event_last_sent_sequence")
        counters = self._zmq
        if counters is not None:
            depth.add_metric([], counters.queue_depth())
            age.add_metric([], counters.oldest_unsent_age_s())
            sent = dict(counters.last_sent)  # a copy: the publisher thread writes it
            for pool_id, seq in sorted(sent.items()):
                try:
                    self._registry.get(pool_id)
                except NotFoundError:
                    continue  # deleted: no series until a pool of that id exists again
                last_sent.add_metric([pool_id], seq)
        yield depth
        yield age
        yield last_sent

    def _progress_families(self) -> Iterator[Metric]:
        """Each live pool's step progress (pools a Step was applied to since the start)."""
        seq = _scalar_family("kvcm_pool_last_step_seq")
        age = _scalar_family("kvcm_pool_last_step_age_seconds")
        behind = _scalar_family("kvcm_pool_steps_behind")
        book = self._progress
        for pool_id in book.pool_ids() if book is not None else ():
            try:
                pool = self._registry.get(pool_id)
            except NotFoundError:
                continue
            progress = book.get(pool_id, pool.last_step_seq) if book is not None else None
            if progress is None:
                continue
            seq.add_metric([pool_id], progress.last_step_seq)
            age.add_metric([pool_id], progress.last_step_age_s)
            behind.add_metric([pool_id], progress.steps_behind)
        yield seq
        yield age
        yield behind

    def _journal_families(self) -> Iterator[Metric]:
        """The journal's counters (empty without a data directory)."""
        journal = self._journal() if self._journal is not None else None
        values: dict[str, int] = {}
        if journal is not None:
            values = {
                "kvcm_journal_records_total": journal.num_records,
                "kvcm_journal_fsyncs_total": journal.num_fsyncs,
                "kvcm_journal_failures_total": journal.num_failures,
                "kvcm_journal_records_since_checkpoint": journal.records_since_checkpoint,
                "kvcm_journal_pending_changes": journal.pending_changes,
            }
        for name in _JOURNAL_METRICS:
            family = _scalar_family(name)
            if name in values:
                family.add_metric([], values[name])
            yield family

    def describe(self) -> Iterator[Metric]:
        """Empty families naming every metric, so the registry knows them without a scrape."""
        for spec in METRICS:
            if spec.kind == "histogram":
                yield _histogram_family(spec.name)
            else:
                yield _scalar_family(spec.name)

    def collect(self) -> Iterator[Metric]:
        """Every family in :data:`METRICS`, read from the current state."""
        # A pool lent to a worker thread for a long call is skipped for this scrape: reading
        # it would race the thread (and a snapshot drains the manager's stats).
        reader = self.reader
        yield from pool_families(reader.read(self._registry.list(), lambda snapshot: snapshot))
        read_errors = _scalar_family("kvcm_pool_read_errors_total")
        for pool, count in sorted(reader.failures.items()):
            read_errors.add_metric([pool], count)
        yield read_errors
        yield from rpc_families(self._rpc_stats.snapshot())
        yield loop_lag_family(self._loop_lag.snapshot())
        yield from self._progress_families()
        reclaims = _scalar_family("kvcm_lease_reclaims_total")
        for (pool, lease), count in sorted(self._reclaims.items()):
            reclaims.add_metric([pool, lease], count)
        yield reclaims
        yield from self._journal_families()
        yield from _sampled_families(_CLUSTER_METRICS, self.cluster)
        yield from _sampled_families(_REPLICATION_METRICS, self.replication)
        batches = _scalar_family("kvcm_zmq_event_batches_total")
        peers = _scalar_family("kvcm_zmq_event_peers")
        if self._zmq is not None:
            counters = self._zmq
            for kind, count in (
                ("sent", counters.batches),
                ("dropped", counters.dropped),
                ("replayed", counters.replayed_batches),
            ):
                batches.add_metric([kind], count)
            peers.add_metric([], counters.peers)
        yield batches
        yield peers
        yield from self._zmq_wire_families()
        for name in _PD_ROUTE_METRICS:
            pd_family = _scalar_family(name)
            pd_family.add_metric([], self._pd_routes.get(name, 0))
            yield pd_family
        transfers = self._transfers() if self._transfers is not None else {}
        for name in _TRANSFER_METRICS:
            transfer_family = _scalar_family(name)
            for labels, value in transfers.get(name, ()):
                transfer_family.add_metric(labels, value)
            yield transfer_family
        keys = _scalar_family("kvcm_lookup_index_keys")
        indexed = _scalar_family("kvcm_lookup_index_pools")
        index = getattr(self._registry, "index", None)
        if index is not None:
            keys.add_metric([], len(index))
            indexed.add_metric([], index.num_pools)
        yield keys
        yield indexed
        yield from _sampled_families(_LOOKUP_PORT_METRICS, self.lookup_port)
        port_latency = self.lookup_port_latency
        yield lookup_port_duration_family(port_latency() if port_latency is not None else None)
        build = _scalar_family("kvcm_build_info")
        build.add_metric(self._build_labels, 1)
        yield build
