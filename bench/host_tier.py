"""Benchmark: a pool's host tier (kvcm.core.host_tier) on a multi-turn workload.

Conversations take turns: each turn's request is the conversation so far (every earlier
prompt and answer) plus a new user message and the answer the model will give, so its prefix
was computed by the turn before. Conversations run interleaved, a few turns at a time, and the
device pool holds about a third of what they keep in all (the working set is ``--ratio`` times
the device pool, 3 by default): between two turns of a conversation other conversations evict
its blocks. Each Step admits a batch of turns (the prefix-cache lookup and the allocation of
the whole turn, as a prefill would) and finishes the batch admitted ``--running`` Steps before.

The same seeded workload runs on a pool without a host tier and on pools with one
(``--host-multiples``: host bytes as multiples of the device pool's), all with kvcm's real
core (``Pool``): the host tier's pool admits with ``Pool.admit_with_host`` (device hit, then
host hit as external computed tokens), the plain one with its device hit.

Reported per pool:

* hit rate: prompt tokens not computed, split by tier (device / host);
* recomputed tokens: tokens a turn computes again although an earlier turn of its conversation
  computed them (its prefix missed on every tier);
* copies: device-to-host (demotions) and host-to-device (loads) blocks;
* Step time (median, p99) and the tier's own bookkeeping per Step (median, p99): the time
  inside the tier's calls (demotions during allocation, the host lookup and its keys, the
  loads), measured by timing those calls. Each pool runs ``--repeat`` times (the same
  decisions every time) and each Step's time is its least over the runs.

    python bench/host_tier.py [--quick] [--seed N] [--ratio R] [--host-multiples 1,3] [--repeat 5]
    python bench/host_tier.py --vllm [--seed N]   # the offloading managers compared (vLLM)
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import p99

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.host_tier import HostTier
from kvcm.core.pool import Pool, PoolConfig

BLOCK_SIZE = 16
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16)


@dataclass(frozen=True)
class Workload:
    """Turns of interleaved conversations: ``turns[i]`` = (conversation, tokens, prior)."""

    turns: list[tuple[int, list[int], int]]
    working_set_tokens: int


def make_workload(
    seed: int, num_conversations: int, num_turns: int, user: tuple[int, int], answer: int
) -> Workload:
    rng = random.Random(seed)
    history: list[list[int]] = [
        [rng.randrange(32000) for _ in range(rng.randint(*user))] for _ in range(num_conversations)
    ]
    turns: list[tuple[int, list[int], int]] = []
    for _ in range(num_turns):
        order = list(range(num_conversations))
        rng.shuffle(order)
        for conv in order:
            prior = len(history[conv])
            tokens = history[conv] + [rng.randrange(32000) for _ in range(rng.randint(*user))]
            tokens += [rng.randrange(32000) for _ in range(answer)]
            history[conv] = tokens
            turns.append((conv, tokens, prior))
    return Workload(turns, sum(len(h) for h in history))


@dataclass
class Result:
    name: str
    prompt_tokens: int = 0
    device_hit: int = 0
    host_hit: int = 0
    recomputed: int = 0
    d2h: int = 0
    h2d: int = 0
    step_s: list[float] = field(default_factory=list)
    tier_s: list[float] = field(default_factory=list)


class _Clock:
    """Time spent inside the tier's code (outermost calls only), for the current Step."""

    depth = 0
    spent = 0.0


def _timed(call):  # type: ignore[no-untyped-def]
    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        if _Clock.depth:
            return call(*args, **kwargs)
        _Clock.depth = 1
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            _Clock.spent += time.perf_counter() - start
            _Clock.depth = 0

    return timed


class TimedHostTier(HostTier):
    """The tier with the time of its public calls added to :class:`_Clock`."""

    __slots__ = ()

    demote = _timed(HostTier.demote)
    match_prefix = _timed(HostTier.match_prefix)
    load = _timed(HostTier.load)
    touch = _timed(HostTier.touch)
    take_copies = _timed(HostTier.take_copies)
    note_hit_tokens = _timed(HostTier.note_hit_tokens)


