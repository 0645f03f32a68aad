"""AdminService: create, list, describe and delete pools (a codec over the registry).

Building a pool costs about a microsecond per block, so a large pool (an explicit layout of
``OFF_LOOP_BLOCKS`` blocks or more) is built in a worker thread: the registry holds its name and
blocks meanwhile (a second CreatePool of the name is ALREADY_EXISTS, DescribePool and ListPools
do not see it) and adds it once built. Deleting one takes it out of the registry at once and
unlinks its blocks in a worker thread, so that neither the loop nor a later garbage collection
walks millions of linked blocks. The cyclic garbage collector is paused while a large pool is
built: its collections would otherwise walk the growing pool again and again, holding the
interpreter lock (and so the loop) for up to a second each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final, TypeAlias

from kvcm.common.errors import InvalidArgumentError
from kvcm.core.pool import Pool, PoolConfig
from kvcm.server.access import may_read
from kvcm.server.rpc._log import log_pool_created, log_pool_deleted
from kvcm.server.rpc._offloop import OFF_LOOP_WORK
from kvcm.server.rpc._state import PRINCIPAL, PoolRuntime, ServerState, may_hash
from kvcm.v1 import admin_pb2, service_pb2_grpc
from kvcm.wire import (
    pool_config_from_proto,
    pool_info_to_proto,
    pool_state_to_proto,
    zmq_event_stream_to_proto,
)

__all__ = ["OFF_LOOP_BLOCKS", "REPLICATION_MODES", "AdminServicer", "check_replication_mode"]

OFF_LOOP_BLOCKS: Final = 4096
"""Pools of at least this many blocks are built and dismantled off the event loop (~4 ms)."""

REPLICATION_MODES: Final = ("sync", "async")
"""A clustered pool's replication modes (CreatePoolRequest.replication_mode)."""


def check_replication_mode(value: str) -> str:
    """The replication mode ``CreatePoolRequest.replication_mode`` names (``""``: sync).

    Raises:
        InvalidArgumentError: Another value (the field is named).
    """
    if value == "":
        return "sync"
    if value not in REPLICATION_MODES:
        raise InvalidArgumentError(
            f"replication_mode must be 'sync' or 'async' (or empty: sync), got {value!r}",
            field="replication_mode",
        )
    return value


# grpc ships no type information: its context is Any to mypy.
Context: TypeAlias = Any


class AdminServicer(service_pb2_grpc.AdminServiceServicer):
    """CreatePool, ListPools, DescribePool, DeletePool."""

    def __init__(self, state: ServerState) -> None:
        """Serve ``state``'s registry."""
        self._state = state

    async def CreatePool(  # noqa: N802 - gRPC method name
        self, request: admin_pb2.CreatePoolRequest, context: Context
    ) -> admin_pb2.CreatePoolResponse:
        """Create a pool (READY at once with an explicit layout)."""
        check_replication_mode(request.replication_mode)
        options = pool_config_from_proto(request.config)
        registry = self._state.registry
        layout = options.explicit_layout
        if layout is None or layout.num_blocks < OFF_LOOP_BLOCKS:
            pool = registry.create(request.pool_id, options)
        else:
            registry.reserve(request.pool_id, options)
            try:
                pool = await asyncio.to_thread(
                    _build_large, registry.build, request.pool_id, options
                )
            except BaseException:
                registry.release(request.pool_id)
                raise
            registry.add(pool)
        runtime = PoolRuntime(config=admin_pb2.PoolConfig())
        runtime.config.CopyFrom(request.config)
        if pool.manager is not None:
            runtime.planned.set()
        self._state.runtimes[pool.name] = runtime
        log_pool_created(pool)
        return admin_pb2.CreatePoolResponse(pool=pool_info_to_proto(pool, runtime.config))

    async def ListPools(  # noqa: N802
        self, request: admin_pb2.ListPoolsRequest, context: Context
    ) -> admin_pb2.ListPoolsResponse:
        """Every pool the caller may read, sorted by id (a pool lent to a worker thread shows
        its last counts)."""
        response = admin_pb2.ListPoolsResponse()
        principal = PRINCIPAL.get()
        for pool in self._state.registry.list():
            if not may_read(principal, pool.name):
                continue
            manager = pool.manager
            response.pools.add(
                pool_id=pool.name,
                state=pool_state_to_proto(pool.state),
                num_blocks=0 if manager is None else manager.block_pool.num_gpu_blocks,
                num_free_blocks=0 if manager is None else manager.num_free_blocks,
                num_requests=len(pool.requests),
            )
        return response

    async def DescribePool(  # noqa: N802
        self, request: admin_pb2.DescribePoolRequest, context: Context
    ) -> admin_pb2.DescribePoolResponse:
        """Everything about one pool."""
        pool = await self._state.pool(request.pool_id)
        config = self._state.runtimes[pool.name].config
        response = admin_pb2.DescribePoolResponse(pool=pool_info_to_proto(pool, config))
        if not may_hash(pool.name):  # the seed is for those who hash for the pool
            response.pool.hashing.seed = ""
            response.pool.config.ClearField("hash_seed")
        zmq_events = self._state.zmq_events(pool)
        if zmq_events is not None:
            response.pool.zmq_events.CopyFrom(zmq_event_stream_to_proto(zmq_events))
        progress = self._state.progress.get(pool.name, pool.last_step_seq)
        if progress is not None:
            response.pool.step_progress.CopyFrom(
                admin_pb2.StepProgress(
                    last_step_seq=progress.last_step_seq,
                    last_step_age_s=progress.last_step_age_s,
                    scheduler_step_seq=progress.scheduler_step_seq,
                    steps_behind=progress.steps_behind,
                    since_applied_s=progress.since_applied_s,
                )
            )
        return response

    async def DeletePool(  # noqa: N802
        self, request: admin_pb2.DeletePoolRequest, context: Context
    ) -> admin_pb2.DeletePoolResponse:
        """Delete a pool: it publishes AllBlocksCleared, then its waiting registrations and event
        streams end with NOT_FOUND."""
        await self._state.pool(request.pool_id)  # waits while a worker thread holds it
        pool = self._state.registry.delete(request.pool_id)
        self._state.progress.forget(pool.name)
        self._state.retire(pool)
        log_pool_deleted(pool)
        manager = pool.manager
        if manager is not None and manager.block_pool.num_gpu_blocks >= OFF_LOOP_BLOCKS:
            await asyncio.to_thread(_dismantle, pool)
        return admin_pb2.DeletePoolResponse()


_FREE_SLICE: Final = 8192


def _build_large(build: Callable[[str, PoolConfig], Pool], name: str, options: PoolConfig) -> Pool:
    """``build(name, options)`` in a worker thread (see :class:`_OffLoopWork`)."""
    with OFF_LOOP_WORK:
        return build(name, options)


def _dismantle(pool: Pool) -> None:
    """Unlink a deleted pool's blocks so reference counting frees them (in a worker thread).

    The free queue links every free block to its neighbours: left alone, millions of blocks
    become one cycle that only a full garbage collection (which holds the interpreter lock)
    frees.
    """
    manager = pool.manager
    if manager is None:
        return
    blocks = manager.block_pool.blocks
    with OFF_LOOP_WORK:
        for block in blocks:
            block.prev_free_block = None
            block.next_free_block = None
        # In slices: one C call freeing millions of blocks would hold the interpreter lock.
        while blocks:
            del blocks[-_FREE_SLICE:]
