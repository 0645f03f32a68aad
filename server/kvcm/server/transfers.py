"""P/D transfer records with leases: the book the TransferService keeps (no I/O, no clock).

A transfer is keyed by its source pool and the caller's ``transfer_id``. Every change is one
of five operations (hold, plan, commit, release, expire), each a pure function of the book,
the operation's fields and the time it is given, so that a journal replay makes the same
records and a retried call finds its own effect and answers it again (exactly once):

* ``hold``: a new record in HELD; the same hold again answers the record as it is now;
* ``plan``: HELD -> PLANNED with the destination and its numbers; the same destination again
  answers the record;
* ``commit``: PLANNED -> COMPLETED; a COMPLETED record answers as it is;
* ``release`` / ``expire``: any state in flight -> RELEASED / EXPIRED; an ended record answers
  as it is.

A *managed* transfer holds a request of the source pool; the caller (the servicer) gives it
back to its pool when an operation ends the record (:attr:`Change.give_back`). A *record-only*
transfer (an engine's own protocol keeps authority over its blocks) never changes a pool: its
expiry only marks the state, and the engine's own late commit or release still moves an
EXPIRED record on.

Leases count the server's awake time (the servicer passes ``AwakeClock`` readings as
``now``): a record's ``renewed_at`` is moved later by a stall like every lease.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from kvcm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    shown,
)

__all__ = [
    "TRANSFER_METRICS",
    "MAX_ENDED_TRANSFERS",
    "MAX_LEASE_S",
    "MAX_TRANSFERS_IN_FLIGHT",
    "TRANSFER_COUNTERS",
    "Change",
    "TransferBook",
    "TransferRecord",
    "TransferState",
    "check_id",
]

MAX_LEASE_S: Final = 86_400.0
MAX_TRANSFERS_IN_FLIGHT: Final = 65_536
MAX_ENDED_TRANSFERS: Final = 4_096
"""Ended records kept for listing and for answering late retries (oldest dropped first)."""
_MAX_ID_CHARS: Final = 256
TRANSFER_COUNTERS: Final = (
    "started",
    "completed",
    "expired",
    "failed",
    "blocks_pulled",
    "blocks_saved",
)
"""Per source pool counters (``TransferBook.counters``), read by /metrics."""
TRANSFER_METRICS: Final = (
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
"""The families :meth:`TransferBook.samples` answers (see docs/metrics.md), in that order."""


@enum.unique
class TransferState(enum.IntEnum):
    """A transfer's state (``kvcm.v1.TransferState``)."""

    HELD = 1
    PLANNED = 2
    COMPLETED = 3
    RELEASED = 4
    EXPIRED = 5


_IN_FLIGHT: Final = frozenset({TransferState.HELD, TransferState.PLANNED})


