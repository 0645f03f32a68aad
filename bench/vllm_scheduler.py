"""vLLM 0.33's scheduler on its own KV-cache manager vs on kvcm: time per step, RPCs, bytes.

Every scheduler is vLLM's real ``Scheduler`` (the kvcm ones are ``KvcmScheduler``, built
through ``scheduler_cls`` exactly as EngineCore builds it), in one process, on the same
workload: ``N`` requests (128-token prompts, 70 % of them sharing one of four 64-token
prefixes) admitted, prefilled, then decoding for long enough that none finishes. One sample is
one engine step's ``schedule()`` plus ``update_from_output()`` (the simulated model's output is
built outside the timed part); samples of the sides are interleaved after
``gc.collect(); gc.freeze()``, as vLLM's engine runs. The kvcm sides:

* ``local``: the mirror with no server (recording the Step program included);
* ``mirror``: the mirror shipping one Step per ``schedule()`` to ``kvcm serve`` (its own
  process on 127.0.0.1) from a background thread, every answer verified;
* ``remote``: every ``allocate_slots`` waits for the server's acknowledgement.

After timing, each shipping side is flushed and its counters printed: RPCs and Step bytes per
step, steps verified, mismatches.

    python bench/vllm_scheduler.py                 # N = 8, 64, 256; ~1-2 min on 2 cores
    python bench/vllm_scheduler.py --running 256 --steps 400 --modes local mirror

Targets (issue 10): mirror median <= 1.0x vLLM at 256 running, <= 1.25x at 8.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from pathlib import Path
from typing import Any

# The simulated engine and its workload live once, beside the differential test.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
if str(Path(__file__).parent.parent / "tests" / "compat") not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "compat"))

from _common import Row, import_vllm, kvcm_server, measure, print_table

PROMPT_LEN = 128
PREFIX_LEN = 64


def _plans(num_running: int, decode_steps: int) -> list[Any]:
    from _vllm_engine import VOCAB, RequestPlan

    rng = random.Random(num_running)
    prefixes = [tuple(rng.randrange(VOCAB) for _ in range(PREFIX_LEN)) for _ in range(4)]
    plans = []
    for index in range(num_running):
        prefix = rng.choice(prefixes) if rng.random() < 0.7 else ()
        tail = tuple(rng.randrange(VOCAB) for _ in range(PROMPT_LEN - len(prefix)))
        plans.append(
            RequestPlan(
                arrival_step=0,
                request_id=f"r{index}",
                prompt=prefix + tail,
                max_tokens=decode_steps + 64,
            )
        )
    return plans


def _stepper(scheduler: Any) -> Any:
    from _vllm_engine import _model_output

    perf = time.perf_counter
    state = {"step": 0}

    def sample() -> float:
        step = state["step"]
        state["step"] = step + 1
        start = perf()
        output = scheduler.schedule()
        scheduled = perf()
        model_output = _model_output(scheduler, output, step)
        updating = perf()
        scheduler.update_from_output(output, model_output)
        return (scheduled - start) + (perf() - updating)

    return sample


def _bytes_per_step(programs: list[Any], pool_id: str) -> float:
    from kvcm.wire import program_to_proto

    if not programs:
        return 0.0
    return sum(program_to_proto(p, pool_id).ByteSize() for p in programs) / len(programs)


class _Counting:
    """A sink wrapper that keeps the programs (for their encoded size, measured afterwards)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.programs: list[Any] = []

    def submit(self, step: Any) -> None:
        self.programs.append(step.program)
        self.inner.submit(step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def bench(num_running: int, steps: int, modes: list[str], target: str | None) -> list[Row]:
    """Rows for one N: each kvcm mode against vLLM's own manager (same samples for vLLM)."""
    from _vllm_engine import Setup, _make_request, build_scheduler

    from kvcm.integrations.vllm import KvcmScheduler

    warmup = 3 + (num_running * PROMPT_LEN) // 8192 + 2
    setup = Setup(
        num_blocks=num_running * ((PROMPT_LEN + steps + warmup + 64) // 16 + 2) + 16,
        max_num_seqs=num_running,
        max_num_batched_tokens=8192,
        max_model_len=4096,
        log_stats=True,
    )
    sides = []
    for mode in modes:
        config = None
        if mode != "local":
            assert target is not None
            pool_id = f"bench-{mode}-{num_running}"
            config = {"kvcm": {"address": target, "pool_id": pool_id, "mode": mode}}
        scheduler = build_scheduler(setup, KvcmScheduler, config)
        recorder = scheduler.kv_cache_manager.recorder
        recorder.sink = _Counting(recorder.sink)
        sides.append(scheduler)
    sides.append(build_scheduler(setup))
    for scheduler in sides:
        for plan in _plans(num_running, steps + warmup):
            scheduler.add_request(_make_request(plan, scheduler.hash_block_size))
    timings = measure([_stepper(s) for s in sides], repeats=steps, warmup=warmup)
    for scheduler in sides:
        assert len(scheduler.running) == num_running, "the bench must time full decode steps"
    vllm = timings[-1]
    rows = []
    for mode, scheduler, timing in zip(modes, sides, timings, strict=False):
        rows.append(Row.of_timings(f"{mode}, {num_running} running", timing, vllm))
        sink = scheduler.kv_cache_manager.recorder.sink
        if mode == "local":
            continue
        flushed = scheduler.kv_cache_manager.flush(60.0)
        stats = sink.stats
        num_steps = steps + warmup
        print(
            f"  {mode:>6} N={num_running}: {stats.rpcs / num_steps:.2f} RPCs/step, "
            f"{_bytes_per_step(sink.programs, 'x'):.0f} Step bytes/program, "
            f"{stats.steps_verified}/{stats.steps_submitted} programs verified, "
            f"{stats.mismatches} mismatches, {stats.resyncs} resyncs, backlog high water "
            f"{stats.backlog_high_water}{'' if flushed else ', NOT FLUSHED'}",
            flush=True,
        )
        scheduler.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print the table (ratio: vLLM / kvcm, above 1: kvcm faster)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="*", default=[8, 64, 256])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--modes", nargs="*", default=["local", "mirror", "remote"],
        choices=["local", "mirror", "remote"],
    )  # fmt: skip
    args = parser.parse_args(argv)
    if import_vllm("vllm.v1.core.sched.scheduler") is None:
        raise SystemExit("vLLM 0.33 is needed for this benchmark (see bench/_common.py)")
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    with contextlib.ExitStack() as stack:
        target = None
        if set(args.modes) - {"local"}:
            target = stack.enter_context(kvcm_server())
        rows = [row for n in args.running for row in bench(n, args.steps, args.modes, target)]
    print_table(
        rows,
        "vLLM 0.33 Scheduler.schedule() + update_from_output(), per step "
        "(kvcm: KvcmScheduler; vLLM: its own manager, same samples)",
    )
    for row in rows:
        assert row.ratio is not None
        print(f"{row.name}: kvcm / vLLM = {1 / row.ratio:.2f}x")


if __name__ == "__main__":
    main()
