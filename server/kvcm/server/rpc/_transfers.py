"""TransferService: P/D transfer records with leases (a codec over :class:`TransferBook`).

Each mutating call is checked (fields, pools), then journaled and applied like the other
mutating calls: its record is written ahead, made durable, and applied in its turn after the
calls written before it on the same source pool (``Journal.write_ahead``). The record is the
call's request, *resolved*: a managed ``PlanTransfer`` carries the destination's hit and pull
that kvcm computed, so a replay makes the same record whatever the destination pool holds
then. A refused apply (the book or the pool says no) is voided and changes nothing.

Giving a managed source back finishes its request (one FINISH Step program on the source pool,
published like any Step's events), in the same apply as the record's change, so both happen or
neither. The lease monitor expires transfers through the same path (``ExpireTransfer``
records). With replication (docs/replication.md) each applied record is shipped to the source
pool's standby (``Journal.on_call``: in a ``sync`` pool the answer waits for the standby's
acknowledgement, as any mutating call's; the lease monitor's expiries go by
``Journal.on_change``, as the server's own changes, waited for by nobody), which replays it
through the journal's replay path; a standby copy refuses these calls (UNAVAILABLE). A seed
carries the pool's records (:func:`encode_transfers` of the pool).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Iterable
from typing import Any, Final, TypeAlias

import grpc
from google.protobuf import json_format  # type: ignore[import-untyped]

from kvcm.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCMError,
    NotFoundError,
    shown,
)
from kvcm.core.lookup import LookupQuery
from kvcm.core.pool import Pool
from kvcm.core.program import OpKind, StepProgram
from kvcm.server.access import may_read
from kvcm.server.journal import JournalRecord, JournalUnavailableError
from kvcm.server.rpc._lookup import LookupDeniedError, lookup_as
from kvcm.server.rpc._state import CALL_TIME, PRINCIPAL, Principal, ServerState
from kvcm.server.rpc._status import AbortRpc
from kvcm.server.transfers import (
    MAX_LEASE_S,
    Change,
    TransferRecord,
    TransferState,
    check_id,
)
from kvcm.v1 import common_pb2, pd_pb2
from kvcm.wire import fill_grouped, grouped_from_proto

__all__ = [
    "TRANSFER_METHODS",
    "TransferServicer",
    "TransferView",
    "decode_transfers",
    "list_transfers",
    "encode_transfers",
    "transfer_to_proto",
]

Context: TypeAlias = Any
_MAX_REASON_CHARS: Final = 256

TRANSFER_METHODS: Final = frozenset(
    {"HoldSource", "PlanTransfer", "CommitTransfer", "ReleaseTransfer", "ExpireTransfer"}
)
"""The TransferService calls that change a record: journaled by this module, replayed by it."""

_REQUESTS: Final[dict[str, Any]] = {
    "HoldSource": pd_pb2.HoldSourceRequest,
    "PlanTransfer": pd_pb2.PlanTransferRequest,
    "CommitTransfer": pd_pb2.CommitTransferRequest,
    "ReleaseTransfer": pd_pb2.ReleaseTransferRequest,
    "ExpireTransfer": pd_pb2.ExpireTransferRequest,
}


def transfer_to_proto(record: TransferRecord, now: float) -> pd_pb2.Transfer:
    """``record`` as a ``kvcm.v1.Transfer``; ``now``: the awake clock, for the lease left."""
    message = pd_pb2.Transfer(
        pool_id=record.pool_id,
        transfer_id=record.transfer_id,
        state=pd_pb2.TransferState.Value(f"TRANSFER_STATE_{record.state.name}"),
        record_only=record.record_only,
        request_key=record.request_key,
        request_id=record.request_id,
        num_tokens=record.num_tokens,
        lease_s=record.lease_s,
        lease_remaining_s=record.deadline() - now if record.holds_source else 0.0,
        destination_pool_id=record.destination_pool_id,
        hit_tokens=record.hit_tokens,
        pull_tokens=record.pull_tokens,
        hit_blocks=record.hit_blocks,
        pull_blocks=record.pull_blocks,
        blocks_pulled=record.blocks_pulled,
        started_at=record.started_at,
        ended_at=record.ended_at,
        reason=record.reason,
        block_size=record.block_size,
        source_freed=record.source_freed,
        pool_epoch=record.pool_epoch,
    )
    fill_grouped([list(ids) for ids in record.source_blocks], message.source_blocks)
    return message


def _from_proto(message: pd_pb2.Transfer) -> TransferRecord:
    return TransferRecord(
        pool_id=message.pool_id,
        transfer_id=message.transfer_id,
        record_only=message.record_only,
        request_key=message.request_key,
        request_id=message.request_id,
        num_tokens=message.num_tokens,
        source_blocks=tuple(tuple(ids) for ids in grouped_from_proto(message.source_blocks)),
        lease_s=message.lease_s,
        block_size=message.block_size,
        state=TransferState(message.state),
        destination_pool_id=message.destination_pool_id,
        hit_tokens=message.hit_tokens,
        pull_tokens=message.pull_tokens,
        blocks_pulled=message.blocks_pulled,
        started_at=message.started_at,
        ended_at=message.ended_at,
        reason=message.reason,
        source_freed=message.source_freed,
        pool_epoch=message.pool_epoch,
    )


def encode_transfers(state: ServerState, pool_id: str | None = None) -> bytes:
    """Every record of the book (of source pool ``pool_id`` only, when given: a replication
    seed's), for a checkpoint (``ListTransfersResponse`` bytes)."""
    now = state.clock.now()
    records: Iterable[TransferRecord] = state.transfer_book.records.values()
    if pool_id is not None:
        records = [record for record in records if record.pool_id == pool_id]
    message = pd_pb2.ListTransfersResponse(
        transfers=[transfer_to_proto(record, now) for record in records]
    )
    data: bytes = message.SerializeToString()
    return data


def decode_transfers(state: ServerState, data: bytes, pool_id: str | None = None) -> None:
    """Restore a checkpoint's records (:func:`encode_transfers`) into an empty book; each
    lease starts again now. With ``pool_id`` (a replication seed's records of that pool), the
    book's records of the pool are replaced by them."""
    if pool_id is not None:
        state.transfer_book.drop_pool(pool_id)
    if not data:
        return
    now = state.clock.now()
    for message in pd_pb2.ListTransfersResponse.FromString(data).transfers:
        state.transfer_book.restore(_from_proto(message), now)


def _check_reason(field_name: str, reason: str) -> None:
    if len(reason) > _MAX_REASON_CHARS:
        raise InvalidArgumentError(f"{field_name}: longer than {_MAX_REASON_CHARS} characters")


def _grouped(message: common_pb2.GroupedBlockIds) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(ids) for ids in grouped_from_proto(message, "source_blocks"))


