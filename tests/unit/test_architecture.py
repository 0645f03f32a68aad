"""The map in docs/architecture.md, enforced on the source.

The page's tables are the rules: the source-root table says which packages exist and where,
the import table says what each package may import (and which third-party modules only some of
its modules may import), and the picture must name every package. An AST scan of every module
under the source roots reads every import (module level, in functions, under
``TYPE_CHECKING``) and checks:

- every package in the tree has a row in both tables and the picture, and every row a package;
- each import lies within its package's "may import" column (or the standard library), and a
  confined third-party module is imported only where the table confines it;
- nobody imports another package's private module (``kvcm.a._b`` from outside ``kvcm.a``);
- the core's modules import each other without circles;
- the README's layout table has the same packages in the same folders, and every kvcm name
  its architecture picture draws exists;
- docs/core-api.md names classes that exist, with fields they have, and lists the manager's
  whole public surface.

A second test imports the SDK in a fresh interpreter where the server's dependencies cannot
be imported at all.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
DOC_TEXT = DOC.read_text(encoding="utf-8")


def _section(marker: str) -> str:
    """The fenced block or table that follows ``<!-- architecture:{marker} -->`` in the doc."""
    tag = f"<!-- architecture:{marker} -->"
    assert tag in DOC_TEXT, f"docs/architecture.md lost its {tag} marker"
    rest = DOC_TEXT.split(tag, 1)[1].lstrip("\n")
    if rest.startswith("```"):
        return rest[3:].split("```", 1)[0]
    lines = []
    for line in rest.splitlines():
        if not line.startswith("|"):
            break
        lines.append(line)
    return "\n".join(lines)


def _source_roots() -> dict[str, tuple[str, str]]:
    """package -> (source root folder, package path inside it), from the roots table."""
    roots: dict[str, tuple[str, str]] = {}
    for line in _section("roots").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0].endswith("/") and fields[1].startswith("kvcm."):
            roots[fields[1]] = (fields[0].rstrip("/"), fields[1].replace(".", "/"))
    return roots


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _import_table() -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(package -> what it may import, third-party module -> the modules it is confined to)."""
    allowed: dict[str, tuple[str, ...]] = {}
    confined: dict[str, tuple[str, ...]] = {}
    for line in _section("imports").splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        (package,) = _names(cells[0])
        allowed[package] = tuple(_names(cells[1]))
        for clause in cells[2].split(";"):
            if clause.strip():
                library, *where = _names(clause)
                confined[library] = (*confined.get(library, ()), *where)
    return allowed, confined


SOURCE_ROOTS = _source_roots()
ALLOWED_IMPORTS, CONFINED = _import_table()
PICTURE = _section("picture")
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
    "zmq",
    "vllm",
)

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
    for root_name, package_path in SOURCE_ROOTS.values():
        source_root = ROOT / root_name
        for path in sorted((source_root / package_path).rglob("*.py")):
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


def _package(module: str) -> str:
    """The package of the import table that owns ``module`` (``kvcm.core`` for kvcm.core.x)."""
    return ".".join(module.split(".")[:2])


def _violation(imp: Import) -> str | None:
    importer, module = imp.importer, imp.module
    if _is_stdlib(module):
        return None
    package = _package(importer)
    may = ALLOWED_IMPORTS.get(package)
    if may is None:
        return f"{package} has no row in the import table of docs/architecture.md"
    if not _within_any(module, may):
        return f"{package} may import only {', '.join(may)} (docs/architecture.md)"
    for library, where in CONFINED.items():
        # Annotation-only imports never run, so they do not pull the library in.
        if _within(module, library) and not imp.type_only and not _within_any(importer, where):
            return f"{library} is imported only in {', '.join(where)} (docs/architecture.md)"
    owner = _private_owner(module)
    if owner is not None and _within(module, "kvcm") and not _within(importer, owner):
        return f"{module} is private to {owner}"
    return None


def test_the_map_names_every_package() -> None:
    found = {_package(name) for name in MODULES}
    assert found == set(SOURCE_ROOTS), (
        f"source-root table {sorted(SOURCE_ROOTS)} vs the tree {sorted(found)}"
    )
    assert set(ALLOWED_IMPORTS) == found, (
        f"import table {sorted(ALLOWED_IMPORTS)} vs the tree {sorted(found)}"
    )
    drawn = set(re.findall(r"kvcm\.[a-z0-9_]+", PICTURE))
    assert drawn == found, f"the picture names {sorted(drawn)}, the tree has {sorted(found)}"
    for root, package_path in SOURCE_ROOTS.values():
        assert (ROOT / root / package_path).is_dir(), f"{root}/{package_path} does not exist"


