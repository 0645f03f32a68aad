"""Where each pool lives: its placement record and the read-only view the server keeps of it.

A pool's placement (:class:`Placement`) names the replica that serves it (``primary``), the
replica that follows it (``standby``, or ``None`` with a single live replica) and an ``epoch``
that rises by one every time the primary changes (a promotion, a move), and the pool's
replication ``mode`` (``sync`` or ``async``, chosen when the pool is created and kept through
every later change, docs/replication.md). The records live in
etcd under ``<prefix>/placement/<pool_id>`` and change only through etcd transactions that
compare the record's mod revision, so two replicas can never both believe they won the same
change; every replica keeps a local copy, refreshed by an etcd watch, behind the
:class:`PlacementView` protocol.

Replica addresses are the ``--advertise-address`` strings (``host:port``) the replicas
registered under; they are the replica's identity in the cluster as well as where clients
connect.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Protocol

__all__ = ["Placement", "PlacementCallback", "PlacementView"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """One pool's place in the cluster.

    Attributes:
        pool_id: The pool.
        primary: The advertise address (``host:port``) of the replica that serves the pool.
        standby: The advertise address of the replica that follows it, or ``None``.
        epoch: Starts at 1 when the pool is placed; rises by one whenever ``primary`` changes,
            so a record, message or answer stamped with a lower epoch comes from a deposed
            primary and is refused.
        mode: ``"sync"`` (a mutation is acknowledged once the standby has it) or
            ``"async"`` (once the primary's journal has it); set when the pool is placed.
    """

    pool_id: str
    primary: str
    standby: str | None
    epoch: int
    mode: str = "sync"

    def __post_init__(self) -> None:
        if not self.pool_id:
            raise ValueError("Placement.pool_id must not be empty")
        if not self.primary:
            raise ValueError("Placement.primary must not be empty")
        if self.standby == self.primary:
            raise ValueError("Placement.standby must differ from primary")
        if self.epoch < 1:
            raise ValueError(f"Placement.epoch must be >= 1, got {self.epoch}")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"Placement.mode must be 'sync' or 'async', got {self.mode!r}")

    def encode(self) -> bytes:
        """The record's value in etcd (UTF-8 JSON, keys sorted; ``mode`` only when async, so
        a sync record reads the same as before modes existed)."""
        record: dict[str, object] = {
            "pool_id": self.pool_id,
            "primary": self.primary,
            "standby": self.standby,
            "epoch": self.epoch,
        }
        if self.mode != "sync":
            record["mode"] = self.mode
        return json.dumps(record, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Placement:
        """Reads a record written by :meth:`encode`; raises ValueError if it is not one."""
        try:
            obj = json.loads(raw)
            standby = obj["standby"]
            return cls(
                pool_id=str(obj["pool_id"]),
                primary=str(obj["primary"]),
                standby=None if standby is None else str(standby),
                epoch=int(obj["epoch"]),
                mode=str(obj.get("mode", "sync")),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a placement record: {raw[:80]!r}") from exc


#: Called with the pool's new placement, or ``(pool_id, None)`` when the pool was deleted.
PlacementCallback = Callable[[str, "Placement | None"], None]


class PlacementView(Protocol):
    """A replica's read-only, eventually consistent copy of every pool's placement.

    Callbacks run on the server's event loop, in etcd revision order, and must not block.
    """

    def get(self, pool_id: str) -> Placement | None:
        """The pool's placement as last seen, or ``None`` if it is not placed."""
        ...

    def watch(self, callback: PlacementCallback) -> Callable[[], None]:
        """Calls ``callback`` on every change from now on; returns a function that stops it."""
        ...
