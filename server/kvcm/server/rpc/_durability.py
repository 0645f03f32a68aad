"""Durability in the rpc layer: journal every acknowledged mutation, replay it at start-up.

:class:`JournalInterceptor` (innermost, with ``--data-dir``) appends each call that changed a
pool to the journal once its handler returned, and holds the answer until the record is on
disk: an answered call survives a crash; a rejected call is not journaled (it changed
nothing). Each call stamps its events with one time (``CALL_TIME``), which the record keeps, so
a replay republishes the same events with the same timestamps and sequence numbers.

:func:`recover` rebuilds the registry from the checkpoint and the journal before the server
serves: the codec servicers run each record's request again (``RegisterWorker`` at the core
level: its barrier belongs to live calls), then a new checkpoint is written and the journal
starts empty.

Worker registrations are journaled per round, not per call: the rank whose registration plans
the pool appends one ``PlanPool`` record holding every rank's registration, before the pool is
seen READY, so that every later call on the pool follows it in the journal.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import AsyncIterator
from typing import Any, Final

import grpc
from google.protobuf.message_factory import GetMessageClass  # type: ignore[import-untyped]

from kvcm.common.errors import KVCMError
from kvcm.core.pool import Pool
from kvcm.core.pool_types import PoolState
from kvcm.core.snapshot import decode_pool, encode_pool
from kvcm.server.journal import (
    Checkpoint,
    CheckpointPool,
    Journal,
    JournalRecord,
    open_data_dir,
    write_checkpoint,
)
from kvcm.server.rpc._admin import AdminServicer
from kvcm.server.rpc._interceptor import MethodInterceptor
from kvcm.server.rpc._resync import resync_pool
from kvcm.server.rpc._scheduler import SchedulerServicer
from kvcm.server.rpc._state import CALL_TIME, PoolRuntime, ServerState
from kvcm.v1 import admin_pb2, scheduler_pb2, service_pb2, worker_pb2
from kvcm.wire import layer_specs_from_proto, layer_specs_to_proto, pool_config_from_proto

__all__ = [
    "MUTATING_METHODS",
    "JournalInterceptor",
    "checkpoint_of",
    "encode_round",
    "journal_planned",
    "recover",
]

_LOG = logging.getLogger("kvcm.server.journal")
_PREFIX = "/kvcm.v1."

MUTATING_METHODS: Final = frozenset(
    {
        "CreatePool",
        "DeletePool",
        "Step",
        "ResyncPool",
        "AddRequest",
        "AppendTokens",
        "Free",
        "GetComputedBlocks",  # counts the lookup in the pool's statistics
        "AllocateSlots",
        "CacheBlocks",
        "RemoveSkippedBlocks",
        "EvictBlocks",
        "ResetPrefixCache",
        "TakeNewBlockIds",
        "NewStepStarts",
        "TakePrefixCacheStats",
    }
)


class JournalInterceptor(MethodInterceptor):
    """Journals answered mutations and holds each answer until it is durable."""

    def __init__(
        self, journal: Journal, state: ServerState | None = None, checkpoint_every: int = 0
    ) -> None:
        """Journal into ``journal``; every ``checkpoint_every`` records (0: never) take a
        checkpoint of ``state`` while serving."""
        super().__init__()
        self._journal = journal
        self._state = state
        self._every = checkpoint_every
        self._checkpointing: asyncio.Task[None] | None = None

    def _maybe_checkpoint(self) -> None:
        if (
            not self._every
            or self._state is None
            or self._checkpointing is not None
            or self._journal.records_since_checkpoint < self._every
        ):
            return
        task = asyncio.get_running_loop().create_task(
            checkpoint_live(self._state, self._journal), name="kvcm-checkpoint"
        )
        self._checkpointing = task

        def finished(done: asyncio.Task[None]) -> None:
            self._checkpointing = None
            if not done.cancelled() and done.exception() is not None:
                _LOG.error("checkpoint failed: %r", done.exception())

        task.add_done_callback(finished)

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if method not in MUTATING_METHODS:
            return handler
        journal = self._journal
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.stream_unary is not None:
            inner_stream = handler.stream_unary

            async def stream_unary(requests: Any, context: Any) -> Any:
                CALL_TIME.set(time.time())
                chunks: list[Any] = []

                async def recorded() -> AsyncIterator[Any]:
                    async for chunk in requests:
                        chunks.append(chunk)
                        yield chunk

                response = await inner_stream(recorded(), context)
                whole = scheduler_pb2.ResyncPoolRequest()
                whole.CopyFrom(chunks[0])
                whole.data = b"".join(c.data for c in chunks)
                seq = journal.append(
                    method, whole.pool_id, whole.SerializeToString(), CALL_TIME.get()
                )
                await journal.commit(seq)
                return response

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
        inner = handler.unary_unary

        async def unary(request: Any, context: Any) -> Any:
            now = time.time()
            CALL_TIME.set(now)
            response = await inner(request, context)
            seq = journal.append(method, request.pool_id, request.SerializeToString(), now)
            await journal.commit(seq)
            self._maybe_checkpoint()
            return response

        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


class _ReplayContext:
    """The part of a grpc context the servicers read, for replaying a record."""

    def time_remaining(self) -> float:
        return 3600.0

    def invocation_metadata(self) -> tuple[()]:
        return ()


async def _one(chunk: scheduler_pb2.ResyncPoolRequest) -> AsyncIterator[Any]:
    yield chunk


def _request_classes() -> dict[str, Any]:
    classes = {}
    for service in service_pb2.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            classes[method.name] = GetMessageClass(method.input_type)
    return classes


def _restore_checkpoint(state: ServerState, checkpoint: Checkpoint) -> None:
    registry = state.registry
    for saved in checkpoint.pools:
        config = admin_pb2.PoolConfig.FromString(saved.config)
        options = pool_config_from_proto(config)
        if saved.snapshot:
            pool = decode_pool(saved.snapshot, saved.pool_id, options, limits=registry.limits)
        else:
            pool = Pool(saved.pool_id, options, limits=registry.limits)
        registry.reserve(saved.pool_id, options)
        registry.add(pool)
        pool.epoch = saved.epoch
        runtime = PoolRuntime(config=config)
        if pool.manager is not None:
            runtime.planned.set()
        state.runtimes[pool.name] = runtime
    registry.epoch = checkpoint.registry_epoch


def encode_round(pool: Pool) -> bytes:
    """A planned pool's registrations as a ``PlanPool`` record's payload: each rank's
    ``RegisterWorkerRequest``, length-prefixed, by rank."""
    parts = []
    for rank in sorted(pool.registrations):
        registration = pool.registrations[rank]
        request = worker_pb2.RegisterWorkerRequest(
            pool_id=pool.name,
            rank=rank,
            world_size=pool.options.world_size,
            layer_specs=layer_specs_to_proto(registration.specs),
            available_memory_bytes=registration.available_memory_bytes,
        )
        data = request.SerializeToString()
        parts.append(struct.pack("<I", len(data)) + data)
    return b"".join(parts)


async def journal_planned(state: ServerState, pool: Pool) -> None:
    """Journal the registration round that just planned ``pool`` (no-op without a journal)."""
    journal = state.journal
    if journal is None:
        return
    seq = journal.append("PlanPool", pool.name, encode_round(pool), CALL_TIME.get() or time.time())
    await journal.commit(seq)


def _replay_round(state: ServerState, record: JournalRecord) -> None:
    data = record.request
    at = 0
    pool = state.registry.get(record.pool_id)
    while at < len(data):
        (size,) = struct.unpack_from("<I", data, at)
        request = worker_pb2.RegisterWorkerRequest.FromString(data[at + 4 : at + 4 + size])
        at += 4 + size
        pool.register_worker(
            request.rank,
            request.world_size,
            layer_specs_from_proto(request.layer_specs),
            request.available_memory_bytes,
            limits=state.limits,
        )
    if pool.manager is not None:
        state.runtimes[pool.name].planned.set()


async def recover(state: ServerState, data_dir: str) -> Journal:
    """Rebuild ``state`` from ``data_dir``; returns the journal to append to.

    Raises:
        ConfigError: The directory is unusable or its checkpoint damaged.
    """
    started = time.perf_counter()
    directory, checkpoint, records, _ = open_data_dir(data_dir)
    if checkpoint is not None:
        _restore_checkpoint(state, checkpoint)
    last_seq = records[-1].seq if records else (checkpoint.seq if checkpoint else 0)
    journal = Journal(directory, last_seq)
    state.journal = journal
    classes = _request_classes()
    admin, scheduler = AdminServicer(state), SchedulerServicer(state)
    failed = 0
    for record in records:
        CALL_TIME.set(record.time)
        try:
            if record.method == "PlanPool":
                _replay_round(state, record)
            elif record.method == "ResyncPool":
                chunk = scheduler_pb2.ResyncPoolRequest.FromString(record.request)
                await resync_pool(state, _one(chunk))
            else:
                servicer = admin if hasattr(admin, record.method) else scheduler
                request = classes[record.method].FromString(record.request)
                await getattr(servicer, record.method)(request, _ReplayContext())
        except KVCMError as exc:  # a record that ran once must run again: a kvcm bug
            failed += 1
            _LOG.error(
                "journal: record %d (%s) failed on replay: %s", record.seq, record.method, exc
            )
    CALL_TIME.set(0.0)
    if records:  # compact; with nothing replayed the checkpoint already says it all
        journal.reset(checkpoint_of(state, journal.last_seq))
    _LOG.info(
        "recovered from the data directory",
        extra={
            "event": "recovered",
            "data_dir": str(directory),
            "pools": len(state.registry),
            "checkpoint_seq": 0 if checkpoint is None else checkpoint.seq,
            "replayed": len(records),
            "failed": failed,
            "seconds": round(time.perf_counter() - started, 3),
        },
    )
    return journal


async def checkpoint_live(state: ServerState, journal: Journal) -> None:
    """Checkpoint while serving: every pool is held (its calls wait, others go on) while its
    snapshot is encoded off the loop, then the journal drops what the checkpoint holds."""
    held: dict[str, tuple[Pool, asyncio.Event]] = {}
    try:
        while missing := [p for p in state.registry.list() if p.name not in held]:
            for pool in missing:
                while (busy := state.lanes.get(pool.name)) is not None:
                    await busy.wait()
                try:
                    current = state.registry.get(pool.name)
                except KVCMError:
                    continue  # deleted meanwhile
                if current is not pool:
                    continue  # replaced (ResyncPool): the next round holds the new one
                done = asyncio.Event()
                state.lanes[pool.name] = done
                pool.lent = True
                held[pool.name] = (pool, done)
        # No await since the last pool was held: no call has changed them since seq.
        seq = journal.last_seq
        pools = [pool for pool, _ in held.values()]
        configs = {
            pool.name: state.runtimes[pool.name].config.SerializeToString() for pool in pools
        }
        epoch = state.registry.epoch
        checkpoint = await asyncio.to_thread(_encode_checkpoint, pools, configs, epoch, seq)
    finally:
        for pool, done in held.values():
            pool.lent = False
            state.lanes.pop(pool.name, None)
            done.set()
    await asyncio.to_thread(write_checkpoint, journal.directory, checkpoint)
    journal.truncate_through(checkpoint.seq)
    _LOG.info(
        "checkpoint written",
        extra={"event": "checkpoint", "seq": checkpoint.seq, "pools": len(checkpoint.pools)},
    )


def _encode_checkpoint(
    pools: list[Pool], configs: dict[str, bytes], epoch: int, seq: int
) -> Checkpoint:
    entries = tuple(
        CheckpointPool(
            pool.name,
            configs[pool.name],
            pool.epoch,
            encode_pool(pool) if pool.state is PoolState.READY else b"",
        )
        for pool in pools
    )
    return Checkpoint(seq, epoch, entries)


def checkpoint_of(state: ServerState, seq: int) -> Checkpoint:
    """Every pool of ``state`` as of journal sequence ``seq`` (call with no call running)."""
    pools = []
    for pool in state.registry.list():
        runtime = state.runtimes.get(pool.name)
        config = runtime.config.SerializeToString() if runtime is not None else b""
        snapshot = encode_pool(pool) if pool.state is PoolState.READY else b""
        pools.append(CheckpointPool(pool.name, config, pool.epoch, snapshot))
    return Checkpoint(seq, state.registry.epoch, tuple(pools))
