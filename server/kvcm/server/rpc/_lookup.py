"""LookupService: where a prompt is cached across pools (a codec over the registry's lookup).

A lookup runs on the event loop between calls, like every read: it costs O(blocks hit + pools
answered) whatever the number of pools (:mod:`kvcm.core.lookup`), and a request that asks for
``packed`` is answered in columns (``PackedPoolHits``), several times cheaper to encode than
one ``PoolHit`` message per pool. With authentication on, the scope is narrowed to the pools
the caller may read. A pool's first lookup indexes its cache (O(cache)): for a pool caching
``OFF_LOOP_INDEX_BLOCKS`` blocks or more, in a worker thread holding the pool (as a lane).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeAlias

import grpc

from kvcm.common.hashing import BlockHash
from kvcm.core.lookup import (
    LookupAnswer,
    LookupQuery,
    PendingPool,
    Profile,
    hash_prompt,
    hashing_work,
    lookup,
)
from kvcm.core.pool import Pool, PoolRegistry
from kvcm.server.access import may_read
from kvcm.server.rpc._state import PRINCIPAL, Principal, ServerState
from kvcm.server.rpc._status import AbortRpc
from kvcm.v1 import lookup_pb2, service_pb2_grpc
from kvcm.wire.lookup import lookup_query_from_proto, lookup_result_to_proto

__all__ = [
    "OFF_LOOP_HASH_BLOCKS",
    "OFF_LOOP_INDEX_BLOCKS",
    "LookupDeniedError",
    "LookupServicer",
    "lookup_as",
    "lookup_now",
]

Context: TypeAlias = Any
OFF_LOOP_HASH_BLOCKS: Final = 4096
"""Token prompts needing this many block hashes or more are hashed off the event loop
(about 4 ms of sha256)."""
OFF_LOOP_INDEX_BLOCKS: Final = 4096
"""A pool caching this many blocks or more is indexed for lookups (once, at its first lookup)
in a worker thread holding the pool, not on the event loop (1-2 ms per 1,000 blocks on a
2-core VM)."""


class LookupDeniedError(Exception):
    """The caller named a pool in scope it may not read."""


async def lookup_as(
    registry: PoolRegistry,
    query: LookupQuery,
    principal: Principal | None,
    *,
    state: ServerState | None = None,
    hashed: Mapping[Profile, Sequence[BlockHash]] | None = None,
) -> LookupAnswer:
    """``registry.lookup(query)`` as ``principal`` sees it (``None``: authentication off).

    A token prompt whose hashing is long (``OFF_LOOP_HASH_BLOCKS`` blocks or more over the
    scope's distinct hashing parameters: a long prompt, or many xxhash pools, each with its own
    seed) is hashed in a worker thread, so the event loop keeps serving meanwhile; the walk
    runs on the loop, over the pools that still exist then. With ``state`` (the server's), a
    pool of the scope caching ``OFF_LOOP_INDEX_BLOCKS`` blocks or more that the index does not
    hold yet is indexed in a worker thread holding the pool, so its O(cache) indexing does not
    hold the loop (without it, or for smaller pools, the lookup indexes them itself).
    ``hashed``: the prompt's hashes already made (:func:`~kvcm.core.lookup.hash_prompt`), for
    a caller that looks the same prompt up in several scopes; profiles it lacks are hashed.

    Raises:
        LookupDeniedError: ``query.pool_ids`` names a pool the principal may not read.
        NotFoundError, InvalidArgumentError, ResourceExhaustedError: As
            :meth:`PoolRegistry.lookup`.
    """
    scoped = _readable(registry, query, principal)
    if scoped is None:
        return LookupAnswer((), (), 0)
    query = scoped
    pools = registry.scope(query)
    waited = False
    if state is not None:
        for pool in registry.index.unindexed(pools):  # usually none: O(1) for every pool
            manager = pool.manager
            if manager is None or manager.block_pool.num_cached_blocks < OFF_LOOP_INDEX_BLOCKS:
                continue
            if pool.name in state.lanes or not _registered(registry, pool):
                continue
            pending = registry.index.reserve(pool)  # None: indexed already, or cannot be
            if pending is not None:
                await _index_in_lane(state, pending)
                waited = True
    work = hashing_work(pools, query, registry.index)  # 0 for hash prompts
    if hashed is None and work >= OFF_LOOP_HASH_BLOCKS:
        hashed = await asyncio.to_thread(hash_prompt, pools, query)
        waited = True
    if waited:
        # Pools deleted or replaced meanwhile are no longer asked about (not NOT_FOUND: they
        # were there when the call came).
        pools = [pool for pool in pools if _registered(registry, pool)]
    return lookup(pools, registry.index, query, hashed)


def lookup_now(
    registry: PoolRegistry, query: LookupQuery, principal: Principal | None
) -> LookupAnswer | None:
    """:func:`lookup_as`'s answer when it needs no wait, else ``None`` (await
    :func:`lookup_as`): a pool of the scope to index off the loop first, or a token prompt to
    hash off it. For a caller that answers on the loop at once when it can (the lookup port).

    Raises:
        See :func:`lookup_as`.
    """
    scoped = _readable(registry, query, principal)
    if scoped is None:
        return LookupAnswer((), (), 0)
    pools = registry.scope(scoped)
    for pool in registry.index.unindexed(pools):  # usually none: O(1) for every pool
        manager = pool.manager
        if manager is not None and manager.block_pool.num_cached_blocks >= OFF_LOOP_INDEX_BLOCKS:
            return None
    if hashing_work(pools, scoped, registry.index) >= OFF_LOOP_HASH_BLOCKS:
        return None
    return lookup(pools, registry.index, scoped)


def _readable(
    registry: PoolRegistry, query: LookupQuery, principal: Principal | None
) -> LookupQuery | None:
    """``query`` narrowed to the pools ``principal`` may read (``None``: it may read none).

    Raises:
        LookupDeniedError: ``query.pool_ids`` names a pool the principal may not read.
    """
    if principal is None:
        return query
    for index, pool_id in enumerate(query.pool_ids):
        if not may_read(principal, pool_id):
            raise LookupDeniedError(
                f"scope.pool_ids[{index}]: principal {principal.name!r} may not read pool "
                f"{pool_id!r}"
            )
    if query.pool_ids:
        return query
    readable = tuple(pool.name for pool in registry.list() if may_read(principal, pool.name))
    if not readable:
        return None
    return dataclasses.replace(query, pool_ids=readable)


def _registered(registry: PoolRegistry, pool: Pool) -> bool:
    return pool.name in registry and registry.get(pool.name) is pool


async def _index_in_lane(state: ServerState, pending: PendingPool) -> None:
    """Attach a reserved pool's cache to the index in a worker thread, the pool lent to it
    (calls on it wait, as for a lane), then commit it, or abandon it if the pool went away.

    The caller checked that no lane holds the pool and has not awaited since. A cancelled
    caller leaves the thread to finish: the pool is given back (and committed) when it does.
    """
    pool = pending.pool
    index = state.registry.index
    done = asyncio.Event()
    state.lanes[pool.name] = done
    pool.lent = True

    def finish(attached: asyncio.Future[None]) -> None:
        pool.lent = False
        del state.lanes[pool.name]
        done.set()
        if attached.cancelled() or attached.exception() is not None:
            index.abandon(pending)
        elif _registered(state.registry, pool):
            index.commit(pending)
        else:
            index.abandon(pending)

    attached = asyncio.get_running_loop().run_in_executor(None, index.attach, pending)
    try:
        await asyncio.shield(attached)
    except asyncio.CancelledError:
        attached.add_done_callback(finish)
        raise
    except Exception:
        finish(attached)
        raise
    finish(attached)


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
            result = await lookup_as(
                self._state.registry, query, PRINCIPAL.get(), state=self._state
            )
        except LookupDeniedError as exc:
            raise AbortRpc(grpc.StatusCode.PERMISSION_DENIED, f"Lookup: {exc}") from None
        return lookup_result_to_proto(result, packed=request.packed)
