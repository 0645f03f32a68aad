"""The body of the JSON query routes (``POST /v1/lookup``, ``POST /v1/pd/route``).

Both read a bounded protobuf-JSON body, answer it as the caller's principal and map the same
errors to the same statuses: 413 for a body over the limit (declared or streamed), 400 for a
field out of its domain, 404 for an unknown pool, 403 for a scope naming a pool the principal
may not read (audited), 429 when hashing the prompt is too much.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from kvcm.common.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from kvcm.server.access import RefusalLog

if TYPE_CHECKING:
    from kvcm.server.rpc import Principal

__all__ = ["answer_json_query", "error_response"]

Q = TypeVar("Q")
A = TypeVar("A")


def error_response(status: int, code: str, message: str) -> JSONResponse:
    """``{"error": {"code", "message"}}`` with ``status``."""
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


async def answer_json_query(
    request: Request,
    *,
    method: str,
    max_body_bytes: int,
    decode: Callable[[bytes], Q],
    answer: Callable[[Q, Principal | None], Awaitable[A]],
    encode: Callable[[A], Any],
    refusals: RefusalLog,
    headers: Callable[[A], Mapping[str, str]] | None = None,
) -> Response:
    """Read ``request``'s body, ``decode`` it, ``answer`` it and ``encode`` the answer.

    Args:
        request: The HTTP request.
        method: The route as the audit names it (``"POST /v1/lookup"``).
        max_body_bytes: Bodies over this are answered 413 before they are read whole.
        decode: Body bytes to a query (raises InvalidArgumentError naming the field).
        answer: Answers a query as a principal (``None``: authentication off).
        encode: The answer as JSON-ready values.
        refusals: Where 403s are audited.
        headers: The answer's response headers (``None``: none).
    """
    from kvcm.server.http._cluster import ClusterCallError
    from kvcm.server.rpc import LookupDeniedError

    principal: Principal | None = getattr(request.state, "principal", None)
    too_large = f"the body exceeds {max_body_bytes} bytes"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        return error_response(413, "RESOURCE_EXHAUSTED", too_large)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            return error_response(413, "RESOURCE_EXHAUSTED", too_large)
    try:
        result = await answer(decode(bytes(body)), principal)
    except InvalidArgumentError as exc:
        return error_response(400, "INVALID_ARGUMENT", str(exc))
    except NotFoundError as exc:
        return error_response(404, "NOT_FOUND", str(exc.args[0]) if exc.args else str(exc))
    except LookupDeniedError as exc:
        if principal is not None:
            client = request.client
            refusals.refused(
                principal=principal.name,
                peer=f"{client.host}:{client.port}" if client else "",
                method=method,
                pool="",
                code="403",
                reason=str(exc),
            )
        return error_response(403, "PERMISSION_DENIED", str(exc))
    except ResourceExhaustedError as exc:
        return error_response(429, "RESOURCE_EXHAUSTED", str(exc))
    except ClusterCallError as exc:  # a replica's part refused with another status
        return error_response(exc.status, exc.code, str(exc))
    return JSONResponse(encode(result), headers=headers(result) if headers is not None else None)
