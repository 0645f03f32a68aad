"""Benchmark: kvcm's allocation core against vLLM 0.33.0's V1 KVCacheManager, same workloads.

Rows (median and p99 of each side, ratio = vLLM / kvcm: above 1 means kvcm is faster):

1. decode step: 256 running requests, one new token each; per request ``allocate_slots(req, 1)``
   as vLLM's scheduler calls it (prompt lengths staggered so ~1/16 of the requests cross a
   block boundary each step and cache the block they filled). Appending the sampled token
   (and hashing a newly full block) is the engine's output processing and stays untimed.
2. admission: a 32k-token prompt whose first half is cached and free (lookup + allocate + the
   admission stats record, as the scheduler does); the hit blocks leave the free queue, 1k new
   blocks are allocated and cached. Between samples the request is freed and its new blocks
   evicted (untimed), so every sample starts from the same state.
3. free: release a request holding 2,048 blocks (2,047 cached full blocks, one partial).
4. hybrid rows: decode and admission again on a hybrid full attention + sliding window
   (512-token window) model under vLLM's default sparse prefix-cache retention
   (``prefix_cache_retention_interval=0``): the sliding-window group caches only the window
   before each prompt's replay boundary and shared-prefix junction, so the admission hits one
   block short of the prefix and pins the junction.
5. hashing 1k blocks of 16 tokens with each algorithm (``bench/hashing.py``'s workloads).
6. memory per block at 1M blocks: ``tracemalloc`` of constructing the block pool.
7. hybrid Mamba rows (``bench/mamba_core.py``, shown after the manager rows): decode and
   admission with a sub-block hit on a full attention + Mamba "align" model (hash block 64
   under a Mamba block of 256).

Both sides run with ``gc.freeze()`` after setup, as vLLM's engine does; samples interleave.

    python bench/core.py [--quick] [--no-vllm] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from _common import Row, Sample, import_vllm, init_vllm_none_hash, measure, print_table
from hashing import bench_hashing
from mamba_core import bench_mamba_rows

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher, HashAlgorithm
from kvcm.common.specs import FullAttentionSpec, SlidingWindowSpec
from kvcm.core.block_pool import BlockPool
from kvcm.core.manager import KVCacheManager, KVCacheManagerConfig
from kvcm.core.request import Request, RequestStatus

__all__ = ["BenchConfig", "main", "run_benchmarks"]

BLOCK_SIZE = 16
HASH_ALGORITHM = HashAlgorithm.SHA256
HASH_SEED = "kvcm-bench"
VOCAB = 32_000
MAX_MODEL_LEN = 40_960
# The hybrid rows' sliding window and retention (vLLM's CacheConfig default).
HYBRID_WINDOW = 512
HYBRID_RETENTION = 0
VLLM_MODULES = (
    "vllm.utils.hashing",
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.request",
    "vllm.sampling_params",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """Sizes and sample counts of one run.

    Attributes:
        decode_requests: Running requests in the decode step.
        decode_prompt_tokens: Prompt length of the first decode request (the others add 0..15).
        decode_repeats: Timed decode steps per side.
        admit_prompt_tokens: Prompt length of the admitted request (half of it hits).
        admit_repeats: Timed admissions per side.
        free_blocks: Blocks held by the freed request.
        free_repeats: Timed frees per side.
        hash_blocks: Blocks per hashing sample.
        hash_repeats: Timed hashing samples per algorithm and side.
        memory_blocks: Blocks in the pool whose construction is traced.
    """

    decode_requests: int = 256
    decode_prompt_tokens: int = 1000
    decode_repeats: int = 300
    admit_prompt_tokens: int = 32_768
    admit_repeats: int = 100
    free_blocks: int = 2048
    free_repeats: int = 100
    hash_blocks: int = 1000
    hash_repeats: int = 200
    memory_blocks: int = 1_000_000


QUICK = BenchConfig(
    decode_repeats=20,
    admit_repeats=10,
    free_repeats=10,
    hash_repeats=10,
    memory_blocks=100_000,
)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# ------------------------------------------------------------------------------ sides
class _KvcmSide:
    """kvcm's core behind the operations the workloads need (timed bodies included)."""

    name = "kvcm"

    def __init__(self, num_blocks: int, hybrid: bool = False) -> None:
        specs: list[FullAttentionSpec | SlidingWindowSpec] = [
            FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16
            )
        ]
        if hybrid:
            specs.append(
                SlidingWindowSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=8,
                    head_size=128,
                    dtype=DType.BFLOAT16,
                    sliding_window=HYBRID_WINDOW,
                )
            )
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=(),
            kv_cache_groups=tuple(
                KVCacheGroupSpec(layer_names=(f"layer.{i}",), kv_cache_spec=spec)
                for i, spec in enumerate(specs)
            ),
        )
        self.hybrid = hybrid
        self.manager = KVCacheManager(
            KVCacheManagerConfig(
                kv_cache_config=config,
                max_model_len=MAX_MODEL_LEN,
                log_stats=True,
                prefix_cache_retention_interval=HYBRID_RETENTION if hybrid else None,
            )
        )
        self.hasher = BlockHasher(BLOCK_SIZE, HASH_ALGORITHM, HASH_SEED)

    def request(self, request_id: str, tokens: list[int]) -> Any:
        return Request(request_id, tokens, block_hasher=self.hasher)

    @staticmethod
    def append(request: Any, token: int) -> None:
        request.append_output_token_ids(token)

    @staticmethod
    def restart(request: Any) -> None:
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING

    @staticmethod
    def start_running(request: Any) -> None:
        request.status = RequestStatus.RUNNING

    def decode_step(self, requests: Sequence[Any]) -> None:
        manager = self.manager
        allocate = manager.allocate_slots
        manager.new_step_starts()
        for request in requests:
            if allocate(request, 1) is None:
                raise RuntimeError("decode step did not fit")
            request.num_computed_tokens += 1

    def admit(self, request: Any) -> tuple[int, list[int]]:
        manager = self.manager
        hit = manager.get_computed_blocks(request)
        num_hit = hit.num_computed_tokens
        blocks = manager.allocate_slots(request, request.num_tokens - num_hit, hit)
        manager.record_prefix_cache_stats(request, num_hit)
        if blocks is None:
            raise RuntimeError("admission did not fit")
        request.num_computed_tokens = request.num_tokens
        return num_hit, [i for group in blocks.get_block_ids() for i in group]

    def free(self, request: Any) -> None:
        self.manager.free(request)

    def evict(self, block_ids: list[int]) -> None:
        self.manager.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def free_order(self) -> list[int]:
        return [b.block_id for b in self.manager.block_pool.free_block_queue.get_all_free_blocks()]


