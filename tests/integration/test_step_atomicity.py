"""Over gRPC: rejected calls change nothing, hits are verified, empty tables (regressions).

Raw stubs against a real server on loopback; each rejected call is compared against the pool's
observable state before it (usage, every request's blocks, the next lookup's answer).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.v1 import admin_pb2, common_pb2, scheduler_pb2, service_pb2_grpc
from kvcm.wire import kv_cache_config_to_proto

BLOCK = 16
POOL = "step-atomicity"
ADD = scheduler_pb2.STEP_OP_KIND_ADD_REQUEST
ALLOC = scheduler_pb2.STEP_OP_KIND_ALLOCATE
CACHE = scheduler_pb2.STEP_OP_KIND_CACHE_BLOCKS
FIN = scheduler_pb2.STEP_OP_KIND_FINISH
EVICT = scheduler_pb2.STEP_OP_KIND_EVICT_BLOCKS
RESET = scheduler_pb2.STEP_OP_KIND_RESET_PREFIX_CACHE


class Stubs:
    def __init__(self, channel: grpc.Channel, seed: str) -> None:
        self.admin = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
        self.sched = service_pb2_grpc.SchedulerServiceStub(channel)  # type: ignore[no-untyped-call]
        self.hasher = BlockHasher(BLOCK, "sha256_cbor", seed)


@pytest.fixture
def stubs(kvcm_address: str) -> Iterator[Stubs]:
    with grpc.insecure_channel(kvcm_address) as channel:
        admin = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16
        )
        layout = kv_cache_config_to_proto(
            KVCacheConfig(
                num_blocks=61,
                kv_cache_tensors=(),
                kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=spec),),
            )
        )
        config = admin_pb2.PoolConfig(
            max_model_len=512, hash_algorithm=common_pb2.HASH_ALGORITHM_SHA256_CBOR
        )
        config.explicit_layout.num_blocks = layout.num_blocks
        config.explicit_layout.kv_cache_groups.extend(layout.kv_cache_groups)
        admin.CreatePool(admin_pb2.CreatePoolRequest(pool_id=POOL, config=config))
        info = admin.DescribePool(admin_pb2.DescribePoolRequest(pool_id=POOL)).pool
        yield Stubs(channel, info.hashing.seed)
        admin.DeletePool(admin_pb2.DeletePoolRequest(pool_id=POOL))


def _new(stubs: Stubs, key: int, prompt: list[int]) -> scheduler_pb2.NewRequest:
    return scheduler_pb2.NewRequest(
        request_key=key,
        prompt_token_ids=prompt,
        block_hashes=b"".join(stubs.hasher.hash_token_ids(prompt)),
    )


def _admit_and_finish(stubs: Stubs, key: int, prompt: list[int]) -> list[int]:
    step = scheduler_pb2.StepRequest(
        pool_id=POOL,
        ops=[ADD, ALLOC, FIN],
        request_keys=[key, key],
        alloc_num_new_tokens=[len(prompt)],
        alloc_num_computed_tokens=[0],
    )
    step.new_requests.append(_new(stubs, key, prompt))
    return list(stubs.sched.Step(step).alloc_block_ids)


def _add(stubs: Stubs, key: int, prompt: list[int]) -> None:
    stubs.sched.AddRequest(
        scheduler_pb2.AddRequestRequest(pool_id=POOL, request=_new(stubs, key, prompt))
    )


def _observe(stubs: Stubs, key: int) -> tuple[bytes, bytes]:
    usage = stubs.sched.GetUsage(scheduler_pb2.GetUsageRequest(pool_id=POOL))
    hit = stubs.sched.GetComputedBlocks(
        scheduler_pb2.GetComputedBlocksRequest(pool_id=POOL, request_key=key)
    )
    return usage.SerializeToString(deterministic=True), hit.SerializeToString(deterministic=True)


def _allocate(stubs: Stubs, key: int, ids: list[int], **options: int) -> None:
    stubs.sched.AllocateSlots(
        scheduler_pb2.AllocateSlotsRequest(
            pool_id=POOL,
            request_key=key,
            num_new_tokens=8,
            new_computed=scheduler_pb2.ComputedBlocks(
                num_new_computed_tokens=BLOCK * len(ids),
                blocks=common_pb2.GroupedBlockIds(block_ids=ids, num_block_ids=[len(ids)]),
            ),
            options=scheduler_pb2.SlotOptions(**options),
        )
    )


def test_add_then_a_refused_op_adds_nothing(stubs: Stubs) -> None:
    before = stubs.sched.GetUsage(scheduler_pb2.GetUsageRequest(pool_id=POOL))
    step = scheduler_pb2.StepRequest(
        pool_id=POOL, ops=[ADD, CACHE], request_keys=[4], cache_num_computed_tokens=[16]
    )
    step.new_requests.append(_new(stubs, 4, list(range(40))))
    with pytest.raises(grpc.RpcError) as caught:
        stubs.sched.Step(step)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    trailers = dict(caught.value.trailing_metadata())
    rejection = scheduler_pb2.StepRejection.FromString(trailers["kvcm-step-rejection-bin"])
    assert rejection.op_index == 1
    assert rejection.field == "request_keys[0]"
    assert stubs.sched.GetUsage(scheduler_pb2.GetUsageRequest(pool_id=POOL)) == before


def test_a_hit_of_another_prompt_or_a_repeated_block_fails_its_precondition(
    stubs: Stubs,
) -> None:
    other = _admit_and_finish(stubs, 1, [9] * 40)
    own = _admit_and_finish(stubs, 2, list(range(40)))
    _add(stubs, 3, list(range(40)))
    before = _observe(stubs, 3)
    for ids in (other[:2], [own[0], own[0]]):
        with pytest.raises(grpc.RpcError) as caught:
            _allocate(stubs, 3, ids)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "look the request up again" in caught.value.details()
        assert _observe(stubs, 3) == before


def test_huge_external_tokens_are_refused_by_name_without_a_change(stubs: Stubs) -> None:
    own = _admit_and_finish(stubs, 1, list(range(40)))
    _add(stubs, 2, list(range(40)))
    before = _observe(stubs, 2)
    with pytest.raises(grpc.RpcError) as caught:
        _allocate(stubs, 2, own[:2], num_external_computed_tokens=2**32 - 1)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_external_computed_tokens" in caught.value.details()
    assert _observe(stubs, 2) == before


def test_a_live_request_without_blocks_has_empty_tables(stubs: Stubs) -> None:
    _add(stubs, 5, list(range(20)))
    ids = stubs.sched.GetBlockIds(
        scheduler_pb2.GetBlockIdsRequest(pool_id=POOL, request_key=5)
    ).blocks
    assert list(ids.num_block_ids) == [0]
    blocks = stubs.sched.GetBlocks(scheduler_pb2.GetBlocksRequest(pool_id=POOL, request_key=5))
    assert list(blocks.blocks.num_block_ids) == [0]


def test_evict_and_reset_run_in_a_step(stubs: Stubs) -> None:
    own = _admit_and_finish(stubs, 1, list(range(40)))
    response = stubs.sched.Step(
        scheduler_pb2.StepRequest(
            pool_id=POOL,
            ops=[EVICT, RESET],
            evict_num_block_ids=[1],
            evict_block_ids=[own[0]],
        )
    )
    assert response.num_ops_executed == 2
    assert list(response.reset) == [True]
