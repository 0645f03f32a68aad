"""No package imports another package's private modules; the server does not import the SDK.

kvcm is one namespace over several source roots (proto, core, server, client): each
top-level package (``kvcm.wire``, ``kvcm.core``, ``kvcm.server``, ``kvcm.client``, ...) may
import the others' public modules only, and ``kvcm.server`` may not import ``kvcm.client``
at all (the codec both share is ``kvcm.wire``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("proto", "core", "server", "client")
# Known exception, owned by another change: the CLI's `demo --remote` runs the SDK's demo.
ALLOWED = {("kvcm.server.cli", "kvcm.client.demo")}


def _modules() -> dict[str, Path]:
    found = {}
    for root in SOURCE_ROOTS:
        for path in (ROOT / root / "kvcm").rglob("*.py"):
            if "_pb2" in path.name:
                continue
            parts = path.relative_to(ROOT / root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("kvcm.")}


def _package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_no_private_imports_across_packages_and_no_sdk_in_the_server() -> None:
    modules = _modules()
    assert "kvcm.wire.specs" in modules
    offending = []
    for name, path in sorted(modules.items()):
        for imported in sorted(_imports(path)):
            allowed = any(
                module == name and (imported == target or imported.startswith(f"{target}."))
                for module, target in ALLOWED
            )
            if allowed or _package(imported) == _package(name):
                continue
            private = any(part.startswith("_") for part in imported.split(".")[2:])
            sdk_in_server = _package(name) == "kvcm.server" and _package(imported) == "kvcm.client"
            if private or sdk_in_server:
                offending.append(f"{name} imports {imported}")
    assert offending == []
