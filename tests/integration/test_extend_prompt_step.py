"""EXTEND_PROMPT as a Step op (a streaming-input session's next chunk): the SDK's
StepBuilder through a real server over gRPC, the same programs in process, and rejections
that name the entry and change nothing."""

from __future__ import annotations

import pytest
from test_sdk_trace import full_attention_layout

from kvcm.client import ItemStatus, PoolConfig, SchedulerClient, StepBuilder, StepResult
from kvcm.client._errors import ServiceInvalidArgumentError
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.hashing import BlockHasher
from kvcm.core.pool import Pool
from kvcm.server.embedded import EmbeddedServer
from kvcm.wire import program_from_proto, program_to_proto


def _config() -> PoolConfig:
    return PoolConfig(max_model_len=1024, explicit_layout=full_attention_layout(num_blocks=64))


def test_extend_prompt_over_grpc_moves_the_server_prompt_as_in_process(
    client: SchedulerClient, kvcm_server: EmbeddedServer
) -> None:
    client.create_pool("extend-prompt", _config())
    local = Pool("extend-prompt", _config())
    hashing = local.hashing
    hasher = BlockHasher(hashing.hash_block_size, hashing.algorithm, hashing.seed)
    prompt = list(range(1, 21))
    chunk = list(range(100, 130))
    first = StepBuilder()
    first.add_request(1, prompt, list(hasher.hash_token_ids(prompt)), request_id="session")
    first.allocate(1, len(prompt), 0)
    # The session's next chunk: its tokens, then the prompt's new end, then its prefill.
    second = StepBuilder()
    hashes = hasher.hash_token_ids(prompt + chunk)
    second.append_tokens(1, chunk, hashes[1:])
    second.extend_prompt(1, len(prompt) + len(chunk))
    second.allocate(1, len(chunk), len(prompt))
    for builder in (first, second):
        program = builder.build()
        assert program_from_proto(program_to_proto(program, "extend-prompt")) == program
        remote = client.step("extend-prompt", builder)
        in_process = StepResult.of(builder, local.run_step(program))
        assert remote.outcome == in_process.outcome
        assert remote.statuses == [ItemStatus.OK]
    assert local.requests[1].num_prompt_tokens == 50

    async def server_prompt() -> list[int]:
        pool = await kvcm_server.server.state.pool("extend-prompt")
        request = pool.requests[1]
        assert request.num_prompt_tokens == len(request.prompt_token_ids)
        return list(request.prompt_token_ids)

    assert kvcm_server.call(server_prompt()) == prompt + chunk

    def extend(end: int) -> StepBuilder:
        builder = StepBuilder()
        builder.extend_prompt(1, end)
        return builder

    # Past the tokens, and below the prompt's end: refused naming the entry, nothing changed.
    before = local.state_fingerprint()
    for end in (51, 49):
        with pytest.raises(ServiceInvalidArgumentError) as info:
            client.step("extend-prompt", extend(end))
        assert info.value.field == "extend_prompt_num_tokens[0]"
        assert info.value.op_index == 0
        with pytest.raises(InvalidArgumentError) as local_info:
            local.run_step(extend(end).build())
        assert local_info.value.field == "extend_prompt_num_tokens[0]"
    assert local.state_fingerprint() == before
    assert kvcm_server.call(server_prompt()) == prompt + chunk
    # The server's end is 50: the same end again is accepted (a no-op).
    client.step("extend-prompt", extend(50))
    client.delete_pool("extend-prompt")
