"""Benchmark: the SDK and server round trip against in-process managers (kvcm core and vLLM).

Prints median and p99 of:

1. a unary ``allocate_slots`` round trip (one slot for a long request, one call per sample);
2. a Step RPC carrying a 256-request decode step (per request: append one token, with the
   hash of the block it completes, and allocate one slot), built, sent and decoded by the SDK;
3. the same decode step in-process on kvcm's core and on vLLM 0.33's ``KVCacheManager`` (where
   importable; ``$KVCM_VLLM_SITE`` appended to the end of ``sys.path``), timed interleaved
   with the remote one (the order alternating every round) so machine load hits all alike;
4. Step throughput with 8 concurrent schedulers (processes) on 8 pools of one server;

and the ratio remote Step / vLLM in-process (target: at most 1.5). Both sides hash the blocks
their requests complete (the SDK client-side, vLLM in its request) and run with ``gc.freeze()``
after setup, as vLLM's engine does.

    python bench/rpc.py [--target HOST:PORT] [--steps 300] [--requests 256]
    python bench/rpc.py --tracing    # Step RPC with tracing off / on / on under a client span
    python bench/rpc.py --tls        # Step RPC over plaintext and over TLS

Without ``--target`` the benchmark starts ``kvcm serve`` on a free loopback port and stops it.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from _common import kvcm_server

from kvcm.client import ItemStatus, PoolConfig, SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHash, BlockHasher, MultiModalFeature
from kvcm.common.specs import FullAttentionSpec

_DEFAULT_SITE = Path.home() / ".cache/kvcm/vllm-ref/lib/python3.11/site-packages"
BLOCK_SIZE = 16
NUM_BLOCKS = 40_000
MAX_MODEL_LEN = 8192
PROMPT_TOKENS = 512
HASH_ALGORITHM = "sha256_cbor"
VOCAB = 32_000


@dataclass(frozen=True, slots=True)
class Timing:
    """Median and p99 of samples, in milliseconds."""

    median_ms: float
    p99_ms: float

    @classmethod
    def of(cls, samples_s: list[float]) -> Timing:
        """Summarize samples given in seconds."""
        ordered = sorted(samples_s)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        return cls(statistics.median(ordered) * 1e3, p99 * 1e3)


def _layout() -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )


def _pool_config() -> PoolConfig:
    return PoolConfig(
        max_model_len=MAX_MODEL_LEN, explicit_layout=_layout(), hash_algorithm=HASH_ALGORITHM
    )


# ----------------------------------------------------------------------------- tracing
@contextmanager
def _otlp_collector() -> Iterator[tuple[str, list[int]]]:
    """A minimal OTLP/gRPC trace collector on loopback that accepts and counts spans."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2,
        trace_service_pb2_grpc,
    )

    received = [0]

    class _Collector(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
            received[0] += sum(
                len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans
            )
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None)


def _self_signed(directory: str) -> tuple[str, str, bytes]:
    """A self-signed certificate for 127.0.0.1 (cert path, key path, PEM)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvcm-bench")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            False,
        )
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_path, key_path = os.path.join(directory, "c.pem"), os.path.join(directory, "k.pem")
    with open(cert_path, "wb") as out:
        out.write(pem)
    with open(key_path, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path, pem


def bench_tls(num_requests: int, repeats: int) -> None:
    """Step RPC over plaintext and over TLS (same machine, interleaved)."""
    import tempfile

    from kvcm.client import TlsConfig

    with tempfile.TemporaryDirectory() as directory:
        cert, key, pem = _self_signed(directory)
        with (
            kvcm_server() as plain,
            kvcm_server(
                "--tls-cert", cert, "--tls-key", key, tls=TlsConfig(root_certificates=pem)
            ) as secure,
            SchedulerClient(plain) as plain_client,
            SchedulerClient(secure, tls=TlsConfig(root_certificates=pem)) as tls_client,
        ):
            timings = time_interleaved(
                {
                    "plaintext": remote_step_runner(plain_client, num_requests),
                    "TLS": remote_step_runner(tls_client, num_requests),
                },
                repeats,
            )
    print(f"TLS cost: {num_requests}-request Step RPC, {repeats} samples each")
    print(f"{'':<48} {'p50 ms':>9} {'p99 ms':>9}")
    for name, timing in timings.items():
        print(_row(f"Step RPC, {name}", timing))
    ratio = timings["TLS"].median_ms / timings["plaintext"].median_ms
    print(f"ratio TLS / plaintext: p50 {ratio:.2f}")


def bench_tracing(num_requests: int, repeats: int) -> None:
    """Step RPC with tracing off, on, and on under a client span (context propagated)."""
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("bench")
    with (
        _otlp_collector() as (endpoint, received),
        kvcm_server() as plain,
        kvcm_server("--otlp-endpoint", endpoint) as traced,
        SchedulerClient(plain) as plain_client,
        SchedulerClient(traced) as traced_client,
    ):
        off = remote_step_runner(plain_client, num_requests)
        on = remote_step_runner(traced_client, num_requests)

        def propagated() -> None:
            with tracer.start_as_current_span("scheduler.step"):
                on()

        timings = time_interleaved({"off": off, "on": on, "on, client span": propagated}, repeats)
        time.sleep(6)  # the batch processor exports every 5 s
    print(f"tracing overhead: {num_requests}-request Step RPC, {repeats} samples each")
    print(f"{'':<48} {'p50 ms':>9} {'p99 ms':>9}")
    for name, timing in timings.items():
        print(_row(f"Step RPC, tracing {name}", timing))
    base = timings["off"].median_ms
    for name in ("on", "on, client span"):
        print(f"ratio tracing {name} / off: {timings[name].median_ms / base:.3f}")
    print(f"spans the collector received: {received[0]}")


# ------------------------------------------------------------------- remote decode step
class _Running:
    """One decoding request as the benchmark's scheduler holds it (a HashableRequest)."""

    __slots__ = ("all_token_ids", "block_hashes", "key", "num_computed_tokens")

    lora_name = None
    lora_path = None
    cache_salt = None
    prompt_embeds = None
    mm_features: tuple[MultiModalFeature, ...] = ()

    def __init__(self, key: int, prompt: list[int]) -> None:
        self.key = key
        self.all_token_ids = prompt
        self.block_hashes: list[BlockHash] = []
        self.num_computed_tokens = 0


