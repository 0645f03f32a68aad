"""What ``kvcm serve --etcd-endpoints`` adds to a server: the node, the interceptor, metrics.

:class:`ClusterRuntime` is built before the gRPC server (its interceptor goes in the
server's chain, after authorization and before the journal, so a redirected call is neither
journaled nor run) and joins the cluster once the gRPC port is bound, under the advertise
address; it leaves (revokes its lease) when the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from kvcm.common.errors import ConfigError
from kvcm.server.cluster._etcd import EtcdUnavailableError
from kvcm.server.cluster._fanout import PeerChannels
from kvcm.server.cluster._http_reads import ClusterReads
from kvcm.server.cluster._node import ClusterConfig, ClusterNode
from kvcm.server.cluster._routing import ClusterInterceptor
from kvcm.server.cluster.placement import Placement
from kvcm.server.settings import ServerSettings, parse_etcd_endpoints, split_address
from kvcm.server.tls import etcd_credentials, peer_credentials, tls_files

if TYPE_CHECKING:
    from kvcm.server.cluster.replication import Replication

__all__ = ["ClusterRuntime"]

_LOG = logging.getLogger("kvcm.server.cluster")

_WILDCARDS: Final = frozenset({"", "0.0.0.0", "::", "[::]"})
# How long start-up waits for the first listing of the cluster (so the first CreatePool sees
# the other replicas); a replica that cannot reach etcd starts anyway and keeps trying.
_FIRST_LISTING_S: Final = 2.0
# Seconds between two tries to place the pools a data directory brought back while etcd is away.
_CLAIM_RETRY_S: Final = 1.0


def _peer_http_ssl(settings: ServerSettings) -> ssl.SSLContext | None:
    """How this replica dials peers' HTTPS sides (``GET /v1/pools``' fan-out) when its own
    HTTP side is TLS: as its gRPC channels to peers (:func:`kvcm.server.tls.peer_credentials`),
    their certificates checked against ``tls_peer_ca`` (else ``tls_client_ca``, else the
    system's roots) and the address dialed, this replica's certificate presented."""
    files = tls_files(settings)
    if files is None:
        return None
    ca_path = settings.tls_peer_ca or settings.tls_client_ca
    context = ssl.create_default_context(cafile=ca_path or None)
    context.load_cert_chain(str(files.cert), str(files.key))
    return context


class ClusterRuntime:
    """A server's cluster side.

    Attributes:
        node: Membership and the placement view (a ``PlacementView``).
        interceptor: The gRPC server interceptor (redirects, placement, fan-out).
        reads: The HTTP side's cluster-wide reads and redirects (``build_app(cluster=)``).
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        pool_ids: Callable[[], list[str]],
        has_pool: Callable[[str], bool],
    ) -> None:
        """Prepare from ``settings`` (``etcd_endpoints`` set).

        Args:
            settings: The server's settings.
            pool_ids: This replica's pool ids now.
            has_pool: Whether this replica holds a pool.

        Raises:
            ConfigError: A malformed ``etcd_endpoints``.
        """
        self._settings = settings
        self._pool_ids = pool_ids
        self._has_pool = has_pool
        self.node = ClusterNode(
            ClusterConfig(
                endpoints=parse_etcd_endpoints(settings.etcd_endpoints),
                prefix=settings.etcd_prefix,
                lease_ttl_s=settings.etcd_lease_ttl_s,
                etcd_timeout_s=settings.etcd_timeout_s,
                fanout_timeout_s=settings.cluster_fanout_timeout_s,
                etcd_credentials=etcd_credentials(settings),
            ),
            num_pools=lambda: len(pool_ids()),
        )
        self._peers = PeerChannels(
            settings.limits.max_message_bytes, credentials=peer_credentials(settings)
        )
        self.interceptor = ClusterInterceptor(self.node, self._peers, has_pool=has_pool)
        self.reads = ClusterReads(self.node, self._peers, ssl_context=_peer_http_ssl(settings))
        self._feeding: asyncio.Task[None] | None = None
        self._pool_feeds: dict[str, asyncio.Task[None]] = {}
        self._replication: Replication | None = None
        self._claiming: asyncio.Task[None] | None = None

    def attach(self, replication: Replication) -> None:
        """Drive ``replication`` from etcd (before :meth:`start`): every placement change is
        handed to it in order, and failover is on (a standby holding a live copy takes over a
        pool whose primary left)."""
        from kvcm.server.cluster.replication import Role

        self._replication = replication
        # In etcd's order, deletions included: a deleted placement (the pool was deleted)
        # makes replication drop a copy it does not own and forget the pool's epoch, so a
        # pool created again under that id (epoch 1) is not ignored as older than the
        # deleted one's.
        changes: asyncio.Queue[tuple[str, Placement | None]] = asyncio.Queue()

        def changed(pool_id: str, placement: Placement | None) -> None:
            changes.put_nowait((pool_id, placement))

        # Each pool's changes in order, by a task of its own while it has any; the pools side
        # by side, so that the pools a dead peer held are promoted at once (one checkpoint for
        # all: Replication.promote), not each after the previous one's checkpoint.
        queued: dict[str, list[Placement | None]] = {}
        feeds = self._pool_feeds

        async def take(pool_id: str) -> None:
            placements = queued[pool_id]
            while placements:
                placement = placements.pop(0)
                try:
                    known = replication.pools.get(pool_id)
                    if placement is None:
                        epoch = self.node.deleted_epoch(pool_id)
                        if (
                            epoch is not None
                            and known is not None
                            and known.role is Role.PRIMARY
                            and self._has_pool(pool_id)
                        ):
                            # Deleted through a newer primary while this one was cut off
                            # from etcd: its copy is the deleted pool's.
                            await self._drop_deleted(pool_id, epoch)
                        else:
                            await replication.deleted(pool_id)
                    else:
                        if known is not None and placement.epoch < known.epoch:
                            # etcd only raises a placement's epoch: a lower one is a pool
                            # deleted and created again while this replica did not watch
                            # (down, or its watch broken): the delete it missed.
                            await replication.deleted(pool_id)
                        await replication.set_placement(placement, sync=placement.mode != "async")
                except Exception:
                    _LOG.exception("replication refused placement %s of %s", placement, pool_id)
            del queued[pool_id]  # no await since the last pop: nothing was queued meanwhile
            del feeds[pool_id]

        async def feed() -> None:
            loop = asyncio.get_running_loop()
            while True:
                pool_id, placement = await changes.get()
                queued.setdefault(pool_id, []).append(placement)
                if pool_id not in feeds:
                    feeds[pool_id] = loop.create_task(take(pool_id), name="kvcm-placement")

        def can_promote(pool_id: str) -> bool:
            entry = replication.pools.get(pool_id)
            return entry is not None and entry.role is Role.STANDBY and entry.has_copy

        replacing: set[asyncio.Task[None]] = set()

        async def replace_standby(pool_id: str, standby: str) -> None:
            try:
                await self.node.replace_standby(pool_id, standby)
            except EtcdUnavailableError as exc:  # the next calls' timeouts ask again
                _LOG.warning("replacing the standby of pool %s waits: %s", pool_id, exc)
                entry = replication.pools.get(pool_id)
                if entry is not None and entry.link is not None:
                    entry.link.reported = False

        def standby_stuck(pool_id: str, standby: str) -> None:
            task = asyncio.get_running_loop().create_task(replace_standby(pool_id, standby))
            replacing.add(task)
            task.add_done_callback(replacing.discard)

        self.node.watch(changed)
        self.node.can_promote = can_promote
        replication.lease_fresh = self.node.lease_fresh
        node = self.node
        replication.pool_deleted = lambda pool_id: (
            node.get(pool_id) is None and node.deleted_epoch(pool_id) is not None
        )
        replication.standby_stuck = standby_stuck
        self._feeding = asyncio.get_running_loop().create_task(feed(), name="kvcm-placements")

    async def start(self, grpc_address: str, http_address: str) -> None:
        """Join the cluster as the advertise address (``grpc_address``, the bound one, when
        ``advertise_address`` is empty); claim the pools a data directory brought back that
        etcd does not place, and drop those deleted meanwhile (:meth:`_claim`; tried again in
        the background until etcd answers).

        Raises:
            ConfigError: No advertise address can be derived (a wildcard listen address).
        """
        advertise = self._settings.advertise_address or grpc_address
        host, port = split_address(advertise)
        if host in _WILDCARDS or port == 0:
            raise ConfigError(
                f"advertise_address: peers and clients cannot dial {advertise!r}; set "
                "--advertise-address HOST:PORT (how other replicas and clients reach this one)"
            )
        await self.node.start(advertise, http_address, wait_s=_FIRST_LISTING_S)
        if not await self._claim():
            self._claiming = asyncio.get_running_loop().create_task(
                self._claim_until_done(), name="kvcm-cluster-claim"
            )

    async def drop_deleted(self, replication: Replication) -> None:
        """Before the server serves (and joins): drop the copies of the pools that were deleted
        from the cluster while this replica was down, as etcd's tombstones say, so that none
        is ever served again (a cluster replica's data directory: one with a
        ``replication.json``; a lone server's pools are claimed instead). When etcd cannot be
        reached the pools wait unplaced, and :meth:`start`'s claim decides in its transaction
        once etcd answers."""
        self._replication = replication
        if not replication.had_roles:
            return  # a first start, or a lone server's data directory
        try:
            tombstones = await self.node.read_tombstones()
        except Exception as exc:
            _LOG.warning("reading the deleted pools' tombstones waits for etcd: %r", exc)
            return
        held = set(replication.pools) | set(self._pool_ids())
        for pool_id in sorted(held & set(tombstones)):
            await self._drop_deleted(pool_id, tombstones[pool_id])

    async def _claim(self) -> bool:
        """Settle every pool this replica holds, or held a role for, that etcd does not place:

        * a copy of a pool in a cluster replica's data directory (one with a
          ``replication.json``) is placed again (this replica its primary) unless etcd holds
          the pool's tombstone, in one etcd transaction (:meth:`ClusterNode.claim`): then it
          was deleted while this replica was away, and the copy is dropped, journaled
          (:meth:`Replication.drop_deleted`); a role without a copy (a standby's) is
          forgotten;
        * a pool of a lone server's data directory (no ``replication.json``) joining a cluster
          is placed, its id's tombstone, if any, removed.

        Returns whether every pool was settled (``False``: etcd could not be reached).
        """
        node, replication = self.node, self._replication
        roles = set(replication.pools) if replication is not None else set()
        try:
            for pool_id in sorted(set(self._pool_ids()) | roles):
                if node.get(pool_id) is not None:
                    continue
                clustered = replication is not None and (
                    replication.had_roles or pool_id in replication.pools
                )
                if not self._has_pool(pool_id):
                    epoch = node.deleted_epoch(pool_id)
                    if clustered and epoch is not None:
                        await self._drop_deleted(pool_id, epoch)  # its role and epoch
                    continue
                if not clustered:
                    await node.place(pool_id, primary=node.address)
                    continue
                role = replication.pools.get(pool_id) if replication is not None else None
                mode = "async" if role is not None and not role.sync else "sync"
                # Above the epoch the data directory knows: a replica that followed the pool
                # at that epoch takes the claim as the pool's next term, not as a pool deleted
                # and created again (whose copies are dropped).
                epoch = role.epoch + 1 if role is not None and role.epoch >= 1 else 1
                outcome = await node.claim(pool_id, mode=mode, epoch=epoch)
                if not isinstance(outcome, Placement):
                    await self._drop_deleted(pool_id, outcome)
        except Exception as exc:  # etcd away (or an answer aetcd could not take): again later
            _LOG.warning(
                "the pools the data directory brought back wait for etcd to be placed: %r", exc
            )
            return False
        return True

    async def _claim_until_done(self) -> None:
        while not await self._claim():
            await asyncio.sleep(_CLAIM_RETRY_S)

    async def _drop_deleted(self, pool_id: str, epoch: int) -> None:
        """Drop the copy (and forget the role) of a pool deleted from the cluster while this
        replica was away; a copy dropped is counted and logged."""
        replication = self._replication
        if replication is None or not await replication.drop_deleted(pool_id):
            return
        self.node.stats.deleted_pools_dropped += 1
        _LOG.warning(
            "pool %s was deleted from the cluster while this replica was away (its placement "
            "at epoch %d): the copy here is dropped, journaled, not placed again",
            pool_id,
            epoch,
            extra={"event": "deleted_pool_dropped", "pool": pool_id, "placement_epoch": epoch},
        )

    async def stop(self) -> None:
        """Leave the cluster and close the peer channels."""
        if self._claiming is not None:
            self._claiming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._claiming
        await self.node.stop()
        feeds = list(self._pool_feeds.values())
        for task in feeds:
            task.cancel()
        await asyncio.gather(*feeds, return_exceptions=True)
        if self._feeding is not None:
            self._feeding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._feeding
        await self._peers.close()
        await self.reads.close()

    def samples(self) -> dict[str, list[tuple[list[str], float]]]:
        """The ``kvcm_cluster_*`` samples (see docs/metrics.md)."""
        node = self.node
        stats = node.stats
        address = node.address
        primaries = sum(1 for p in node.placements().values() if p.primary == address)
        return {
            "kvcm_cluster_etcd_session_up": [([], 1.0 if node.etcd_up else 0.0)],
            "kvcm_cluster_etcd_session_losses_total": [([], float(stats.session_losses))],
            "kvcm_cluster_standby_replacements_total": [([], float(stats.standby_replacements))],
            "kvcm_cluster_deleted_pools_dropped_total": [([], float(stats.deleted_pools_dropped))],
            "kvcm_cluster_replicas": [([], float(len(node.replicas)))],
            "kvcm_cluster_primary_pools": [([], float(primaries))],
            "kvcm_cluster_redirects_total": [
                ([method], float(count)) for method, count in sorted(stats.redirects.items())
            ],
            "kvcm_cluster_placement_changes_total": [([], float(stats.placement_changes))],
            "kvcm_cluster_placement_failures_total": [([], float(stats.placement_failures))],
            "kvcm_cluster_fanout_missed_total": [
                ([method], float(count)) for method, count in sorted(stats.fanout_missed.items())
            ],
        }
