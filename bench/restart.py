"""Benchmark: durability costs. Restart time of a pool with 1M cached blocks, and the Step
RPC with the journal on and off.

1. Restart: a pool of ``--blocks`` blocks is filled in-process until every usable block is
   in the prefix cache (free and cached), written as a data directory's checkpoint, and
   ``kvcm serve --data-dir`` is started on it; printed: snapshot encode and decode time,
   snapshot size, and the wall time until the server answers (process start included).
2. Journal: the 256-request decode Step RPC of bench/rpc.py against ``kvcm serve`` without and
   with ``--data-dir`` (every Step journaled and fsynced before its answer; group commit),
   interleaved; printed: p50 and p99 and the ratio.

    python bench/restart.py                 # 1M blocks (~1 min), then the journal figures
    python bench/restart.py --blocks 200000 --steps 200
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from _common import free_port, kvcm_server
from rpc import _row, remote_step_runner, time_interleaved

from kvcm.client import SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import NewRequestSpec, OpKind, StepProgram
from kvcm.core.snapshot import decode_pool, encode_pool
from kvcm.server.journal import Checkpoint, CheckpointPool, write_checkpoint
from kvcm.wire import pool_config_to_proto

BLOCK = 16


def _filled_pool(num_blocks: int) -> tuple[Pool, PoolConfig]:
    """A pool whose usable blocks are all cached and free (requests admitted, cached, freed)."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16)
    config = PoolConfig(
        max_model_len=BLOCK * 4096,
        hash_seed="bench-restart",
        explicit_layout=KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=(),
            kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=spec),),
        ),
    )
    pool = Pool("big", config)
    per_request = 4096
    key = 0
    remaining = num_blocks - 1
    while remaining > 0:
        blocks = min(per_request, remaining)
        tokens = [key * 10_000_000 + i for i in range(blocks * BLOCK)]
        # Distinct fake hashes (the restart cost does not depend on their values).
        hashes = b"".join((key * per_request + i).to_bytes(8, "little") * 4 for i in range(blocks))
        program = StepProgram(
            ops=[OpKind.ADD_REQUEST, OpKind.ALLOCATE, OpKind.CACHE_BLOCKS, OpKind.FINISH],
            request_keys=[key, key, key],
            new_requests=[
                NewRequestSpec(
                    key=key, request_id=f"r{key}", prompt_token_ids=tokens, block_hashes=hashes
                )
            ],
            alloc_num_new_tokens=[len(tokens)],
            alloc_num_computed_tokens=[0],
            cache_num_computed_tokens=[len(tokens)],
        )
        pool.run_step(program)
        remaining -= blocks
        key += 1
    return pool, config


def bench_restart(num_blocks: int) -> None:
    from kvcm.core.limits import Limits

    started = time.perf_counter()
    pool, config = _filled_pool(num_blocks)
    cached = pool.ready_manager().block_pool.num_cached_blocks
    built = time.perf_counter() - started
    print(f"pool of {num_blocks} blocks, {cached} cached, built in {built:.1f} s")
    started = time.perf_counter()
    data = encode_pool(pool)
    encoded = time.perf_counter() - started
    limits = Limits(max_step_tokens=1 << 30)
    started = time.perf_counter()
    decode_pool(data, "big", config, limits=limits)
    decoded = time.perf_counter() - started
    print(f"snapshot: {len(data) / 1e6:.1f} MB, encode {encoded:.2f} s, decode {decoded:.2f} s")
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(
            Path(directory),
            Checkpoint(
                1,
                1,
                (CheckpointPool("big", pool_config_to_proto(config).SerializeToString(), 1, data),),
            ),
        )
        address = f"127.0.0.1:{free_port()}"
        started = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "kvcm.server.cli", "serve", "--grpc-address", address,
             "--http-address", "", "--data-dir", directory, "--log-level", "WARNING"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            with SchedulerClient(address, timeout=2.0) as client:
                while True:
                    try:
                        info = client.describe_pool("big")
                        break
                    except Exception:
                        assert process.poll() is None, "kvcm serve exited"
                        time.sleep(0.02)
            elapsed = time.perf_counter() - started
        finally:
            process.terminate()
            process.wait(timeout=60)
    print(
        f"kvcm serve --data-dir: answering after {elapsed:.2f} s (process start included; "
        f"{info.num_free_blocks} free blocks restored)"
    )


def bench_journal(num_requests: int, repeats: int) -> None:
    with (
        tempfile.TemporaryDirectory() as directory,
        kvcm_server() as plain,
        kvcm_server("--data-dir", directory) as durable,
        SchedulerClient(plain) as plain_client,
        SchedulerClient(durable) as durable_client,
    ):
        timings = time_interleaved(
            {
                "journal off": remote_step_runner(plain_client, num_requests),
                "journal on (fsync per Step)": remote_step_runner(durable_client, num_requests),
            },
            repeats,
        )
    print(f"journal cost: {num_requests}-request Step RPC, {repeats} samples each")
    print(f"{'':<48} {'p50 ms':>9} {'p99 ms':>9}")
    for name, timing in timings.items():
        print(_row(f"Step RPC, {name}", timing))
    off, on = timings["journal off"], timings["journal on (fsync per Step)"]
    print(f"ratio journal on / off: p50 {on.median_ms / off.median_ms:.2f}")


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args(argv)
    bench_restart(args.blocks)
    bench_journal(args.requests, args.steps)


if __name__ == "__main__":
    main()
