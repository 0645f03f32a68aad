"""ResyncPool: replace a pool's state with a snapshot a scheduler uploads (its mirror's).

The vLLM integration's mirror repairs the server's copy of its pool with this call when that
copy was lost (the pool deleted, a server restarted without a data directory) or diverged. The
upload is a client stream of chunks; the snapshot is decoded in a worker thread (it may hold
millions of blocks) and checked against the config of the first chunk before anything changes.
Then the old pool, if any, is deleted as DeletePool deletes it (its waiting registrations and
event streams end) and the restored pool is added under a new epoch: a new incarnation whose
last applied ``step_seq`` is the chunk's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Final, TypeAlias

import grpc

from kvcm.common.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from kvcm.core.limits import Limits, check_pool_blocks
from kvcm.core.pool import Pool
from kvcm.core.pool_types import PoolConfig
from kvcm.core.snapshot import decode_pool
from kvcm.server.access import RULES, refusal
from kvcm.server.rpc._handlers import UndecodableRequest
from kvcm.server.rpc._log import log_pool_resynced
from kvcm.server.rpc._offloop import OFF_LOOP_WORK
from kvcm.server.rpc._state import PRINCIPAL, PoolRuntime, ServerState
from kvcm.server.rpc._status import AbortRpc
from kvcm.v1 import admin_pb2, scheduler_pb2
from kvcm.wire import pool_config_from_proto

__all__ = ["MAX_SNAPSHOT_BYTES", "resync_pool"]

Context: TypeAlias = Any
_METHOD: Final = "/kvcm.v1.SchedulerService/ResyncPool"

MAX_SNAPSHOT_BYTES: Final = 4 << 30
"""The largest snapshot one ResyncPool takes (a 16M-block pool's snapshot is well under)."""


async def _collect(
    chunks: AsyncIterator[scheduler_pb2.ResyncPoolRequest],
) -> tuple[scheduler_pb2.ResyncPoolRequest, bytes]:
    first: scheduler_pb2.ResyncPoolRequest | None = None
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        if isinstance(chunk, UndecodableRequest):
            raise chunk.error()
        if first is None:
            first = chunk
        elif chunk.pool_id or chunk.HasField("config") or chunk.step_seq:
            raise InvalidArgumentError(
                "only the first ResyncPoolRequest names the pool, config and step_seq",
                field="pool_id",
            )
        size += len(chunk.data)
        if size > MAX_SNAPSHOT_BYTES:
            raise ResourceExhaustedError(
                f"the snapshot exceeds {MAX_SNAPSHOT_BYTES} bytes", field="data"
            )
        parts.append(chunk.data)
    if first is None:
        raise InvalidArgumentError("ResyncPool needs at least one chunk", field="pool_id")
    if not first.HasField("config"):
        raise InvalidArgumentError("the first ResyncPoolRequest carries no config", field="config")
    return first, b"".join(parts)


def _decode(data: bytes, pool_id: str, options: PoolConfig, step_seq: int, limits: Limits) -> Pool:
    """The snapshot as a pool called ``pool_id`` (in a worker thread)."""
    with OFF_LOOP_WORK:
        pool = decode_pool(data, pool_id, options, limits=limits)
    pool.last_step_seq = step_seq
    pool.last_step_outcome = None
    return pool


def _check_may_create(pool_id: str) -> None:
    """Creating a pool by ResyncPool needs what CreatePool needs (authentication on).

    Raises:
        AbortRpc: PERMISSION_DENIED.
    """
    principal = PRINCIPAL.get()
    if principal is None:
        return
    why = refusal(principal, RULES[_METHOD], pool_id, exists=False)
    if why is not None:
        raise AbortRpc(
            grpc.StatusCode.PERMISSION_DENIED, f"ResyncPool: principal {principal.name!r} {why}"
        )


async def resync_pool(
    state: ServerState, chunks: AsyncIterator[scheduler_pb2.ResyncPoolRequest]
) -> scheduler_pb2.ResyncPoolResponse:
    """Decode, check, then swap the pool (see the module docstring)."""
    first, data = await _collect(chunks)
    pool_id = first.pool_id
    options = pool_config_from_proto(first.config)
    if options.explicit_layout is None:
        raise InvalidArgumentError(
            "ResyncPool needs a config with an explicit layout", field="config.explicit_layout"
        )
    check_pool_blocks(state.registry.limits, pool_id, options.explicit_layout.num_blocks, 0)
    pool = await asyncio.to_thread(
        _decode, data, pool_id, options, first.step_seq, state.registry.limits
    )
    registry = state.registry
    try:
        old = await state.pool(pool_id)  # waits while a worker thread holds it
    except NotFoundError:
        old = None
    exists = old is not None
    if not exists:
        _check_may_create(pool_id)  # no await from here to the pool's creation
    old_blocks = 0
    if old is not None and old.manager is not None:
        old_blocks = old.manager.block_pool.num_gpu_blocks
    # Check the limits before anything changes (the old pool's blocks are given back).
    check_pool_blocks(
        registry.limits, pool_id, options.explicit_layout.num_blocks,
        registry.num_blocks() - old_blocks,
    )  # fmt: skip
    if old is not None:
        registry.delete(pool_id)
        state.retire(old)
    registry.reserve(pool_id, options)
    registry.add(pool)
    runtime = PoolRuntime(config=admin_pb2.PoolConfig())
    runtime.config.CopyFrom(first.config)
    runtime.planned.set()
    state.runtimes[pool_id] = runtime
    state.activity[pool_id] = time.monotonic()  # the scheduler that uploaded it is alive
    log_pool_resynced(pool, replaced=exists)
    manager = pool.ready_manager()
    return scheduler_pb2.ResyncPoolResponse(
        epoch=pool.epoch,
        num_blocks=manager.block_pool.num_gpu_blocks,
        num_free_blocks=manager.num_free_blocks,
        num_requests=len(pool.requests),
    )
