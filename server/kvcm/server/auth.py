"""Bearer tokens with roles per pool, and the gRPC side of their checks.

``--auth-tokens FILE`` turns authentication on: every kvcm.v1 call must carry
``authorization: Bearer <token>`` metadata (every HTTP route but the probes the same
``Authorization`` header) naming a token of the file, whose roles allow the call on its pool.
The file (TOML) stores only SHA-256 digests of the tokens::

    [[tokens]]
    name = "engine-0-scheduler"                 # the principal, in the audit log
    sha256 = "9f86d081884c7d659a2feaa0c55ad015..."  # hex digest of the token
    roles = ["scheduler:engine-0", "reader:*"]  # role:pool-id glob (fnmatch)

Who may call what is one table for gRPC and HTTP, :data:`kvcm.server.access.RULES` (the roles
are described there). A call without a token, or with one not in the file, is
UNAUTHENTICATED; a token whose roles do not cover the call on that pool is PERMISSION_DENIED;
neither changes anything, and both are audited (rate-limited) on the ``kvcm.audit`` logger. A
pool's NONE_HASH seed (DescribePool's ``hashing.seed``) is shown only to principals that drive
the pool (scheduler or admin): others see it empty. Every CreatePool, DeletePool and
ResyncPool is logged at INFO on ``kvcm.audit`` with the principal, the pool and the outcome.
SIGHUP re-reads the file.
"""

from __future__ import annotations

import hashlib
import hmac
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import grpc

from kvcm.common.errors import ConfigError
from kvcm.server.access import (
    AUDIT_LOG,
    ROLES,
    RULES,
    SERVER_WIDE_ROLES,
    PoolFrom,
    RefusalLog,
    Rule,
    bearer_token,
    refusal,
)
from kvcm.server.rpc import PRINCIPAL, AbortRpc, MethodInterceptor, Principal, UndecodableRequest

__all__ = ["AuthInterceptor", "TokenTable"]

_AUDITED: Final = frozenset(
    {
        "/kvcm.v1.AdminService/CreatePool",
        "/kvcm.v1.AdminService/DeletePool",
        "/kvcm.v1.SchedulerService/ResyncPool",
    }
)
_NO_RULE: Final = Rule(roles=("admin",), pool=PoolFrom.SERVER)
"""A method without a row in the table: refused to all but ``admin:*`` (and a test fails)."""


class TokenTable:
    """The tokens file, by SHA-256 digest, and the audit of refusals made against it.

    Attributes:
        path: The file.
        refusals: The rate-limited audit of refused calls (shared by gRPC and HTTP).
    """

    def __init__(self, path: str) -> None:
        """Load ``path``.

        Raises:
            ConfigError: Unreadable, not TOML, or an entry out of its domain (named).
        """
        self.path = path
        self._by_digest = self._load(path)
        self.refusals = RefusalLog()

    @staticmethod
    def _load(path: str) -> dict[str, Principal]:
        where = f"auth_tokens {path!r}"
        try:
            document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{where}: {exc.strerror or exc}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        entries = document.get("tokens", [])
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{where}: needs at least one [[tokens]] entry")
        table: dict[str, Principal] = {}
        for index, entry in enumerate(entries):
            at = f"{where} tokens[{index}]"
            if not isinstance(entry, dict):
                raise ConfigError(f"{at}: must be a table")
            digest = str(entry.get("sha256", "")).lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ConfigError(f"{at}: sha256 must be 64 hex digits")
            roles = []
            for granted in entry.get("roles", []):
                role, _, glob = str(granted).partition(":")
                if role not in ROLES or not glob:
                    raise ConfigError(f"{at}: role {granted!r} is not one of {ROLES} ':' glob")
                if role in SERVER_WIDE_ROLES and glob != "*":
                    raise ConfigError(f"{at}: role {granted!r} spans every pool: write '{role}:*'")
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
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        for known, principal in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return principal
        return None


