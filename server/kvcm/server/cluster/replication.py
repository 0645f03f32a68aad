"""A hot standby for every pool: the primary ships each applied record, the standby replays it.

The core is deterministic, so a standby that applies the records its primary applied, in the
same order and each with the time its events were stamped with, holds the same pool: the same
state, block ids, events and event sequence numbers. :class:`Replication` is both sides of it
for one replica (see docs/replication.md):

* **Primary.** The journal (:class:`~kvcm.server.rpc._durability.JournalInterceptor`, and
  :meth:`Journal.append` for changes the server makes itself: lease reclaims, registration
  rounds) tells :meth:`Replication.applied` about each record right after it was applied, before
  anything else can touch the pool. Each pool with a standby has a :class:`_Link`: a
  ``ShipRecords`` stream to the standby that first seeds it (a snapshot taken while the pool is
  held, as of the last record numbered) and then sends every record, numbered 1, 2, 3... after
  the seed's. In ``sync`` mode the call's answer waits until the standby acknowledged its record
  (a later acknowledgement covers every earlier record); in ``async`` mode only for the local
  journal.
* **Standby.** :meth:`Replication.ship_records` (the ``ShipRecords`` handler) installs seeds and
  runs records through the journal's replay path; every ``digest_every`` records the primary
  sends the pool's digest after the record and the standby compares its own (a mismatch drops
  its copy and asks for a new seed). A standby pool publishes nothing on the ZMQ wire, reclaims
  no lease and is in no checkpoint (:attr:`ServerState.standby_pools`).
* **Epochs and fencing.** Every message carries the pool's placement epoch. A replica refuses a
  message with an older epoch than it knows (``SHIP_STATUS_STALE_EPOCH``); a primary that sees a
  newer epoch steps down at once (:meth:`Replication.demote`): its waiting calls and every later
  call on the pool answer UNAVAILABLE, so a primary that was paused or cut off while another was
  promoted acknowledges nothing more. :meth:`Replication.promote` makes a standby the primary
  (after a checkpoint, so its own journal then covers the pool).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import grpc

from kvcm.common.errors import ConfigError, KVCMError, NotFoundError
from kvcm.core.pool import Pool
from kvcm.core.pool_types import PoolState
from kvcm.core.snapshot import decode_pool, encode_pool
from kvcm.server.cluster.placement import Placement
from kvcm.server.journal import JournalRecord
from kvcm.server.rpc import (
    AbortRpc,
    PoolRuntime,
    ServerState,
    checkpoint_live,
    decode_transfers,
    delete_pool_journaled,
    encode_transfers,
    replay_records,
)
from kvcm.v1 import admin_pb2, replica_pb2, replica_pb2_grpc
from kvcm.wire import pool_config_from_proto

__all__ = [
    "DIGEST_EVERY_ENV",
    "EPOCH_METADATA",
    "REPLICA_TOKEN_ENV",
    "STATE_FILE",
    "SYNC_TIMEOUT_ENV",
    "PromotionRefusedError",
    "ReplicaState",
    "Replication",
    "Role",
    "pool_digest",
    "read_state",
]

_LOG = logging.getLogger("kvcm.server.replication")

REPLICA_TOKEN_ENV: Final = "KVCM_REPLICA_TOKEN"
"""The bearer token a replica presents to its peers (a ``replica:*`` token, when auth is on)."""
EPOCH_METADATA: Final = "kvcm-epoch"
"""The trailing-metadata key of an answer's placement epoch (a replicated pool's answers)."""
DIGEST_EVERY_ENV: Final = "KVCM_REPLICA_DIGEST_EVERY"
"""Overrides ``digest_every`` (records between two digest checks; 0: only at seeds)."""
STATE_FILE: Final = "replication.json"
"""This replica's roles and placement epochs, in the data directory (kept across restarts)."""
SYNC_TIMEOUT_ENV: Final = "KVCM_REPLICA_SYNC_TIMEOUT_S"
"""Overrides ``sync_timeout_s`` (seconds a sync call waits for its standby)."""

_SEED_CHUNK: Final = 1 << 20  # bytes of snapshot per seed message
# Sync calls that timed out waiting for the standby, with no acknowledgement in between, after
# which the primary asks placement for another standby (Replication.standby_stuck).
_STUCK_TIMEOUTS: Final = 3
_MAX_UNACKED: Final = 65_536  # records in flight to a standby before the link is reseeded
_BACKOFF_S: Final = (0.05, 1.0)  # reconnect backoff: first, most
_STOP_POLL_S: Final = 0.25  # how often an idle ShipRecords stream looks for a server stop
# How long a promotion's checkpoint waits before it begins, so that the pools whose placements
# arrive together (one etcd watch message after another) share it.
_PROMOTION_GATHER_S: Final = 0.02


class Role(enum.Enum):
    """A replica's role for one pool."""

    NONE = "none"
    """No placement: the pool is served here alone, as without replication."""
    PRIMARY = "primary"
    """The pool is served here and shipped to its standby (if any)."""
    PROMOTING = "promoting"
    """Being promoted: calls wait for the checkpoint that makes the pool durable here."""
    STANDBY = "standby"
    """The pool follows its primary's records; clients' mutations are refused."""
    FENCED = "fenced"
    """A newer epoch deposed this replica: nothing on the pool is acknowledged here."""


def read_state(data: bytes, path: Path) -> list[ReplicaState]:
    """The pools' roles and epochs a ``replication.json`` (at ``path``, for the message) holds.

    Raises:
        ConfigError: It is not such a file: one line naming it and what is wrong.
    """
    try:
        rows = json.loads(data)
        entries = [
            ReplicaState(
                str(pool_id),
                role=Role(row["role"]),
                epoch=int(row["epoch"]),
                primary=str(row["primary"]),
                standby=str(row["standby"]),
                sync=bool(row["sync"]),
            )
            for pool_id, row in rows.items()
        ]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"data_dir: {path} is damaged: {exc!r}") from None
    return entries


def pool_digest(pool: Pool) -> bytes:
    """A 16-byte digest of everything any call can change in ``pool`` (O(state)).

    The digest of :meth:`kvcm.core.pool.Pool.state_fingerprint`: equal on two replicas exactly
    when their copies are (event log and its timestamps included). The manager's pending
    prefix-cache counters are drained into the pool's totals first (as any read of the pool's
    statistics does), so a read on one replica does not make it differ.
    """
    pool.snapshot()  # drains the pending counters: their sum is what any call observes
    return hashlib.blake2b(pool.state_fingerprint(), digest_size=16).digest()


