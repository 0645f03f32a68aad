"""Bearer tokens with roles per pool, and the audit log of admin actions.

``--auth-tokens FILE`` turns authentication on: every kvcm.v1 call must carry
``authorization: Bearer <token>`` metadata naming a token of the file, whose roles allow the
call on its pool. The file (TOML) stores only SHA-256 digests of the tokens::

    [[tokens]]
    name = "engine-0-scheduler"                 # the principal, in the audit log
    sha256 = "9f86d081884c7d659a2feaa0c55ad015..."  # hex digest of the token
    roles = ["scheduler:engine-0", "reader:*"]  # role:pool-id glob (fnmatch)

Roles, each on the pools its glob matches:

* ``admin``: CreatePool, DeletePool, and everything the other roles may;
* ``scheduler``: every SchedulerService call (Step, the manager calls, KeepAlive,
  ResyncPool) and what ``reader`` may;
* ``worker``: RegisterWorker, DescribePool;
* ``reader``: DescribePool, SubscribeEvents.

ListPools needs any valid token; so does Lookup, whose answer covers only the pools the token
may read (reader, worker, scheduler or admin), and which is PERMISSION_DENIED when its scope
names another. A call without a token, or with one not in the file, is
UNAUTHENTICATED; a token whose roles do not cover the call on that pool is PERMISSION_DENIED;
neither changes anything. A pool's NONE_HASH seed (DescribePool's ``hashing.seed``) is shown
only to principals that drive the pool (scheduler or admin): others see it empty. Every
CreatePool, DeletePool and ResyncPool is logged at INFO on the ``kvcm.audit`` logger with
the principal, the pool and the outcome. SIGHUP re-reads the file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
import tomllib
from pathlib import Path
from typing import Any, Final

import grpc

from kvcm.common.errors import ConfigError
from kvcm.server.rpc import PRINCIPAL, AbortRpc, MethodInterceptor, Principal

__all__ = ["AuthInterceptor", "TokenTable"]

AUDIT_LOG = logging.getLogger("kvcm.audit")
ROLES: Final = ("admin", "scheduler", "worker", "reader")
_ADMIN_METHODS: Final = frozenset({"CreatePool", "DeletePool"})
_READER_METHODS: Final = frozenset({"DescribePool", "SubscribeEvents"})
_AUDITED: Final = frozenset({"CreatePool", "DeletePool", "ResyncPool"})


class TokenTable:
    """The tokens file, by SHA-256 digest."""

    def __init__(self, path: str) -> None:
        """Load ``path``.

        Raises:
            ConfigError: Unreadable, not TOML, or an entry out of its domain (named).
        """
        self.path = path
        self._by_digest = self._load(path)

    @staticmethod
    def _load(path: str) -> dict[str, Principal]:
        where = f"auth_tokens {path!r}"
        try:
            document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{where}: {exc.strerror or exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        entries = document.get("tokens", [])
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{where}: needs at least one [[tokens]] entry")
        table: dict[str, Principal] = {}
        for index, entry in enumerate(entries):
            at = f"{where} tokens[{index}]"
            digest = str(entry.get("sha256", "")).lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ConfigError(f"{at}: sha256 must be 64 hex digits")
            roles = []
            for granted in entry.get("roles", []):
                role, _, glob = str(granted).partition(":")
                if role not in ROLES or not glob:
                    raise ConfigError(f"{at}: role {granted!r} is not one of {ROLES} ':' glob")
                roles.append((role, glob))
            table[digest] = Principal(str(entry.get("name") or f"tokens[{index}]"), tuple(roles))
        return table

    def reload(self) -> None:
        """Re-read the file (SIGHUP); a broken file keeps the old table.

        Raises:
            ConfigError: The file is broken (the old table stays).
        """
        self._by_digest = self._load(self.path)

    def principal(self, token: str) -> Principal | None:
        """The principal of a presented token, or ``None``."""
        digest = hashlib.sha256(token.encode()).hexdigest()
        for known, principal in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return principal
        return None


def _allowed(principal: Principal, method: str, pool_id: str) -> bool:
    if method in ("ListPools", "Lookup"):
        return True  # Lookup narrows its scope to the pools the principal may read
    if method in _ADMIN_METHODS:
        return principal.has("admin", pool_id)
    if method == "RegisterWorker":
        return principal.has("worker", pool_id)
    if method in _READER_METHODS:
        return any(principal.has(role, pool_id) for role in ("reader", "worker", "scheduler"))
    return principal.has("scheduler", pool_id)  # SchedulerService


class AuthInterceptor(MethodInterceptor):
    """Authenticates and authorizes every kvcm.v1 call; audits admin actions."""

    def __init__(self, tokens: TokenTable) -> None:
        """Check calls against ``tokens``."""
        super().__init__()
        self.tokens = tokens

    def _check(self, method: str, context: Any, pool_id: str) -> Principal:
        token = ""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                token = token.strip() if scheme.lower() == "bearer" else ""
        principal = self.tokens.principal(token) if token else None
        if principal is None:
            raise AbortRpc(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: a valid 'authorization: Bearer <token>' is required",
            )
        if not _allowed(principal, method, pool_id):
            raise AbortRpc(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: principal {principal.name!r} has no role for pool {pool_id!r}",
            )
        PRINCIPAL.set(principal)
        return principal

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        check = self._check
        audited = method in _AUDITED

        async def audit(principal: Principal, pool_id: str, call: Any) -> Any:
            if not audited:
                return await call
            outcome = "OK"
            try:
                return await call
            except BaseException as exc:
                outcome = type(exc).__name__
                raise
            finally:
                AUDIT_LOG.info(
                    "admin action",
                    extra={
                        "event": "audit",
                        "principal": principal.name,
                        "method": method,
                        "pool": pool_id,
                        "outcome": outcome,
                        "time": time.time(),
                    },
                )

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: Any) -> Any:
                pool_id = str(getattr(request, "pool_id", ""))
                principal = check(method, context, pool_id)
                return await audit(principal, pool_id, inner(request, context))

            return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
        if handler.unary_stream is not None:
            producer = handler.unary_stream

            async def stream(request: Any, context: Any) -> Any:
                check(method, context, str(getattr(request, "pool_id", "")))
                async for item in producer(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
        if handler.stream_unary is not None:
            consumer = handler.stream_unary

            async def stream_unary(requests: Any, context: Any) -> Any:
                first = await anext(aiter(requests))
                pool_id = str(getattr(first, "pool_id", ""))
                principal = check(method, context, pool_id)

                async def again() -> Any:
                    yield first
                    async for item in requests:
                        yield item

                return await audit(principal, pool_id, consumer(again(), context))

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
        return handler
