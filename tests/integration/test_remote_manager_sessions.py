"""RemoteKVCacheManager follows a streaming-input session's prompt end (EXTEND_PROMPT).

vLLM's scheduler updates a resumable request in place when its next input chunk arrives
(``_update_request_as_session``): the last sampled token is dropped, the kept outputs and the
chunk join the prompt, and ``num_prompt_tokens`` moves. The manager sends the chunk's tokens
and then the new prompt end, so the server's request is the scheduler's; driven beside kvcm's
in-process manager on a hybrid sliding-window pool, every answer is the same.
"""

from __future__ import annotations

from kvcm.client import PoolConfig, RemoteKVCacheManager, SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec, SlidingWindowSpec
from kvcm.core import KVCacheManager, KVCacheManagerConfig, Request
from kvcm.server.embedded import EmbeddedServer

MAX_MODEL_LEN = 1024


def _layout() -> KVCacheConfig:
    common = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": DType.BFLOAT16}
    return KVCacheConfig(
        num_blocks=200,
        kv_cache_tensors=(),
        kv_cache_groups=(
            KVCacheGroupSpec(layer_names=("full.0",), kv_cache_spec=FullAttentionSpec(**common)),
            KVCacheGroupSpec(
                layer_names=("swa.0",),
                kv_cache_spec=SlidingWindowSpec(sliding_window=32, **common),
            ),
        ),
    )


def _next_chunk(request: Request, chunk: list[int]) -> None:
    """What vLLM's _update_request_as_session does to the request."""
    keep_end = request.num_tokens - 1
    kept = request.all_token_ids[request.num_prompt_tokens : keep_end]
    del request.all_token_ids[keep_end:]
    del request.block_hashes[keep_end // 16 :]
    request.prompt_token_ids.extend(kept)
    request.all_token_ids.extend(chunk)
    request.prompt_token_ids.extend(chunk)
    request.update_block_hashes()
    request.num_prompt_tokens = len(request.prompt_token_ids)


def test_a_session_chunk_moves_the_server_prompt_end(kvcm_server: EmbeddedServer) -> None:
    server = kvcm_server
    layout = _layout()
    pool_id = "remote-sessions"
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool(pool_id, PoolConfig(max_model_len=MAX_MODEL_LEN, explicit_layout=layout))
        remote = RemoteKVCacheManager(client, pool_id, last_step_seq=0)
        local = KVCacheManager(
            KVCacheManagerConfig(kv_cache_config=layout, max_model_len=MAX_MODEL_LEN)
        )
        hasher = remote.block_hasher
        prompt = [(7 * i) % 997 for i in range(40)]
        pair = [Request("session", list(prompt), block_hasher=hasher) for _ in range(2)]
        managers = (remote, local)

        def allocate(num_new: int) -> None:
            answers = [
                manager.allocate_slots(request, num_new)
                for manager, request in zip(managers, pair, strict=True)
            ]
            assert answers[0] is not None
            assert answers[1] is not None
            assert answers[0].get_block_ids() == answers[1].get_block_ids()
            for request in pair:
                request.num_computed_tokens += num_new

        def decode(count: int, seed: int) -> None:
            for index in range(count):
                for request in pair:
                    request.append_output_token_ids((seed + index) % 997)
                if index < count - 1:  # the last sampled token ends the chunk
                    allocate(1)

        allocate(len(prompt))
        decode(6, 500)
        ends = []
        for number, size in enumerate((23, 17)):
            chunk = [(13 * i + number) % 997 for i in range(size)]
            for request in pair:
                _next_chunk(request, chunk)
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            local_request = pair[1]
            allocate(local_request.num_tokens - local_request.num_computed_tokens)
            remote.flush()
            ends.append(local_request.num_prompt_tokens)

            async def read() -> tuple[int, list[int], tuple[list[int], ...]]:
                pool = await server.server.state.pool(pool_id)
                (key,) = [k for k, rid in pool.request_ids.items() if rid == "session"]
                request = pool.requests[key]
                manager = pool.ready_manager()
                blocks = manager.get_block_ids(request.request_id)
                return request.num_prompt_tokens, list(request.prompt_token_ids), blocks

            end, server_prompt, blocks = server.call(read())
            assert end == local_request.num_prompt_tokens
            assert server_prompt == local_request.prompt_token_ids
            assert blocks == local.get_block_ids("session")
            decode(4, 700 + number)
        assert ends == sorted(set(ends))
        assert ends[0] > len(prompt)
        remote.close()
        client.delete_pool(pool_id)
