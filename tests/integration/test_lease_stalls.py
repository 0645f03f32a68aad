"""Leases count the server's awake time: pausing the server does not reclaim live schedulers.

A real ``kvcm serve`` process is paused (SIGSTOP) for longer than its pools' scheduler lease,
then resumed (SIGCONT). Its schedulers could not call while it was paused, so the pause must
not count against them: a scheduler that calls within a lease after the resume keeps its
requests, and one that stays silent is reclaimed once it has been silent for a lease of the
server's awake time (its silence before the pause plus after the resume), not at the resume.
The reclaim times are read from the server's own JSON log lines.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime

import pytest

from kvcm.client import SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig

LEASE_S = 1.5
PAUSE_S = 4.0  # well over the lease
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=512,
    scheduler_lease_s=LEASE_S,
    explicit_layout=KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)


class _Server:
    """``kvcm serve`` with JSON logs at INFO; its log lines are collected as they come."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvcm.server.cli", "serve", "--grpc-address", self.address,
             "--http-address", "", "--log-format", "json", "--log-level", "INFO"],
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.lines: list[dict[str, object]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                self.lines.append({"message": line})

    def reclaims(self) -> list[tuple[str, float]]:
        """(pool, wall time) of each scheduler-lease reclaim logged so far."""
        return [
            (str(line["pool"]), datetime.fromisoformat(str(line["time"])).timestamp())
            for line in list(self.lines)
            if line.get("event") == "lease_reclaimed" and line.get("lease") == "scheduler"
        ]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGCONT)  # in case a test failed while paused
        self.process.terminate()
        self.process.wait(timeout=15)


@pytest.fixture
def server() -> Iterator[_Server]:
    running = _Server()
    try:
        with SchedulerClient(running.address, timeout=2.0) as client:
            give_up_at = time.monotonic() + 30
            while True:
                try:
                    client.list_pools()
                    break
                except Exception:
                    assert running.process.poll() is None, running.lines[-5:]
                    assert time.monotonic() < give_up_at, "kvcm serve did not start"
                    time.sleep(0.1)
        yield running
    finally:
        running.stop()


def _admit(client: SchedulerClient, pool_id: str) -> None:
    hasher = client.block_hasher(pool_id)
    step = StepBuilder()
    for key in (1, 2, 3):
        prompt = [key] * 40
        step.add_request(key, prompt, hasher.hash_token_ids(prompt))
        step.allocate(key, 40, 0, lookup=True)
    client.step(pool_id, step)


def test_a_paused_server_reclaims_only_who_stays_silent_for_a_lease_of_awake_time(
    server: _Server,
) -> None:
    with SchedulerClient(server.address, timeout=30.0) as client:
        client.create_pool("idle", CONFIG)
        client.create_pool("silent", CONFIG)
        client.create_pool("unleased", dataclasses.replace(CONFIG, scheduler_lease_s=0.0))
        for pool_id in ("idle", "unleased"):
            _admit(client, pool_id)
        _admit(client, "silent")  # its scheduler's last call
        silent_since = time.time()
        client.keep_alive("idle")
        server.process.send_signal(signal.SIGSTOP)
        paused_at = time.time()
        time.sleep(PAUSE_S)
        server.process.send_signal(signal.SIGCONT)
        resumed_at = time.time()
        # "idle" calls again well within one lease after the resume, then keeps calling.
        time.sleep(LEASE_S / 3)
        assert client.keep_alive("idle") == LEASE_S
        give_up_at = time.monotonic() + LEASE_S + 5.0
        while client.describe_pool("silent").num_requests:
            assert time.monotonic() < give_up_at, "the silent scheduler was never reclaimed"
            client.keep_alive("idle")
            time.sleep(LEASE_S / 6)
        for _ in range(6):  # and "idle" keeps its lease for a while longer
            client.keep_alive("idle")
            time.sleep(LEASE_S / 6)
        assert client.describe_pool("idle").num_requests == 3
        assert client.describe_pool("unleased").num_requests == 3
    reclaims = server.reclaims()
    assert [pool for pool, _ in reclaims] == ["silent"], reclaims
    silent_before = paused_at - silent_since  # awake silence before the pause
    after_resume = reclaims[0][1] - resumed_at
    print(
        f"silent {silent_before:.2f} s before the pause of {PAUSE_S} s, reclaimed "
        f"{after_resume:.2f} s after the resume (lease {LEASE_S} s)"
    )
    # A lease of awake time (less the 0.15 s the stall detector may miss), not at resume.
    assert after_resume >= LEASE_S - silent_before - 0.25
    assert after_resume < LEASE_S + 3.0
