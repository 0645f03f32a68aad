"""A realistic shared-prefix trace through the Step RPC equals the in-process core, item by item.

The replay scheduler (``examples/workload.py``) drives a pool on a real server through
``SchedulerClient.step``. Every Step it sends is also executed here, in-process, by
``InProcessStepExecutor``: this file's own reading of the Step semantics in ``api.md``, calling
``kvcm.core.KVCacheManager`` directly. Each answer (status, blocks, lookup hit and
allocated tokens, budget left, ops executed) must be identical, and at the end so must the
pool's free blocks and the prefix-cache counters.
"""

from __future__ import annotations

import pytest
from workload import ReplayScheduler, WorkloadOptions, make_workload

from kvcm.client import (
    ItemStatus,
    KVCacheBlocks,
    PoolConfig,
    SchedulerClient,
    StepBuilder,
    StepResult,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec, SlidingWindowSpec
from kvcm.core import (
    CacheHit,
    KVCacheManager,
    KVCacheManagerConfig,
    Request,
    RequestStatus,
    SlotOptions,
)
from kvcm.v1 import common_pb2, scheduler_pb2

OP = scheduler_pb2
OK = common_pb2.ITEM_STATUS_OK
DOES_NOT_FIT = common_pb2.ITEM_STATUS_DOES_NOT_FIT
NO_TOKEN_BUDGET = common_pb2.ITEM_STATUS_NO_TOKEN_BUDGET


class InProcessStepExecutor:
    """Runs Steps on an in-process ``KVCacheManager`` with the semantics api.md gives them."""

    def __init__(self, manager: KVCacheManager, hasher: BlockHasher | None) -> None:
        self.manager = manager
        self.hasher = hasher
        self.requests: dict[int, Request] = {}
        self.hash_length = 0

    def __call__(self, builder: StepBuilder) -> StepResult:
        message = builder.to_proto("in-process")
        response = self.run(message)
        return StepResult(response, builder.num_allocations, builder.lookup_allocations)

    def run(self, message: scheduler_pb2.StepRequest) -> scheduler_pb2.StepResponse:
        response = scheduler_pb2.StepResponse()
        keys = iter(message.request_keys)
        new_requests = iter(message.new_requests)
        append_counts = iter(
            zip(message.append_num_tokens, message.append_num_block_hashes, strict=True)
        )
        append_tokens = iter(message.append_token_ids)
        append_hashes = message.append_block_hashes
        hash_cursor = 0
        alloc_args = iter(
            zip(message.alloc_num_new_tokens, message.alloc_num_computed_tokens, strict=True)
        )
        alloc_options = {entry.alloc_index: entry for entry in message.alloc_options}
        cache_args = iter(message.cache_num_computed_tokens)
        skipped_args = iter(message.remove_skipped_total_computed_tokens)
        budget = message.token_budget if message.HasField("token_budget") else None
        alloc_index = 0
        executed = 0
        for op in message.ops:
            executed += 1
            if op == OP.STEP_OP_KIND_ADD_REQUEST:
                self._add(next(new_requests))
            elif op == OP.STEP_OP_KIND_APPEND_TOKENS:
                request = self.requests[next(keys)]
                num_tokens, num_hashes = next(append_counts)
                tokens = [next(append_tokens) for _ in range(num_tokens)]
                size = self.hash_length * num_hashes
                sent = append_hashes[hash_cursor : hash_cursor + size]
                hash_cursor += size
                before = len(request.block_hashes)
                request.append_output_token_ids(tokens)
                assert b"".join(request.block_hashes[before:]) == sent, "client hashes differ"
            elif op == OP.STEP_OP_KIND_ALLOCATE:
                request = self.requests[next(keys)]
                num_new, num_computed = next(alloc_args)
                entry = alloc_options.get(alloc_index)
                alloc_index += 1
                status, budget = self._allocate(
                    request, num_new, num_computed, entry, message, budget, response
                )
                if status != OK and not message.continue_on_does_not_fit:
                    break
            elif op == OP.STEP_OP_KIND_CACHE_BLOCKS:
                self.manager.cache_blocks(self.requests[next(keys)], next(cache_args))
            elif op == OP.STEP_OP_KIND_REMOVE_SKIPPED_BLOCKS:
                request = self.requests[next(keys)]
                self.manager.remove_skipped_blocks(request.request_id, next(skipped_args))
            elif op == OP.STEP_OP_KIND_PREEMPT:
                request = self.requests[next(keys)]
                self.manager.free(request)
                request.status = RequestStatus.PREEMPTED
                request.num_preemptions += 1
                request.num_computed_tokens = 0
            elif op == OP.STEP_OP_KIND_FINISH:
                request = self.requests.pop(next(keys))
                request.status = RequestStatus.FINISHED_STOPPED
                self.manager.free(request)
            elif op == OP.STEP_OP_KIND_NEW_STEP_STARTS:
                self.manager.new_step_starts()
            else:  # pragma: no cover - the builder writes no other kind
                raise AssertionError(op)
        response.num_ops_executed = executed
        if budget is not None:
            response.token_budget_left = budget
        if message.HasField("step_seq"):
            response.step_seq = message.step_seq
        return response

    def _add(self, new: scheduler_pb2.NewRequest) -> None:
        request = Request(
            new.request_id or f"key-{new.request_key}",
            list(new.prompt_token_ids),
            block_hasher=self.hasher,
            skip_reading_prefix_cache=new.skip_reading_prefix_cache,
        )
        assert b"".join(request.block_hashes) == new.block_hashes, "client hashes differ"
        self.requests[new.request_key] = request

    def _allocate(
        self,
        request: Request,
        num_new: int,
        num_computed: int,
        entry: scheduler_pb2.StepAllocOptions | None,
        message: scheduler_pb2.StepRequest,
        budget: int | None,
        response: scheduler_pb2.StepResponse,
    ) -> tuple[int, int | None]:
        manager = self.manager
        options = _slot_options(entry, message.default_num_lookahead_tokens)
        request.num_computed_tokens = num_computed
        lookup = entry is not None and entry.HasField("lookup")
        hit: CacheHit | None = None
        if lookup:
            assert entry is not None
            bound = (
                entry.lookup.max_cache_hit_length
                if entry.lookup.HasField("max_cache_hit_length")
                else None
            )
            hit = manager.get_computed_blocks(request, bound)
            left = (
                request.num_tokens
                - num_computed
                - hit.num_computed_tokens
                - options.num_external_computed_tokens
            )
            num_new = min(num_new, left)
            if budget is not None:
                num_new = min(num_new, budget)
            if num_new <= 0:
                self._answer(response, NO_TOKEN_BUDGET, None, (hit.num_computed_tokens, 0))
                return NO_TOKEN_BUDGET, budget
        blocks = manager.allocate_slots(request, num_new, hit, options)
        if blocks is None:
            looked = (hit.num_computed_tokens, 0) if hit is not None else None
            self._answer(response, DOES_NOT_FIT, None, looked)
            return DOES_NOT_FIT, budget
        request.status = RequestStatus.RUNNING
        if hit is not None:
            manager.record_prefix_cache_stats(request, hit.num_computed_tokens)
            ids = manager.get_block_ids(request.request_id)
            self._answer(response, OK, ids, (hit.num_computed_tokens, num_new))
        else:
            self._answer(response, OK, blocks.get_block_ids(), None)
        if budget is not None:
            budget = max(0, budget - num_new)
        return OK, budget

    def _answer(
        self,
        response: scheduler_pb2.StepResponse,
        status: int,
        block_ids: tuple[list[int], ...] | None,
        lookup: tuple[int, int] | None,
    ) -> None:
        response.alloc_statuses.append(status)  # type: ignore[arg-type]
        for group in range(self.manager.num_kv_cache_groups):
            ids = block_ids[group] if block_ids is not None else []
            response.alloc_num_block_ids.append(len(ids))
            response.alloc_block_ids.extend(ids)
        if lookup is not None:
            response.lookup_num_computed_tokens.append(lookup[0])
            response.lookup_num_new_tokens.append(lookup[1])


def _slot_options(
    entry: scheduler_pb2.StepAllocOptions | None, default_lookahead: int
) -> SlotOptions:
    if entry is None or not entry.HasField("options"):
        return SlotOptions(num_lookahead_tokens=default_lookahead)
    wire = entry.options
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


# ------------------------------------------------------------------------------- layouts
def _attention(block_size: int) -> dict[str, object]:
    return {"block_size": block_size, "num_kv_heads": 2, "head_size": 64, "dtype": DType.BFLOAT16}


def full_attention_layout(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(**_attention(16))  # type: ignore[arg-type]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )


def hybrid_layout(num_blocks: int) -> KVCacheConfig:
    full = FullAttentionSpec(**_attention(16))  # type: ignore[arg-type]
    window = SlidingWindowSpec(**_attention(16), sliding_window=64)  # type: ignore[arg-type]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(
            KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=full),
            KVCacheGroupSpec(layer_names=("layer.1",), kv_cache_spec=window),
        ),
    )


