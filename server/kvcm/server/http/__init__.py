"""kvcm's HTTP side: Prometheus metrics, health and readiness probes, pool summaries.

``build_app`` returns the FastAPI app the server runs with uvicorn on its own event loop. The
metrics are read from pool snapshots and :class:`kvcm.server.telemetry.RpcStats` by a custom
collector at scrape time; nothing on the RPC path touches prometheus_client.
"""

from __future__ import annotations

from kvcm.server.http._app import (
    ErrorBody,
    ErrorDetail,
    GroupSummary,
    HashingSummary,
    PoolList,
    PoolSummary,
    PoolWiring,
    PrefixCacheSummary,
    Status,
    ZmqEventsSummary,
    build_app,
    summarize,
)
from kvcm.server.http._cluster import ClusterCallError, ClusterReadsLike
from kvcm.server.http._collector import METRICS, KVCMCollector, MetricSpec
from kvcm.server.http._views import PoolLike, PoolRegistryLike, PoolSnapshotLike

__all__ = [
    "METRICS",
    "ClusterCallError",
    "ClusterReadsLike",
    "ErrorBody",
    "ErrorDetail",
    "GroupSummary",
    "HashingSummary",
    "KVCMCollector",
    "MetricSpec",
    "PoolLike",
    "PoolList",
    "PoolRegistryLike",
    "PoolSnapshotLike",
    "PoolSummary",
    "PoolWiring",
    "PrefixCacheSummary",
    "Status",
    "ZmqEventsSummary",
    "build_app",
    "summarize",
]