class TransferServicer:
    """The TransferService (see the module docstring)."""

    def __init__(self, state: ServerState) -> None:
        """Serve ``state``'s transfer book."""
        self._state = state

    # ------------------------------------------------------------------------------ calls
    async def HoldSource(  # noqa: N802 - gRPC method name
        self, request: pd_pb2.HoldSourceRequest, context: Context
    ) -> pd_pb2.HoldSourceResponse:
        """Hold a source (see pd.proto)."""
        self._check_keys(request.pool_id, request.transfer_id)
        lease = request.lease_s
        if not (math.isfinite(lease) and 0 < lease <= MAX_LEASE_S):
            raise InvalidArgumentError(f"lease_s: {lease} is not in (0, {MAX_LEASE_S:g}]")
        if request.record_only:
            check_id("request_id", request.request_id)
            _grouped(request.source_blocks)
        elif request.request_id or request.num_tokens or request.HasField("source_blocks"):
            raise InvalidArgumentError(
                "request_id: request_id, num_tokens and source_blocks are read from the pool; "
                "set them only with record_only"
            )
        self._state.registry.get(request.pool_id)  # NOT_FOUND before anything is written
        change = await self._journaled("HoldSource", request, request.pool_id)
        return pd_pb2.HoldSourceResponse(transfer=self._answer(change))

    async def PlanTransfer(  # noqa: N802 - gRPC method name
        self, request: pd_pb2.PlanTransferRequest, context: Context
    ) -> pd_pb2.PlanTransferResponse:
        """Plan the destination; a managed transfer's hit is computed here (see pd.proto)."""
        self._check_keys(request.pool_id, request.transfer_id)
        check_id("destination_pool_id", request.destination_pool_id)
        record = self._state.transfer_book.get(request.pool_id, request.transfer_id)
        given = request.HasField("hit_tokens"), request.HasField("pull_tokens")
        if record.destination_pool_id == request.destination_pool_id:
            return pd_pb2.PlanTransferResponse(transfer=self._answer(Change(record, False)))
        if record.record_only:
            if not all(given):
                missing = "hit_tokens" if not given[0] else "pull_tokens"
                raise InvalidArgumentError(f"{missing}: required for a record_only transfer")
        else:
            if any(given):
                raise InvalidArgumentError(
                    "hit_tokens: kvcm computes a managed transfer's hit and pull; set them "
                    "only for record_only transfers"
                )
            if not record.in_flight:
                raise FailedPreconditionError(
                    f"transfer_id: transfer {shown(record.transfer_id)} is {record.state.name}"
                )
            request = await self._resolve_plan(request, record)
        change = await self._journaled("PlanTransfer", request, request.pool_id)
        return pd_pb2.PlanTransferResponse(transfer=self._answer(change))

    async def CommitTransfer(  # noqa: N802 - gRPC method name
        self, request: pd_pb2.CommitTransferRequest, context: Context
    ) -> pd_pb2.CommitTransferResponse:
        """Complete the transfer, giving a managed source back."""
        self._check_keys(request.pool_id, request.transfer_id)
        record = self._state.transfer_book.get(request.pool_id, request.transfer_id)
        most = max((len(ids) for ids in record.source_blocks), default=0)
        if request.HasField("blocks_pulled") and request.blocks_pulled > most:
            raise InvalidArgumentError(
                f"blocks_pulled: {request.blocks_pulled} is more than the source's {most} blocks"
            )
        change = await self._journaled("CommitTransfer", request, request.pool_id)
        return pd_pb2.CommitTransferResponse(transfer=self._answer(change))

    async def ReleaseTransfer(  # noqa: N802 - gRPC method name
        self, request: pd_pb2.ReleaseTransferRequest, context: Context
    ) -> pd_pb2.ReleaseTransferResponse:
        """Let the transfer go, giving a managed source back."""
        self._check_keys(request.pool_id, request.transfer_id)
        _check_reason("reason", request.reason)
        self._state.transfer_book.get(request.pool_id, request.transfer_id)
        change = await self._journaled("ReleaseTransfer", request, request.pool_id)
        return pd_pb2.ReleaseTransferResponse(transfer=self._answer(change))

    async def ExpireTransfer(  # noqa: N802 - gRPC method name
        self, request: pd_pb2.ExpireTransferRequest, context: Context
    ) -> pd_pb2.ExpireTransferResponse:
        """End the lease now, giving a managed source back."""
        self._check_keys(request.pool_id, request.transfer_id)
        _check_reason("reason", request.reason)
        record = self._state.transfer_book.get(request.pool_id, request.transfer_id)
        if request.source_freed and not record.record_only:
            raise InvalidArgumentError(
                "source_freed: only for record_only transfers (kvcm frees a managed source)"
            )
        if not request.reason:
            request.reason = "ExpireTransfer"
        change = await self._journaled("ExpireTransfer", request, request.pool_id)
        return pd_pb2.ExpireTransferResponse(transfer=self._answer(change))

    async def DescribeTransfer(  # noqa: N802 - gRPC method name
        self, request: pd_pb2.DescribeTransferRequest, context: Context
    ) -> pd_pb2.DescribeTransferResponse:
        """One transfer."""
        self._check_keys(request.pool_id, request.transfer_id)
        record = self._state.transfer_book.get(request.pool_id, request.transfer_id)
        return pd_pb2.DescribeTransferResponse(transfer=self._answer(Change(record, False)))

    async def ListTransfers(  # noqa: N802 - gRPC method name
        self, request: pd_pb2.ListTransfersRequest, context: Context
    ) -> pd_pb2.ListTransfersResponse:
        """Transfers in flight (oldest first), then ended ones (most recent first)."""
        states = set()
        for index, value in enumerate(request.states):
            if value not in TransferState._value2member_map_:
                raise InvalidArgumentError(f"states[{index}]: {value} is not a transfer state")
            states.add(TransferState(value))
        try:
            return list_transfers(self._state, request.pool_id, states, PRINCIPAL.get())
        except PermissionError as exc:
            raise AbortRpc(grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None

    # ------------------------------------------------------------------------- the lease
    async def expire_due(self) -> int:
        """Expire every transfer past its lease and release managed ones whose source was
        freed outside the transfer; returns how many were ended (the lease monitor's)."""
        state = self._state
        now = state.clock.now()
        ended = 0
        for record in list(state.transfer_book.in_flight()):
            if not record.in_flight or record.pool_id in state.standby_pools:
                continue  # ended meanwhile; a standby's copy expires by its primary's records
            if record.pool_id not in state.registry:
                ended += state.transfer_book.abandon_pool(record.pool_id, time.time())
                continue
            if not record.record_only and self._source(record) is None:
                method, reason = "ReleaseTransfer", "the source request was freed outside it"
                message: Any = pd_pb2.ReleaseTransferRequest(reason=reason)
            elif now > record.deadline():
                method = "ExpireTransfer"
                reason = f"lease of {record.lease_s:g} s ran out"
                message = pd_pb2.ExpireTransferRequest(reason=reason)
            else:
                continue
            message.pool_id, message.transfer_id = record.pool_id, record.transfer_id
            CALL_TIME.set(time.time())
            try:
                await self._journaled(method, message, record.pool_id, answered=False)
            except (KVCMError, AbortRpc):
                continue  # the pool went away meanwhile, or the disk refused: next check
            ended += 1
        return ended

    # -------------------------------------------------------------------------- replay
    def replay(self, record: JournalRecord) -> None:
        """Apply a journaled transfer call again (at recovery, or on a standby).

        A call on a transfer this book does not hold is skipped (a checkpoint written before
        checkpoints held transfer records; a standby's seed carries its pool's records).
        """
        request = _REQUESTS[record.method].FromString(record.request)
        key = (request.pool_id, request.transfer_id)
        if record.method != "HoldSource" and key not in self._state.transfer_book.records:
            return
        self._apply(record.method, request)

    # ------------------------------------------------------------------------ internals
    def _check_keys(self, pool_id: str, transfer_id: str) -> None:
        check_id("pool_id", pool_id)
        check_id("transfer_id", transfer_id)

    def _answer(self, change: Change) -> pd_pb2.Transfer:
        return transfer_to_proto(change.record, self._state.clock.now())

    async def _resolve_plan(
        self, request: pd_pb2.PlanTransferRequest, record: TransferRecord
    ) -> pd_pb2.PlanTransferRequest:
        """The destination's exact hit for the source's blocks, into a copy of ``request``."""
        state = self._state
        registry = state.registry
        try:
            destination = registry.get(request.destination_pool_id)
        except NotFoundError:
            raise NotFoundError(
                f"destination_pool_id: no pool {shown(request.destination_pool_id)}"
            ) from None
        source_pool = registry.get(record.pool_id)
        if destination.hashing != source_pool.hashing:
            raise FailedPreconditionError(
                f"destination_pool_id: pool {shown(destination.name)} hashes blocks differently "
                f"from pool {shown(source_pool.name)} (algorithm, seed or block size)"
            )
        source = self._source(record)
        if source is None:
            raise FailedPreconditionError(
                f"transfer_id: the source request of transfer {shown(record.transfer_id)} is "
                "no longer in its pool"
            )
        size = source_pool.hashing.hash_block_size
        hashes = source.block_hashes[: record.num_tokens // size]
        hit = 0
        if hashes and record.num_tokens > 1:
            query = LookupQuery(
                block_hashes=b"".join(hashes),
                num_tokens=record.num_tokens,
                pool_ids=(destination.name,),
            )
            try:
                answer = await lookup_as(registry, query, PRINCIPAL.get(), state=state)
            except LookupDeniedError as exc:
                raise AbortRpc(
                    grpc.StatusCode.PERMISSION_DENIED, f"destination_pool_id: {exc}"
                ) from None
            if not answer.pools:
                why = answer.skipped[0][1] if answer.skipped else "not answered"
                raise FailedPreconditionError(f"destination_pool_id: {why}")
            hit = answer.pools[0].num_hit_tokens
        resolved = pd_pb2.PlanTransferRequest()
        resolved.CopyFrom(request)
        resolved.hit_tokens = hit
        resolved.pull_tokens = record.num_tokens - hit
        return resolved

    def _source(self, record: TransferRecord) -> Any:
        """The managed source's request in its pool now (``None``: gone, holds nothing, or the
        pool was deleted or replaced since the hold)."""
        try:
            pool = self._state.registry.get(record.pool_id)
        except KVCMError:
            return None
        request = pool.requests.get(record.request_key)
        manager = pool.manager
        if (
            pool.epoch != record.pool_epoch
            or request is None
            or manager is None
            or request.request_id != record.request_id
            or not manager.holds_blocks(request.request_id)
        ):
            return None
        return request

    async def _journaled(
        self, method: str, request: Any, pool_id: str, *, answered: bool = True
    ) -> Change:
        """Write ``request`` ahead, then apply it in its turn (see the module docstring).

        ``answered``: a client's call, whose answer waits for a ``sync`` standby; else the
        server's own change (the lease monitor's), shipped without waiting.
        """
        when = CALL_TIME.get() or time.time()
        CALL_TIME.set(when)
        state = self._state
        journal = state.journal
        if answered and journal is not None and journal.admit is not None:
            journal.admit(method, pool_id)  # served elsewhere, or being promoted: refused
        if pool_id in state.standby_pools:  # its primary's shipped records change it
            raise AbortRpc(
                grpc.StatusCode.UNAVAILABLE,
                f"{method}: pool {shown(pool_id)} is a standby copy here: call its primary",
            )
        if journal is None:
            await state.pool(pool_id)  # wait for a lane; no await after it
            return self._apply(method, request)
        while journal.gate is not None:  # a checkpoint is being taken
            await journal.gate.wait()
        data = request.SerializeToString()
        try:
            ticket = journal.write_ahead(method, pool_id, data, when)
        except JournalUnavailableError as exc:
            raise AbortRpc(grpc.StatusCode.UNAVAILABLE, _unavailable(exc)) from None

        async def run() -> Change:
            replicated: Awaitable[None] | None = None
            try:
                try:
                    await journal.commit(ticket.seq)
                except JournalUnavailableError as exc:
                    raise AbortRpc(grpc.StatusCode.UNAVAILABLE, _unavailable(exc)) from None
                for earlier in ticket.waits:
                    await earlier
                while (busy := state.lanes.get(pool_id)) is not None:
                    await busy.wait()
                if ticket.void_reason is not None:
                    raise AbortRpc(grpc.StatusCode.UNAVAILABLE, ticket.void_reason)
                ticket.started = True
                try:
                    change = self._apply(method, request)
                except KVCMError:
                    journal.void(ticket)  # refused: it changed nothing
                    raise
                # No await since it ran (the pool's order): ship it to a standby.
                if answered and journal.on_call is not None:
                    replicated = journal.on_call(method, pool_id, data, when)
                elif journal.on_change is not None:
                    journal.on_change(method, pool_id, data, when)
            finally:
                journal.finish(ticket)
            if replicated is not None:  # a sync standby's acknowledgement
                await replicated
            return change

        # Once written, it runs even if its caller goes away (as the journal interceptor's).
        task = asyncio.ensure_future(run())
        task.add_done_callback(_retrieve)
        return await asyncio.shield(task)

    def _apply(self, method: str, request: Any) -> Change:
        """Apply one (resolved) call to the book and, giving a source back, to its pool."""
        state = self._state
        book = state.transfer_book
        now = state.clock.now()
        wall = CALL_TIME.get() or time.time()
        pool_id, transfer_id = request.pool_id, request.transfer_id
        if method == "HoldSource":
            change = book.hold(self._source_record(request), now, wall)
        elif method == "PlanTransfer":
            change = book.plan(
                pool_id,
                transfer_id,
                destination_pool_id=request.destination_pool_id,
                hit_tokens=request.hit_tokens,
                pull_tokens=request.pull_tokens,
                now=now,
            )
        elif method == "CommitTransfer":
            pulled = request.blocks_pulled if request.HasField("blocks_pulled") else None
            change = book.commit(pool_id, transfer_id, pulled, wall)
        elif method == "ReleaseTransfer":
            change = book.release(pool_id, transfer_id, request.reason, wall)
        else:
            change = book.expire(
                pool_id, transfer_id, request.reason, wall, source_freed=request.source_freed
            )
        if change.give_back:
            self._give_back(change.record)
        return change

    def _source_record(self, request: pd_pb2.HoldSourceRequest) -> TransferRecord:
        """The record a hold starts (a managed one read from its pool now)."""
        book = self._state.transfer_book
        pool = self._state.registry.get(request.pool_id)
        block_size = pool.hashing.hash_block_size
        if request.record_only:
            return _record(
                request,
                pool,
                request.request_id,
                request.num_tokens,
                _grouped(request.source_blocks),
            )
        existing = book.records.get((request.pool_id, request.transfer_id))
        if (
            existing is not None
            and not existing.record_only
            and existing.request_key == request.request_key
        ):
            return existing  # the same hold again: answered as it is now
        source = pool.requests.get(request.request_key)
        if source is None:
            raise NotFoundError(
                f"request_key: no request {request.request_key} in pool {shown(pool.name)}"
            )
        manager = pool.manager
        if manager is None or not manager.holds_blocks(source.request_id):
            raise FailedPreconditionError(
                f"request_key: request {request.request_key} holds no blocks to hold"
            )
        blocks = tuple(tuple(ids) for ids in manager.get_block_ids(source.request_id))
        # The tokens its blocks hold (the scheduler, not kvcm, keeps num_computed_tokens).
        num_tokens = min(len(source.all_token_ids), len(blocks[0]) * block_size)
        return _record(request, pool, source.request_id, num_tokens, blocks)

    def _give_back(self, record: TransferRecord) -> None:
        """Finish a managed source's request (unless it is gone already)."""
        if self._source(record) is None:
            return
        pool: Pool = self._state.registry.get(record.pool_id)
        pool.run_step(StepProgram(ops=[int(OpKind.FINISH)], request_keys=[record.request_key]))
        self._state.published(pool)


def _record(
    request: pd_pb2.HoldSourceRequest,
    pool: Pool,
    request_id: str,
    num_tokens: int,
    blocks: tuple[tuple[int, ...], ...],
) -> TransferRecord:
    return TransferRecord(
        pool_epoch=pool.epoch,
        pool_id=request.pool_id,
        transfer_id=request.transfer_id,
        record_only=request.record_only,
        request_key=request.request_key,
        request_id=request_id,
        num_tokens=num_tokens,
        source_blocks=blocks,
        lease_s=request.lease_s,
        block_size=pool.hashing.hash_block_size,
    )


def list_transfers(
    state: ServerState,
    pool_id: str,
    states: Iterable[TransferState] = (),
    principal: Principal | None = None,
) -> pd_pb2.ListTransfersResponse:
    """ListTransfers' answer (also ``GET /v1/transfers``): the transfers of ``pool_id`` (or of
    every pool ``principal`` may read; ``None``: authentication off).

    Raises:
        NotFoundError: ``pool_id`` names no pool (naming ``pool_id``).
        PermissionError: ``principal`` may not read ``pool_id``.
    """
    wanted = set(states)
    if pool_id and pool_id not in state.registry:
        raise NotFoundError(f"pool_id: no pool {shown(pool_id)}")
    if pool_id and not may_read(principal, pool_id):
        raise PermissionError(
            f"pool_id: principal {principal.name if principal else ''!r} may not read pool "
            f"{shown(pool_id)}"
        )
    now = state.clock.now()
    in_flight: list[TransferRecord] = []
    ended: list[TransferRecord] = []
    for record in state.transfer_book.records.values():
        if pool_id and record.pool_id != pool_id:
            continue
        if wanted and record.state not in wanted:
            continue
        if not pool_id and not may_read(principal, record.pool_id):
            continue
        (in_flight if record.in_flight else ended).append(record)
    ended.sort(key=lambda record: record.ended_at, reverse=True)
    return pd_pb2.ListTransfersResponse(
        transfers=[transfer_to_proto(record, now) for record in (*in_flight, *ended)]
    )


def _unavailable(exc: JournalUnavailableError) -> str:
    return f"{exc}: nothing was changed; retry once the data directory can be written"


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class TransferView:
    """What HTTP (``GET /v1/transfers``) and ``/metrics`` read of the transfer book."""

    def __init__(self, state: ServerState) -> None:
        """Read ``state``'s book."""
        self._state = state

    def listing(
        self, pool_id: str, states: Iterable[str], principal: Principal | None
    ) -> dict[str, Any]:
        """:func:`list_transfers` as ``ListTransfersResponse`` JSON; ``states`` by name.

        Raises:
            InvalidArgumentError: A state name is unknown (naming ``state``).
            NotFoundError, PermissionError: As :func:`list_transfers`.
        """
        wanted = []
        for name in states:
            if name.upper() not in TransferState.__members__:
                known = ", ".join(TransferState.__members__)
                raise InvalidArgumentError(f"state: {name!r} is not one of {known}")
            wanted.append(TransferState[name.upper()])
        return _json(list_transfers(self._state, pool_id, wanted, principal))

    def describe(self, pool_id: str, transfer_id: str) -> dict[str, Any]:
        """One transfer as ``Transfer`` JSON.

        Raises:
            NotFoundError: No such transfer.
        """
        record = self._state.transfer_book.get(pool_id, transfer_id)
        return _json(transfer_to_proto(record, self._state.clock.now()))

    def samples(self) -> dict[str, list[tuple[list[str], float]]]:
        """The ``kvcm_transfer*`` samples (``TransferBook.samples``)."""
        return self._state.transfer_book.samples(self._state.clock.now(), time.time())


def _json(message: Any) -> dict[str, Any]:
    document: dict[str, Any] = json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )
    return document
