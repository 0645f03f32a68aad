"""``kvcm serve`` as operators run it: a bad setting is one line on stderr and exit code 2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVE = [sys.executable, "-m", "kvcm.server.cli", "serve"]


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    environ.update(env or {})
    return subprocess.run(
        [*SERVE, *args], capture_output=True, text=True, timeout=60, env=environ, check=False
    )


def _assert_one_line_exit_2(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


@pytest.fixture
def listening() -> Iterator[int]:
    """A port some other process already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (["--max-blocks-per-pool", "many"], {}, ("flag --max-blocks-per-pool", "integer")),
        ([], {"KVCM_MAX_TOTAL_BLOCKS": "0"}, ("KVCM_MAX_TOTAL_BLOCKS", "max_total_blocks")),
        (["--grpc-address", "localhost"], {}, ("--grpc-address", "host:port")),
        (["--log-level", "chatty"], {}, ("--log-level", "log_level")),
        (["--no-such-flag"], {}, ("--no-such-flag",)),
    ],
)
def test_bad_values_exit_2_with_one_line(
    args: list[str], env: dict[str, str], needles: tuple[str, ...]
) -> None:
    _assert_one_line_exit_2(_run(args, env), *needles)


def test_bad_config_files_exit_2_with_one_line(tmp_path: Path) -> None:
    unknown_table = tmp_path / "table.toml"
    unknown_table.write_text("[limit]\nmax_pools = 2\n", encoding="utf-8")
    _assert_one_line_exit_2(_run(["--config", str(unknown_table)]), "'limit'")
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text('[limits]\nmax_step_ops = "9"\n', encoding="utf-8")
    _assert_one_line_exit_2(_run([], {"KVCM_CONFIG": str(wrong_type)}), "max_step_ops")
    _assert_one_line_exit_2(_run(["--config", str(tmp_path / "absent.toml")]), "absent.toml")


def test_a_grpc_port_in_use_exits_2_with_one_line(listening: int) -> None:
    result = _run(["--grpc-address", f"127.0.0.1:{listening}", "--http-address", ""])
    _assert_one_line_exit_2(result, "grpc_address", str(listening))


def test_an_http_port_in_use_exits_2_with_one_line(listening: int) -> None:
    result = _run(["--grpc-address", "127.0.0.1:0", "--http-address", f"127.0.0.1:{listening}"])
    _assert_one_line_exit_2(result, "http_address", str(listening))


def test_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvcm.server.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0
    assert result.stdout.startswith("kvcm 0.")
