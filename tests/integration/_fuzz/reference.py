"""The in-process reference: what the core answers for a call the server accepted.

The server's SchedulerService is a codec: it decodes a request with :mod:`kvcm.wire`, makes
one ``Pool`` call and encodes the result. ``Reference.answer`` decodes the same request the
same way, makes the same ``Pool`` call on a copy of an in-process pool (Step through
``Pool.run_step(program_from_proto(...))``) and encodes the answer the server should have sent.
No semantics are re-implemented here: every decision (validation, hits, block ids, the Step
replay) is the core's. A call the core refuses raises :class:`RefusedError`; the copy is then
dropped, so the reference stays in the state the accepted calls left.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from kvcm.common.errors import FailedPreconditionError, KVCMError
from kvcm.common.hashing import get_block_hash
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS
from kvcm.core.pool import Pool
from kvcm.core.pool_types import FreeMode
from kvcm.core.program import HitSpec
from kvcm.v1 import common_pb2, scheduler_pb2
from kvcm.wire import (
    fill_grouped,
    free_mode_from_proto,
    grouped_from_proto,
    outcome_to_proto,
    program_from_proto,
    slot_options_from_proto,
)

__all__ = ["REFERENCE_METHODS", "Reference", "RefusedError"]


class RefusedError(Exception):
    """The core refuses the call (the in-process pool raised)."""


class Reference:
    """An in-process pool answering the accepted calls (see the module docstring).

    Attributes:
        pool: The reference pool, in the state the accepted calls left.
    """

    def __init__(self, pool: Pool) -> None:
        """Follow ``pool`` (a fresh pool with the served pool's configuration)."""
        self.pool = pool

    def answer(self, method: str, request: Message) -> Message:
        """What the core answers for ``request`` (a ``SchedulerService`` call).

        Raises:
            RefusedError: The core refuses the call; the reference did not change.
        """
        trial = copy.deepcopy(self.pool)
        handler: Callable[[Pool, Any], Message] = getattr(self, f"_{method}")
        try:
            response = handler(trial, request)
        except KVCMError as exc:
            raise RefusedError(f"{type(exc).__name__}: {exc}") from exc
        trial.publish_events(0.0)
        self.pool = trial
        return response

    # ------------------------------------------------------------------------ the program
    def _Step(self, pool: Pool, r: Any) -> Message:
        return outcome_to_proto(pool.run_step(program_from_proto(r)))

    # ------------------------------------------------------------------------ lifecycle
    def _AddRequest(self, pool: Pool, r: Any) -> Message:
        new = r.request
        pool.add_request(
            new.request_key,
            new.request_id,
            new.prompt_token_ids,
            new.block_hashes,
            lora_id=new.lora_id if new.HasField("lora_id") else None,
            lora_name=new.lora_name if new.HasField("lora_name") else None,
            cache_salt=new.cache_salt if new.HasField("cache_salt") else None,
            skip_reading_prefix_cache=new.skip_reading_prefix_cache,
        )
        return scheduler_pb2.AddRequestResponse()

    def _AppendTokens(self, pool: Pool, r: Any) -> Message:
        pool.append_tokens(r.request_key, r.token_ids, r.block_hashes)
        return scheduler_pb2.AppendTokensResponse()

    def _Free(self, pool: Pool, r: Any) -> Message:
        mode = free_mode_from_proto(r.mode)
        pool.free(r.request_key, preempt=mode is FreeMode.PREEMPTED)
        return scheduler_pb2.FreeResponse()

    # ----------------------------------------------------------------------- operations
    def _GetComputedBlocks(self, pool: Pool, r: Any) -> Message:
        bound = r.lookup.max_cache_hit_length if r.lookup.HasField("max_cache_hit_length") else None
        hit = pool.get_computed_blocks(r.request_key, bound)
        response = scheduler_pb2.GetComputedBlocksResponse(
            num_computed_tokens=hit.num_computed_tokens
        )
        fill_grouped(hit.blocks.get_block_ids(), response.blocks)
        return response

    def _AllocateSlots(self, pool: Pool, r: Any) -> Message:
        hit = None
        if r.HasField("new_computed"):
            hit = HitSpec(
                num_tokens=r.new_computed.num_new_computed_tokens,
                block_ids=grouped_from_proto(r.new_computed.blocks, "new_computed.blocks"),
            )
        options, in_flight = (
            slot_options_from_proto(r.options)
            if r.HasField("options")
            else (DEFAULT_SLOT_OPTIONS, 0)
        )
        ids = pool.allocate(
            r.request_key,
            r.num_new_tokens,
            r.num_computed_tokens,
            hit=hit,
            options=options,
            num_in_flight_tokens=in_flight,
        )
        response = scheduler_pb2.AllocateSlotsResponse()
        if ids is None:
            response.status = common_pb2.ITEM_STATUS_DOES_NOT_FIT
        else:
            response.status = common_pb2.ITEM_STATUS_OK
            fill_grouped(ids, response.new_blocks)
        return response

    def _CacheBlocks(self, pool: Pool, r: Any) -> Message:
        pool.cache_blocks(r.request_key, r.num_computed_tokens)
        return scheduler_pb2.CacheBlocksResponse()

    def _RemoveSkippedBlocks(self, pool: Pool, r: Any) -> Message:
        pool.remove_skipped_blocks(r.request_key, r.total_computed_tokens)
        return scheduler_pb2.RemoveSkippedBlocksResponse()

    def _EvictBlocks(self, pool: Pool, r: Any) -> Message:
        pool.evict_blocks(r.block_ids)
        return scheduler_pb2.EvictBlocksResponse()

    def _ResetPrefixCache(self, pool: Pool, r: Any) -> Message:
        return scheduler_pb2.ResetPrefixCacheResponse(reset=pool.reset_prefix_cache())

    # -------------------------------------------------------------------------- queries
    def _GetBlocks(self, pool: Pool, r: Any) -> Message:
        manager = pool.ready_manager()
        request = pool.request(r.request_key)
        response = scheduler_pb2.GetBlocksResponse()
        hashes = []
        for group in manager.get_blocks(request.request_id).blocks:
            response.blocks.num_block_ids.append(len(group))
            for block in group:
                response.blocks.block_ids.append(block.block_id)
                response.ref_cnts.append(block.ref_cnt)
                response.is_cached.append(block.block_hash is not None)
                if block.block_hash is not None:
                    hashes.append(get_block_hash(block.block_hash))
        response.block_hashes = b"".join(hashes)
        return response

    def _GetBlockIds(self, pool: Pool, r: Any) -> Message:
        manager = pool.ready_manager()
        request = pool.request(r.request_key)
        response = scheduler_pb2.GetBlockIdsResponse()
        fill_grouped(manager.get_block_ids(request.request_id), response.blocks)
        return response

    def _GetNumCommonPrefixBlocks(self, pool: Pool, r: Any) -> Message:
        manager = pool.ready_manager()
        request = pool.request(r.running_request_key)
        if not manager.holds_blocks(request.request_id):
            raise FailedPreconditionError("not running")
        counts = manager.get_num_common_prefix_blocks(request.request_id)
        return scheduler_pb2.GetNumCommonPrefixBlocksResponse(num_common_prefix_blocks=counts)

    def _TakeNewBlockIds(self, pool: Pool, r: Any) -> Message:
        ids = pool.ready_manager().take_new_block_ids()
        return scheduler_pb2.TakeNewBlockIdsResponse(block_ids=ids)

    def _NewStepStarts(self, pool: Pool, r: Any) -> Message:
        pool.ready_manager().new_step_starts()
        return scheduler_pb2.NewStepStartsResponse()

    def _GetUsage(self, pool: Pool, r: Any) -> Message:
        manager = pool.ready_manager()
        return scheduler_pb2.GetUsageResponse(
            usage=manager.usage,
            num_free_blocks=manager.num_free_blocks,
            num_blocks=manager.block_pool.num_gpu_blocks,
            num_requests=len(pool.requests),
        )

    def _TakePrefixCacheStats(self, pool: Pool, r: Any) -> Message:
        stats = pool.take_prefix_cache_stats()
        response = scheduler_pb2.TakePrefixCacheStatsResponse()
        if stats is not None:
            wire = response.stats
            wire.reset = stats.reset
            wire.num_requests = stats.requests
            wire.num_query_tokens = stats.queries
            wire.num_hit_tokens = stats.hits
            wire.num_preempted_requests = stats.preempted_requests
            wire.num_preempted_query_tokens = stats.preempted_queries
            wire.num_preempted_hit_tokens = stats.preempted_hits
        return response


REFERENCE_METHODS = frozenset(
    name[1:] for name in vars(Reference) if name.startswith("_") and name[1].isupper()
)
