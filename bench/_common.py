"""Shared helpers of the benchmarks: vLLM import, interleaved timing, summaries and tables.

Every benchmark times kvcm and (where importable) vLLM 0.33.0 on the same workload. The rules
kept here, so that every benchmark applies them alike:

* vLLM is imported from ``$KVCM_VLLM_SITE`` (default: the reference environment built by
  ``../shared/tools/vllm-reference/setup.sh``) appended to the *end* of ``sys.path``, so kvcm's
  own pinned packages win any clash; its logs go to stderr.
* Both sides run after ``gc.collect(); gc.freeze()``, as vLLM's engine does once its manager
  exists, so the collector does not rescan the long-lived pool on every sample.
* Samples of the two sides are interleaved (and the order alternates), so machine drift hits
  both alike; each side warms up first.
* A sample is a callable that does its own untimed setup and returns the seconds of its timed
  part, so workloads that must rebuild state between samples time only the operation.
"""

from __future__ import annotations

import gc
import importlib
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "DEFAULT_VLLM_SITE",
    "Row",
    "Sample",
    "Timing",
    "frozen_gc",
    "import_vllm",
    "init_vllm_none_hash",
    "kvcm_server",
    "measure",
    "p99",
    "print_table",
    "timed",
]

DEFAULT_VLLM_SITE = Path.home() / ".cache/kvcm/vllm-ref/lib/python3.11/site-packages"

# A sample runs one operation (with any untimed setup around it) and returns the seconds
# the operation itself took.
Sample = Callable[[], float]


# ------------------------------------------------------------------------------ server
def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def kvcm_server(*extra_args: str, server_src: str | None = None, tls: Any = None) -> Iterator[str]:
    """``kvcm serve`` in its own process on 127.0.0.1 (gRPC only); yields its address.

    A separate process, as in production: the benchmark's own threads do not share its
    interpreter lock. ``server_src``: run the server of another checkout (before/after);
    ``tls``: the ``TlsConfig`` to reach a server started with TLS.
    """
    from kvcm.client import SchedulerClient

    target = f"127.0.0.1:{free_port()}"
    env = dict(os.environ)
    if server_src:
        roots = ("core", "server", "client", "proto")
        env["PYTHONPATH"] = os.pathsep.join(os.path.join(server_src, root) for root in roots)
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvcm.server.cli", "serve", "--grpc-address", target),
            *("--http-address", "", "--log-level", "WARNING", *extra_args),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    try:
        with SchedulerClient(target, timeout=2.0, tls=tls) as client:
            give_up_at = time.monotonic() + 30
            while True:
                try:
                    client.list_pools()
                    break
                except Exception:
                    if time.monotonic() > give_up_at or process.poll() is not None:
                        raise
                    time.sleep(0.1)
        yield target
    finally:
        process.terminate()
        process.wait(timeout=10)


# ------------------------------------------------------------------------------- vLLM
def import_vllm(*module_names: str) -> dict[str, ModuleType] | None:
    """Import vLLM modules from the reference environment.

    Args:
        module_names: Dotted module names, e.g. ``"vllm.v1.core.kv_cache_manager"``.

    Returns:
        Name -> module, or ``None`` (the reason printed to stderr) when vLLM is not importable.
    """
    site = os.environ.get("KVCM_VLLM_SITE") or str(DEFAULT_VLLM_SITE)
    if not Path(site).is_dir():
        print(f"vLLM reference not found at {site}: kvcm figures only", file=sys.stderr)
        return None
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if site not in sys.path:
        sys.path.append(site)
    try:
        return {name: importlib.import_module(name) for name in module_names}
    except Exception as exc:  # any failure only means "no comparison"
        print(f"vLLM not importable from {site}: {exc!r}; kvcm figures only", file=sys.stderr)
        return None


def init_vllm_none_hash(kv_cache_utils: ModuleType, hash_fn: object, seed: str) -> None:
    """Seed vLLM's process-global NONE_HASH from ``seed`` (its PYTHONHASHSEED rule).

    Args:
        kv_cache_utils: ``vllm.v1.core.kv_cache_utils``.
        hash_fn: vLLM's hash function for the algorithm.
        seed: The seed kvcm's ``BlockHasher`` is given, so both sides hash alike.
    """
    saved = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = seed
    try:
        kv_cache_utils.init_none_hash(hash_fn)
    finally:
        if saved is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = saved


