"""The package boundaries of docs/architecture.md, enforced on the source.

An AST scan of every module under ``core/``, ``proto/kvcm/wire``, ``server/`` and ``client/``
reads every import (module level, in functions, under ``TYPE_CHECKING``) and checks who may
import whom:

- ``kvcm.common`` and ``kvcm.core`` import no transport, metrics or tensor library and no
  kvcm layer above them; ``kvcm.common`` does not import ``kvcm.core``;
- ``kvcm.wire`` imports only ``kvcm.v1``, ``kvcm.core``, ``kvcm.common``, the standard library
  and protobuf;
- ``kvcm.server`` never imports ``kvcm.client``, nor ``kvcm.client`` ``kvcm.server``;
- nobody imports another package's private module (``kvcm.a._b`` from outside ``kvcm.a``);
- the core's modules import each other without circles.

A second test imports the SDK in a fresh interpreter where the server's dependencies cannot
be imported at all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = {"core": ("kvcm/core", "kvcm/common"), "proto": ("kvcm/wire",)}
SOURCE_ROOTS |= {"server": ("kvcm/server",), "client": ("kvcm/client",)}

IO_LIBRARIES = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "google.protobuf",
    "fastapi",
    "uvicorn",
    "starlette",
    "prometheus_client",
    "torch",
)
CORE_FORBIDDEN = (*IO_LIBRARIES, "kvcm.v1", "kvcm.wire", "kvcm.server", "kvcm.client")
WIRE_ALLOWED = ("kvcm.v1", "kvcm.wire", "kvcm.core", "kvcm.common", "google.protobuf")

# Known violations, each to be removed by the change that ends it. The test fails for a
# violation missing here AND for an entry here that no longer happens, so the list only
# shrinks. (importer, imported, why it is still here)
ALLOWED_VIOLATIONS: frozenset[tuple[str, str]] = frozenset(set())


@dataclass(frozen=True, slots=True)
class Import:
    """One imported module, as the importer names it."""

    importer: str
    module: str
    line: int
    type_only: bool = False


def _module_name(source_root: Path, path: Path) -> str:
    parts = list(path.relative_to(source_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_files() -> Iterator[tuple[str, Path]]:
    for root_name, packages in SOURCE_ROOTS.items():
        source_root = ROOT / root_name
        for package in packages:
            for path in sorted((source_root / package).rglob("*.py")):
                yield _module_name(source_root, path), path


MODULES: dict[str, Path] = dict(_source_files())


def _resolve(importer: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _type_only_nodes(tree: ast.Module) -> set[ast.AST]:
    """Import nodes under ``if TYPE_CHECKING:`` (annotations only; never run)."""
    nodes: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for stmt in node.body:
                nodes.update(ast.walk(stmt))
    return nodes


def _imports(importer: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    type_only = _type_only_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer, alias.name, node.lineno, node in type_only)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, path, node)
            yield Import(importer, base, node.lineno, node in type_only)
            for alias in node.names:
                # `from kvcm.client import _convert` imports the module kvcm.client._convert.
                if f"{base}.{alias.name}" in MODULES:
                    yield Import(importer, f"{base}.{alias.name}", node.lineno, node in type_only)


ALL_IMPORTS: list[Import] = [imp for name, path in MODULES.items() for imp in _imports(name, path)]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _within_any(module: str, packages: tuple[str, ...]) -> bool:
    return any(_within(module, package) for package in packages)


def _is_stdlib(module: str) -> bool:
    return module.split(".", maxsplit=1)[0] in sys.stdlib_module_names or module == "__future__"


def _private_owner(module: str) -> str | None:
    """The package that owns the first private component of ``module``, if any."""
    parts = module.split(".")
    for index, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:index])
    return None


def _violation(imp: Import) -> str | None:
    importer, module = imp.importer, imp.module
    if _within_any(importer, ("kvcm.core", "kvcm.common")):
        if _within_any(module, CORE_FORBIDDEN):
            return "the core and the shared vocabulary import no I/O library or upper layer"
        if _within(importer, "kvcm.common") and _within(module, "kvcm.core"):
            return "kvcm.common is below kvcm.core"
    if (
        _within(importer, "kvcm.wire")
        and not _is_stdlib(module)
        and not _within_any(module, WIRE_ALLOWED)
    ):
        return "kvcm.wire imports only kvcm.v1, kvcm.core, kvcm.common, stdlib and protobuf"
    if _within(importer, "kvcm.server") and _within(module, "kvcm.client"):
        return "the server never imports the SDK"
    if _within(importer, "kvcm.client") and _within(module, "kvcm.server"):
        return "the SDK never imports the server"
    owner = _private_owner(module)
    if owner is not None and _within(module, "kvcm") and not _within(importer, owner):
        return f"{module} is private to {owner}"
    return None


def test_the_scan_sees_every_layer() -> None:
    for module in ("kvcm.core.manager", "kvcm.common.specs", "kvcm.server.app", "kvcm.client"):
        assert module in MODULES, sorted(MODULES)
    assert any(imp.module == "kvcm.common.specs" for imp in ALL_IMPORTS)
    # Lazy imports inside functions count too.
    assert any(
        imp.importer == "kvcm.server.cli" and imp.module == "kvcm.server.app" for imp in ALL_IMPORTS
    )


def test_imports_respect_the_layers() -> None:
    found: dict[tuple[str, str], str] = {}
    for imp in ALL_IMPORTS:
        why = _violation(imp)
        if why is not None:
            found.setdefault((imp.importer, imp.module), f"line {imp.line}: {why}")
    new = {pair: why for pair, why in found.items() if pair not in ALLOWED_VIOLATIONS}
    assert not new, "imports that cross the boundaries of docs/architecture.md:\n" + "\n".join(
        f"  {importer} -> {module} ({why})" for (importer, module), why in sorted(new.items())
    )
    stale = ALLOWED_VIOLATIONS - found.keys()
    assert not stale, f"ALLOWED_VIOLATIONS entries that no longer happen; remove them: {stale}"


def test_the_core_has_no_import_circles() -> None:
    core = ("kvcm.core", "kvcm.common")
    graph: dict[str, set[str]] = {name: set() for name in MODULES if _within_any(name, core)}
    for imp in ALL_IMPORTS:
        # A package's __init__ re-exports its modules; that is not a dependency circle. Nor
        # is an annotation-only import (the interpreter in kvcm.core.step takes a Pool, whose
        # methods call the interpreter): only what runs makes a circle.
        if imp.type_only:
            continue
        if imp.importer in graph and imp.module in graph and not _within(imp.module, imp.importer):
            graph[imp.importer].add(imp.module)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circle = [*path[path.index(target) :], target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_a_violation_is_reported() -> None:
    # The checker itself: a core module importing grpc, the server importing the SDK, and a
    # private module imported from outside its package are all caught.
    assert _violation(Import("kvcm.core.pool", "grpc", 1)) is not None
    assert _violation(Import("kvcm.core.pool", "kvcm.wire", 1)) is not None
    assert _violation(Import("kvcm.wire.codec", "fastapi", 1)) is not None
    assert _violation(Import("kvcm.wire.codec", "enum", 1)) is None
    assert _violation(Import("kvcm.server.app", "kvcm.client", 1)) is not None
    assert _violation(Import("kvcm.client.aio", "kvcm.server.settings", 1)) is not None
    assert _violation(Import("kvcm.client.aio", "kvcm.core._x", 1)) is not None
    assert _violation(Import("kvcm.client.aio", "kvcm.client._base", 1)) is None
    assert _violation(Import("kvcm.server.rpc", "kvcm.server.rpc._step", 1)) is None


SDK_MODULES = ("kvcm.client", "kvcm.client.worker", "kvcm.client.remote_manager", "kvcm.core.pool")
SERVER_ONLY = (
    "fastapi",
    "uvicorn",
    "starlette",
    "prometheus_client",
    "grpc_health",
    "grpc_reflection",
)


def test_the_sdk_imports_without_the_server_dependencies() -> None:
    code = textwrap.dedent(
        f"""
        import importlib, importlib.abc, sys

        BLOCKED = {SERVER_ONLY!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is a server dependency")
                return None

        sys.meta_path.insert(0, Block())
        for name in {SDK_MODULES!r}:
            importlib.import_module(name)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        try:
            import fastapi  # noqa: F401
        except ImportError:
            print("blocked")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "blocked"
