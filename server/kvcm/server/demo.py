"""``kvcm demo``: a scheduler loop over the allocation core with a shared-prefix workload.

The workload is what prefix caching is for: a few long system prompts shared by many users,
multi-turn conversations whose next prompt repeats the previous turn, chunked prefill under a
token budget, and a pool small enough that blocks get evicted and requests get preempted. The
loop plays vLLM's scheduler in miniature (running requests first, then admissions; preempt the
newest running request when a decode does not fit), so the numbers it prints are the ones a
real engine would see from the same core.
"""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.events import BlockRemoved, BlockStored
from kvcm.common.hashing import BlockHasher, HashAlgorithm
from kvcm.common.specs import FullAttentionSpec
from kvcm.core import (
    KVCacheManager,
    KVCacheManagerConfig,
    Request,
    RequestStatus,
)

__all__ = ["DemoOptions", "DemoReport", "run_demo", "simulate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    """What the demo simulates."""

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
    vocab_size: int = 32000


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
    num_output_tokens: int
    rng: random.Random


def _make_prompts(options: DemoOptions, rng: random.Random) -> list[list[int]]:
    """Prompts of a multi-user chat service: system prompt + conversation so far + new turn."""
    systems = [
        [rng.randrange(options.vocab_size) for _ in range(rng.randrange(256, 1536))]
        for _ in range(options.num_system_prompts)
    ]
    conversations: list[list[int]] = []
    prompts: list[list[int]] = []
    for _ in range(options.num_requests):
        if conversations and rng.random() < 0.5:
            # A follow-up turn repeats the whole conversation so far.
            history = rng.choice(conversations)
        else:
            history = list(rng.choice(systems))
            conversations.append(history)
        history.extend(rng.randrange(options.vocab_size) for _ in range(rng.randrange(16, 400)))
        prompts.append(list(history))
    return prompts


def simulate(options: DemoOptions) -> DemoReport:
    """Run the scheduler loop to completion and count what the core did."""
    rng = random.Random(options.seed)
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
                request_id=f"req-{i}",
                prompt_token_ids=prompt,
                block_hasher=hasher,
            ),
            num_output_tokens=rng.randrange(8, 128),
            rng=random.Random(options.seed * 7919 + i),
        )
        for i, prompt in enumerate(_make_prompts(options, rng))
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
        if request.num_output_tokens >= job.num_output_tokens:
            manager.free(request)
            report.finished += 1
            continue
        request.append_output_token_ids([job.rng.randrange(32000)])
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
    print("kvcm demo: allocation core, shared-prefix chat workload", file=out)
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
