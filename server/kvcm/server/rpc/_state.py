"""What the servicers share: the pool registry, per-pool wake-ups, created configs, stats."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvcm.core.pool import Pool, PoolRegistry
from kvcm.server.telemetry import RpcStats
from kvcm.v1 import admin_pb2

__all__ = ["PoolRuntime", "ServerState"]


@dataclass(slots=True)
class PoolRuntime:
    """The asyncio side of one pool: who waits for it to be planned or for its events.

    Attributes:
        config: The ``PoolConfig`` the pool was created with (echoed by DescribePool).
        planned: Set once the pool is READY (or deleted).
        events: Set (and replaced) whenever events are published (or the pool is deleted).
        deleted: Whether the pool was deleted.
    """

    config: admin_pb2.PoolConfig
    planned: asyncio.Event = field(default_factory=asyncio.Event)
    events: asyncio.Event = field(default_factory=asyncio.Event)
    deleted: bool = False

    def wake_subscribers(self) -> None:
        """Wake every subscriber waiting for events."""
        self.events.set()
        self.events = asyncio.Event()


@dataclass(slots=True)
class ServerState:
    """The state every servicer reads.

    Attributes:
        registry: The pools.
        rpc_stats: Per-method call counts and latencies (read by /metrics).
        runtimes: The asyncio side of each pool, by pool id.
        serving: Whether the gRPC side serves (False before start and while shutting down).
    """

    registry: PoolRegistry
    rpc_stats: RpcStats
    runtimes: dict[str, PoolRuntime] = field(default_factory=dict)
    serving: bool = False

    def begin_shutdown(self) -> None:
        """Stop serving: wake every waiting registration and event stream so they end now."""
        self.serving = False
        for runtime in self.runtimes.values():
            runtime.planned.set()
            runtime.wake_subscribers()

    def published(self, pool: Pool) -> None:
        """Publish the events a mutating call left in the pool's core, waking subscribers."""
        if pool.publish_events(time.time()):
            runtime = self.runtimes.get(pool.name)
            if runtime is not None:
                runtime.wake_subscribers()
