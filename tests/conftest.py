"""Shared by every test folder: the examples (demo, workload generator) are importable.

``examples/`` holds programs, not a library package; tests import its modules by name
(``import workload``, ``import demo``), as the demo itself does.
"""

from __future__ import annotations

import sys
from pathlib import Path

_EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
