"""kill -9 under load: every acknowledged Step survives, and the schedulers resume.

``kvcm serve --data-dir`` runs as a subprocess; three scheduler threads drive one pool each
with Step programs (an admission with a prefix lookup, its cache commit and its finish per
step; the cache fills, so blocks are evicted), each retrying a Step whose answer it did not
get with the same ``step_seq`` until the server answers (exactly-once). The server is killed
with SIGKILL at random moments and restarted on the same directory and port. At the end each
pool must equal an in-process pool that ran the same programs: the same event stream from
sequence 1 (every block stored and removed, in order), the same free blocks, requests and
``step_seq``.

The server checkpoints every 300 journal records while it serves, so kills land before,
during and after live checkpoints too. ``KVCM_CRASH_KILLS`` sets the number of kills (3
here; ``scripts/crash-long.sh`` runs 50).

The second run adds a failing disk: through the journal's test hook
(``KVCM_JOURNAL_FAULT_FILE``) journal writes and fsyncs fail with ENOSPC or EIO at random
moments between the kills (live checkpoints fail too). A Step refused that way answers
UNAVAILABLE and changed nothing; its scheduler retries it; the end state is still exactly the
acknowledged Steps.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcm.client import (
    CallCancelledError,
    DeadlineExceededError,
    SchedulerClient,
    StepBuilder,
    UnavailableError,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import StepProgram
from kvcm.server.journal import FAULT_ENV
from kvcm.wire.events import event_from_proto, events_to_proto

KILLS = int(os.environ.get("KVCM_CRASH_KILLS", "3"))
SCHEDULERS = 3
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=1024,
    hash_seed="crash",
    enable_kv_cache_events=True,
    event_retention_num_events=1_000_000,
    explicit_layout=KVCacheConfig(
        num_blocks=48,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)
HASHER = BlockHasher(16, CONFIG.hash_algorithm, "crash")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """``kvcm serve --data-dir`` in a subprocess, killable and restartable on one port."""

    def __init__(self, data_dir: Path, fault_file: Path | None = None) -> None:
        self.address = f"127.0.0.1:{_free_port()}"
        self.data_dir = data_dir
        self.fault_file = fault_file
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvcm.server.cli", "serve", "--grpc-address", self.address,
             "--http-address", "", "--data-dir", str(self.data_dir), "--log-level", "WARNING",
             "--checkpoint-every-records", "300"],
            stdout=subprocess.DEVNULL,
            env={**os.environ, FAULT_ENV: str(self.fault_file or "")},
        )  # fmt: skip
        with SchedulerClient(self.address, timeout=2.0) as client:
            while True:
                try:
                    client.list_pools()
                    return time.monotonic() - started
                except Exception:
                    assert self.process.poll() is None, "kvcm serve exited"
                    assert time.monotonic() - started < 60, "kvcm serve did not come back"
                    time.sleep(0.05)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=15)


@pytest.fixture(params=["healthy disk", "failing disk"])
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    faults = tmp_path / "fault" if request.param == "failing disk" else None
    running = Server(tmp_path / "data", faults)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def program(scheduler: int, seq: int) -> StepProgram:
    """Step ``seq`` of a scheduler: admit one request (lookup), cache it, finish it."""
    rng = random.Random(scheduler * 1_000_003 + seq)
    prefix = [scheduler * 10_000 + rng.randrange(4) * 100 + i for i in range(rng.choice((16, 32)))]
    prompt = prefix + [rng.randrange(50_000) for _ in range(rng.randrange(1, 60))]
    step = StepBuilder()
    step.step_seq = seq
    step.add_request(seq, prompt, HASHER.hash_token_ids(prompt))
    step.allocate(seq, len(prompt), 0, lookup=True)
    step.cache_blocks(seq, len(prompt))
    step.finish(seq)
    return step.build()


def drive(server: Server, scheduler: int, stop: threading.Event, acked: list[int]) -> None:
    """Run Steps 1, 2, ... on pool ``s<scheduler>`` until ``stop``; retry unanswered ones."""
    with SchedulerClient(server.address, timeout=30.0) as client:
        seq = len(acked) + 1
        give_up_at = time.monotonic() + 120
        while not stop.is_set():
            try:
                client.step(f"s{scheduler}", program(scheduler, seq))
            except (UnavailableError, DeadlineExceededError, CallCancelledError):
                assert time.monotonic() < give_up_at, "the server did not come back in 120 s"
                time.sleep(0.05)
                continue  # the same step_seq again: it runs once whichever way it went
            acked.append(seq)
            seq += 1
            give_up_at = time.monotonic() + 120


def _run_for(server: Server, rng: random.Random, seconds: float) -> None:
    """Let the schedulers run ``seconds``; with a fault file, the disk fails now and then
    (and works again before the server is killed: a start on a failing disk is refused)."""
    if server.fault_file is None:
        time.sleep(seconds)
        return
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        server.fault_file.write_text(rng.choice(["write ENOSPC", "fsync EIO", "any ENOSPC"]))
        time.sleep(min(left, rng.uniform(0.01, 0.1)))
        server.fault_file.unlink()
        time.sleep(min(max(end - time.monotonic(), 0), rng.uniform(0.02, 0.2)))


def test_acknowledged_steps_survive_kill_9(server: Server) -> None:
    with SchedulerClient(server.address) as client:
        for index in range(SCHEDULERS):
            client.create_pool(f"s{index}", CONFIG)
    stop = threading.Event()
    acked: list[list[int]] = [[] for _ in range(SCHEDULERS)]
    threads = [
        threading.Thread(target=drive, args=(server, i, stop, acked[i]), daemon=True)
        for i in range(SCHEDULERS)
    ]
    for thread in threads:
        thread.start()
    rng = random.Random(7)
    restarts = []
    for _ in range(KILLS):
        _run_for(server, rng, rng.uniform(0.2, 0.8))
        server.kill()
        restarts.append(server.start())
    _run_for(server, rng, 0.5)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    print(
        f"{KILLS} kills, {sum(len(a) for a in acked)} acknowledged Steps, restart "
        f"p50 {sorted(restarts)[len(restarts) // 2]:.2f} s"
    )
    with SchedulerClient(server.address) as client:
        for index in range(SCHEDULERS):
            assert acked[index] == list(range(1, len(acked[index]) + 1))
            assert len(acked[index]) > 5
            reference = Pool("ref", CONFIG)
            for seq in acked[index]:
                reference.run_step(program(index, seq))
                reference.publish_events(0.0)
            info = client.describe_pool(f"s{index}")
            manager = reference.ready_manager()
            assert info.num_free_blocks == manager.num_free_blocks
            assert info.num_requests == len(reference.requests)
            assert info.last_event_sequence == reference.last_event_sequence
            events = []
            with client.subscribe_events(f"s{index}", start_sequence=1) as stream:
                for batch in stream:
                    events.extend(batch.events)
                    if len(events) >= reference.last_event_sequence:
                        break
            # As the wire carries them (the stream's codec).
            length = reference.hashing.hash_length_bytes
            expected = [
                event_from_proto(message, length)
                for message in events_to_proto(
                    [event for event, _ in reference.event_log_contents()]
                )
            ]
            assert events == expected, f"pool s{index}: the event streams differ"
            # The next Step continues the sequence (the restored exactly-once guard).
            client.step(f"s{index}", program(index, len(acked[index]) + 1))