class _VllmSide:
    """vLLM 0.33.0's KVCacheManager behind the same operations."""

    name = "vllm"

    def __init__(self, ref: dict[str, ModuleType], num_blocks: int, hybrid: bool = False) -> None:
        import torch

        kci = ref["vllm.v1.kv_cache_interface"]
        kcu = ref["vllm.v1.core.kv_cache_utils"]
        hash_fn = ref["vllm.utils.hashing"].get_hash_fn_by_name(HASH_ALGORITHM.value)
        init_vllm_none_hash(kcu, hash_fn, HASH_SEED)
        self._hasher = kcu.get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self._request_mod = ref["vllm.v1.request"]
        self._sampling = ref["vllm.sampling_params"]
        attn = {"block_size": BLOCK_SIZE, "num_kv_heads": 8, "head_size": 128}
        specs = [kci.FullAttentionSpec(**attn, dtype=torch.bfloat16)]
        if hybrid:
            specs.append(
                kci.SlidingWindowSpec(**attn, dtype=torch.bfloat16, sliding_window=HYBRID_WINDOW)
            )
        config = kci.KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                kci.KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=spec)
                for i, spec in enumerate(specs)
            ],
            prefix_cache_retention_interval=HYBRID_RETENTION if hybrid else None,
        )
        self.hybrid = hybrid
        self.manager = ref["vllm.v1.core.kv_cache_manager"].KVCacheManager(
            kv_cache_config=config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=True,
            log_stats=True,
        )

    def request(self, request_id: str, tokens: list[int]) -> Any:
        return self._request_mod.Request(
            request_id=request_id,
            prompt_token_ids=list(tokens),
            sampling_params=self._sampling.SamplingParams(max_tokens=1 << 20),
            pooling_params=None,
            block_hasher=self._hasher,
        )

    @staticmethod
    def append(request: Any, token: int) -> None:
        request.append_output_token_ids(token)

    def restart(self, request: Any) -> None:
        request.num_computed_tokens = 0
        request.status = self._request_mod.RequestStatus.WAITING

    def start_running(self, request: Any) -> None:
        request.status = self._request_mod.RequestStatus.RUNNING

    def decode_step(self, requests: Sequence[Any]) -> None:
        manager = self.manager
        allocate = manager.allocate_slots
        manager.new_step_starts()
        for request in requests:
            if allocate(request, 1, num_lookahead_tokens=0) is None:
                raise RuntimeError("decode step did not fit")
            request.num_computed_tokens += 1

    def admit(self, request: Any) -> tuple[int, list[int]]:
        manager = self.manager
        hit_blocks, num_hit, junction = manager.get_computed_blocks(request)
        request.shared_prefix_boundary = junction  # as vLLM's scheduler keeps it
        blocks = manager.allocate_slots(
            request,
            request.num_tokens - num_hit,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_blocks,
        )
        manager.record_prefix_cache_stats(request, num_hit)
        if blocks is None:
            raise RuntimeError("admission did not fit")
        request.num_computed_tokens = request.num_tokens
        return num_hit, [i for group in blocks.get_block_ids() for i in group]

    def free(self, request: Any) -> None:
        self.manager.free(request)

    def evict(self, block_ids: list[int]) -> None:
        self.manager.evict_blocks(set(block_ids))

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def free_order(self) -> list[int]:
        queue = self.manager.block_pool.free_block_queue
        return [b.block_id for b in queue.get_all_free_blocks()]


