"""SchedulerService: Step and the unary KVCacheManager operations (codecs over the pool)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from kvcm.common.errors import FailedPreconditionError, KVCMError
from kvcm.common.hashing import get_block_hash
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS
from kvcm.core.pool import Pool
from kvcm.core.pool_types import FreeMode
from kvcm.core.program import HitSpec, StepOutcome, StepProgram
from kvcm.core.request import Request
from kvcm.server.rpc._resync import resync_pool
from kvcm.server.rpc._state import CALL_TIME, ServerState
from kvcm.server.rpc._status import StepRejectedError
from kvcm.v1 import common_pb2, scheduler_pb2, service_pb2_grpc
from kvcm.wire import (
    fill_grouped,
    free_mode_from_proto,
    grouped_from_proto,
    outcome_to_proto,
    prefix_cache_stats_to_proto,
    program_from_proto,
    slot_options_from_proto,
)

if TYPE_CHECKING:
    from kvcm.server.tracing import Tracing

__all__ = ["SchedulerServicer"]

# grpc ships no type information: its context is Any to mypy.
Context: TypeAlias = Any


# A Step estimated to cost more than this (decoding, running and encoding it) runs in a worker
# thread (see ServerState.lanes), so no Step holds the loop for long. The estimate reads only
# the message's lengths: decoding a 4,096-admission Step costs ~50 ms, so it must not happen on
# the loop either. The per-item costs were measured on a 2-core VM (docs/server.md,
# "Event-loop fairness"): a 256-request decode step (~1.3 ms) stays inline.
_INLINE_STEP_US: Final = 4000
_OP_US: Final = 2.5
_ALLOC_OPTIONS_US: Final = 25.0
_NEW_REQUEST_US: Final = 150.0
_TOKEN_US: Final = 0.4


def _estimated_cost_us(request: scheduler_pb2.StepRequest) -> float:
    """A cheap upper estimate of a Step's cost (decode, run, encode), in microseconds.

    Read from the still-encoded message's repeated-field lengths (constant time each); the
    prompts are summed only when there are few admissions (a long prompt alone can be costly).
    """
    cost = (
        len(request.ops) * _OP_US
        + len(request.alloc_options) * _ALLOC_OPTIONS_US
        + len(request.append_token_ids) * _TOKEN_US
    )
    num_new = len(request.new_requests)
    if num_new:
        cost += num_new * _NEW_REQUEST_US
        if cost <= _INLINE_STEP_US:  # at most ~26 admissions to sum
            cost += sum(len(new.prompt_token_ids) for new in request.new_requests) * _TOKEN_US
    return cost


@dataclass(frozen=True, slots=True)
class _Answer:
    """A Step's program, outcome and response, and whether it published a batch of events."""

    program: StepProgram
    outcome: StepOutcome
    response: scheduler_pb2.StepResponse
    published: bool


def _answer_step(
    pool: Pool, request: scheduler_pb2.StepRequest, tracing: Tracing | None
) -> _Answer:
    """Decode, run, publish the events of and encode one Step (on the loop, or in the pool's
    lane: all but waking the subscribers, which the loop does after).

    Raises:
        KVCMError: The message does not decode (as is: it names its field).
        StepRejectedError: The program was rejected; nothing changed.
    """
    phase = None
    if tracing is None:
        program = program_from_proto(request)
    else:
        with tracing.span("kvcm.step.decode", **{"kvcm.step.num_ops": len(request.ops)}):
            program = program_from_proto(request)
        phase = tracing.phase_hook()
    try:
        outcome = pool.run_step(program, phase=phase)
    except KVCMError as exc:
        raise StepRejectedError(exc, exc.op_index, exc.field or "") from exc
    published = pool.publish_events(CALL_TIME.get() or time.time()) > 0
    if tracing is None:
        return _Answer(program, outcome, outcome_to_proto(outcome), published)
    with tracing.span("kvcm.step.encode"):
        return _Answer(program, outcome, outcome_to_proto(outcome), published)


def _check_ready_request(pool: Pool, key: int) -> Request:
    pool.ready_manager()
    return pool.request(key)


