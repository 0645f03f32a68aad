"""kvcm's demo: a shared-prefix chat workload driven through the SDK or the core.

Run it with ``bash scripts/run.sh`` (or ``python examples/demo.py``). Three ways:

- default: start a kvcm server with its embedded defaults (``kvcm.server.embedded``), then
  drive it as below, print a summary and stop;
- ``--remote HOST:PORT``: drive a running server (``kvcm serve``):

  1. the launcher creates a pool for ``--world-size`` ranks;
  2. simulated GPU workers (threads) register their layers and memory at once; each receives
     the same unified config (``num_blocks`` = the minimum over ranks);
  3. a scheduler replays the workload (``workload.ReplayScheduler``) with one Step RPC per
     scheduler step, hashing blocks client-side with the pool's hasher, and prints its
     progress and the live prefix-cache hit rate (the server's counters);
  4. a summary: requests, steps, round trips, preemptions, hit rate, blocks stored and
     evicted (from the pool's event stream), and the Step round-trip latency;

- ``--in-process``: a scheduler loop over the allocation core itself (``kvcm.core``), no
  network: vLLM's scheduler in miniature (running requests first, then admissions; preempt
  the newest running request when a decode does not fit) on a pool small enough that blocks
  get evicted and requests preempted.

The workload is ``workload.make_workload``'s (this folder): a few long system prompts shared
by many users and multi-turn conversations whose next prompt repeats the previous turn.
Not a library module: it lives beside the packages, not in them.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TextIO

from workload import ReplayScheduler, WorkloadOptions, make_workload

from kvcm.client import (
    EventStream,
    PoolConfig,
    SchedulerClient,
    ServiceNotFoundError,
    StepBuilder,
    StepResult,
    WorkerClient,
    WorkerRegistration,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.events import BlockRemoved, BlockStored
from kvcm.common.hashing import BlockHasher, HashAlgorithm
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec
from kvcm.core import KVCacheManager, KVCacheManagerConfig, Request, RequestStatus
from kvcm.server.settings import DEFAULT_GRPC_ADDRESS, DEFAULT_HTTP_ADDRESS

__all__ = [
    "DemoOptions",
    "DemoReport",
    "RemoteDemoOptions",
    "RemoteDemoReport",
    "main",
    "run_demo",
    "run_remote_demo",
    "simulate",
]


# ============================================================================ in process
@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    """What the in-process demo simulates (its workload is :func:`workload.make_workload`'s)."""

    num_requests: int = 400
    num_blocks: int = 2048
    block_size: int = 16
    seed: int = 0
    hash_algorithm: str = "sha256_cbor"
    max_model_len: int = 16384
    token_budget: int = 2048
    """Tokens scheduled per step (prefill chunks and decodes together)."""
    max_running: int = 64
    num_system_prompts: int = 4


@dataclass(slots=True)
class DemoReport:
    """What happened, as counted through the core's public surface."""

    steps: int = 0
    finished: int = 0
    preemptions: int = 0
    rejected: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    blocks_stored: int = 0
    blocks_evicted: int = 0
    peak_usage: float = 0.0
    seconds: float = 0.0
    hit_rate_history: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate over all admissions (0..1)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class _Job:
    request: Request
    output_token_ids: tuple[int, ...]


def simulate(options: DemoOptions) -> DemoReport:
    """Run the scheduler loop to completion and count what the core did."""
    trace = make_workload(
        WorkloadOptions(
            num_requests=options.num_requests,
            num_system_prompts=options.num_system_prompts,
            seed=options.seed,
        )
    )
    algorithm = HashAlgorithm(options.hash_algorithm)
    hasher = BlockHasher(algorithm=algorithm, seed="kvcm-demo", block_size=options.block_size)
    spec = FullAttentionSpec(
        block_size=options.block_size, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16
    )
    layers = [f"model.layers.{i}.self_attn" for i in range(32)]
    manager = KVCacheManager(
        KVCacheManagerConfig(
            kv_cache_config=KVCacheConfig(
                num_blocks=options.num_blocks,
                kv_cache_tensors=(),
                kv_cache_groups=(KVCacheGroupSpec(layer_names=tuple(layers), kv_cache_spec=spec),),
            ),
            max_model_len=options.max_model_len,
            enable_kv_cache_events=True,
        )
    )
    waiting: deque[_Job] = deque(
        _Job(
            Request(
                request_id=item.request_id,
                prompt_token_ids=list(item.prompt_token_ids),
                block_hasher=hasher,
            ),
            output_token_ids=item.output_token_ids,
        )
        for item in trace
    )
    running: list[_Job] = []
    report = DemoReport()
    started = time.perf_counter()
    while waiting or running:
        report.steps += 1
        manager.new_step_starts()
        budget = options.token_budget
        budget = _schedule_running(manager, running, waiting, budget, report)
        _admit_waiting(manager, running, waiting, budget, report, max_running=options.max_running)
        if not running and waiting:
            # Nothing runs and the head request does not fit an empty pool: it never will.
            # A real scheduler rejects it; looping would never end.
            waiting.popleft()
            report.rejected += 1
        _advance(manager, running, report)
        _count_events(manager, report)
        report.peak_usage = max(report.peak_usage, manager.usage)
        if report.steps % 50 == 0:
            report.hit_rate_history.append(report.hit_rate)
    report.seconds = time.perf_counter() - started
    return report


def _schedule_running(
    manager: KVCacheManager,
    running: list[_Job],
    waiting: deque[_Job],
    budget: int,
    report: DemoReport,
) -> int:
    """Give each running request its next chunk; preempt the newest when one does not fit."""
    index = 0
    while index < len(running) and budget > 0:
        job = running[index]
        request = job.request
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        while manager.allocate_slots(request, num_new) is None:
            victim = running.pop()
            manager.free(victim.request)
            # As vLLM's scheduler does: the request restarts from scratch, keeping its hashes.
            victim.request.status = RequestStatus.PREEMPTED
            victim.request.num_computed_tokens = 0
            victim.request.num_in_flight_tokens = 0
            victim.request.num_preemptions += 1
            waiting.appendleft(victim)
            report.preemptions += 1
            if victim is job:
                return budget
        budget -= num_new
        job.request.num_in_flight_tokens = num_new
        index += 1
    return budget


def _admit_waiting(
    manager: KVCacheManager,
    running: list[_Job],
    waiting: deque[_Job],
    budget: int,
    report: DemoReport,
    *,
    max_running: int,
) -> None:
    """Admit waiting requests in order while the budget and the pool allow."""
    while waiting and budget > 0 and len(running) < max_running:
        job = waiting[0]
        request = job.request
        hit = manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - hit.num_computed_tokens, budget)
        if manager.allocate_slots(request, num_new, hit) is None:
            return
        waiting.popleft()
        report.queried_tokens += request.num_tokens
        report.hit_tokens += hit.num_computed_tokens
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit.num_computed_tokens
        request.num_in_flight_tokens = num_new
        running.append(job)
        budget -= num_new


