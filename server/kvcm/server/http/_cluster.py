"""The HTTP side in a kvcm cluster: cluster-wide reads fan out, per-pool reads are redirected.

With ``kvcm serve --etcd-endpoints`` (docs/cluster.md) the HTTP side answers as the gRPC side
does:

* **cluster-wide reads** (``POST /v1/lookup``, ``POST /v1/pd/route``, ``GET /v1/pools``,
  ``GET /v1/transfers`` without ``pool``) ask every live replica in parallel with the
  cluster's deadline and merge, by the gRPC fan-out's own code
  (:mod:`kvcm.server.cluster._fanout`), so an answer equals the gRPC answer through any
  replica. The answer says which replicas it missed: JSON
  ``missing_replicas`` (advertise addresses; ``[]`` when all answered) and ``replicas`` (the
  replicas asked, this one included), and the same in the headers ``kvcm-replicas`` and
  ``kvcm-missing-replicas`` (comma-separated, only when some were missed).
* **per-pool reads** (``GET /v1/pools/{pool}``, ``GET /v1/pools/{pool}/events``, ``GET
  /v1/transfers/{pool}/{transfer_id}``, ``GET /v1/transfers?pool=``) of a pool another
  replica is the primary of are answered ``307 Temporary Redirect`` to the same path on that
  replica's HTTP address (``Location``), with ``kvcm-owner`` (its gRPC advertise address) and
  ``kvcm-epoch`` headers: the gRPC side's redirect, for HTTP clients (``curl -L``, httpx's
  ``follow_redirects``). A primary that registered no HTTP address (or is not live) is
  answered 503, naming it.

A request carrying ``kvcm-cluster-local: 1`` is a replica's part of a fan-out: answered from
this replica's own pools, never redirected nor fanned out again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol
from urllib.parse import parse_qs, quote

from kvcm.common.errors import KVCMError

if TYPE_CHECKING:
    from kvcm.core.lookup import LookupAnswer, LookupQuery
    from kvcm.core.pd_route import PdRoute, PdRouteQuery

__all__ = [
    "LOCAL_HEADER",
    "MISSING_HEADER",
    "REPLICAS_HEADER",
    "ClusterCallError",
    "ClusterReadsLike",
    "ClusterRedirect",
    "fanned_headers",
    "is_local_request",
]

#: A replica's part of a fan-out (the gRPC side's ``kvcm-cluster-local`` metadata).
LOCAL_HEADER: Final = "kvcm-cluster-local"
#: The replicas a fanned-out answer asked, this one included.
REPLICAS_HEADER: Final = "kvcm-replicas"
#: The replicas a fanned-out answer missed (comma-separated advertise addresses).
MISSING_HEADER: Final = "kvcm-missing-replicas"

# gRPC code name -> HTTP status of a replica's refusal (the statuses the routes answer).
_HTTP_STATUS: Final = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 409,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


class ClusterCallError(KVCMError):
    """A replica refused its part of a cluster-wide read (``/v1/lookup`` and ``/v1/pd/route``
    get the refusals a single server answers as core errors, this for the others:
    UNAVAILABLE from a replica being stopped, UNAUTHENTICATED, ...).

    Attributes:
        code: The gRPC status code's name.
        status: The HTTP status it is answered with.
    """

    def __init__(self, code: str, message: str) -> None:
        """A refusal with gRPC code name ``code``."""
        super().__init__(message)
        self.code = code
        self.status = _HTTP_STATUS.get(code, 500)


class ClusterReadsLike(Protocol):
    """What the HTTP side asks of the cluster (``kvcm.server.cluster.ClusterReads``).

    ``authorization`` is the caller's ``Authorization`` header (``None``: none), forwarded
    to every replica so each authorizes the same principal.
    """

    async def lookup(
        self, query: LookupQuery, authorization: str | None
    ) -> tuple[LookupAnswer, int]:
        """The cluster's Lookup answer (its ``missing_replicas`` set) and the replicas asked."""
        ...

    async def route_pd(self, query: PdRouteQuery, authorization: str | None) -> tuple[PdRoute, int]:
        """The cluster's P/D route (its ``missing_replicas`` set) and the replicas asked."""
        ...

    async def pools(
        self, local: Sequence[Mapping[str, Any]], authorization: str | None
    ) -> tuple[list[Mapping[str, Any]], tuple[str, ...], int]:
        """Every replica's ``/v1/pools`` summaries merged with this one's ``local`` ones (by
        pool id, the primary's copy kept): the pools, the replicas missed, the replicas asked."""
        ...

    async def transfers(
        self, states: Sequence[str], authorization: str | None
    ) -> tuple[dict[str, Any], tuple[str, ...], int]:
        """Every replica's transfer records as one ``ListTransfersResponse`` JSON (``states``
        by name: only these), the replicas missed, the replicas asked.

        Raises:
            InvalidArgumentError: A state name is unknown (naming ``state``).
            ClusterCallError: A replica refused its part.
        """
        ...

    def owner(self, pool_id: str) -> tuple[str, str, int] | None:
        """``(gRPC address, HTTP address, epoch)`` of the pool's primary when another replica
        is it (HTTP address ``""``: it has none, or is not live); ``None``: served here."""
        ...


