"""ResyncPool over gRPC: a snapshot replaces a pool (or creates it); bad uploads change nothing.

The snapshot comes from a pool driven in-process through the core (what the vLLM mirror
uploads is built the same way); the server's pool must then answer as that pool does.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kvcm.client import (
    SchedulerClient,
    ServiceInvalidArgumentError,
    ServiceNotFoundError,
    ServiceResourceExhaustedError,
    StepBuilder,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import ItemStatus
from kvcm.core.snapshot import encode_pool
from kvcm.v1 import scheduler_pb2, service_pb2_grpc

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=512,
    hash_seed="resync",
    enable_kv_cache_events=True,
    explicit_layout=KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)
HASHER = BlockHasher(16, CONFIG.hash_algorithm, "resync")


def _admitted_pool() -> tuple[Pool, list[int]]:
    """A pool in-process: request 1 holds 3 blocks, request 2 finished (2 cached free)."""
    pool = Pool("local", CONFIG)
    step = StepBuilder()
    step.add_request(1, list(range(40)), HASHER.hash_token_ids(list(range(40))))
    step.allocate(1, 40, 0)
    prompt = [7] * 32
    step.add_request(2, prompt, HASHER.hash_token_ids(prompt))
    step.allocate(2, 32, 0)
    step.cache_blocks(1, 32)
    step.cache_blocks(2, 32)
    step.finish(2)
    program = step.build()
    program.step_seq = 1
    outcome = pool.run_step(program)
    assert outcome.alloc_statuses == [ItemStatus.OK, ItemStatus.OK]
    return pool, outcome.alloc_block_ids


def test_a_missing_pool_is_created_from_the_snapshot(client: SchedulerClient) -> None:
    pool, ids = _admitted_pool()
    epoch = client.resync_pool("resync-new", encode_pool(pool), CONFIG, step_seq=7)
    info = client.describe_pool("resync-new")
    assert epoch > 0
    assert info.num_requests == 1
    assert client.get_block_ids("resync-new", 1) == (ids[:3],)
    # step_seq continues from the snapshot's; the cached prompt of request 2 hits.
    step = StepBuilder()
    step.step_seq = 8
    step.add_request(3, [7] * 32 + [1], HASHER.hash_token_ids([7] * 32 + [1]))
    step.allocate(3, 33, 0, lookup=True)
    result = client.step("resync-new", step)
    found = result.lookup(0)
    assert found is not None
    assert found.num_computed_tokens == 32
    client.delete_pool("resync-new")


def test_an_existing_pool_is_replaced_as_a_new_incarnation(client: SchedulerClient) -> None:
    client.create_pool("resync-old", CONFIG)
    first = client.describe_pool("resync-old")
    pool, ids = _admitted_pool()
    events = client.subscribe_events("resync-old")
    epoch = client.resync_pool("resync-old", encode_pool(pool), CONFIG, step_seq=1)
    assert epoch > first.epoch
    with pytest.raises(ServiceNotFoundError):
        list(events)  # the old incarnation's stream ends
    assert client.get_block_ids("resync-old", 1) == (ids[:3],)
    client.delete_pool("resync-old")


def test_bad_uploads_change_nothing(client: SchedulerClient, kvcm_address: str) -> None:
    client.create_pool("resync-keep", CONFIG)
    before = client.describe_pool("resync-keep")
    pool, _ = _admitted_pool()
    data = encode_pool(pool)
    damaged = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(ServiceInvalidArgumentError, match="damaged"):
        client.resync_pool("resync-keep", damaged, CONFIG, step_seq=1)
    other = dataclasses.replace(
        CONFIG, explicit_layout=dataclasses.replace(CONFIG.explicit_layout, num_blocks=41)
    )
    with pytest.raises(ServiceInvalidArgumentError, match="blocks"):
        client.resync_pool("resync-keep", data, other, step_seq=1)
    huge = dataclasses.replace(
        CONFIG, explicit_layout=dataclasses.replace(CONFIG.explicit_layout, num_blocks=1 << 30)
    )
    with pytest.raises(ServiceResourceExhaustedError):
        client.resync_pool("resync-keep", data, huge, step_seq=1)
    with grpc.insecure_channel(kvcm_address) as channel:
        stub = service_pb2_grpc.SchedulerServiceStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as caught:
            stub.ResyncPool(iter([scheduler_pb2.ResyncPoolRequest(pool_id="resync-keep")]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "config" in (caught.value.details() or "")
    after = client.describe_pool("resync-keep")
    assert after.epoch == before.epoch
    assert after.num_requests == before.num_requests == 0
    client.delete_pool("resync-keep")
