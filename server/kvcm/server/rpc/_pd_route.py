"""LookupService/RoutePd: the prefill and the decode engine for a prompt (a codec over two
exact lookups and :func:`kvcm.core.pd_route.rank_pd`).

Each role's scope is looked up as ``Lookup`` looks it up (:func:`lookup_as`: the caller's
readable pools only, long token prompts hashed off the loop), then both are ranked. Errors name
the role's field (``prefill_scope.pool_ids[1]``), not Lookup's ``scope``. Each answered call
adds to the server's P/D counters (``kvcm_pd_route*``), which ``/metrics`` reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeAlias

import grpc

from kvcm.common.errors import InvalidArgumentError, NotFoundError
from kvcm.common.hashing import BlockHash
from kvcm.core.lookup import Profile, hash_prompt, hashing_work
from kvcm.core.pd_route import PdRoute, PdRouteQuery, by_role, held_prefix, rank_pd
from kvcm.core.pool import PoolRegistry
from kvcm.server.rpc._lookup import (
    OFF_LOOP_HASH_BLOCKS,
    LookupDeniedError,
    LookupServicer,
    lookup_as,
)
from kvcm.server.rpc._state import PRINCIPAL, Principal, ServerState
from kvcm.server.rpc._status import AbortRpc
from kvcm.v1 import pd_pb2
from kvcm.wire.pd import pd_route_query_from_proto, pd_route_to_proto

__all__ = ["PD_ROUTE_COUNTERS", "RoutingServicer", "route_pd", "route_pd_as"]

Context: TypeAlias = Any
_ROLES: Final = ("prefill_scope", "decode_scope")

PD_ROUTE_COUNTERS: Final = (
    "kvcm_pd_routes_total",
    "kvcm_pd_route_prompt_tokens_total",
    "kvcm_pd_route_decode_hit_tokens_total",
    "kvcm_pd_route_prefill_computed_tokens_total",
    "kvcm_pd_route_remote_tokens_total",
)
"""The counters each routing call adds to, in ``ServerState.pd_routes`` (see docs/metrics.md)."""


def _renamed(text: str, role: str) -> str:
    return text.replace("scope.", f"{role}.", 1)


async def route_pd(
    registry: PoolRegistry,
    query: PdRouteQuery,
    principal: Principal | None,
    *,
    state: ServerState | None = None,
) -> PdRoute:
    """Route ``query`` as ``principal`` sees the pools (``None``: authentication off).

    A token prompt is hashed once for both scopes (and the held requests), off the loop when
    long; ``state``: the server's, for :func:`lookup_as`'s off-loop indexing.

    Raises:
        LookupDeniedError: A scope names a pool the principal may not read (named by role).
        NotFoundError: A scope names an unknown pool (``prefill_scope.pool_ids[i]``).
        InvalidArgumentError, ResourceExhaustedError: As :func:`lookup_as`.
    """
    hashed = await _hash_once(registry, query)
    answers = []
    for role in _ROLES:
        try:
            role_query = query.role_query(role)
            answers.append(
                await lookup_as(registry, role_query, principal, state=state, hashed=hashed)
            )
        except (NotFoundError, InvalidArgumentError) as exc:
            raise by_role(exc, role) from None
        except LookupDeniedError as exc:
            raise LookupDeniedError(_renamed(str(exc), role)) from None
    held = None
    if query.bidirectional and query.held and answers[1].pools:
        held = await _held_on_best(registry, query, answers[1].pools[0].pool_id, hashed)
    return rank_pd(query, answers[0], answers[1], held)


async def _hash_once(
    registry: PoolRegistry, query: PdRouteQuery
) -> dict[Profile, list[BlockHash]] | None:
    """A token prompt's hashes for every hashing profile of both scopes, made once (off the
    loop when long); ``None`` for a hash prompt, or when a scope names an unknown pool (the
    lookup then says which, by role)."""
    if query.prompt.token_ids is None:
        return None
    try:
        pools = {
            pool.name: pool for role in _ROLES for pool in registry.scope(query.role_query(role))
        }
    except NotFoundError:
        return None
    if hashing_work(pools.values(), query.prompt) >= OFF_LOOP_HASH_BLOCKS:
        return await asyncio.to_thread(hash_prompt, list(pools.values()), query.prompt)
    return hash_prompt(pools.values(), query.prompt)


async def _held_on_best(
    registry: PoolRegistry,
    query: PdRouteQuery,
    pool_id: str,
    hashed: Mapping[Profile, Sequence[BlockHash]] | None,
) -> tuple[str, int] | None:
    """:func:`held_prefix` on the best decode pool (a long token prompt hashed off the loop)."""
    request_ids = query.held_on(pool_id)
    if not request_ids or pool_id not in registry:
        return None
    pool = registry.get(pool_id)
    if hashed is None and hashing_work([pool], query.prompt) >= OFF_LOOP_HASH_BLOCKS:
        hashed = await asyncio.to_thread(hash_prompt, [pool], query.prompt)
        if pool_id not in registry or registry.get(pool_id) is not pool:
            return None  # replaced meanwhile
    return held_prefix(pool, request_ids, query.prompt, hashed)


def _count(counters: dict[str, int], route: PdRoute) -> None:
    if not route.decode and not route.prefill:
        return
    for name, value in zip(
        PD_ROUTE_COUNTERS,
        (
            1,
            route.num_tokens,
            route.decode_hit_tokens,
            route.prefill_compute_tokens,
            route.remote_num_tokens,
        ),
        strict=True,
    ):
        counters[name] = counters.get(name, 0) + value


async def route_pd_as(
    state: ServerState, query: PdRouteQuery, principal: Principal | None
) -> PdRoute:
    """:func:`route_pd` over ``state``'s pools, counted in ``state.pd_routes`` (gRPC and HTTP
    share it)."""
    route = await route_pd(state.registry, query, principal, state=state)
    _count(state.pd_routes, route)
    return route


class RoutingServicer(LookupServicer):
    """LookupService: Lookup, and RoutePd for P/D proxies."""

    async def RoutePd(  # noqa: N802 - gRPC method name
        self, request: pd_pb2.RoutePdRequest, context: Context
    ) -> pd_pb2.RoutePdResponse:
        """The prefill and the decode engine for the prompt, ranked (see pd.proto)."""
        query = pd_route_query_from_proto(request)
        try:
            route = await route_pd_as(self._state, query, PRINCIPAL.get())
        except LookupDeniedError as exc:
            raise AbortRpc(grpc.StatusCode.PERMISSION_DENIED, f"RoutePd: {exc}") from None
        return pd_route_to_proto(route)
