"""The pool inspector page (``GET /``), the API docs (``GET /docs``) and a pool's recent events.

The page and the docs are static HTML that hold no data: a browser cannot send a bearer token
when it navigates, so both are open (``kvcm.server.access.RULES``), ask for the token in the
page, keep it in the tab's ``sessionStorage`` and send it as ``Authorization: Bearer`` on
every call to the JSON routes, which check it as they check any client's (docs/security.md).

``GET /v1/pools/{pool}/events`` answers the last events the pool keeps for resuming
subscribers (the same ones SubscribeEvents would replay), newest last, as JSON.
"""

from __future__ import annotations

import dataclasses
import enum
from importlib import resources
from typing import Any, Final, Protocol

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response

from kvcm.common.errors import NotFoundError
from kvcm.server.http._views import PoolRegistryLike

__all__ = ["MAX_RECENT_EVENTS", "add_inspector_routes"]

MAX_RECENT_EVENTS: Final = 200
_SWAGGER_JS: Final = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"
_SWAGGER_CSS: Final = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"
_DOCS_HTML: Final = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvcm HTTP API</title>
<link rel="stylesheet" href="%(css)s"></head>
<body><div id="swagger-ui"></div>
<script src="%(js)s"></script>
<script>
// The page is open; /openapi.json and the routes need the token the inspector page keeps.
const token = sessionStorage.getItem("kvcm-token") || "";
SwaggerUIBundle({
  url: "/openapi.json", dom_id: "#swagger-ui",
  requestInterceptor: (req) => {
    if (token) { req.headers["Authorization"] = "Bearer " + token; }
    return req;
  },
});
</script></body></html>
"""


class _EventSource(Protocol):
    """What the events route reads of a pool (the core's ``Pool``)."""

    name: str
    lent: bool
    epoch: int

    @property
    def last_event_sequence(self) -> int: ...
    @property
    def oldest_event_sequence(self) -> int: ...
    def events_from(self, sequence: int, max_events: int) -> tuple[list[Any], float] | None:
        """Up to ``max_events`` events from ``sequence`` on."""
        ...


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bytes):
        return value.hex()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return value


def _page() -> str:
    return resources.files("kvcm.server.http").joinpath("inspector.html").read_text("utf-8")


def add_inspector_routes(app: FastAPI, registry: PoolRegistryLike) -> None:
    """Add ``GET /``, ``GET /docs`` and ``GET /v1/pools/{pool}/events`` to ``app``."""
    page = _page()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def inspector() -> HTMLResponse:
        """The pool inspector: static HTML that calls the JSON routes with the user's token."""
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> HTMLResponse:
        """Swagger UI over ``/openapi.json`` (with the token the inspector page keeps)."""
        return HTMLResponse(_DOCS_HTML % {"css": _SWAGGER_CSS, "js": _SWAGGER_JS})

    @app.get(
        "/v1/pools/{pool}/events",
        tags=["pools"],
        responses={
            401: {"description": "authentication is on: no valid token"},
            403: {"description": "the token may not read this pool"},
            404: {"description": "no pool has this name"},
        },
    )
    async def recent_events(
        pool: str, limit: int = Query(default=20, ge=1, le=MAX_RECENT_EVENTS)
    ) -> Response:
        """The pool's last ``limit`` kept KV events, oldest first, each with its sequence."""
        try:
            found: Any = registry.get(pool)
        except NotFoundError as exc:
            return JSONResponse({"error": {"code": "NOT_FOUND", "message": str(exc)}}, 404)
        source: _EventSource = found
        if source.lent:
            busy = {"code": "UNAVAILABLE", "message": f"pool {pool!r} is busy; retry"}
            return JSONResponse({"error": busy}, 503)
        last = source.last_event_sequence
        start = max(source.oldest_event_sequence, last - limit + 1, 1)
        read = source.events_from(start, limit) if last >= start else None
        events, timestamp = read if read is not None else ([], 0.0)
        return JSONResponse(
            {
                "pool": source.name,
                "epoch": source.epoch,
                "last_sequence": last,
                "timestamp_unix_seconds": timestamp,
                "events": [
                    {"sequence": start + i, "type": type(event).__name__, **_jsonable(event)}
                    for i, event in enumerate(events)
                ],
            }
        )
