"""Admit + free against an older commit: the allocator's cost now and before a change.

bench/lookup.py's last row compares the allocator with the cross-pool index on and off in one
process: the index's share of an admit+free. This script answers the other question a change
to the allocation path raises: is admit+free slower than it was at an older commit? It checks
``--before`` out into a temporary git worktree, then runs the same sample loop in a fresh
process per tree (each importing only its own tree), alternating the trees for ``--rounds``
rounds, and prints each tree's median and p99 with the ratio now / before.

The sample (as bench/lookup.py's index-cost row): a full pool of 4,096 blocks whose every
block is cached; admit a 64-block request with new hashes (evicting 64 cached blocks, caching
64), then free it. Two pools in one registry, one indexed for lookups and one not, samples
interleaved.

    python bench/allocator_ab.py                  # against the commit before issue 26's work
    python bench/allocator_ab.py --before HEAD~5 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The parent of dd5d48d ("lookup: answer in O(blocks hit + pools answered)"), the first
# commit of issue 26: the allocator already kept the index then.
DEFAULT_BEFORE = "dd5d48d^"
WARMUP = 500


def worker(tree: str, samples: int) -> None:
    """Run the sample loop against ``tree``'s kvcm and print ``on_p50 on_p99 off_p50 off_p99``
    (microseconds)."""
    for part in ("core", "server", "proto", "client"):
        sys.path.insert(0, os.path.join(tree, part))
    sys.path.insert(0, os.path.join(tree, "bench"))
    import gc

    import kvcm.core.pool as pool_module

    assert pool_module.__file__ is not None
    assert pool_module.__file__.startswith(tree)
    import lookup as bench  # the tree's own bench/lookup.py: its layout and fill helpers

    rng = random.Random(0)
    tokens = [0] * (64 * bench.BLOCK_SIZE)
    config = pool_module.PoolConfig(
        max_model_len=bench.MAX_MODEL_LEN,
        explicit_layout=bench._layout(4097),
        hash_seed=bench.HASH_SEED,
        log_stats=False,
    )
    registry = pool_module.PoolRegistry()
    pools = [registry.create(name, config) for name in ("indexed", "plain")]
    for pool in pools:
        bench._fill(pool, [(tokens, [os.urandom(32) for _ in range(64)]) for _ in range(64)], 0)
    assert registry.index.slot(pools[0]) is not None
    keys = iter(range(1000, 1 << 62))

    def sample(pool: object) -> float:
        key = next(keys)
        hashes = b"".join(rng.randbytes(32) for _ in range(64))
        start = time.perf_counter()
        request = pool.add_request(key, "r", tokens, hashes)  # type: ignore[attr-defined]
        if hasattr(pool, "allocate_slots"):  # older trees: the pool's own call
            pool.allocate_slots(request, len(tokens), None)
        else:
            pool.ready_manager().allocate_slots(request, len(tokens))  # type: ignore[attr-defined]
        pool.free(key, preempt=False)  # type: ignore[attr-defined]
        return time.perf_counter() - start

    gc.collect()
    gc.freeze()
    on: list[float] = []
    off: list[float] = []
    for _ in range(samples + WARMUP):
        on.append(sample(pools[0]))
        off.append(sample(pools[1]))
    figures = []
    for values in (on[WARMUP:], off[WARMUP:]):
        values.sort()
        figures += [statistics.median(values) * 1e6, values[int(len(values) * 0.99)] * 1e6]
    print(" ".join(f"{value:.2f}" for value in figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--before", default=DEFAULT_BEFORE, help="the older commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=5000, help="samples per pool and run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.samples)
        return
    with tempfile.TemporaryDirectory(prefix="kvcm-ab-") as scratch:
        before = os.path.join(scratch, "before")
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", before, args.before],
            check=True,
            capture_output=True,
        )
        try:
            runs: dict[str, list[list[float]]] = {"before": [], "now": []}
            for _ in range(args.rounds):
                for name, tree in (("before", before), ("now", str(ROOT))):
                    out = subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--worker",
                            tree,
                            "--samples",
                            str(args.samples),
                        ],
                        check=True,
                        capture_output=True,
                        text=True,
                    ).stdout.split()
                    runs[name].append([float(value) for value in out])
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", before],
                check=False,
                capture_output=True,
            )
    print(
        f"admit+free 64 blocks (evicting 64) in a full 4,096-block pool, us; median over "
        f"{args.rounds} runs of each run's p50 / p99 ({args.samples} samples a pool a run); "
        f"before = {args.before}"
    )
    heads = ("before p50", "now p50", "x", "before p99", "now p99", "x")
    print(f"{'pool':<16} " + " ".join(f"{head:>10}" for head in heads))
    for column, label in ((0, "index on"), (2, "index off")):
        b50 = statistics.median(run[column] for run in runs["before"])
        n50 = statistics.median(run[column] for run in runs["now"])
        b99 = statistics.median(run[column + 1] for run in runs["before"])
        n99 = statistics.median(run[column + 1] for run in runs["now"])
        values = (b50, n50, n50 / b50, b99, n99, n99 / b99)
        print(f"{label:<16} " + " ".join(f"{value:>10.2f}" for value in values))


if __name__ == "__main__":
    main()
