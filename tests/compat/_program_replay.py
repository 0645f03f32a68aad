"""Replays recorded Step programs on a fresh kvcm core and compares it with the mirror.

Until the core's own interpreter (``Pool.run_step``) lands, this is the test's reference
interpreter for the programs the vLLM mirror records: it applies each op to a plain
:class:`kvcm.core.manager.KVCacheManager` with kvcm's own requests, exactly as the program
says (explicit computed tokens, explicit hits, the allocation options), and answers a
:class:`StepOutcome`. If the programs leave anything out, the replayed pool drifts from the
mirror and :func:`pool_state` tells.
"""

from __future__ import annotations

from typing import Any

from kvcm.core.manager import (
    DEFAULT_SLOT_OPTIONS,
    CacheHit,
    KVCacheBlocks,
    KVCacheManager,
)
from kvcm.core.program import ItemStatus, OpKind, StepOutcome, StepProgram
from kvcm.core.request import Request, RequestStatus


def _split(raw: bytes, count: int) -> list[Any]:
    if count == 0:
        return []
    size = len(raw) // count
    return [raw[i * size : (i + 1) * size] for i in range(count)]


class ProgramReplayer:
    """A fresh core driven only by Step programs."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.requests: dict[int, Request] = {}
        self.running: set[int] = set()

    def run(self, program: StepProgram) -> StepOutcome:
        """Apply every op; answer what the mirror should have answered."""
        manager = self.manager
        outcome = StepOutcome(step_seq=program.step_seq)
        keys = iter(program.request_keys)
        new_requests = iter(program.new_requests)
        alloc_index = 0
        append_index = tokens_at = hashes_at = 0
        cache_at = remove_at = evict_at = evict_ids_at = record_at = extend_at = 0
        report_at = report_blocks_at = 0
        hash_size = 0
        for op in program.ops:
            if op == OpKind.ADD_REQUEST:
                spec = next(new_requests)
                request = Request(
                    spec.request_id,
                    spec.prompt_token_ids,
                    lora_name=spec.lora_name,
                    lora_id=spec.lora_id,
                    cache_salt=spec.cache_salt,
                    skip_reading_prefix_cache=spec.skip_reading_prefix_cache,
                    report_cached_blocks=spec.report_cached_blocks,
                )
                lookahead = manager.block_pool.num_hash_lookahead_tokens
                count = max(len(spec.prompt_token_ids) - lookahead, 0) // manager.hash_block_size
                if spec.block_hashes:
                    hash_size = len(spec.block_hashes) // count
                request.block_hashes.extend(
                    _split(spec.block_hashes, count if spec.block_hashes else 0)
                )
                self.requests[spec.key] = request
            elif op == OpKind.APPEND_TOKENS:
                request = self.requests[next(keys)]
                num_tokens = program.append_num_tokens[append_index]
                num_hashes = program.append_num_block_hashes[append_index]
                append_index += 1
                request.all_token_ids.extend(
                    program.append_token_ids[tokens_at : tokens_at + num_tokens]
                )
                tokens_at += num_tokens
                size = hash_size or 32
                raw = program.append_block_hashes[hashes_at : hashes_at + num_hashes * size]
                hashes_at += num_hashes * size
                request.block_hashes.extend(_split(raw, num_hashes))
            elif op == OpKind.ALLOCATE:
                key = next(keys)
                self._allocate(program, alloc_index, key, outcome)
                alloc_index += 1
            elif op == OpKind.CACHE_BLOCKS:
                manager.cache_blocks(
                    self.requests[next(keys)], program.cache_num_computed_tokens[cache_at]
                )
                cache_at += 1
            elif op == OpKind.REMOVE_SKIPPED_BLOCKS:
                request = self.requests[next(keys)]
                manager.remove_skipped_blocks(
                    request.request_id, program.remove_skipped_total_computed_tokens[remove_at]
                )
                remove_at += 1
            elif op == OpKind.PREEMPT:
                key = next(keys)
                manager.free(self.requests[key])
                self.requests[key].status = RequestStatus.PREEMPTED
                self.requests[key].num_preemptions += 1
                self.running.discard(key)
            elif op == OpKind.FINISH:
                key = next(keys)
                manager.free(self.requests.pop(key))
                self.running.discard(key)
            elif op == OpKind.NEW_STEP_STARTS:
                manager.new_step_starts()
            elif op == OpKind.EVICT_BLOCKS:
                count = program.evict_num_block_ids[evict_at]
                evict_at += 1
                manager.evict_blocks(program.evict_block_ids[evict_ids_at : evict_ids_at + count])
                evict_ids_at += count
            elif op == OpKind.RESET_PREFIX_CACHE:
                outcome.reset.append(manager.reset_prefix_cache())
            elif op == OpKind.RECORD_PREFIX_STATS:
                manager.record_prefix_cache_stats(
                    self.requests[next(keys)], program.record_hit_tokens[record_at]
                )
                record_at += 1
            elif op == OpKind.EXTEND_PROMPT:
                request = self.requests[next(keys)]
                end = program.extend_prompt_num_tokens[extend_at]
                extend_at += 1
                request.prompt_token_ids.extend(
                    request.all_token_ids[request.num_prompt_tokens : end]
                )
                request.num_prompt_tokens = end
            elif op == OpKind.REPORT_HIT:
                request = self.requests[next(keys)]
                count = program.report_hit_num_groups[report_at]
                report_at += 1
                counts = program.report_hit_num_blocks[report_blocks_at : report_blocks_at + count]
                report_blocks_at += count
                if request.report_cached_blocks and manager.block_pool.enable_kv_cache_events:
                    manager.coordinator.emit_cached_block_counts(request, counts)
            else:
                raise AssertionError(f"unknown op {op}")
        outcome.num_ops_executed = len(program.ops)
        return outcome

    def _allocate(self, program: StepProgram, index: int, key: int, outcome: StepOutcome) -> None:
        manager = self.manager
        request = self.requests[key]
        options = program.alloc_options.get(index)
        request.num_computed_tokens = program.alloc_num_computed_tokens[index]
        request.num_in_flight_tokens = 0 if options is None else options.num_in_flight_tokens
        if key in self.running:
            request.status = RequestStatus.RUNNING
        hit = None
        if options is not None and options.hit is not None:
            blocks = manager.block_pool.blocks
            hit = CacheHit(
                KVCacheBlocks(tuple([blocks[i] for i in ids] for ids in options.hit.block_ids)),
                options.hit.num_tokens,
            )
            if options.hit.shared_prefix_boundary is not None:
                manager.set_shared_prefix_boundary(
                    request.request_id, options.hit.shared_prefix_boundary
                )
        slot_options = DEFAULT_SLOT_OPTIONS if options is None else options.slot_options
        result = manager.allocate_slots(
            request, program.alloc_num_new_tokens[index], hit, slot_options
        )
        if result is None:
            outcome.alloc_statuses.append(int(ItemStatus.DOES_NOT_FIT))
            outcome.alloc_num_block_ids.extend([0] * manager.num_kv_cache_groups)
            return
        self.running.add(key)
        request.status = RequestStatus.RUNNING
        outcome.alloc_statuses.append(int(ItemStatus.OK))
        for ids in result.get_block_ids():
            outcome.alloc_num_block_ids.append(len(ids))
            outcome.alloc_block_ids.extend(ids)


def pool_state(manager: KVCacheManager, request_ids: list[str]) -> dict[str, Any]:
    """The pool's whole state in a comparable form (free order, ref counts, cache, tables)."""
    pool = manager.block_pool
    return {
        "free": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "ref_cnts": [b.ref_cnt for b in pool.blocks[1:]],
        "hashes": [None if b.block_hash is None else bytes(b.block_hash) for b in pool.blocks],
        "cache": {bytes(k): tuple(v) for k, v in pool.cached_block_ids().items()},
        "tables": {
            rid: manager.get_block_ids(rid)
            for rid in sorted(request_ids)
            if manager.holds_blocks(rid)
        },
    }
