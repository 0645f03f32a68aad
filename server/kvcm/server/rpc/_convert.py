"""Compatibility shim: the codec moved to :mod:`kvcm.wire`.

Only the names ``rpc/_scheduler.py`` and ``rpc/_step.py`` import today are re-exported; new
code imports :mod:`kvcm.wire` directly. Delete this module once neither imports it.
"""

from __future__ import annotations

from kvcm.wire import fill_grouped, slot_options_from_proto

__all__ = ["fill_grouped", "slot_options_from_proto"]