@dataclass(slots=True, kw_only=True)
class TransferRecord:
    """One transfer (fields as ``kvcm.v1.Transfer``'s; times explained there).

    Attributes:
        renewed_at: Awake-clock time the lease was last renewed (deadline: + ``lease_s``).
        block_size: The source pool's block size (hit and pull in blocks).
        pool_epoch: The source pool's incarnation at the hold (a replaced pool's requests are
            not the source's).
    """

    pool_id: str
    transfer_id: str
    record_only: bool
    request_key: int
    request_id: str
    num_tokens: int
    source_blocks: tuple[tuple[int, ...], ...]
    lease_s: float
    block_size: int
    state: TransferState = TransferState.HELD
    renewed_at: float = 0.0
    destination_pool_id: str = ""
    hit_tokens: int = 0
    pull_tokens: int = 0
    blocks_pulled: int = 0
    started_at: float = 0.0
    ended_at: float = 0.0
    reason: str = ""
    source_freed: bool = False
    pool_epoch: int = 0

    @property
    def in_flight(self) -> bool:
        """Held or planned."""
        return self.state in _IN_FLIGHT

    @property
    def holds_source(self) -> bool:
        """Whether an engine may still hold the source: in flight, or a record-only transfer
        kvcm expired that its engine has not reported on yet."""
        if self.source_freed:
            return False
        return self.state in _IN_FLIGHT or (
            self.record_only and self.state is TransferState.EXPIRED
        )

    @property
    def hit_blocks(self) -> int:
        """The destination's own hit in whole blocks."""
        return self.hit_tokens // self.block_size

    @property
    def pull_blocks(self) -> int:
        """Blocks the pull covers: from the hit's end to the source's last (partial) block."""
        total = -(-self.num_tokens // self.block_size)
        return max(0, total - self.hit_blocks) if self.destination_pool_id else 0

    def deadline(self) -> float:
        """Awake-clock time the lease runs out."""
        return self.renewed_at + self.lease_s


@dataclass(frozen=True, slots=True)
class Change:
    """What an operation did.

    Attributes:
        record: The record after it (the answer).
        changed: Whether the book changed (``False``: a retry, answered as it is).
        give_back: The managed source to give back to its pool now (finish its request).
    """

    record: TransferRecord
    changed: bool
    give_back: bool = False


def check_id(field_name: str, value: str) -> None:
    """Refuse an empty or too long id, naming ``field_name``."""
    if not value:
        raise InvalidArgumentError(f"{field_name}: required")
    if len(value) > _MAX_ID_CHARS:
        raise InvalidArgumentError(f"{field_name}: longer than {_MAX_ID_CHARS} characters")


def _name(record: TransferRecord) -> str:
    return f"transfer {shown(record.transfer_id)} of pool {shown(record.pool_id)}"


@dataclass(slots=True)
class TransferBook:
    """Every transfer in flight and the last :data:`MAX_ENDED_TRANSFERS` ended ones.

    Attributes:
        records: By (source pool, transfer id), in start order.
        counters: Per source pool, :data:`TRANSFER_COUNTERS` (``failed``: released).
    """

    records: OrderedDict[tuple[str, str], TransferRecord] = field(default_factory=OrderedDict)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    _ended: OrderedDict[tuple[str, str], None] = field(default_factory=OrderedDict)
    _in_flight: int = 0
    # Managed transfers in flight by (source pool, request key): one hold per request.
    _holders: dict[tuple[str, int], TransferRecord] = field(default_factory=dict)

    def get(self, pool_id: str, transfer_id: str) -> TransferRecord:
        """The record, or NOT_FOUND naming ``transfer_id``."""
        record = self.records.get((pool_id, transfer_id))
        if record is None:
            raise NotFoundError(
                f"transfer_id: no transfer {shown(transfer_id)} of pool {shown(pool_id)}"
            )
        return record

    def holder_of(self, pool_id: str, request_key: int) -> TransferRecord | None:
        """The managed transfer in flight holding ``request_key`` of ``pool_id``, if any."""
        return self._holders.get((pool_id, request_key))

    def _track(self, record: TransferRecord) -> None:
        """Count a record that is in flight (and index a managed one's request)."""
        self._in_flight += 1
        if not record.record_only:
            self._holders[(record.pool_id, record.request_key)] = record

    def _untrack(self, record: TransferRecord) -> None:
        self._in_flight -= 1
        if not record.record_only:
            self._holders.pop((record.pool_id, record.request_key), None)

    def in_flight(self) -> Iterator[TransferRecord]:
        """Records in flight, oldest first."""
        return (record for record in self.records.values() if record.in_flight)

    def _count(self, pool_id: str, name: str, amount: int = 1) -> None:
        counters = self.counters.setdefault(pool_id, dict.fromkeys(TRANSFER_COUNTERS, 0))
        counters[name] += amount

    # ------------------------------------------------------------------------- operations
    def hold(self, record: TransferRecord, now: float, wall: float) -> Change:
        """Start ``record`` (HELD) or, when its key exists, answer the existing one if it is
        the same hold.

        Raises:
            AlreadyExistsError: The key names another source, or (managed) another transfer
                in flight holds the same request.
            ResourceExhaustedError: :data:`MAX_TRANSFERS_IN_FLIGHT` are in flight.
        """
        key = (record.pool_id, record.transfer_id)
        existing = self.records.get(key)
        if existing is not None:
            same = (
                existing.record_only == record.record_only
                and existing.request_key == record.request_key
                and existing.request_id == record.request_id
                and (
                    not record.record_only
                    or (
                        existing.num_tokens == record.num_tokens
                        and existing.source_blocks == record.source_blocks
                    )
                )
            )
            if not same:
                raise AlreadyExistsError(
                    f"transfer_id: {_name(existing)} already holds request "
                    f"{shown(existing.request_id)} (key {existing.request_key})"
                )
            return Change(existing, changed=False)
        if not record.record_only:
            holder = self.holder_of(record.pool_id, record.request_key)
            if holder is not None:
                raise AlreadyExistsError(
                    f"request_key: {record.request_key} is held by {_name(holder)}"
                )
        if self._in_flight >= MAX_TRANSFERS_IN_FLIGHT:
            raise ResourceExhaustedError(
                f"transfer_id: {MAX_TRANSFERS_IN_FLIGHT} transfers are in flight already"
            )
        record.state = TransferState.HELD
        record.renewed_at = now
        record.started_at = wall
        self.records[key] = record
        self._track(record)
        self._count(record.pool_id, "started")
        return Change(record, changed=True)

    def plan(
        self,
        pool_id: str,
        transfer_id: str,
        *,
        destination_pool_id: str,
        hit_tokens: int,
        pull_tokens: int,
        now: float,
    ) -> Change:
        """HELD -> PLANNED (the lease renewed); the same destination again answers the record.

        Raises:
            NotFoundError: No such transfer.
            FailedPreconditionError: Planned against another pool, or ended (a record-only
                transfer kvcm expired may still be planned by its engine).
        """
        record = self.get(pool_id, transfer_id)
        if record.destination_pool_id:
            if record.destination_pool_id == destination_pool_id:
                return Change(record, changed=False)
            raise FailedPreconditionError(
                f"destination_pool_id: {_name(record)} is planned against pool "
                f"{shown(record.destination_pool_id)}"
            )
        if not self._may_move(record):
            raise FailedPreconditionError(f"transfer_id: {_name(record)} is {record.state.name}")
        record.destination_pool_id = destination_pool_id
        record.hit_tokens = hit_tokens
        record.pull_tokens = pull_tokens
        if record.state is TransferState.HELD:
            record.state = TransferState.PLANNED
            record.renewed_at = now
        self._count(pool_id, "blocks_saved", record.hit_blocks)
        return Change(record, changed=True)

    def commit(
        self, pool_id: str, transfer_id: str, blocks_pulled: int | None, wall: float
    ) -> Change:
        """PLANNED -> COMPLETED, giving a managed source back; COMPLETED answers as it is.

        Raises:
            NotFoundError: No such transfer.
            FailedPreconditionError: Not planned, or released or expired (managed).
        """
        record = self.get(pool_id, transfer_id)
        if record.state is TransferState.COMPLETED:
            return Change(record, changed=False)
        if not record.destination_pool_id:
            raise FailedPreconditionError(
                f"transfer_id: {_name(record)} has no destination: PlanTransfer first"
            )
        if not self._may_move(record):
            raise FailedPreconditionError(f"transfer_id: {_name(record)} is {record.state.name}")
        pulled = record.pull_blocks if blocks_pulled is None else blocks_pulled
        record.blocks_pulled = pulled
        self._end(record, TransferState.COMPLETED, "", wall)
        self._count(pool_id, "blocks_pulled", pulled)
        return Change(record, changed=True, give_back=not record.record_only)

    def release(self, pool_id: str, transfer_id: str, reason: str, wall: float) -> Change:
        """In flight -> RELEASED, giving a managed source back; ended answers as it is."""
        return self._stop(pool_id, transfer_id, TransferState.RELEASED, reason, wall)

    def expire(
        self, pool_id: str, transfer_id: str, reason: str, wall: float, *, source_freed: bool
    ) -> Change:
        """In flight -> EXPIRED, giving a managed source back; ended answers as it is.

        ``source_freed`` (record-only): the engine freed the source itself; a HELD record
        expires, an EXPIRED or PLANNED one is only marked (it holds nothing any more; a planned
        one's destination reports how its pull ended).
        """
        record = self.get(pool_id, transfer_id)
        if source_freed and record.record_only and not record.source_freed:
            if record.state in (TransferState.EXPIRED, TransferState.PLANNED):
                # Expired by kvcm, or being pulled (its destination reports how it ended).
                record.source_freed = True
                return Change(record, changed=True)
            if record.in_flight:
                record.source_freed = True
        return self._stop(pool_id, transfer_id, TransferState.EXPIRED, reason, wall)

    def _stop(
        self, pool_id: str, transfer_id: str, state: TransferState, reason: str, wall: float
    ) -> Change:
        record = self.get(pool_id, transfer_id)
        if not self._may_move(record) or (state is TransferState.EXPIRED and not record.in_flight):
            return Change(record, changed=False)
        self._end(record, state, reason, wall)
        return Change(record, changed=True, give_back=not record.record_only)

    @staticmethod
    def _may_move(record: TransferRecord) -> bool:
        """In flight, or record-only and expired by kvcm (its engine still reports)."""
        return record.in_flight or (record.record_only and record.state is TransferState.EXPIRED)

    def _end(self, record: TransferRecord, state: TransferState, reason: str, wall: float) -> None:
        was_in_flight = record.in_flight
        was_expired = record.state is TransferState.EXPIRED
        record.state = state
        record.reason = reason
        record.ended_at = wall
        key = (record.pool_id, record.transfer_id)
        if was_in_flight:
            self._untrack(record)
        if state is TransferState.COMPLETED:
            self._count(record.pool_id, "completed")
        elif state is TransferState.EXPIRED:
            self._count(record.pool_id, "expired")
        elif not was_expired:  # a record-only expiry its engine then released counted once
            self._count(record.pool_id, "failed")
        self._ended.pop(key, None)
        self._ended[key] = None
        while len(self._ended) > MAX_ENDED_TRANSFERS:
            old, _ = self._ended.popitem(last=False)
            self.records.pop(old, None)

    def samples(self, now: float, wall: float) -> dict[str, list[tuple[list[str], float]]]:
        """The :data:`TRANSFER_METRICS` samples per source pool: ``now`` the awake clock (for
        leases), ``wall`` the wall clock (for ages)."""
        out: dict[str, list[tuple[list[str], float]]] = {name: [] for name in TRANSFER_METRICS}
        for pool_id, counters in sorted(self.counters.items()):
            for name, counter in zip(TRANSFER_METRICS, TRANSFER_COUNTERS, strict=False):
                out[name].append(([pool_id], counters[counter]))
        flying: dict[str, int] = {}
        late: dict[str, int] = {}
        oldest: dict[str, float] = {}
        for record in self.records.values():
            pool_id = record.pool_id
            if record.in_flight:
                flying[pool_id] = flying.get(pool_id, 0) + 1
            if not record.holds_source:
                continue
            if now > record.deadline():
                late[pool_id] = late.get(pool_id, 0) + 1
            oldest[pool_id] = max(oldest.get(pool_id, 0.0), wall - record.started_at)
        for pool_id in sorted(set(self.counters) | set(flying) | set(oldest)):
            out["kvcm_transfers_in_flight"].append(([pool_id], flying.get(pool_id, 0)))
            out["kvcm_transfers_past_lease"].append(([pool_id], late.get(pool_id, 0)))
            age = oldest.get(pool_id, 0.0)
            out["kvcm_transfer_oldest_source_age_seconds"].append(([pool_id], max(age, 0.0)))
        return out

    def abandon_pool(self, pool_id: str, wall: float) -> int:
        """Release every transfer in flight of ``pool_id`` (the pool was deleted: nothing is
        held for them any more); returns how many."""
        stale = [r for r in self.records.values() if r.pool_id == pool_id and r.in_flight]
        for record in stale:
            record.source_freed = record.record_only
            self._end(record, TransferState.RELEASED, "the source pool was deleted", wall)
        return len(stale)

    def drop_pool(self, pool_id: str) -> None:
        """Forget every record of ``pool_id``, ended ones included (a standby's copy of the
        pool is being replaced by its primary's seed)."""
        for key in [key for key in self.records if key[0] == pool_id]:
            record = self.records.pop(key)
            if record.in_flight:
                self._untrack(record)
            self._ended.pop(key, None)

    def extend(self, stall_s: float, now: float) -> None:
        """Move every lease ``stall_s`` later (not past ``now``): the server stalled."""
        for record in self.records.values():
            if record.holds_source:
                record.renewed_at = min(record.renewed_at + stall_s, now)

    def restore(self, record: TransferRecord, now: float) -> None:
        """Put a checkpointed record back (in its order); its lease restarts at ``now`` (the
        server's down time is not its holder's silence)."""
        key = (record.pool_id, record.transfer_id)
        record.renewed_at = now
        self.records[key] = record
        if record.in_flight:
            self._track(record)
        else:
            self._ended[key] = None