Side = _KvcmSide | _VllmSide
SideFactory = Callable[[int], Side]

# The hybrid admission hits the prefix less its last block: the sliding window kept only the
# window before the warm prompt's replay boundary (its length less one token, floored).
_HYBRID_HIT_SHORTFALL = BLOCK_SIZE


# -------------------------------------------------------------------------- workloads
class _Stopwatch:
    """Times the operation of a sample; with a profiler attached, profiles only that part."""

    __slots__ = ("profiler",)

    def __init__(self) -> None:
        self.profiler: cProfile.Profile | None = None

    def start(self) -> float:
        if self.profiler is not None:
            self.profiler.enable()
        return time.perf_counter()

    def stop(self, start: float) -> float:
        elapsed = time.perf_counter() - start
        if self.profiler is not None:
            self.profiler.disable()
        return elapsed


_STOPWATCH = _Stopwatch()


def _decode_sample(side: Side, config: BenchConfig) -> Sample:
    rng = random.Random(1)
    requests = []
    for i in range(config.decode_requests):
        # Staggered lengths: each step, ~1/16 of the requests fill (and cache) a block.
        request = side.request(f"d{i}", _tokens(rng, config.decode_prompt_tokens + i % BLOCK_SIZE))
        side.admit(request)
        side.start_running(request)
        requests.append(request)
    next_tokens = _tokens(rng, 4096)
    step = 0

    def sample() -> float:
        nonlocal step
        token = next_tokens[step % len(next_tokens)]
        step += 1
        for request in requests:
            side.append(request, token)
        start = _STOPWATCH.start()
        side.decode_step(requests)
        return _STOPWATCH.stop(start)

    return sample


