"""Signals on a real ``kvcm serve`` process: SIGTERM drains, SIGHUP reloads.

SIGTERM turns readiness off at once (``/readyz`` 503, gRPC health NOT_SERVING), keeps serving
calls for ``shutdown_delay_s`` while endpoints update, then stops and exits 0. SIGHUP re-reads
the configuration file and applies the log settings without dropping anything, naming the
settings that need a restart.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvcm.client import SchedulerClient


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _serve(config: Path) -> tuple[subprocess.Popen[str], str, str]:
    grpc_address = f"127.0.0.1:{_free_port()}"
    http_address = f"127.0.0.1:{_free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcm.server.cli", "serve", "--config", str(config),
         "--grpc-address", grpc_address, "--http-address", http_address],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    started = time.monotonic()
    while True:
        try:
            if httpx.get(f"http://{http_address}/readyz", timeout=1.0).status_code == 200:
                return process, grpc_address, http_address
        except httpx.HTTPError:
            pass
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() - started < 30
        time.sleep(0.05)


def test_sigterm_turns_readiness_off_keeps_serving_for_the_delay_then_exits_0(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvcm.toml"
    config.write_text("[server]\nshutdown_delay_s = 1.5\n", encoding="utf-8")
    process, grpc_address, http_address = _serve(config)
    with SchedulerClient(grpc_address, timeout=2.0) as client:
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        assert httpx.get(f"http://{http_address}/readyz", timeout=1.0).status_code == 503
        assert client.list_pools() == []  # still answering during the delay
        assert time.monotonic() - sent < 1.5
    assert process.wait(timeout=15) == 0
    assert time.monotonic() - sent >= 1.5


def test_sighup_reloads_the_log_settings_and_names_what_needs_a_restart(tmp_path: Path) -> None:
    config = tmp_path / "kvcm.toml"
    config.write_text('[server]\nlog_format = "json"\nlog_level = "INFO"\n', encoding="utf-8")
    process, grpc_address, _ = _serve(config)
    try:
        config.write_text(
            '[server]\nlog_format = "json"\nlog_level = "DEBUG"\ndata_dir = "/nonexistent"\n',
            encoding="utf-8",
        )
        process.send_signal(signal.SIGHUP)
        with SchedulerClient(grpc_address, timeout=2.0) as client:
            assert client.list_pools() == []  # serving throughout
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        assert process.stderr is not None
        lines = [
            json.loads(line) for line in process.stderr.read().splitlines() if line.startswith("{")
        ]
    finally:
        if process.poll() is None:
            process.kill()
    reloads = [line for line in lines if line.get("event") == "config_reloaded"]
    assert len(reloads) == 1
    assert reloads[0]["log_level"] == "DEBUG"
    assert reloads[0]["needs_restart"] == ["data_dir"]
