"""Generate the synchronous scheduler client from the asyncio one.

``client/kvcm/client/aio.py`` (``AsyncSchedulerClient``) is the source of both clients;
``client/kvcm/client/scheduler.py`` (``SchedulerClient``) is derived from it here, so the two
cannot drift: same methods, same signatures, same docstrings, same requests and decoding.

    python scripts/gen_sync_client.py           # rewrite scheduler.py
    python scripts/gen_sync_client.py --check   # exit 1 when scheduler.py is stale

The rules, applied line by line to the source:

- ``async def`` -> ``def``, ``async with``/``async for`` -> ``with``/``for``, ``await `` dropped;
- the names in ``NAMES`` are swapped for their synchronous twins, then the phrases in
  ``PHRASES`` (docstrings that must say something else; a phrase that is gone is an error);
- a line ending in ``# async-only-line`` is dropped, and so is every line between
  ``# async-only`` and ``# end-async-only``;
- ``# sync: CODE`` (alone on its line, or after code) becomes ``CODE`` at that indentation;
- the result is import-sorted and formatted with the project's ruff settings.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "client" / "kvcm" / "client" / "aio.py"
TARGET = ROOT / "client" / "kvcm" / "client" / "scheduler.py"

NAMES = (
    ("AsyncSchedulerClient", "SchedulerClient"),
    ("AsyncEventStream", "EventStream"),
    ("AsyncChannelClient", "ChannelClient"),
    ("AsyncLookupPortConnection", "LookupPortConnection"),
    ("__aenter__", "__enter__"),
    ("__aexit__", "__exit__"),
    ("asyncio.sleep", "time.sleep"),
)
SOURCE_NOTE = """This module is the source of both scheduler clients: ``kvcm.client.scheduler``
(``SchedulerClient``) is generated from it by ``scripts/gen_sync_client.py``, which drops the
``async``/``await`` keywords and swaps the asyncio names for their synchronous twins (its table
says which), so the two cannot drift. ``bash scripts/test.sh`` fails when the generated module
is stale. Edit this file, then run ``python scripts/gen_sync_client.py``."""
PHRASES = (
    (
        SOURCE_NOTE,
        "Generated from ``kvcm.client.aio`` (the source of both scheduler clients) by\n"
        "``scripts/gen_sync_client.py``: every method has the same signature, docstring, request\n"
        "and decoding as its asyncio twin. Edit that module, not this one.",
    ),
    ("the asyncio SDK", "the synchronous SDK"),
    ("Asyncio client of a kvcm server", "Synchronous client of a kvcm server"),
    (
        "Create it inside the event loop that uses it.",
        "Thread-safe: one client may be shared by threads driving different pools.",
    ),
)
HEADER = (
    "# Generated from client/kvcm/client/aio.py by scripts/gen_sync_client.py: do not edit.\n"
    "# Edit aio.py (the source of both scheduler clients) and run the script again.\n"
)
_KEYWORDS = ((re.compile(r"\basync (def|with|for)\b"), r"\1"), (re.compile(r"\bawait "), ""))
_DIRECTIVE = re.compile(r"^(?P<indent>\s*)(?P<code>.*?)\s*# sync: (?P<sync>.*)$")


def _convert_line(line: str) -> str:
    for pattern, replacement in _KEYWORDS:
        line = pattern.sub(replacement, line)
    for old, new in NAMES:
        line = line.replace(old, new)
    return line


def generate(source: str) -> str:
    """The synchronous module for the asyncio ``source`` (before formatting)."""
    out: list[str] = []
    skipping = False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == "# async-only":
            skipping = True
            continue
        if stripped == "# end-async-only":
            skipping = False
            continue
        if skipping or line.rstrip().endswith("# async-only-line"):
            continue
        directive = _DIRECTIVE.match(line)
        if directive is not None:
            out.append(directive["indent"] + directive["sync"])
            continue
        out.append(_convert_line(line))
    if skipping:
        raise SystemExit(f"{SOURCE}: '# async-only' without '# end-async-only'")
    text = "\n".join(out) + "\n"
    for old, new in PHRASES:
        if old not in text:
            raise SystemExit(f"{SOURCE}: the phrase {old[:40]!r}... is gone; update PHRASES")
        text = text.replace(old, new)
    return text


def _ruff(args: list[str], text: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(TARGET), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    if done.returncode not in (0, 1) or not done.stdout:
        raise SystemExit(f"ruff {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def render() -> str:
    """The text scheduler.py must have: generated, import-sorted, formatted."""
    text = generate(SOURCE.read_text(encoding="utf-8"))
    text = _ruff(["check", "--select", "I", "--fix", "--quiet", "--exit-zero"], text)
    text = _ruff(["format"], text)
    docstring_end = text.index('"""', 3) + 3
    return text[:docstring_end] + "\n\n" + HEADER + text[docstring_end:].lstrip("\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when scheduler.py is stale")
    args = parser.parse_args()
    wanted = render()
    if args.check:
        if TARGET.read_text(encoding="utf-8") != wanted:
            print(
                f"{TARGET.relative_to(ROOT)} is stale: run python scripts/gen_sync_client.py",
                file=sys.stderr,
            )
            return 1
        print("the sync scheduler client is up to date", file=sys.stderr)
        return 0
    TARGET.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
