"""`kvcm demo`, the README's run command: an embedded server driven over gRPC, end to end."""

from __future__ import annotations

import pytest

from kvcm.server.cli import main


def test_demo_starts_a_server_and_drives_it_over_grpc(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--requests", "24", "--grpc-address", "127.0.0.1:0"]
    assert main([*argv, "--http-address", "127.0.0.1:0"]) == 0
    out = capsys.readouterr().out
    assert "kvcm server: gRPC on 127.0.0.1:" in out
    assert "requests finished   24" in out
    assert "prefix hit rate" in out


def test_demo_reports_a_port_in_use_instead_of_a_traceback(
    kvcm_address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--requests", "4", "--grpc-address", kvcm_address]
    assert main([*argv, "--http-address", "127.0.0.1:0"]) == 1
    err = capsys.readouterr().err
    assert "failed to start" in err
    assert "--grpc-address" in err


def test_demo_in_process_needs_no_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--in-process", "--requests", "12", "--num-blocks", "256"]) == 0
    assert "12 finished" in capsys.readouterr().out
