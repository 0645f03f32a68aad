"""Benchmark: hash the full blocks of one request, kvcm against vLLM 0.33.0.

For each algorithm and workload, times hashing ``num_blocks`` blocks of ``block_size`` tokens
from scratch (one call of the per-request hasher, as when a long prompt arrives) and prints the
median and p99 over ``repeats`` runs with the ratio kvcm / vLLM (below 1 means kvcm is faster).
vLLM is imported from ``$KVCM_VLLM_SITE`` (or the reference's default location) appended to the
end of ``sys.path``; where it cannot be imported, only kvcm's figures are printed.

    python bench/hashing.py [--num-blocks 1000] [--repeats 200]

``bench_hashing`` is the entry point other benchmarks import.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcm.common.hashing import BlockHash, BlockHasher, HashAlgorithm

__all__ = ["HashBenchRow", "bench_hashing", "main"]

_DEFAULT_SITE = Path.home() / ".cache/kvcm/vllm-ref/lib/python3.11/site-packages"
WORKLOADS = ("plain", "lora+salt+mm")


@dataclass(frozen=True, slots=True)
class HashBenchRow:
    """Timings of one algorithm and workload (milliseconds per ``num_blocks`` blocks)."""

    algorithm: str
    workload: str
    num_blocks: int
    block_size: int
    kvcm_median_ms: float
    kvcm_p99_ms: float
    vllm_median_ms: float | None
    vllm_p99_ms: float | None

    @property
    def ratio(self) -> float | None:
        """kvcm's median over vLLM's (below 1: kvcm is faster)."""
        if self.vllm_median_ms is None:
            return None
        return self.kvcm_median_ms / self.vllm_median_ms


class _KvcmRequest:
    """The fields kvcm's hasher reads; ``block_hashes`` stays empty so each run starts over."""

    __slots__ = (
        "all_token_ids",
        "block_hashes",
        "cache_salt",
        "lora_name",
        "lora_path",
        "mm_features",
    )

    def __init__(self, token_ids: list[int], workload: str, mm: list[Any]) -> None:
        self.all_token_ids = token_ids
        self.block_hashes: list[BlockHash] = []
        extra = workload != "plain"
        self.lora_name = "adapter" if extra else None
        self.lora_path = "/adapter" if extra else None
        self.cache_salt = "tenant" if extra else None
        self.mm_features = mm if extra else []

    prompt_embeds = None


def _import_vllm() -> dict[str, Any] | None:
    site = os.environ.get("KVCM_VLLM_SITE") or str(_DEFAULT_SITE)
    if not Path(site).is_dir():
        return None
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if site not in sys.path:
        sys.path.append(site)
    try:
        kcu = importlib.import_module("vllm.v1.core.kv_cache_utils")
        hashing = importlib.import_module("vllm.utils.hashing")
        request_mod = importlib.import_module("vllm.v1.request")
        sampling = importlib.import_module("vllm.sampling_params")
        lora = importlib.import_module("vllm.lora.request")
        mm_inputs = importlib.import_module("vllm.multimodal.inputs")
    except Exception as exc:  # any failure only means "no comparison"
        print(f"vLLM not importable from {site}: {exc!r}", file=sys.stderr)
        return None
    return {
        "kcu": kcu,
        "hashing": hashing,
        "Request": request_mod.Request,
        "SamplingParams": sampling.SamplingParams,
        "LoRARequest": lora.LoRARequest,
        "Feature": mm_inputs.MultiModalFeatureSpec,
        "Range": mm_inputs.PlaceholderRange,
    }


def _vllm_runner(
    ref: dict[str, Any],
    algorithm: HashAlgorithm,
    block_size: int,
    token_ids: list[int],
    workload: str,
    mm: list[tuple[str, int, int]],
) -> Callable[[], list[bytes]]:
    kcu = ref["kcu"]
    hash_fn = ref["hashing"].get_hash_fn_by_name(algorithm.value)
    os.environ["PYTHONHASHSEED"] = "bench"
    try:
        kcu.init_none_hash(hash_fn)
    finally:
        del os.environ["PYTHONHASHSEED"]
    extra = workload != "plain"
    request = ref["Request"](
        request_id="bench",
        prompt_token_ids=token_ids,
        sampling_params=ref["SamplingParams"](max_tokens=1),
        pooling_params=None,
        lora_request=ref["LoRARequest"]("adapter", 1, "/adapter") if extra else None,
        cache_salt="tenant" if extra else None,
        mm_features=[
            ref["Feature"](
                data=None,
                modality="image",
                identifier=ident,
                mm_position=ref["Range"](offset=offset, length=length),
            )
            for ident, offset, length in mm
        ]
        if extra
        else None,
    )
    hasher = kcu.get_request_block_hasher(block_size, hash_fn)

    def run() -> list[bytes]:
        result: list[bytes] = hasher(request)
        return result

    return run


