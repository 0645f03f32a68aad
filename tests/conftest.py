"""Shared by every test folder: the examples (demo, workload generator) are importable.

``examples/`` holds programs, not a library package; tests import its modules by name
(``import workload``, ``import demo``), as the demo itself does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

_EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)


# --- Skips are failures where the README's test command runs ------------------------------------
# The real components (the vLLM reference, etcd, Prometheus, Chromium) are installed by
# scripts/test.sh and fail soft there, so that a developer without one still runs the rest. The
# README's command (and CI, which runs exactly it) exports KVCM_STRICT_SKIPS=1: a test skipped
# for a missing component then fails the run, naming it, instead of a green run that checked
# nothing of the cluster or of vLLM. Only the reasons below remain legitimate skips.
_ALLOWED_SKIPS = ("KVCM_LONG", "KVCM_PURE_PYTHON", "SIGSTOP", "needs root")
_unexpected_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and os.environ.get("KVCM_STRICT_SKIPS") == "1":
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        if not any(allowed in reason for allowed in _ALLOWED_SKIPS):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


# With pytest-xdist (scripts/test.sh runs two workers) a module's own terminal summary stays in
# its worker: tests/compat/test_manager_compat.py hands its line over in ``workeroutput``.
_WORKER_SUMMARY_KEY = "kvcm_manager_compat_summary"
_worker_summaries: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    del error
    line = getattr(node, "workeroutput", {}).get(_WORKER_SUMMARY_KEY)
    if line:
        _worker_summaries.append(line)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _worker_summaries:
        terminalreporter.write_sep("-", "kvcm KVCacheManager vs vLLM 0.33.0")
        terminalreporter.write_line(line)
    if _unexpected_skips:
        terminalreporter.write_line(
            f"KVCM_STRICT_SKIPS=1: {len(_unexpected_skips)} test(s) skipped, a component missing:"
        )
        for line in _unexpected_skips[:50]:
            terminalreporter.write_line(f"  {line}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unexpected_skips and exitstatus == 0:
        session.exitstatus = 1
