"""``kvcm serve --data-dir`` as a killable subprocess, and the Steps the data-directory tests
run (shared by test_journal_damage.py and test_disk_full.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvcm.client import SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import StepProgram

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=1024,
    hash_seed="damage",
    enable_kv_cache_events=True,
    explicit_layout=KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)
HASHER = BlockHasher(16, CONFIG.hash_algorithm, "damage")
CLI = [sys.executable, "-m", "kvcm.server.cli"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """``kvcm serve --data-dir`` in a subprocess."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.address = f"127.0.0.1:{_free_port()}"
        self.data_dir = data_dir
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def spawn(self) -> subprocess.Popen[bytes]:
        self.process = subprocess.Popen(
            [*CLI, "serve", "--grpc-address", self.address, "--http-address", "",
             "--data-dir", str(self.data_dir), "--log-level", "ERROR"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env,
        )  # fmt: skip
        return self.process

    def start(self) -> None:
        process = self.spawn()
        started = time.monotonic()
        with SchedulerClient(self.address, timeout=2.0) as client:
            while True:
                try:
                    client.list_pools()
                    return
                except Exception:
                    if process.poll() is not None:
                        raise AssertionError(
                            f"kvcm serve exited: {process.stderr.read().decode()}"  # type: ignore[union-attr]
                        ) from None
                    assert time.monotonic() - started < 60, "kvcm serve did not come up"
                    time.sleep(0.05)

    def refused(self) -> str:
        """Start, expecting a refusal: the process's stderr."""
        process = self.spawn()
        _, err = process.communicate(timeout=60)
        assert process.returncode not in (0, None), "kvcm serve started"
        return err.decode()

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=15)


def program(seq: int) -> StepProgram:
    """Step ``seq``: admit a request (prefix lookup), cache it; finish every other one."""
    prompt = [seq % 5] * 32 + list(range(seq * 100, seq * 100 + 7))
    step = StepBuilder()
    step.step_seq = seq
    step.add_request(seq, prompt, HASHER.hash_token_ids(prompt))
    step.allocate(seq, len(prompt), 0, lookup=True)
    step.cache_blocks(seq, len(prompt))
    if seq % 2 or seq > 20:
        step.finish(seq)
    return step.build()


def reference(steps: int) -> Pool:
    pool = Pool("ref", CONFIG)
    for seq in range(1, steps + 1):
        pool.run_step(program(seq))
        pool.publish_events(0.0)
    return pool


def assert_pool_is(client: SchedulerClient, steps: int) -> None:
    """The server's pool ``p`` equals an in-process pool that ran Steps 1..steps."""
    expected = reference(steps)
    info = client.describe_pool("p")
    assert info.num_free_blocks == expected.ready_manager().num_free_blocks
    assert info.num_requests == len(expected.requests)
    assert info.last_event_sequence == expected.last_event_sequence
