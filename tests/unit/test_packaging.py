"""What the distribution ships beside the code: type markers and the license.

A downstream ``mypy --strict`` only reads a package's inline types (and the generated ``.pyi``
stubs of ``kvcm.v1``) when the package carries a ``py.typed`` marker (PEP 561); without one
every generated message is ``Any``. The license file must say what the metadata declares.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("proto", "core", "server", "client")


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _top_packages() -> list[Path]:
    """Every kvcm.<name> package under the source roots."""
    return sorted(
        path
        for root in SOURCE_ROOTS
        for path in (ROOT / root / "kvcm").iterdir()
        if path.is_dir() and any(path.glob("*.py"))
    )


def test_every_package_carries_a_py_typed_marker() -> None:
    packages = _top_packages()
    assert ROOT / "proto" / "kvcm" / "v1" in packages
    missing = [str(p.relative_to(ROOT)) for p in packages if not (p / "py.typed").is_file()]
    assert not missing


def test_package_data_ships_the_markers_and_stubs() -> None:
    tool = _pyproject()["tool"]
    assert isinstance(tool, dict)
    patterns = tool["setuptools"]["package-data"]["*"]
    assert {"py.typed", "*.pyi"} <= set(patterns)


def test_license_file_matches_the_declared_license() -> None:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