def _admit(client: SchedulerClient, pool_id: str, num_requests: int, seed: int) -> list[_Running]:
    rng = random.Random(seed)
    hasher = client.block_hasher(pool_id)
    requests = []
    step = StepBuilder()
    for key in range(num_requests):
        request = _Running(key, [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)])
        request.block_hashes.extend(hasher.hash_request_blocks(request))
        step.add_request(key, request.all_token_ids, request.block_hashes)
        step.allocate(key, PROMPT_TOKENS, 0, lookup=True)
        requests.append(request)
    result = client.step(pool_id, step)
    if any(status is not ItemStatus.OK for status in result.statuses):
        raise RuntimeError(f"admission failed: {result}")
    for request in requests:
        request.num_computed_tokens = PROMPT_TOKENS
    return requests


def _decode_step_runner(
    client: SchedulerClient, pool_id: str, requests: list[_Running], seed: int
) -> Callable[[], None]:
    rng = random.Random(seed)
    hasher = client.block_hasher(pool_id)
    keys = [request.key for request in requests]

    def run() -> None:
        tokens = []
        hashes = []
        computed = []
        for request in requests:
            token = rng.randrange(VOCAB)
            request.all_token_ids.append(token)
            if len(request.all_token_ids) % BLOCK_SIZE:
                hashes.append(b"")  # no block became full
            else:
                new = hasher.hash_request_blocks(request)
                request.block_hashes.extend(new)
                hashes.append(new[0])
            tokens.append(token)
            computed.append(request.num_computed_tokens)
        step = StepBuilder()
        step.new_step_starts()
        step.decode(keys, tokens, computed, hashes)
        result = client.step(pool_id, step)
        if result.num_allocations_executed != len(requests):
            raise RuntimeError(f"decode step did not fit: {result}")
        for request in requests:
            request.num_computed_tokens += 1

    return run


def remote_step_runner(client: SchedulerClient, num_requests: int) -> Callable[[], None]:
    """A ``num_requests``-request decode step through one Step RPC, on a new pool."""
    pool_id = "bench-step"
    client.create_pool(pool_id, _pool_config())
    return _decode_step_runner(client, pool_id, _admit(client, pool_id, num_requests, 1), 2)


def bench_unary_allocate(target: str, repeats: int) -> Timing:
    """One unary ``allocate_slots`` (one slot of a long request) per sample."""
    with SchedulerClient(target) as client:
        pool_id = "bench-unary"
        client.create_pool(pool_id, _pool_config())
        prompt = [random.Random(3).randrange(VOCAB) for _ in range(MAX_MODEL_LEN)]
        client.add_request(pool_id, 0, prompt, client.block_hasher(pool_id).hash_token_ids(prompt))
        computed = iter(range(MAX_MODEL_LEN))

        def run() -> None:
            if client.allocate_slots(pool_id, 0, 1, next(computed)) is None:
                raise RuntimeError("unary allocation did not fit")

        return _time(run, min(repeats, MAX_MODEL_LEN - 1))