def test_the_core_api_page_has_a_row_per_core_module() -> None:
    # docs/core-api.md's module tables name kvcm.common's and kvcm.core's public modules
    # (first cell of each row, several per row allowed); a module added or removed without
    # the page following fails here.
    text = (ROOT / "docs" / "core-api.md").read_text(encoding="utf-8")
    documented: set[str] = set()
    for heading, package in (("## `kvcm.common`", "kvcm.common"), ("## `kvcm.core`", "kvcm.core")):
        section = text.split(heading, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
        for line in section.splitlines()[4:]:
            if line.startswith("| `"):
                first_cell = line.split("|")[1]
                documented.update(f"{package}.{name}" for name in _names(first_cell))
    public = {
        name
        for name in MODULES
        if _within_any(name, ("kvcm.common", "kvcm.core"))
        and name.count(".") == 2
        and not name.rsplit(".", 1)[1].startswith("_")
    }
    assert documented == public, (
        f"undocumented: {sorted(public - documented)}; gone: {sorted(documented - public)}"
    )


CORE_API_TEXT = (ROOT / "docs" / "core-api.md").read_text(encoding="utf-8")


def _core_api_rows() -> Iterator[tuple[list[str], str]]:
    """(modules of the row, as ``kvcm.core.x``; the row's contents cell) of the module tables."""
    for heading, package in (("## `kvcm.common`", "kvcm.common"), ("## `kvcm.core`", "kvcm.core")):
        section = CORE_API_TEXT.split(heading, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
        for line in section.splitlines():
            if line.startswith("| `"):
                first, contents = line.strip().strip("|").split("|", 1)
                yield [f"{package}.{name}" for name in _names(first)], contents


def test_the_core_api_page_names_what_exists() -> None:
    # Each class a row of docs/core-api.md names is defined by one of the row's modules (or,
    # for a cross-reference, by another module of the tree), and each
    # ``Record(field, ...)`` it spells out lists fields the record has. A renamed class or a
    # field that moved makes the page false; this makes the test fail instead.
    import dataclasses
    import importlib

    everything = [
        importlib.import_module(name)
        for name in MODULES
        if _within_any(name, ("kvcm.common", "kvcm.core")) and "._" not in name
    ]
    for modules, contents in _core_api_rows():
        mine = [importlib.import_module(name) for name in modules]
        for match in re.finditer(r"`([A-Z][A-Za-z0-9]+)(?:\(([^`]*)\))?`", contents):
            name, args = match.group(1), match.group(2)
            owners = [m for m in mine if hasattr(m, name)] or [
                m for m in everything if hasattr(m, name)
            ]
            if not owners:
                # A cross-reference to a layer above (the SDK's StepBuilder, say).
                assert any(_defines(module, name) for module in MODULES), (
                    f"docs/core-api.md ({', '.join(modules)}): no {name}"
                )
                continue
            record = getattr(owners[0], name)
            if args is None or not isinstance(record, type):
                continue
            fields = (
                [f.name for f in dataclasses.fields(record)]
                if dataclasses.is_dataclass(record)
                else list(getattr(record, "_fields", ()))
            )
            if not fields:
                continue
            for arg in (a.split("=")[0].strip() for a in args.split(",")):
                assert arg in fields, f"docs/core-api.md: {name} has no field {arg!r}"


def test_the_core_api_page_has_the_managers_surface() -> None:
    # The code block of "The manager's surface" lists KVCacheManager's public methods and
    # properties, and the fields of KVCacheManagerConfig and SlotOptions in their order.
    import dataclasses

    from kvcm.core import manager

    block = CORE_API_TEXT.split("### The manager's surface", 1)[1].split("```python", 1)[1]
    block = block.split("```", 1)[0]
    classes = dict(re.findall(r"^class (\w+)[^\n]*\n((?:    [^\n]*\n)+)", block, re.MULTILINE))
    for name in ("KVCacheManagerConfig", "SlotOptions"):
        documented = re.findall(r"^    (\w+):", classes[name], re.MULTILINE)
        actual = [field.name for field in dataclasses.fields(getattr(manager, name))]
        assert documented == actual, f"docs/core-api.md: {name} fields"
    surface = classes["KVCacheManager"]
    methods = set(re.findall(r"^    (?:def )?(\w+)[:(]", surface, re.MULTILINE))
    public = {
        name
        for name, member in vars(manager.KVCacheManager).items()
        if not name.startswith("_") or name == "__init__"
    }
    assert methods == public, (
        f"docs/core-api.md: KVCacheManager undocumented {sorted(public - methods)}, "
        f"gone {sorted(methods - public)}"
    )


README_TEXT = (ROOT / "README.md").read_text(encoding="utf-8")


def _readme_layout() -> list[tuple[str, str]]:
    """(folder, package or "") of each row of the README's layout table."""
    rows = []
    lines = README_TEXT.split("| folder | package | what it holds |", 1)[1].splitlines()
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        (folder,) = _names(cells[0])
        packages = _names(cells[1])
        rows.append((folder.rstrip("/"), packages[0] if packages else ""))
    return rows


def _defines(module: str, name: str) -> bool:
    """Whether ``module`` (a module of the tree) defines or re-exports ``name``."""
    source = MODULES[module].read_text(encoding="utf-8")
    return bool(re.search(rf"^(class|def) {name}\b|^{name}\b|\"{name}\"", source, re.MULTILINE))


def test_the_readme_layout_table_is_the_tree() -> None:
    # The README's layout table is the roots table of docs/architecture.md for readers: one
    # row per package, in the folder that holds it; every other row names a folder that exists.
    rows = _readme_layout()
    by_package = {package: folder for folder, package in rows if package}
    assert by_package == {package: root for package, (root, _) in SOURCE_ROOTS.items()}, (
        "README layout table vs the source roots of docs/architecture.md"
    )
    for folder, _ in rows:
        assert (ROOT / folder).is_dir(), f"README layout table: {folder}/ does not exist"


def test_the_readme_picture_names_what_exists() -> None:
    # Every kvcm name drawn in the README's architecture picture is a package or module of the
    # tree, or a name one of them defines; the server's folders it draws exist.
    picture = README_TEXT.split("## Architecture", 1)[1].split("```", 2)[1]
    names = set(re.findall(r"\bkvcm(?:\.[A-Za-z_][A-Za-z0-9_]*)+", picture))
    assert {"kvcm.server", "kvcm.core", "kvcm.client", "kvcm.wire", "kvcm.v1"} <= names
    for name in sorted(names):
        if name in MODULES:
            continue
        module, _, attribute = name.rpartition(".")
        assert module in MODULES, f"README picture: {name}"
        assert _defines(module, attribute), f"README picture: {name}"
    server = ROOT / "server" / "kvcm" / "server"
    for folder in re.findall(r"\|\s+([a-z]+)/\s", picture):
        assert (server / folder).is_dir(), f"README picture: server/kvcm/server/{folder}/"


def test_the_table_keeps_the_core_pure() -> None:
    # The table is the rule, so the rule's spirit is checked on the table: the core and the
    # vocabulary import no I/O library and nothing above them; the server and the SDK never
    # import each other; only the integrations import vLLM.
    for package in ("kvcm.core", "kvcm.common"):
        assert not set(ALLOWED_IMPORTS[package]) & {*IO_LIBRARIES, "kvcm.v1", "kvcm.wire"}
        for upper in ("kvcm.server", "kvcm.client", "kvcm.integrations"):
            assert upper not in ALLOWED_IMPORTS[package]
    assert "kvcm.core" not in ALLOWED_IMPORTS["kvcm.common"]
    assert "kvcm.client" not in ALLOWED_IMPORTS["kvcm.server"]
    assert "kvcm.server" not in ALLOWED_IMPORTS["kvcm.client"]
    assert "kvcm.server" not in ALLOWED_IMPORTS["kvcm.integrations"]
    importers_of_vllm = {p for p, may in ALLOWED_IMPORTS.items() if "vllm" in may}
    assert importers_of_vllm == {"kvcm.integrations"}


def test_the_scan_sees_every_layer() -> None:
    for module in (
        "kvcm.core.manager",
        "kvcm.common.specs",
        "kvcm.server.app",
        "kvcm.client",
        "kvcm.integrations.vllm",
        "kvcm.v1.service_pb2",
    ):
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
    assert _violation(Import("kvcm.client.scheduler", "torch", 1)) is not None
    assert _violation(Import("kvcm.client.tensors", "torch", 1)) is None
    assert _violation(Import("kvcm.integrations.vllm", "kvcm.server", 1)) is not None
    assert _violation(Import("kvcm.integrations.vllm._manager", "vllm.config", 1)) is None
    assert _violation(Import("kvcm.client.scheduler", "vllm", 1)) is not None


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
