"""``POST /v1/pd/route``: the P/D routing call over HTTP (``RoutePd``'s JSON twin).

The body is a ``kvcm.v1.RoutePdRequest`` in protobuf's JSON mapping; the answer a
``RoutePdResponse`` (snake_case names, every field present). Errors are
``{"error": {"code", "message"}}`` with the statuses of ``POST /v1/lookup``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response

from kvcm.core.pd_route import PdRoute, PdRouteQuery
from kvcm.server.access import RefusalLog
from kvcm.server.http._cluster import ClusterReadsLike, fanned_headers, is_local_request
from kvcm.server.http._queries import answer_json_query

if TYPE_CHECKING:
    from kvcm.server.rpc import Principal

__all__ = ["add_pd_route"]


def add_pd_route(
    app: FastAPI,
    route_pd: Callable[[PdRouteQuery, Principal | None], Awaitable[PdRoute]],
    refusals: RefusalLog,
    *,
    max_body_bytes: int,
    error_model: Any,
    cluster: ClusterReadsLike | None = None,
) -> None:
    """Add ``POST /v1/pd/route`` to ``app``.

    Args:
        app: The server's FastAPI app.
        route_pd: Routes a query as a principal (``None``: authentication off).
        refusals: Where 403s are audited.
        max_body_bytes: Bodies over this are answered 413.
        error_model: The app's error body model (for the OpenAPI schema).
        cluster: This replica's cluster: the route fans out to every replica and merges as
            the gRPC ``RoutePd`` does, adding ``missing_replicas`` and ``replicas``
            (``None``: one server).
    """
    from kvcm.wire.pd import pd_route_query_from_json, pd_route_to_json

    @app.post(
        "/v1/pd/route",
        tags=["routing"],
        responses={
            400: {"model": error_model, "description": "a field is out of its domain"},
            401: {"model": error_model, "description": "authentication is on: no valid token"},
            403: {
                "model": error_model,
                "description": "a scope names an unreadable pool",
            },
            404: {"model": error_model, "description": "a scope names an unknown pool"},
            413: {"model": error_model, "description": "the body is too large"},
            429: {
                "model": error_model,
                "description": "hashing the prompt for the scopes is too much",
            },
        },
    )
    async def pd_route(request: Request) -> Response:
        """The prefill and the decode engine for a prompt, ranked by exact prefix hit and
        load, with the decode engine's own hit and vLLM's ``remote_num_tokens`` (see
        docs/pd.md)."""
        if cluster is not None and not is_local_request(request.headers):
            authorization = request.headers.get("authorization")

            async def fanned(
                query: PdRouteQuery, principal: Principal | None
            ) -> tuple[PdRoute, int]:
                return await cluster.route_pd(query, authorization)

            return await answer_json_query(
                request,
                method="POST /v1/pd/route",
                max_body_bytes=max_body_bytes,
                decode=pd_route_query_from_json,
                answer=fanned,
                encode=lambda found: {
                    **pd_route_to_json(found[0]),
                    "missing_replicas": list(found[0].missing_replicas),
                    "replicas": found[1],
                },
                refusals=refusals,
                headers=lambda found: fanned_headers(found[1], found[0].missing_replicas),
            )
        return await answer_json_query(
            request,
            method="POST /v1/pd/route",
            max_body_bytes=max_body_bytes,
            decode=pd_route_query_from_json,
            answer=route_pd,
            encode=pd_route_to_json,
            refusals=refusals,
        )
