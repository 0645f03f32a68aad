"""Durability in the rpc layer: write each mutation ahead, run it once durable, replay.

:class:`JournalInterceptor` (innermost, with ``--data-dir``) writes each call that may change
a pool to the journal before it runs, and runs it once the record is on disk, in journal
order: an answered call survives a crash, and a record the disk refuses (full, failing)
answers UNAVAILABLE having changed nothing. A call the core refuses is marked void. Each call
stamps its events with one time (``CALL_TIME``), which the record keeps, so a replay
republishes the same events with the same timestamps and sequence numbers.

:func:`recover` rebuilds the registry from the checkpoint and the journal before the server
serves: the codec servicers run each record's request again (``RegisterWorker`` at the core
level: its barrier belongs to live calls), then a new checkpoint is written and the journal
starts empty. A journal damaged anywhere but its torn last record stops the start (one line,
nothing changed; see ``kvcm data-dir``).

Worker registrations are journaled per round, not per call: the rank whose registration plans
the pool appends one ``PlanPool`` record holding every rank's registration, before the pool is
seen READY, so that every later call on the pool follows it in the journal.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import grpc
from google.protobuf.message_factory import GetMessageClass  # type: ignore[import-untyped]

from kvcm.common.errors import ConfigError, KVCMError, NotFoundError
from kvcm.core.pool import Pool
from kvcm.core.pool_types import PoolState
from kvcm.core.snapshot import decode_pool, encode_pool
from kvcm.server.journal import (
    PLAN_POOL,
    RECORD_METHODS,
    VOID,
    Checkpoint,
    CheckpointPool,
    Journal,
    JournalRecord,
    JournalUnavailableError,
    Ticket,
    iter_voided,
    open_data_dir,
    write_checkpoint,
)
from kvcm.server.rpc._admin import AdminServicer
from kvcm.server.rpc._handlers import UndecodableRequest
from kvcm.server.rpc._interceptor import MethodInterceptor
from kvcm.server.rpc._resync import MAX_SNAPSHOT_BYTES, resync_pool
from kvcm.server.rpc._scheduler import SchedulerServicer
from kvcm.server.rpc._state import CALL_TIME, PoolRuntime, ServerState
from kvcm.server.rpc._status import AbortRpc
from kvcm.server.rpc._transfers import (
    TRANSFER_METHODS,
    TransferServicer,
    decode_transfers,
    encode_transfers,
)
from kvcm.v1 import admin_pb2, scheduler_pb2, service_pb2, worker_pb2

if TYPE_CHECKING:
    from kvcm.server.cluster.replication import Replication
from kvcm.wire import layer_specs_from_proto, layer_specs_to_proto, pool_config_from_proto

__all__ = [
    "MUTATING_METHODS",
    "JournalInterceptor",
    "checkpoint_of",
    "delete_pool_journaled",
    "encode_round",
    "journal_planned",
    "recover",
    "replay_records",
]

_LOG = logging.getLogger("kvcm.server.journal")
_PREFIX = "/kvcm.v1."
# How long a live checkpoint waits for the calls written ahead to finish before it is
# postponed (calls wait at the gate meanwhile).
_DRAIN_S: Final = 1.0
_DRAIN_ATTEMPTS: Final = 10
# Calls that are not a scheduler's (they renew no scheduler lease).
_ADMIN_METHODS: Final = frozenset({"CreatePool", "DeletePool"})
# How long after a failed or postponed live checkpoint the next one is tried.
_CHECKPOINT_BACKOFF_S: Final = 10.0

# The calls this interceptor journals: every method a record may name but the journal's own (a
# registration round, a void mark) and the TransferService's, which journal themselves (a plan's
# record carries the hit kvcm computed; see rpc/_transfers.py). GetComputedBlocks counts its
# lookup in the pool's statistics, so it is one.
MUTATING_METHODS: Final = RECORD_METHODS - {PLAN_POOL, VOID} - TRANSFER_METHODS


class JournalInterceptor(MethodInterceptor):
    """Writes each mutating call's record ahead, runs the call once the record is durable.

    A call that may change a pool is written to the journal (on the event loop, so a full
    disk is seen at once), waits for its fsync (group commit), then for the calls written
    before it on the same pool, then runs. A record that cannot be written or made durable
    answers UNAVAILABLE with the reason, before the call ran: nothing changed in memory, and
    the next call tries the disk again. A call the core refuses (it changed nothing) is
    marked void in the journal. Once written, a call runs even if its caller goes away
    (cancellation would leave a durable record that never ran live).
    """

    def __init__(
        self, journal: Journal, state: ServerState | None = None, checkpoint_every: int = 0
    ) -> None:
        """Journal into ``journal``; every ``checkpoint_every`` records (0: never) take a
        checkpoint of ``state`` while serving."""
        super().__init__()
        self._journal = journal
        self._state = state
        self._every = checkpoint_every
        self._checkpointing: asyncio.Task[bool] | None = None
        self._not_before = 0.0  # monotonic time before which no checkpoint is tried again
        # Set with a pool placement (docs/replication.md): refuses calls on pools served
        # elsewhere and ships each applied record to the pool's standby.
        self.replication: Replication | None = None

    def _maybe_checkpoint(self) -> None:
        if (
            not self._every
            or self._state is None
            or self._checkpointing is not None
            or time.monotonic() < self._not_before
            or self._journal.records_since_checkpoint < self._every
        ):
            return
        task = asyncio.get_running_loop().create_task(
            checkpoint_live(self._state, self._journal), name="kvcm-checkpoint"
        )
        self._checkpointing = task

        def finished(done: asyncio.Task[bool]) -> None:
            self._checkpointing = None
            if done.cancelled():
                return
            if done.exception() is not None:
                _LOG.error("checkpoint failed: %s", _why(done.exception()))
            elif done.result():
                return
            # Failed (a full disk) or postponed (a long call held a pool): not at every call.
            self._not_before = time.monotonic() + _CHECKPOINT_BACKOFF_S

        task.add_done_callback(finished)

    def _refused_at_once(self, method: str, pool_id: str) -> bool:
        """A call on a pool that does not exist, with no call on that id written ahead of
        it: its handler answers NOT_FOUND before it awaits anything, so it needs no record
        (a stream of such calls neither grows the journal nor costs fsyncs)."""
        state = self._state
        return (
            state is not None
            and method != "CreatePool"
            and pool_id not in state.registry
            and not self._journal.has_calls_on(pool_id)
        )

    async def _write_ahead(self, method: str, pool_id: str, request: bytes, when: float) -> Ticket:
        journal = self._journal
        state = self._state
        if state is not None and method not in _ADMIN_METHODS and pool_id in state.registry:
            # The scheduler called now: its lease is renewed now, not once the record is
            # durable and the call runs (a slow disk is not the client's silence).
            state.activity[pool_id] = state.clock.now()
        while journal.gate is not None:  # a checkpoint is being taken
            await journal.gate.wait()
        try:
            return journal.write_ahead(method, pool_id, request, when)
        except JournalUnavailableError as exc:
            raise AbortRpc(grpc.StatusCode.UNAVAILABLE, _unavailable(exc)) from None

    async def _run(
        self,
        ticket: Ticket,
        call: Callable[[], Awaitable[Any]],
        record: tuple[str, bytes, float] | None = None,
    ) -> Any:
        """Run a written call in its turn (see the class docstring); once it ran, its
        ``record`` (method, request, time) is shipped to the pool's standby, and a ``sync``
        pool's answer waits for the standby (after later calls on the pool may run)."""
        journal = self._journal
        replicated = None
        try:
            try:
                await journal.commit(ticket.seq)
            except JournalUnavailableError as exc:
                raise AbortRpc(grpc.StatusCode.UNAVAILABLE, _unavailable(exc)) from None
            for earlier in ticket.waits:
                await earlier
            state = self._state
            if state is not None:  # the handler then takes the pool without waiting
                while (busy := state.lanes.get(ticket.pool_id)) is not None:
                    await busy.wait()
            if ticket.void_reason is not None:
                raise AbortRpc(grpc.StatusCode.UNAVAILABLE, ticket.void_reason)
            ticket.started = True
            try:
                result = await call()
            except (KVCMError, AbortRpc):
                journal.void(ticket)  # refused: it changed nothing
                raise
            replication = self.replication
            if replication is not None and record is not None:  # no await since it ran
                replicated = replication.applied(record[0], ticket.pool_id, *record[1:])
        finally:
            journal.finish(ticket)
        if replicated is not None and self.replication is not None and record is not None:
            await self.replication.wait_replicated(replicated, record[0], ticket.pool_id)
        return result

    async def _shielded(
        self,
        ticket: Ticket,
        call: Callable[[], Awaitable[Any]],
        record: tuple[str, bytes, float] | None = None,
    ) -> Any:
        task = asyncio.ensure_future(self._run(ticket, call, record))
        task.add_done_callback(_retrieve)
        return await asyncio.shield(task)

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if method not in MUTATING_METHODS:
            return handler
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.stream_unary is not None:
            inner_stream = handler.stream_unary

            async def stream_unary(requests: Any, context: Any) -> Any:
                now = time.time()
                CALL_TIME.set(now)
                chunks, whole = await _collect_upload(requests)
                if whole is None:  # refused by the handler itself: no record
                    return await inner_stream(_replayed(chunks, requests), context)
                if self.replication is not None:
                    self.replication.admit(method, whole.pool_id)
                data = whole.SerializeToString()
                ticket = await self._write_ahead(method, whole.pool_id, data, now)

                async def call() -> Any:
                    # Lease reclaims leave the old pool alone while the snapshot decodes
                    # (they would change it after this call's record).
                    state = self._state
                    old = None
                    if state is not None and whole.pool_id in state.registry:
                        old = state.registry.get(whole.pool_id)
                        old.lent = True
                    try:
                        return await inner_stream(_replayed(chunks, None), context)
                    finally:
                        if old is not None:
                            old.lent = False

                response = await self._shielded(ticket, call, (method, data, now))
                if self.replication is not None:
                    self.replication.stamp(whole.pool_id, context)
                return response

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
        inner = handler.unary_unary

        async def unary(request: Any, context: Any) -> Any:
            now = time.time()
            CALL_TIME.set(now)
            if type(request) is UndecodableRequest:
                return await inner(request, context)  # INVALID_ARGUMENT: no record
            if self._refused_at_once(method, request.pool_id):
                return await inner(request, context)  # NOT_FOUND before any await: no record
            if self.replication is not None:
                self.replication.admit(method, request.pool_id)
            data = request.SerializeToString()
            ticket = await self._write_ahead(method, request.pool_id, data, now)
            response = await self._shielded(
                ticket, lambda: inner(request, context), (method, data, now)
            )
            if self.replication is not None:  # the answer names the pool's placement epoch
                self.replication.stamp(request.pool_id, context)
            self._maybe_checkpoint()
            return response

        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Retrieve a written call's outcome (its caller may have gone)."""
    if not task.cancelled():
        task.exception()


