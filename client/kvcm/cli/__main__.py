"""``python -m kvcm.cli``: the ``kvcm`` command."""

from __future__ import annotations

from kvcm.cli import main

raise SystemExit(main())