def is_local_request(headers: Mapping[str, str]) -> bool:
    """Whether the request is a replica's part of a fan-out."""
    return headers.get(LOCAL_HEADER) == "1"


def fanned_headers(asked: int, missing: Sequence[str]) -> dict[str, str]:
    """The headers of a fanned-out answer."""
    headers = {REPLICAS_HEADER: str(asked)}
    if missing:
        headers[MISSING_HEADER] = ",".join(missing)
    return headers


Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


def _pool_of(path: str, query_string: bytes) -> str | None:
    """The pool a per-pool read names (``None``: not a per-pool read)."""
    parts = path.strip("/").split("/")
    if len(parts) in (3, 4) and parts[:2] == ["v1", "pools"] and parts[2]:
        if len(parts) == 3 or parts[3] == "events":
            return parts[2]
        return None
    if len(parts) == 4 and parts[:2] == ["v1", "transfers"] and parts[2]:
        return parts[2]
    if parts == ["v1", "transfers"]:
        pool = parse_qs(query_string.decode("latin-1")).get("pool", [""])[0]
        return pool or None
    return None


class ClusterRedirect:
    """ASGI middleware: per-pool GETs of a pool served elsewhere are redirected (module doc).

    Inside the token guard, so a caller without a valid token learns nothing of placement.
    """

    def __init__(self, app: Any, cluster: ClusterReadsLike) -> None:
        """Wrap ``app``."""
        self.app = app
        self.cluster = cluster

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Redirect or pass the request on."""
        if scope["type"] != "http" or scope.get("method") != "GET":
            await self.app(scope, receive, send)
            return
        pool = _pool_of(scope.get("path", ""), scope.get("query_string", b""))
        owner = self.cluster.owner(pool) if pool else None
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if owner is None or is_local_request(headers):
            await self.app(scope, receive, send)
            return
        address, http_address, epoch = owner
        out = [
            (b"content-type", b"application/json"),
            (b"kvcm-owner", address.encode()),
            (b"kvcm-epoch", str(epoch).encode()),
        ]
        if http_address:
            status, code = 307, "FAILED_PRECONDITION"
            message = (
                f"pool {pool!r} is served by replica {address} (placement epoch {epoch}); "
                f"its HTTP side is {http_address}: follow Location"
            )
            location = f"{scope.get('scheme', 'http')}://{http_address}"
            location += quote(scope.get("path", ""))
            if scope.get("query_string"):
                location += "?" + scope["query_string"].decode("latin-1")
            out.append((b"location", location.encode()))
        else:
            status, code = 503, "UNAVAILABLE"
            message = (
                f"pool {pool!r} is served by replica {address} (placement epoch {epoch}), "
                "whose HTTP side is not known here (not live, or without HTTP); retry"
            )
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        out.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": body})
