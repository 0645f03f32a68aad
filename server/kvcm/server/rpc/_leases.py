"""Scheduler leases: reclaim what a scheduler that stopped calling left behind.

A pool created with ``scheduler_lease_s > 0`` expects its scheduler to call: every
SchedulerService call that may change the pool renews the lease (``KeepAlive`` when there is
nothing to send); pure reads (GetUsage, GetBlocks, GetBlockIds, GetNumCommonPrefixBlocks) do
not, so whoever polls a dead engine's pool does not keep it alive. :class:`LeaseMonitor`
checks the pools about four times per shortest lease (at most once a second); a pool whose
lease ran out and that still holds requests (or, with CLEAR, cached blocks) is reclaimed
once, by its ``lease_expiry`` policy:

* ``FREE_REQUESTS``: every request is finished (in key order), as if its scheduler had freed
  them; their blocks stay in the prefix cache;
* ``CLEAR``: the same, then the prefix cache is reset (AllBlocksCleared: routers drop the
  pool's blocks), for an engine that will come back empty.

Leases count the server's awake time, not wall time: a stall of the server itself (the
process paused or starved, the event loop blocked) is detected by the monitor's beat
(:class:`~kvcm.server.rpc._state.AwakeClock`, every 0.1 s) and moves every lease deadline
later by as much, so after a stall each holder still has its whole lease to call again.

A reclaim is an ordinary Step program run by the interpreter, published and journaled like
any Step (so a restart replays it), counted in ``kvcm_lease_reclaims_total{pool, kind}`` and
logged at INFO. A scheduler that calls again renews the lease; nothing else is touched.

The transfer lease (server setting ``transfer_lease_s``) covers P/D: a request allocated with
``delay_cache_blocks`` waits for a KV transfer to fill its blocks; if by the end of the lease
it was neither cached (CacheBlocks) nor freed, the transfer is taken as lost and the request
is finished, counted as ``kind="transfer"``. Transfer records (TransferService) past their own
lease are expired here too (``TransferServicer.expire_due``: journaled ``ExpireTransfer``
records; a managed source goes back to its pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Final

from kvcm.common.errors import KVCMError
from kvcm.core.pool import Pool
from kvcm.core.pool_types import LeaseExpiry, PoolState
from kvcm.core.program import OpKind, StepProgram
from kvcm.server.rpc._state import CALL_TIME, ServerState
from kvcm.server.rpc._transfers import TransferServicer
from kvcm.wire import program_to_proto

__all__ = ["SCHEDULER_LEASE", "TRANSFER_LEASE", "LeaseMonitor"]

_LOG = logging.getLogger("kvcm.server.leases")
SCHEDULER_LEASE: Final = "scheduler"
TRANSFER_LEASE: Final = "transfer"
_MAX_INTERVAL_S: Final = 1.0
_INLINE_RECLAIM_OPS: Final = 256


def _reclaim_program(pool: Pool) -> StepProgram | None:
    """FINISH every request (and RESET with CLEAR), or ``None`` when there is nothing."""
    clear = pool.options.lease_expiry is LeaseExpiry.CLEAR
    keys = sorted(pool.requests)
    manager = pool.manager
    cached = manager is not None and manager.block_pool.num_cached_blocks > 0
    if not keys and not (clear and cached):
        return None
    ops = [int(OpKind.FINISH)] * len(keys)
    if clear:
        ops.append(int(OpKind.RESET_PREFIX_CACHE))
    return StepProgram(ops=ops, request_keys=keys)


class LeaseMonitor:
    """Expires scheduler leases (see the module docstring).

    Attributes:
        state: The server's shared state.
    """

    def __init__(self, state: ServerState) -> None:
        """Watch ``state``'s pools (their lease times come from ``state.clock``)."""
        self.state = state
        self._reclaimed: set[tuple[str, int]] = set()  # (pool, epoch) reclaimed since activity
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Check periodically on the running loop."""
        self._task = asyncio.create_task(self._run(), name="kvcm-lease-monitor")

    async def stop(self) -> None:
        """Stop checking."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _interval(self) -> float:
        leases = [
            p.options.scheduler_lease_s
            for p in self.state.registry.list()
            if p.options.scheduler_lease_s > 0
        ]
        if self.state.transfer_lease_s:
            leases.append(self.state.transfer_lease_s)
        leases.extend(record.lease_s for record in self.state.transfer_book.in_flight())
        return min([_MAX_INTERVAL_S, *(lease / 4 for lease in leases)])

    async def _run(self) -> None:
        clock = self.state.clock
        next_check = clock.now() + self._interval()
        while True:
            # The beat: a gap in it is a stall of the server (see AwakeClock).
            await asyncio.sleep(clock.beat_s)
            now = clock.now()
            if now < next_check:
                continue
            try:
                await self.check()
            except Exception:  # a check must never stop the monitor
                _LOG.exception("lease check failed")
            next_check = clock.now() + self._interval()

    async def check(self) -> int:
        """Reclaim every pool whose lease expired; returns how many were reclaimed."""
        state = self.state
        now = state.clock.now()  # first: a stall just ended moves the deadlines
        reclaimed = 0
        for pool in state.registry.list():
            lease = pool.options.scheduler_lease_s
            if lease <= 0 or pool.state is not PoolState.READY or pool.lent:
                continue
            if pool.name in state.standby_pools:
                continue  # its primary reclaims, and ships the reclaim
            last = state.activity.setdefault(pool.name, now)
            mark = (pool.name, pool.epoch)
            if now - last <= lease:
                self._reclaimed.discard(mark)
                continue
            if mark in self._reclaimed:
                continue
            if await self._reclaim(pool, now - last):
                reclaimed += 1
            self._reclaimed.add(mark)
        reclaimed += await self._check_transfers(now)
        return reclaimed + await TransferServicer(state).expire_due()

    async def _check_transfers(self, now: float) -> int:
        """Free requests whose P/D transfer was neither cached nor freed within its lease."""
        state = self.state
        lease = state.transfer_lease_s
        reclaimed = 0
        for (pool_id, key), (started, request) in list(state.transfers.items()):
            if now - started <= lease:
                continue
            if pool_id in state.standby_pools:
                continue  # its primary reclaims, and ships the reclaim
            del state.transfers[(pool_id, key)]
            try:
                pool = state.registry.get(pool_id)
            except KVCMError:
                continue
            manager = pool.manager
            if manager is None or pool.lent or pool.requests.get(key) is not request:
                continue  # gone (freed, or the pool was replaced)
            rid = pool.requests[key].request_id
            groups = manager.coordinator.single_type_managers
            if not manager.holds_blocks(rid) or any(g.num_cached_block.get(rid, 0) for g in groups):
                continue  # freed or cached: the transfer completed
            program = StepProgram(ops=[int(OpKind.FINISH)], request_keys=[key])
            await self._apply(pool, program, TRANSFER_LEASE, now - started, cleared=False)
            reclaimed += 1
        return reclaimed

    async def _reclaim(self, pool: Pool, idle_s: float) -> bool:
        program = _reclaim_program(pool)
        if program is None:
            return False
        cleared = pool.options.lease_expiry is LeaseExpiry.CLEAR
        await self._apply(pool, program, SCHEDULER_LEASE, idle_s, cleared=cleared)
        return True

    async def _apply(
        self, pool: Pool, program: StepProgram, kind: str, idle_s: float, *, cleared: bool
    ) -> None:
        """Run a reclaim program as a Step: publish, journal, count, log."""
        state = self.state
        now = time.time()
        CALL_TIME.set(now)
        if len(program.ops) > _INLINE_RECLAIM_OPS:  # ~12 us per FINISH: off the loop
            await state.run_in_lane(pool, lambda: pool.run_step(program))
        else:
            pool.run_step(program)
        state.published(pool)
        if state.journal is not None:
            journal = state.journal
            data = program_to_proto(program, pool.name).SerializeToString()
            await journal.commit(journal.append("Step", pool.name, data, now))
        key = (pool.name, kind)
        state.reclaims[key] = state.reclaims.get(key, 0) + 1
        _LOG.info(
            f"{kind} lease expired: reclaimed",
            extra={
                "event": "lease_reclaimed",
                "pool": pool.name,
                "lease": kind,
                "idle_s": round(idle_s, 3),
                "requests": len(program.request_keys),
                "cleared": cleared,
            },
        )
