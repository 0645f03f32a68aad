"""The event stream of a real server: every event once, in order, numbered; resume; limits."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvcm.client import (
    OutOfRangeError,
    PoolConfig,
    SchedulerClient,
    ServiceFailedPreconditionError,
    ServiceInvalidArgumentError,
    ServiceNotFoundError,
    StepBuilder,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.events import BlockRemoved, BlockStored, KVCacheEvent
from kvcm.common.specs import FullAttentionSpec
from kvcm.core import KVCacheManager, KVCacheManagerConfig, Request
from kvcm.wire import EventBatch

LAYOUT = KVCacheConfig(
    num_blocks=12,
    kv_cache_tensors=(),
    kv_cache_groups=(
        KVCacheGroupSpec(
            layer_names=("layer.0",),
            kv_cache_spec=FullAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16
            ),
        ),
    ),
)


def _config(**overrides: object) -> PoolConfig:
    return PoolConfig(
        max_model_len=1024,
        explicit_layout=LAYOUT,
        hash_algorithm="sha256_cbor",
        enable_kv_cache_events=True,
        **overrides,  # type: ignore[arg-type]
    )


def _churn(client: SchedulerClient, pool_id: str, rounds: int, first_key: int = 0) -> None:
    """Admit and finish requests of distinct prompts: stores, and evictions once full."""
    hasher = client.block_hasher(pool_id)
    for key in range(first_key, first_key + rounds):
        prompt = [key * 1000 + i for i in range(48)]
        step = StepBuilder()
        step.add_request(key, prompt, hasher.hash_token_ids(prompt))
        step.allocate(key, 48, 0, lookup=True)
        step.finish(key)
        client.step(pool_id, step)


def _read(stream: Iterator[EventBatch], num_events: int) -> tuple[list[EventBatch], list[object]]:
    batches: list[EventBatch] = []
    events: list[object] = []
    for batch in stream:
        batches.append(batch)
        events.extend(batch.events)
        if len(events) >= num_events:
            break
    return batches, events


def _view(event: KVCacheEvent) -> tuple[object, ...]:
    if isinstance(event, BlockStored):
        return ("stored", event.block_hashes, event.parent_block_hash, event.token_ids)
    if isinstance(event, BlockRemoved):
        return ("removed", event.block_hashes)
    return ("cleared",)


def test_every_event_once_in_order_and_equal_to_the_core(client: SchedulerClient) -> None:
    pool_id = "events-order"
    client.create_pool(pool_id, _config())
    stream = client.subscribe_events(pool_id, start_sequence=1)
    _churn(client, pool_id, 10)
    last = client.describe_pool(pool_id).last_event_sequence
    assert last > 10  # stores and, in a 12-block pool, evictions
    batches, events = _read(iter(stream), last)
    stream.close()
    assert batches[0].first_sequence == 1
    assert batches[0].oldest_sequence == 1
    expected_sequence = 1
    for batch in batches:
        if batch.events:
            assert batch.first_sequence == expected_sequence
            expected_sequence += len(batch.events)
    assert expected_sequence == last + 1

    # The same calls on an in-process core publish the same events.
    hasher = client.block_hasher(pool_id)
    manager = KVCacheManager(
        KVCacheManagerConfig(
            kv_cache_config=LAYOUT, max_model_len=1024, enable_kv_cache_events=True
        )
    )
    for key in range(10):
        request = Request(str(key), [key * 1000 + i for i in range(48)], block_hasher=hasher)
        hit = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, 48 - hit.num_computed_tokens, hit) is not None
        manager.free(request)
    assert [_view(e) for e in events] == [_view(e) for e in manager.take_events()]  # type: ignore[arg-type]
    client.delete_pool(pool_id)


def test_resume_from_a_sequence_number(client: SchedulerClient) -> None:
    pool_id = "events-resume"
    client.create_pool(pool_id, _config())
    _churn(client, pool_id, 4)
    last = client.describe_pool(pool_id).last_event_sequence
    with client.subscribe_events(pool_id, start_sequence=1) as stream:
        _, everything = _read(iter(stream), last)
    middle = last // 2
    with client.subscribe_events(pool_id, start_sequence=middle + 1) as stream:
        batches, rest = _read(iter(stream), last - middle)
    assert batches[0].first_sequence == middle + 1
    assert rest == everything[middle:]
    client.delete_pool(pool_id)


def test_live_edge_subscription_sees_only_new_events(client: SchedulerClient) -> None:
    pool_id = "events-live"
    client.create_pool(pool_id, _config())
    _churn(client, pool_id, 2)
    before = client.describe_pool(pool_id).last_event_sequence
    stream = client.subscribe_events(pool_id)
    received: list[EventBatch] = []
    first = next(iter(stream))
    assert first.first_sequence == before + 1
    thread = threading.Thread(target=lambda: received.append(next(iter(stream))), daemon=True)
    thread.start()
    _churn(client, pool_id, 1, first_key=100)
    thread.join(timeout=10)
    stream.close()
    assert received
    assert received[0].first_sequence == before + 1
    client.delete_pool(pool_id)


def test_too_old_future_disabled_and_deleted(client: SchedulerClient) -> None:
    pool_id = "events-limits"
    client.create_pool(pool_id, _config(event_retention_num_events=4))
    _churn(client, pool_id, 4)
    last = client.describe_pool(pool_id).last_event_sequence
    assert last > 4
    with pytest.raises(OutOfRangeError):
        next(iter(client.subscribe_events(pool_id, start_sequence=1)))
    with pytest.raises(ServiceInvalidArgumentError):
        next(iter(client.subscribe_events(pool_id, start_sequence=last + 2)))
    with client.subscribe_events(pool_id, start_sequence=last - 3) as stream:
        _, kept = _read(iter(stream), 4)
    assert len(kept) == 4

    stream = client.subscribe_events(pool_id)
    iterator = iter(stream)
    next(iterator)  # the first message: the stream is open
    client.delete_pool(pool_id)
    with pytest.raises(ServiceNotFoundError):
        next(iterator)

    client.create_pool("events-off", PoolConfig(max_model_len=1024, explicit_layout=LAYOUT))
    with pytest.raises(ServiceFailedPreconditionError):
        next(iter(client.subscribe_events("events-off")))
    client.delete_pool("events-off")
