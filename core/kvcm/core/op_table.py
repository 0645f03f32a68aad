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

:class:`OpWriter` writes ops into a program the same way: ``writer.op(kind, key, *values)``
with one value per per-op column in the row's order (for a span's count column, the span's
entries: the writer counts them). The SDK's ``StepBuilder`` and the vLLM integration's
``StepRecorder`` build their programs through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvcm.core.program import OpKind, StepProgram

__all__ = [
    "COLUMNS",
    "KEYED",
    "OP_TABLE",
    "OpColumns",
    "OpWriter",
    "Span",
    "op_name",
]


@dataclass(frozen=True, slots=True)
class Span:
    """A run of entries in ``data`` whose length is the op's entry in ``count``.

    Attributes:
        count: The per-op column holding the run's length.
        data: The column holding the runs, one after the other.
        hashes: ``data`` is bytes and its entries are block hashes of the pool's length.
    """

    count: str
    data: str
    hashes: bool = False


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
            Span("append_num_block_hashes", "append_block_hashes", hashes=True),
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


_Put = Callable[[Any], object]


class OpWriter:
    """Appends ops to a program's columns as the op table says (see the module docstring).

    ``writer.op(kind)`` is the kind's writer, made once per writer: called with the request key
    (keyed kinds only) and one value per per-op column, in the row's order (for a span's count
    column, the span's entries: the writer counts them). Hashes written to a bytes column are
    kept aside and joined once by :meth:`flush`.
    """

    __slots__ = ("_pending", "_writers", "program")

    def __init__(self, program: StepProgram) -> None:
        """Write into ``program`` (its columns keep what they hold)."""
        self.program = program
        self._pending: list[bytes] = []
        self._writers: dict[int, Callable[..., None]] = {}

    def op(self, kind: int) -> Callable[..., None]:
        """The writer of ``kind``'s ops (``KeyError``: no such kind)."""
        writer = self._writers.get(kind)
        if writer is None:
            writer = self._writers[kind] = self._make(OP_TABLE[kind])
        return writer

    def columns(self, kind: int) -> tuple[list[Any], ...]:
        """``kind``'s per-op columns, in the row's order (to extend them in bulk)."""
        return tuple(getattr(self.program, name) for name in OP_TABLE[kind].columns)

    def count(self, kind: int) -> int:
        """The ops of ``kind`` written so far (kinds with per-op columns)."""
        return len(getattr(self.program, OP_TABLE[kind].columns[0]))

    def flush(self) -> StepProgram:
        """Join the hashes kept aside into the program; returns it."""
        if self._pending:
            self.program.append_block_hashes += b"".join(self._pending)
            self._pending.clear()
        return self.program

    def pending(self, hashes: Sequence[bytes]) -> None:
        """Keep hashes aside for the bytes column (written in bulk with :meth:`columns`)."""
        self._pending.extend(hashes)

    def _put(self, row: OpColumns, column: str) -> _Put:
        counts = getattr(self.program, column)
        span = next((span for span in row.spans if span.count == column), None)
        if span is None:
            return counts.append  # type: ignore[no-any-return]
        gather = self._pending.extend if span.hashes else getattr(self.program, span.data).extend

        def put(entries: Sequence[Any]) -> None:
            counts.append(len(entries))
            gather(entries)

        return put

    def _make(self, row: OpColumns) -> Callable[..., None]:
        kind, ops = int(row.kind), self.program.ops.append
        puts = [self._put(row, column) for column in row.columns]
        key = self.program.request_keys.append if row.keyed else None
        if key is None and not puts:
            return lambda: ops(kind)
        if key is None:
            (put,) = puts

            def unkeyed(a: object) -> None:
                ops(kind)
                put(a)

            return unkeyed
        if not puts:

            def keyed(k: int) -> None:
                ops(kind)
                key(k)

            return keyed
        if len(puts) == 1:
            (put,) = puts

            def keyed1(k: int, a: object) -> None:
                ops(kind)
                key(k)
                put(a)

            return keyed1
        first, second = puts

        def keyed2(k: int, a: object, b: object) -> None:
            ops(kind)
            key(k)
            first(a)
            second(b)

        return keyed2


assert all(len(row.columns) <= (2 if row.keyed else 1) for row in _ROWS), "OpWriter's shapes"
