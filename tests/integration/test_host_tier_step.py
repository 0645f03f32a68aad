"""The host tier through Step over gRPC: host-hit admission, swap-out and swap-in.

A real server on 127.0.0.1 runs Steps built with the SDK's StepBuilder on a pool with a host
tier; an in-process core Pool of the same config runs the same programs. Every answer
(blocks, hits, the tier's device-to-host and host-to-device copies) must be the same, and
must say what happened: a prefix evicted from the device demotes to the tier and is admitted
back as host hits with its loads; a swapped-out request comes back with every block copied.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kvcm.client import SchedulerClient, StepBuilder
from kvcm.client._errors import ServiceFailedPreconditionError
from kvcm.client._step import StepResult
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import ItemStatus
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
POOL = "tiered"
LAYOUT = KVCacheConfig(
    num_blocks=17,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)
CONFIG = PoolConfig(
    max_model_len=512, host_tier_bytes=32 * SPEC.page_size_bytes, explicit_layout=LAYOUT
)
PROMPT = list(range(64))  # four blocks


def _pairs(ids: list[int]) -> list[tuple[int, int]]:
    return list(zip(ids[::2], ids[1::2], strict=True))


def test_host_hits_and_swaps_through_step_match_the_core(tmp_path: Path) -> None:
    server = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", data_dir=str(tmp_path))
    )
    local = Pool(POOL, CONFIG)
    try:
        with SchedulerClient(server.grpc_address) as client:
            client.create_pool(POOL, CONFIG)
            hasher = client.block_hasher(POOL)
            seq = 0

            def run(step: StepBuilder) -> StepResult:
                nonlocal seq
                seq += 1
                step.step_seq = seq
                program = copy.deepcopy(step.build())
                remote = client.step(POOL, step)
                expected = StepResult.of(step, local.run_step(program))
                assert remote.num_ops_executed == expected.num_ops_executed
                assert remote.host_allocations == expected.host_allocations
                assert remote.host_copies == expected.host_copies
                assert remote.swapped_out == expected.swapped_out
                return remote

            def admit_and_finish(key: int, tokens: list[int]) -> None:
                step = StepBuilder()
                step.add_request(key, tokens, hasher.hash_token_ids(tokens))
                step.allocate(key, len(tokens), 0, lookup=True)
                step.cache_blocks(key, len(tokens))
                step.finish(key)
                step.take_host_copies()
                run(step)

            admit_and_finish(1, PROMPT)
            # A request of 16 fresh blocks evicts the prompt's cached blocks: they demote.
            step = StepBuilder()
            flood = [5000 + i for i in range(16 * 16)]
            step.add_request(2, flood, hasher.hash_token_ids(flood))
            step.allocate(2, len(flood), 0, lookup=True)
            step.cache_blocks(2, len(flood))
            step.finish(2)
            step.take_host_copies()
            ((demoted, loaded),) = run(step).host_copies
            assert len(demoted) == 4
            assert loaded == []

            # The prompt again, with three new tokens: admitted with a 64-token host hit,
            # its four blocks loaded from the host blocks they demoted to.
            step = StepBuilder()
            tokens = [*PROMPT, 7, 8, 9]
            step.add_request(3, tokens, hasher.hash_token_ids(tokens))
            step.admit_with_host(3, 100)
            step.take_host_copies()
            result = run(step)
            ((admitted),) = result.host_allocations
            assert admitted.status is ItemStatus.OK
            assert (admitted.num_device_hit_tokens, admitted.num_host_hit_tokens) == (0, 64)
            ((_, loads),) = result.host_copies
            assert sorted(host for host, _ in loads) == sorted(host for _, host in demoted)
            assert [device for _, device in loads] == admitted.block_ids[0][:4]

            # Swap the running request out (its loaded blocks are in the tier already: only
            # the partial block is copied), flood the device, and swap it back in: every
            # block comes back from the host.
            step = StepBuilder()
            step.cache_blocks(3, len(tokens))
            run(step)
            step = StepBuilder()
            step.swap_out(3, len(tokens))
            step.take_host_copies()
            result = run(step)
            assert result.swapped_out == [True]
            ((out, _),) = result.host_copies
            assert [device for device, _ in out] == [admitted.block_ids[0][4]]
            admit_and_finish(4, [9000 + i for i in range(16 * 16)])
            step = StepBuilder()
            step.swap_in(3, 1)
            step.take_host_copies()
            result = run(step)
            ((back),) = result.host_allocations
            assert back.status is ItemStatus.OK
            assert (back.num_device_hit_tokens, back.num_host_hit_tokens) == (0, len(tokens))
            ((_, loads),) = result.host_copies
            assert [device for _, device in loads] == back.block_ids[0]
            assert loads[4][0] == out[0][1]  # the partial block from where it was swapped

            # A bad op is refused naming the field, and the pool goes on.
            step = StepBuilder()
            step.swap_in(3, 1)  # running now, not swapped
            with pytest.raises(ServiceFailedPreconditionError) as info:
                client.step(POOL, step)
            assert info.value.field == "request_keys[0]"
            assert info.value.op_index == 0
    finally:
        server.stop()


def test_a_pool_without_a_tier_refuses_host_ops_naming_host_tier_bytes(tmp_path: Path) -> None:
    server = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", data_dir=str(tmp_path))
    )
    try:
        with SchedulerClient(server.grpc_address) as client:
            client.create_pool(POOL, PoolConfig(max_model_len=512, explicit_layout=LAYOUT))
            step = StepBuilder()
            step.take_host_copies()
            with pytest.raises(ServiceFailedPreconditionError, match="host_tier_bytes") as info:
                client.step(POOL, step)
            assert info.value.field == "config.host_tier_bytes"
    finally:
        server.stop()


def test_a_request_swapped_out_through_step_survives_a_restart(tmp_path: Path) -> None:
    # Swapped out on one server, which then stops; the restarted server swaps it back in
    # exactly as an in-process pool that never stopped.
    def start() -> EmbeddedServer:
        return start_embedded_server(
            ServerSettings(grpc_address="127.0.0.1:0", http_address="", data_dir=str(tmp_path))
        )

    local = Pool(POOL, CONFIG)
    tokens = [*PROMPT, 7, 8, 9]
    server = start()
    try:
        with SchedulerClient(server.grpc_address) as client:
            client.create_pool(POOL, CONFIG)
            step = StepBuilder(step_seq=1)
            step.add_request(1, tokens, client.block_hasher(POOL).hash_token_ids(tokens))
            step.allocate(1, len(tokens), 0, lookup=True)
            step.cache_blocks(1, len(tokens))
            local.run_step(copy.deepcopy(step.build()))
            client.step(POOL, step)
            step = StepBuilder(step_seq=2)
            step.swap_out(1, len(tokens))
            step.take_host_copies()
            expected = StepResult.of(step, local.run_step(copy.deepcopy(step.build())))
            result = client.step(POOL, step)
            assert result.swapped_out == expected.swapped_out == [True]
            assert result.host_copies == expected.host_copies
            assert len(result.host_copies[0][0]) == 5
    finally:
        server.stop()  # a graceful stop: the pool goes to the checkpoint
    server = start()
    try:
        with SchedulerClient(server.grpc_address) as client:
            step = StepBuilder(step_seq=3)
            step.swap_in(1, 1)
            step.take_host_copies()
            expected = StepResult.of(step, local.run_step(copy.deepcopy(step.build())))
            result = client.step(POOL, step)
            assert result.host_allocations == expected.host_allocations
            assert result.host_copies == expected.host_copies
            ((back),) = result.host_allocations
            assert back.status is ItemStatus.OK
            assert back.num_device_hit_tokens + back.num_host_hit_tokens == len(tokens)
    finally:
        server.stop()
