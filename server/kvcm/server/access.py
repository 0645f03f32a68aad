"""Who may call what: one table for every gRPC method and HTTP route, and the refusals' audit.

With ``auth_tokens`` set, every kvcm.v1 method and every HTTP route is looked up in
:data:`RULES` (keyed ``/kvcm.v1.Service/Method`` for gRPC, ``VERB /path`` for HTTP): the roles
that may call it, and where the pool it acts on is found (:class:`PoolFrom`). A method or route
without a row is refused (gRPC) or fails the app's build (HTTP), so adding one means adding its
row; the tests generate their cases from this table and from the registered methods and routes.

Roles (a token's ``role:pool-glob`` pairs; ``admin`` may whatever any role may, on its pools):

* ``admin``: create and delete pools (CreatePool, and ResyncPool of a pool that does not exist);
* ``scheduler``: every SchedulerService call; reads its pools;
* ``worker``: RegisterWorker; reads its pools;
* ``reader``: reads its pools (DescribePool, SubscribeEvents, ``GET /v1/pools/{pool}``);
* ``scrape``: ``GET /metrics``, which spans every pool, so its glob must be ``*``
  (``admin:*`` scrapes too);
* ``replica``: the replica-to-replica ReplicaService (ShipRecords, SetPlacement,
  GetReplicaState), which spans every pool (``replica:*``; ``admin:*`` may too): the token a
  cluster's replicas present to each other (``KVCM_REPLICA_TOKEN``), good for nothing else.

Listings (ListPools, ``GET /v1/pools``) and lookups (Lookup, ``POST /v1/lookup``) take any
valid token and answer only about the pools it may read (:func:`may_read`). ``/healthz`` and
``/readyz`` are open, and so are ``/`` (the pool inspector) and ``/docs``: static pages holding
no data, which ask for a token and send it with their calls to the JSON routes.

Every refusal (UNAUTHENTICATED, PERMISSION_DENIED, HTTP 401 and 403) is logged at WARNING on
the ``kvcm.audit`` logger by :class:`RefusalLog`: who (the token's name, never the token, and
the peer's address), what (method or route, pool) and why, at most ``rate_per_s`` lines a
second after a burst; the lines a flood suppresses are counted in one ``refusals suppressed``
line.

This module holds no transport code: ``kvcm.server.auth`` applies it to gRPC,
``kvcm.server.http`` to HTTP, and the ResyncPool servicer asks :func:`refusal` again (with
``exists=False``) when it is about to create the pool.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

from kvcm.common.errors import shown

__all__ = [
    "AUDIT_LOG",
    "READ_ROLES",
    "ROLES",
    "RULES",
    "SERVER_WIDE_ROLES",
    "UNROUTED",
    "PoolFrom",
    "PrincipalLike",
    "RefusalLog",
    "Rule",
    "bearer_token",
    "may_read",
    "refusal",
]

AUDIT_LOG = logging.getLogger("kvcm.audit")
ROLES: Final = ("admin", "scheduler", "worker", "reader", "scrape", "replica")
SERVER_WIDE_ROLES: Final = frozenset({"scrape", "replica"})
"""Roles that act on no pool in particular: their glob must be ``*``."""
READ_ROLES: Final = ("reader", "worker", "scheduler")
"""Roles that may read a pool (its summary, events, lookups, listings); admin may too."""
_CREATE: Final = ("admin",)
"""Who may bring a pool into existence, whatever the route (CreatePool, ResyncPool)."""


class PrincipalLike(Protocol):
    """An authenticated caller (``kvcm.server.rpc.Principal``)."""

    @property
    def name(self) -> str: ...
    @property
    def roles(self) -> tuple[tuple[str, str], ...]: ...
    def has(self, role: str, pool_id: str) -> bool:
        """Whether ``role`` (or admin) covers ``pool_id``."""
        ...


@enum.unique
class PoolFrom(enum.Enum):
    """Where a call's pool is found, which decides what its roles are checked against."""

    REQUEST = "request"
    """gRPC: the request's ``pool_id`` (a client stream's first message)."""
    PATH = "path"
    """HTTP: the ``{pool}`` path parameter."""
    NONE = "none"
    """No pool: any valid token; a listing or lookup answers about readable pools only."""
    SERVER = "server"
    """Every pool at once: one of the roles on ``*``."""
    OPEN = "open"
    """No token needed (probes)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """Who may make one call.

    Attributes:
        roles: Any of these on the call's pool allows it (admin always does); for a call
            naming no pool (:attr:`PoolFrom.NONE`), the roles that put a pool in its answer.
        pool: Where the pool is found.
        create_roles: When the call would create its pool (it does not exist yet), the roles
            needed instead (empty: the call never creates).
    """

    roles: tuple[str, ...]
    pool: PoolFrom
    create_roles: tuple[str, ...] = ()


_ADMIN = Rule(roles=_CREATE, pool=PoolFrom.REQUEST)
_READ = Rule(roles=READ_ROLES, pool=PoolFrom.REQUEST)
_SCHEDULE = Rule(roles=("scheduler",), pool=PoolFrom.REQUEST)
_ANY_TOKEN = Rule(roles=(), pool=PoolFrom.NONE)
# ReplicaService: a primary's records and seeds overwrite a standby's copy, a placement
# promotes or fences: only a replica (or admin:*), never a tenant's token.
_REPLICA = Rule(roles=("replica",), pool=PoolFrom.SERVER)
_OPEN = Rule(roles=(), pool=PoolFrom.OPEN)
_SCHEDULER_METHODS: Final = (
    "Step",
    "KeepAlive",
    "AddRequest",
    "AppendTokens",
    "Free",
    "GetComputedBlocks",
    "AllocateSlots",
    "CacheBlocks",
    "RemoveSkippedBlocks",
    "EvictBlocks",
    "ResetPrefixCache",
    "GetBlocks",
    "GetBlockIds",
    "GetNumCommonPrefixBlocks",
    "TakeNewBlockIds",
    "NewStepStarts",
    "GetUsage",
    "TakePrefixCacheStats",
)
# The TransferService calls that change a record: the scheduler role on the source pool.
_TRANSFER_METHODS: Final = (
    "HoldSource",
    "PlanTransfer",
    "CommitTransfer",
    "ReleaseTransfer",
    "ExpireTransfer",
)

RULES: Final[Mapping[str, Rule]] = {
    # gRPC, by full method name.
    "/kvcm.v1.AdminService/CreatePool": _ADMIN,
    "/kvcm.v1.AdminService/DeletePool": _ADMIN,
    "/kvcm.v1.AdminService/DescribePool": _READ,
    "/kvcm.v1.AdminService/ListPools": Rule(roles=READ_ROLES, pool=PoolFrom.NONE),
    "/kvcm.v1.WorkerService/RegisterWorker": Rule(roles=("worker",), pool=PoolFrom.REQUEST),
    **{f"/kvcm.v1.SchedulerService/{method}": _SCHEDULE for method in _SCHEDULER_METHODS},
    "/kvcm.v1.SchedulerService/ResyncPool": Rule(
        roles=("scheduler",), pool=PoolFrom.REQUEST, create_roles=_CREATE
    ),
    "/kvcm.v1.EventService/SubscribeEvents": _READ,
    "/kvcm.v1.LookupService/Lookup": Rule(roles=READ_ROLES, pool=PoolFrom.NONE),
    "/kvcm.v1.LookupService/RoutePd": Rule(roles=READ_ROLES, pool=PoolFrom.NONE),
    **{f"/kvcm.v1.TransferService/{method}": _SCHEDULE for method in _TRANSFER_METHODS},
    "/kvcm.v1.TransferService/DescribeTransfer": _READ,
    "/kvcm.v1.TransferService/ListTransfers": Rule(roles=READ_ROLES, pool=PoolFrom.NONE),
    "/kvcm.v1.ReplicaService/ShipRecords": _REPLICA,
    "/kvcm.v1.ReplicaService/SetPlacement": _REPLICA,
    "/kvcm.v1.ReplicaService/GetReplicaState": _REPLICA,
    # HTTP, by verb and route template.
    "GET /metrics": Rule(roles=("scrape",), pool=PoolFrom.SERVER),
    "GET /healthz": _OPEN,
    "GET /readyz": _OPEN,
    "GET /v1/pools": Rule(roles=READ_ROLES, pool=PoolFrom.NONE),
    "GET /v1/pools/{pool}": Rule(roles=READ_ROLES, pool=PoolFrom.PATH),
    "GET /v1/pools/{pool}/events": Rule(roles=READ_ROLES, pool=PoolFrom.PATH),
    "POST /v1/lookup": Rule(roles=READ_ROLES, pool=PoolFrom.NONE),
    "POST /v1/pd/route": Rule(roles=READ_ROLES, pool=PoolFrom.NONE),
    "GET /v1/transfers": Rule(roles=READ_ROLES, pool=PoolFrom.NONE),
    "GET /v1/transfers/{pool}/{transfer_id}": Rule(roles=READ_ROLES, pool=PoolFrom.PATH),
    # The inspector page and the API docs: static HTML without data (a browser sends no bearer
    # header when it navigates); they ask for the token and send it to the routes above.
    "GET /": _OPEN,
    "GET /docs": _OPEN,
    "GET /openapi.json": _ANY_TOKEN,
    "HEAD /openapi.json": _ANY_TOKEN,
}
"""Every gRPC method and HTTP route, and who may call it."""

UNROUTED: Final = _ANY_TOKEN
"""An HTTP path no route serves (a 404 or 405 to come) still needs a valid token."""


def bearer_token(header: str) -> str:
    """The token of an ``authorization`` value (``""`` unless it is ``Bearer <token>``)."""
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def may_read(principal: PrincipalLike | None, pool_id: str) -> bool:
    """Whether ``principal`` may read ``pool_id`` (always without authentication)."""
    return principal is None or any(principal.has(role, pool_id) for role in READ_ROLES)


def refusal(
    principal: PrincipalLike, rule: Rule, pool_id: str, *, exists: bool = True
) -> str | None:
    """Why ``principal`` may not make a call under ``rule`` on ``pool_id`` (``None``: it may).

    Args:
        principal: The authenticated caller.
        rule: The call's row of :data:`RULES`.
        pool_id: The pool the call names (``""`` when it names none).
        exists: Whether the pool exists (a call that would create it needs
            ``rule.create_roles``).
    """
    if rule.pool in (PoolFrom.OPEN, PoolFrom.NONE):
        return None
    if rule.pool is PoolFrom.SERVER:
        if any(role in (*rule.roles, "admin") and glob == "*" for role, glob in principal.roles):
            return None
        return f"has no role {_either(rule.roles)} on every pool ('*')"
    creating = bool(rule.create_roles) and not exists
    roles = rule.create_roles if creating else rule.roles
    if any(principal.has(role, pool_id) for role in roles):
        return None
    missing = " (it does not exist: creating it)" if creating else ""
    return f"has no role {_either(roles)} for pool {shown(pool_id)}{missing}"


def _either(roles: tuple[str, ...]) -> str:
    named = " or ".join(roles)
    return named if "admin" in roles else f"{named} (or admin)"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Refused:
    principal: str
    peer: str
    method: str
    pool: str
    code: str
    reason: str


class RefusalLog:
    """The audit of refused calls, rate-limited by a token bucket.

    Up to ``burst`` lines at once, then ``rate_per_s`` a second; the lines held back are
    counted, and the count is logged (``event=auth_refusals_suppressed``) before the next line
    or, on an event loop, within a second of the first one held back.
    """

    def __init__(
        self,
        *,
        rate_per_s: float = 10.0,
        burst: int = 50,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """A full bucket."""
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self.suppressed = 0
        self._flush_armed = False

    def _take(self) -> bool:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate_per_s)
        self._stamp = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def refused(
        self,
        *,
        principal: str,
        peer: str,
        method: str,
        pool: str,
        code: str,
        reason: str,
    ) -> None:
        """Log one refusal (or count it when the bucket is empty).

        Args:
            principal: The token's name (``""``: no valid token was presented).
            peer: The caller's address as the transport names it.
            method: The gRPC method (``/kvcm.v1.AdminService/CreatePool``) or HTTP route
                (``GET /v1/pools/{pool}``; an unrouted path as sent).
            pool: The pool the call named (``""``: none).
            code: The status answered (``PERMISSION_DENIED``, ``UNAUTHENTICATED``, ``403``...).
            reason: Why, in words.
        """
        if not AUDIT_LOG.isEnabledFor(logging.WARNING):
            return
        if self.suppressed and self._take():
            self._log_suppressed()
        if not self._take():
            self.suppressed += 1
            self._arm_flush()
            return
        self._log(
            _Refused(
                principal=principal,
                peer=peer,
                method=method,
                pool=pool,
                code=code,
                reason=reason,
            )
        )

    @staticmethod
    def _log(refused: _Refused) -> None:
        who = refused.principal or "anonymous"
        AUDIT_LOG.warning(
            "refused %s to %s: %s",
            _safe(refused.method),
            who,
            refused.reason,
            extra={
                "event": "auth_refused",
                "principal": refused.principal,
                "peer": _safe(refused.peer),
                "method": _safe(refused.method),
                "pool": _safe(refused.pool),
                "code": refused.code,
                "reason": refused.reason,
            },
        )

    def _log_suppressed(self) -> None:
        count, self.suppressed = self.suppressed, 0
        AUDIT_LOG.warning(
            "%d refusals suppressed (over %g a second)",
            count,
            self.rate_per_s,
            extra={"event": "auth_refusals_suppressed", "suppressed": count},
        )

    def _arm_flush(self) -> None:
        if self._flush_armed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: the count goes out with the next line
        self._flush_armed = True
        loop.call_later(1.0, self._flush)

    def _flush(self) -> None:
        self._flush_armed = False
        if not self.suppressed:
            return
        if self._take():
            self._log_suppressed()
        else:
            self._arm_flush()


def _safe(value: str) -> str:
    """A caller-chosen string fit for one log line: as it is when plain, else quoted short."""
    if len(value) <= 128 and value.isascii() and value.isprintable():
        return value
    return shown(value)
