"""The in-process reference: the core's ``Pool`` driven by the calls the server accepted.

``Reference.answer`` reads one accepted wire call the way scheduler.proto documents it (a Step
as the equivalent unary calls, run in order, validated whole), runs it on a copy of an
in-process ``Pool`` and answers the response message the server should have sent. A call the
reference refuses raises :class:`RefusedError`; the copy is then dropped, so the reference stays
in the state the accepted calls left.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from google.protobuf.message import Message

from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError, KVCMError
from kvcm.common.hashing import make_block_hash_with_group_id
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS, CacheHit, KVCacheManager, SlotOptions
from kvcm.core.pool import Pool
from kvcm.core.request import Request
from kvcm.v1 import common_pb2, scheduler_pb2

__all__ = ["REFERENCE_METHODS", "Reference", "RefusedError"]

_OK = common_pb2.ITEM_STATUS_OK
_DOES_NOT_FIT = common_pb2.ITEM_STATUS_DOES_NOT_FIT
_NO_TOKEN_BUDGET = common_pb2.ITEM_STATUS_NO_TOKEN_BUDGET
_KEYED_OPS = frozenset(range(2, 8))
_OP_NAMES = scheduler_pb2.StepOpKind


class RefusedError(Exception):
    """The reference refuses the call (the core raised, or the wire contract forbids it)."""


def _grouped(block_ids: Sequence[Sequence[int]], message: common_pb2.GroupedBlockIds) -> None:
    for group in block_ids:
        message.block_ids.extend(group)
        message.num_block_ids.append(len(group))


def _slot_options(wire: scheduler_pb2.SlotOptions, default_lookahead: int) -> SlotOptions:
    return SlotOptions(
        num_lookahead_tokens=(
            wire.num_lookahead_tokens
            if wire.HasField("num_lookahead_tokens")
            else default_lookahead
        ),
        num_external_computed_tokens=wire.num_external_computed_tokens,
        delay_cache_blocks=wire.delay_cache_blocks,
        num_encoder_tokens=wire.num_encoder_tokens,
        full_sequence_must_fit=wire.full_sequence_must_fit,
        reserved_blocks=wire.reserved_blocks,
        has_scheduled_reqs=wire.has_scheduled_reqs if wire.HasField("has_scheduled_reqs") else True,
    )


def _manager(pool: Pool) -> KVCacheManager:
    return pool.ready_manager()


def _add(pool: Pool, new: scheduler_pb2.NewRequest) -> None:
    pool.add_request(
        new.request_key,
        new.request_id,
        list(new.prompt_token_ids),
        new.block_hashes,
        lora_id=new.lora_id if new.HasField("lora_id") else None,
        lora_name=new.lora_name if new.HasField("lora_name") else None,
        cache_salt=new.cache_salt if new.HasField("cache_salt") else None,
        skip_reading_prefix_cache=new.skip_reading_prefix_cache,
    )


def _tokens_at_most(request: Request, field: str, value: int) -> None:
    if value > request.num_tokens:
        raise InvalidArgumentError(f"{field}={value} exceeds the request's {request.num_tokens}")


def _hit_from_wire(pool: Pool, request: Request, wire: scheduler_pb2.ComputedBlocks) -> CacheHit:
    """The documented checks of a handed-back hit: every block holds the request's hash."""
    manager = _manager(pool)
    counts = list(wire.blocks.num_block_ids)
    ids = list(wire.blocks.block_ids)
    if sum(counts) != len(ids) or len(counts) != manager.num_kv_cache_groups:
        raise InvalidArgumentError("new_computed.blocks: malformed")
    groups, pos = [], 0
    assert pool.kv_cache_config is not None
    for group_id, count in enumerate(counts):
        group = ids[pos : pos + count]
        pos += count
        spec = pool.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
        if count * spec.block_size != wire.num_new_computed_tokens:
            raise InvalidArgumentError("new_computed: tokens and blocks disagree")
        for position, block_id in enumerate(group):
            if not 0 < block_id < len(manager.block_pool.blocks):
                raise InvalidArgumentError(f"new_computed: block {block_id} outside the pool")
            if position >= len(request.block_hashes):
                raise InvalidArgumentError("new_computed: beyond the request's hashes")
            want = make_block_hash_with_group_id(request.block_hashes[position], group_id)
            if manager.block_pool.blocks[block_id].block_hash != want:
                raise InvalidArgumentError(f"new_computed: block {block_id} is not the hit")
        groups.append(group)
    return pool.hit_from_ids(groups, wire.num_new_computed_tokens)