class SchedulerServicer(service_pb2_grpc.SchedulerServiceServicer):
    """Step and one unary RPC per KVCacheManager operation."""

    def __init__(self, state: ServerState) -> None:
        """Serve ``state``'s registry."""
        self._state = state

    async def ResyncPool(  # noqa: N802
        self, request_iterator: Any, context: Context
    ) -> scheduler_pb2.ResyncPoolResponse:
        """Replace a pool's state with an uploaded snapshot (see scheduler.proto)."""
        return await resync_pool(self._state, request_iterator)

    async def KeepAlive(  # noqa: N802
        self, request: scheduler_pb2.KeepAliveRequest, context: Context
    ) -> scheduler_pb2.KeepAliveResponse:
        """Renew the pool's scheduler lease."""
        pool = await self._state.scheduler_pool(request.pool_id)
        return scheduler_pb2.KeepAliveResponse(scheduler_lease_s=pool.options.scheduler_lease_s)

    async def Step(  # noqa: N802
        self, request: scheduler_pb2.StepRequest, context: Context
    ) -> scheduler_pb2.StepResponse:
        """A whole scheduler step (see scheduler.proto)."""
        state = self._state
        pool = await state.scheduler_pool(request.pool_id)
        tracing = state.tracing
        try:
            if _estimated_cost_us(request) <= _INLINE_STEP_US:
                answer = _answer_step(pool, request, tracing)
            else:
                answer = await state.run_in_lane(pool, lambda: _answer_step(pool, request, tracing))
        except BaseException:
            state.published(pool)  # a rejected Step changed nothing; published for safety
            raise
        if answer.published:
            state.announce(pool)
        program = answer.program
        state.progress.note_step(
            pool.name, program.step_seq, program.scheduler_step_seq, program.step_age_s
        )
        if state.transfer_lease_s and answer.outcome.delayed_keys:
            state.track_transfers(pool, answer.outcome.delayed_keys)
        return answer.response

    async def AddRequest(  # noqa: N802
        self, request: scheduler_pb2.AddRequestRequest, context: Context
    ) -> scheduler_pb2.AddRequestResponse:
        """Start tracking a request."""
        pool = await self._state.scheduler_pool(request.pool_id)
        new = request.request
        pool.add_request(
            new.request_key,
            new.request_id,
            new.prompt_token_ids,
            new.block_hashes,
            lora_id=new.lora_id if new.HasField("lora_id") else None,
            lora_name=new.lora_name if new.HasField("lora_name") else None,
            cache_salt=new.cache_salt if new.HasField("cache_salt") else None,
            skip_reading_prefix_cache=new.skip_reading_prefix_cache,
            report_cached_blocks=new.report_cached_blocks,
        )
        return scheduler_pb2.AddRequestResponse()

    async def AppendTokens(  # noqa: N802
        self, request: scheduler_pb2.AppendTokensRequest, context: Context
    ) -> scheduler_pb2.AppendTokensResponse:
        """Append produced tokens and their block hashes."""
        pool = await self._state.scheduler_pool(request.pool_id)
        pool.append_tokens(request.request_key, request.token_ids, request.block_hashes)
        return scheduler_pb2.AppendTokensResponse()

    async def Free(  # noqa: N802
        self, request: scheduler_pb2.FreeRequest, context: Context
    ) -> scheduler_pb2.FreeResponse:
        """Finish or preempt a request."""
        pool = await self._state.scheduler_pool(request.pool_id)
        mode = free_mode_from_proto(request.mode)
        pool.free(request.request_key, preempt=mode is FreeMode.PREEMPTED)
        self._state.published(pool)
        return scheduler_pb2.FreeResponse()

    async def GetComputedBlocks(  # noqa: N802
        self, request: scheduler_pb2.GetComputedBlocksRequest, context: Context
    ) -> scheduler_pb2.GetComputedBlocksResponse:
        """The request's longest prefix-cache hit (counted in the hit statistics)."""
        pool = await self._state.scheduler_pool(request.pool_id)
        lookup = request.lookup
        bound = lookup.max_cache_hit_length if lookup.HasField("max_cache_hit_length") else None
        hit = pool.get_computed_blocks(request.request_key, bound)
        # A request with report_cached_blocks reports its hit as BlockStored events.
        self._state.published(pool)
        response = scheduler_pb2.GetComputedBlocksResponse(
            num_computed_tokens=hit.num_computed_tokens
        )
        fill_grouped(hit.blocks.get_block_ids(), response.blocks)
        return response

    async def AllocateSlots(  # noqa: N802
        self, request: scheduler_pb2.AllocateSlotsRequest, context: Context
    ) -> scheduler_pb2.AllocateSlotsResponse:
        """allocate_slots; "does not fit" is a status, not an error."""
        pool = await self._state.scheduler_pool(request.pool_id)
        hit = None
        if request.HasField("new_computed"):
            wire = request.new_computed
            hit = HitSpec(
                num_tokens=wire.num_new_computed_tokens,
                block_ids=grouped_from_proto(wire.blocks, "new_computed.blocks"),
                shared_prefix_boundary=(
                    wire.shared_prefix_boundary if wire.HasField("shared_prefix_boundary") else None
                ),
            )
        options, in_flight = (
            slot_options_from_proto(request.options)
            if request.HasField("options")
            else (DEFAULT_SLOT_OPTIONS, 0)
        )
        try:
            ids = pool.allocate(
                request.request_key,
                request.num_new_tokens,
                request.num_computed_tokens,
                hit=hit,
                options=options,
                num_in_flight_tokens=in_flight,
            )
        except KVCMError as exc:
            if hit is not None and exc.path is not None and "hit" in exc.path[1:]:
                raise type(exc)(f"new_computed: {exc}", field="new_computed") from None
            raise
        self._state.published(pool)
        if ids is not None and options.delay_cache_blocks and self._state.transfer_lease_s:
            self._state.track_transfers(pool, [request.request_key])
        response = scheduler_pb2.AllocateSlotsResponse()
        if ids is None:
            response.status = common_pb2.ITEM_STATUS_DOES_NOT_FIT
            return response
        response.status = common_pb2.ITEM_STATUS_OK
        fill_grouped(ids, response.new_blocks)
        return response

    async def CacheBlocks(  # noqa: N802
        self, request: scheduler_pb2.CacheBlocksRequest, context: Context
    ) -> scheduler_pb2.CacheBlocksResponse:
        """cache_blocks."""
        pool = await self._state.scheduler_pool(request.pool_id)
        pool.cache_blocks(request.request_key, request.num_computed_tokens)
        self._state.published(pool)
        return scheduler_pb2.CacheBlocksResponse()

    async def RemoveSkippedBlocks(  # noqa: N802
        self, request: scheduler_pb2.RemoveSkippedBlocksRequest, context: Context
    ) -> scheduler_pb2.RemoveSkippedBlocksResponse:
        """remove_skipped_blocks."""
        pool = await self._state.scheduler_pool(request.pool_id)
        pool.remove_skipped_blocks(request.request_key, request.total_computed_tokens)
        self._state.published(pool)
        return scheduler_pb2.RemoveSkippedBlocksResponse()

    async def EvictBlocks(  # noqa: N802
        self, request: scheduler_pb2.EvictBlocksRequest, context: Context
    ) -> scheduler_pb2.EvictBlocksResponse:
        """evict_blocks."""
        pool = await self._state.scheduler_pool(request.pool_id)
        pool.evict_blocks(request.block_ids)
        self._state.published(pool)
        return scheduler_pb2.EvictBlocksResponse()

    async def ResetPrefixCache(  # noqa: N802
        self, request: scheduler_pb2.ResetPrefixCacheRequest, context: Context
    ) -> scheduler_pb2.ResetPrefixCacheResponse:
        """reset_prefix_cache."""
        pool = await self._state.scheduler_pool(request.pool_id)
        reset = pool.reset_prefix_cache()
        self._state.published(pool)
        return scheduler_pb2.ResetPrefixCacheResponse(reset=reset)

    async def GetBlocks(  # noqa: N802
        self, request: scheduler_pb2.GetBlocksRequest, context: Context
    ) -> scheduler_pb2.GetBlocksResponse:
        """get_blocks with each block's reference count and cache state."""
        pool = await self._state.pool(request.pool_id)
        target = _check_ready_request(pool, request.request_key)
        blocks = pool.ready_manager().get_blocks(target.request_id)
        response = scheduler_pb2.GetBlocksResponse()
        hashes = []
        for group in blocks.blocks:
            response.blocks.num_block_ids.append(len(group))
            for block in group:
                response.blocks.block_ids.append(block.block_id)
                response.ref_cnts.append(block.ref_cnt)
                cached = block.block_hash is not None
                response.is_cached.append(cached)
                if block.block_hash is not None:
                    hashes.append(get_block_hash(block.block_hash))
        response.block_hashes = b"".join(hashes)
        return response

    async def GetBlockIds(  # noqa: N802
        self, request: scheduler_pb2.GetBlockIdsRequest, context: Context
    ) -> scheduler_pb2.GetBlockIdsResponse:
        """get_block_ids."""
        pool = await self._state.pool(request.pool_id)
        target = _check_ready_request(pool, request.request_key)
        response = scheduler_pb2.GetBlockIdsResponse()
        fill_grouped(pool.ready_manager().get_block_ids(target.request_id), response.blocks)
        return response

    async def GetNumCommonPrefixBlocks(  # noqa: N802
        self, request: scheduler_pb2.GetNumCommonPrefixBlocksRequest, context: Context
    ) -> scheduler_pb2.GetNumCommonPrefixBlocksResponse:
        """get_num_common_prefix_blocks of a running request."""
        pool = await self._state.pool(request.pool_id)
        target = _check_ready_request(pool, request.running_request_key)
        manager = pool.ready_manager()
        if not manager.holds_blocks(target.request_id):
            raise FailedPreconditionError(
                f"request key {request.running_request_key} is not running (holds no blocks)"
            )
        counts = manager.get_num_common_prefix_blocks(target.request_id)
        return scheduler_pb2.GetNumCommonPrefixBlocksResponse(num_common_prefix_blocks=counts)

    async def TakeNewBlockIds(  # noqa: N802
        self, request: scheduler_pb2.TakeNewBlockIdsRequest, context: Context
    ) -> scheduler_pb2.TakeNewBlockIdsResponse:
        """take_new_block_ids (drains)."""
        pool = await self._state.scheduler_pool(request.pool_id)
        ids = pool.ready_manager().take_new_block_ids()
        return scheduler_pb2.TakeNewBlockIdsResponse(block_ids=ids)

    async def NewStepStarts(  # noqa: N802
        self, request: scheduler_pb2.NewStepStartsRequest, context: Context
    ) -> scheduler_pb2.NewStepStartsResponse:
        """new_step_starts."""
        pool = await self._state.scheduler_pool(request.pool_id)
        pool.ready_manager().new_step_starts()
        return scheduler_pb2.NewStepStartsResponse()

    async def GetUsage(  # noqa: N802
        self, request: scheduler_pb2.GetUsageRequest, context: Context
    ) -> scheduler_pb2.GetUsageResponse:
        """Usage and block counts."""
        pool = await self._state.pool(request.pool_id)
        manager = pool.ready_manager()
        return scheduler_pb2.GetUsageResponse(
            usage=manager.usage,
            num_free_blocks=manager.num_free_blocks,
            num_blocks=manager.block_pool.num_gpu_blocks,
            num_requests=len(pool.requests),
        )

    async def TakePrefixCacheStats(  # noqa: N802
        self, request: scheduler_pb2.TakePrefixCacheStatsRequest, context: Context
    ) -> scheduler_pb2.TakePrefixCacheStatsResponse:
        """make_prefix_cache_stats (drains)."""
        pool = await self._state.scheduler_pool(request.pool_id)
        stats = pool.take_prefix_cache_stats()
        response = scheduler_pb2.TakePrefixCacheStatsResponse()
        if stats is not None:
            prefix_cache_stats_to_proto(stats, response.stats)
        return response