@dataclass(slots=True)
class ReplicaState:
    """One pool's replication state on this replica.

    Attributes:
        pool_id: The pool.
        role: This replica's role for it.
        epoch: The placement epoch this replica knows.
        primary: The primary's address (``""``: unknown).
        standby: The standby's address (``""``: none).
        sync: Whether answers wait for the standby (else only for the local journal).
        applied: Standby: the last record applied (0: none, or no copy yet).
        has_copy: Standby: whether it holds a seeded copy it can continue.
        digest_checks: Digest comparisons passed (standby).
        digest_mismatches: Digest comparisons failed (standby; each asked for a seed).
        link: Primary: the stream to the standby.
        seed_chunks: Standby: the chunks of a seed being received.
        stream: Standby: the token of the stream that may change the copy (its last hello's:
            an older stream still open is answered NEED_SEED and changes nothing).
    """

    pool_id: str
    role: Role = Role.NONE
    epoch: int = 0
    primary: str = ""
    standby: str = ""
    sync: bool = True
    applied: int = 0
    has_copy: bool = False
    digest_checks: int = 0
    digest_mismatches: int = 0
    link: _Link | None = None
    seed_chunks: list[bytes] = field(default_factory=list)
    stream: object = None


class Replication:
    """Both sides of replication on one replica (see the module docstring).

    Args:
        state: The server's state.
        address: This replica's address as placements name it (``host:port``).
        digest_every: The primary sends its pool's digest every this many records (0: never;
            seeds always carry one).
        sync_timeout_s: How long a ``sync`` call waits for its standby before answering
            UNAVAILABLE (it is applied and journaled here; a retry of a Step with the same
            step_seq is answered once the standby has it).
        directory: The data directory: each pool's role and placement epoch are kept in its
            ``replication.json`` (written at every change, atomically) and read back here, so
            a replica that restarts neither forgets that it stepped down nor acknowledges on
            an old epoch. A standby comes back with no copy (it is seeded again); a pool being
            promoted when the process died comes back as such a standby.
    """

    def __init__(
        self,
        state: ServerState,
        address: str,
        *,
        digest_every: int = 256,
        sync_timeout_s: float = 5.0,
        directory: Path | None = None,
    ) -> None:
        """Replication for ``state``, this replica being ``address``.

        Raises:
            ConfigError: An override variable is not a number in range, or ``directory``'s
                ``replication.json`` is damaged (one line naming it).
        """
        self.state = state
        self.address = address
        raw = os.environ.get(DIGEST_EVERY_ENV, "")
        if raw:
            if not raw.isdigit():
                raise ConfigError(f"{DIGEST_EVERY_ENV}: must be an integer >= 0, got {raw!r}")
            digest_every = int(raw)
        raw = os.environ.get(SYNC_TIMEOUT_ENV, "")
        if raw:
            try:
                sync_timeout_s = float(raw)
            except ValueError:
                sync_timeout_s = -1.0
            if not 0 < sync_timeout_s < 3600:
                raise ConfigError(f"{SYNC_TIMEOUT_ENV}: must be seconds in (0, 3600), got {raw!r}")
        self.digest_every = digest_every
        self.sync_timeout_s = sync_timeout_s
        self.pools: dict[str, ReplicaState] = {}
        self.token = os.environ.get(REPLICA_TOKEN_ENV, "")
        self._channels: dict[str, grpc.aio.Channel] = {}
        #: Makes the TLS credentials of a channel to a peer (``None``: plaintext; set by the
        #: server from ``tls_cert``, see :func:`kvcm.server.tls.peer_credentials`).
        self.credentials: Callable[[], grpc.ChannelCredentials] | None = None
        #: Called with ``(pool_id, standby)`` when a ``sync`` pool's standby has let
        #: ``_STUCK_TIMEOUTS`` calls in a row time out (live in etcd but not acknowledging):
        #: the primary's placement replaces it (a cluster's, set by the runtime; ``None``:
        #: static placements, the operator's to change).
        self.standby_stuck: Callable[[str, str], None] | None = None
        #: Whether this replica's etcd lease is surely still live and names it the pool's
        #: primary at the epoch (``(pool_id, epoch)``; a cluster's, set by the runtime): an
        #: ``async`` pool's primary acknowledges nothing once it may have expired (its standby
        #: may have been promoted). ``None``: no lease (static placements).
        self.lease_fresh: Callable[[str, int], bool] | None = None
        #: Whether the pool was deleted from the cluster and not placed again (its tombstone
        #: in etcd, no placement; a cluster's, set by the runtime): a primary's message for a
        #: pool this replica knows nothing of is then refused, so that a seed in flight when
        #: the pool was deleted does not leave a copy behind. ``None``: never.
        self.pool_deleted: Callable[[str], bool] | None = None
        self.failovers = 0  # promotions of this replica
        self.fenced = 0  # times this replica stepped down
        self.directory = directory
        #: Whether the data directory held a ``replication.json`` at start: it is a cluster
        #: replica's (its pools were placed), not a lone server's.
        self.had_roles = False
        self._saved = b""
        # Promotions share checkpoints: the one not begun yet (every pool promoted before it
        # begins is in it), and the one being taken.
        self._next_checkpoint: asyncio.Future[None] | None = None
        self._checkpointing: asyncio.Task[None] | None = None
        if directory is not None:
            self._load(directory / STATE_FILE)

    def _load(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ConfigError(f"data_dir: cannot read {path}: {exc.strerror or exc}") from None
        entries = read_state(data, path)
        self.had_roles = True
        for entry in entries:
            if entry.role is Role.PROMOTING:
                entry.role = Role.STANDBY  # its checkpoint may not be written: seed it again
            if entry.role is not Role.PRIMARY:
                self.state.standby_pools.add(entry.pool_id)
            self.pools[entry.pool_id] = entry
        self._saved = data
        for entry in entries:
            self._relink(entry)

    def _save(self) -> None:
        """Write every pool's role and epoch to ``replication.json`` (when they changed):
        beside it, fsynced, renamed over it. A failure is logged; the roles in memory hold."""
        directory = self.directory
        if directory is None:
            return
        rows = {
            pool_id: {
                "role": entry.role.value,
                "epoch": entry.epoch,
                "primary": entry.primary,
                "standby": entry.standby,
                "sync": entry.sync,
            }
            for pool_id, entry in sorted(self.pools.items())
            if entry.role is not Role.NONE
        }
        data = json.dumps(rows, sort_keys=True).encode()
        if data == self._saved:
            return
        temporary = directory / (STATE_FILE + ".tmp")
        try:
            with temporary.open("wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            temporary.replace(directory / STATE_FILE)
            descriptor = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        except OSError as exc:
            _LOG.error(
                "replication: cannot write %s: %s; a restart would forget the roles since",
                directory / STATE_FILE,
                exc.strerror or exc,
            )
            return
        self._saved = data

    # -- placement ------------------------------------------------------------------------------

    def entry(self, pool_id: str) -> ReplicaState:
        """The pool's replication state (created empty: role NONE)."""
        found = self.pools.get(pool_id)
        if found is None:
            found = self.pools[pool_id] = ReplicaState(pool_id)
        return found

    async def set_placement(self, placement: Placement | None, *, sync: bool = True) -> Role:
        """Take ``placement`` (a :class:`PlacementView` callback's, or a test's) as the pool's.

        ``None`` forgets the pool's placement (the pool was deleted from the cluster). A
        placement older than the epoch known is ignored. Returns the role now.
        """
        if placement is None:
            return Role.NONE
        pool_id = placement.pool_id
        entry = self.entry(pool_id)
        epoch = placement.epoch
        if epoch < entry.epoch:
            return entry.role
        promotes = placement.primary == self.address and epoch > entry.epoch
        if promotes and entry.role in (Role.STANDBY, Role.FENCED):
            self._check_promotable(entry, epoch)  # before anything changes
        entry.sync = sync
        entry.primary = placement.primary
        entry.standby = placement.standby or ""
        if placement.primary == self.address:
            if entry.role in (Role.STANDBY, Role.FENCED):
                if epoch > entry.epoch:
                    await self.promote(pool_id, epoch)
                return entry.role
            if entry.role is not Role.PROMOTING:
                entry.role = Role.PRIMARY
            entry.epoch = epoch
            self.state.standby_pools.discard(pool_id)
            self._relink(entry)
        elif placement.standby == self.address:
            if entry.role in (Role.PRIMARY, Role.PROMOTING):
                self.demote(pool_id, epoch, standby=True)
            elif entry.role is not Role.STANDBY or epoch > entry.epoch:
                self._become_standby(entry, epoch)
        else:
            if entry.role in (Role.PRIMARY, Role.PROMOTING, Role.STANDBY):
                self.demote(pool_id, epoch, standby=False)
            entry.epoch = max(entry.epoch, epoch)
        self._save()
        return entry.role

    def _become_standby(self, entry: ReplicaState, epoch: int) -> None:
        if entry.role is not Role.STANDBY or epoch > entry.epoch:
            entry.has_copy = False
            entry.applied = 0
        entry.role = Role.STANDBY
        entry.epoch = max(entry.epoch, epoch)
        self.state.standby_pools.add(entry.pool_id)
        self._unlink(entry, None)
        self._save()

    async def promote(self, pool_id: str, epoch: int) -> None:
        """Make this replica the pool's primary at ``epoch`` (the hook placement calls once
        its etcd transaction raised the epoch).

        The pool stops following, its lease starts now, and a checkpoint is taken so that the
        journal here covers it from now on; client calls wait (UNAVAILABLE "promoting") until
        then. An ``epoch`` not newer than the one known is refused.

        Raises:
            PromotionRefusedError: ``epoch`` is not newer than the pool's epoch here, or this
                replica holds no copy it can serve: a standby never seeded (or whose copy was
                dropped), or a primary that stepped down (its copy may hold calls the new
                primary never had). Nothing changed; seed it as a standby first.
        """
        entry = self.entry(pool_id)
        self._check_promotable(entry, epoch)
        started = time.monotonic()
        state = self.state
        entry.role = Role.PROMOTING
        entry.epoch = epoch
        entry.primary = self.address
        entry.has_copy = False
        self._unlink(entry, None)
        state.standby_pools.discard(pool_id)
        state.activity[pool_id] = state.clock.now()

        def promoting() -> bool:
            return entry.role is Role.PROMOTING and entry.epoch == epoch

        if state.journal is not None and pool_id in state.registry:
            await self._checkpoint_after_now()
        if not promoting():
            return  # stepped down (a newer epoch) while the checkpoint was taken
        entry.role = Role.PRIMARY
        self._save()
        self.failovers += 1
        _LOG.warning(
            "promoted to primary",
            extra={
                "event": "replica_promoted",
                "pool": pool_id,
                "placement_epoch": epoch,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        self._relink(entry)

    async def _checkpoint_after_now(self) -> None:
        """Wait for a live checkpoint that begins after this call (it holds every pool not a
        standby's, so every pool promoted before it begins is then durable here).

        Promotions share it: a replica that takes over several pools at once (its peer died)
        writes one checkpoint for all of them, not one after the other (each O(every pool's
        state), the kept event logs included), which made the last pool's failover grow with
        the number of pools and their logs.
        """
        waiting = self._next_checkpoint
        if waiting is None:
            waiting = self._next_checkpoint = asyncio.get_running_loop().create_future()
            previous = self._checkpointing
            self._checkpointing = asyncio.get_running_loop().create_task(
                self._take_checkpoint(waiting, previous), name="kvcm-promotion-checkpoint"
            )
        await asyncio.shield(waiting)

    async def _take_checkpoint(
        self, done: asyncio.Future[None], previous: asyncio.Task[None] | None
    ) -> None:
        state = self.state
        journal = state.journal
        try:
            if previous is not None:  # one round at a time: the next one begins after it
                with contextlib.suppress(BaseException):
                    await previous
            await asyncio.sleep(_PROMOTION_GATHER_S)
            if self._next_checkpoint is done:
                self._next_checkpoint = None  # promotions from now on wait for the next one
            while journal is not None:
                while journal.gate is not None:  # another checkpoint is being taken
                    await journal.gate.wait()
                try:
                    if await checkpoint_live(state, journal):
                        break
                    await asyncio.sleep(0.05)  # postponed: calls were still running
                except OSError as exc:  # a full or failing disk: the calls wait, try again
                    _LOG.error("a promotion waits for a checkpoint: %s", exc)
                    await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            done.cancel()
            raise
        except Exception as exc:
            if not done.done():
                done.set_exception(exc)
                done.exception()
            raise
        finally:
            if self._next_checkpoint is done:
                self._next_checkpoint = None
        if not done.done():
            done.set_result(None)

    def _check_promotable(self, entry: ReplicaState, epoch: int) -> None:
        pool_id = entry.pool_id
        if epoch <= entry.epoch and entry.role is not Role.NONE:
            raise PromotionRefusedError(
                f"promote({pool_id!r}, {epoch}): placement_epoch: the pool's epoch here is "
                f"{entry.epoch}; a promotion needs a newer one"
            )
        if entry.role is Role.FENCED or (entry.role is Role.STANDBY and not entry.has_copy):
            why = "stepped down" if entry.role is Role.FENCED else "has no seeded copy"
            raise PromotionRefusedError(
                f"promote({pool_id!r}, {epoch}): this replica ({self.address}) {why}: "
                "promoting it would lose acknowledged calls; make it the standby first"
            )

    def demote(self, pool_id: str, epoch: int, *, standby: bool = False) -> None:
        """Step down from the pool at ``epoch`` (a newer primary exists): nothing on it is
        acknowledged here any more. Calls waiting for their standby answer UNAVAILABLE; the
        pool's copy stays (reads only) until a seed replaces it (``standby``) or forever.

        An ``epoch`` older than the one known is ignored.
        """
        entry = self.entry(pool_id)
        if epoch < entry.epoch:
            return
        was = entry.role
        entry.epoch = max(entry.epoch, epoch)
        reason = (
            f"pool {pool_id!r}: this replica ({self.address}) is no longer its primary "
            f"(placement epoch {entry.epoch}"
            f"{f', primary {entry.primary}' if entry.primary != self.address else ''}): "
            "nothing more is acknowledged here; call the primary"
        )
        self._unlink(entry, reason)
        self.state.standby_pools.add(pool_id)
        if standby:
            self._become_standby(entry, epoch)
        else:
            entry.role = Role.FENCED
            entry.has_copy = False
            self._save()
        if was in (Role.PRIMARY, Role.PROMOTING):
            self.fenced += 1
            _LOG.warning(
                "stepped down: a newer placement epoch exists",
                extra={"event": "replica_fenced", "pool": pool_id, "placement_epoch": epoch},
            )

    # -- the journal's hooks ----------------------------------------------------------------------

    def admit(self, method: str, pool_id: str) -> None:
        """Refuse a client's mutating call on a pool this replica does not serve.

        Raises:
            AbortRpc: UNAVAILABLE naming the primary and the placement epoch.
        """
        entry = self.pools.get(pool_id)
        if entry is None or entry.role in (Role.PRIMARY, Role.NONE):
            return
        if entry.role is Role.PROMOTING:
            raise AbortRpc(
                grpc.StatusCode.UNAVAILABLE,
                f"{method}: pool {pool_id!r} is being promoted here (placement epoch "
                f"{entry.epoch}): nothing was done, retry in a moment",
            )
        primary = entry.primary if entry.primary and entry.primary != self.address else "unknown"
        raise AbortRpc(
            grpc.StatusCode.UNAVAILABLE,
            f"{method}: pool {pool_id!r} is not served by this replica ({self.address}, "
            f"{entry.role.value}); its primary is {primary} (placement epoch {entry.epoch}): "
            "nothing was done",
        )

    def applied(
        self, method: str, pool_id: str, request: bytes, when: float
    ) -> Awaitable[None] | None:
        """Record ``method`` on ``pool_id`` was just applied (no await since): ship it.

        Returns what a ``sync`` call's answer waits for (``None``: nothing).
        """
        entry = self.pools.get(pool_id)
        if entry is None or entry.role is Role.NONE:
            return None
        if entry.role is not Role.PRIMARY:
            return _failed(
                f"{method}: pool {pool_id!r}: this replica ({self.address}) stepped down "
                f"(placement epoch {entry.epoch}) before the call was replicated: it is not "
                "acknowledged; call the primary"
            )
        link = entry.link
        if link is None:
            return None
        pending = link.add(method, request, when, wait=entry.sync)
        if pending is None and self.lease_fresh is not None:
            return self._leased(method, pool_id, entry.epoch)  # async: fenced by the lease
        return pending

    async def _leased(self, method: str, pool_id: str, epoch: int) -> None:
        """An ``async`` pool's answer, just before it goes: refused once this replica's etcd
        lease may have expired (its standby may be the primary now and never see this call:
        shipped, it is refused there by the new epoch)."""
        fresh = self.lease_fresh
        if fresh is not None and not fresh(pool_id, epoch):
            raise AbortRpc(
                grpc.StatusCode.UNAVAILABLE,
                f"{method}: pool {pool_id!r}: this replica ({self.address}) has not renewed its "
                "etcd lease in time, so its standby may have taken the pool over: the call is "
                "not acknowledged (an async pool's primary answers only under a live lease); "
                "retry a Step with the same step_seq",
            )

    def call_applied(
        self, method: str, pool_id: str, request: bytes, when: float
    ) -> Awaitable[None] | None:
        """A call a servicer journals itself (``Journal.on_call``: TransferService) was just
        applied (no await since): ship it; returns what its answer awaits first (a ``sync``
        pool's standby acknowledgement, :meth:`wait_replicated`), or ``None``."""
        pending = self.applied(method, pool_id, request, when)
        return None if pending is None else self.wait_replicated(pending, method, pool_id)

    def stamp(self, pool_id: str, context: Any) -> None:
        """Put the pool's placement epoch in an answer's trailing metadata (a pool with a
        placement only): a client sees which epoch acknowledged its call."""
        entry = self.pools.get(pool_id)
        if entry is not None and entry.epoch:
            context.set_trailing_metadata(((EPOCH_METADATA, str(entry.epoch)),))

    def changed(self, method: str, pool_id: str, request: bytes, when: float) -> None:
        """A change the server made itself was just recorded (``Journal.on_change``: a lease
        reclaim, a registration round): ship it (nobody's answer waits for it)."""
        entry = self.pools.get(pool_id)
        if entry is not None and entry.role is Role.PRIMARY and entry.link is not None:
            entry.link.add(method, request, when, wait=False)

    async def wait_replicated(self, pending: Awaitable[None], method: str, pool_id: str) -> None:
        """Wait for ``pending`` (from :meth:`applied`) up to ``sync_timeout_s``.

        Raises:
            AbortRpc: UNAVAILABLE when the standby did not confirm in time or this replica
                stepped down meanwhile.
        """
        try:
            await asyncio.wait_for(asyncio.shield(pending), self.sync_timeout_s)
        except TimeoutError:
            entry = self.pools.get(pool_id)
            standby = entry.standby if entry is not None else "?"
            link = entry.link if entry is not None else None
            if link is not None and entry is not None and entry.role is Role.PRIMARY:
                link.timeouts += 1
                stuck = self.standby_stuck
                if link.timeouts >= _STUCK_TIMEOUTS and not link.reported and stuck is not None:
                    link.reported = True
                    _LOG.warning(
                        "standby %s let %d calls in a row time out: asking for another",
                        link.standby,
                        link.timeouts,
                        extra={"event": "replica_standby_stuck", "pool": pool_id},
                    )
                    stuck(pool_id, link.standby)
            raise AbortRpc(
                grpc.StatusCode.UNAVAILABLE,
                f"{method}: pool {pool_id!r}: the standby {standby} did not confirm the "
                f"record within {self.sync_timeout_s:g} s; it is applied and journaled here "
                "and is acknowledged once the standby has it (retry a Step with the same "
                "step_seq)",
            ) from None

    # -- the primary's links ----------------------------------------------------------------------

    def _relink(self, entry: ReplicaState) -> None:
        if entry.role is not Role.PRIMARY:
            return
        link = entry.link
        if link is not None and link.standby == entry.standby and link.epoch == entry.epoch:
            return
        marks = link.marks if link is not None else None
        # A sync pool's calls waiting for the old standby wait for the new one's seed, which
        # holds their records: acknowledged once a standby has them (no new standby: released).
        waiting = link.take_waiters() if link is not None and entry.standby and entry.sync else []
        entry.link = None
        if link is not None:
            link.close(None, release=not (entry.standby and entry.sync))
        if entry.standby:
            entry.link = new = _Link(self, entry.pool_id, entry.standby, entry.epoch)
            new.waiters.extend((0, future) for future in waiting)
            if entry.sync:  # its KV events go out once the standby has their records
                self.state.hold_events(entry.pool_id)
                new.holds = True
                if marks:  # the old standby's unacknowledged ones: the new one's seed has them
                    new.marks.append((0, *marks[-1][1:]))

    def _unlink(self, entry: ReplicaState, reason: str | None) -> None:
        link, entry.link = entry.link, None
        if link is not None:
            link.close(reason)

    def forget(self, pool_id: str) -> None:
        """Drop everything known of ``pool_id`` (its placement was deleted with the pool):
        its link stops (waiting calls are released), and a pool created again under that id
        starts from placement epoch 1 here."""
        entry = self.pools.pop(pool_id, None)
        if entry is not None:
            self._unlink(entry, None)
        self.state.standby_pools.discard(pool_id)
        self._save()

    async def deleted(self, pool_id: str) -> None:
        """The pool's placement was deleted with the pool: drop a copy this replica holds but
        does not own (a stepped-down primary's kept for reads, a standby's whose
        ``DeletePool`` record never came), then :meth:`forget` the pool. Without this such a
        copy would be served as a local pool once forgotten."""
        state = self.state
        registry = state.registry
        if pool_id in state.standby_pools and pool_id in registry:
            with contextlib.suppress(KVCMError):
                old = await state.pool(pool_id)  # once no worker thread holds it
                if pool_id in state.standby_pools and self._pool(pool_id) is old:
                    registry.delete(pool_id)  # still a standby's: publishes nothing
                    state.progress.forget(pool_id)
                    state.retire(old)
                    state.transfer_book.drop_pool(pool_id)
        self.forget(pool_id)

    async def drop_deleted(self, pool_id: str) -> bool:
        """Drop this replica's copy of a pool deleted from the cluster while this replica was
        away (etcd holds its tombstone and no placement): the copy is deleted as a client's
        ``DeletePool`` deletes it, journaled (a restart does not bring it back), publishing
        nothing (the primary that deleted the pool published its ``AllBlocksCleared``), and
        the pool's role and epoch are forgotten. Returns whether a copy was dropped."""
        state = self.state
        dropped = False
        if pool_id in state.registry:
            state.standby_pools.add(pool_id)  # not served here: its deletion publishes nothing
            dropped = await delete_pool_journaled(state, pool_id)
            state.transfer_book.drop_pool(pool_id)
        self.forget(pool_id)
        return dropped

    def samples(self) -> dict[str, list[tuple[list[str], float]]]:
        """The ``kvcm_replication_*`` samples by metric name (``(label values, value)``)."""
        roles: list[tuple[list[str], float]] = []
        lag_records: list[tuple[list[str], float]] = []
        lag_seconds: list[tuple[list[str], float]] = []
        seeds: list[tuple[list[str], float]] = []
        mismatches: list[tuple[list[str], float]] = []
        for pool_id, entry in sorted(self.pools.items()):
            if entry.role is Role.NONE:
                continue
            roles.append(([pool_id, entry.role.value], 1.0))
            link = entry.link
            if link is not None:
                records, age = link.lag()
                lag_records.append(([pool_id], float(records)))
                lag_seconds.append(([pool_id], age))
                seeds.append(([pool_id], float(link.seeds)))
            if entry.role is Role.STANDBY:
                mismatches.append(([pool_id], float(entry.digest_mismatches)))
        return {
            "kvcm_replication_role": roles,
            "kvcm_replication_lag_records": lag_records,
            "kvcm_replication_lag_seconds": lag_seconds,
            "kvcm_replication_seeds_total": seeds,
            "kvcm_replication_digest_mismatches_total": mismatches,
            "kvcm_replication_promotions_total": [([], float(self.failovers))],
            "kvcm_replication_stepdowns_total": [([], float(self.fenced))],
        }

    def channel(self, address: str) -> grpc.aio.Channel:
        """A channel to the replica at ``address`` (kept)."""
        channel = self._channels.get(address)
        if channel is None:
            options = [
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ]
            if self.credentials is None:
                channel = grpc.aio.insecure_channel(address, options=options)
            else:
                channel = grpc.aio.secure_channel(address, self.credentials(), options=options)
            self._channels[address] = channel
        return channel

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata of a call to a peer (its bearer token, when set)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    async def close(self) -> None:
        """Stop every link and close the channels."""
        tasks = [entry.link.task for entry in self.pools.values() if entry.link is not None]
        for entry in self.pools.values():
            self._unlink(entry, "the server is stopping")
        await asyncio.gather(*tasks, return_exceptions=True)  # each ended before the loop
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # -- the standby's side -----------------------------------------------------------------------

    async def ship_records(
        self, requests: AsyncIterator[replica_pb2.ShipRecordsRequest]
    ) -> AsyncIterator[replica_pb2.ShipRecordsResponse]:
        """The ``ShipRecords`` handler: apply what the primary ships, answer each message.

        Ends when the server stops serving (a graceful stop need not wait its grace for the
        primary's stream; the primary reconnects, and seeds, when this replica is back).
        """
        iterator = aiter(requests)
        streams: dict[str, object] = {}  # this stream's token per pool (from its hello)
        pending: asyncio.Future[Any] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(iterator, None))
                done, _ = await asyncio.wait((pending,), timeout=_STOP_POLL_S)
                if not done:
                    if not self.state.serving:
                        return
                    continue
                request, pending = pending.result(), None
                if request is None:
                    return
                answer = await self._receive(request, streams)
                if answer is not None:
                    yield answer
        finally:
            if pending is not None:
                pending.cancel()

    def _answer(
        self, entry: ReplicaState, status: int, detail: str = ""
    ) -> replica_pb2.ShipRecordsResponse:
        return replica_pb2.ShipRecordsResponse(
            pool_id=entry.pool_id,
            placement_epoch=entry.epoch,
            seq=entry.applied,
            status=status,  # type: ignore[arg-type]
            detail=detail,
        )

    async def _receive(
        self, request: replica_pb2.ShipRecordsRequest, streams: dict[str, object]
    ) -> replica_pb2.ShipRecordsResponse | None:
        pool_id = request.pool_id
        if not pool_id:
            raise AbortRpc(
                grpc.StatusCode.INVALID_ARGUMENT, "ShipRecords: pool_id: must not be empty"
            )
        if (
            pool_id not in self.pools
            and self.pool_deleted is not None
            and self.pool_deleted(pool_id)
        ):
            return replica_pb2.ShipRecordsResponse(
                pool_id=pool_id,
                placement_epoch=request.placement_epoch,
                status=replica_pb2.SHIP_STATUS_NOT_STANDBY,
                detail="the pool was deleted from the cluster",
            )
        entry = self.entry(pool_id)
        epoch = request.placement_epoch
        if epoch < entry.epoch:
            return self._answer(
                entry,
                replica_pb2.SHIP_STATUS_STALE_EPOCH,
                f"placement epoch {epoch} is older than {entry.epoch} here",
            )
        if entry.role in (Role.PRIMARY, Role.PROMOTING) and epoch == entry.epoch:
            return self._answer(
                entry, replica_pb2.SHIP_STATUS_NOT_STANDBY, "this replica is the primary"
            )
        if entry.role is not Role.STANDBY or epoch > entry.epoch:
            # A primary at a newer epoch than this replica knows: placement made it so.
            if entry.role in (Role.PRIMARY, Role.PROMOTING):
                self.demote(pool_id, epoch, standby=True)
            else:
                self._become_standby(entry, epoch)
        body = request.WhichOneof("body")
        if body is None and not request.digest:  # hello: this stream now owns the copy
            entry.seed_chunks = []  # a seed an older stream broke off is dropped
            entry.stream = streams[pool_id] = object()
            return self._answer(entry, replica_pb2.SHIP_STATUS_OK)
        if streams.get(pool_id) is not entry.stream or entry.stream is None:
            return self._answer(
                entry, replica_pb2.SHIP_STATUS_NEED_SEED, "a newer stream (or none) holds the copy"
            )
        if body is None:  # a periodic check after record ``seq``
            if not entry.has_copy or request.seq != entry.applied:
                entry.has_copy = False
                return self._answer(
                    entry,
                    replica_pb2.SHIP_STATUS_NEED_SEED,
                    f"a digest of record {request.seq} after record {entry.applied}",
                )
            mismatch = await self._check_digest(entry, self._pool(pool_id), request.digest)
            return mismatch or self._answer(entry, replica_pb2.SHIP_STATUS_OK)
        if body == "seed":
            return await self._seed(entry, request)
        if not entry.has_copy or request.seq != entry.applied + 1:
            entry.has_copy = False
            return self._answer(
                entry,
                replica_pb2.SHIP_STATUS_NEED_SEED,
                f"record {request.seq} does not follow {entry.applied}",
            )
        record = request.record
        journal_record = JournalRecord(
            request.seq, record.time, record.method, pool_id, record.request
        )
        failed = await replay_records(self.state, [journal_record])
        if failed:
            entry.has_copy = False
            return self._answer(
                entry,
                replica_pb2.SHIP_STATUS_NEED_SEED,
                f"record {request.seq} ({record.method}) failed here",
            )
        pool = self._pool(pool_id)
        if pool is not None and record.pool_epoch and pool.epoch != record.pool_epoch:
            pool.epoch = record.pool_epoch  # CreatePool, ResyncPool: the primary's incarnation
            registry = self.state.registry
            registry.epoch = max(registry.epoch, pool.epoch)
        entry.applied = request.seq
        return self._answer(entry, replica_pb2.SHIP_STATUS_OK)

    def _pool(self, pool_id: str) -> Pool | None:
        registry = self.state.registry
        return registry.get(pool_id) if pool_id in registry else None

    async def _check_digest(
        self, entry: ReplicaState, pool: Pool | None, digest: bytes
    ) -> replica_pb2.ShipRecordsResponse | None:
        """Compare ``digest`` with the copy's (:meth:`held_digest`)."""
        ours = b"" if pool is None else await self.held_digest(pool)
        if ours == digest:
            entry.digest_checks += 1
            return None
        entry.has_copy = False
        entry.digest_mismatches += 1
        _LOG.error(
            "standby copy differs from the primary's after record %d: dropped, to be seeded",
            entry.applied,
            extra={"event": "replica_digest_mismatch", "pool": entry.pool_id},
        )
        return self._answer(
            entry,
            replica_pb2.SHIP_STATUS_DIGEST_MISMATCH,
            f"digest differs after record {entry.applied}",
        )

    async def _seed(
        self, entry: ReplicaState, request: replica_pb2.ShipRecordsRequest
    ) -> replica_pb2.ShipRecordsResponse | None:
        seed = request.seed
        entry.seed_chunks.append(seed.data)
        if not seed.last:
            return None
        if len(entry.seed_chunks) == 1:
            first = seed
        else:
            first = replica_pb2.ReplicaSeed()  # the first chunk's fields are repeated in each
            first.CopyFrom(seed)
        data = b"".join(entry.seed_chunks)
        entry.seed_chunks = []
        try:
            pool = await self._install(entry, first, data)
        except KVCMError as exc:
            entry.has_copy = False
            return self._answer(entry, replica_pb2.SHIP_STATUS_NEED_SEED, f"seed refused: {exc}")
        entry.applied = request.seq
        entry.has_copy = True
        if request.digest:
            mismatch = await self._check_digest(entry, pool, request.digest)
            return mismatch or self._answer(entry, replica_pb2.SHIP_STATUS_OK)
        return self._answer(entry, replica_pb2.SHIP_STATUS_OK)

    async def _install(
        self, entry: ReplicaState, seed: replica_pb2.ReplicaSeed, data: bytes
    ) -> Pool | None:
        """Replace the standby's copy of ``entry``'s pool by the seed's.

        Raises:
            NotFoundError: The pool was forgotten (deleted from the cluster) while the seed was
                decoded: nothing is installed.
        """
        pool_id = entry.pool_id
        state = self.state
        registry = state.registry
        pool: Pool | None = None
        if seed.exists:
            config = admin_pb2.PoolConfig.FromString(seed.config)
            options = pool_config_from_proto(config)
            if data:
                pool = await asyncio.to_thread(
                    decode_pool, data, pool_id, options, limits=registry.limits
                )
            else:
                pool = Pool(pool_id, options, limits=registry.limits)
        # Checked after each await (the decode, the wait for the old copy): a pool forgotten
        # meanwhile was deleted from the cluster, and its seed must leave no copy behind.
        for _ in range(2):
            if self.pools.get(pool_id) is not entry:
                raise NotFoundError(f"pool {pool_id!r} was deleted while its seed was installed")
            if pool_id not in registry:
                break
            old = await state.pool(pool_id)
            registry.delete(pool_id)
            state.retire(old)
        decode_transfers(state, seed.transfers, pool_id)  # the primary's records replace ours
        if pool is None:
            return None
        registry.reserve(pool_id, pool.options)
        registry.add(pool)
        pool.epoch = seed.pool_epoch
        registry.epoch = max(registry.epoch, pool.epoch)
        runtime = PoolRuntime(config=admin_pb2.PoolConfig.FromString(seed.config))
        if pool.manager is not None:
            runtime.planned.set()
        state.runtimes[pool_id] = runtime
        state.kv_numbering.adopt(pool_id, seed.kv_event_base)
        return pool

    async def held_digest(self, pool: Pool) -> bytes:
        """:func:`pool_digest` of ``pool`` (``b""`` unless READY), computed in a worker thread
        while the pool is held (its calls wait; O(state), never on the event loop)."""
        state = self.state
        while (busy := state.lanes.get(pool.name)) is not None:
            await busy.wait()
        if self._pool(pool.name) is not pool or pool.state is not PoolState.READY:
            return b""  # replaced or deleted meanwhile, or not planned yet
        done = asyncio.Event()
        state.lanes[pool.name] = done
        pool.lent = True
        try:
            return await asyncio.to_thread(pool_digest, pool)
        finally:
            pool.lent = False
            state.lanes.pop(pool.name, None)
            done.set()

    async def describe(self, pool_id: str) -> replica_pb2.GetReplicaStateResponse:
        """The pool's replication state here (``GetReplicaState``)."""
        entry = self.pools.get(pool_id) or ReplicaState(pool_id)
        pool = self._pool(pool_id)
        digest = b"" if pool is None else await self.held_digest(pool)
        link = entry.link
        return replica_pb2.GetReplicaStateResponse(
            role=entry.role.value,
            placement_epoch=entry.epoch,
            seq=link.last if link is not None else entry.applied,
            acked_seq=link.acked if link is not None else 0,
            digest=digest,
            mode=(
                replica_pb2.REPLICATION_MODE_SYNC
                if entry.sync
                else replica_pb2.REPLICATION_MODE_ASYNC
            ),
            digest_checks=link.digests if link is not None else entry.digest_checks,
            digest_mismatches=entry.digest_mismatches,
            has_copy=entry.role is Role.STANDBY and entry.has_copy,
        )


def _failed(reason: str) -> Awaitable[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_exception(AbortRpc(grpc.StatusCode.UNAVAILABLE, reason))
    return future


class PromotionRefusedError(ValueError):
    """Raised by :meth:`Replication.promote` when this replica must not become the primary
    (its message says why; nothing changed)."""


class _FencedError(Exception):
    """The standby knows a newer placement epoch: this replica stepped down."""


class _Link:
    """The primary's stream of one pool's records to its standby (see the module docstring).

    Records are numbered from 1 in the order they were applied (``last``). While a session is
    up, every record goes to the outbox, which the session's writer empties onto the stream;
    while it is down nothing is kept (the next session starts with a seed, which holds them).
    Calls waiting for a record (``sync``) wait for an acknowledgement of it or a later one.
    Every ``digest_every`` records the writer holds the pool (its calls wait), computes its
    digest in a worker thread (O(state): ~15 ms at 10k blocks, ~270 ms at 100k on a 2-core VM;
    never on the event loop) and sends it as a message of its own after the records it covers.
    """

    def __init__(self, owner: Replication, pool_id: str, standby: str, epoch: int) -> None:
        self.owner = owner
        self.pool_id = pool_id
        self.standby = standby
        self.epoch = epoch
        self.last = 0  # the last record numbered
        self.acked = 0  # the last record the standby acknowledged
        self.digests = 0
        self.outbox: collections.deque[replica_pb2.ShipRecordsRequest] = collections.deque()
        self.digest_due = False  # a periodic digest is to be sent after the outbox
        self.waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self.wake = asyncio.Event()
        self.live = False  # a session is up and sending
        self.closed = False
        self.seeds = 0  # seeds sent
        # (seq, time.monotonic()) of records not acknowledged yet (the oldest kept when more
        # than _MAX_UNACKED are outstanding): the replication lag in seconds.
        self.times: collections.deque[tuple[int, float]] = collections.deque()
        # A sync pool's KV events wait for their records' acknowledgements (ServerState.
        # release_events): (record seq, the pool object, its last event sequence after it).
        self.holds = False
        self.marks: collections.deque[tuple[int, Pool, int]] = collections.deque()
        self.timeouts = 0  # sync calls timed out since the last acknowledgement
        self.reported = False  # standby_stuck was called for this link
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kvcm-replica-{pool_id}"
        )

    def add(
        self, method: str, request: bytes, when: float, *, wait: bool
    ) -> Awaitable[None] | None:
        self.last += 1
        seq = self.last
        if self.holds:
            pool = self.owner._pool(self.pool_id)
            if pool is not None:
                marks = self.marks
                last = pool.last_event_sequence
                if not marks or marks[-1][1] is not pool or marks[-1][2] != last:
                    marks.append((seq, pool, last))  # the record that completes these events
        if len(self.times) < _MAX_UNACKED:
            self.times.append((seq, time.monotonic()))
        if self.live:
            pool = self.owner._pool(self.pool_id)
            record = replica_pb2.ReplicaRecord(
                method=method, request=request, time=when, pool_epoch=pool.epoch if pool else 0
            )
            message = replica_pb2.ShipRecordsRequest(
                pool_id=self.pool_id, placement_epoch=self.epoch, seq=seq, record=record
            )
            self.outbox.append(message)
            every = self.owner.digest_every
            if every and seq % every == 0:
                self.digest_due = True
            self.wake.set()
            if self.last - self.acked > _MAX_UNACKED:
                self.live = False  # the session ends; the next one seeds
                self.outbox.clear()
        if not wait:
            return None
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append((seq, future))
        return future

    def _acked(self, seq: int) -> None:
        self.acked = max(self.acked, seq)
        self.timeouts = 0
        while self.waiters and self.waiters[0][0] <= seq:
            _, future = self.waiters.popleft()
            if not future.done():
                future.set_result(None)
        times = self.times
        while times and times[0][0] <= seq:
            times.popleft()
        marks = self.marks
        if marks and marks[0][0] <= seq:
            released = None
            while marks and marks[0][0] <= seq:
                released = marks.popleft()
            if released is not None:
                self.owner.state.release_events(released[1], released[2])

    def take_waiters(self) -> list[asyncio.Future[None]]:
        """Remove and return the futures of the calls waiting for an acknowledgement."""
        waiting = [future for _, future in self.waiters]
        self.waiters.clear()
        return waiting

    def lag(self) -> tuple[int, float]:
        """Records not acknowledged yet, and the age in seconds of the oldest of them."""
        age = time.monotonic() - self.times[0][1] if self.times else 0.0
        return self.last - self.acked, age

    def close(self, reason: str | None, *, release: bool = True) -> None:
        """Stop; waiting calls fail with ``reason`` (``None``: they are released: the pool
        has no standby any more, and its held KV events go out unless not ``release``: a
        new standby takes over). With a ``reason`` (this replica stepped down) its held
        events never go out here: the new primary may not have them."""
        self.closed = True
        self.live = False
        self.task.cancel()
        if reason is None and release and self.holds:
            self.owner.state.unhold_events(self.pool_id)
        while self.waiters:
            _, future = self.waiters.popleft()
            if future.done():
                continue
            if reason is None:
                future.set_result(None)
            else:
                future.set_exception(AbortRpc(grpc.StatusCode.UNAVAILABLE, reason))
                future.exception()

    async def _run(self) -> None:
        delay = _BACKOFF_S[0]
        while not self.closed:
            try:
                if await self._session():
                    delay = _BACKOFF_S[0]  # it followed live: the next seed may come at once
            except _FencedError:
                return
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                _LOG.info(
                    "replication stream to %s ended: %s",
                    self.standby,
                    exc.code().name,
                    extra={"event": "replica_link_down", "pool": self.pool_id},
                )
            except Exception:
                _LOG.exception("replication stream to %s failed", self.standby)
            self.live = False
            self.outbox.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_S[1])

    async def _session(self) -> bool:
        """One stream: hello, seed, then records until it ends; whether the seed was taken
        (``False``: the standby refused it, try again after the backoff)."""
        owner = self.owner
        stub = replica_pb2_grpc.ReplicaServiceStub(owner.channel(self.standby))  # type: ignore[no-untyped-call]
        call = stub.ShipRecords(metadata=owner.metadata())
        try:
            await call.write(
                replica_pb2.ShipRecordsRequest(pool_id=self.pool_id, placement_epoch=self.epoch)
            )
            self._check(await call.read())
            seed_seq = await self._send_seed(call)
            answer = await call.read()
            self._check(answer)
            if answer.status != replica_pb2.SHIP_STATUS_OK:
                _LOG.warning(
                    "standby %s refused the seed: %s",
                    self.standby,
                    answer.detail,
                    extra={"event": "replica_seed_refused", "pool": self.pool_id},
                )
                return False
            self._acked(seed_seq)
            reader = asyncio.ensure_future(self._read(call))
            try:
                await self._write(call, reader)
            finally:
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
            return True
        finally:
            self.live = False
            call.cancel()

    def _check(self, answer: Any) -> None:
        if answer is grpc.aio.EOF or answer is None:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "EOF"
            )
        if answer.status == replica_pb2.SHIP_STATUS_STALE_EPOCH:
            self.owner.demote(self.pool_id, answer.placement_epoch)
            raise _FencedError
        if answer.status == replica_pb2.SHIP_STATUS_NOT_STANDBY:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                answer.detail,
            )

    async def _send_seed(self, call: Any) -> int:
        """Seed the standby with the pool as of the last record numbered; returns its seq.

        The pool is held (its calls wait) while its snapshot is taken: it is then exactly the
        records up to the seed's seq.
        """
        owner = self.owner
        state = owner.state
        pool_id = self.pool_id
        while (busy := state.lanes.get(pool_id)) is not None:
            await busy.wait()
        seq = self.last
        self.outbox.clear()
        self.digest_due = False
        self.live = True  # records applied from now on are queued after the seed
        pool = owner._pool(pool_id)
        base = state.kv_numbering.base(pool_id)
        # The pool's transfer records as of ``seq`` (no await since): the seed's last chunk.
        transfers = encode_transfers(state, pool_id)
        if pool is None:
            self.seeds += 1
            seed = replica_pb2.ReplicaSeed(
                last=True, exists=False, kv_event_base=base, transfers=transfers
            )
            await call.write(
                replica_pb2.ShipRecordsRequest(
                    pool_id=pool_id, placement_epoch=self.epoch, seq=seq, seed=seed
                )
            )
            return seq
        self.seeds += 1
        runtime = state.runtimes.get(pool_id)
        config = runtime.config.SerializeToString() if runtime is not None else b""
        data, digest = b"", b""
        if pool.state is PoolState.READY:
            done = asyncio.Event()
            state.lanes[pool_id] = done
            pool.lent = True
            try:
                data, digest = await asyncio.to_thread(_encode, pool)
            finally:
                pool.lent = False
                state.lanes.pop(pool_id, None)
                done.set()
        chunks = [data[at : at + _SEED_CHUNK] for at in range(0, len(data), _SEED_CHUNK)] or [b""]
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            seed = replica_pb2.ReplicaSeed(
                config=config,
                data=chunk,
                last=last,
                pool_epoch=pool.epoch,
                kv_event_base=base,
                exists=True,
                transfers=transfers if last else b"",
            )
            await call.write(
                replica_pb2.ShipRecordsRequest(
                    pool_id=pool_id,
                    placement_epoch=self.epoch,
                    seq=seq,
                    seed=seed,
                    digest=digest if last else b"",
                )
            )
        return seq

    async def _write(self, call: Any, reader: asyncio.Future[Any]) -> None:
        outbox = self.outbox
        while not self.closed and self.live:
            if reader.done():
                reader.result()
                return
            if outbox:
                while outbox:
                    await call.write(outbox.popleft())
                continue
            if self.digest_due:
                self.digest_due = False
                message = await self._digest()
                if message is not None:
                    outbox.append(message)
                continue
            self.wake.clear()
            waiter: asyncio.Future[Any] = asyncio.ensure_future(self.wake.wait())
            await asyncio.wait((waiter, reader), return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()

    async def _digest(self) -> replica_pb2.ShipRecordsRequest | None:
        """The pool's digest as of the last record numbered, computed in a worker thread
        while the pool is held (``None``: no READY pool)."""
        state = self.owner.state
        pool_id = self.pool_id
        while (busy := state.lanes.get(pool_id)) is not None:
            await busy.wait()
        pool = self.owner._pool(pool_id)
        if pool is None or pool.state is not PoolState.READY or not self.live:
            return None
        seq = self.last  # no await from here to the hold: the pool is exactly records 1..seq
        digest = await self.owner.held_digest(pool)
        if not digest:
            return None
        self.digests += 1
        return replica_pb2.ShipRecordsRequest(
            pool_id=pool_id, placement_epoch=self.epoch, seq=seq, digest=digest
        )

    async def _read(self, call: Any) -> None:
        while True:
            answer = await call.read()
            self._check(answer)
            if answer.status != replica_pb2.SHIP_STATUS_OK:
                _LOG.warning(
                    "standby %s asks for a new seed: %s",
                    self.standby,
                    answer.detail,
                    extra={"event": "replica_reseed", "pool": self.pool_id},
                )
                self.live = False
                self.wake.set()
                return
            self._acked(answer.seq)


def _encode(pool: Pool) -> tuple[bytes, bytes]:
    return encode_pool(pool), pool_digest(pool)
