"""One replica's place in the cluster: its etcd lease, the live replicas, every pool's placement.

::

    <prefix>/replicas/<address>    {"address", "http_address", "num_pools"}  on the replica's lease
    <prefix>/placement/<pool_id>   Placement.encode()                           no lease
    <prefix>/deleted/<pool_id>     {"pool_id", "epoch"}: the pool was deleted    no lease

A pool's **tombstone** (``deleted/``) is written in the transaction that deletes its placement
(the deleted record's epoch in it) and removed in the one that places a pool of that id again,
so etcd holds at most one of the two. It tells a replica that restarts with a copy of the pool
in its data directory, and no placement for it, that the pool was deleted while it was down
(:meth:`ClusterNode.claim`): the copy goes instead of being placed again.

Two background tasks run from :meth:`ClusterNode.start` to :meth:`ClusterNode.stop`:

* the **session** task grants the lease, registers the replica under it, refreshes it every
  third of its TTL and re-registers when the pool count changes; when etcd cannot be reached
  the replica goes on serving what it owns (``etcd_up`` is false) and re-registers, on a new
  lease if the old one expired, as soon as etcd answers again;
* the **watch** task lists ``<prefix>/`` once, then follows it with an etcd watch from the
  listed revision on, so the local view (live replicas, placements) misses no change; when
  the watch breaks it lists and watches again.

Placements change only through etcd transactions: :meth:`ClusterNode.place` creates a record
only where none exists (compare ``create_revision == 0``), :meth:`ClusterNode.replace` swaps
one only if it still holds the expected value, so two replicas never both win.

**Failover** (with ``can_promote`` set, i.e. with replication): when etcd says a replica left
(its key deleted: lease expired or revoked), each replica looks at the placements that name
the one that left. A pool whose primary left is taken over by its standby, if that standby
holds a live copy (``can_promote``): one transaction swaps the record for one naming it
primary, a new standby (the least-loaded other live replica) and the epoch plus one;
replication, told by the watch, promotes the copy. A pool whose standby left gets a new
standby from its primary (same epoch). The same check runs after every listing, so a
departure missed while the watch was down is acted on too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import aetcd.exceptions
import grpc

from kvcm.server.cluster._etcd import EtcdSession, EtcdUnavailableError
from kvcm.server.cluster.placement import Placement, PlacementCallback

__all__ = ["ClusterConfig", "ClusterNode", "ClusterStats"]

_LOG = logging.getLogger("kvcm.server.cluster")

# Pause before listing and watching again after the watch broke (etcd down), in seconds.
_REWATCH_S = 0.5
# How long a standby its primary replaced for not acknowledging is chosen as no pool's standby
# again by this replica, in seconds (a full disk, a stuck apply: the operator's to fix).
_UNFIT_S = 60.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """How a replica joins the cluster.

    Attributes:
        endpoints: etcd's client endpoints, ``(host, port)``.
        prefix: The etcd key prefix every key of this cluster lives under.
        lease_ttl_s: TTL of the replica's etcd lease, in seconds: a replica that stops
            refreshing it leaves the live set this long after its last refresh.
        etcd_timeout_s: Deadline of each etcd call, in seconds.
        fanout_timeout_s: Deadline of each peer's part of a cluster-wide call, in seconds.
        etcd_credentials: Makes the TLS credentials of each channel to etcd (``None``:
            plaintext; see :func:`kvcm.server.tls.etcd_credentials`).
    """

    endpoints: tuple[tuple[str, int], ...]
    prefix: str = "/kvcm"
    lease_ttl_s: int = 5
    etcd_timeout_s: float = 2.0
    fanout_timeout_s: float = 2.0
    etcd_credentials: Callable[[], grpc.ChannelCredentials] | None = None


@dataclasses.dataclass(slots=True)
class ClusterStats:
    """Counters the metrics collector reads (``kvcm_cluster_*``).

    Attributes:
        redirects: Calls answered with a redirect, by method.
        placement_changes: Placement records this replica created, replaced or deleted.
        placement_failures: Placements refused because etcd could not be reached.
        fanout_missed: Cluster-wide calls' peer parts that did not answer, by method.
        session_losses: Times the etcd session was lost (etcd unreachable, lease expired).
        standby_replacements: Standbys this replica replaced, as their pools' primary, for not
            acknowledging while live in etcd (:meth:`ClusterNode.replace_standby`).
        deleted_pools_dropped: Copies of pools deleted while this replica was away (a
            tombstone, no placement) that it dropped instead of placing them again.
    """

    redirects: dict[str, int] = dataclasses.field(default_factory=dict)
    placement_changes: int = 0
    placement_failures: int = 0
    fanout_missed: dict[str, int] = dataclasses.field(default_factory=dict)
    session_losses: int = 0
    standby_replacements: int = 0
    deleted_pools_dropped: int = 0


class ClusterNode:
    """This replica's membership and its view of every pool's placement (a ``PlacementView``).

    Attributes:
        config: How it joined.
        address: This replica's advertise address (``host:port`` clients and peers dial;
            set by :meth:`start`).
        http_address: Its HTTP side's ``host:port`` (``""``: none), registered for operators.
        stats: Its counters.
        etcd_up: Whether the last etcd call of the session task succeeded.
        replicas: The live replicas (registered under a lease), by address: what they
            registered.
    """

    def __init__(self, config: ClusterConfig, *, num_pools: Callable[[], int]) -> None:
        """Prepare; nothing talks to etcd before :meth:`start`.

        Args:
            config: How to join.
            num_pools: This replica's pool count now (registered as its load).
        """
        self.config = config
        self.address = ""
        self.http_address = ""
        self.stats = ClusterStats()
        self.etcd_up = False
        self.replicas: dict[str, dict[str, Any]] = {}
        self._num_pools = num_pools
        tls = config.etcd_credentials
        self._session = EtcdSession(
            config.endpoints, timeout_s=config.etcd_timeout_s, credentials=tls
        )
        # The watch has clients of its own: starting over closes them, never the session's.
        self._watching = EtcdSession(
            config.endpoints, timeout_s=config.etcd_timeout_s, credentials=tls
        )
        self._replica_prefix = f"{config.prefix}/replicas/".encode()
        self._placement_prefix = f"{config.prefix}/placement/".encode()
        self._deleted_prefix = f"{config.prefix}/deleted/".encode()
        self._placements: dict[str, Placement] = {}
        # The tombstones as last seen: pool id -> the deleted placement's epoch.
        self._tombstones: dict[str, int] = {}
        self._callbacks: list[PlacementCallback] = []
        self._lease: Any = None
        # time.monotonic() when the last keep-alive that etcd granted was sent (None: none).
        self._renewed_at: float | None = None
        self._registered_pools = -1
        self._tasks: list[asyncio.Task[None]] = []
        self._listed = asyncio.Event()
        self._reconciling: asyncio.Task[None] | None = None
        # Replicas replaced as a standby for not acknowledging: time.monotonic() until which
        # none is chosen as a standby here (_UNFIT_S).
        self._unfit: dict[str, float] = {}
        # time.monotonic() when the session came up last (after a loss: failover settles).
        self._regained_at: float | None = None
        self._lost_at: float | None = None  # when the session was lost last
        self._settle_pending = False
        #: Whether this replica holds a live copy of a pool it follows and may take it over
        #: (set by replication; ``None``: failover off, a standby is never promoted).
        self.can_promote: Callable[[str], bool] | None = None

    # ------------------------------------------------------------------ PlacementView
    def get(self, pool_id: str) -> Placement | None:
        """The pool's placement as last seen, or ``None``."""
        return self._placements.get(pool_id)

    def watch(self, callback: PlacementCallback) -> Callable[[], None]:
        """Call ``callback(pool_id, placement | None)`` on every change from now on."""
        self._callbacks.append(callback)

        def stop() -> None:
            with contextlib.suppress(ValueError):
                self._callbacks.remove(callback)

        return stop

    def placements(self) -> dict[str, Placement]:
        """Every placement as last seen (a copy)."""
        return dict(self._placements)

    def deleted_epoch(self, pool_id: str) -> int | None:
        """The epoch of the pool's deleted placement when its tombstone was last seen (the pool
        was deleted and no pool of that id placed since), else ``None``."""
        return self._tombstones.get(pool_id)

    def peers(self) -> list[str]:
        """The live replicas other than this one, sorted."""
        return sorted(address for address in self.replicas if address != self.address)

    # --------------------------------------------------------------------- lifecycle
    async def start(self, address: str, http_address: str = "", *, wait_s: float = 0.0) -> None:
        """Join as ``address``: start the session and watch tasks, and wait up to ``wait_s``
        for the first listing of the cluster."""
        self.address = address
        self.http_address = http_address
        self._tasks = [
            asyncio.create_task(self._session_loop(), name="kvcm-cluster-session"),
            asyncio.create_task(self._watch_loop(), name="kvcm-cluster-watch"),
        ]
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._listed.wait(), wait_s)

    async def stop(self) -> None:
        """Leave: stop the tasks and revoke the lease (peers see this replica go at once)."""
        if self._reconciling is not None:
            self._tasks.append(self._reconciling)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._session.call(lambda c: c.revoke_lease(lease.id)), 1.0)
        await self._session.close()
        await self._watching.close()

    # ---------------------------------------------------------------------- placement
    async def place(
        self, pool_id: str, *, primary: str | None = None, mode: str = "sync"
    ) -> tuple[Placement, bool]:
        """The pool's placement, created (least-loaded live replicas) if it has none.

        Args:
            pool_id: The pool.
            primary: The primary a new record names (a pool this replica already holds);
                ``None``: the least-loaded live replica.
            mode: The replication mode a new record names (an existing one keeps its own).

        Returns:
            The placement in etcd, and whether this call created it.

        Raises:
            EtcdUnavailableError: etcd could not be reached; nothing changed.
        """
        key = self._placement_prefix + pool_id.encode()
        try:
            existing = await self._session.call(lambda c: c.get(key))
            if existing is not None:
                placement = Placement.decode(existing.value)
                self._apply(pool_id, placement)
                return placement, False
            primary, standby = self._choose(primary)
            placement = Placement(
                pool_id=pool_id, primary=primary, standby=standby, epoch=1, mode=mode
            )
            tx = self._session.client.transactions
            # A pool of a deleted id: its tombstone goes in the same transaction (first, so
            # that a watcher has forgotten it when it sees the new record).
            tombstone = self._deleted_prefix + pool_id.encode()

            async def create(client: Any) -> tuple[bool, Any]:
                return await client.transaction(  # type: ignore[no-any-return]
                    compare=[tx.create(key) == 0],
                    success=[tx.delete(tombstone), tx.put(key, placement.encode())],
                    failure=[tx.get(key)],
                )

            won, responses = await self._session.call(create)
        except EtcdUnavailableError:
            self.stats.placement_failures += 1
            raise
        if won:
            self._placed(placement, "on " + placement.primary)
            return placement, True
        # Another replica placed it between our read and our transaction: theirs stands.
        placement = Placement.decode(responses[0][0][0])
        self._apply(pool_id, placement)
        return placement, False

    async def read_tombstones(self) -> dict[str, int]:
        """Every tombstone in etcd now (pool id -> the deleted placement's epoch), in one read:
        a pool listed has no placement (etcd never holds both), so a copy of it is a deleted
        pool's. Callable before :meth:`start`.

        Raises:
            EtcdUnavailableError: etcd could not be reached.
        """
        prefix = self._deleted_prefix
        listing = await self._session.call(lambda c: c.get_prefix(prefix))
        tombstones: dict[str, int] = {}
        for kv in listing:
            self._read(kv.key, kv.value, None, None, tombstones)
        return tombstones

    async def claim(self, pool_id: str, *, mode: str = "sync", epoch: int = 1) -> Placement | int:
        """Place a pool this replica's data directory brought back (this replica its primary,
        replication ``mode``, placement ``epoch``) unless the pool was deleted meanwhile: one
        transaction creates the record only where neither a record nor a tombstone exists.

        Returns:
            The placement in etcd (created here, or one found), or the tombstone's epoch: the
            pool was deleted while this replica was away, and its copy must go.

        Raises:
            EtcdUnavailableError: etcd could not be reached; nothing changed.
        """
        key = self._placement_prefix + pool_id.encode()
        tombstone = self._deleted_prefix + pool_id.encode()
        try:
            _, standby = self._choose(self.address)
            placement = Placement(
                pool_id=pool_id, primary=self.address, standby=standby, epoch=epoch, mode=mode
            )
            tx = self._session.client.transactions

            async def create(client: Any) -> tuple[bool, Any]:
                return await client.transaction(  # type: ignore[no-any-return]
                    compare=[tx.create(key) == 0, tx.create(tombstone) == 0],
                    success=[tx.put(key, placement.encode())],
                    failure=[tx.get(key), tx.get(tombstone)],
                )

            won, responses = await self._session.call(create)
        except EtcdUnavailableError:
            self.stats.placement_failures += 1
            raise
        if won:
            self._placed(placement, "brought back by the data directory, on this replica")
            return placement
        found, dead = responses
        if found:
            placement = Placement.decode(found[0][0])
            self._apply(pool_id, placement)
            return placement
        try:
            epoch = _tombstone_epoch(dead[0][0])
        except (IndexError, ValueError, KeyError, TypeError):
            epoch = 0  # an unreadable tombstone still says the pool was deleted
        self._tombstones[pool_id] = epoch
        return epoch

    def _placed(self, placement: Placement, where: str) -> None:
        """Count, record and log a placement this replica's transaction created."""
        self.stats.placement_changes += 1
        self._apply(placement.pool_id, placement)
        _LOG.info(
            "placed pool %s %s (standby %s)",
            placement.pool_id,
            where,
            placement.standby,
            extra={"event": "pool_placed", "pool": placement.pool_id},
        )

    async def replace(self, expected: Placement, new: Placement | None) -> bool:
        """Swap the pool's record for ``new`` (``None``: delete it) if it still is ``expected``.

        Returns:
            Whether the swap happened (False: the record changed meanwhile; nothing done).

        Raises:
            EtcdUnavailableError: etcd could not be reached; nothing changed.
        """
        pool_id = expected.pool_id
        if new is not None and new.pool_id != pool_id:
            raise ValueError(f"replace: pool ids differ ({pool_id!r}, {new.pool_id!r})")
        key = self._placement_prefix + pool_id.encode()
        tx = self._session.client.transactions
        if new is None:  # the tombstone first: a watcher knows it when it sees the delete
            tombstone = self._deleted_prefix + pool_id.encode()
            dead = json.dumps({"pool_id": pool_id, "epoch": expected.epoch}, sort_keys=True)
            success = [tx.put(tombstone, dead.encode()), tx.delete(key)]
        else:
            success = [tx.put(key, new.encode())]

        async def swap(client: Any) -> tuple[bool, Any]:
            return await client.transaction(  # type: ignore[no-any-return]
                compare=[tx.value(key) == expected.encode()], success=success, failure=[]
            )

        won, _ = await self._session.call(swap)
        if won:
            self.stats.placement_changes += 1
            if new is None:
                self._tombstones[pool_id] = expected.epoch
            self._apply(pool_id, new)
        return bool(won)

    def _choose(
        self, primary: str | None = None, planned: Mapping[str, Placement] | None = None
    ) -> tuple[str, str | None]:
        """Primary and standby for a new pool, as placed now: the live replica with the fewest
        primaries (then standbys, then address), and of the others the one with the fewest
        standbys (then primaries, then address); this replica when it knows of none.
        ``primary``: already chosen (a pool this replica holds); only the standby is.
        ``planned``: placements about to be written, counted instead of the pools' own."""
        live = set(self.replicas) | {self.address}
        primaries = dict.fromkeys(live, 0)
        standbys = dict.fromkeys(live, 0)
        for placement in {**self._placements, **(planned or {})}.values():
            if placement.primary in primaries:
                primaries[placement.primary] += 1
            if placement.standby in standbys:
                standbys[placement.standby] += 1
        if primary is None:
            primary = min(live, key=lambda a: (primaries[a], standbys[a], a))
        now = time.monotonic()
        unfit = {address for address, until in self._unfit.items() if until > now}
        others = live - {primary} - unfit
        if not others:
            return primary, None
        # The standby's own load is its standbys (what it replays), then its primaries.
        standby = min(others, key=lambda a: (standbys.get(a, 0), primaries.get(a, 0), a))
        return primary, standby

    async def replace_standby(self, pool_id: str, standby: str) -> Placement | None:
        """Replace the pool's standby ``standby``, live in etcd but not acknowledging (a full or
        failing disk, a stuck apply, a partition between the two replicas), as this replica,
        its primary, asks: one transaction swaps the record for one at the same epoch naming
        another live replica (the least-loaded), or no standby if none is left. The replaced
        one is no pool's standby here for ``_UNFIT_S`` seconds. It is no longer in the
        placement, so it can never be promoted (failover promotes only the standby named).

        Returns:
            The new placement, or ``None`` when nothing changed (the record no longer names
            this replica primary and ``standby`` as its standby, or it changed meanwhile).

        Raises:
            EtcdUnavailableError: etcd could not be reached; nothing changed.
        """
        placement = self._placements.get(pool_id)
        if placement is None or (placement.primary, placement.standby) != (self.address, standby):
            return None
        self._unfit[standby] = time.monotonic() + _UNFIT_S
        _, new_standby = self._choose(self.address)
        new = dataclasses.replace(placement, standby=new_standby)
        if not await self.replace(placement, new):
            return None
        self.stats.standby_replacements += 1
        _LOG.warning(
            "pool %s: standby %s does not acknowledge; replaced by %s (epoch %d)",
            pool_id,
            standby,
            new_standby or "none (acknowledged after the local journal)",
            new.epoch,
            extra={"event": "standby_replaced", "pool": pool_id},
        )
        return new

    def _apply(self, pool_id: str, placement: Placement | None) -> None:
        """Record a change in the local view and tell the watchers (only if it changed)."""
        if placement is not None:  # etcd holds a record or a tombstone, never both
            self._tombstones.pop(pool_id, None)
        if self._placements.get(pool_id) == placement:
            return
        if placement is None:
            self._placements.pop(pool_id, None)
        else:
            self._placements[pool_id] = placement
        for callback in list(self._callbacks):
            try:
                callback(pool_id, placement)
            except Exception:
                _LOG.exception("a placement watcher failed")

    # ----------------------------------------------------------------------- session
    async def _session_loop(self) -> None:
        ttl = self.config.lease_ttl_s
        while True:
            try:
                await self._keep_session(ttl)
                if not self.etcd_up:
                    now = time.monotonic()
                    lost = self._lost_at
                    if lost is not None and now - lost >= ttl:  # long enough for leases to lapse
                        self._regained_at = now
                    _LOG.info(
                        "etcd session up (%s)",
                        self._session.describe(),
                        extra={"event": "etcd_session_up"},
                    )
                self.etcd_up = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd away, or an answer aetcd could not take: go on
                if not isinstance(exc, EtcdUnavailableError | aetcd.exceptions.ClientError):
                    _LOG.warning("etcd session: unexpected %r", exc)
                if self.etcd_up:
                    self.stats.session_losses += 1
                    self._lost_at = time.monotonic()
                    _LOG.warning(
                        "etcd session lost: %s; serving the pools this replica owns, placement "
                        "changes wait for etcd",
                        exc,
                        extra={"event": "etcd_session_lost"},
                    )
                self.etcd_up = False
            await asyncio.sleep(ttl / 3)

    async def _keep_session(self, ttl: int) -> None:
        sent = time.monotonic()
        if self._lease is not None:
            reply = await self._session.call(lambda c: c.refresh_lease(self._lease.id))
            if reply is None or reply.TTL <= 0:  # expired while etcd was away: start again
                if self.etcd_up:
                    self.stats.session_losses += 1
                self._lease = None
        if self._lease is None:
            self._lease = await self._session.call(lambda c: c.lease(ttl))
            self._registered_pools = -1
            if self._renewed_at is not None:
                # The old lease expired (a pause, a partition): pools may have been taken
                # over meanwhile. Read every placement before the lease counts as live again,
                # so that an async pool's answer (lease_fresh) sees the new owner first.
                prefix = f"{self.config.prefix}/".encode()
                self._relist(await self._session.call(lambda c: c.get_prefix(prefix)))
        self._renewed_at = sent
        num_pools = self._num_pools()
        if num_pools != self._registered_pools:
            value = json.dumps(
                {
                    "address": self.address,
                    "http_address": self.http_address,
                    "num_pools": num_pools,
                },
                sort_keys=True,
            ).encode()
            key = self._replica_prefix + self.address.encode()
            lease = self._lease
            await self._session.call(lambda c: c.put(key, value, lease=lease))
            self._registered_pools = num_pools

    def lease_fresh(self, pool_id: str, epoch: int) -> bool:
        """Whether this replica may still acknowledge a call of ``pool_id`` as its primary at
        ``epoch`` without a standby's word (an ``async`` pool): its etcd lease was renewed
        less than the TTL minus a margin ago (``time.monotonic()``; the margin, a third of
        the TTL, covers the keep-alive's own round trip and the answer's way out), and the
        placement it last read still names it primary at that epoch. A standby can be
        promoted only after the lease expired, so no two primaries acknowledge at once."""
        renewed = self._renewed_at
        if renewed is None:
            return False
        ttl = self.config.lease_ttl_s
        if time.monotonic() - renewed >= ttl - ttl / 3:
            return False
        placement = self._placements.get(pool_id)
        return placement is not None and (placement.primary, placement.epoch) == (
            self.address,
            epoch,
        )

    # ------------------------------------------------------------------------- watch
    async def _watch_loop(self) -> None:
        prefix = f"{self.config.prefix}/".encode()
        while True:
            try:
                listing = await self._watching.call(lambda c: c.get_prefix(prefix))
                self._relist(listing)
                self._listed.set()
                watch = await self._watching.client.watch_prefix(
                    prefix, start_revision=listing.header.revision + 1
                )
                try:
                    async for event in watch:
                        self._on_event(event)
                finally:
                    with contextlib.suppress(Exception):
                        await watch.cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                _LOG.debug("etcd watch broke: %r; listing again", exc)
                with contextlib.suppress(Exception):
                    await self._watching.client.close()
            await asyncio.sleep(_REWATCH_S)

    def _relist(self, listing: Any) -> None:
        replicas: dict[str, dict[str, Any]] = {}
        placements: dict[str, Placement] = {}
        tombstones: dict[str, int] = {}
        for kv in listing:
            self._read(kv.key, kv.value, replicas, placements, tombstones)
        self.replicas = replicas
        self._tombstones = tombstones  # before the placements' callbacks: they may read it
        for pool_id in [p for p in self._placements if p not in placements]:
            self._apply(pool_id, None)
        for pool_id, placement in placements.items():
            self._apply(pool_id, placement)
        self._reconcile_soon()

    def _on_event(self, event: Any) -> None:
        key: bytes = event.kv.key
        deleted = event.kind == "DELETE"
        if key.startswith(self._replica_prefix):
            address = key[len(self._replica_prefix) :].decode()
            if deleted:
                self.replicas.pop(address, None)
                self._reconcile_soon()
            else:
                self._read(key, event.kv.value, self.replicas, None)
        elif key.startswith(self._deleted_prefix):
            if deleted:
                self._tombstones.pop(key[len(self._deleted_prefix) :].decode(), None)
            else:
                self._read(key, event.kv.value, None, None, self._tombstones)
        elif key.startswith(self._placement_prefix):
            pool_id = key[len(self._placement_prefix) :].decode()
            if deleted:
                self._apply(pool_id, None)
            else:
                staged: dict[str, Placement] = {}
                self._read(key, event.kv.value, None, staged)
                for placed_id, placement in staged.items():
                    self._apply(placed_id, placement)

    # ---------------------------------------------------------------------- failover
    def _reconcile_soon(self) -> None:
        if self._reconciling is None or self._reconciling.done():
            self._reconciling = asyncio.create_task(self._reconcile(), name="kvcm-cluster-failover")

    def _settling_s(self) -> float:
        """Seconds before failover may act again after this replica lost etcd (0: now).

        When etcd was away from every replica (an etcd outage), each replica's lease may
        expire in etcd's view before that replica's next keep-alive reaches it once etcd is
        back (its reconnect backoff): its key goes, yet it is alive and serving. Acting on
        that would fail over live primaries (a new epoch, their calls refused) for nothing.
        So after a session loss of at least the TTL (a shorter blip, a slow keep-alive, does
        not wait) a replica acts on departures only once its own session has been up for
        twice the TTL plus an etcd call: a replica that is alive has re-registered
        by then, and one that is not is still gone (its pools fail over that much later).
        """
        lost = self._lost_at
        if lost is None:
            return 0.0
        ttl = self.config.lease_ttl_s
        grace = 2 * ttl + self.config.etcd_timeout_s
        if not self.etcd_up:  # still away: only a loss as long as the TTL waits
            return grace if time.monotonic() - lost >= ttl else 0.0
        regained = self._regained_at  # set only after a loss of at least the TTL
        if regained is None or regained < lost:
            return 0.0
        return max(0.0, regained + grace - time.monotonic())

    def _settled(self) -> None:
        self._settle_pending = False
        if self._tasks:  # not stopped meanwhile
            self._reconcile_soon()

    async def _reconcile(self) -> None:
        """Take over the pools whose primary left and this replica follows; give the pools
        this replica serves whose standby left a new one (see the module docstring)."""
        if self.can_promote is None or self.address not in self.replicas:
            return  # failover off, or this replica's own session is not live: act on nothing
        settling = self._settling_s()
        if settling > 0:  # etcd just came back: see who re-registers first
            if not self._settle_pending:
                self._settle_pending = True
                asyncio.get_running_loop().call_later(settling, self._settled)
            return
        planned: dict[str, Placement] = {}
        changes: list[tuple[Placement, Placement]] = []
        for placement in list(self._placements.values()):
            live = self.replicas
            if placement.primary in live:
                if placement.primary != self.address or placement.standby in live:
                    continue
                _, standby = self._choose(self.address, planned)
                if standby == placement.standby:
                    continue
                new = dataclasses.replace(placement, standby=standby)
            elif placement.standby == self.address and self.can_promote(placement.pool_id):
                _, standby = self._choose(self.address, planned)
                new = dataclasses.replace(
                    placement, primary=self.address, standby=standby, epoch=placement.epoch + 1
                )
            else:
                continue
            planned[new.pool_id] = new
            changes.append((placement, new))
        # Side by side: the pools a dead peer held change placement within one etcd round
        # trip, so this replica promotes them together (one checkpoint, Replication.promote)
        # instead of one transaction, and one checkpoint, after the other.
        outcomes = await asyncio.gather(
            *(self.replace(old, new) for old, new in changes), return_exceptions=True
        )
        for (placement, new), won in zip(changes, outcomes, strict=True):
            if isinstance(won, BaseException):  # etcd away: the next listing tries again
                _LOG.warning("failover of pool %s waits: %s", placement.pool_id, won)
                continue
            if won:
                _LOG.warning(
                    "pool %s: %s is primary at epoch %d (standby %s); %s left",
                    new.pool_id,
                    new.primary,
                    new.epoch,
                    new.standby,
                    placement.primary if new.epoch > placement.epoch else placement.standby,
                    extra={"event": "placement_failover", "pool": new.pool_id},
                )

    def _read(
        self,
        key: bytes,
        value: bytes,
        replicas: dict[str, dict[str, Any]] | None,
        placements: dict[str, Placement] | None,
        tombstones: dict[str, int] | None = None,
    ) -> None:
        try:
            if key.startswith(self._replica_prefix) and replicas is not None:
                record = json.loads(value)
                replicas[str(record["address"])] = record
            elif key.startswith(self._placement_prefix) and placements is not None:
                placement = Placement.decode(value)
                placements[placement.pool_id] = placement
            elif key.startswith(self._deleted_prefix) and tombstones is not None:
                tombstones[key[len(self._deleted_prefix) :].decode()] = _tombstone_epoch(value)
        except (ValueError, KeyError, TypeError):
            _LOG.warning("ignoring a malformed cluster record under %r", key)


def _tombstone_epoch(value: bytes) -> int:
    """The epoch a tombstone's value names (raises ValueError, KeyError or TypeError)."""
    return int(json.loads(value)["epoch"])
