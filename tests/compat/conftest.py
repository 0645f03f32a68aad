"""Shared fixtures for the differential tests against vLLM 0.33.0.

vLLM lives in its own virtual environment (built by ``../shared/tools/vllm-reference``); its
site-packages directory is appended to the *end* of ``sys.path`` so kvcm's own pinned packages
win any name clash. Importing vLLM costs 10-20 s, so it happens once per session. Where vLLM
cannot be imported every compat test is skipped with the reason.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

_DEFAULT_SITE = Path.home() / ".cache/kvcm/vllm-ref/lib/python3.11/site-packages"


def vllm_site() -> Path | None:
    """The vLLM reference's site-packages: ``$KVCM_VLLM_SITE`` or the default location."""
    site = os.environ.get("KVCM_VLLM_SITE")
    path = Path(site) if site else _DEFAULT_SITE
    return path if path.is_dir() else None


@functools.cache
def import_vllm() -> str | None:
    """Make vLLM importable once per process; return why it is not, or ``None``."""
    site = vllm_site()
    if site is None:
        return (
            "vLLM 0.33.0 reference not found: set KVCM_VLLM_SITE or run "
            "`bash ../shared/tools/vllm-reference/setup.sh` (scripts/test.sh does)"
        )
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if str(site) not in sys.path:
        sys.path.append(str(site))
    try:
        vllm = importlib.import_module("vllm")
        importlib.import_module("vllm.v1.core.kv_cache_manager")
    except Exception as exc:  # any import failure means "cannot compare", said in the skip
        return f"vLLM 0.33.0 is not importable from {site}: {exc!r}"
    version = str(getattr(vllm, "__version__", "?"))
    if not version.startswith("0.33.0"):
        return f"expected vLLM 0.33.0 at {site}, found {version}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/compat as ``compat``."""
    del config
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.compat)


@pytest.fixture(scope="session")
def vllm() -> ModuleType:
    """The imported ``vllm`` package, or a skip that says why it is unavailable."""
    reason = import_vllm()
    if reason is not None:
        pytest.skip(reason)
    return importlib.import_module("vllm")


@pytest.fixture
def kv_events(vllm: ModuleType) -> ModuleType:
    """vLLM's ``vllm.distributed.kv_events`` (its event structs and ``KVEventBatch``)."""
    del vllm
    return importlib.import_module("vllm.distributed.kv_events")
