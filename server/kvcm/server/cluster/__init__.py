"""kvcm as a cluster of replicas: membership and pool placement in etcd, redirects, fan-out.

Without ``--etcd-endpoints`` none of this runs and the server is the single process it always
was. See ``docs/cluster.md``.
"""

from __future__ import annotations

from kvcm.server.cluster.placement import Placement, PlacementCallback, PlacementView

__all__ = ["Placement", "PlacementCallback", "PlacementView"]
