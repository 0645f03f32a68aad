"""What the servicers share: the pool registry, per-pool wake-ups, created configs, stats."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvcm.common.errors import KVCMError
from kvcm.core.limits import DEFAULT_LIMITS, Limits
from kvcm.core.pool import Pool, PoolRegistry
from kvcm.server.telemetry import RpcStats
from kvcm.v1 import admin_pb2

__all__ = ["PoolRuntime", "ServerState"]


@dataclass(slots=True)
class PoolRuntime:
    """The asyncio side of one pool: who waits for it to be planned or for its events.

    Attributes:
        config: The ``PoolConfig`` the pool was created with (echoed by DescribePool).
        planned: Set once the pool is READY (or deleted, or the server stops); set and
            replaced when a registration round's plan fails.
        events: Set (and replaced) whenever events are published (or the pool is deleted).
        deleted: Whether the pool was deleted.
        round: Registration rounds ended by a failed plan so far (a waiting rank compares
            it with the round it joined).
        plan_failure: Why the last failed round failed (sent to every rank that waited).
        waiting: RegisterWorker calls waiting at the barrier, by rank.
        subscribers: Live SubscribeEvents streams of the pool (bounded by
            ``Limits.max_subscribers_per_pool``).
    """

    config: admin_pb2.PoolConfig
    planned: asyncio.Event = field(default_factory=asyncio.Event)
    events: asyncio.Event = field(default_factory=asyncio.Event)
    deleted: bool = False
    round: int = 0
    plan_failure: KVCMError | None = None
    waiting: dict[int, int] = field(default_factory=dict)
    subscribers: int = 0

    def fail_round(self, error: KVCMError) -> None:
        """End the current registration round with ``error``: every waiting rank gets it."""
        self.plan_failure = error
        self.round += 1
        self.planned.set()
        self.planned = asyncio.Event()

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
        limits: The service's hard limits (pending registrations, registration timeout).
    """

    registry: PoolRegistry
    rpc_stats: RpcStats
    limits: Limits = DEFAULT_LIMITS
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
