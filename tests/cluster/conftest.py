"""The cluster tests' fixtures (a real etcd, three ``kvcm serve`` replicas): see _cluster.py."""

from __future__ import annotations

from _cluster import etcd, replicas

__all__ = ["etcd", "replicas"]
