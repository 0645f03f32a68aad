"""The ZMQ KV-event stream: its cost on the Step path, its throughput, and vLLM's publisher.

Three measurements, each printing medians and p99:

1. A churning Step RPC (32 new 4-block requests admitted and finished per Step: every Step
   stores blocks and, once the pool is full, evicts some) against two ``kvcm serve``
   processes, one with ``--kv-events-endpoint`` (a subscriber in this process counts what
   arrives) and one without; the samples interleave. The ratio is the stream's cost on the
   Step path (the event loop only queues; the publisher thread encodes and sends).
2. Events per second end to end: what the subscriber received during (1).
3. Encoding one batch on the wire: kvcm's publisher (core events -> vLLM's structs -> msgpack)
   against vLLM 0.33's own (its structs -> msgpack, as its ZmqEventPublisher does), same
   batches, same run, and the bytes compared.
4. The publisher alone (``KvEventStream`` in this process, a SUB socket on loopback TCP read
   by its own thread): the batches per second it sustains when batches are published back to
   back (AllBlocksCleared batches, the smallest; and Step-sized ones, 32 requests admitted
   and finished by the core per batch), and the publish-to-wire latency (from ``publish()``
   until the subscriber holds the batch) at a paced 1,000 batches/s, p50 and p99.

Run: ``python bench/kv_events.py [--steps 300]`` (``--publisher-only``: just 4).
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import msgspec
import zmq
from _common import Timing, import_vllm, kvcm_server

from kvcm.client import ItemStatus, PoolConfig, SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.events import BlockStored
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import Pool
from kvcm.core.program import StepProgram
from kvcm.server.kv_events import EventBatchStruct, KvEventNumbering, KvEventStream, _to_structs
from kvcm.server.settings import ServerSettings

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
REQUESTS_PER_STEP = 32
BLOCKS_PER_PROMPT = 4


def _pool_config() -> PoolConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16
    )
    layout = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )
    return PoolConfig(
        max_model_len=4096,
        explicit_layout=layout,
        hash_algorithm="sha256_cbor",
        enable_kv_cache_events=True,
        event_retention_num_events=100_000,
    )


def churn_runner(client: SchedulerClient, pool_id: str, seed: int) -> Callable[[], None]:
    """One Step per call: admit and finish REQUESTS_PER_STEP new distinct prompts."""
    client.create_pool(pool_id, _pool_config())
    hasher = client.block_hasher(pool_id)
    rng = random.Random(seed)
    next_key = [0]

    def run() -> None:
        step = StepBuilder()
        keys = []
        for _ in range(REQUESTS_PER_STEP):
            key = next_key[0]
            next_key[0] += 1
            prompt = [rng.randrange(32_000) for _ in range(BLOCKS_PER_PROMPT * BLOCK_SIZE + 1)]
            step.add_request(key, prompt, hasher.hash_token_ids(prompt))
            step.allocate(key, len(prompt), 0, lookup=True)
            keys.append(key)
        for key in keys:
            step.finish(key)
        result = client.step(pool_id, step)
        if any(status is not ItemStatus.OK for status in result.statuses):
            raise RuntimeError(f"churn step failed: {result}")

    return run


class _Counter:
    """A SUB socket drained by a thread: messages and events received."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.messages = 0
        self.events = 0
        self.last_seq = -1
        self.gaps = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        while not self._stop:
            if not self.sub.poll(50):
                continue
            _, seq, payload = self.sub.recv_multipart()
            number = int.from_bytes(seq, "big")
            if self.last_seq >= 0 and number != self.last_seq + 1:
                self.gaps += 1
            self.last_seq = number
            self.messages += 1
            self.events += len(decoder.decode(payload)[1])

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sub.close(linger=0)
        self.ctx.term()


def _interleaved(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, Timing]:
    for run in runs.values():
        for _ in range(5):
            run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for index in range(repeats):
        for name in names if index % 2 == 0 else reversed(names):
            start = time.perf_counter()
            runs[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: Timing.of(values) for name, values in samples.items()}


