"""AdminService: create, list, describe and delete pools (a codec over the registry)."""

from __future__ import annotations

from typing import Any, Final, TypeAlias

from kvcm.server.rpc._state import PoolRuntime, ServerState
from kvcm.v1 import admin_pb2, service_pb2_grpc
from kvcm.wire import pool_config_from_proto, pool_info_to_proto, pool_state_to_proto

__all__ = ["AdminServicer"]

# grpc ships no type information: its context is Any to mypy.
Context: TypeAlias = Any
_MAX_EVENTS_PER_MESSAGE: Final = 1024
# RegisterWorker answers this long before the client's deadline, so its own message arrives.
_DEADLINE_MARGIN_S: Final = 0.02


class AdminServicer(service_pb2_grpc.AdminServiceServicer):
    """CreatePool, ListPools, DescribePool, DeletePool."""

    def __init__(self, state: ServerState) -> None:
        """Serve ``state``'s registry."""
        self._state = state

    async def CreatePool(  # noqa: N802 - gRPC method name
        self, request: admin_pb2.CreatePoolRequest, context: Context
    ) -> admin_pb2.CreatePoolResponse:
        """Create a pool (READY at once with an explicit layout)."""
        config = pool_config_from_proto(request.config)
        pool = self._state.registry.create(request.pool_id, config)
        runtime = PoolRuntime(config=admin_pb2.PoolConfig())
        runtime.config.CopyFrom(request.config)
        if pool.manager is not None:
            runtime.planned.set()
        self._state.runtimes[pool.name] = runtime
        return admin_pb2.CreatePoolResponse(pool=pool_info_to_proto(pool, runtime.config))

    async def ListPools(  # noqa: N802
        self, request: admin_pb2.ListPoolsRequest, context: Context
    ) -> admin_pb2.ListPoolsResponse:
        """Every pool, sorted by id."""
        response = admin_pb2.ListPoolsResponse()
        for pool in self._state.registry.list():
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
        pool = self._state.registry.get(request.pool_id)
        config = self._state.runtimes[pool.name].config
        return admin_pb2.DescribePoolResponse(pool=pool_info_to_proto(pool, config))

    async def DeletePool(  # noqa: N802
        self, request: admin_pb2.DeletePoolRequest, context: Context
    ) -> admin_pb2.DeletePoolResponse:
        """Delete a pool; its waiting registrations and event streams end with NOT_FOUND."""
        pool = self._state.registry.delete(request.pool_id)
        runtime = self._state.runtimes.pop(pool.name, None)
        if runtime is not None:
            runtime.deleted = True
            runtime.planned.set()
            runtime.wake_subscribers()
        return admin_pb2.DeletePoolResponse()