def _admit_sample(side: Side, config: BenchConfig) -> Sample:
    rng = random.Random(2)
    num_tokens = config.admit_prompt_tokens
    prefix = _tokens(rng, num_tokens // 2)
    warm = side.request("prefix", prefix)
    side.admit(warm)
    side.free(warm)  # its blocks stay cached, free: the hit must take them off the queue
    request = side.request("admit", prefix + _tokens(rng, num_tokens - len(prefix)))

    def sample() -> float:
        side.restart(request)
        start = _STOPWATCH.start()
        num_hit, new_ids = side.admit(request)
        elapsed = _STOPWATCH.stop(start)
        expected = len(prefix) - (_HYBRID_HIT_SHORTFALL if side.hybrid else 0)
        if num_hit != expected:
            raise RuntimeError(f"{side.name}: hit {num_hit} tokens, expected {expected}")
        side.free(request)
        side.evict(new_ids)  # the next sample must miss on the second half again
        return elapsed

    return sample


def _free_sample(side: Side, config: BenchConfig) -> Sample:
    rng = random.Random(3)
    # The last block is partial: 2,047 cached blocks go to the back of the queue, one to the
    # front.
    num_tokens = config.free_blocks * BLOCK_SIZE - BLOCK_SIZE // 2
    request = side.request("free", _tokens(rng, num_tokens))

    def sample() -> float:
        if not side.reset_prefix_cache():
            raise RuntimeError(f"{side.name}: reset_prefix_cache refused")
        side.restart(request)
        side.admit(request)
        start = _STOPWATCH.start()
        side.free(request)
        return _STOPWATCH.stop(start)

    return sample


# The pools of each workload: enough blocks that nothing cached is evicted by accident.
def _decode_blocks(config: BenchConfig) -> int:
    # Room for warmup, the timed steps and as many again for --profile.
    max_len = config.decode_prompt_tokens + BLOCK_SIZE + 2 * config.decode_repeats + 64
    return config.decode_requests * (max_len // BLOCK_SIZE + 2) + 1


def _admit_blocks(config: BenchConfig) -> int:
    return 4 * (config.admit_prompt_tokens // BLOCK_SIZE) + 1


def _free_blocks(config: BenchConfig) -> int:
    return 2 * config.free_blocks + 1


def _hybrid_blocks(blocks_of: Callable[[BenchConfig], int]) -> Callable[[BenchConfig], int]:
    # Two groups share the pool: twice the blocks.
    return lambda config: 2 * blocks_of(config)


# name, sample, pool size, which repeats, hybrid full + sliding window (sparse retention)
WORKLOADS: tuple[
    tuple[str, Callable[[Side, BenchConfig], Sample], Callable[[BenchConfig], int], int, bool],
    ...,
] = (
    ("decode step, 256 requests x 1 token", _decode_sample, _decode_blocks, 0, False),
    ("admit 32k prompt, 50% prefix hit", _admit_sample, _admit_blocks, 1, False),
    ("free a 2k-block request", _free_sample, _free_blocks, 2, False),
    (
        "hybrid full+SWA retention 0: decode step",
        _decode_sample,
        _hybrid_blocks(_decode_blocks),
        0,
        True,
    ),
    (
        "hybrid full+SWA retention 0: admit 32k",
        _admit_sample,
        _hybrid_blocks(_admit_blocks),
        1,
        True,
    ),
)


def _repeats(config: BenchConfig, index: int) -> int:
    return (config.decode_repeats, config.admit_repeats, config.free_repeats)[index]


def _check_same_decisions(kvcm: Side, vllm: Side, name: str) -> None:
    # Same workload means same decisions: the free queues must match block for block.
    if kvcm.free_order() != vllm.free_order():
        raise RuntimeError(f"{name}: kvcm and vLLM free queues differ; the workloads diverged")


def _profile(sample: Sample, repeats: int, name: str) -> None:
    # Profiles the timed part of kvcm's samples only (not their untimed setup).
    profiler = _STOPWATCH.profiler = cProfile.Profile()
    try:
        for _ in range(repeats):
            sample()
    finally:
        _STOPWATCH.profiler = None
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    print(f"== cProfile, kvcm side: {name} ({repeats} samples)\n{out.getvalue()}", file=sys.stderr)


def bench_manager_rows(
    config: BenchConfig, ref: dict[str, ModuleType] | None, *, profile: bool = False
) -> list[Row]:
    """Time the manager workloads (decode, admission, free) on kvcm and, if given, vLLM."""
    rows = []
    for name, make_sample, num_blocks_of, repeats_index, hybrid in WORKLOADS:
        num_blocks = num_blocks_of(config)
        repeats = _repeats(config, repeats_index)
        kvcm_side = _KvcmSide(num_blocks, hybrid)
        samples = [make_sample(kvcm_side, config)]
        vllm_side = None
        if ref is not None:
            vllm_side = _VllmSide(ref, num_blocks, hybrid)
            samples.append(make_sample(vllm_side, config))
        timings = measure(samples, repeats)
        if vllm_side is not None:
            _check_same_decisions(kvcm_side, vllm_side, name)
        rows.append(Row.of_timings(name, timings[0], timings[1] if len(timings) > 1 else None))
        if profile:
            _profile(samples[0], max(1, repeats // 2), name)
        del samples, kvcm_side, vllm_side
        gc.collect()
    return rows


def bench_hash_rows(config: BenchConfig, *, with_vllm: bool) -> list[Row]:
    """Hashing rows from ``bench/hashing.py`` (its ratio inverted to vLLM / kvcm)."""
    rows = []
    for result in bench_hashing(
        config.hash_blocks, config.hash_repeats, BLOCK_SIZE, with_vllm=with_vllm
    ):
        rows.append(
            Row(
                f"hash {config.hash_blocks} blocks: {result.algorithm}, {result.workload}",
                "ms",
                result.kvcm_median_ms,
                result.kvcm_p99_ms,
                result.vllm_median_ms,
                result.vllm_p99_ms,
            )
        )
    return rows


def _traced_bytes(build: Callable[[], object]) -> tuple[int, int]:
    # Bytes still allocated once the object exists (it is kept alive), and the peak.
    gc.collect()
    tracemalloc.start()
    try:
        built = build()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del built
    gc.collect()
    return current, peak


def bench_memory_rows(config: BenchConfig, ref: dict[str, ModuleType] | None) -> list[Row]:
    """Bytes per block of a freshly built block pool (retained, and peak while building)."""
    n = config.memory_blocks
    kvcm = _traced_bytes(lambda: BlockPool(n, True, BLOCK_SIZE))
    vllm: tuple[int, int] | tuple[None, None] = (None, None)
    if ref is not None:
        pool_class = ref["vllm.v1.core.block_pool"].BlockPool
        vllm = _traced_bytes(
            lambda: pool_class(num_gpu_blocks=n, enable_caching=True, hash_block_size=BLOCK_SIZE)
        )
    label = f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"
    rows = []
    for which, index in (("retained", 0), ("peak", 1)):
        theirs = vllm[index]
        rows.append(
            Row(
                f"memory per block at {label} blocks ({which})",
                "B/block",
                kvcm[index] / n,
                None,
                None if theirs is None else theirs / n,
                None,
            )
        )
    return rows


def run_benchmarks(
    config: BenchConfig, *, with_vllm: bool = True, profile: bool = False
) -> list[Row]:
    """Every row of the table, in display order."""
    ref = import_vllm(*VLLM_MODULES) if with_vllm else None
    rows = bench_manager_rows(config, ref, profile=profile)
    rows += bench_mamba_rows(ref, quick=config == QUICK)
    rows += bench_hash_rows(config, with_vllm=ref is not None)
    rows += bench_memory_rows(config, ref)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="few samples: a smoke run")
    parser.add_argument("--no-vllm", action="store_true", help="time kvcm only")
    parser.add_argument("--profile", action="store_true", help="cProfile kvcm's manager rows")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else BenchConfig()
    started = time.perf_counter()
    rows = run_benchmarks(config, with_vllm=not args.no_vllm, profile=args.profile)
    print_table(
        rows,
        "kvcm core vs vLLM 0.33.0 (ratio = vLLM / kvcm: above 1, kvcm is faster or smaller)",
    )
    print(f"({time.perf_counter() - started:.1f} s; Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