# ------------------------------------------------------------------- in-process steps
def core_step_runner(num_requests: int) -> Callable[[], None]:
    """The same decode step on kvcm's core, in-process."""
    from kvcm.core import KVCacheManager, KVCacheManagerConfig, Request, RequestStatus

    manager = KVCacheManager(
        KVCacheManagerConfig(kv_cache_config=_layout(), max_model_len=MAX_MODEL_LEN)
    )
    hasher = BlockHasher(BLOCK_SIZE, HASH_ALGORITHM, "bench")
    rng = random.Random(1)
    requests = []
    for index in range(num_requests):
        prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
        request = Request(f"r{index}", prompt, block_hasher=hasher)
        hit = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, PROMPT_TOKENS - hit.num_computed_tokens, hit) is None:
            raise RuntimeError("core admission failed")
        request.num_computed_tokens = PROMPT_TOKENS
        request.status = RequestStatus.RUNNING
        requests.append(request)
    tokens = random.Random(2)

    def run() -> None:
        manager.new_step_starts()
        for request in requests:
            request.append_output_token_ids(tokens.randrange(VOCAB))
            if manager.allocate_slots(request, 1) is None:
                raise RuntimeError("core decode did not fit")
            request.num_computed_tokens += 1

    return run


def _import_vllm() -> dict[str, Any] | None:
    site = os.environ.get("KVCM_VLLM_SITE") or str(_DEFAULT_SITE)
    if not Path(site).is_dir():
        print(f"vLLM reference not found at {site}", file=sys.stderr)
        return None
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if site not in sys.path:
        sys.path.append(site)
    try:
        return {
            "torch": importlib.import_module("torch"),
            "manager": importlib.import_module("vllm.v1.core.kv_cache_manager"),
            "interface": importlib.import_module("vllm.v1.kv_cache_interface"),
            "request": importlib.import_module("vllm.v1.request"),
            "sampling": importlib.import_module("vllm.sampling_params"),
            "utils": importlib.import_module("vllm.v1.core.kv_cache_utils"),
            "hashing": importlib.import_module("vllm.utils.hashing"),
        }
    except Exception as exc:  # any failure only means "no comparison"
        print(f"vLLM not importable from {site}: {exc!r}", file=sys.stderr)
        return None


def vllm_step_runner(num_requests: int) -> Callable[[], None] | None:
    """The same decode step on vLLM 0.33's ``KVCacheManager``, in-process (None: no vLLM)."""
    ref = _import_vllm()
    if ref is None:
        return None
    interface = ref["interface"]
    spec = interface.FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=ref["torch"].bfloat16
    )
    config = interface.KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[interface.KVCacheGroupSpec(["layer.0"], spec)],
    )
    manager = ref["manager"].KVCacheManager(
        config,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
    )
    hash_fn = ref["hashing"].get_hash_fn_by_name(HASH_ALGORITHM)
    ref["utils"].init_none_hash(hash_fn)
    block_hasher = ref["utils"].get_request_block_hasher(BLOCK_SIZE, hash_fn)
    request_mod = ref["request"]
    rng = random.Random(1)
    requests = []
    for index in range(num_requests):
        prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
        request = request_mod.Request(
            f"r{index}",
            prompt,
            ref["sampling"].SamplingParams(max_tokens=MAX_MODEL_LEN),
            None,
            block_hasher=block_hasher,
        )
        blocks, num_hit, _ = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, PROMPT_TOKENS - num_hit, num_hit, blocks) is None:
            raise RuntimeError("vLLM admission failed")
        request.num_computed_tokens = PROMPT_TOKENS
        request.status = request_mod.RequestStatus.RUNNING
        requests.append(request)
    tokens = random.Random(2)

    def run() -> None:
        manager.new_step_starts()
        for request in requests:
            request.append_output_token_ids(tokens.randrange(VOCAB))
            if manager.allocate_slots(request, 1) is None:
                raise RuntimeError("vLLM decode did not fit")
            request.num_computed_tokens += 1

    return run


# --------------------------------------------------------------------------- throughput
def _scheduler_process(
    target: str, index: int, num_requests: int, steps: int, queue: Any, start: Any
) -> None:
    with SchedulerClient(target) as client:
        pool_id = f"bench-concurrent-{index}"
        client.create_pool(pool_id, _pool_config())
        run = _decode_step_runner(
            client, pool_id, _admit(client, pool_id, num_requests, 10 + index), 20 + index
        )
        run()  # warm up
        queue.put(("ready", index, 0.0))
        start.wait()
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        queue.put(("done", index, samples))


