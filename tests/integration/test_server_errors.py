"""Every error path of the wire API: its status, a message naming the field, nothing changed.

Raw gRPC stubs (no SDK) send malformed and out-of-domain requests to a real server; after each
one the pool's full observable state (usage, requests, every live request's blocks with their
ref counts and hashes, events, Step sequence) must equal what it was before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import grpc
import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.v1 import admin_pb2, common_pb2, scheduler_pb2, service_pb2_grpc
from kvcm.wire import kv_cache_config_to_proto

BLOCK = 16
POOL = "wire-errors"
Code: TypeAlias = grpc.StatusCode


class Stubs:
    def __init__(self, channel: grpc.Channel) -> None:
        self.admin = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
        self.sched = service_pb2_grpc.SchedulerServiceStub(channel)  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def stubs(kvcm_address: str) -> Iterator[Stubs]:
    with grpc.insecure_channel(kvcm_address) as channel:
        stubs = Stubs(channel)
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16
        )
        layout = kv_cache_config_to_proto(
            KVCacheConfig(
                num_blocks=32,
                kv_cache_tensors=(),
                kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=spec),),
            )
        )
        config = admin_pb2.PoolConfig(
            max_model_len=128,
            enable_kv_cache_events=True,
            hash_algorithm=common_pb2.HASH_ALGORITHM_SHA256_CBOR,
        )
        config.explicit_layout.num_blocks = layout.num_blocks
        config.explicit_layout.kv_cache_groups.extend(layout.kv_cache_groups)
        stubs.admin.CreatePool(admin_pb2.CreatePoolRequest(pool_id=POOL, config=config))
        info = stubs.admin.DescribePool(admin_pb2.DescribePoolRequest(pool_id=POOL)).pool
        hasher = BlockHasher(BLOCK, "sha256_cbor", info.hashing.seed)
        prompt = list(range(40))
        step = scheduler_pb2.StepRequest(
            pool_id=POOL,
            ops=[scheduler_pb2.STEP_OP_KIND_ADD_REQUEST, scheduler_pb2.STEP_OP_KIND_ALLOCATE],
            request_keys=[1],
            alloc_num_new_tokens=[40],
            alloc_num_computed_tokens=[0],
            step_seq=1,
        )
        step.new_requests.add(
            request_key=1,
            prompt_token_ids=prompt,
            block_hashes=b"".join(hasher.hash_token_ids(prompt)),
        )
        stubs.sched.Step(step)
        yield stubs
        stubs.admin.DeletePool(admin_pb2.DeletePoolRequest(pool_id=POOL))


def _state(stubs: Stubs) -> tuple[Any, ...]:
    usage = stubs.sched.GetUsage(scheduler_pb2.GetUsageRequest(pool_id=POOL))
    blocks = stubs.sched.GetBlocks(scheduler_pb2.GetBlocksRequest(pool_id=POOL, request_key=1))
    info = stubs.admin.DescribePool(admin_pb2.DescribePoolRequest(pool_id=POOL)).pool
    return (
        usage.SerializeToString(deterministic=True),
        blocks.SerializeToString(deterministic=True),
        info.last_event_sequence,
        info.num_requests,
    )


def _step(**fields: Any) -> scheduler_pb2.StepRequest:
    return scheduler_pb2.StepRequest(pool_id=POOL, **fields)


A = scheduler_pb2.STEP_OP_KIND_ALLOCATE
P = scheduler_pb2.STEP_OP_KIND_APPEND_TOKENS
ADD = scheduler_pb2.STEP_OP_KIND_ADD_REQUEST
FIN = scheduler_pb2.STEP_OP_KIND_FINISH

CASES: list[tuple[str, Callable[[Stubs], Any], Code, str]] = [
    (
        "unknown pool",
        lambda s: s.sched.GetUsage(scheduler_pb2.GetUsageRequest(pool_id="nope")),
        Code.NOT_FOUND,
        "nope",
    ),
    (
        "unknown key",
        lambda s: s.sched.GetBlockIds(
            scheduler_pb2.GetBlockIdsRequest(pool_id=POOL, request_key=9)
        ),
        Code.NOT_FOUND,
        "9",
    ),
    (
        "taken key",
        lambda s: s.sched.AddRequest(
            scheduler_pb2.AddRequestRequest(
                pool_id=POOL, request=scheduler_pb2.NewRequest(request_key=1, prompt_token_ids=[1])
            )
        ),
        Code.ALREADY_EXISTS,
        "1",
    ),
    (
        "empty prompt",
        lambda s: s.sched.AddRequest(
            scheduler_pb2.AddRequestRequest(
                pool_id=POOL, request=scheduler_pb2.NewRequest(request_key=2)
            )
        ),
        Code.INVALID_ARGUMENT,
        "prompt_token_ids",
    ),
    (
        "prompt beyond max_model_len",
        lambda s: s.sched.AddRequest(
            scheduler_pb2.AddRequestRequest(
                pool_id=POOL,
                request=scheduler_pb2.NewRequest(request_key=2, prompt_token_ids=[1] * 129),
            )
        ),
        Code.INVALID_ARGUMENT,
        "max_model_len",
    ),
    (
        "wrong hash bytes",
        lambda s: s.sched.AddRequest(
            scheduler_pb2.AddRequestRequest(
                pool_id=POOL,
                request=scheduler_pb2.NewRequest(
                    request_key=2, prompt_token_ids=[1] * 16, block_hashes=b"x"
                ),
            )
        ),
        Code.INVALID_ARGUMENT,
        "block_hashes",
    ),
    (
        "append nothing",
        lambda s: s.sched.AppendTokens(
            scheduler_pb2.AppendTokensRequest(pool_id=POOL, request_key=1)
        ),
        Code.INVALID_ARGUMENT,
        "token_ids",
    ),
    (
        "free mode unset",
        lambda s: s.sched.Free(scheduler_pb2.FreeRequest(pool_id=POOL, request_key=1)),
        Code.INVALID_ARGUMENT,
        "mode",
    ),
    (
        "computed beyond tokens",
        lambda s: s.sched.AllocateSlots(
            scheduler_pb2.AllocateSlotsRequest(
                pool_id=POOL, request_key=1, num_new_tokens=1, num_computed_tokens=41
            )
        ),
        Code.INVALID_ARGUMENT,
        "num_computed_tokens",
    ),
    (
        "stale hit",
        lambda s: s.sched.AllocateSlots(
            scheduler_pb2.AllocateSlotsRequest(
                pool_id=POOL,
                request_key=1,
                num_new_tokens=1,
                num_computed_tokens=0,
                new_computed=scheduler_pb2.ComputedBlocks(
                    num_new_computed_tokens=16,
                    blocks=common_pb2.GroupedBlockIds(block_ids=[31], num_block_ids=[1]),
                ),
            )
        ),
        Code.INVALID_ARGUMENT,
        "",
    ),
    (
        "hit block outside the pool",
        lambda s: s.sched.AllocateSlots(
            scheduler_pb2.AllocateSlotsRequest(
                pool_id=POOL,
                request_key=1,
                num_new_tokens=1,
                new_computed=scheduler_pb2.ComputedBlocks(
                    num_new_computed_tokens=16,
                    blocks=common_pb2.GroupedBlockIds(block_ids=[99], num_block_ids=[1]),
                ),
            )
        ),
        Code.INVALID_ARGUMENT,
        "new_computed",
    ),
    (
        "cache beyond tokens",
        lambda s: s.sched.CacheBlocks(
            scheduler_pb2.CacheBlocksRequest(pool_id=POOL, request_key=1, num_computed_tokens=41)
        ),
        Code.INVALID_ARGUMENT,
        "num_computed_tokens",
    ),
    (
        "evict outside the pool",
        lambda s: s.sched.EvictBlocks(
            scheduler_pb2.EvictBlocksRequest(pool_id=POOL, block_ids=[3, 0])
        ),
        Code.INVALID_ARGUMENT,
        "block_ids[1]",
    ),
    (
        "step_seq skipped",
        lambda s: s.sched.Step(_step(step_seq=3)),
        Code.FAILED_PRECONDITION,
        "step_seq",
    ),
    (
        "step column too short",
        lambda s: s.sched.Step(_step(ops=[A], request_keys=[1])),
        Code.INVALID_ARGUMENT,
        "alloc_num_new_tokens",
    ),
    (
        "step column too long",
        lambda s: s.sched.Step(
            _step(
                ops=[A],
                request_keys=[1, 1],
                alloc_num_new_tokens=[1],
                alloc_num_computed_tokens=[40],
            )
        ),
        Code.INVALID_ARGUMENT,
        "request_keys",
    ),
    (
        "step finishes then allocates",
        lambda s: s.sched.Step(
            _step(
                ops=[FIN, A],
                request_keys=[1, 1],
                alloc_num_new_tokens=[1],
                alloc_num_computed_tokens=[40],
            )
        ),
        Code.NOT_FOUND,
        "ops[1]",
    ),
    (
        "step adds a live key",
        lambda s: s.sched.Step(
            _step(
                ops=[ADD],
                new_requests=[scheduler_pb2.NewRequest(request_key=1, prompt_token_ids=[1])],
            )
        ),
        Code.ALREADY_EXISTS,
        "ops[0]",
    ),
    (
        "step appends beyond max_model_len",
        lambda s: s.sched.Step(
            _step(
                ops=[P],
                request_keys=[1],
                append_num_tokens=[89],
                append_token_ids=[1] * 89,
                append_num_block_hashes=[0],
            )
        ),
        Code.INVALID_ARGUMENT,
        "max_model_len",
    ),
    ("step unknown op", lambda s: s.sched.Step(_step(ops=[42])), Code.INVALID_ARGUMENT, "ops[0]"),
    (
        "step alloc_options out of order",
        lambda s: s.sched.Step(
            _step(
                ops=[A, A],
                request_keys=[1, 1],
                alloc_num_new_tokens=[1, 1],
                alloc_num_computed_tokens=[40, 40],
                alloc_options=[
                    scheduler_pb2.StepAllocOptions(alloc_index=1),
                    scheduler_pb2.StepAllocOptions(alloc_index=0),
                ],
            )
        ),
        Code.INVALID_ARGUMENT,
        "alloc_index",
    ),
]


@pytest.mark.parametrize(("name", "call", "code", "named"), CASES, ids=[c[0] for c in CASES])
def test_error_has_its_status_and_changes_nothing(
    stubs: Stubs, name: str, call: Callable[[Stubs], Any], code: Code, named: str
) -> None:
    before = _state(stubs)
    with pytest.raises(grpc.RpcError) as caught:
        call(stubs)
    assert caught.value.code() == code, caught.value.details()
    assert named in caught.value.details()
    assert _state(stubs) == before


def test_a_rejected_step_carries_its_rejection_trailer(stubs: Stubs) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stubs.sched.Step(
            _step(
                ops=[A], request_keys=[7], alloc_num_new_tokens=[1], alloc_num_computed_tokens=[0]
            )
        )
    trailers = dict(caught.value.trailing_metadata())
    rejection = scheduler_pb2.StepRejection.FromString(trailers["kvcm-step-rejection-bin"])
    assert rejection.op_index == 0
    assert rejection.field == "request_keys[0]"
    assert rejection.reason == caught.value.details()
