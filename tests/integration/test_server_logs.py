"""A real ``kvcm serve --log-format json`` subprocess: every stderr line is one JSON object, and
each pool lifecycle change, the configuration and a rejected call (at DEBUG) have their line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvcm.client import PoolConfig, SchedulerClient, ServiceNotFoundError, WorkerClient
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec

SERVE = [sys.executable, "-m", "kvcm.server.cli", "serve"]
MIB = 1024 * 1024


class _Server:
    """A ``kvcm serve`` child whose stderr lines are collected by a thread."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [*SERVE, "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        """The first JSON line whose ``event`` is ``event``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                entry = json.loads(line)
                if entry.get("event") == event:
                    return entry  # type: ignore[no-any-return]
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"no {event!r} line in {self.lines}")

    def stop(self) -> list[dict[str, Any]]:
        """SIGTERM, wait, and every line parsed (each must be JSON)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=30) == 0
        self._reader.join(timeout=10)
        return [json.loads(line) for line in self.lines]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCM_", "GRPC_"))}
    env.update(extra)
    return env


@pytest.fixture
def server() -> Iterator[_Server]:
    # The format from the flag, the level from the environment: both layers reach logging.
    running = _Server("--log-format", "json", env=_env(KVCM_LOG_LEVEL="DEBUG"))
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait(timeout=10)


def _by_event(entries: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [entry for entry in entries if entry.get("event") == event]


def test_json_lines_for_every_lifecycle_event(server: _Server) -> None:
    serving = server.wait_for("serving")
    config = server.wait_for("config_loaded")
    assert config["log_format"] == "json"
    assert config["log_level"] == "DEBUG"
    assert config["limits"]["max_pools"] >= 1
    address, http_address = serving["grpc_address"], serving["http_address"]
    # uvicorn's lines reach the same handler: a scrape must not break the format.
    assert httpx.get(f"http://{http_address}/metrics", timeout=5.0).status_code == 200

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
    with SchedulerClient(address) as client, WorkerClient(address, timeout=30.0) as worker:
        client.create_pool("planned", PoolConfig(max_model_len=2048, world_size=1))
        worker.register("planned", 0, 1, {"layer.0": spec}, 16 * MIB)
        with pytest.raises(ServiceNotFoundError):
            client.describe_pool("absent")
        client.delete_pool("planned")

    entries = server.stop()
    levels = {entry["level"] for entry in entries}
    assert levels <= {"DEBUG", "INFO", "WARNING"}
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= set(entry), entry
    (created,) = _by_event(entries, "pool_created")
    assert created == created | {"pool": "planned", "state": "PENDING_WORKERS", "world_size": 1}
    (registered,) = _by_event(entries, "worker_registered")
    assert registered["rank"] == 0
    assert registered["registered"] == 1
    (ready,) = _by_event(entries, "pool_ready")
    assert ready["pool"] == "planned"
    assert ready["num_blocks"] > 0
    (deleted,) = _by_event(entries, "pool_deleted")
    assert deleted["pool"] == "planned"
    (rejected,) = _by_event(entries, "call_rejected")
    assert rejected["level"] == "DEBUG"
    assert rejected["method"] == "DescribePool"
    assert rejected["code"] == "NOT_FOUND"
    order = [e.get("event") for e in entries if e.get("event", "").startswith(("pool", "worker"))]
    assert order == ["pool_created", "worker_registered", "pool_ready", "pool_deleted"]
    # grpc's and asyncio's own DEBUG lines stay out even at DEBUG.
    assert not [e for e in entries if e["logger"].startswith(("grpc", "asyncio"))]


def test_text_is_the_default_and_info_has_no_per_call_lines() -> None:
    running = _Server(env=_env())
    try:
        deadline = time.monotonic() + 30
        while not any("kvcm serving" in line for line in running.lines):
            assert time.monotonic() < deadline, running.lines
            assert running.process.poll() is None, running.lines
            time.sleep(0.02)
        line = next(line for line in running.lines if "kvcm serving" in line)
        assert line.split()[1:3] == ["INFO", "kvcm.server"]
        assert "event=serving" in line
        address = line.split("grpc_address=")[1].split()[0]
        with SchedulerClient(address) as client:
            for _ in range(3):
                with pytest.raises(ServiceNotFoundError):
                    client.describe_pool("absent")
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(timeout=30) == 0
        running._reader.join(timeout=10)
    finally:
        if running.process.poll() is None:
            running.process.kill()
    assert not [line for line in running.lines if "call rejected" in line]
    assert all(not line.startswith("{") for line in running.lines)
