"""The allocation core stays pure: importing it pulls in no transport or metrics library."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import kvcm.core

FORBIDDEN = ("grpc", "fastapi", "prometheus_client", "uvicorn", "starlette", "torch")


def test_core_modules_import_no_io_libraries() -> None:
    modules = sorted(info.name for info in pkgutil.walk_packages(kvcm.core.__path__, "kvcm.core."))
    assert "kvcm.core.manager" in modules, modules
    # A fresh interpreter: this test process may already hold grpc or torch from other tests.
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert json.loads(out) == []
