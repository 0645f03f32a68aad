"""The Python blocks of README.md and docs/*.md run, against a real server.

Every ```python block is either run or marked, on the line right before it, with
``<!-- not-run: reason -->`` (fragments of a larger loop, signature listings, code that needs a
GPU). A runnable block is executed in a fresh namespace against a fresh embedded server on
127.0.0.1:0: the docs' address ``127.0.0.1:50051`` (``kvcm serve``'s default) is rewritten to
that server's. The demo commands the docs give are parsed by the demo's own parser.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from demo import _parser as demo_parser

from kvcm.server.embedded import start_embedded_server
from kvcm.server.settings import DEFAULT_GRPC_ADDRESS, ServerSettings

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FENCE = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
DEMO_COMMAND = re.compile(r"`((?:python examples/demo\.py|bash scripts/run\.sh demo)[^`]*)`")
NOT_RUN = re.compile(r"<!-- not-run: (.+?) -->\s*$")


@dataclass(frozen=True, slots=True)
class Snippet:
    """One ```python block: where it is, its code, and why it is not run (``""``: it runs)."""

    path: Path
    line: int
    code: str
    not_run: str

    @property
    def id(self) -> str:
        """``README.md:107``."""
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _snippets() -> list[Snippet]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = NOT_RUN.search(before)
            found.append(Snippet(path, line, match.group(1), marker.group(1) if marker else ""))
    return found


SNIPPETS = _snippets()
RUNNABLE = [s for s in SNIPPETS if not s.not_run]


def test_every_block_runs_or_says_why_not() -> None:
    skipped = [s for s in SNIPPETS if s.not_run]
    # The counts are the docs' inventory: a new block must run or be marked with a reason.
    assert len(RUNNABLE) >= 3, [s.id for s in RUNNABLE]
    assert all(len(s.not_run) > 10 for s in skipped), [s.id for s in skipped]
    assert len(SNIPPETS) == len(RUNNABLE) + len(skipped)
    readme = [s for s in RUNNABLE if s.path.name == "README.md"]
    assert any("RemoteKVCacheManager" in s.code for s in readme), "the scheduler example runs"


@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda s: s.id)
def test_block_runs_against_a_real_server(snippet: Snippet) -> None:
    settings = ServerSettings(grpc_address="127.0.0.1:0", http_address="")
    with start_embedded_server(settings) as server:
        code = snippet.code.replace(DEFAULT_GRPC_ADDRESS, server.grpc_address)
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(code, snippet.id, "exec"), {"__name__": "__docs__"})
    # Where a block shows what it prints in a comment, that is what it prints.
    shown = re.findall(r"print\(.*\)\s+# (.+)$", snippet.code, re.M)
    for expected in shown:
        assert expected.strip() in output.getvalue(), (expected, output.getvalue())


def _demo_commands() -> list[str]:
    commands = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        commands += DEMO_COMMAND.findall(text)
    return commands


def test_demo_commands_in_the_docs_parse() -> None:
    commands = _demo_commands()
    assert commands
    parser = demo_parser()
    for command in commands:
        words = shlex.split(command)
        args = words[2:] if words[0] == "python" else words[3:]
        parser.parse_args([a.replace("HOST:PORT", "127.0.0.1:1") for a in args])
    demo_flags = {f for action in parser._actions for f in action.option_strings}
    # Every flag the Demo section of docs/sdk.md names is one the demo accepts.
    section = (ROOT / "docs" / "sdk.md").read_text("utf-8").split("## Demo", 1)[1]
    section = section.split("\n## ", 1)[0]
    named = set(re.findall(r"`(--[a-z-]+)`", section))
    assert named
    assert named <= demo_flags, named - demo_flags
