"""What every client shares: settings, channel, stubs, error mapping, retries, codecs.

The three clients (``SchedulerClient``, ``AsyncSchedulerClient``, ``WorkerClient``) derive
from one of the two channel clients here, ``ChannelClient`` (synchronous) and
``AsyncChannelClient`` (asyncio), which differ only in how they wait: both take the same
arguments (validated once, in ``ClientSettings``), open the channel with the bearer token and
the trace-context interceptors, hold one stub per service (``Stubs``), and run every unary
call through ``_unary``: the call's deadline, then ``error_from_rpc`` (``_errors.py``) on
failure, raised ``from`` the gRPC error. A scheduler call is ``build_*`` (Python values to a
``kvcm.v1`` request) + one ``_unary`` + a decoder (``kvcm.wire``'s, or ``decode_*`` here for
the SDK's own records).

Retries: the channel's service config retries the calls ``service.proto`` declares idempotent
(``RegisterWorker``, ``Get*``/``List*``/``Describe*``, ``SubscribeEvents``, ``Lookup``,
``RoutePd``, every TransferService call) on UNAVAILABLE. A
``Step`` is idempotent only when it carries a ``step_seq``, which a service config cannot see,
so the clients retry such Steps themselves with the same policy (``RETRY_POLICY``).

In a kvcm cluster (several seeds, or a pool whose owner a redirect named), an idempotent call's
attempt is also bounded by ``RetryPolicy.attempt_timeout_s``: a paused or black-holed replica
accepts the connection and answers nothing (DEADLINE_EXCEEDED, not UNAVAILABLE), so an attempt
that gets no answer in time forgets the pool's route and asks the next seed, which redirects
to the pool's current owner (its promoted standby). Other calls keep the caller's whole
deadline and are not sent again (docs/cluster.md); a lone server behaves as without a cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Self, TypeVar

import grpc

from kvcm.client._errors import ServiceError, StatusCode, UnavailableError, error_from_rpc
from kvcm.client._lookup_port import AsyncLookupPortConnection, LookupPortConnection
from kvcm.client._step import StepBuilder, check_in_flight_tokens, check_report_cached_blocks
from kvcm.client._tracing import aio_intercept, intercept
from kvcm.client._types import (
    DEFAULT_TIMEOUT_S,
    USE_CLIENT_DEFAULT,
    CacheHit,
    FreeMode,
    ItemStatus,
    KVCacheBlocks,
    PoolConfig,
    RequestBlocks,
    SlotOptions,
    UseClientDefault,
)
from kvcm.common.errors import InvalidArgumentError
from kvcm.core.lookup import LookupAnswer
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS
from kvcm.core.pd_route import PdRoute
from kvcm.v1 import admin_pb2, common_pb2, scheduler_pb2, service_pb2, service_pb2_grpc
from kvcm.wire import (
    FREE_MODE_TO_PROTO,
    fill_grouped,
    grouped_from_proto,
    pool_config_to_proto,
    slot_options_to_proto,
)

__all__ = [
    "MAX_REROUTES",
    "unrouted_error",
    "RETRY_POLICY",
    "AsyncChannelClient",
    "ChannelClient",
    "ClientSettings",
    "RetryPolicy",
    "Stubs",
    "Timeout",
    "build_channel_options",
    "redirect_owner",
]

Timeout = float | UseClientDefault
"""A call's deadline in seconds, or ``USE_CLIENT_DEFAULT`` (the client's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How idempotent calls are retried on UNAVAILABLE (gRPC's retryPolicy fields).

    Attributes:
        max_attempts: Attempts in all, the first included (gRPC caps it at 5), on a lone
            server. In a kvcm cluster an idempotent call that stays UNAVAILABLE (a failover
            or a move under way) backs off and is sent again until its deadline.
        initial_backoff_s: Upper bound of the first randomized backoff, in seconds.
        max_backoff_s: Upper bound of any backoff, in seconds.
        backoff_multiplier: Growth of the bound after each attempt.
        attempt_timeout_s: In a kvcm cluster only (several seeds, or a pool redirected to
            its owner): the longest one attempt of an idempotent call (a Step with a
            step_seq, a read) waits before it is sent again through the seeds, so that a
            paused or unreachable primary is left for its promoted standby, which takes over
            about one etcd lease TTL after the pause: about a quarter of the cluster's TTL
            (the server's default TTL is 5 s) serves the pool again within TTL + 1 s. The
            call's own deadline still bounds all attempts together.
    """

    max_attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    backoff_multiplier: float = 2.0
    attempt_timeout_s: float = 1.25

    def __post_init__(self) -> None:
        # A zero backoff or a shrinking one would spin until a cluster call's deadline.
        bounds = {
            "initial_backoff_s": (self.initial_backoff_s, 0.0, "a positive number of seconds"),
            "max_backoff_s": (self.max_backoff_s, 0.0, "a positive number of seconds"),
            "attempt_timeout_s": (self.attempt_timeout_s, 0.0, "a positive number of seconds"),
            "backoff_multiplier": (self.backoff_multiplier, 1.0, "a number >= 1"),
        }
        for field, (value, low, what) in bounds.items():
            bad = isinstance(value, bool) or not isinstance(value, int | float)
            if bad or not (value >= low if low else value > 0):
                raise InvalidArgumentError(f"{field} must be {what}, got {value!r}", field=field)
        attempts = self.max_attempts
        # gRPC's service config refuses a retry policy of fewer than 2 attempts.
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 2:
            raise InvalidArgumentError(
                f"max_attempts must be an integer >= 2, got {attempts!r}", field="max_attempts"
            )

    def backoff_s(self, attempt: int) -> float:
        """Upper bound of the backoff before attempt ``attempt + 1`` (``attempt`` >= 1)."""
        bound = self.initial_backoff_s
        # Grown one attempt at a time and capped, never as a power: a cluster's call retries
        # until its deadline, and 2.0 ** 1100 overflows.
        for _ in range(min(attempt, 64) - 1):
            bound *= self.backoff_multiplier
            if bound >= self.max_backoff_s:
                break
        return float(min(bound, self.max_backoff_s))


RETRY_POLICY: Final = RetryPolicy()

# The calls service.proto declares idempotent, by service.
_IDEMPOTENT_METHODS: Final = {
    "kvcm.v1.AdminService": ("ListPools", "DescribePool"),
    "kvcm.v1.WorkerService": ("RegisterWorker",),
    "kvcm.v1.SchedulerService": (
        "GetComputedBlocks",
        "GetBlocks",
        "GetBlockIds",
        "GetNumCommonPrefixBlocks",
        "GetUsage",
    ),
    "kvcm.v1.EventService": ("SubscribeEvents",),
    "kvcm.v1.LookupService": ("Lookup", "RoutePd"),
    # Every transfer call: a retry with the same transfer_id answers the same record.
    "kvcm.v1.TransferService": (
        "HoldSource",
        "PlanTransfer",
        "CommitTransfer",
        "ReleaseTransfer",
        "ExpireTransfer",
        "DescribeTransfer",
        "ListTransfers",
    ),
}


def _service_config(policy: RetryPolicy) -> str:
    names = [
        {"service": service, "method": method}
        for service, methods in _IDEMPOTENT_METHODS.items()
        for method in methods
    ]
    retry = {
        "maxAttempts": policy.max_attempts,
        "initialBackoff": f"{policy.initial_backoff_s}s",
        "maxBackoff": f"{policy.max_backoff_s}s",
        "backoffMultiplier": policy.backoff_multiplier,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": retry}]})


# Steps carry whole prompts for new requests: allow large messages both ways.
_MAX_MESSAGE_BYTES: Final = 256 * 1024 * 1024


def build_channel_options(
    extra: Sequence[tuple[str, Any]] = (), policy: RetryPolicy = RETRY_POLICY
) -> list[tuple[str, Any]]:
    """gRPC channel options: the service config with its retry policy, message limits, extras.

    Args:
        extra: More channel options; later entries win.
        policy: The retry policy of idempotent calls.

    Returns:
        The options for ``grpc.insecure_channel`` / ``grpc.aio.insecure_channel``.
    """
    return [
        ("grpc.service_config", _service_config(policy)),
        ("grpc.enable_retries", 1),
        ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        *extra,
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsConfig:
    """TLS for a client's channel (PEM bytes; :meth:`from_files` reads paths).

    Attributes:
        root_certificates: CA certificates that sign the server's certificate (``None``:
            gRPC's default roots).
        certificate_chain: The client's certificate, for servers that require mutual TLS.
        private_key: The client certificate's key.
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise InvalidArgumentError(
                "certificate_chain and private_key go together (mutual TLS)", field="tls"
            )

    @classmethod
    def from_files(
        cls, ca: str | None = None, cert: str | None = None, key: str | None = None
    ) -> TlsConfig:
        """Read the PEM files (``None``: not given).

        Raises:
            InvalidArgumentError: A file cannot be read, or only one of cert and key is given.
        """

        def read(name: str, path: str | None) -> bytes | None:
            if not path:
                return None
            try:
                with open(path, "rb") as handle:
                    return handle.read()
            except OSError as exc:
                raise InvalidArgumentError(
                    f"tls {name}: cannot read {path!r}: {exc.strerror}", field="tls"
                ) from exc

        return cls(
            root_certificates=read("ca", ca),
            certificate_chain=read("cert", cert),
            private_key=read("key", key),
        )

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientSettings:
    """Settings every client takes (validated once, shared by sync and async clients).

    Attributes:
        target: The server's address, ``host:port``.
        timeout_s: Deadline of every unary call that does not give its own, in seconds.
        retry_policy: Retries of idempotent calls on UNAVAILABLE.
        channel_options: Extra gRPC channel options.
        tls: TLS for the channel; ``None``: plaintext.
    """

    target: str
    timeout_s: float
    retry_policy: RetryPolicy = RETRY_POLICY
    channel_options: tuple[tuple[str, Any], ...] = ()
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise InvalidArgumentError(f"target must be a non-empty str, got {self.target!r}")
        check_timeout("timeout", self.timeout_s)

    def deadline(self, timeout: float | UseClientDefault) -> float:
        """The call's deadline in seconds from now: its own, or the client's."""
        if timeout is USE_CLIENT_DEFAULT:
            return self.timeout_s
        check_timeout("timeout", timeout)
        return float(timeout)  # type: ignore[arg-type]

    def options(self) -> list[tuple[str, Any]]:
        """The channel options to open the channel with."""
        return build_channel_options(self.channel_options, self.retry_policy)

    def channel(self, target: str | None = None) -> grpc.Channel:
        """A synchronous channel to ``target`` (``None``: the target) (TLS when configured)."""
        target = self.target if target is None else target
        if self.tls is None:
            return grpc.insecure_channel(target, options=self.options())
        return grpc.secure_channel(target, self.tls.credentials(), options=self.options())

    def aio_channel(
        self, interceptors: Sequence[Any], target: str | None = None
    ) -> grpc.aio.Channel:
        """An asyncio channel to ``target`` (``None``: the target) (TLS when configured)."""
        target = self.target if target is None else target
        if self.tls is None:
            return grpc.aio.insecure_channel(
                target, options=self.options(), interceptors=interceptors
            )
        return grpc.aio.secure_channel(
            target, self.tls.credentials(), options=self.options(), interceptors=interceptors
        )


def should_retry(
    error: ServiceError,
    attempt: int,
    *,
    resendable: bool,
    clustered: bool,
    policy: RetryPolicy,
    give_up_at: float,
) -> bool:
    """Whether a call that failed on this attempt is worth another one after a backoff.

    Only a call that may run twice (an idempotent RPC, a Step with a step_seq), only after
    UNAVAILABLE (its replica unreachable, or still redirected after ``MAX_REROUTES`` hops
    while a placement changes), and only while the call's deadline leaves room for the
    backoff. A lone server's attempts are also bounded by ``max_attempts``; in a kvcm
    cluster only the deadline bounds them, so that an idempotent call rides through a
    failover (about one etcd lease TTL) instead of failing in its first second.

    Args:
        resendable: Whether the call may run twice.
        clustered: Whether the call goes to a kvcm cluster.
        error: How the attempt failed.
        attempt: Attempts made so far.
        policy: The retry policy.
        give_up_at: ``time.monotonic()`` value of the call's deadline.
    """
    return (
        resendable
        and error.code is StatusCode.UNAVAILABLE
        and (clustered or attempt < policy.max_attempts)
        and time.monotonic() + policy.backoff_s(attempt) < give_up_at
    )


def check_timeout(field: str, value: object) -> None:
    """Reject a deadline that is not a positive number of seconds.

    Raises:
        InvalidArgumentError: It is not.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidArgumentError(f"{field} must be a positive number of seconds, got {value!r}")


# ---------------------------------------------------------------------------- clients
def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries: the bearer token, if any."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class Stubs:
    """One stub per kvcm service, all on one channel (building a stub sends nothing).

    Attributes:
        admin: ``AdminService``.
        scheduler: ``SchedulerService``.
        events: ``EventService``.
        lookup: ``LookupService``.
        transfers: ``TransferService``.
        worker: ``WorkerService``.
    """

    __slots__ = ("admin", "events", "lookup", "scheduler", "transfers", "worker")

    def __init__(self, channel: Any) -> None:
        """Build the stubs on ``channel`` (sync or asyncio)."""
        self.admin = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
        self.scheduler = service_pb2_grpc.SchedulerServiceStub(channel)  # type: ignore[no-untyped-call]
        self.events = service_pb2_grpc.EventServiceStub(channel)  # type: ignore[no-untyped-call]
        self.lookup = service_pb2_grpc.LookupServiceStub(channel)  # type: ignore[no-untyped-call]
        self.transfers = service_pb2_grpc.TransferServiceStub(channel)  # type: ignore[no-untyped-call]
        self.worker = service_pb2_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]


# A kvcm cluster's redirect (docs/cluster.md): the call was refused before it ran, and the
# trailing metadata name the replica that serves the pool.
_OWNER_KEY: Final = "kvcm-owner"
MAX_REROUTES: Final = 4
"""Reroutes one call follows (redirects, and asking a seed after its replica was unreachable)."""
_STUB_OF_SERVICE: Final = {
    "AdminService": "admin",
    "SchedulerService": "scheduler",
    "EventService": "events",
    "LookupService": "lookup",
    "TransferService": "transfers",
    "WorkerService": "worker",
}
# Method name -> the Stubs attribute that holds it.
_STUB_OF_METHOD: Final = {
    method.name: _STUB_OF_SERVICE[service.name]
    for service in service_pb2.DESCRIPTOR.services_by_name.values()
    if service.name in _STUB_OF_SERVICE
    for method in service.methods
}


def split_seeds(target: str) -> list[str]:
    """The ``host:port`` seeds of a target (``"a:1,b:2"``: a cluster's replicas).

    Raises:
        InvalidArgumentError: An empty seed.
    """
    seeds = [seed.strip() for seed in target.split(",")]
    if not all(seeds):
        raise InvalidArgumentError(f"target: empty address in {target!r}", field="target")
    return seeds


def redirect_owner(exc: grpc.RpcError) -> str | None:
    """The owner a cluster's redirect names, or ``None`` when ``exc`` is not a redirect."""
    if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == _OWNER_KEY:
            return str(value)
    return None


def _resendable(method: str, request: Any, step: StepBuilder | None) -> bool:
    """Whether a call that may have reached a dead replica can be sent again elsewhere."""
    if step is not None:
        return step.step_seq is not None
    return any(method in names for names in _IDEMPOTENT_METHODS.values())


class _ClientBase:
    """Settings, target, channel and stubs: what both channel clients hold.

    A target may list several seeds, ``"host:port,host:port"`` (a kvcm cluster's replicas,
    docs/cluster.md). Calls go to the first seed, and a call naming a pool goes to the
    replica that last answered for it: a redirect (FAILED_PRECONDITION with ``kvcm-owner``)
    is followed at once and remembered per pool; when the remembered replica or the seed is
    unreachable (UNAVAILABLE), the route is forgotten and the next seed asked, and the call
    is sent again when it is idempotent (else it raises, and the next call finds the owner).
    An idempotent call's attempt in a cluster that gets no answer within
    ``RetryPolicy.attempt_timeout_s`` (a paused primary) is handled as UNAVAILABLE is.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_policy: RetryPolicy = RETRY_POLICY,
        channel_options: Sequence[tuple[str, Any]] = (),
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        """Open a channel to ``target`` (connecting lazily, on the first call).

        Args:
            target: ``host:port`` of the server.
            timeout: Deadline of every call that does not give its own, in seconds.
            retry_policy: Retries of idempotent calls on UNAVAILABLE.
            channel_options: Extra gRPC channel options (``("grpc.keepalive_time_ms", ...)``).
            tls: TLS (server roots; a client certificate for mutual TLS); ``None``: plaintext.
            token: A bearer token sent with every call (a server with ``auth_tokens``).

        Raises:
            InvalidArgumentError: ``target`` is empty or ``timeout`` is not positive.
        """
        self._settings = ClientSettings(
            target=target,
            timeout_s=timeout,
            retry_policy=retry_policy,
            channel_options=tuple(channel_options),
            tls=tls,
        )
        self.target = target
        self._seeds = split_seeds(target)
        self._seed = 0
        self._metadata = auth_metadata(token)
        self._channel: Any = self._open_channel(self._seeds[0], self._metadata)
        self._stubs = Stubs(self._channel)
        # Replica address -> (channel, stubs), opened on first use; pool id -> its replica.
        self._replicas: dict[str, tuple[Any, Stubs]] = {
            self._seeds[0]: (self._channel, self._stubs)
        }
        self._routes: dict[str, str] = {}
        # Held while a replica's channel is opened or the seed moves: calls from several
        # threads share a client, and two failing at once must neither open a replica twice
        # (the second channel never closed) nor leave _seed and _stubs naming different seeds.
        self._route_lock = threading.RLock()

    def _open_channel(self, target: str, metadata: Sequence[tuple[str, str]]) -> Any:
        raise NotImplementedError

    def _replica(self, address: str) -> Stubs:
        entry = self._replicas.get(address)
        if entry is None:
            with self._route_lock:
                entry = self._replicas.get(address)
                if entry is None:
                    channel = self._open_channel(address, self._metadata)
                    entry = self._replicas[address] = (channel, Stubs(channel))
        return entry[1]

    def _next_seed(self, failed: Stubs) -> None:
        """Move to the next seed, unless a concurrent call already moved past ``failed``
        (the stubs the failed call used): one failure moves the seed once."""
        with self._route_lock:
            if self._stubs is not failed:
                return
            seed = (self._seed + 1) % len(self._seeds)
            self._seed, self._stubs = seed, self._replica(self._seeds[seed])

    def _stubs_for(self, pool_id: str | None) -> Stubs:
        """The stubs of the pool's replica as last learned, else of the current seed."""
        address = self._routes.get(pool_id) if pool_id else None
        return self._replica(address) if address is not None else self._stubs

    def _rerouted(
        self,
        exc: grpc.RpcError,
        pool_id: str | None,
        resendable: bool,
        used: Stubs | None = None,
    ) -> bool:
        """Learn from a failed call; whether to send it again (to the new route).

        A redirect names the pool's replica: remembered, and the call (refused before it
        ran) goes there. UNAVAILABLE: the remembered replica, or the current seed, is
        forgotten (the next seed is asked); the call is sent again only if ``resendable``.
        ``used``: the stubs the call went to; the seed moves only if it still is theirs
        (calls failing together on one seed move it once).
        """
        stubs = self._stubs if used is None else used
        owner = redirect_owner(exc)
        if owner is not None and pool_id:
            self._routes[pool_id] = owner
            return True
        if exc.code() is not grpc.StatusCode.UNAVAILABLE:
            return False
        if pool_id and self._routes.pop(pool_id, None) is not None:
            return resendable
        if len(self._seeds) > 1:
            self._next_seed(stubs)
            return resendable
        return False

    def _clustered(self, pool_id: str | None) -> bool:
        """Whether calls of ``pool_id`` go to a kvcm cluster: several seeds, or a route
        learned from a redirect (a lone server never redirects)."""
        return len(self._seeds) > 1 or (pool_id is not None and pool_id in self._routes)

    def _attempt_s(self, pool_id: str | None, give_up_at: float, resendable: bool) -> float:
        """The deadline of the next attempt: what is left of the call's, bounded by
        ``attempt_timeout_s`` when the call can be sent again elsewhere (a cluster)."""
        left = max(give_up_at - time.monotonic(), 1e-3)
        if resendable and self._clustered(pool_id):
            return min(left, self._settings.retry_policy.attempt_timeout_s)
        return left

    def _timed_out(
        self,
        exc: grpc.RpcError,
        pool_id: str | None,
        give_up_at: float,
        resendable: bool,
        used: Stubs | None = None,
    ) -> bool:
        """Learn from an attempt that got no answer in time (DEADLINE_EXCEEDED) in a
        cluster: the pool's route is forgotten, and the seed when the call went to it, so
        the next attempt asks the next seed (which redirects to the current owner). Returns
        whether to send the call again: only a resendable call with time left; a lone
        server's DEADLINE_EXCEEDED, or the call's own deadline, raises as it always did."""
        if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED or not self._clustered(pool_id):
            return False
        stubs = self._stubs if used is None else used
        routed = self._routes.pop(pool_id, None) if pool_id else None
        if (routed is None or self._replicas.get(routed, (None, None))[1] is stubs) and len(
            self._seeds
        ) > 1:
            self._next_seed(stubs)
        return resendable and time.monotonic() < give_up_at - 1e-3

    def _reopener(self, request: Any, timeout: float | None) -> Callable[[str], Any]:
        """Opens the ``SubscribeEvents`` stream of ``request`` again on a named owner (a
        redirect), remembering the owner for the pool."""

        def reopen(owner: str) -> Any:
            self._routes[request.pool_id] = owner
            return self._replica(owner).events.SubscribeEvents(request, timeout=timeout)

        return reopen

    def _stream_lost(self, pool_id: str) -> Callable[[grpc.RpcError], object]:
        """Learns from an event stream of ``pool_id`` that failed: UNAVAILABLE forgets the
        replica it was on (the remembered owner, else the current seed), so that subscribing
        again asks the next seed, which redirects to the pool's current owner."""
        return lambda exc: self._rerouted(exc, pool_id, resendable=False)

    @staticmethod
    def _stub(stubs: Stubs, method: str) -> Any:
        return getattr(getattr(stubs, _STUB_OF_METHOD[method]), method)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(target={self.target!r})"


class ChannelClient(_ClientBase):
    """A synchronous client: one ``grpc.Channel``, calls that block. Thread-safe."""

    _lookup_port: LookupPortConnection | None = None
    """The lookup port's connection (a scheduler client's ``lookup_address``), closed here."""

    def _open_channel(self, target: str, metadata: Sequence[tuple[str, str]]) -> grpc.Channel:
        return intercept(self._settings.channel(target), metadata)

    def _unary(
        self,
        method: str,
        callable_: Any,
        request: Any,
        timeout: Timeout,
        trailers: list[tuple[str, str]] | None = None,
    ) -> Any:
        """Call ``method`` with the call's deadline on the replica that serves its pool
        (``callable_`` is the seed's; redirects followed); a failure raises the SDK's error.
        ``trailers``: where the answer's trailing metadata go (``None``: not read)."""
        deadline = self._settings.deadline(timeout)
        pool_id = _pool_of(request)
        if trailers is not None:
            callable_ = _trailed(callable_, trailers)
        if pool_id is None and len(self._seeds) == 1:
            try:
                return callable_(request, timeout=deadline)
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, method) from exc
        resendable = _resendable(method, request, None)
        give_up_at = time.monotonic() + deadline
        hop, attempt = 0, 1
        while True:
            try:
                stubs = self._stubs_for(pool_id)
                stub = self._stub(stubs, method)
                if trailers is not None:
                    stub = _trailed(stub, trailers)
                return stub(request, timeout=self._attempt_s(pool_id, give_up_at, resendable))
            except grpc.RpcError as exc:
                if self._timed_out(exc, pool_id, give_up_at, resendable, stubs):
                    continue  # bounded by the call's deadline
                if hop < MAX_REROUTES and self._rerouted(exc, pool_id, resendable, stubs):
                    hop += 1
                    continue
                error = unrouted_error(exc, method)
                # A lone server's UNAVAILABLE was already retried by the channel (gRPC's
                # retry policy); a cluster's placement that is changing is waited for.
                policy = self._settings.retry_policy
                if not self._clustered(pool_id) or not should_retry(
                    error,
                    attempt,
                    resendable=resendable,
                    clustered=True,
                    policy=policy,
                    give_up_at=give_up_at,
                ):
                    raise error from exc
                time.sleep(random.uniform(0.0, policy.backoff_s(attempt)))
                attempt, hop = attempt + 1, 0

    def close(self) -> None:
        """Close the channels (and the lookup port's connection); calls in flight are
        cancelled."""
        if self._lookup_port is not None:
            self._lookup_port.close()
        for channel, _ in self._replicas.values():
            channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncChannelClient(_ClientBase):
    """An asyncio client: one ``grpc.aio.Channel``; create it inside the loop that uses it."""

    _lookup_port: AsyncLookupPortConnection | None = None
    """The lookup port's connection (a scheduler client's ``lookup_address``), closed here."""

    def _open_channel(self, target: str, metadata: Sequence[tuple[str, str]]) -> grpc.aio.Channel:
        return aio_intercept(self._settings.aio_channel((), target), metadata)

    async def _unary(
        self,
        method: str,
        callable_: Any,
        request: Any,
        timeout: Timeout,
        trailers: list[tuple[str, str]] | None = None,
    ) -> Any:
        """Await ``method`` with the call's deadline on the replica that serves its pool
        (``callable_`` is the seed's; redirects followed); a failure raises the SDK's error.
        ``trailers``: where the answer's trailing metadata go (``None``: not read)."""
        deadline = self._settings.deadline(timeout)
        pool_id = _pool_of(request)
        if trailers is not None:
            callable_ = _async_trailed(callable_, trailers)
        if pool_id is None and len(self._seeds) == 1:
            try:
                return await callable_(request, timeout=deadline)
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, method) from exc
        resendable = _resendable(method, request, None)
        give_up_at = time.monotonic() + deadline
        hop, attempt = 0, 1
        while True:
            try:
                stubs = self._stubs_for(pool_id)
                stub = self._stub(stubs, method)
                if trailers is not None:
                    stub = _async_trailed(stub, trailers)
                return await stub(request, timeout=self._attempt_s(pool_id, give_up_at, resendable))
            except grpc.RpcError as exc:
                if self._timed_out(exc, pool_id, give_up_at, resendable, stubs):
                    continue  # bounded by the call's deadline
                if hop < MAX_REROUTES and self._rerouted(exc, pool_id, resendable, stubs):
                    hop += 1
                    continue
                error = unrouted_error(exc, method)
                # A lone server's UNAVAILABLE was already retried by the channel (gRPC's
                # retry policy); a cluster's placement that is changing is waited for.
                policy = self._settings.retry_policy
                if not self._clustered(pool_id) or not should_retry(
                    error,
                    attempt,
                    resendable=resendable,
                    clustered=True,
                    policy=policy,
                    give_up_at=give_up_at,
                ):
                    raise error from exc
                await asyncio.sleep(random.uniform(0.0, policy.backoff_s(attempt)))
                attempt, hop = attempt + 1, 0

    async def close(self) -> None:
        """Close the channels (and the lookup port's connection); calls in flight are
        cancelled."""
        if self._lookup_port is not None:
            await self._lookup_port.close()
        for channel, _ in self._replicas.values():
            await channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def unrouted_error(exc: grpc.RpcError, method: str) -> ServiceError:
    """The SDK error for a call that failed for good. A call still redirected after
    ``MAX_REROUTES`` hops (replicas' views of a placement that is changing, a failover or a
    move) did not run anywhere: it raises ``UnavailableError``, which callers retry, rather
    than the redirect's FAILED_PRECONDITION."""
    if redirect_owner(exc) is None:
        return error_from_rpc(exc, method)
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return UnavailableError(
        f"{details} (still redirected after {MAX_REROUTES} hops: the pool's placement is "
        "changing; the call did not run, send it again)",
        code=StatusCode.UNAVAILABLE,
        method=method,
    )


# A kvcm cluster's fanned-out answer (docs/cluster.md): the replicas it did not hear from.
_MISSING_KEY: Final = "kvcm-missing-replicas"
_Answer = TypeVar("_Answer", LookupAnswer, PdRoute)


def _trailed(callable_: Any, trailers: list[tuple[str, str]]) -> Callable[..., Any]:
    """``callable_`` (a sync unary multicallable) that also keeps its answer's trailers."""

    def call(request: Any, *, timeout: float | None) -> Any:
        response, rpc = callable_.with_call(request, timeout=timeout)
        trailers.extend(rpc.trailing_metadata() or ())
        return response

    return call


def _async_trailed(callable_: Any, trailers: list[tuple[str, str]]) -> Callable[..., Any]:
    """``callable_`` (an asyncio unary multicallable) that also keeps its answer's trailers."""

    async def call(request: Any, *, timeout: float | None) -> Any:
        rpc = callable_(request, timeout=timeout)
        response = await rpc
        trailers.extend(await rpc.trailing_metadata() or ())
        return response

    return call


def missing_replicas(trailers: Sequence[tuple[str, str]]) -> tuple[str, ...]:
    """The replicas a cluster's fanned-out answer missed, as its trailers name them."""
    for key, value in trailers:
        if key == _MISSING_KEY and value:
            return tuple(str(value).split(","))
    return ()


def with_missing(answer: _Answer, trailers: Sequence[tuple[str, str]]) -> _Answer:
    """``answer`` (a ``LookupAnswer`` or ``PdRoute``) with the replicas its call missed."""
    missing = missing_replicas(trailers)
    return dataclasses.replace(answer, missing_replicas=missing) if missing else answer


def _pool_of(request: Any) -> str | None:
    """The pool a unary request names (``None``: none, or a request stream)."""
    pool_id = getattr(request, "pool_id", None)
    return pool_id if isinstance(pool_id, str) and pool_id else None


# ----------------------------------------------------------------------------- blocks
def grouped_to_blocks(message: common_pb2.GroupedBlockIds) -> KVCacheBlocks:
    """Decode a ``GroupedBlockIds`` into the SDK's ``KVCacheBlocks``."""
    return KVCacheBlocks(grouped_from_proto(message))


def blocks_to_grouped(blocks: KVCacheBlocks, message: common_pb2.GroupedBlockIds) -> None:
    """Fill a ``GroupedBlockIds`` from per-group id lists."""
    fill_grouped(blocks.block_ids, message)


# ------------------------------------------------------------------------------ admin
def build_create_pool(
    pool_id: str, config: PoolConfig, replication_mode: str | None = None
) -> admin_pb2.CreatePoolRequest:
    """``CreatePoolRequest`` for a pool id, config and replication mode (``None``: sync)."""
    if not isinstance(config, PoolConfig):
        raise InvalidArgumentError(f"config must be a PoolConfig, got {config!r}")
    if replication_mode not in (None, "sync", "async"):
        raise InvalidArgumentError(
            f"replication_mode must be 'sync' or 'async', got {replication_mode!r}",
            field="replication_mode",
        )
    return admin_pb2.CreatePoolRequest(
        pool_id=pool_id,
        config=pool_config_to_proto(config),
        replication_mode=replication_mode or "",
    )


RESYNC_CHUNK_BYTES: Final = 1 << 20
"""Snapshot bytes per ResyncPool message (well under the server's message limit)."""


def build_resync_chunks(
    pool_id: str, snapshot: bytes, config: PoolConfig, step_seq: int
) -> Iterator[scheduler_pb2.ResyncPoolRequest]:
    """The ``ResyncPoolRequest`` stream of one snapshot (the first names the pool)."""
    if not isinstance(config, PoolConfig):
        raise InvalidArgumentError(f"config must be a PoolConfig, got {config!r}")
    if step_seq < 0:
        raise InvalidArgumentError(f"step_seq must be >= 0, got {step_seq}")
    view = memoryview(snapshot)
    yield scheduler_pb2.ResyncPoolRequest(
        pool_id=pool_id,
        config=pool_config_to_proto(config),
        step_seq=step_seq,
        data=bytes(view[:RESYNC_CHUNK_BYTES]),
    )
    for start in range(RESYNC_CHUNK_BYTES, len(view), RESYNC_CHUNK_BYTES):
        yield scheduler_pb2.ResyncPoolRequest(data=bytes(view[start : start + RESYNC_CHUNK_BYTES]))


# -------------------------------------------------------------------------- scheduler
def build_add_request(
    pool_id: str,
    request_key: int,
    prompt_token_ids: Sequence[int],
    block_hashes: Sequence[bytes] | bytes,
    *,
    request_id: str,
    lora_id: int | None,
    lora_name: str | None,
    cache_salt: str | None,
    skip_reading_prefix_cache: bool,
    report_cached_blocks: bool = False,
) -> scheduler_pb2.AddRequestRequest:
    """``AddRequestRequest``: one new request with its prompt and the prompt's block hashes."""
    check_report_cached_blocks(report_cached_blocks)
    request = scheduler_pb2.NewRequest(
        request_key=request_key,
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        block_hashes=block_hashes if isinstance(block_hashes, bytes) else b"".join(block_hashes),
        skip_reading_prefix_cache=skip_reading_prefix_cache,
        report_cached_blocks=report_cached_blocks,
    )
    if lora_id is not None:
        request.lora_id = lora_id
    if lora_name is not None:
        request.lora_name = lora_name
    if cache_salt is not None:
        request.cache_salt = cache_salt
    return scheduler_pb2.AddRequestRequest(pool_id=pool_id, request=request)


def build_append_tokens(
    pool_id: str, request_key: int, token_ids: Sequence[int], block_hashes: Sequence[bytes] | bytes
) -> scheduler_pb2.AppendTokensRequest:
    """``AppendTokensRequest``: produced tokens and the hashes of the blocks they filled."""
    return scheduler_pb2.AppendTokensRequest(
        pool_id=pool_id,
        request_key=request_key,
        token_ids=token_ids,
        block_hashes=block_hashes if isinstance(block_hashes, bytes) else b"".join(block_hashes),
    )


def build_free(pool_id: str, request_key: int, mode: FreeMode) -> scheduler_pb2.FreeRequest:
    """``FreeRequest`` finishing or preempting a request."""
    wire_mode: Any = FREE_MODE_TO_PROTO[mode]
    return scheduler_pb2.FreeRequest(pool_id=pool_id, request_key=request_key, mode=wire_mode)


def build_get_computed_blocks(
    pool_id: str, request_key: int, max_cache_hit_length: int | None
) -> scheduler_pb2.GetComputedBlocksRequest:
    """``GetComputedBlocksRequest`` with an optional cap of the hit."""
    message = scheduler_pb2.GetComputedBlocksRequest(pool_id=pool_id, request_key=request_key)
    message.lookup.SetInParent()
    if max_cache_hit_length is not None:
        message.lookup.max_cache_hit_length = max_cache_hit_length
    return message


def decode_cache_hit(message: scheduler_pb2.GetComputedBlocksResponse) -> CacheHit:
    """Decode ``GetComputedBlocks``' answer."""
    return CacheHit(grouped_to_blocks(message.blocks), message.num_computed_tokens)


def build_allocate_slots(
    pool_id: str,
    request_key: int,
    *,
    num_new_tokens: int,
    num_computed_tokens: int,
    hit: CacheHit | None,
    options: SlotOptions,
    num_in_flight_tokens: int = 0,
) -> scheduler_pb2.AllocateSlotsRequest:
    """``AllocateSlotsRequest``, with the hit to adopt and the non-default knobs."""
    message = scheduler_pb2.AllocateSlotsRequest(
        pool_id=pool_id,
        request_key=request_key,
        num_new_tokens=num_new_tokens,
        num_computed_tokens=num_computed_tokens,
    )
    if hit is not None and (hit.num_computed_tokens or hit.blocks):
        message.new_computed.num_new_computed_tokens = hit.num_computed_tokens
        blocks_to_grouped(hit.blocks, message.new_computed.blocks)
    if options is not DEFAULT_SLOT_OPTIONS or num_in_flight_tokens:
        check_in_flight_tokens(num_in_flight_tokens)
        slot_options_to_proto(options, num_in_flight_tokens, message.options)
    return message


def decode_allocation(message: scheduler_pb2.AllocateSlotsResponse) -> KVCacheBlocks | None:
    """Decode ``AllocateSlots``' answer: the new blocks, or ``None`` when they do not fit."""
    if int(message.status) != ItemStatus.OK:
        return None
    return grouped_to_blocks(message.new_blocks)


def decode_request_blocks(
    message: scheduler_pb2.GetBlocksResponse, hash_length_bytes: int | None = None
) -> RequestBlocks:
    """Decode ``GetBlocks``' answer (hashes split by the number of cached blocks)."""
    raw = message.block_hashes
    num_cached = sum(1 for cached in message.is_cached if cached)
    if hash_length_bytes is None:
        hash_length_bytes = len(raw) // num_cached if num_cached else 0
    hashes = tuple(
        raw[i : i + hash_length_bytes]
        for i in range(0, num_cached * hash_length_bytes, hash_length_bytes)
    )
    return RequestBlocks(
        blocks=grouped_to_blocks(message.blocks),
        ref_cnts=tuple(message.ref_cnts),
        is_cached=tuple(message.is_cached),
        block_hashes=hashes,
    )