def _stats(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    p99 = samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))]
    return statistics.median(samples), p99


def _time(
    kvcm_run: Callable[[], object], vllm_run: Callable[[], object] | None, repeats: int
) -> tuple[tuple[float, float], tuple[float, float] | tuple[None, None]]:
    """Median and p99 (ms) of each side, runs interleaved so machine drift hits both alike."""
    runs = [kvcm_run] if vllm_run is None else [kvcm_run, vllm_run]
    samples: list[list[float]] = [[] for _ in runs]
    for run in runs:
        run()  # warm up caches and lazy imports
    perf = time.perf_counter_ns
    for i in range(repeats):
        order = range(len(runs)) if i % 2 == 0 else reversed(range(len(runs)))
        for side in order:
            run = runs[side]
            start = perf()
            run()
            samples[side].append((perf() - start) / 1e6)
    kvcm = _stats(samples[0])
    return kvcm, (_stats(samples[1]) if vllm_run is not None else (None, None))


def bench_hashing(
    num_blocks: int = 1000,
    repeats: int = 200,
    block_size: int = 16,
    *,
    with_vllm: bool = True,
) -> list[HashBenchRow]:
    """Time kvcm's (and, where importable, vLLM's) per-request hasher.

    Args:
        num_blocks: Full blocks in the request.
        repeats: Timed runs per algorithm and workload (after one warm-up run).
        block_size: Tokens per block.
        with_vllm: Also time vLLM where it can be imported.

    Returns:
        One row per algorithm and workload.
    """
    rng = random.Random(0)
    token_ids = [rng.randrange(150_000) for _ in range(num_blocks * block_size)]
    # Ten 200-token images spread over the prompt (the "mm" part of the extra-keys workload).
    stride = max(1, len(token_ids) // 10)
    mm = [(f"image-{i:02d}", i * stride, min(200, stride)) for i in range(10)]
    ref = _import_vllm() if with_vllm else None
    from kvcm.common.hashing import MultiModalFeature

    features = [MultiModalFeature(*item) for item in mm]
    rows: list[HashBenchRow] = []
    gc.collect()
    gc.freeze()  # as vLLM's engine does once its manager exists
    for algorithm in HashAlgorithm:
        hasher = BlockHasher(block_size, algorithm, "bench")
        for workload in WORKLOADS:
            request = _KvcmRequest(token_ids, workload, features)

            def kvcm_run(h: BlockHasher = hasher, r: _KvcmRequest = request) -> list[BlockHash]:
                return h.hash_request_blocks(r)

            vllm_run = None
            if ref is not None:
                vllm_run = _vllm_runner(ref, algorithm, block_size, token_ids, workload, mm)
                if vllm_run() != kvcm_run():
                    raise RuntimeError(f"kvcm and vLLM disagree ({algorithm}, {workload})")
            kvcm, vllm = _time(kvcm_run, vllm_run, repeats)
            rows.append(
                HashBenchRow(algorithm.value, workload, num_blocks, block_size, *kvcm, *vllm)
            )
    gc.unfreeze()
    return rows


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: print a table of the timings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--num-blocks", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args(argv)
    rows = bench_hashing(args.num_blocks, args.repeats, args.block_size, with_vllm=not args.no_vllm)
    print(
        f"hash {args.num_blocks} blocks x {args.block_size} tokens, {args.repeats} runs "
        "(ms; ratio = kvcm median / vLLM median)"
    )
    header = ("algorithm", "workload", "kvcm p50", "kvcm p99", "vllm p50", "vllm p99", "ratio")
    print("{:<12} {:<13} {:>9} {:>9} {:>9} {:>9} {:>6}".format(*header))
    for row in rows:
        print(
            f"{row.algorithm:<12} {row.workload:<13} {row.kvcm_median_ms:>9.3f} "
            f"{row.kvcm_p99_ms:>9.3f} {_fmt(row.vllm_median_ms):>9} {_fmt(row.vllm_p99_ms):>9} "
            f"{_fmt(row.ratio, '.2f'):>6}"
        )


if __name__ == "__main__":
    main()
