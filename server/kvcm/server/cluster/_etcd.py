"""The etcd session: one aetcd client over a list of endpoints, failing over between them.

aetcd (the maintained asyncio etcd v3 client, gRPC underneath) talks to one endpoint; this
wrapper keeps the list and moves to the next endpoint when a call finds the current one
unreachable, so a replica rides out the loss of one etcd member. Every call has a deadline; a
call that no endpoint answers raises :class:`EtcdUnavailableError`, whose message names etcd
and the endpoints, so the status a client finally sees says what is missing.

aetcd 1.0 opens plaintext channels only; with credentials (``https://`` endpoints, see
:func:`kvcm.server.tls.etcd_credentials`) each client is a :class:`_TlsClient`, aetcd's
client whose ``connect`` opens a TLS channel instead (server verified, client certificate
presented for etcd's ``--client-cert-auth``). Everything else is aetcd's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

__all__ = ["EtcdSession", "EtcdUnavailableError"]

_LOG = logging.getLogger("kvcm.server.cluster")
_T = TypeVar("_T")

# What aetcd raises when an endpoint does not answer (UNAVAILABLE, DEADLINE_EXCEEDED).
_UNREACHABLE: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
)


class EtcdUnavailableError(Exception):
    """No etcd endpoint answered within the deadline (every one was tried)."""


class _TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd is untyped
    """``aetcd.Client`` over a TLS channel (pinned aetcd 1.0: ``connect`` below mirrors its
    own, with ``grpc.aio.secure_channel`` in place of its plaintext channel)."""

    _connected: asyncio.Event
    _is_connecting: bool

    def __init__(
        self, *, credentials: Callable[[], grpc.ChannelCredentials], **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        """Open the TLS channel and the stubs (once; concurrent callers wait for it)."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = grpc.aio.secure_channel(
                f"{self._host}:{self._port}",
                self._credentials(),
                options=list(self._options.items()),
            )
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(
                aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


class EtcdSession:
    """aetcd clients for each endpoint, the current one first.

    Attributes:
        endpoints: ``(host, port)`` of each endpoint.
        timeout_s: Deadline of each etcd call, in seconds.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        timeout_s: float,
        credentials: Callable[[], grpc.ChannelCredentials] | None = None,
    ) -> None:
        """Prepare clients (nothing connects before the first call); with ``credentials``
        (see :func:`kvcm.server.tls.etcd_credentials`) over TLS."""
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self.tls = credentials is not None
        self._clients = [
            aetcd.Client(host=host, port=port, timeout=timeout_s)
            if credentials is None
            else _TlsClient(host=host, port=port, timeout=timeout_s, credentials=credentials)
            for host, port in endpoints
        ]
        self._current = 0

    @property
    def client(self) -> Any:
        """The current endpoint's ``aetcd.Client`` (for watches, which outlive one call)."""
        return self._clients[self._current]

    def describe(self) -> str:
        """``https://host:port,...`` (for messages)."""
        scheme = "https" if self.tls else "http"
        return ",".join(f"{scheme}://{host}:{port}" for host, port in self.endpoints)

    async def call(self, fn: Callable[[Any], Awaitable[_T]]) -> _T:
        """``await fn(client)`` on the current endpoint, then on each other one if unreachable.

        Raises:
            EtcdUnavailableError: No endpoint answered.
            aetcd.exceptions.ClientError: etcd answered with an error.
        """
        last: BaseException | None = None
        for _ in range(len(self._clients)):
            try:
                return await fn(self._clients[self._current])
            except _UNREACHABLE as exc:
                last = exc
                _LOG.debug("etcd endpoint %s unreachable: %s", self._current, exc)
                self._current = (self._current + 1) % len(self._clients)
        raise EtcdUnavailableError(
            f"etcd unreachable at {self.describe()} ({type(last).__name__}: {last})"
        ) from last

    async def close(self) -> None:
        """Close every client."""
        for client in self._clients:
            try:
                await client.close()
            except Exception:
                _LOG.debug("closing an etcd client failed", exc_info=True)