def bench_throughput(
    target: str, num_schedulers: int, num_requests: int, steps: int
) -> tuple[float, Timing]:
    """Steps per second with ``num_schedulers`` processes, each on its own pool.

    Returns:
        Steps per second over all schedulers, and the per-step latency under that load.
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    start_event = context.Event()
    processes = [
        context.Process(
            target=_scheduler_process,
            args=(target, index, num_requests, steps, queue, start_event),
        )
        for index in range(num_schedulers)
    ]
    for process in processes:
        process.start()
    for _ in processes:
        queue.get(timeout=120)
    start = time.perf_counter()
    start_event.set()
    samples: list[float] = []
    for _ in processes:
        _, _, process_samples = queue.get(timeout=600)
        samples.extend(process_samples)
    elapsed = time.perf_counter() - start
    for process in processes:
        process.join(timeout=30)
    return num_schedulers * steps / elapsed, Timing.of(samples)


# ------------------------------------------------------------------------------ timing
def _time(run: Callable[[], None], repeats: int) -> Timing:
    for _ in range(3):
        run()  # warm up lazy imports and connections
    gc.collect()
    gc.freeze()
    samples = []
    perf = time.perf_counter
    try:
        for _ in range(repeats):
            start = perf()
            run()
            samples.append(perf() - start)
    finally:
        gc.unfreeze()
    return Timing.of(samples)


def time_interleaved(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, Timing]:
    """Median and p99 of each run, the runs interleaved (order alternating every round) so
    that load on a shared machine hits every side alike."""
    for run in runs.values():
        for _ in range(3):
            run()  # warm up lazy imports and connections
    gc.collect()
    gc.freeze()
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    perf = time.perf_counter
    try:
        for index in range(repeats):
            for name in names if index % 2 == 0 else reversed(names):
                run = runs[name]
                start = perf()
                run()
                samples[name].append(perf() - start)
    finally:
        gc.unfreeze()
    return {name: Timing.of(values) for name, values in samples.items()}


def _row(name: str, timing: Timing | None) -> str:
    if timing is None:
        return f"{name:<48} {'-':>9} {'-':>9}"
    return f"{name:<48} {timing.median_ms:>9.3f} {timing.p99_ms:>9.3f}"


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--target", help="a running server (default: start one)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--schedulers", type=int, default=8)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="instead: Step RPC with OpenTelemetry tracing off and on (needs kvcm[tracing])",
    )
    parser.add_argument(
        "--tls", action="store_true", help="instead: Step RPC over plaintext and over TLS"
    )
    args = parser.parse_args(argv)
    if args.tracing:
        bench_tracing(args.requests, args.steps)
        return
    if args.tls:
        bench_tls(args.requests, args.steps)
        return

    def measure(target: str) -> None:
        unary = bench_unary_allocate(target, args.steps * 4)
        runs = {"core": core_step_runner(args.requests)}
        vllm_run = None if args.no_vllm else vllm_step_runner(args.requests)
        if vllm_run is not None:
            runs["vllm"] = vllm_run
        with SchedulerClient(target) as client:
            runs["remote"] = remote_step_runner(client, args.requests)
            timings = time_interleaved(runs, args.steps)
        remote, core, vllm = timings["remote"], timings["core"], timings.get("vllm")
        throughput, loaded = bench_throughput(
            target, args.schedulers, args.requests, max(50, args.steps // 2)
        )
        print(f"kvcm RPC benchmark: {args.requests}-request decode steps, {args.steps} samples")
        print(f"{'':<48} {'p50 ms':>9} {'p99 ms':>9}")
        print(_row("unary allocate_slots round trip", unary))
        print(_row(f"Step RPC, {args.requests}-request decode step", remote))
        print(_row("same step in-process, kvcm core", core))
        print(_row("same step in-process, vLLM 0.33 KVCacheManager", vllm))
        print(_row(f"Step RPC under {args.schedulers} concurrent schedulers", loaded))
        print(
            f"throughput: {throughput:.0f} steps/s with {args.schedulers} schedulers on "
            f"{args.schedulers} pools ({throughput * args.requests:.0f} allocations/s)"
        )
        print(f"ratio remote Step / kvcm core in-process: {remote.median_ms / core.median_ms:.2f}")
        if vllm is not None:
            ratio = remote.median_ms / vllm.median_ms
            verdict = "meets" if ratio <= 1.5 else "misses"
            print(f"ratio remote Step / vLLM in-process: {ratio:.2f} ({verdict} the 1.5x target)")

    if args.target:
        measure(args.target)
    else:
        with kvcm_server() as target:
            measure(target)


if __name__ == "__main__":
    main()
