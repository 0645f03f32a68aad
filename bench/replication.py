"""Benchmark: the cost of a hot standby. The Step RPC (bench/rpc.py's N-request decode step)
against a ``kvcm serve --data-dir`` whose pool has no standby, and against one whose pool is
replicated to a standby (a third ``kvcm serve --data-dir``) in ``sync`` mode (each answer
waits for the standby's acknowledgement) or ``async`` mode, interleaved in one run; printed:
p50 and p99 and the ratios to "no standby".

    python bench/replication.py                      # 256-request Steps, 300 samples each
    python bench/replication.py --requests 32 --steps 500 --mode async
    python bench/replication.py --failovers 10       # instead: kill -9 + promotion times
    python bench/replication.py --kv-events          # pools publish KV events on ZMQ

With ``--kv-events`` every server publishes on its own ZMQ socket (``tcp://*:0``) and the pools
emit KV events: a ``sync`` pool's batches then go out once its standby acknowledged them
(docs/replication.md), which this measures against the unreplicated server's at once.

Failover (``--failovers N``): a scheduler drives a sync pool on A (standby B); A is killed with
SIGKILL; B is promoted at once (``SetPlacement``: what placement's etcd watch does once A's
lease is gone, so the lease TTL comes on top); printed: p50/p99 of the promotion call and of
the time from the kill to the scheduler's first acknowledged Step on B (same step_seq retried).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import grpc
from _common import free_port, kvcm_server, p99
from rpc import _pool_config, _row, remote_step_runner, time_interleaved

from kvcm.client import SchedulerClient, StepBuilder
from kvcm.common.hashing import BlockHasher
from kvcm.v1 import replica_pb2, replica_pb2_grpc

POOL = "bench-step"  # remote_step_runner's pool


def _place(address: str, primary: str, standby: str, sync: bool, epoch: int = 1) -> str:
    with grpc.insecure_channel(address) as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
        mode = replica_pb2.REPLICATION_MODE_SYNC if sync else replica_pb2.REPLICATION_MODE_ASYNC
        answer = stub.SetPlacement(
            replica_pb2.SetPlacementRequest(
                pool_id=POOL, primary=primary, standby=standby, placement_epoch=epoch, mode=mode
            ),
            timeout=30,
        )
        return str(answer.role)


def _state(address: str) -> replica_pb2.GetReplicaStateResponse:
    with grpc.insecure_channel(address) as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
        answer: replica_pb2.GetReplicaStateResponse = stub.GetReplicaState(
            replica_pb2.GetReplicaStateRequest(pool_id=POOL), timeout=10
        )
        return answer


def bench_replication(num_requests: int, repeats: int, sync: bool) -> None:
    mode = "sync" if sync else "async"
    with (
        tempfile.TemporaryDirectory() as alone_dir,
        tempfile.TemporaryDirectory() as primary_dir,
        tempfile.TemporaryDirectory() as standby_dir,
        kvcm_server("--data-dir", alone_dir) as alone,
        kvcm_server("--data-dir", primary_dir) as primary,
        kvcm_server("--data-dir", standby_dir) as standby,
        SchedulerClient(alone) as alone_client,
        SchedulerClient(primary) as primary_client,
    ):
        assert _place(standby, primary, standby, sync) == "standby"
        assert _place(primary, primary, standby, sync) == "primary"
        names = ("no standby (journal only)", f"{mode} standby")
        timings = time_interleaved(
            {
                names[0]: remote_step_runner(alone_client, num_requests),
                names[1]: remote_step_runner(primary_client, num_requests),
            },
            repeats,
        )
        on_primary, on_standby = _state(primary), _state(standby)
    print(f"replication cost: {num_requests}-request Step RPC, {repeats} samples each")
    print(f"{'':<48} {'p50 ms':>9} {'p99 ms':>9}")
    for name, timing in timings.items():
        print(_row(f"Step RPC, {name}", timing))
    base, replicated = timings[names[0]], timings[names[1]]
    print(
        f"ratio {mode} / none: p50 {replicated.median_ms / base.median_ms:.2f}, "
        f"p99 {replicated.p99_ms / base.p99_ms:.2f}"
    )
    same = on_primary.digest == on_standby.digest
    print(
        f"standby: applied {on_standby.seq} records, acknowledged {on_primary.acked_seq} of "
        f"{on_primary.seq}, digest checks {on_standby.digest_checks}, same digest now: {same}"
    )


def _spawn(data_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcm.server.cli", "serve", "--grpc-address", address,
         "--http-address", "", "--data-dir", data_dir, "--log-level", "ERROR"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ),
    )  # fmt: skip
    with SchedulerClient(address, timeout=2.0) as client:
        give_up_at = time.monotonic() + 60
        while True:
            try:
                client.list_pools()
                return process, address
            except Exception:
                if time.monotonic() > give_up_at or process.poll() is not None:
                    raise
                time.sleep(0.05)


def _step(hasher: BlockHasher, seq: int) -> StepBuilder:
    """Step ``seq``: admit and cache a fresh 64-token prompt, finish it (exactly once)."""
    prompt = list(range(seq * 100, seq * 100 + 64))
    step = StepBuilder()
    step.step_seq = seq
    step.add_request(seq, prompt, hasher.hash_token_ids(prompt))
    step.allocate(seq, len(prompt), 0, lookup=True)
    step.cache_blocks(seq, len(prompt))
    step.finish(seq)
    return step


def _one_failover() -> tuple[float, float]:
    """(promotion call, kill to the first acknowledged Step on the new primary), seconds."""
    with tempfile.TemporaryDirectory() as a_dir, tempfile.TemporaryDirectory() as b_dir:
        (a, a_address), (b, b_address) = _spawn(a_dir), _spawn(b_dir)
        try:
            assert _place(b_address, a_address, b_address, True) == "standby"
            assert _place(a_address, a_address, b_address, True) == "primary"
            with SchedulerClient(a_address) as client:
                client.create_pool(POOL, _pool_config())
                hasher = client.block_hasher(POOL)
            target = [a_address]
            moved = threading.Event()
            served_again: list[float] = []

            def drive() -> None:
                seq = 1
                while not served_again:
                    address = target[0]
                    try:
                        with SchedulerClient(address, timeout=2.0) as client:
                            while not served_again:
                                client.step(POOL, _step(hasher, seq))
                                seq += 1
                                if address != a_address:
                                    served_again.append(time.perf_counter())
                    except Exception:
                        moved.wait(30)  # re-pointed: the same step (same step_seq) again

            driver = threading.Thread(target=drive, daemon=True)
            driver.start()
            time.sleep(0.3)
            a.send_signal(signal.SIGKILL)
            killed = time.perf_counter()
            a.wait()
            _place(b_address, b_address, "", True, epoch=2)
            promoted = time.perf_counter() - killed
            target[0] = b_address
            moved.set()
            driver.join(30)
            assert served_again, "the scheduler did not go on"
            return promoted, served_again[0] - killed
        finally:
            for process in (a, b):
                if process.poll() is None:
                    process.terminate()
                    process.wait(10)


def bench_failovers(count: int) -> None:
    promotions, outages = [], []
    for _ in range(count):
        promoted, outage = _one_failover()
        promotions.append(promoted)
        outages.append(outage)
    promotions.sort()
    outages.sort()
    print(f"failover ({count} kills of a sync primary; placement's lease TTL not included)")
    print(f"{'':<48} {'p50 ms':>9} {'p99 ms':>9}")
    for name, values in (("promotion (SetPlacement, checkpoint)", promotions),
                         ("kill -9 to the first Step acked on B", outages)):  # fmt: skip
        print(f"{name:<48} {values[len(values) // 2] * 1e3:>9.1f} {p99(values) * 1e3:>9.1f}")


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--failovers", type=int, default=0, help="instead: kill -9 this often")
    parser.add_argument("--kv-events", action="store_true", help="pools publish KV events")
    args = parser.parse_args(argv)
    if args.kv_events:
        import rpc

        config = rpc._pool_config
        rpc._pool_config = lambda: dataclasses.replace(config(), enable_kv_cache_events=True)
        os.environ["KVCM_KV_EVENTS_ENDPOINT"] = "tcp://*:0"
    if args.failovers:
        bench_failovers(args.failovers)
        return
    bench_replication(args.requests, args.steps, args.mode == "sync")


if __name__ == "__main__":
    main()