LAYOUTS = {"full_attention": full_attention_layout, "full_plus_sliding_window": hybrid_layout}


def _compare(step: int, remote: StepResult, local: StepResult) -> None:
    where = f"step RPC #{step}"
    assert remote.num_ops_executed == local.num_ops_executed, where
    assert remote.statuses == local.statuses, where
    assert remote.token_budget_left == local.token_budget_left, where
    for index in range(remote.num_allocations_executed):
        remote_blocks: KVCacheBlocks | None = remote.blocks(index)
        assert remote_blocks == local.blocks(index), f"{where} allocation {index}"
        assert remote.lookup(index) == local.lookup(index), f"{where} allocation {index}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("hash_algorithm", ["sha256_cbor", "xxhash"])
def test_trace_through_step_equals_in_process_core(
    client: SchedulerClient, layout: str, hash_algorithm: str
) -> None:
    pool_id = f"trace-{layout}-{hash_algorithm}".replace("_", "-")
    kv_cache_config = LAYOUTS[layout](num_blocks=400)
    client.create_pool(
        pool_id,
        PoolConfig(
            max_model_len=4096,
            explicit_layout=kv_cache_config,
            hash_algorithm=hash_algorithm,
            watermark=0.01,
        ),
    )
    hashing = client.hashing(pool_id)
    hasher = hashing.block_hasher()
    manager = KVCacheManager(
        KVCacheManagerConfig(
            kv_cache_config=kv_cache_config,
            max_model_len=4096,
            hash_block_size=hashing.hash_block_size,
            watermark=0.01,
        )
    )
    assert manager.hash_block_size == hashing.hash_block_size
    local = InProcessStepExecutor(manager, hasher)
    local.hash_length = hashing.hash_length_bytes

    compared = 0

    def both(builder: StepBuilder) -> StepResult:
        nonlocal compared
        remote_result = client.step(pool_id, builder)
        _compare(compared, remote_result, local(builder))
        compared += 1
        return remote_result

    trace = make_workload(WorkloadOptions(num_requests=160, seed=7))
    scheduler = ReplayScheduler(both, trace, hasher, max_num_batched_tokens=1024)
    stats = scheduler.run()

    assert scheduler.done
    assert stats.finished == len(trace)
    # The trace is realistic only if it exercised what matters.
    assert stats.hit_rate > 0.3
    assert stats.preemptions > 0
    assert compared == stats.rpcs
    usage = client.get_usage(pool_id)
    assert usage.num_free_blocks == manager.num_free_blocks
    assert usage.num_requests == 0
    remote_stats = client.take_prefix_cache_stats(pool_id)
    local_stats = manager.make_prefix_cache_stats()
    assert remote_stats is not None
    assert local_stats is not None
    assert (remote_stats.requests, remote_stats.queries, remote_stats.hits) == (
        local_stats.requests,
        local_stats.queries,
        local_stats.hits,
    )
    client.delete_pool(pool_id)


