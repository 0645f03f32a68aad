"""Event streams that cannot mislead: pool epochs, ends on deletion, the subscriber limit."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvcm.client import (
    PoolConfig,
    SchedulerClient,
    ServiceFailedPreconditionError,
    ServiceNotFoundError,
    ServiceResourceExhaustedError,
    StepBuilder,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.limits import Limits
from kvcm.server.embedded import start_embedded_server
from kvcm.server.settings import ServerSettings

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
CONFIG = PoolConfig(
    max_model_len=1024,
    explicit_layout=LAYOUT,
    hash_algorithm="sha256_cbor",
    enable_kv_cache_events=True,
    event_retention_num_events=100_000,
)


def _churn(client: SchedulerClient, pool_id: str, rounds: int) -> None:
    """Admit and finish requests of distinct prompts: stores, and evictions once full."""
    hasher = client.block_hasher(pool_id)
    for key in range(rounds):
        prompt = [key * 1000 + i for i in range(48)]
        step = StepBuilder()
        step.add_request(key, prompt, hasher.hash_token_ids(prompt))
        step.allocate(key, 48, 0, lookup=True)
        step.finish(key)
        client.step(pool_id, step)


def test_a_recreated_pool_has_a_larger_epoch_and_refuses_old_positions(
    client: SchedulerClient,
) -> None:
    pool_id = "epoch-pool"
    client.create_pool(pool_id, CONFIG)
    first = client.describe_pool(pool_id).epoch
    assert first >= 1
    _churn(client, pool_id, 3)
    with client.subscribe_events(pool_id, start_sequence=1, expected_epoch=first) as stream:
        batches = iter(stream)
        opening = next(batches)
        assert opening.pool_epoch == first
        assert next(batches).pool_epoch == first
    old_last = client.describe_pool(pool_id).last_event_sequence

    client.delete_pool(pool_id)
    client.create_pool(pool_id, CONFIG)
    second = client.describe_pool(pool_id).epoch
    assert second > first
    _churn(client, pool_id, 3)
    assert client.describe_pool(pool_id).last_event_sequence >= old_last  # positions overlap

    # The old subscriber's position is valid in the new log, yet it is refused.
    stale = client.subscribe_events(pool_id, start_sequence=old_last, expected_epoch=first)
    with pytest.raises(ServiceFailedPreconditionError) as refused:
        next(iter(stale))
    assert f"epoch {second}" in str(refused.value)
    assert f"expected_epoch {first}" in str(refused.value)
    # With the current epoch (or none) the same position resumes.
    with client.subscribe_events(pool_id, start_sequence=1, expected_epoch=second) as stream:
        batches = iter(stream)
        assert next(batches).pool_epoch == second
        batch = next(batches)
        assert batch.first_sequence == 1
        assert batch.events
    client.delete_pool(pool_id)


def test_a_backed_up_subscriber_of_a_deleted_pool_ends_with_not_found(
    client: SchedulerClient, kvcm_address: str
) -> None:
    pool_id = "backed-up"
    client.create_pool(pool_id, CONFIG)
    # A reader with a small, fixed receive window: the server's writes block soon.
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    reader = SchedulerClient(kvcm_address, timeout=10.0, channel_options=small_window)
    stream = reader.subscribe_events(pool_id, start_sequence=1, max_events_per_message=1)
    batches = iter(stream)
    next(batches)  # open; then read nothing while events pile up past flow control
    _churn(client, pool_id, 400)
    published = client.describe_pool(pool_id).last_event_sequence
    time.sleep(0.2)  # let the server fill the stream's window and block on its write
    client.delete_pool(pool_id)
    started = time.monotonic()
    arrived: list[object] = []
    with pytest.raises(ServiceNotFoundError):
        arrived.extend(event for batch in batches for event in batch.events)
    received = len(arrived)
    assert time.monotonic() - started < 5.0
    # Only what was already on its way arrived: the deleted pool's later events did not.
    assert received < published
    stream.close()
    reader.close()


@pytest.fixture
def limited_client() -> Iterator[SchedulerClient]:
    """A client of a server of its own that allows 2 subscriptions per pool."""
    settings = ServerSettings(
        grpc_address="127.0.0.1:0",
        http_address="127.0.0.1:0",
        log_level="WARNING",
        limits=Limits(max_subscribers_per_pool=2),
    )
    running = start_embedded_server(settings)
    try:
        with SchedulerClient(running.grpc_address, timeout=10.0) as client:
            yield client
    finally:
        running.stop(grace_s=1.0)


def test_subscribers_per_pool_are_bounded(limited_client: SchedulerClient) -> None:
    client = limited_client
    client.create_pool("a", CONFIG)
    client.create_pool("b", CONFIG)
    streams = [client.subscribe_events("a") for _ in range(2)]
    for stream in streams:
        next(iter(stream))
    with pytest.raises(ServiceResourceExhaustedError) as refused:
        next(iter(client.subscribe_events("a")))
    assert "max_subscribers_per_pool" in str(refused.value)
    assert "2" in str(refused.value)
    with client.subscribe_events("b") as other:  # the limit is per pool
        next(iter(other))
    # A closed subscription frees its place.
    streams.pop().close()
    deadline = time.monotonic() + 5.0
    while True:
        try:
            with client.subscribe_events("a") as again:
                next(iter(again))
            break
        except ServiceResourceExhaustedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    # Deleting the pool ends the remaining one with NOT_FOUND.
    remaining = iter(streams[0])
    client.delete_pool("a")
    with pytest.raises(ServiceNotFoundError):
        next(remaining)
