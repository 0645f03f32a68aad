"""WorkerService: the RegisterWorker barrier (every rank gets the same unified config)."""

from __future__ import annotations

import asyncio
from typing import Any, Final, TypeAlias

import grpc

from kvcm.common.errors import KVCMError, NotFoundError
from kvcm.core.pool import Pool
from kvcm.server.rpc._durability import journal_planned
from kvcm.server.rpc._log import log_pool_ready, log_worker_registered
from kvcm.server.rpc._state import PoolRuntime, ServerState
from kvcm.server.rpc._status import AbortRpc
from kvcm.v1 import service_pb2_grpc, worker_pb2
from kvcm.wire import hashing_to_proto, kv_cache_config_to_proto, layer_specs_from_proto

__all__ = ["WorkerServicer"]

# grpc ships no type information: its context is Any to mypy.
Context: TypeAlias = Any
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
        """Register a rank and answer its config once every rank has registered.

        A plan that fails answers every waiting rank with the plan's error at once, and the
        pool drops the round's registrations (every rank registers again). A rank that
        stops waiting (its deadline, ``limits.registration_timeout_s``, a cancelled call)
        before the pool is planned is dropped, so no stale rank keeps the pool PENDING.
        """
        specs = layer_specs_from_proto(request.layer_specs)
        pool = await self._state.pool(request.pool_id)
        runtime = self._state.runtimes[pool.name]
        was_ready = pool.manager is not None
        failed_plans = pool.failed_plans

        def register() -> None:
            pool.register_worker(
                request.rank,
                request.world_size,
                specs,
                request.available_memory_bytes,
                limits=self._state.limits,
            )

        # The rank that completes the round plans the pool and builds its blocks (up to
        # limits.max_blocks_per_pool of them): that runs in the pool's lane, off the loop.
        completes = not was_ready and request.world_size - len(pool.registrations) <= (
            0 if request.rank in pool.registrations else 1
        )
        try:
            if completes:
                await self._state.run_in_lane(pool, register, builds_pool=True)
            else:
                register()
        except KVCMError as exc:
            if pool.failed_plans != failed_plans:
                runtime.fail_round(exc)
            raise
        log_worker_registered(pool, request.rank, request.world_size)
        if pool.manager is not None:
            if not was_ready:
                await journal_planned(self._state, pool)  # before anyone sees it READY
                log_pool_ready(pool)
            runtime.planned.set()
        else:
            await self._wait_for_ranks(pool, runtime, request.rank, context)
        return worker_pb2.RegisterWorkerResponse(
            kv_cache_config=kv_cache_config_to_proto(pool.rank_config(request.rank)),
            hashing=hashing_to_proto(pool.hashing),
            max_model_len=pool.max_model_len,
        )

    async def _wait_for_ranks(
        self, pool: Pool, runtime: PoolRuntime, rank: int, context: Context
    ) -> None:
        """Wait at the barrier until the pool is planned; raise when this round ends otherwise."""
        limit_s = self._state.limits.registration_timeout_s
        remaining = context.time_remaining()
        timeout = limit_s
        if remaining is not None:
            timeout = min(limit_s, max(remaining - _DEADLINE_MARGIN_S, 0.0))
        joined = runtime.round
        runtime.waiting[rank] = runtime.waiting.get(rank, 0) + 1
        try:
            await asyncio.wait_for(runtime.planned.wait(), timeout)
        except TimeoutError:
            raise AbortRpc(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"pool {pool.name!r}: {len(pool.registrations)} of "
                f"{pool.options.world_size} ranks registered within "
                f"{'the deadline' if timeout < limit_s else f'{limit_s:g} s'} (this "
                "registration is dropped: register again to keep waiting)",
            ) from None
        finally:
            left = runtime.waiting.pop(rank) - 1
            if left:
                runtime.waiting[rank] = left
            elif runtime.round == joined and not runtime.deleted:
                pool.withdraw_worker(rank)  # a no-op once planned
        if runtime.deleted:
            raise NotFoundError(f"pool {pool.name!r} was deleted")
        if runtime.round != joined and runtime.plan_failure is not None:
            raise runtime.plan_failure
        if pool.manager is None and not self._state.serving:
            raise AbortRpc(
                grpc.StatusCode.UNAVAILABLE,
                "the server is shutting down (this registration is lost: register again "
                "with the next server)",
            )
