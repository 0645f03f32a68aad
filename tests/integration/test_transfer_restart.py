"""P/D transfer leases across a restart: a Step retried right after it tracks its transfers.

A Step that allocated with ``delay_cache_blocks`` starts the transfer lease of those requests.
After a graceful stop (a checkpoint) the pool answers a retry of that Step from the outcome it
restored; the retry must start the leases again as the first answer did, so a transfer lost
across the restart is still freed when its lease runs out.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvcm.client import SchedulerClient, SlotOptions, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

LEASE_S = 0.4
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=512,
    explicit_layout=KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)


def _start(data_dir: Path) -> EmbeddedServer:
    return start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="",
            data_dir=str(data_dir),
            transfer_lease_s=LEASE_S,
        )
    )


def _transfers(server: EmbeddedServer) -> set[tuple[str, int]]:
    async def read() -> set[tuple[str, int]]:
        return set(server.server.state.transfers)

    return server.call(read())


def _step(client: SchedulerClient) -> StepBuilder:
    hasher = client.block_hasher("decode")
    step = StepBuilder()
    step.step_seq = 1
    for key in (1, 2):  # two remote prefills whose KV is on its way; 3 is local
        prompt = [key] * 40
        step.add_request(key, prompt, hasher.hash_token_ids(prompt))
        step.allocate(key, 40, 0, options=SlotOptions(delay_cache_blocks=True))
    prompt = [3] * 40
    step.add_request(3, prompt, hasher.hash_token_ids(prompt))
    step.allocate(3, 40, 0)
    return step


def test_a_step_retried_after_a_restart_tracks_its_transfers_again(tmp_path: Path) -> None:
    server = _start(tmp_path / "data")
    try:
        with SchedulerClient(server.grpc_address) as client:
            client.create_pool("decode", CONFIG)
            first = client.step("decode", _step(client))
        assert _transfers(server) == {("decode", 1), ("decode", 2)}
    finally:
        server.stop()  # a checkpoint: the retry is answered from the restored outcome
    again = _start(tmp_path / "data")
    try:
        assert _transfers(again) == set()  # leases are not state: none until the retry
        with SchedulerClient(again.grpc_address) as client:
            retried = client.step("decode", _step(client))
            assert retried.outcome == first.outcome  # the same answer, nothing re-run
            assert _transfers(again) == {("decode", 1), ("decode", 2)}
            deadline = LEASE_S * 10
            started = time.monotonic()
            while client.describe_pool("decode").num_requests != 1:
                assert time.monotonic() - started < deadline, "the lost transfers were kept"
                time.sleep(0.02)
            assert client.get_block_ids("decode", 3) != ([],)  # not a transfer: untouched
        assert again.server.state.reclaims == {("decode", "transfer"): 2}
    finally:
        again.stop()


def test_a_step_retried_after_a_restart_answers_its_copies_again(tmp_path: Path) -> None:
    """A Step's copies are an answer, not state, but an answer lost with a restart is retried:
    the retry must hand the workers the same (source, destination) copies as the first."""
    prompt = list(range(16 + 3))  # one full block and a partial one
    first_step = StepBuilder()
    first_step.step_seq = 1
    first_step.add_request(1, prompt, request_id="a")
    first_step.allocate(1, len(prompt), 0)
    fork_step = StepBuilder()
    fork_step.step_seq = 2
    fork_step.fork(1, 2, len(prompt))
    for key in (1, 2):
        fork_step.append_tokens(key, [500 + key])
    fork_step.decode([1, 2], [1, 1], [len(prompt)] * 2)
    server = _start(tmp_path / "data")
    try:
        with SchedulerClient(server.grpc_address) as client:
            client.create_pool("forks", CONFIG)
            client.step("forks", first_step)
            first = client.step("forks", fork_step)
    finally:
        server.stop()  # a checkpoint holding the last answer
    assert len(first.copies) == 1  # the parent's write into the shared partial block
    again = _start(tmp_path / "data")
    try:
        with SchedulerClient(again.grpc_address) as client:
            retried = client.step("forks", fork_step)
    finally:
        again.stop()
    assert retried.outcome == first.outcome
    assert retried.copies == first.copies