def test_step_stops_at_the_first_allocation_that_does_not_fit(client: SchedulerClient) -> None:
    pool_id = "trace-stop"
    client.create_pool(
        pool_id, PoolConfig(max_model_len=4096, explicit_layout=full_attention_layout(10))
    )
    hasher = client.block_hasher(pool_id)
    step = StepBuilder()
    for key in range(3):
        prompt = [key * 1000 + i for i in range(64)]  # 4 blocks each, 9 usable blocks
        step.add_request(key, prompt, hasher.hash_token_ids(prompt))
        step.allocate(key, 64, 0, lookup=True)
    result = client.step(pool_id, step)
    assert result.statuses == [ItemStatus.OK, ItemStatus.OK, ItemStatus.DOES_NOT_FIT]
    assert result.num_ops_executed == 6
    assert result.blocks(2) is None
    assert client.get_usage(pool_id).num_requests == 3

    step = StepBuilder(continue_on_does_not_fit=True)
    step.allocate(2, 64, 0, lookup=True)
    step.finish(0)
    step.allocate(2, 64, 0, lookup=True)
    result = client.step(pool_id, step)
    assert result.statuses == [ItemStatus.DOES_NOT_FIT, ItemStatus.OK]
    assert result.num_ops_executed == 3
    client.delete_pool(pool_id)