def _instrument() -> None:
    # The pool-level steps of the tier: the host lookup (its keys included) and the building
    # of the loads; the allocation itself is the device pool's (its demotions are timed above).
    import kvcm.core.host_tier as tier_module
    import kvcm.core.pool as pool_module

    hit = _timed(tier_module.host_hit_tokens)
    tier_module.host_hit_tokens = hit  # type: ignore[assignment]
    pool_module.host_hit_tokens = hit  # type: ignore[assignment]
    tier_module._group_keys = _timed(tier_module._group_keys)  # type: ignore[assignment]


def run(workload: Workload, num_blocks: int, host_bytes: int, batch: int, running: int) -> Result:
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    )
    pool = Pool(
        "p", PoolConfig(max_model_len=1 << 16, explicit_layout=layout, host_tier_bytes=host_bytes)
    )
    manager = pool.manager
    assert manager is not None
    timed = None
    if pool.host_tier is not None:
        # The same tier, timed (it is empty: nothing is lost by replacing it).
        timed = TimedHostTier(pool.host_tier.num_blocks, block_bytes=pool.host_tier.block_bytes)
        pool.host_tier = timed
        manager.block_pool.demote = timed.demote
    host = pool.host_tier
    name = "no host tier" if host is None else f"host tier {host.num_blocks} blocks"
    result = Result(name)
    hasher = BlockHasher(BLOCK_SIZE, pool.hashing.algorithm, pool.hashing.seed)
    # Hashing is the engine's work: done before timing.
    prepared = [
        (tokens, b"".join(hasher.hash_token_ids(tokens)), prior)
        for _, tokens, prior in workload.turns
    ]
    gc.collect()
    gc.freeze()
    gc.disable()  # no collector pauses inside the timed Steps (re-enabled after the run)
    in_flight: list[list[int]] = []
    key = 0
    for start in range(0, len(prepared), batch):
        step_start = time.perf_counter()
        _Clock.spent = 0.0
        admitted: list[int] = []
        for tokens, hashes, prior in prepared[start : start + batch]:
            key += 1
            pool.add_request(key, str(key), tokens, hashes)
            if host is None:
                hit = pool.get_computed_blocks(key, None)
                device_hit, host_hit = hit.num_computed_tokens, 0
                ids = pool.allocate(key, len(tokens) - device_hit, device_hit, hit=_hit(hit))
                ok = ids is not None
            else:
                looked_up = pool.lookup_tiers(key)
                hit, host_hit = looked_up
                device_hit = hit.num_computed_tokens
                admission = pool.admit_with_host(
                    key, len(tokens) - device_hit - host_hit, looked_up=looked_up
                )
                ok = admission is not None
            if not ok:
                pool.free(key, preempt=False)
                continue
            admitted.append(key)
            result.prompt_tokens += len(tokens)
            result.device_hit += device_hit
            result.host_hit += host_hit
            result.recomputed += max(0, prior - device_hit - host_hit)
        in_flight.append(admitted)
        if len(in_flight) > running:
            for done in in_flight.pop(0):
                pool.free(done, preempt=False)
        if timed is not None:
            d2h, h2d = pool.take_host_copies()
            result.d2h += len(d2h)
            result.h2d += len(h2d)
            result.tier_s.append(_Clock.spent)
        result.step_s.append(time.perf_counter() - step_start)
    gc.enable()
    gc.unfreeze()
    return result


def _hit(hit: object) -> object:
    from kvcm.core.program import HitSpec

    blocks = hit.blocks.get_block_ids()  # type: ignore[attr-defined]
    return HitSpec(num_tokens=hit.num_computed_tokens, block_ids=blocks)  # type: ignore[attr-defined]


