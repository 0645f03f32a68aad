"""Several schedulers drive different pools of one server at once, with threads and asyncio.

Every pool replays the same trace, so every pool must give the answers a pool driven alone
gives: concurrency on the server (one event loop, many pools) must not leak between pools.
"""

from __future__ import annotations

import asyncio
import threading

from workload import ReplayScheduler, WorkloadOptions, make_workload

from kvcm.client import (
    AsyncSchedulerClient,
    ItemStatus,
    PoolConfig,
    SchedulerClient,
    StepBuilder,
    StepResult,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec

NUM_SCHEDULERS = 6
TRACE = make_workload(WorkloadOptions(num_requests=60, seed=11))


def _config() -> PoolConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
    layout = KVCacheConfig(
        num_blocks=300,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )
    return PoolConfig(max_model_len=4096, explicit_layout=layout, hash_algorithm="sha256_cbor")


Fingerprint = list[tuple[int, list[str], list[tuple[list[int], ...] | None]]]


def _fingerprint(results: list[StepResult]) -> Fingerprint:
    return [
        (
            result.num_ops_executed,
            [status.name for status in result.statuses],
            [None if blocks is None else blocks.block_ids for blocks in result.all_blocks()],
        )
        for result in results
    ]


def _replay(client: SchedulerClient, pool_id: str) -> Fingerprint:
    client.create_pool(pool_id, _config())
    hasher = client.block_hasher(pool_id)

    def backend(builder: StepBuilder) -> StepResult:
        return client.step(pool_id, builder)

    scheduler = ReplayScheduler(
        backend, TRACE, hasher, max_num_batched_tokens=768, keep_results=True
    )
    stats = scheduler.run()
    assert scheduler.done
    client.delete_pool(pool_id)
    return _fingerprint(stats.results)


def test_threads_drive_pools_concurrently(client: SchedulerClient, kvcm_address: str) -> None:
    alone = _replay(client, "concurrent-alone")
    results: dict[int, Fingerprint] = {}
    failures: list[BaseException] = []
    barrier = threading.Barrier(NUM_SCHEDULERS)

    def scheduler(index: int) -> None:
        try:
            # Half share the fixture's channel, half open their own.
            if index % 2:
                with SchedulerClient(kvcm_address) as own:
                    barrier.wait()
                    results[index] = _replay(own, f"concurrent-thread-{index}")
            else:
                barrier.wait()
                results[index] = _replay(client, f"concurrent-thread-{index}")
        except BaseException as exc:  # reported below, with the thread's index
            failures.append(exc)

    threads = [threading.Thread(target=scheduler, args=(i,)) for i in range(NUM_SCHEDULERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not failures, failures
    assert sorted(results) == list(range(NUM_SCHEDULERS))
    for index, fingerprint in results.items():
        assert fingerprint == alone, f"pool of scheduler {index} diverged"


async def _decode_pool(client: AsyncSchedulerClient, pool_id: str) -> tuple[Fingerprint, int]:
    await client.create_pool(pool_id, _config())
    hasher = await client.block_hasher(pool_id)
    prompts = [[key * 97 + i for i in range(100)] for key in range(16)]
    step = StepBuilder()
    for key, prompt in enumerate(prompts):
        step.add_request(key, prompt, hasher.hash_token_ids(prompt))
        step.allocate(key, len(prompt), 0, lookup=True)
    results = [await client.step(pool_id, step)]
    assert all(status is ItemStatus.OK for status in results[0].statuses)
    computed = [len(prompt) for prompt in prompts]
    for token in range(40):
        step = StepBuilder()
        step.new_step_starts()
        tokens = []
        hashes = []
        for prompt in prompts:
            prompt.append(token)
            full = len(prompt) % 16 == 0
            hashes.append(hasher.hash_token_ids(prompt)[-1] if full else b"")
            tokens.append(token)
        step.decode(list(range(len(prompts))), tokens, computed, hashes)
        results.append(await client.step(pool_id, step))
        computed = [count + 1 for count in computed]
    usage = await client.get_usage(pool_id)
    await client.delete_pool(pool_id)
    return _fingerprint(results), usage.num_free_blocks


def test_asyncio_drives_pools_concurrently(kvcm_address: str) -> None:
    async def scenario() -> list[tuple[Fingerprint, int]]:
        async with AsyncSchedulerClient(kvcm_address) as client:
            return await asyncio.gather(
                *(_decode_pool(client, f"concurrent-async-{i}") for i in range(NUM_SCHEDULERS))
            )

    fingerprints = asyncio.run(scenario())
    assert all(fingerprint == fingerprints[0] for fingerprint in fingerprints[1:])
    # New blocks were handed out while decoding (one per request every 16 tokens).
    decode_steps = fingerprints[0][0][1:]
    new_blocks = sum(len(ids[0]) for step in decode_steps for ids in step[2] if ids is not None)
    assert new_blocks == 16 * 2  # 100 + 40 tokens: blocks 7 and 8 of every request