def _advance(manager: KVCacheManager, running: list[_Job], report: DemoReport) -> None:
    """The forward pass: scheduled tokens become computed; decodes sample one token."""
    still_running: list[_Job] = []
    for job in running:
        request = job.request
        request.num_computed_tokens += request.num_in_flight_tokens
        request.num_in_flight_tokens = 0
        if request.num_computed_tokens < request.num_tokens:
            still_running.append(job)  # a chunked prefill continues next step
            continue
        if request.num_output_tokens >= len(job.output_token_ids):
            manager.free(request)
            report.finished += 1
            continue
        request.append_output_token_ids([job.output_token_ids[request.num_output_tokens]])
        still_running.append(job)
    running[:] = still_running


def _count_events(manager: KVCacheManager, report: DemoReport) -> None:
    for event in manager.take_events():
        if isinstance(event, BlockStored):
            report.blocks_stored += len(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            report.blocks_evicted += len(event.block_hashes)


def print_report(options: DemoOptions, report: DemoReport, out: TextIO) -> None:
    """Print the report in the shape an operator reads."""
    print("kvcm demo --in-process: allocation core, shared-prefix chat workload", file=out)
    print(
        f"  pool            {options.num_blocks} blocks x {options.block_size} tokens, "
        f"hash {options.hash_algorithm}",
        file=out,
    )
    print(f"  requests        {report.finished} finished in {report.steps} steps", file=out)
    print(f"  preemptions     {report.preemptions}", file=out)
    if report.rejected:
        print(f"  rejected        {report.rejected} (longer than the whole pool)", file=out)
    print(
        f"  prefix cache    {report.hit_tokens} of {report.queried_tokens} prompt tokens hit "
        f"(hit rate {report.hit_rate:.1%})",
        file=out,
    )
    trend = " ".join(f"{rate:.0%}" for rate in report.hit_rate_history[:12])
    print(f"  hit rate trend  {trend} (every 50 steps)", file=out)
    print(
        f"  blocks          {report.blocks_stored} cached, {report.blocks_evicted} evicted, "
        f"peak usage {report.peak_usage:.1%}",
        file=out,
    )
    print(
        f"  time            {report.seconds:.2f} s "
        f"({report.seconds / max(report.steps, 1) * 1e6:.0f} us per step)",
        file=out,
    )


def run_demo(options: DemoOptions, out: TextIO | None = None) -> int:
    """Simulate and print to ``out`` (default: the current ``sys.stdout``); returns 0."""
    if out is None:
        out = sys.stdout
    report = simulate(options)
    print_report(options, report, out)
    return 0 if report.finished == options.num_requests else 1


# ============================================================================ over gRPC
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


# ============================================================================ command line
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="examples/demo.py",
        description=(
            "By default: start a kvcm server with its embedded defaults, register simulated "
            "workers, replay a shared-prefix chat workload through the Step RPC with a live hit "
            "rate, print a summary and stop. --remote drives a running server instead; "
            "--in-process drives the allocation core without the network."
        ),
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--remote", metavar="ADDRESS", default=None, help="drive the server at host:port"
    )
    where.add_argument(
        "--in-process", action="store_true", help="drive the allocation core in this process"
    )
    where.add_argument(
        "--pd",
        action="store_true",
        help="the P/D demo instead: kvcm pd-proxy against round robin over simulated prefill "
        "and decode engines, with faults (examples/pd_demo.py; its own flags follow: "
        "--conversations, --turns, --never-pull-every, --die-after, --concurrency, --seed)",
    )
    parser.add_argument(
        "--grpc-address",
        default=DEFAULT_GRPC_ADDRESS,
        help=f"gRPC host:port of the embedded server (default {DEFAULT_GRPC_ADDRESS})",
    )
    parser.add_argument(
        "--http-address",
        default=DEFAULT_HTTP_ADDRESS,
        help=f"HTTP host:port of the embedded server (default {DEFAULT_HTTP_ADDRESS})",
    )
    parser.add_argument("--pool", default="demo", help="pool id to create (default demo)")
    parser.add_argument("--keep-pool", action="store_true", help="leave the pool on the server")
    parser.add_argument("--requests", type=int, default=300, help="requests (default 300)")
    parser.add_argument("--world-size", type=int, default=2, help="simulated worker ranks")
    parser.add_argument(
        "--num-blocks", type=int, default=2048, help="pool blocks (--in-process only)"
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per block (--in-process only)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--hash-algorithm",
        default="sha256_cbor",
        choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
        help="block hash algorithm (default sha256_cbor)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python examples/demo.py [--remote ADDRESS | --in-process | --pd] ...``; the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--pd" in argv:
        from pd_demo import main as pd_main

        return pd_main([arg for arg in argv if arg != "--pd"])
    args = _parser().parse_args(argv)
    if args.in_process:
        return run_demo(
            DemoOptions(
                num_requests=args.requests,
                num_blocks=args.num_blocks,
                block_size=args.block_size,
                seed=args.seed,
                hash_algorithm=args.hash_algorithm,
            )
        )
    options = RemoteDemoOptions(
        address=args.remote or args.grpc_address,
        pool_id=args.pool,
        keep_pool=args.keep_pool,
        world_size=args.world_size,
        num_requests=args.requests,
        hash_algorithm=args.hash_algorithm,
        seed=args.seed,
    )
    if args.remote:
        run_remote_demo(options)
        return 0
    # The server is the [server] extra; only this path needs it.
    from kvcm.server.embedded import start_embedded_server
    from kvcm.server.settings import ServerSettings

    settings = ServerSettings(
        grpc_address=args.grpc_address, http_address=args.http_address, log_level="WARNING"
    )
    try:
        server = start_embedded_server(settings)
    except RuntimeError as exc:
        print(
            f"kvcm demo: {exc}\n  (another server on these ports? pass --grpc-address and "
            "--http-address, e.g. 127.0.0.1:0 for any free port)",
            file=sys.stderr,
        )
        return 1
    with server:
        http = f", HTTP on http://{server.http_address}/metrics" if server.http_address else ""
        print(f"kvcm server: gRPC on {server.grpc_address}{http}")
        run_remote_demo(replace(options, address=server.grpc_address))
    return 0


if __name__ == "__main__":
    sys.exit(main())