def compare_vllm(seed: int, num_requests: int, buffers: list[int]) -> None:
    """vLLM's CPUOffloadingSpec against KvcmOffloadingSpec under vLLM's EngineCore (the
    workload and recording of tests/compat/test_offload_spec.py)."""
    from _common import import_vllm

    if import_vllm("vllm.v1.kv_offload.base") is None:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "compat"))
    import test_offload_spec as compat

    compat.NUM_REQUESTS = num_requests
    print(
        f"{'buffer':>7} {'manager':<20}{'calls':>6}{'stored':>8}{'evicted':>8}{'refused':>8}"
        f"{'loaded':>8}{'hit tokens':>11}{'first diff':>11}"
    )
    for chunks in buffers:
        runs = {
            spec: compat._run(spec, chunks, seed)
            for spec in ("CPUOffloadingSpec", "KvcmOffloadingSpec")
        }
        logs = [r["log"] for r in runs.values()]
        first = next((i for i, (a, b) in enumerate(zip(*logs, strict=False)) if a != b), None)
        for spec, r in runs.items():
            stores = [e[2] for e in r["log"] if e[0] == "store"]
            print(
                f"{chunks:>7} {spec:<20}{len(r['log']):>6}"
                f"{sum(len(d[0]) for d in stores if d):>8}{sum(len(d[1]) for d in stores if d):>8}"
                f"{sum(1 for d in stores if d is None):>8}"
                f"{sum(len(e[2]) for e in r['log'] if e[0] == 'load'):>8}"
                f"{sum(h for _, h in r['hits']):>11}{'-' if first is None else first:>11}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--seed", type=int, default=None, help="default 1 (--vllm: 7)")
    parser.add_argument("--ratio", type=float, default=3.0, help="working set / device pool")
    parser.add_argument("--host-multiples", default="1,3", help="host bytes / device bytes")
    parser.add_argument("--repeat", type=int, default=5, help="runs per pool (least per Step)")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="compare KvcmOffloadingSpec with vLLM's CPUOffloadingSpec under vLLM's EngineCore",
    )
    args = parser.parse_args()
    if args.vllm:
        compare_vllm(7 if args.seed is None else args.seed, 50, [4000, 40])
        return
    _instrument()
    conversations, turns = (24, 4) if args.quick else (48, 6)
    seed = 1 if args.seed is None else args.seed
    workload = make_workload(seed, conversations, turns, (48, 160), 64)
    num_blocks = max(64, int(workload.working_set_tokens / BLOCK_SIZE / args.ratio))
    device_bytes = num_blocks * SPEC.page_size_bytes
    batch, running = 4, 2
    print(
        f"{conversations} conversations x {turns} turns, {len(workload.turns)} requests; working "
        f"set {workload.working_set_tokens} tokens = "
        f"{workload.working_set_tokens / BLOCK_SIZE / num_blocks:.2f}"
        f" x the device pool ({num_blocks} blocks of {BLOCK_SIZE}); {batch} admissions a Step"
    )
    budgets = [0] + [int(device_bytes * float(m)) for m in args.host_multiples.split(",")]
    results = []
    for host_bytes in budgets:
        # Every run makes the same decisions (seeded, deterministic), so Step i does the same
        # work in each: its time is the least over the runs (the machine's noise removed).
        runs = [run(workload, num_blocks, host_bytes, batch, running) for _ in range(args.repeat)]
        best = runs[0]
        best.step_s = [min(times) for times in zip(*(r.step_s for r in runs), strict=True)]
        best.tier_s = [min(times) for times in zip(*(r.tier_s for r in runs), strict=True)]
        results.append(best)
    header = (
        f"{'pool':<26}{'hit rate':>9}{'device':>8}{'host':>8}{'recomputed':>12}"
        f"{'d2h':>8}{'h2d':>8}{'Step med':>10}{'Step p99':>10}{'tier med':>10}{'tier p99':>10}"
    )
    print(header)
    for r in results:
        total = r.prompt_tokens or 1
        tier_med = statistics.median(r.tier_s) * 1e6 if r.tier_s else 0.0
        tier_p99 = p99(sorted(r.tier_s)) * 1e6 if r.tier_s else 0.0
        print(
            f"{r.name:<26}{(r.device_hit + r.host_hit) / total:>9.1%}{r.device_hit / total:>8.1%}"
            f"{r.host_hit / total:>8.1%}{r.recomputed:>12}{r.d2h:>8}{r.h2d:>8}"
            f"{statistics.median(r.step_s) * 1e6:>8.0f}us{p99(sorted(r.step_s)) * 1e6:>8.0f}us"
            f"{tier_med:>8.0f}us{tier_p99:>8.0f}us"
        )


if __name__ == "__main__":
    main()