# ----------------------------------------------------------------------------- timing
def p99(ordered: Sequence[float]) -> float:
    """The 99th percentile of sorted samples (nearest rank)."""
    if not ordered:
        raise ValueError("no samples")
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class Timing:
    """Median and p99 of one side's samples, in milliseconds."""

    median_ms: float
    p99_ms: float
    num_samples: int

    @classmethod
    def of(cls, samples_s: Sequence[float]) -> Timing:
        """Summarize samples given in seconds."""
        ordered = sorted(samples_s)
        return cls(statistics.median(ordered) * 1e3, p99(ordered) * 1e3, len(ordered))


def timed(run: Callable[[], object]) -> Sample:
    """A sample that times all of ``run`` (for operations with no setup between samples)."""
    perf = time.perf_counter

    def sample() -> float:
        start = perf()
        run()
        return perf() - start

    return sample


@contextmanager
def frozen_gc() -> Iterator[None]:
    """Collect, then freeze every live object out of the collector's reach, as vLLM's engine."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def measure(samples: Sequence[Sample], repeats: int, warmup: int = 3) -> list[Timing]:
    """Time each side ``repeats`` times, interleaved, after ``warmup`` untimed runs each.

    Args:
        samples: One sample callable per side (kvcm first by convention).
        repeats: Timed samples per side.
        warmup: Untimed samples per side before timing (caches, lazy imports, branch warmup).

    Returns:
        One ``Timing`` per side, in the order given.
    """
    for sample in samples:
        for _ in range(warmup):
            sample()
    collected: list[list[float]] = [[] for _ in samples]
    sides = list(range(len(samples)))
    with frozen_gc():
        for i in range(repeats):
            for side in sides if i % 2 == 0 else reversed(sides):
                collected[side].append(samples[side]())
    return [Timing.of(values) for values in collected]


# ----------------------------------------------------------------------------- tables
@dataclass(frozen=True, slots=True)
class Row:
    """One benchmark row: kvcm's figure, vLLM's (if measured) and the ratio vLLM / kvcm.

    For times a ratio above 1 means kvcm is faster; for memory, that kvcm uses less.
    """

    name: str
    unit: str
    kvcm_median: float
    kvcm_p99: float | None
    vllm_median: float | None = None
    vllm_p99: float | None = None

    @classmethod
    def of_timings(cls, name: str, kvcm: Timing, vllm: Timing | None) -> Row:
        """A row of two timings (ms)."""
        return cls(
            name,
            "ms",
            kvcm.median_ms,
            kvcm.p99_ms,
            None if vllm is None else vllm.median_ms,
            None if vllm is None else vllm.p99_ms,
        )

    @property
    def ratio(self) -> float | None:
        """vLLM's median over kvcm's (above 1: kvcm is faster or smaller)."""
        if self.vllm_median is None or self.kvcm_median <= 0:
            return None
        return self.vllm_median / self.kvcm_median


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: Sequence[Row], title: str) -> None:
    """Print rows as an aligned table with the ratio column.

    Args:
        rows: The rows, in display order.
        title: A line printed above the table.
    """
    width = max([len(row.name) for row in rows] + [9])
    header = ("workload", "unit", "kvcm p50", "kvcm p99", "vLLM p50", "vLLM p99", "ratio")
    print(title)
    print(f"{header[0]:<{width}} {header[1]:<7}" + "".join(f" {h:>9}" for h in header[2:]))
    print("-" * (width + 8 + 10 * 5))
    for row in rows:
        print(
            f"{row.name:<{width}} {row.unit:<7}"
            f" {_fmt(row.kvcm_median, '.3f'):>9} {_fmt(row.kvcm_p99, '.3f'):>9}"
            f" {_fmt(row.vllm_median, '.3f'):>9} {_fmt(row.vllm_p99, '.3f'):>9}"
            f" {_fmt(row.ratio, '.2f'):>9}"
        )
