"""LookupService: where a prompt is cached across pools (a codec over the registry's lookup).

A lookup runs on the event loop between calls, like every read: the walk over the prompt's
blocks costs O(blocks hit) whatever the number of pools (:mod:`kvcm.core.lookup`). With
authentication on, the scope is narrowed to the pools the caller may read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeAlias

import grpc

from kvcm.core.lookup import LookupAnswer, LookupQuery
from kvcm.core.pool import PoolRegistry
from kvcm.server.rpc._state import PRINCIPAL, Principal, ServerState
from kvcm.server.rpc._status import AbortRpc
from kvcm.v1 import lookup_pb2, service_pb2_grpc
from kvcm.wire.lookup import lookup_query_from_proto, lookup_result_to_proto

__all__ = ["LookupServicer", "LookupDeniedError", "lookup_as"]

Context: TypeAlias = Any
_READ_ROLES = ("reader", "worker", "scheduler")


class LookupDeniedError(Exception):
    """The caller named a pool in scope it may not read."""


def _readable(principal: Principal, pool_id: str) -> bool:
    return any(principal.has(role, pool_id) for role in _READ_ROLES)


def lookup_as(
    registry: PoolRegistry, query: LookupQuery, principal: Principal | None
) -> LookupAnswer:
    """``registry.lookup(query)`` as ``principal`` sees it (``None``: authentication off).

    Raises:
        LookupDeniedError: ``query.pool_ids`` names a pool the principal may not read.
        NotFoundError, InvalidArgumentError: As :meth:`PoolRegistry.lookup`.
    """
    if principal is None:
        return registry.lookup(query)
    for index, pool_id in enumerate(query.pool_ids):
        if not _readable(principal, pool_id):
            raise LookupDeniedError(
                f"scope.pool_ids[{index}]: principal {principal.name!r} may not read pool "
                f"{pool_id!r}"
            )
    if query.pool_ids:
        return registry.lookup(query)
    readable = tuple(pool.name for pool in registry.list() if _readable(principal, pool.name))
    if not readable:
        return LookupAnswer((), (), 0)
    return registry.lookup(dataclasses.replace(query, pool_ids=readable))


class LookupServicer(service_pb2_grpc.LookupServiceServicer):
    """Lookup."""

    def __init__(self, state: ServerState) -> None:
        """Serve ``state``'s registry."""
        self._state = state

    async def Lookup(  # noqa: N802 - gRPC method name
        self, request: lookup_pb2.LookupRequest, context: Context
    ) -> lookup_pb2.LookupResponse:
        """Each pool's hit for the prompt, its load and the ranking."""
        query = lookup_query_from_proto(request)
        try:
            result = lookup_as(self._state.registry, query, PRINCIPAL.get())
        except LookupDeniedError as exc:
            raise AbortRpc(grpc.StatusCode.PERMISSION_DENIED, f"Lookup: {exc}") from None
        return lookup_result_to_proto(result)
