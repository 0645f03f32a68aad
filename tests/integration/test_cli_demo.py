"""The README's run command (``bash scripts/run.sh`` runs ``examples/demo.py``): an embedded
server driven over gRPC, end to end; and ``kvcm`` without the demo subcommand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from demo import main

from kvcm.server.cli import main as kvcm_main

ROOT = Path(__file__).resolve().parents[2]


def test_demo_starts_a_server_and_drives_it_over_grpc(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", "24", "--grpc-address", "127.0.0.1:0"]
    assert main([*argv, "--http-address", "127.0.0.1:0"]) == 0
    out = capsys.readouterr().out
    assert "kvcm server: gRPC on 127.0.0.1:" in out
    assert "requests finished   24" in out
    assert "prefix hit rate" in out


def test_demo_reports_a_port_in_use_instead_of_a_traceback(
    kvcm_address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--requests", "4", "--grpc-address", kvcm_address]
    assert main([*argv, "--http-address", "127.0.0.1:0"]) == 1
    err = capsys.readouterr().err
    assert "failed to start" in err
    assert "--grpc-address" in err


def test_demo_in_process_needs_no_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--in-process", "--requests", "12", "--num-blocks", "256"]) == 0
    assert "12 finished" in capsys.readouterr().out


def test_the_demo_runs_as_a_script() -> None:
    # What scripts/run.sh executes: the example as a program, importing its sibling module.
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, "examples/demo.py", "--in-process", "--requests", "8"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "8 finished" in done.stdout


def test_kvcm_has_no_demo_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        kvcm_main(["demo"])
    assert exc.value.code == 2
    assert "invalid choice: 'demo'" in capsys.readouterr().err