def bench_step_path(steps: int) -> None:
    """(1) and (2): the Step RPC with and without the ZMQ stream; events per second."""
    counter = _Counter()
    try:
        with (
            kvcm_server() as plain,
            kvcm_server("--kv-events-endpoint", f"tcp://127.0.0.1:{counter.port}") as zmq_on,
            SchedulerClient(plain, timeout=30) as plain_client,
            SchedulerClient(zmq_on, timeout=30) as zmq_client,
        ):
            runs = {
                "off": churn_runner(plain_client, "bench", 1),
                "zmq": churn_runner(zmq_client, "bench", 1),
            }
            time.sleep(1.0)  # the PUB socket connects to the subscriber
            started = time.perf_counter()
            first_events = counter.events
            timings = _interleaved(runs, steps)
            elapsed = time.perf_counter() - started
            time.sleep(1.0)
            received = counter.events - first_events
    finally:
        counter.close()
    print(
        f"Step RPC, {REQUESTS_PER_STEP} requests admitted and finished per Step "
        f"({REQUESTS_PER_STEP * BLOCKS_PER_PROMPT} blocks stored), {steps} samples each"
    )
    print(f"{'':<40} {'p50 ms':>9} {'p99 ms':>9}")
    for name, timing in timings.items():
        label = "ZMQ stream on" if name == "zmq" else "ZMQ stream off"
        print(f"{label:<40} {timing.median_ms:>9.3f} {timing.p99_ms:>9.3f}")
    base = timings["off"]
    print(
        f"ratio on / off: p50 {timings['zmq'].median_ms / base.median_ms:.3f}, "
        f"p99 {timings['zmq'].p99_ms / base.p99_ms:.3f}"
    )
    print(
        f"subscriber received {counter.messages} batches, {counter.events} events "
        f"({received / elapsed:,.0f} events/s during the timed run, both servers sharing "
        f"the machine), {counter.gaps} gaps in seq"
    )


def bench_encoding(repeats: int) -> None:
    """(3): encoding one batch, kvcm's publisher against vLLM's."""
    modules = import_vllm("vllm.distributed.kv_events")
    rng = random.Random(3)
    batches: list[list[BlockStored]] = []
    for _ in range(64):
        events = []
        for _ in range(REQUESTS_PER_STEP):
            hashes = [rng.randbytes(32) for _ in range(BLOCKS_PER_PROMPT)]
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[
                        rng.randrange(32_000) for _ in range(BLOCKS_PER_PROMPT * BLOCK_SIZE)
                    ],
                    block_size=BLOCK_SIZE,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None] * BLOCKS_PER_PROMPT,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
        batches.append(events)
    encoder = msgspec.msgpack.Encoder()

    def ours(events: list[BlockStored]) -> bytes:
        return encoder.encode(EventBatchStruct(1.0, _to_structs(events, True), 0))

    build_vllm: Callable[[list[BlockStored]], Any] | None = None
    if modules is not None:
        kv_events = modules["vllm.distributed.kv_events"]
        kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
        convert = kv_cache_utils.maybe_convert_block_hash

        def build_vllm(events: list[BlockStored]) -> Any:
            # What vLLM's block pool and scheduler do per step: its structs, hashes converted.
            return kv_events.KVEventBatch(
                ts=1.0,
                events=[
                    kv_events.BlockStored(
                        block_hashes=[convert(h) for h in e.block_hashes],
                        parent_block_hash=None,
                        token_ids=e.token_ids,
                        block_size=e.block_size,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                        extra_keys=e.extra_keys,
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                    )
                    for e in events
                ],
                data_parallel_rank=0,
            )

        same = all(ours(b) == encoder.encode(build_vllm(b)) for b in batches)
        print(f"payload bytes equal to vLLM's encoder output: {same}")
    samples: dict[str, list[float]] = {"kvcm": [], "vllm build+encode": [], "vllm encode": []}
    perf = time.perf_counter
    for index in range(repeats):
        batch = batches[index % len(batches)]
        start = perf()
        ours(batch)
        samples["kvcm"].append(perf() - start)
        if build_vllm is not None:
            start = perf()
            built = build_vllm(batch)
            encoder.encode(built)
            samples["vllm build+encode"].append(perf() - start)
            start = perf()
            encoder.encode(built)
            samples["vllm encode"].append(perf() - start)
    events = REQUESTS_PER_STEP
    print(
        f"a {events}-event batch ({events * BLOCKS_PER_PROMPT} hashes) to wire bytes, "
        f"{repeats} samples"
    )
    print(f"{'':<44} {'p50 us':>9} {'p99 us':>9} {'events/s':>12}")
    labels = {
        "kvcm": "kvcm: core events -> structs -> msgpack",
        "vllm build+encode": "vLLM 0.33: its structs built -> msgpack",
        "vllm encode": "vLLM 0.33: msgpack of ready structs",
    }
    timings = {name: Timing.of(values) for name, values in samples.items() if values}
    for name, timing in timings.items():
        print(
            f"{labels[name]:<44} {timing.median_ms * 1e3:>9.1f} {timing.p99_ms * 1e3:>9.1f} "
            f"{events / (timing.median_ms / 1e3):>12,.0f}"
        )
    if "vllm build+encode" in timings:
        ratio = timings["kvcm"].median_ms / timings["vllm build+encode"].median_ms
        print(f"ratio kvcm / vLLM (build + encode): {ratio:.2f}x")
    else:
        print("vLLM not importable: no vLLM rows (set KVCM_VLLM_SITE)")


