"""The HTTP side's cluster-wide reads (``kvcm.server.http.ClusterReadsLike``).

``POST /v1/lookup`` and ``POST /v1/pd/route`` run the gRPC fan-out's own code
(:func:`~kvcm.server.cluster._fanout.cluster_lookup`,
:func:`~kvcm.server.cluster._fanout.cluster_route_pd`): every replica, this one included over
the loopback, is asked over gRPC as a peer, with the caller's token; the merge is the one the
gRPC answer gets. ``GET /v1/pools`` asks each peer's HTTP side for its own summaries (``GET
/v1/pools`` with ``kvcm-cluster-local: 1``: the gRPC ``ListPools`` does not carry what the
HTTP summaries show) through the same parallel, deadline-bound ask, and merges them as
``ListPools`` merges (:func:`~kvcm.server.cluster._fanout.merge_listings`). ``GET
/v1/transfers`` of every pool is the gRPC ``ListTransfers`` fan-out
(:func:`~kvcm.server.cluster._fanout.cluster_list_transfers`) in protobuf's JSON mapping. A
replica's refusal is answered with the status a single server gives.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import grpc
from google.protobuf import json_format  # type: ignore[import-untyped]

from kvcm.common.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from kvcm.core.lookup import LookupAnswer, LookupQuery
from kvcm.core.pd_route import PdRoute, PdRouteQuery
from kvcm.server.cluster._fanout import (
    LOCAL_KEY,
    CallerContext,
    PeerChannels,
    PeerRefusedError,
    _ask,
    cluster_list_transfers,
    cluster_lookup,
    cluster_route_pd,
    merge_listings,
)
from kvcm.server.cluster._node import ClusterNode
from kvcm.server.http import ClusterCallError
from kvcm.server.rpc import LookupDeniedError
from kvcm.server.transfers import TransferState
from kvcm.v1 import pd_pb2

__all__ = ["ClusterReads"]

# A peer's HTTP refusal of its part: the gRPC code name the whole read fails with.
_CODE_OF_HTTP: Final = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
}


def _translated(exc: PeerRefusedError) -> Exception:
    """A replica's refusal as the error the HTTP routes answer (the single server's)."""
    code, details = exc.code, exc.details
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgumentError(details)
    if code is grpc.StatusCode.NOT_FOUND:
        return NotFoundError(details)
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return LookupDeniedError(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhaustedError(details)
    return ClusterCallError(code.name, details)


class ClusterReads:
    """What the HTTP side asks of the cluster (see the module docstring)."""

    def __init__(
        self, node: ClusterNode, peers: PeerChannels, *, ssl_context: ssl.SSLContext | None
    ) -> None:
        """Read through ``node``'s view; ``ssl_context``: how peers' HTTPS sides are dialed
        (``None``: plain HTTP, as this replica's own)."""
        self._node = node
        self._peers = peers
        self._ssl = ssl_context
        self._http: Any = None  # an httpx.AsyncClient, opened on the first listing

    async def lookup(
        self, query: LookupQuery, authorization: str | None
    ) -> tuple[LookupAnswer, int]:
        """The cluster's Lookup (``missing_replicas`` set) and the replicas asked."""
        try:
            return await cluster_lookup(
                self._node, self._peers, query, CallerContext(authorization)
            )
        except PeerRefusedError as exc:
            raise _translated(exc) from exc

    async def route_pd(self, query: PdRouteQuery, authorization: str | None) -> tuple[PdRoute, int]:
        """The cluster's P/D route (``missing_replicas`` set) and the replicas asked."""
        try:
            return await cluster_route_pd(
                self._node, self._peers, query, CallerContext(authorization)
            )
        except PeerRefusedError as exc:
            raise _translated(exc) from exc

    async def transfers(
        self, states: Sequence[str], authorization: str | None
    ) -> tuple[dict[str, Any], tuple[str, ...], int]:
        """Every replica's transfer records as one ``ListTransfersResponse`` JSON, the
        replicas missed, the replicas asked (the gRPC ``ListTransfers`` fan-out's merge).

        Raises:
            InvalidArgumentError: A state name is unknown (naming ``state``).
            ClusterCallError: A replica refused its part (its status).
        """
        request = pd_pb2.ListTransfersRequest()
        for name in states:
            if name.upper() not in TransferState.__members__:
                known = ", ".join(TransferState.__members__)
                raise InvalidArgumentError(f"state: {name!r} is not one of {known}")
            request.states.append(pd_pb2.TransferState.Value(f"TRANSFER_STATE_{name.upper()}"))
        try:
            merged, missed, asked = await cluster_list_transfers(
                self._node, self._peers, request, CallerContext(authorization)
            )
        except PeerRefusedError as exc:
            raise ClusterCallError(exc.code.name, exc.details) from exc
        listing: dict[str, Any] = json_format.MessageToDict(
            merged,
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
            unquote_int64_if_possible=True,
        )
        return listing, tuple(missed), asked

    def owner(self, pool_id: str) -> tuple[str, str, int] | None:
        """The pool's primary when another replica is it: ``(address, HTTP address, epoch)``."""
        node = self._node
        placement = node.get(pool_id)
        if placement is None or placement.primary == node.address:
            return None
        registered = node.replicas.get(placement.primary) or {}
        return placement.primary, str(registered.get("http_address") or ""), placement.epoch

    async def pools(
        self, local: Sequence[Mapping[str, Any]], authorization: str | None
    ) -> tuple[list[Mapping[str, Any]], tuple[str, ...], int]:
        """Every replica's ``/v1/pools`` summaries merged with ``local`` (this replica's):
        the pools, the replicas missed, the replicas asked.

        Raises:
            ClusterCallError: A peer refused its part (its status).
        """
        node = self._node
        headers = {LOCAL_KEY: "1"}
        if authorization:
            headers["authorization"] = authorization
        scheme = "http" if self._ssl is None else "https"
        parts: list[tuple[str, Callable[[float, Any], Awaitable[Any]]]] = []
        for address in node.peers():
            http_address = str((node.replicas.get(address) or {}).get("http_address") or "")
            parts.append((address, self._part(f"{scheme}://{http_address}", headers)))
        try:
            answers, missed = await _ask(node, CallerContext(authorization), "ListPools", parts)
        except PeerRefusedError as exc:
            raise ClusterCallError(exc.code.name, exc.details) from exc
        listings: list[tuple[str, Iterable[Mapping[str, Any]]]] = [(node.address, local)]
        listings.extend((address, answer) for address, answer in answers)
        merged = merge_listings(node, listings, lambda pool: str(pool["name"]))
        return merged, tuple(missed), len(parts) + 1

    def _part(
        self, base: str, headers: Mapping[str, str]
    ) -> Callable[[float, Any], Awaitable[Any]]:
        async def call(timeout: float, metadata: Any) -> list[Mapping[str, Any]]:
            if base.endswith("://"):
                raise ConnectionError("the replica registered no HTTP address")
            response = await self._client().get(
                f"{base}/v1/pools", headers=dict(headers), timeout=timeout
            )
            code = _CODE_OF_HTTP.get(response.status_code)
            if code is not None:
                message = response.json().get("error", {}).get("message", response.text)
                raise PeerRefusedError(code, str(message))
            response.raise_for_status()  # anything else: the replica is missed
            pools: list[Mapping[str, Any]] = response.json()["pools"]
            return pools

        return call

    def _client(self) -> Any:
        if self._http is None:
            import httpx

            self._http = httpx.AsyncClient(verify=self._ssl if self._ssl is not None else True)
        return self._http

    async def close(self) -> None:
        """Close the HTTP client (if one was opened)."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None
