"""``GET /v1/transfers`` and ``GET /v1/transfers/{pool}/{transfer_id}``: the P/D transfer
records over HTTP (``ListTransfers`` and ``DescribeTransfer``'s JSON twins).

Answers are ``kvcm.v1.ListTransfersResponse`` / ``kvcm.v1.Transfer`` in protobuf's JSON mapping
(snake_case names, every field present, states by name). Errors are ``{"error": {"code",
"message"}}``: 400 (an unknown ``state``), 403 (``pool`` names a pool the token may not read),
404 (no such pool or transfer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse

from kvcm.common.errors import InvalidArgumentError, NotFoundError
from kvcm.server.http._cluster import (
    ClusterCallError,
    ClusterReadsLike,
    fanned_headers,
    is_local_request,
)

if TYPE_CHECKING:
    from kvcm.server.rpc import Principal

__all__ = ["TransfersLike", "add_transfer_routes"]


class TransfersLike(Protocol):
    """What the routes read (``kvcm.server.rpc.TransferView``)."""

    def listing(
        self, pool_id: str, states: list[str], principal: Principal | None
    ) -> dict[str, Any]: ...

    def describe(self, pool_id: str, transfer_id: str) -> dict[str, Any]: ...

    def samples(self) -> dict[str, list[tuple[list[str], float]]]: ...


def _error(code: str, message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def add_transfer_routes(
    app: FastAPI,
    transfers: TransfersLike,
    error_model: Any,
    cluster: ClusterReadsLike | None = None,
) -> None:
    """Add both routes to ``app``; with ``cluster``, the listing of every pool asks every
    replica and merges as the gRPC ``ListTransfers`` does (``missing_replicas``,
    ``replicas``)."""

    @app.get(
        "/v1/transfers",
        tags=["transfers"],
        responses={
            400: {"model": error_model, "description": "an unknown state"},
            401: {"model": error_model, "description": "authentication is on: no valid token"},
            403: {"model": error_model, "description": "pool names an unreadable pool"},
            404: {"model": error_model, "description": "pool names no pool"},
        },
    )
    async def list_transfers(
        request: Request,
        pool: str = "",
        state: list[str] = Query(default=[]),  # noqa: B008 - FastAPI's declaration
    ) -> Response:
        """P/D transfers in flight (oldest first), then recently ended ones (latest first),
        of ``pool`` or of every pool the token may read; ``state`` (repeated): only these
        (``HELD``, ``PLANNED``, ``COMPLETED``, ``RELEASED``, ``EXPIRED``)."""
        principal = getattr(request.state, "principal", None)
        if cluster is not None and not pool and not is_local_request(request.headers):
            try:
                listed, missing, asked = await cluster.transfers(
                    state, request.headers.get("authorization")
                )
            except InvalidArgumentError as exc:
                return _error("INVALID_ARGUMENT", str(exc), 400)
            except ClusterCallError as exc:  # a replica's refusal, with its status
                return _error(exc.code, str(exc), exc.status)
            body = {**listed, "missing_replicas": list(missing), "replicas": asked}
            return JSONResponse(body, headers=fanned_headers(asked, missing))
        try:
            return JSONResponse(transfers.listing(pool, state, principal))
        except InvalidArgumentError as exc:
            return _error("INVALID_ARGUMENT", str(exc), 400)
        except NotFoundError as exc:
            return _error("NOT_FOUND", str(exc.args[0] if exc.args else exc), 404)
        except PermissionError as exc:
            return _error("PERMISSION_DENIED", str(exc), 403)

    @app.get(
        "/v1/transfers/{pool}/{transfer_id}",
        tags=["transfers"],
        responses={
            401: {"model": error_model, "description": "authentication is on: no valid token"},
            403: {"model": error_model, "description": "the token may not read this pool"},
            404: {"model": error_model, "description": "no such transfer"},
        },
    )
    async def describe_transfer(pool: str, transfer_id: str) -> Response:
        """One P/D transfer record of source pool ``pool``."""
        try:
            return JSONResponse(transfers.describe(pool, transfer_id))
        except NotFoundError as exc:
            return _error("NOT_FOUND", str(exc.args[0] if exc.args else exc), 404)