class _Step:
    """One Step program run on a (copied) pool, column cursors included."""

    def __init__(self, pool: Pool, message: scheduler_pb2.StepRequest) -> None:
        self.pool = pool
        self.message = message
        self.response = scheduler_pb2.StepResponse()
        self.k = self.n_add = self.n_append = self.n_alloc = self.n_cache = self.n_skip = 0
        self.token_cursor = self.hash_cursor = 0
        self.budget = message.token_budget if message.HasField("token_budget") else None
        self.options = {entry.alloc_index: entry for entry in message.alloc_options}

    def check_columns(self) -> None:
        """Every column is consumed exactly; op kinds are known; alloc_options ordered."""
        m = self.message
        ops = list(m.ops)
        unknown = [op for op in ops if not 1 <= op <= 8]
        if unknown:
            raise InvalidArgumentError(f"unknown op kinds {unknown}")
        count = {kind: ops.count(kind) for kind in range(1, 9)}
        hash_length = self.pool.hashing.hash_length_bytes
        expect = {
            "request_keys": (len(m.request_keys), sum(1 for op in ops if op in _KEYED_OPS)),
            "alloc_num_new_tokens": (len(m.alloc_num_new_tokens), count[3]),
            "alloc_num_computed_tokens": (len(m.alloc_num_computed_tokens), count[3]),
            "append_num_tokens": (len(m.append_num_tokens), count[2]),
            "append_num_block_hashes": (len(m.append_num_block_hashes), count[2]),
            "append_token_ids": (len(m.append_token_ids), sum(m.append_num_tokens)),
            "append_block_hashes": (
                len(m.append_block_hashes),
                sum(m.append_num_block_hashes) * hash_length,
            ),
            "cache_num_computed_tokens": (len(m.cache_num_computed_tokens), count[4]),
            "remove_skipped_total_computed_tokens": (
                len(m.remove_skipped_total_computed_tokens),
                count[5],
            ),
            "new_requests": (len(m.new_requests), count[1]),
        }
        for field, (got, want) in expect.items():
            if got != want:
                raise InvalidArgumentError(f"{field} has {got} entries, the ops need {want}")
        indexes = [entry.alloc_index for entry in m.alloc_options]
        if indexes != sorted(set(indexes)) or any(i >= count[3] for i in indexes):
            raise InvalidArgumentError(f"alloc_options indexes {indexes}")

    def run(self, ops: Sequence[int], *, stop: bool) -> int:
        """Run ``ops``; returns how many ran (stops after a refused allocation when ``stop``)."""
        for ran, op in enumerate(ops, start=1):
            if op == 3 and not self.allocate() and stop:
                return ran
            if op != 3:
                self.cold(op)
        return len(ops)

    def key(self) -> int:
        key = self.message.request_keys[self.k]
        self.k += 1
        return key

    def cold(self, op: int) -> None:
        pool, m = self.pool, self.message
        if op == 1:
            _add(pool, m.new_requests[self.n_add])
            self.n_add += 1
        elif op == 2:
            key = self.key()
            num_tokens = m.append_num_tokens[self.n_append]
            num_hashes = m.append_num_block_hashes[self.n_append]
            self.n_append += 1
            tokens = m.append_token_ids[self.token_cursor : self.token_cursor + num_tokens]
            self.token_cursor += num_tokens
            size = num_hashes * pool.hashing.hash_length_bytes
            raw = m.append_block_hashes[self.hash_cursor : self.hash_cursor + size]
            self.hash_cursor += size
            pool.append_tokens(key, list(tokens), raw)
        elif op == 4:
            request = pool.request(self.key())
            value = m.cache_num_computed_tokens[self.n_cache]
            self.n_cache += 1
            _tokens_at_most(request, "cache_num_computed_tokens", value)
            _manager(pool).cache_blocks(request, value)
        elif op == 5:
            request = pool.request(self.key())
            value = m.remove_skipped_total_computed_tokens[self.n_skip]
            self.n_skip += 1
            _tokens_at_most(request, "remove_skipped_total_computed_tokens", value)
            _manager(pool).remove_skipped_blocks(request.request_id, value)
        elif op in (6, 7):
            pool.free(self.key(), preempt=op == 6)
        else:
            _manager(pool).new_step_starts()

    def allocate(self) -> bool:
        """One ALLOCATE; whether it was OK."""
        pool, m = self.pool, self.message
        manager = _manager(pool)
        key = self.key()
        request = pool.request(key)
        index = self.n_alloc
        num_new, computed = m.alloc_num_new_tokens[index], m.alloc_num_computed_tokens[index]
        self.n_alloc += 1
        pool.check_allocation(key, num_new, computed)
        entry = self.options.get(index)
        lookahead = m.default_num_lookahead_tokens
        options = (
            _slot_options(entry.options, lookahead)
            if entry is not None
            else replace(DEFAULT_SLOT_OPTIONS, num_lookahead_tokens=lookahead)
        )
        request.num_computed_tokens = computed
        request.num_in_flight_tokens = (
            entry.options.num_in_flight_tokens if entry is not None else 0
        )
        lookup = entry is not None and entry.HasField("lookup")
        hit = None
        if lookup:
            assert entry is not None
            if computed or manager.holds_blocks(request.request_id):
                raise InvalidArgumentError("lookup is for a waiting request")
            bound = entry.lookup.max_cache_hit_length
            hit = manager.get_computed_blocks(
                request, bound if entry.lookup.HasField("max_cache_hit_length") else None
            )
            left = request.num_tokens - computed - hit.num_computed_tokens
            num_new = min(num_new, left - options.num_external_computed_tokens)
            if self.budget is not None:
                num_new = min(num_new, self.budget)
            if num_new <= 0:
                return self.answer(_NO_TOKEN_BUDGET, None, hit.num_computed_tokens, 0)
        blocks = pool.allocate_slots(request, num_new, hit, options)
        if blocks is None:
            looked = hit.num_computed_tokens if hit is not None else None
            return self.answer(_DOES_NOT_FIT, None, looked, 0)
        if hit is not None:
            manager.record_prefix_cache_stats(request, hit.num_computed_tokens)
            ids = manager.get_block_ids(request.request_id)
            self.answer(_OK, ids, hit.num_computed_tokens, num_new)
        else:
            self.answer(_OK, blocks.get_block_ids(), None, 0)
        if self.budget is not None:
            self.budget = max(0, self.budget - num_new)
        return True

    def answer(
        self, status: int, ids: Sequence[Sequence[int]] | None, looked: int | None, num_new: int
    ) -> bool:
        response = self.response
        response.alloc_statuses.append(status)
        groups = _manager(self.pool).num_kv_cache_groups
        for group in ids if ids is not None else [[]] * groups:
            response.alloc_num_block_ids.append(len(group))
            response.alloc_block_ids.extend(group)
        if looked is not None:
            response.lookup_num_computed_tokens.append(looked)
            response.lookup_num_new_tokens.append(num_new)
        return status == _OK


