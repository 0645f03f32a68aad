"""Long Steps run off the event loop in their pool's lane; everything else keeps answering.

A Step estimated to cost more than a few milliseconds runs in a worker thread while its pool
is lent (``ServerState.run_in_lane``): calls on other pools are served on the loop meanwhile,
calls on the same pool wait for it, and the outcome is exactly the in-process core's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvcm.client import PoolConfig, SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import Pool
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
NUM_REQUESTS = 512
PROMPT_TOKENS = 200
# CI machines are slow and shared: generous, yet far below what the big Steps take in all.
MAX_PROBE_S = 0.2


def _config() -> PoolConfig:
    layout = KVCacheConfig(
        num_blocks=NUM_REQUESTS * (PROMPT_TOKENS // 16 + 2) + 2,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=SPEC),),
    )
    return PoolConfig(max_model_len=1024, explicit_layout=layout, enable_kv_cache_events=True)


def _admit_many(first_key: int) -> StepBuilder:
    """A Step that admits NUM_REQUESTS prompts (well above the inline budget)."""
    step = StepBuilder()
    for key in range(first_key, first_key + NUM_REQUESTS):
        prompt = [(key * 7 + i) % 50000 for i in range(PROMPT_TOKENS)]
        step.add_request(key, prompt, request_id=f"r{key}")
        step.allocate(key, PROMPT_TOKENS, 0, lookup=True)
    return step


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0")
    )
    try:
        yield running
    finally:
        running.stop(grace_s=1.0)


def test_a_long_step_leaves_other_pools_answering(server: EmbeddedServer) -> None:
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("big", _config())
        client.create_pool("probe", _config())
        results = []

        def send() -> None:
            with SchedulerClient(server.grpc_address) as own:
                for round_index in range(3):
                    results.append(own.step("big", _admit_many(round_index * NUM_REQUESTS)))

        busy = threading.Thread(target=send)
        samples = []
        busy.start()
        while busy.is_alive():
            started = time.perf_counter()
            client.describe_pool("probe")
            samples.append(time.perf_counter() - started)
        busy.join()
        samples.sort()
        assert len(results) == 3
        assert samples, "the probe never ran"
        assert samples[int(0.95 * (len(samples) - 1))] < MAX_PROBE_S, samples[-5:]


def test_a_lent_pool_answers_like_the_core_and_serializes_its_calls(
    server: EmbeddedServer,
) -> None:
    config = _config()
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("same", config)
        steps = [_admit_many(0), _admit_many(NUM_REQUESTS)]
        answers: list[object] = []

        def send() -> None:
            with SchedulerClient(server.grpc_address) as own:
                answers.append(own.step("same", steps[0]))

        busy = threading.Thread(target=send)
        busy.start()
        time.sleep(0.01)
        # Queued behind the long Step on the same pool, never interleaved with it.
        usage_during = client.get_usage("same")
        busy.join()
        second = client.step("same", steps[1])

        reference = Pool("same", config)
        expected_first = reference.run_step(steps[0].build())
        free_after_first = reference.ready_manager().num_free_blocks
        expected_second = reference.run_step(steps[1].build())
        first = answers[0]
        assert first.outcome == expected_first  # type: ignore[attr-defined]
        assert second.outcome == expected_second
        served = server.server.state.registry.get("same")
        assert not served.lent
        served.publish_events(0.0)
        reference.publish_events(0.0)
        assert served.state_fingerprint() == reference.state_fingerprint()
        # The usage read either before the Step started or after it ended: all or nothing.
        assert config.explicit_layout is not None
        initial_free = config.explicit_layout.num_blocks - 1  # all but the null block
        assert usage_during.num_free_blocks in (initial_free, free_after_first)