class _Stamped:
    """A SUB socket drained by a thread, keeping each batch's arrival time by ``seq``."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.arrived: dict[int, float] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        arrived, perf = self.arrived, time.perf_counter
        while not self._stop:
            if self.sub.poll(20):
                while True:
                    try:
                        _, seq, _ = self.sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    arrived[int.from_bytes(seq, "big")] = perf()

    def wait(self, count: int, timeout_s: float = 60.0) -> float:
        """Until ``count`` batches arrived; the arrival time of the last."""
        deadline = time.monotonic() + timeout_s
        while len(self.arrived) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(self.arrived)} of {count} batches arrived")
            time.sleep(0.001)
        return max(self.arrived.values())

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sub.close(linger=0)
        self.ctx.term()


def _step_program(rng: random.Random, first_key: int, hasher: Any) -> StepProgram:
    step = StepBuilder()
    for key in range(first_key, first_key + REQUESTS_PER_STEP):
        prompt = [rng.randrange(32_000) for _ in range(BLOCKS_PER_PROMPT * BLOCK_SIZE + 1)]
        step.add_request(key, prompt, hasher.hash_token_ids(prompt))
        step.allocate(key, len(prompt), 0, lookup=True)
    for key in range(first_key, first_key + REQUESTS_PER_STEP):
        step.finish(key)
    return step.build()


def _publisher_run(
    label: str, num_batches: int, produce: Callable[[int], Pool], pace_s: float = 0.0
) -> tuple[list[float], float]:
    """Publish ``num_batches`` (``produce(i)`` makes batch i and returns its pool), paced
    ``pace_s`` apart; the publish-to-wire latencies and the wire's batches/s."""
    wire = _Stamped()
    settings = ServerSettings(
        kv_events_endpoint=f"tcp://127.0.0.1:{wire.port}",
        kv_events_hwm=10_000_000,
        kv_events_max_queue_size=10_000_000,
    )
    stream = KvEventStream(
        settings,
        collect=lambda *_: None,  # type: ignore[arg-type,return-value]
        numbering=KvEventNumbering(),
    )
    try:
        while stream.counters.peers == 0:
            time.sleep(0.01)
        time.sleep(0.3)  # the subscription travels after the connection
        published: list[float] = []
        seqs: list[int] = []
        perf = time.perf_counter
        started = perf()
        for index in range(num_batches):
            pool = produce(index)
            seqs.append(pool.event_batches()[0] - 1)
            published.append(perf())
            stream.publish(pool, f"kv@{pool.name}@")
            if pace_s:  # sleep, not spin: a spinning producer would starve the publisher
                wait = started + (index + 1) * pace_s - perf()
                if wait > 0:
                    time.sleep(wait)
        last = wire.wait(num_batches)
        if stream.counters.dropped:
            raise RuntimeError(f"{label}: {stream.counters.dropped} batches dropped")
        latencies = [wire.arrived[seq] - at for seq, at in zip(seqs, published, strict=True)]
        return latencies, num_batches / (last - published[0])
    finally:
        stream.close(timeout=10.0)
        wire.close()


def bench_publisher(num_batches: int, num_steps: int) -> None:
    """The publisher's throughput and publish-to-wire latency (measurement 4)."""
    print(f"== ZMQ publisher alone ({num_batches:,} batches, {num_steps:,} Step batches)")
    cleared = Pool("bench", _pool_config())

    def clear(_: int) -> Pool:
        cleared.publish_cleared(time.time())
        return cleared

    stepped = Pool("bench-steps", _pool_config())
    hasher = stepped.hashing.block_hasher()
    rng = random.Random(5)
    programs = [_step_program(rng, i * REQUESTS_PER_STEP, hasher) for i in range(num_steps)]

    def step(index: int) -> Pool:
        stepped.run_step(programs[index])
        stepped.publish_events(time.time())
        return stepped

    for label, produce, count, pace in (
        ("AllBlocksCleared, back to back", clear, num_batches, 0.0),
        ("Step-sized, back to back", step, num_steps, 0.0),
        ("AllBlocksCleared, paced 1,000/s", clear, min(num_batches, 3_000), 1e-3),
    ):
        latencies, rate = _publisher_run(label, count, produce, pace)
        timing = Timing.of(latencies)
        print(
            f"{label:34s} {rate:10,.0f} batches/s on the wire   publish-to-wire "
            f"p50 {timing.median_ms:7.3f} ms  p99 {timing.p99_ms:7.3f} ms"
        )
        if label.startswith("Step"):
            events = sum(len(b[1]) for b in stepped.event_batches_from(0)) / max(1, num_steps)
            print(f"{'':34s} ({events:.0f} events per Step batch, core time included)")


def main(argv: list[str] | None = None) -> None:
    """Run the four measurements."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--encode-repeats", type=int, default=2000)
    parser.add_argument("--publisher-batches", type=int, default=50_000)
    parser.add_argument("--publisher-steps", type=int, default=1_000)
    parser.add_argument("--publisher-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.publisher_only:
        bench_step_path(args.steps)
        print()
        bench_encoding(args.encode_repeats)
        print()
    bench_publisher(args.publisher_batches, args.publisher_steps)


if __name__ == "__main__":
    main()
