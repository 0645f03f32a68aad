"""Benchmark: the cost of a hot standby. The Step RPC (bench/rpc.py's N-request decode step)
against a ``kvcm serve --data-dir`` whose pool has no standby, and against one whose pool is
replicated to a standby (a third ``kvcm serve --data-dir``) in ``sync`` mode (each answer
waits for the standby's acknowledgement) or ``async`` mode, interleaved in one run; printed:
p50 and p99 and the ratios to "no standby".

    python bench/replication.py                      # 256-request Steps, 300 samples each
    python bench/replication.py --requests 32 --steps 500 --mode async
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import grpc
from _common import kvcm_server
from rpc import _row, remote_step_runner, time_interleaved

from kvcm.client import SchedulerClient
from kvcm.v1 import replica_pb2, replica_pb2_grpc

POOL = "bench-step"  # remote_step_runner's pool


def _place(address: str, primary: str, standby: str, sync: bool) -> str:
    with grpc.insecure_channel(address) as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
        mode = replica_pb2.REPLICATION_MODE_SYNC if sync else replica_pb2.REPLICATION_MODE_ASYNC
        answer = stub.SetPlacement(
            replica_pb2.SetPlacementRequest(
                pool_id=POOL, primary=primary, standby=standby, placement_epoch=1, mode=mode
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


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    args = parser.parse_args(argv)
    bench_replication(args.requests, args.steps, args.mode == "sync")


if __name__ == "__main__":
    main()
