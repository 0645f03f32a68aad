"""The remote demo: simulated workers and a scheduler drive a running kvcm server over gRPC.

What it shows, end to end through the SDK:

1. The launcher creates a pool for ``--world-size`` ranks.
2. Simulated GPU workers (threads) register their layers and memory at once; each receives the
   same unified config (``num_blocks`` = the minimum over ranks).
3. A scheduler replays a shared-prefix chat workload (``kvcm.client._replay``) with one Step
   RPC per scheduler step, hashing blocks client-side with the pool's hasher, and prints its
   progress and the live prefix-cache hit rate (the server's counters).
4. A summary: requests, steps, round trips, preemptions, hit rate, blocks stored and evicted
   (from the pool's event stream), and the Step round-trip latency.

    python -m kvcm.client.demo --remote 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from kvcm.client._errors import ServiceNotFoundError
from kvcm.client._replay import ReplayScheduler, WorkloadOptions, make_workload
from kvcm.client._step import StepBuilder, StepResult
from kvcm.client.scheduler import EventStream, SchedulerClient
from kvcm.client.worker import WorkerClient, WorkerRegistration
from kvcm.common.dtypes import DType
from kvcm.common.events import BlockRemoved, BlockStored
from kvcm.common.hashing import HashAlgorithm
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec
from kvcm.core.pool_types import PoolConfig

__all__ = ["RemoteDemoOptions", "RemoteDemoReport", "main", "run_remote_demo"]

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteDemoOptions:
    """What the remote demo does.

    Attributes:
        address: ``host:port`` of the kvcm server.
        pool_id: The pool to create (deleted at the end unless ``keep_pool``).
        world_size: Simulated worker ranks.
        num_layers: Attention layers per rank.
        memory_mib: KV-cache memory of rank 0, in MiB; each further rank has 16 MiB less.
        num_requests: Requests in the workload.
        token_budget: Tokens per scheduler step.
        max_running: Running requests at most.
        hash_algorithm: Block hash algorithm of the pool.
        seed: Workload seed.
        progress_every: Print progress every this many steps.
        keep_pool: Leave the pool on the server.
    """

    address: str
    pool_id: str = "demo"
    world_size: int = 2
    num_layers: int = 4
    memory_mib: int = 192
    num_requests: int = 300
    token_budget: int = 2048
    max_running: int = 64
    hash_algorithm: str = "sha256_cbor"
    seed: int = 0
    progress_every: int = 25
    keep_pool: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteDemoReport:
    """What the remote demo saw.

    Attributes:
        num_blocks: Blocks of the unified config.
        steps: Scheduler steps.
        rpcs: Step RPCs sent.
        finished: Requests completed.
        preemptions: Preemptions.
        hit_rate: The server's prefix-cache hit rate (hit tokens / queried tokens).
        blocks_stored: Blocks that entered the prefix cache (events).
        blocks_evicted: Blocks evicted from it (events).
        step_p50_ms: Median Step round trip.
        step_p99_ms: 99th percentile Step round trip.
        seconds: Wall time of the replay.
    """

    num_blocks: int
    steps: int
    rpcs: int
    finished: int
    preemptions: int
    hit_rate: float
    blocks_stored: int
    blocks_evicted: int
    step_p50_ms: float
    step_p99_ms: float
    seconds: float


def _layer_specs(num_layers: int) -> dict[str, KVCacheSpec]:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}


def _register_workers(
    client: SchedulerClient, options: RemoteDemoOptions, out: TextIO
) -> list[WorkerRegistration]:
    specs = _layer_specs(options.num_layers)
    registrations: dict[int, WorkerRegistration] = {}
    failures: list[BaseException] = []
    failed = threading.Event()

    def worker(rank: int) -> None:
        memory = (options.memory_mib - 16 * rank) * _MIB
        try:
            with WorkerClient(options.address, timeout=60.0) as worker_client:
                registrations[rank] = worker_client.register(
                    options.pool_id, rank, options.world_size, specs, memory
                )
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)
            failed.set()

    threads = [
        threading.Thread(target=worker, args=(rank,), name=f"worker-{rank}")
        for rank in range(options.world_size)
    ]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads) and not failed.wait(0.05):
        pass
    if failures:
        # The other ranks wait for the one that failed: deleting the pool ends their calls.
        with contextlib.suppress(ServiceNotFoundError):
            client.delete_pool(options.pool_id)
        for thread in threads:
            thread.join()
        raise failures[0]
    ordered = [registrations[rank] for rank in range(options.world_size)]
    for registration in ordered:
        config = registration.kv_cache_config
        tensor_mib = sum(tensor.size for tensor in config.kv_cache_tensors) / _MIB
        print(
            f"  worker rank {registration.rank}: {config.num_blocks} blocks, "
            f"{len(config.kv_cache_groups)} group(s), {len(config.kv_cache_tensors)} tensor(s), "
            f"{tensor_mib:.0f} MiB to allocate",
            file=out,
        )
    return ordered


class _EventCounter:
    """Counts stored and evicted blocks from the pool's event stream, in the background."""

    def __init__(self, stream: EventStream) -> None:
        self.stored = 0
        self.evicted = 0
        self._stream = stream
        self._thread = threading.Thread(target=self._run, name="demo-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for batch in self._stream:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self.stored += len(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self.evicted += len(event.block_hashes)

    def close(self) -> None:
        self._stream.close()
        self._thread.join(timeout=5.0)


def run_remote_demo(options: RemoteDemoOptions, out: TextIO | None = None) -> RemoteDemoReport:
    """Run the demo against a running server and print what happens (to ``out``, by default
    standard output).

    Raises:
        ServiceError: The server refused a call (e.g. the pool id is taken).
    """
    out = sys.stdout if out is None else out
    client = SchedulerClient(options.address)
    try:
        print(f"kvcm remote demo against {options.address}", file=out)
        client.create_pool(
            options.pool_id,
            PoolConfig(
                max_model_len=8192,
                world_size=options.world_size,
                hash_algorithm=HashAlgorithm(options.hash_algorithm),
                enable_kv_cache_events=True,
            ),
        )
        print(f"pool {options.pool_id!r}: waiting for {options.world_size} worker(s)", file=out)
        try:
            registrations = _register_workers(client, options, out)
            counter = _EventCounter(client.subscribe_events(options.pool_id, start_sequence=1))
            try:
                num_blocks = registrations[0].kv_cache_config.num_blocks
                return _replay(client, options, num_blocks, out, counter)
            finally:
                counter.close()
        finally:
            if not options.keep_pool:
                with contextlib.suppress(ServiceNotFoundError):
                    client.delete_pool(options.pool_id)
    finally:
        client.close()


def _replay(
    client: SchedulerClient,
    options: RemoteDemoOptions,
    num_blocks: int,
    out: TextIO,
    counter: _EventCounter,
) -> RemoteDemoReport:
    pool_id = options.pool_id
    hasher = client.block_hasher(pool_id)
    workload = WorkloadOptions(num_requests=options.num_requests, seed=options.seed)
    trace = make_workload(workload)
    latencies: list[float] = []
    queried = hits = 0

    def backend(builder: StepBuilder) -> StepResult:
        start = time.perf_counter()
        result = client.step(pool_id, builder)
        latencies.append(time.perf_counter() - start)
        return result

    scheduler = ReplayScheduler(
        backend,
        trace,
        hasher,
        max_num_batched_tokens=options.token_budget,
        max_num_running=options.max_running,
    )
    print(
        f"scheduler: replaying {len(trace)} chat requests sharing "
        f"{workload.num_system_prompts} system prompts "
        f"({options.token_budget} tokens/step, {num_blocks} blocks)",
        file=out,
    )
    started = time.perf_counter()
    while not scheduler.done:
        scheduler.step()
        if scheduler.stats.steps % options.progress_every == 0 or scheduler.done:
            stats = client.take_prefix_cache_stats(pool_id)
            if stats is not None:
                queried += stats.queries
                hits += stats.hits
            usage = client.get_usage(pool_id)
            print(
                f"  step {scheduler.stats.steps:>5}  finished {scheduler.stats.finished:>4}/"
                f"{len(trace)}  requests {usage.num_requests:>3}  usage {usage.usage:>5.1%}  "
                f"hit rate {hits / queried if queried else 0.0:>5.1%}  "
                f"preemptions {scheduler.stats.preemptions}",
                file=out,
            )
    seconds = time.perf_counter() - started
    ordered = sorted(latencies)
    report = RemoteDemoReport(
        num_blocks=num_blocks,
        steps=scheduler.stats.steps,
        rpcs=scheduler.stats.rpcs,
        finished=scheduler.stats.finished,
        preemptions=scheduler.stats.preemptions,
        hit_rate=hits / queried if queried else 0.0,
        blocks_stored=counter.stored,
        blocks_evicted=counter.evicted,
        step_p50_ms=statistics.median(ordered) * 1e3 if ordered else 0.0,
        step_p99_ms=ordered[round(0.99 * (len(ordered) - 1))] * 1e3 if ordered else 0.0,
        seconds=seconds,
    )
    _print_summary(report, out)
    return report


def _print_summary(report: RemoteDemoReport, out: TextIO) -> None:
    print("summary", file=out)
    print(f"  requests finished   {report.finished}", file=out)
    print(
        f"  scheduler steps     {report.steps} ({report.rpcs} Step RPCs, {report.seconds:.1f} s)",
        file=out,
    )
    print(f"  preemptions         {report.preemptions}", file=out)
    print(f"  prefix hit rate     {report.hit_rate:.1%} (server counters)", file=out)
    print(
        f"  blocks              {report.num_blocks} in the pool, {report.blocks_stored} cached, "
        f"{report.blocks_evicted} evicted (event stream)",
        file=out,
    )
    print(
        f"  Step round trip     p50 {report.step_p50_ms:.2f} ms, p99 {report.step_p99_ms:.2f} ms",
        file=out,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcm.client.demo --remote ADDRESS``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="kvcm demo --remote",
        description="Drive a running kvcm server with simulated workers and a scheduler.",
    )
    parser.add_argument("--remote", required=True, metavar="ADDRESS", help="host:port")
    parser.add_argument("--pool", default="demo", help="pool id to create (default demo)")
    parser.add_argument("--world-size", type=int, default=2, help="simulated worker ranks")
    parser.add_argument("--requests", type=int, default=300, help="requests to replay")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--keep-pool", action="store_true", help="leave the pool on the server")
    args = parser.parse_args(argv)
    run_remote_demo(
        RemoteDemoOptions(
            address=args.remote,
            pool_id=args.pool,
            world_size=args.world_size,
            num_requests=args.requests,
            seed=args.seed,
            keep_pool=args.keep_pool,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
