"""The SDK's StepBuilder builds the core's StepProgram: run in-process by ``Pool.run_step`` it
answers exactly what the server answers over gRPC, and a rejected program changes nothing."""

from __future__ import annotations

import pytest
from test_sdk_trace import full_attention_layout

from kvcm.client import ItemStatus, PoolConfig, SchedulerClient, StepBuilder, StepResult
from kvcm.client._errors import ServiceError
from kvcm.common.hashing import BlockHasher
from kvcm.core.pool import Pool


def _config() -> PoolConfig:
    return PoolConfig(max_model_len=1024, explicit_layout=full_attention_layout(num_blocks=64))


def _steps(hasher: BlockHasher) -> list[StepBuilder]:
    prompt = list(range(100))
    hashes = hasher.hash_token_ids(prompt)
    first = StepBuilder(token_budget=512)
    first.add_request(1, prompt, hashes, request_id="a")
    first.allocate(1, 100, 0, lookup=True)
    first.cache_blocks(1, 100)
    second = StepBuilder(token_budget=512)
    second.new_step_starts()
    second.add_request(2, prompt, hashes, request_id="b")
    second.allocate(2, 100, 0, lookup=True)
    second.decode([1], [7], [100])
    second.finish(1)
    second.reset_prefix_cache()
    return [first, second]


def test_builder_program_in_process_equals_grpc(client: SchedulerClient) -> None:
    client.create_pool("sdk-program", _config())
    local = Pool("sdk-program", _config())
    hasher = client.block_hasher("sdk-program")
    for builder in _steps(hasher):
        remote = client.step("sdk-program", builder)
        in_process = StepResult.of(builder, local.run_step(builder.build()))
        assert remote.outcome == in_process.outcome
        assert remote.statuses == in_process.statuses
    assert remote.resets == [False]


def test_step_accepts_a_core_program(client: SchedulerClient) -> None:
    client.create_pool("sdk-program-raw", _config())
    builder = StepBuilder()
    builder.add_request(1, [1, 2, 3], request_id="a")
    builder.allocate(1, 3, 0)
    result = client.step("sdk-program-raw", builder.build())
    assert result.statuses == [ItemStatus.OK]
    assert result.blocks(0) is not None


def test_rejected_step_leaves_the_key_free(client: SchedulerClient) -> None:
    client.create_pool("sdk-program-reject", _config())
    bad = StepBuilder()
    bad.add_request(5, [1, 2, 3], request_id="a")
    bad.cache_blocks(99, 3)  # unknown request: the server refuses the whole program
    with pytest.raises(ServiceError):
        client.step("sdk-program-reject", bad)
    again = StepBuilder()
    again.add_request(5, [1, 2, 3], request_id="a")
    again.allocate(5, 3, 0)
    assert client.step("sdk-program-reject", again).statuses == [ItemStatus.OK]
