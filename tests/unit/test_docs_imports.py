"""The docs name one import path per type.

Every ``from kvcm... import Name`` in the README and docs/*.md code blocks is collected; a name
imported from two modules (``PoolConfig`` from ``kvcm.client`` here and ``kvcm.core.pool``
there) fails, naming both places, so a reader meets each type under one path.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_IMPORT = re.compile(r"^\s*from (kvcm[\w.]*) import (\([^)]*\)|[^\n]+)", re.MULTILINE)


def _imports() -> dict[str, set[tuple[str, str]]]:
    """name -> {(module, page)} over every page's imports."""
    found: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for page in PAGES:
        for module, names in _IMPORT.findall(page.read_text(encoding="utf-8")):
            for item in names.strip("()").replace("\n", ",").split(","):
                name = item.split("#")[0].strip().split(" as ")[0].strip()
                if name.isidentifier():
                    found[name].add((module, page.name))
    return found


def test_the_pages_import_something() -> None:
    imports = _imports()
    assert ("kvcm.client", "README.md") in imports["SchedulerClient"]


def test_each_type_has_one_import_path_in_the_docs() -> None:
    clashes = {
        name: sorted(places)
        for name, places in _imports().items()
        if len({module for module, _ in places}) > 1
    }
    assert not clashes, f"names imported from more than one module in the docs: {clashes}"
