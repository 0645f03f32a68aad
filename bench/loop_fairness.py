"""Event-loop fairness: how long a cheap call waits while other clients send the biggest work.

Starts ``kvcm serve`` on a free loopback port (its own process), then for each phase one
client (a thread of this process) calls ``DescribePool`` back to back and records each round
trip, while a second client (another process, so the two do not share an interpreter lock)
sends the phase's load:

* ``idle``: no load.
* ``pool``: CreatePool of a ``--pool-blocks`` explicit-layout pool, then DeletePool, in a loop.
* ``step``: the largest Step the limits allow: ADD_REQUEST + ALLOCATE (with lookup) of
  requests whose prompts total ``max_step_tokens`` tokens (``--step-tokens``, in prompts of
  ``--prompt-tokens``), then a Step finishing them all,
  in a loop (three sets of prompts in turn, so every admission misses the prefix cache).
* ``ops``: the Step with the most ops the limits allow: ``max_step_ops`` / 2 one-block
  requests (ADD_REQUEST + ALLOCATE each), then a Step finishing them all, in a loop.

Prints p50 / p99 / max of the probe's round trips per phase (target: p99 under 20 ms), and
the load client's own round trips. ``--server-src DIR`` runs the server from another checkout
(``DIR/{core,server,client,proto}``), to measure a revision before a change::

    python bench/loop_fairness.py                 # about 30 s
    python bench/loop_fairness.py --phases pool --seconds 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import threading
import time
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from _common import kvcm_server

from kvcm.client import ItemStatus, PoolConfig, SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.limits import DEFAULT_LIMITS

BLOCK_SIZE = 16
PROMPT_TOKENS = 16384
VOCAB = 32000


def _config(num_blocks: int, max_model_len: int = PROMPT_TOKENS) -> PoolConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16
    )
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )
    return PoolConfig(max_model_len=max_model_len, explicit_layout=layout, hash_algorithm="xxhash")


# ------------------------------------------------------------------------------- loads
def _pool_load(target: str, ready: EventType, stop: EventType, pool_blocks: int) -> None:
    with SchedulerClient(target, timeout=120.0) as client:
        ready.set()
        samples = []
        while not stop.is_set():
            started = time.perf_counter()
            client.create_pool("big", _config(pool_blocks))
            created = time.perf_counter()
            client.delete_pool("big")
            samples.append((created - started, time.perf_counter() - created))
        _print_load("CreatePool", [s[0] for s in samples])
        _print_load("DeletePool", [s[1] for s in samples])


def _step_sets(
    hash_size: int, step_tokens: int, prompt_tokens: int
) -> list[list[tuple[list[int], bytes]]]:
    rng = random.Random(0)
    num_requests = max(1, step_tokens // prompt_tokens)
    blocks_per_prompt = prompt_tokens // BLOCK_SIZE
    sets = []
    for _ in range(3):
        requests = []
        for _ in range(num_requests):
            prompt = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
            requests.append((prompt, rng.randbytes(hash_size * blocks_per_prompt)))
        sets.append(requests)
    return sets


def _step_load(
    target: str, ready: EventType, stop: EventType, total_tokens: int, prompt_tokens: int
) -> None:
    num_blocks = total_tokens // BLOCK_SIZE + 1024
    with SchedulerClient(target, timeout=120.0) as client:
        info = client.create_pool("steps", _config(num_blocks, max(prompt_tokens, 1024)))
        sets = _step_sets(info.hashing.hash_length_bytes, total_tokens, prompt_tokens)
        ready.set()
        admit, finish = [], []
        turn = 0
        while not stop.is_set():
            builder = StepBuilder()
            for key, (prompt, hashes) in enumerate(sets[turn % len(sets)]):
                builder.add_request(key, prompt, hashes)
                builder.allocate(key, len(prompt), 0, lookup=True)
            started = time.perf_counter()
            result = client.step("steps", builder)
            admit.append(time.perf_counter() - started)
            if any(status is not ItemStatus.OK for status in result.statuses):
                raise RuntimeError("admission did not fit")
            builder = StepBuilder()
            for key in range(len(sets[0])):
                builder.finish(key)
            started = time.perf_counter()
            client.step("steps", builder)
            finish.append(time.perf_counter() - started)
            turn += 1
        client.delete_pool("steps")
        _print_load(f"Step admit {total_tokens} tokens", admit)
        _print_load("Step finish all", finish)


def _print_load(name: str, samples_s: list[float]) -> None:
    if samples_s:
        mean = statistics.mean(samples_s) * 1e3
        print(f"    load: {name:<28} n={len(samples_s):<4} mean {mean:8.1f} ms", flush=True)


# ------------------------------------------------------------------------------- probe
def _probe(target: str, seconds: float) -> list[float]:
    samples = []
    with SchedulerClient(target, timeout=60.0) as client:
        give_up_at = time.monotonic() + seconds
        while time.monotonic() < give_up_at:
            started = time.perf_counter()
            client.describe_pool("probe")
            samples.append(time.perf_counter() - started)
    return samples


def _run_phase(target: str, phase: str, args: argparse.Namespace) -> None:
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    load = None
    if phase == "pool":
        load = context.Process(target=_pool_load, args=(target, ready, stop, args.pool_blocks))
    elif phase == "step":
        load = context.Process(
            target=_step_load,
            args=(target, ready, stop, args.step_tokens, args.prompt_tokens),
        )
    elif phase == "ops":
        ops_tokens = args.step_ops // 2 * BLOCK_SIZE
        load = context.Process(
            target=_step_load, args=(target, ready, stop, ops_tokens, BLOCK_SIZE)
        )
    if load is not None:
        load.start()
        if not ready.wait(120):
            raise RuntimeError(f"the {phase} load did not start")
        time.sleep(0.2)
    samples: list[float] = []
    thread = threading.Thread(target=lambda: samples.extend(_probe(target, args.seconds)))
    thread.start()
    thread.join()
    stop.set()
    ordered = sorted(samples)
    p50 = statistics.median(ordered) * 1e3
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3
    print(
        f"{phase:<5} DescribePool n={len(ordered):<6} p50 {p50:6.2f} ms  p99 {p99:8.2f} ms  "
        f"max {ordered[-1] * 1e3:8.1f} ms",
        flush=True,
    )
    if load is not None:
        load.join(timeout=300)


def main() -> None:
    """Run the phases and print one line per phase."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="probe time per phase")
    parser.add_argument("--pool-blocks", type=int, default=4 * 1024 * 1024)
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=DEFAULT_LIMITS.max_step_tokens,
        help="prompt tokens one Step adds (default: max_step_tokens)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument(
        "--step-ops",
        type=int,
        default=DEFAULT_LIMITS.max_step_ops,
        help="ops of the ops phase's Steps (default: max_step_ops)",
    )
    parser.add_argument("--phases", default="idle,pool,step,ops", help="comma-separated phases")
    parser.add_argument("--server-src", default=None, help="run the server from this checkout")
    args = parser.parse_args()
    with kvcm_server(server_src=args.server_src) as target:
        with SchedulerClient(target, timeout=10.0) as client:
            client.create_pool("probe", _config(64, max_model_len=1024))
        for phase in args.phases.split(","):
            _run_phase(target, phase, args)


if __name__ == "__main__":
    main()
