"""WorkerService: the RegisterWorker barrier (every rank gets the same unified config)."""

from __future__ import annotations

import asyncio
from typing import Any, Final, TypeAlias

import grpc

from kvcm.common.errors import NotFoundError
from kvcm.server.rpc._state import ServerState
from kvcm.server.rpc._status import AbortRpc
from kvcm.v1 import service_pb2_grpc, worker_pb2
from kvcm.wire import hashing_to_proto, kv_cache_config_to_proto, layer_specs_from_proto

__all__ = ["WorkerServicer"]

# grpc ships no type information: its context is Any to mypy.
Context: TypeAlias = Any
_MAX_EVENTS_PER_MESSAGE: Final = 1024
# RegisterWorker answers this long before the client's deadline, so its own message arrives.
_DEADLINE_MARGIN_S: Final = 0.02


class WorkerServicer(service_pb2_grpc.WorkerServiceServicer):
    """RegisterWorker."""

    def __init__(self, state: ServerState) -> None:
        """Serve ``state``'s registry."""
        self._state = state

    async def RegisterWorker(  # noqa: N802
        self, request: worker_pb2.RegisterWorkerRequest, context: Context
    ) -> worker_pb2.RegisterWorkerResponse:
        """Register a rank and answer its config once every rank has registered."""
        specs = layer_specs_from_proto(request.layer_specs)
        pool = self._state.registry.get(request.pool_id)
        runtime = self._state.runtimes[pool.name]
        pool.register_worker(
            request.rank, request.world_size, specs, request.available_memory_bytes
        )
        if pool.manager is not None:
            runtime.planned.set()
        else:
            remaining = context.time_remaining()
            timeout = None if remaining is None else max(remaining - _DEADLINE_MARGIN_S, 0.0)
            try:
                await asyncio.wait_for(runtime.planned.wait(), timeout)
            except TimeoutError:
                raise AbortRpc(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"pool {pool.name!r}: {len(pool.registrations)} of "
                    f"{pool.options.world_size} ranks registered by the deadline (this "
                    "registration stays; call again to keep waiting)",
                ) from None
            if runtime.deleted:
                raise NotFoundError(f"pool {pool.name!r} was deleted")
            if pool.manager is None and not self._state.serving:
                raise AbortRpc(
                    grpc.StatusCode.UNAVAILABLE,
                    "the server is shutting down (this registration is lost: register again "
                    "with the next server)",
                )
        return worker_pb2.RegisterWorkerResponse(
            kv_cache_config=kv_cache_config_to_proto(pool.rank_config(request.rank)),
            hashing=hashing_to_proto(pool.hashing),
            max_model_len=pool.max_model_len,
        )
