"""The HTTP side of the tokens: every route checked by the table the gRPC side uses.

:class:`TokenGuard` is plain ASGI middleware in front of the app. It finds the route a request
is for (as the router will), looks the route up in :data:`kvcm.server.access.RULES`, and
answers 401 or 403 itself, with an :class:`ErrorBody`-shaped JSON body and an audit line, before
the route runs or the body is read. An allowed request carries its principal in
``request.state.principal`` (listings use it to narrow their answer).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute, Match

from kvcm.server.access import (
    RULES,
    UNROUTED,
    PoolFrom,
    RefusalLog,
    Rule,
    bearer_token,
    refusal,
)

if TYPE_CHECKING:
    from kvcm.server.rpc import Principal

__all__ = ["TokenGuard", "check_routes", "route_keys"]

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


def route_keys(routes: Sequence[BaseRoute]) -> list[str]:
    """``VERB /path`` of every route, as :data:`RULES` keys them."""
    keys = []
    for route in routes:
        path = getattr(route, "path", None)
        for verb in sorted(getattr(route, "methods", None) or ()):
            keys.append(f"{verb} {path}")
    return keys


def check_routes(routes: Sequence[BaseRoute]) -> None:
    """Every route must have a row in the table.

    Raises:
        RuntimeError: A route without a row (named).
    """
    missing = [key for key in route_keys(routes) if key not in RULES]
    if missing:
        raise RuntimeError(f"HTTP routes without a row in kvcm.server.access.RULES: {missing}")


class TokenGuard:
    """ASGI middleware checking every HTTP request against :data:`RULES` (see the module)."""

    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Any],
        *,
        routes: Sequence[BaseRoute],
        authenticate: Callable[[str], Principal | None],
        refusals: RefusalLog,
    ) -> None:
        """Guard ``app``, whose router holds ``routes``."""
        self.app = app
        self.routes = routes
        self.authenticate = authenticate
        self.refusals = refusals

    def _route(self, scope: Scope) -> tuple[str, Rule, dict[str, Any]]:
        """The request's table key, rule and path parameters."""
        for route in self.routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                key = f"{scope['method']} {getattr(route, 'path', '')}"
                return key, RULES.get(key, UNROUTED), child.get("path_params", {})
        # A path no route serves, or a verb its route does not take (404, 405 to come).
        return f"{scope['method']} {scope.get('path', '')}", UNROUTED, {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer 401/403 or pass the request on with its principal."""
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a WebSocket: kvcm serves none, so none gets through
            await send({"type": "websocket.close", "code": 1008})
            return
        key, rule, params = self._route(scope)
        if rule.pool is PoolFrom.OPEN:
            await self.app(scope, receive, send)
            return
        header = ""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
        token = bearer_token(header)
        principal = self.authenticate(token) if token else None
        pool_id = str(params.get("pool", "")) if rule.pool is PoolFrom.PATH else ""
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else ""
        if principal is None:
            self.refusals.refused(
                principal="",
                peer=peer,
                method=key,
                pool=pool_id,
                code="401",
                reason="no token" if not token else "a token not in the tokens file",
            )
            message = "a valid 'Authorization: Bearer <token>' is required"
            await _answer(send, 401, "UNAUTHENTICATED", message, authenticate=True)
            return
        why = refusal(principal, rule, pool_id)
        if why is not None:
            self.refusals.refused(
                principal=principal.name,
                peer=peer,
                method=key,
                pool=pool_id,
                code="403",
                reason=why,
            )
            message = f"principal {principal.name!r} {why}"
            await _answer(send, 403, "PERMISSION_DENIED", message)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


async def _answer(
    send: Send, status: int, code: str, message: str, *, authenticate: bool = False
) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if authenticate:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