def _why(exc: BaseException | None) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, 'error')})"
    return repr(exc)


def _unavailable(exc: JournalUnavailableError) -> str:
    return f"{exc}: nothing was changed; retry once the data directory can be written"


async def _collect_upload(
    requests: AsyncIterator[Any],
) -> tuple[list[Any], scheduler_pb2.ResyncPoolRequest | None]:
    """Read a ResyncPool upload whole before writing its record; ``None`` when it is one the
    handler refuses by its shape (an undecodable chunk, too large, empty)."""
    chunks: list[Any] = []
    size = 0
    async for chunk in requests:
        chunks.append(chunk)
        if type(chunk) is UndecodableRequest:
            return chunks, None
        size += len(chunk.data)
        if size > MAX_SNAPSHOT_BYTES:
            return chunks, None
    if not chunks:
        return chunks, None
    whole = scheduler_pb2.ResyncPoolRequest()
    whole.CopyFrom(chunks[0])
    whole.data = b"".join(c.data for c in chunks)
    return chunks, whole


async def _replayed(chunks: list[Any], rest: AsyncIterator[Any] | None) -> AsyncIterator[Any]:
    for chunk in chunks:
        yield chunk
    if rest is not None:
        async for chunk in rest:
            yield chunk


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
    state.kv_numbering.restore(checkpoint.kv_event_numbering)
    decode_transfers(state, checkpoint.transfers)


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
    """Journal the registration round that just planned ``pool`` (no-op without a journal).

    The plan is already made (it runs in the pool's lane), so the pool stays lent until its
    record is durable: no call sees it READY before. While the disk refuses the record (full,
    failing) the journal keeps it and tries again (:meth:`Journal.append`); the rank's call
    waits, calls on other pools go on. Calls on the pool written while it was pending are
    voided by the record (they would run after the plan though written before it).

    Raises:
        AbortRpc: UNAVAILABLE when the server stops before the record is durable.
    """
    journal = state.journal
    if journal is None:
        return
    payload = encode_round(pool)
    when = CALL_TIME.get() or time.time()
    while (busy := state.lanes.get(pool.name)) is not None:
        await busy.wait()
    done = asyncio.Event()
    state.lanes[pool.name] = done
    pool.lent = True
    try:
        await journal.commit(journal.append(PLAN_POOL, pool.name, payload, when))
    except JournalUnavailableError as exc:
        raise AbortRpc(grpc.StatusCode.UNAVAILABLE, _unavailable(exc)) from None
    finally:
        pool.lent = False
        state.lanes.pop(pool.name, None)
        done.set()


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
        ConfigError: The directory is unusable, its checkpoint damaged, its journal damaged
            other than by a torn tail (:class:`JournalDamagedError`: nothing was changed), or
            the compacting checkpoint cannot be written (a full disk): one line each.
    """
    try:
        return await _recover(state, data_dir)
    except OSError as exc:
        raise ConfigError(
            f"data_dir: {data_dir}: {_why(exc)} while recovering"
            f"{f' ({exc.filename})' if exc.filename else ''}; nothing acknowledged was lost"
        ) from None


async def _recover(state: ServerState, data_dir: str) -> Journal:
    started = time.perf_counter()
    directory, checkpoint, records, _ = open_data_dir(data_dir)
    if checkpoint is not None:
        _restore_checkpoint(state, checkpoint)
    last_seq = records[-1].seq if records else (checkpoint.seq if checkpoint else 0)
    journal = Journal(directory, last_seq)
    state.journal = journal
    voided = set(iter_voided(records))
    failed = await _replay(state, [r for r in records if r.seq not in voided and r.method != VOID])
    CALL_TIME.set(0.0)
    if records:  # compact; with nothing replayed the checkpoint already says it all
        failure = journal.reset(checkpoint_of(state, journal.last_seq), quiet=True)
        if failure is not None:
            journal.close()
            raise ConfigError(
                f"data_dir: cannot write a checkpoint to {directory}: {_why(failure)}; the journal "
                "was left as it was (free space, then start again)"
            ) from None
    _LOG.info(
        "recovered from the data directory",
        extra={
            "event": "recovered",
            "data_dir": str(directory),
            "pools": len(state.registry),
            "checkpoint_seq": 0 if checkpoint is None else checkpoint.seq,
            "replayed": len(records),
            "voided": len(voided),
            "failed": failed,
            "seconds": round(time.perf_counter() - started, 3),
        },
    )
    return journal


async def replay_records(state: ServerState, records: list[JournalRecord]) -> int:
    """Run ``records`` again, as a recovery does (a standby applies its primary's records
    so); returns how many were refused."""
    return await _replay(state, records)


async def _replay(state: ServerState, records: list[JournalRecord]) -> int:
    """Run ``records`` again; returns how many were refused."""
    classes = _request_classes()
    admin, scheduler = AdminServicer(state), SchedulerServicer(state)
    transfers = TransferServicer(state)
    failed = 0
    for record in records:
        CALL_TIME.set(record.time)
        try:
            if record.method == PLAN_POOL:
                _replay_round(state, record)
            elif record.method in TRANSFER_METHODS:
                transfers.replay(record)
            elif record.method == "ResyncPool":
                chunk = scheduler_pb2.ResyncPoolRequest.FromString(record.request)
                await resync_pool(state, _one(chunk))
            else:
                servicer = admin if hasattr(admin, record.method) else scheduler
                request = classes[record.method].FromString(record.request)
                await getattr(servicer, record.method)(request, _ReplayContext())
        except KVCMError as exc:
            # Refused as it was refused live (its Void mark lost in a crash): it changes
            # nothing either way. Were it a record that ran live, that would be a kvcm bug.
            failed += 1
            _LOG.warning(
                "journal: record %d (%s) is refused on replay: %s", record.seq, record.method, exc
            )
        except Exception:  # a record that failed live with a kvcm bug fails alike
            failed += 1
            _LOG.exception("journal: record %d (%s) failed on replay", record.seq, record.method)
    return failed


async def delete_pool_journaled(state: ServerState, pool_id: str) -> bool:
    """Delete a pool on the server's own behalf as a client's ``DeletePool`` does (the same
    servicer method runs), and journal that call's record, so that neither a replay nor a
    checkpoint brings the pool back: a cluster replica dropping its copy of a pool deleted
    while it was away. Returns whether there was such a pool, once the record is durable (a
    record the disk refuses is kept and written again, :meth:`Journal.append`).
    """
    request = admin_pb2.DeletePoolRequest(pool_id=pool_id)
    when = time.time()
    CALL_TIME.set(when)
    try:
        await AdminServicer(state).DeletePool(request, _ReplayContext())
    except NotFoundError:
        return False
    journal = state.journal
    if journal is not None:
        await journal.commit(
            journal.append("DeletePool", pool_id, request.SerializeToString(), when)
        )
    return True


async def checkpoint_live(state: ServerState, journal: Journal) -> bool:
    """Checkpoint while serving: every pool is held (its calls wait, others go on) while its
    snapshot is encoded off the loop, then the journal drops what the checkpoint holds.

    New calls wait at the journal's gate until every call written ahead has finished and
    every pool is held (a few milliseconds; when that takes more than ``_DRAIN_S`` the gate
    opens again for ``_DRAIN_S`` and the drain is tried again, ``_DRAIN_ATTEMPTS`` times).
    Returns whether it was written (``False``: postponed).

    Raises:
        OSError: The checkpoint or the new journal could not be written (the old ones stay).
    """
    attempts = 0
    while not await journal.pause(_DRAIN_S):  # every call written ahead has finished
        attempts += 1
        if attempts == _DRAIN_ATTEMPTS:
            _LOG.info("checkpoint postponed: calls written ahead did not finish in time")
            return False
        await asyncio.sleep(_DRAIN_S)  # calls flow meanwhile; then try again
    held: dict[str, tuple[Pool, asyncio.Event]] = {}
    try:
        while missing := [
            p
            for p in state.registry.list()
            if p.name not in held and p.name not in state.standby_pools
        ]:
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
        # No await since the last pool was held, and no call written ahead is unfinished:
        # the pools are exactly the records up to seq. Calls written from now on run once
        # the pools are released, after their snapshots were encoded.
        seq = journal.last_seq
        journal.resume()
        pools = [pool for pool, _ in held.values()]
        configs = {
            pool.name: state.runtimes[pool.name].config.SerializeToString() for pool in pools
        }
        epoch = state.registry.epoch
        numbering = state.kv_numbering.encode()
        transfers = encode_transfers(state)
        checkpoint = await asyncio.to_thread(
            _encode_checkpoint, pools, configs, epoch, seq, numbering, transfers=transfers
        )
    finally:
        journal.resume()
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
    return True


def _encode_checkpoint(
    pools: list[Pool],
    configs: dict[str, bytes],
    epoch: int,
    seq: int,
    numbering: bytes,
    *,
    transfers: bytes,
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
    return Checkpoint(seq, epoch, entries, numbering, transfers)


def checkpoint_of(state: ServerState, seq: int) -> Checkpoint:
    """Every pool of ``state`` as of journal sequence ``seq`` (call with no call running)."""
    pools = []
    for pool in state.registry.list():
        if pool.name in state.standby_pools:
            continue  # a standby's copy: its primary seeds it again
        runtime = state.runtimes.get(pool.name)
        config = runtime.config.SerializeToString() if runtime is not None else b""
        snapshot = encode_pool(pool) if pool.state is PoolState.READY else b""
        pools.append(CheckpointPool(pool.name, config, pool.epoch, snapshot))
    return Checkpoint(
        seq,
        state.registry.epoch,
        tuple(pools),
        state.kv_numbering.encode(),
        encode_transfers(state),
    )