class Reference:
    """An in-process pool answering the accepted calls (see the module docstring).

    Attributes:
        pool: The reference pool, in the state the accepted calls left.
    """

    def __init__(self, pool: Pool) -> None:
        """Follow ``pool`` (a fresh copy of the served pool's configuration)."""
        self.pool = pool
        self._step_answer: scheduler_pb2.StepResponse | None = None

    def answer(self, method: str, request: Message) -> Message:
        """What the core answers for ``request`` (a ``SchedulerService`` call).

        Raises:
            RefusedError: The reference refuses the call; its state did not change.
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

    # ------------------------------------------------------------------------ lifecycle
    def _AddRequest(self, pool: Pool, r: Any) -> Message:
        _add(pool, r.request)
        return scheduler_pb2.AddRequestResponse()

    def _AppendTokens(self, pool: Pool, r: Any) -> Message:
        pool.append_tokens(r.request_key, list(r.token_ids), r.block_hashes)
        return scheduler_pb2.AppendTokensResponse()

    def _Free(self, pool: Pool, r: Any) -> Message:
        if r.mode not in (scheduler_pb2.FREE_MODE_FINISHED, scheduler_pb2.FREE_MODE_PREEMPTED):
            raise InvalidArgumentError(f"mode {r.mode} is neither FINISHED nor PREEMPTED")
        pool.free(r.request_key, preempt=r.mode == scheduler_pb2.FREE_MODE_PREEMPTED)
        return scheduler_pb2.FreeResponse()

    # ----------------------------------------------------------------------- operations
    def _GetComputedBlocks(self, pool: Pool, r: Any) -> Message:
        bound = r.lookup.max_cache_hit_length if r.lookup.HasField("max_cache_hit_length") else None
        hit = pool.get_computed_blocks(r.request_key, bound)
        response = scheduler_pb2.GetComputedBlocksResponse(
            num_computed_tokens=hit.num_computed_tokens
        )
        _grouped(hit.blocks.get_block_ids(), response.blocks)
        return response

    def _AllocateSlots(self, pool: Pool, r: Any) -> Message:
        _manager(pool)
        request = pool.request(r.request_key)
        pool.check_allocation(r.request_key, r.num_new_tokens, r.num_computed_tokens)
        computed = r.num_computed_tokens
        hit = None
        if r.HasField("new_computed"):
            if computed and computed == r.new_computed.num_new_computed_tokens:
                computed = 0  # the hit counted into num_computed_tokens means the same
            hit = _hit_from_wire(pool, request, r.new_computed)
        options = _slot_options(r.options, 0)
        request.num_computed_tokens = computed
        request.num_in_flight_tokens = r.options.num_in_flight_tokens
        blocks = pool.allocate_slots(request, r.num_new_tokens, hit, options)
        response = scheduler_pb2.AllocateSlotsResponse()
        if blocks is None:
            response.status = _DOES_NOT_FIT
        else:
            response.status = _OK
            _grouped(blocks.get_block_ids(), response.new_blocks)
        return response

    def _CacheBlocks(self, pool: Pool, r: Any) -> Message:
        _manager(pool)
        request = pool.request(r.request_key)
        _tokens_at_most(request, "num_computed_tokens", r.num_computed_tokens)
        _manager(pool).cache_blocks(request, r.num_computed_tokens)
        return scheduler_pb2.CacheBlocksResponse()

    def _RemoveSkippedBlocks(self, pool: Pool, r: Any) -> Message:
        _manager(pool)
        request = pool.request(r.request_key)
        _tokens_at_most(request, "total_computed_tokens", r.total_computed_tokens)
        _manager(pool).remove_skipped_blocks(request.request_id, r.total_computed_tokens)
        return scheduler_pb2.RemoveSkippedBlocksResponse()

    def _EvictBlocks(self, pool: Pool, r: Any) -> Message:
        manager = _manager(pool)
        num_blocks = manager.block_pool.num_gpu_blocks
        if any(not 1 <= block_id < num_blocks for block_id in r.block_ids):
            raise InvalidArgumentError("block_ids outside [1, num_blocks)")
        manager.evict_blocks(list(r.block_ids))
        return scheduler_pb2.EvictBlocksResponse()

    def _ResetPrefixCache(self, pool: Pool, r: Any) -> Message:
        return scheduler_pb2.ResetPrefixCacheResponse(reset=_manager(pool).reset_prefix_cache())

    def _GetBlocks(self, pool: Pool, r: Any) -> Message:
        _manager(pool)
        request = pool.request(r.request_key)
        response = scheduler_pb2.GetBlocksResponse()
        hashes = []
        for group in _manager(pool).get_blocks(request.request_id).blocks:
            response.blocks.num_block_ids.append(len(group))
            for block in group:
                response.blocks.block_ids.append(block.block_id)
                response.ref_cnts.append(block.ref_cnt)
                response.is_cached.append(block.block_hash is not None)
                if block.block_hash is not None:
                    hashes.append(block.block_hash[: pool.hashing.hash_length_bytes])
        response.block_hashes = b"".join(hashes)
        return response

    def _GetBlockIds(self, pool: Pool, r: Any) -> Message:
        _manager(pool)
        request = pool.request(r.request_key)
        response = scheduler_pb2.GetBlockIdsResponse()
        _grouped(_manager(pool).get_block_ids(request.request_id), response.blocks)
        return response

    def _GetNumCommonPrefixBlocks(self, pool: Pool, r: Any) -> Message:
        manager = _manager(pool)
        request = pool.request(r.running_request_key)
        if not manager.holds_blocks(request.request_id):
            raise FailedPreconditionError("not running")
        counts = manager.get_num_common_prefix_blocks(request.request_id)
        return scheduler_pb2.GetNumCommonPrefixBlocksResponse(num_common_prefix_blocks=counts)

    def _TakeNewBlockIds(self, pool: Pool, r: Any) -> Message:
        ids = _manager(pool).take_new_block_ids()
        return scheduler_pb2.TakeNewBlockIdsResponse(block_ids=ids)

    def _NewStepStarts(self, pool: Pool, r: Any) -> Message:
        _manager(pool).new_step_starts()
        return scheduler_pb2.NewStepStartsResponse()

    def _GetUsage(self, pool: Pool, r: Any) -> Message:
        manager = _manager(pool)
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

    # ----------------------------------------------------------------------------- step
    def _Step(self, pool: Pool, r: Any) -> Message:
        _manager(pool)
        if r.HasField("step_seq"):
            if r.step_seq and r.step_seq == pool.last_step_seq:
                assert self._step_answer is not None
                return self._step_answer
            if r.step_seq != pool.last_step_seq + 1:
                raise FailedPreconditionError(f"step_seq {r.step_seq} out of sequence")
        step = _Step(pool, r)
        step.check_columns()
        ops = list(r.ops)
        ran = step.run(ops, stop=not r.continue_on_does_not_fit)
        if ran < len(ops):
            # The ops after the stop do not run, but the Step is validated whole.
            rest = copy.deepcopy(step)
            rest.run(ops[ran:], stop=False)
        response = step.response
        response.num_ops_executed = ran
        if step.budget is not None:
            response.token_budget_left = step.budget
        if r.HasField("step_seq"):
            response.step_seq = r.step_seq
            pool.last_step_seq = r.step_seq
            self._step_answer = response
        return response


REFERENCE_METHODS = frozenset(
    name[1:] for name in vars(Reference) if name.startswith("_") and name[1].isupper()
)
