"""kvcm as a cluster of replicas: membership and pool placement in etcd, redirects, fan-out.

Without ``--etcd-endpoints`` none of this runs and the server is the single process it always
was. See ``docs/cluster.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcm.server.cluster._etcd import EtcdUnavailableError
from kvcm.server.cluster._fanout import LOCAL_KEY, MISSING_KEY, REPLICAS_KEY
from kvcm.server.cluster._moves import MoveError, drain_replica, move_pool
from kvcm.server.cluster._node import ClusterConfig, ClusterNode, ClusterStats
from kvcm.server.cluster._replica_rpc import add_replica_servicer
from kvcm.server.cluster._routing import EPOCH_KEY, OWNER_KEY
from kvcm.server.cluster.placement import Placement, PlacementCallback, PlacementView

__all__ = [
    "EPOCH_KEY",
    "LOCAL_KEY",
    "MISSING_KEY",
    "OWNER_KEY",
    "REPLICAS_KEY",
    "ClusterConfig",
    "ClusterNode",
    "ClusterRuntime",
    "ClusterStats",
    "EtcdUnavailableError",
    "MoveError",
    "Placement",
    "PlacementCallback",
    "PlacementView",
    "add_replica_servicer",
    "drain_replica",
    "move_pool",
]

if TYPE_CHECKING:
    from kvcm.server.cluster._runtime import ClusterRuntime


def __getattr__(name: str) -> Any:
    """``ClusterRuntime`` on first use: it pulls in the HTTP side (FastAPI), which tools that
    read a replica's files (``kvcm data-dir check``) never need."""
    if name == "ClusterRuntime":
        from kvcm.server.cluster._runtime import ClusterRuntime

        return ClusterRuntime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
