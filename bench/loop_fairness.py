"""Event-loop fairness: how long a neighbour pool's calls wait while another pool does big work.

Starts ``kvcm serve`` on a free loopback port (its own process). A probe client (a thread of
this process) calls its own pool, ``neighbour``, back to back and records each round trip,
while a load client (another process, so the two share no interpreter lock) works on another
pool. The probe's call (``--probe``):

* ``step`` (default): a small Step on the neighbour pool (ADD_REQUEST + ALLOCATE with lookup
  + FINISH of one 16-token prompt), what a neighbour scheduler sends;
* ``describe``: ``DescribePool`` of the neighbour pool.

The load (``--load``):

* ``ops`` (default): the Step with the most admissions the limits allow, ``max_step_ops`` / 2
  (4,096) one-block requests (ADD_REQUEST + ALLOCATE with lookup each), then a Step finishing
  them all, in a loop (three sets of prompts in turn, so every admission misses the cache);
* ``tokens``: the same with prompts of ``--prompt-tokens`` totalling ``max_step_tokens``;
* ``pool``: CreatePool of a ``--pool-blocks`` explicit-layout pool, then DeletePool.

The load's messages are encoded once, before timing, and sent as bytes, so the load client
spends no CPU on the 2-core machines this runs on. Windows without and with the load
alternate (``--rounds`` of ``--seconds`` each) so that machine drift hits both alike; the run
ends with one line per condition (p50 / p99 / max of the probe) and the p99 the load added::

    python bench/loop_fairness.py                      # about 40 s
    python bench/loop_fairness.py --load pool --pool-blocks 1048576
    python bench/loop_fairness.py --server-src ../old  # a checkout before a change
"""

from __future__ import annotations

import argparse
import gc
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

from kvcm.client import PoolConfig, SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.limits import DEFAULT_LIMITS
from kvcm.v1 import scheduler_pb2

BLOCK_SIZE = 16
VOCAB = 32000
_STEP_METHOD = "/kvcm.v1.SchedulerService/Step"


def _config(num_blocks: int, max_model_len: int = 1024) -> PoolConfig:
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
def _encoded_steps(
    hash_size: int, num_requests: int, prompt_tokens: int
) -> tuple[list[bytes], bytes]:
    """Three admitting Steps (distinct prompts) and the Step finishing them, as bytes."""
    rng = random.Random(0)
    blocks_per_prompt = prompt_tokens // BLOCK_SIZE
    admits = []
    for _ in range(3):
        builder = StepBuilder()
        for key in range(num_requests):
            prompt = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
            builder.add_request(key, prompt, rng.randbytes(hash_size * blocks_per_prompt))
            builder.allocate(key, prompt_tokens, 0, lookup=True)
        admits.append(builder.to_proto("load").SerializeToString())
    finish = StepBuilder()
    for key in range(num_requests):
        finish.finish(key)
    return admits, finish.to_proto("load").SerializeToString()


