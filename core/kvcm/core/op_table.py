"""The Step op table: one row per op kind, declaring the program columns an op consumes.

A :class:`~kvcm.core.program.StepProgram` is columnar: each op takes its arguments from the
front of the columns its kind owns. This table is the one statement of which columns those
are; validation and execution (:mod:`kvcm.core.step`), the consumption check, the SDK's
``StepBuilder`` and the vLLM integration's ``StepRecorder`` all derive what they walk or fill
from it, so a new op kind is a new row here plus its validate/execute pair in
:mod:`kvcm.core.step`::

    op kind                keyed  per-op columns (1 entry each)      spans (count -> entries)
    ADD_REQUEST            -      new_requests (the key is inside)   -
    APPEND_TOKENS          yes    append_num_tokens,                 append_num_tokens ->
                                  append_num_block_hashes            append_token_ids;
                                                                     append_num_block_hashes ->
                                                                     append_block_hashes (hashes)
    ALLOCATE               yes    alloc_num_new_tokens,              - (alloc_options[n], when
                                  alloc_num_computed_tokens          present, by alloc index n)
    CACHE_BLOCKS           yes    cache_num_computed_tokens          -
    REMOVE_SKIPPED_BLOCKS  yes    remove_skipped_total_computed_tokens
    PREEMPT, FINISH        yes    -                                  -
    NEW_STEP_STARTS,       -      -                                  -
    RESET_PREFIX_CACHE
    EVICT_BLOCKS           -      evict_num_block_ids                evict_num_block_ids ->
                                                                     evict_block_ids
    RECORD_PREFIX_STATS    yes    record_hit_tokens                  -

A keyed op takes the next entry of ``request_keys``. Op number ``n`` of a kind (its ordinal
among the program's ops of that kind) takes entry ``n`` of each of its per-op columns, so one
cursor (the key position and each kind's ordinal) finds every argument; a span's entries are
the next ``count`` entries of its data column (``append_block_hashes`` counts hashes of the
pool's hash length). The rows are listed in the order the consumption check names a column
that has too many or too few entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from kvcm.core.program import OpKind

__all__ = [
    "COLUMNS",
    "KEYED",
    "OP_TABLE",
    "OpColumns",
    "Span",
    "op_name",
]


@dataclass(frozen=True, slots=True)
class Span:
    """A run of entries in ``data`` whose length is the op's entry in ``count``."""

    count: str
    data: str


@dataclass(frozen=True, slots=True)
class OpColumns:
    """One row of the op table (see the module docstring).

    Attributes:
        kind: The op kind.
        keyed: The op takes one ``request_keys`` entry.
        columns: The per-op columns: one entry each per op, in the order the op is checked
            (the first is the one named when a program has too few).
        spans: Data columns whose length per op is in one of ``columns``.
    """

    kind: OpKind
    keyed: bool
    columns: tuple[str, ...] = ()
    spans: tuple[Span, ...] = ()


_ROWS: Final = (
    OpColumns(OpKind.ADD_REQUEST, keyed=False, columns=("new_requests",)),
    OpColumns(
        OpKind.ALLOCATE,
        keyed=True,
        columns=("alloc_num_new_tokens", "alloc_num_computed_tokens"),
    ),
    OpColumns(
        OpKind.APPEND_TOKENS,
        keyed=True,
        columns=("append_num_tokens", "append_num_block_hashes"),
        spans=(
            Span("append_num_tokens", "append_token_ids"),
            Span("append_num_block_hashes", "append_block_hashes"),
        ),
    ),
    OpColumns(OpKind.CACHE_BLOCKS, keyed=True, columns=("cache_num_computed_tokens",)),
    OpColumns(
        OpKind.REMOVE_SKIPPED_BLOCKS,
        keyed=True,
        columns=("remove_skipped_total_computed_tokens",),
    ),
    OpColumns(OpKind.PREEMPT, keyed=True),
    OpColumns(OpKind.FINISH, keyed=True),
    OpColumns(OpKind.NEW_STEP_STARTS, keyed=False),
    OpColumns(
        OpKind.EVICT_BLOCKS,
        keyed=False,
        columns=("evict_num_block_ids",),
        spans=(Span("evict_num_block_ids", "evict_block_ids"),),
    ),
    OpColumns(OpKind.RESET_PREFIX_CACHE, keyed=False),
    OpColumns(OpKind.RECORD_PREFIX_STATS, keyed=True, columns=("record_hit_tokens",)),
)

OP_TABLE: Final[Mapping[int, OpColumns]] = {int(row.kind): row for row in _ROWS}
"""The op table, by op kind value."""

KEYED: Final[Mapping[int, int]] = {kind: int(row.keyed) for kind, row in OP_TABLE.items()}
"""Per op kind value, how many ``request_keys`` entries one op takes (0 or 1)."""

COLUMNS: Final[tuple[str, ...]] = (
    "request_keys",
    *(name for row in _ROWS for name in (*row.columns, *(span.data for span in row.spans))),
)
"""Every column an op consumes, in the order the consumption check names them."""

assert set(OP_TABLE) == {int(kind) for kind in OpKind}, "every op kind has a row"


def op_name(op: int) -> str:
    """The op kind's name (``str(op)`` for a value that is no kind)."""
    row = OP_TABLE.get(op)
    return str(op) if row is None else row.kind.name
