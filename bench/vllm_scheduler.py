"""vLLM 0.33's scheduler on its own KV-cache manager vs on kvcm's mirror: time per step.

Both schedulers are vLLM's real ``Scheduler`` (the kvcm one is ``KvcmScheduler``, built
through ``scheduler_cls`` exactly as EngineCore builds it), in one process, on the same
workload: ``N`` requests (128-token prompts, 70 % of them sharing one of four 64-token
prefixes) admitted, prefilled, then decoding for long enough that none finishes. One sample is
one engine step's ``schedule()`` plus ``update_from_output()`` (the simulated model's output is
built outside the timed part); samples of the two sides are interleaved after
``gc.collect(); gc.freeze()``, as vLLM's engine runs. The mirror's figure includes recording the
step's Step program (shipping it is the next stage).

    python bench/vllm_scheduler.py                 # N = 8, 64, 256; ~40 s on 2 cores
    python bench/vllm_scheduler.py --running 256 --steps 400

Targets (issue 10): mirror median <= 1.0x vLLM at 256 running, <= 1.25x at 8.
"""

from __future__ import annotations

import argparse
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

from _common import Row, import_vllm, measure, print_table

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


def bench(num_running: int, steps: int) -> Row:
    """One row: per-step time of vLLM's manager (vLLM column) and kvcm's mirror (kvcm)."""
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
    sides = [build_scheduler(setup, KvcmScheduler), build_scheduler(setup)]
    for scheduler in sides:
        for plan in _plans(num_running, steps + warmup):
            scheduler.add_request(_make_request(plan, scheduler.hash_block_size))
    kvcm, vllm = measure([_stepper(s) for s in sides], repeats=steps, warmup=warmup)
    for scheduler in sides:
        assert len(scheduler.running) == num_running, "the bench must time full decode steps"
    return Row.of_timings(f"step, {num_running} running", kvcm, vllm)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print the table (ratio: vLLM / kvcm, above 1: kvcm faster)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="*", default=[8, 64, 256])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    if import_vllm("vllm.v1.core.sched.scheduler") is None:
        raise SystemExit("vLLM 0.33 is needed for this benchmark (see bench/_common.py)")
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    rows = [bench(n, args.steps) for n in args.running]
    print_table(
        rows,
        "vLLM 0.33 Scheduler.schedule() + update_from_output(), per step "
        "(kvcm: KvcmScheduler on the mirror; vLLM: its own manager)",
    )
    for row in rows:
        assert row.ratio is not None
        print(f"{row.name}: mirror / vLLM = {1 / row.ratio:.2f}x")


if __name__ == "__main__":
    main()