def _step_load(
    target: str, ready: EventType, go: EventType, idle: EventType, stop: EventType,
    num_requests: int, prompt_tokens: int,
) -> None:  # fmt: skip
    import grpc

    num_blocks = num_requests * (prompt_tokens // BLOCK_SIZE) + 1024
    with SchedulerClient(target, timeout=120.0) as client:
        info = client.create_pool("load", _config(num_blocks, max(prompt_tokens, 1024)))
    admits, finish = _encoded_steps(info.hashing.hash_length_bytes, num_requests, prompt_tokens)
    gc.collect()
    gc.freeze()  # this client's own collections must not slow its Steps
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(target, options=options) as channel:
        step = channel.unary_unary(_STEP_METHOD)
        times: list[float] = []
        turn = 0
        ready.set()
        while not stop.is_set():
            if not go.is_set():
                idle.set()
                go.wait(0.05)
                continue
            idle.clear()
            started = time.perf_counter()
            answer = scheduler_pb2.StepResponse.FromString(step(admits[turn % 3], timeout=120))
            times.append(time.perf_counter() - started)
            if list(answer.alloc_statuses).count(1) != num_requests:  # ITEM_STATUS_OK
                raise RuntimeError("an admission did not fit")
            step(finish, timeout=120)
            turn += 1
    if times:
        print(
            f"load: {len(times)} Steps admitting {num_requests} requests, mean "
            f"{statistics.mean(times) * 1e3:.0f} ms each",
            flush=True,
        )


def _pool_load(
    target: str, ready: EventType, go: EventType, idle: EventType, stop: EventType,
    pool_blocks: int,
) -> None:  # fmt: skip
    with SchedulerClient(target, timeout=120.0) as client:
        ready.set()
        while not stop.is_set():
            if not go.is_set():
                idle.set()
                go.wait(0.05)
                continue
            idle.clear()
            client.create_pool("big", _config(pool_blocks))
            client.delete_pool("big")


# ------------------------------------------------------------------------------- probe
def _probe(client: SchedulerClient, kind: str, seconds: float) -> list[float]:
    hasher = client.block_hasher("neighbour")
    prompt = list(range(BLOCK_SIZE))
    hashes = hasher.hash_token_ids(prompt)
    samples = []
    give_up_at = time.monotonic() + seconds
    while time.monotonic() < give_up_at:
        started = time.perf_counter()
        if kind == "describe":
            client.describe_pool("neighbour")
        else:
            step = StepBuilder()
            step.add_request(1, prompt, hashes)
            step.allocate(1, BLOCK_SIZE, 0, lookup=True)
            step.finish(1)
            client.step("neighbour", step)
        samples.append(time.perf_counter() - started)
    return samples


def _summary(name: str, samples: list[float]) -> float:
    ordered = sorted(samples)
    p50 = statistics.median(ordered) * 1e3
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3
    print(
        f"{name:<22} n={len(ordered):<6} p50 {p50:6.2f} ms  p99 {p99:7.2f} ms  "
        f"max {ordered[-1] * 1e3:7.1f} ms",
        flush=True,
    )
    return p99


def main() -> None:
    """Alternate windows without and with the load; print the probe's figures for each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one window")
    parser.add_argument("--rounds", type=int, default=4, help="window pairs (without, with)")
    parser.add_argument("--probe", choices=("step", "describe"), default="step")
    parser.add_argument("--load", choices=("ops", "tokens", "pool"), default="ops")
    parser.add_argument(
        "--admissions",
        type=int,
        default=DEFAULT_LIMITS.max_step_ops // 2,
        help="requests one ops-load Step admits (default: max_step_ops / 2)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=16384, help="for --load tokens")
    parser.add_argument("--pool-blocks", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--server-src", default=None, help="run the server from this checkout")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    ready, go, idle, stop = (context.Event() for _ in range(4))
    with kvcm_server(server_src=args.server_src) as target:
        if args.load == "pool":
            load_args: tuple[object, ...] = (args.pool_blocks,)
            load = context.Process(
                target=_pool_load, args=(target, ready, go, idle, stop, *load_args)
            )
        else:
            if args.load == "ops":
                load_args = (args.admissions, BLOCK_SIZE)
            else:
                load_args = (
                    max(1, DEFAULT_LIMITS.max_step_tokens // args.prompt_tokens),
                    args.prompt_tokens,
                )
            load = context.Process(
                target=_step_load, args=(target, ready, go, idle, stop, *load_args)
            )
        load.start()
        if not ready.wait(300):
            raise RuntimeError("the load did not start")
        alone: list[float] = []
        beside: list[float] = []
        with SchedulerClient(target, timeout=60.0) as client:
            client.create_pool("neighbour", _config(64))
            _probe(client, args.probe, 0.5)  # warm up
            gc.collect()
            gc.freeze()  # the probe's own collections are not the server's latency
            for _ in range(args.rounds):
                idle.wait(300)
                alone.extend(_probe(client, args.probe, args.seconds))
                go.set()
                time.sleep(0.2)  # the load's first big Step is under way
                beside.extend(_probe(client, args.probe, args.seconds))
                go.clear()
        stop.set()
        load.join(timeout=300)
    probe = "Step" if args.probe == "step" else "DescribePool"
    print(f"neighbour {probe} round trips, {args.rounds} x {args.seconds:g} s each:")
    quiet = _summary("  without the load", alone)
    busy = _summary(f"  beside the {args.load} load", beside)
    print(f"  added p99: {busy - quiet:.2f} ms")


if __name__ == "__main__":
    threading.current_thread().name = "probe"
    main()
