"""A pool its workers planned survives graceful restarts (its checkpoint replans it).

The checkpoint holds each pool's config and snapshot; a pool planned by RegisterWorker has no
layout in its config, so its snapshot carries the ranks' registrations and decoding plans it
again. Before, the second start after such a pool was checkpointed failed ("PENDING_WORKERS").
"""

from __future__ import annotations

from pathlib import Path

from test_durability import SPEC, WINDOW, _drive, _fingerprints, _start

from kvcm.client import SchedulerClient, WorkerClient
from kvcm.core.pool import PoolConfig


def test_a_worker_planned_pool_survives_two_graceful_restarts(tmp_path: Path) -> None:
    server = _start(tmp_path / "data")
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("planned", PoolConfig(max_model_len=512, world_size=1))
        with WorkerClient(server.grpc_address) as worker:
            planned = worker.register("planned", 0, 1, {"full": SPEC, "window": WINDOW}, 64 << 20)
        _drive(client, "planned", 1, 8)
    before = _fingerprints(server)
    server.stop()
    for _ in range(2):  # the first start replays and checkpoints; the second reads that
        again = _start(tmp_path / "data")
        try:
            assert _fingerprints(again) == before
            with WorkerClient(again.grpc_address) as worker:
                # A rank registering again with the same specs gets the same config.
                same = worker.register("planned", 0, 1, {"full": SPEC, "window": WINDOW}, 64 << 20)
            assert same == planned
        finally:
            again.stop()
    last = _start(tmp_path / "data")
    try:
        with SchedulerClient(last.grpc_address) as client:
            _drive(client, "planned", 9, 4)  # step_seq continues
    finally:
        last.stop()
