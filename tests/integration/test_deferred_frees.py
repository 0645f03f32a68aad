"""FINISH_DEFERRED, TAKE_BLOCK_COPIES_RETAINED and RELEASE_BLOCK_COPIES: vLLM's deferred frees
(an asynchronous KV consumer, docs/mamba.md) on a hybrid full attention + align-mode Mamba
pool (hash block 64 under blocks of 256), through a real server over gRPC and in process: a
retained drain keeps its blocks referenced until released, oldest first, and survives a
snapshot and a server restart; a release with nothing retained is refused naming the op and
changes nothing; a deferred finish frees every group in one pool call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_take_block_copies import OTHER, SHARED, _config, _hasher, _steps

from kvcm.client import SchedulerClient, StepBuilder, StepResult
from kvcm.client._errors import ServiceFailedPreconditionError
from kvcm.core.invariants import pool_violations
from kvcm.core.pool import Pool
from kvcm.core.snapshot import decode_pool, encode_pool
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

POOL = "deferred-frees"


def _server_pool(server: EmbeddedServer) -> Pool:
    async def read() -> Pool:
        return await server.server.state.pool(POOL)

    return server.call(read())


def _run(pool: Pool, seq: int, build: Any) -> StepResult:
    step = StepBuilder(step_seq=seq)
    build(step)
    return StepResult.of(step, pool.run_step(step.build()))


def _drain_steps(pool: Pool) -> list[Any]:
    def retaining(build: Any) -> Any:
        def run(s: StepBuilder) -> None:
            build(_Retaining(s))

        return run

    return [retaining(build) for build in _steps(_hasher(pool))]


class _Retaining:
    """A StepBuilder whose take_block_copies retains its drain."""

    def __init__(self, step: StepBuilder) -> None:
        self._step = step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)

    def take_block_copies(self) -> None:
        self._step.take_block_copies(retain=True)


def _ref_cnts(pool: Pool) -> list[int]:
    assert pool.manager is not None
    return [block.ref_cnt for block in pool.manager.block_pool.blocks]


def test_retained_drains_hold_their_blocks_until_released_over_grpc(tmp_path: Path) -> None:
    settings = ServerSettings(grpc_address="127.0.0.1:0", http_address="", data_dir=str(tmp_path))
    server = start_embedded_server(settings)
    local, plain = Pool(POOL, _config()), Pool(POOL, _config())
    try:
        with SchedulerClient(server.grpc_address) as client:
            client.create_pool(POOL, _config())
            drains = []
            for seq, (build, plain_build) in enumerate(
                zip(_drain_steps(local), _steps(_hasher(plain)), strict=True), start=1
            ):
                step = StepBuilder(step_seq=seq)
                build(step)
                remote = client.step(POOL, step)
                in_process = StepResult.of(step, local.run_step(step.build()))
                assert remote.outcome == in_process.outcome
                # Answered as TAKE_BLOCK_COPIES answers.
                assert remote.drained_copies == _run(plain, seq, plain_build).drained_copies
                drains += remote.drained_copies
            assert [len(drain) for drain in drains] == [0, 1, 2]
            assert local.manager is not None
            retained = [
                [block.block_id for block in batch] for batch in local.manager.retained_copy_batches
            ]
            assert retained == [[], *([i for pair in d for i in pair] for d in drains[1:])]
            # Every retained end holds one reference more than in the pool that released it.
            extra = [a - b for a, b in zip(_ref_cnts(local), _ref_cnts(plain), strict=True)]
            expected = [0] * len(extra)
            for pair in drains[1] + drains[2]:
                for block_id in pair:
                    expected[block_id] += 1
            assert extra == expected
            assert not list(pool_violations(local))
            assert _server_pool(server).state_fingerprint() == local.state_fingerprint()

        # A restart on the data directory keeps the retained drains.
        server.stop()
        server = start_embedded_server(settings)
        assert _server_pool(server).state_fingerprint() == local.state_fingerprint()
        with SchedulerClient(server.grpc_address) as client:
            # Released oldest first, one per op; a fourth release has none left: refused
            # naming the op, nothing changed.
            for seq in (4, 5, 6):
                step = StepBuilder(step_seq=seq)
                step.release_block_copies()
                client.step(POOL, step)
                local.run_step(step.build())
                assert len(local.manager.retained_copy_batches) == 6 - seq
            before = _server_pool(server).state_fingerprint()
            step = StepBuilder(step_seq=7)
            step.new_step_starts()
            step.take_block_copies(retain=True)
            step.release_block_copies()
            step.release_block_copies()
            with pytest.raises(ServiceFailedPreconditionError) as info:
                client.step(POOL, step)
            assert (info.value.op_index, info.value.field) == (3, "ops[3]")
            assert "retains no drained block copies" in str(info.value)
            assert _server_pool(server).state_fingerprint() == before
        # Released, the pool is the one whose drains were released at once.
        for seq in (4, 5, 6, 7):
            plain.run_step(StepBuilder(step_seq=seq).build())
        local.run_step(StepBuilder(step_seq=7).build())
        assert local.state_fingerprint() == plain.state_fingerprint()
    finally:
        server.stop()


def test_retained_drains_and_a_deferred_finish_survive_a_snapshot() -> None:
    pool = Pool(POOL, _config())
    for seq, build in enumerate(_drain_steps(pool), start=1):
        _run(pool, seq, build)
    restored = decode_pool(encode_pool(pool), POOL, _config())
    assert restored.state_fingerprint() == pool.state_fingerprint()
    assert restored.manager is not None
    assert [len(batch) for batch in restored.manager.retained_copy_batches] == [0, 2, 4]
    for each in (pool, restored):
        step = StepBuilder(step_seq=4)
        step.finish(1, deferred=True)
        step.finish(2, deferred=True)
        step.release_block_copies()
        step.release_block_copies()
        step.release_block_copies()
        each.run_step(step.build())
        assert not list(pool_violations(each))
        assert each.manager is not None
        assert all(block.ref_cnt == 0 for block in each.manager.block_pool.blocks[1:])
    assert restored.state_fingerprint() == pool.state_fingerprint()


def test_a_deferred_finish_frees_every_group_in_one_call() -> None:
    # Request a's blocks are cached in both groups (full attention's 64-token hashes, Mamba's
    # 256-token checkpoint); FINISH frees one group after the other (each tail first), the
    # deferred finish the groups' tables concatenated and reversed, in one call: the cached
    # blocks reach the free queue's back in another order, the uncached ones its front alike.
    tails: dict[bool, list[int]] = {}
    for deferred in (False, True):
        pool = Pool(POOL, _config())
        hashing = _hasher(pool)
        tokens = SHARED + OTHER[192:] + OTHER[192:] + OTHER[192:]  # 500 tokens, 2 blocks
        step = StepBuilder()
        step.new_step_starts()
        step.add_request(1, tokens, hashing.hash_token_ids(tokens), request_id="a")
        step.allocate(1, 256, 0, lookup=True)
        pool.run_step(step.build())
        step = StepBuilder()
        step.cache_blocks(1, 256)
        step.allocate(1, len(tokens) - 256, 256)
        step.cache_blocks(1, len(tokens))
        step.take_block_copies()
        pool.run_step(step.build())
        assert pool.manager is not None
        tables = pool.manager.get_blocks(pool.requests[1].request_id).blocks
        ids = [[block.block_id for block in group] for group in tables]
        step = StepBuilder()
        step.finish(1, deferred=deferred)
        pool.run_step(step.build())
        queue = [b.block_id for b in pool.manager.block_pool.free_block_queue.get_all_free_blocks()]
        num_held = sum(map(len, ids))
        tails[deferred] = queue[-num_held:]
        if deferred:
            concatenated = [block_id for group in ids for block_id in group]
            blocks = pool.manager.block_pool.blocks
            cached = [i for i in reversed(concatenated) if blocks[i].block_hash is not None]
            assert len(cached) >= 2
            assert tails[True][-len(cached) :] == cached
        assert not list(pool_violations(pool))
    assert sorted(tails[False]) == sorted(tails[True])
    assert tails[False] != tails[True]
