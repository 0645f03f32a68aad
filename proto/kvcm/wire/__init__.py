"""Codecs between ``kvcm.v1`` messages and the core's plain values (one module per concept)."""

from __future__ import annotations

from kvcm.wire.step import (
    alloc_options_from_proto,
    grouped_from_proto,
    outcome_from_proto,
    outcome_to_proto,
    program_from_proto,
    program_to_proto,
    slot_options_from_proto,
)

__all__ = [
    "alloc_options_from_proto",
    "grouped_from_proto",
    "outcome_from_proto",
    "outcome_to_proto",
    "program_from_proto",
    "program_to_proto",
    "slot_options_from_proto",
]