class AuthInterceptor(MethodInterceptor):
    """Authenticates and authorizes every kvcm.v1 call by :data:`~kvcm.server.access.RULES`;
    audits refusals and admin actions."""

    def __init__(
        self, tokens: TokenTable, *, pool_exists: Callable[[str], bool] | None = None
    ) -> None:
        """Check calls against ``tokens``.

        Args:
            tokens: The tokens file.
            pool_exists: Whether a pool exists, so that a call that would create its pool
                (ResyncPool) is refused before its upload is read (``None``: only when the
                servicer is about to create it).
        """
        super().__init__()
        self.tokens = tokens
        self.pool_exists = pool_exists

    def _check(self, full_name: str, rule: Rule, context: Any, pool_id: str) -> Principal:
        """The caller's principal, once allowed.

        A call that may create its pool (ResyncPool) is checked here against the pool as it
        is now; the servicer asks again at the moment it would create the pool (no await
        between that check and the creation), since the pool may be deleted meanwhile.

        Raises:
            AbortRpc: UNAUTHENTICATED or PERMISSION_DENIED (audited).
        """
        principal = self._authenticate(full_name, context, pool_id)
        exists = True
        if rule.create_roles and self.pool_exists is not None:
            exists = self.pool_exists(pool_id)
        why = refusal(principal, rule, pool_id, exists=exists)
        if why is not None:
            self._refused(
                context,
                principal=principal.name,
                method=full_name,
                pool=pool_id,
                code="PERMISSION_DENIED",
                reason=why,
            )
            raise AbortRpc(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{full_name.rsplit('/', 1)[-1]}: principal {principal.name!r} {why}",
            )
        PRINCIPAL.set(principal)
        return principal

    def _authenticate(self, full_name: str, context: Any, pool_id: str) -> Principal:
        """The principal of the call's bearer token (who it is, not yet what it may do).

        Reads only the call's metadata, so it also runs for a request whose bytes did not
        decode: without a valid token such a call is UNAUTHENTICATED, never INVALID_ARGUMENT.

        Raises:
            AbortRpc: UNAUTHENTICATED (audited).
        """
        token = ""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                token = bearer_token(value)
        principal = self.tokens.principal(token) if token else None
        if principal is None:
            reason = "no token" if not token else "a token not in the tokens file"
            self._refused(
                context,
                principal="",
                method=full_name,
                pool=pool_id,
                code="UNAUTHENTICATED",
                reason=reason,
            )
            method = full_name.rsplit("/", 1)[-1]
            raise AbortRpc(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: a valid 'authorization: Bearer <token>' is required",
            )
        return principal

    def _refused(self, context: Any, **fields: str) -> None:
        """Audit a refusal (``principal``, ``method``, ``pool``, ``code``, ``reason``)."""
        self.tokens.refusals.refused(peer=str(context.peer() or ""), **fields)

    def _wrap_full(self, full_name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        rule = RULES.get(full_name, _NO_RULE)
        method = full_name.rsplit("/", 1)[-1]
        check = self._check
        refused = self._refused
        audited = full_name in _AUDITED

        authenticate = self._authenticate

        def pool_of(request: Any) -> str:
            if rule.pool is not PoolFrom.REQUEST:
                return ""
            return str(getattr(request, "pool_id", ""))

        def admit(request: Any, context: Any) -> tuple[Principal, str]:
            """Check the call; a request that did not decode is only authenticated (it has
            no pool to authorize against) and then ends INVALID_ARGUMENT in its handler."""
            pool_id = pool_of(request)
            if type(request) is UndecodableRequest:
                return authenticate(full_name, context, pool_id), pool_id
            return check(full_name, rule, context, pool_id), pool_id

        async def guarded(principal: Principal, pool_id: str, context: Any, call: Any) -> Any:
            outcome = "OK"
            try:
                return await call
            except AbortRpc as exc:  # a refusal decided by the servicer (scope, creation)
                outcome = type(exc).__name__
                if exc.code == grpc.StatusCode.PERMISSION_DENIED:
                    refused(
                        context,
                        principal=principal.name,
                        method=full_name,
                        pool=pool_id,
                        code=exc.code.name,
                        reason=exc.details,
                    )
                raise
            except BaseException as exc:
                outcome = type(exc).__name__
                raise
            finally:
                if audited:
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
                principal, pool_id = admit(request, context)
                return await guarded(principal, pool_id, context, inner(request, context))

            return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
        if handler.unary_stream is not None:
            producer = handler.unary_stream

            async def stream(request: Any, context: Any) -> Any:
                admit(request, context)
                async for item in producer(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
        if handler.stream_unary is not None:
            consumer = handler.stream_unary

            async def stream_unary(requests: Any, context: Any) -> Any:
                first = await anext(aiter(requests), None)
                principal, pool_id = admit(first, context)

                async def again() -> Any:
                    if first is not None:
                        yield first
                    async for item in requests:
                        yield item

                return await guarded(principal, pool_id, context, consumer(again(), context))

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
        if handler.stream_stream is not None:  # ReplicaService.ShipRecords
            bidi = handler.stream_stream

            async def stream_stream(requests: Any, context: Any) -> Any:
                first = await anext(aiter(requests), None)
                admit(first, context)

                async def again() -> Any:
                    if first is not None:
                        yield first
                    async for item in requests:
                        yield item

                async for item in bidi(again(), context):
                    yield item

            return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)
        return handler
