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
    FORK                   yes    fork_child_keys,                   -
                                  fork_num_computed_tokens
    TAKE_BLOCK_COPIES      -      -                                  -
    SWAP_OUT               yes    swap_out_num_computed_tokens       -
    SWAP_IN                yes    swap_in_num_new_tokens             -
    TAKE_HOST_COPIES       -      -                                  -
    ADMIT_WITH_HOST        yes    admit_host_num_new_tokens          -
    FINISH_DEFERRED        yes    -                                  -
    TAKE_BLOCK_COPIES_RETAINED,
    RELEASE_BLOCK_COPIES   -      -                                  -
    HOST_SYNC              -      host_sync_actions,                 host_sync_num_keys ->
                                  host_sync_num_keys                 host_sync_keys (hashes),
                                                                     host_sync_group_ids
    COMMON_BLOCKS          -      common_num_keys                    common_num_keys ->
                                                                     common_keys
    EXTEND_PROMPT          yes    extend_prompt_num_tokens           -
    REPORT_HIT             yes    report_hit_num_groups              report_hit_num_groups ->
                                                                     report_hit_num_blocks

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
    OpColumns(OpKind.FORK, keyed=True, columns=("fork_child_keys", "fork_num_computed_tokens")),
    OpColumns(OpKind.TAKE_BLOCK_COPIES, keyed=False),
    OpColumns(OpKind.SWAP_OUT, keyed=True, columns=("swap_out_num_computed_tokens",)),
    OpColumns(OpKind.SWAP_IN, keyed=True, columns=("swap_in_num_new_tokens",)),
    OpColumns(OpKind.TAKE_HOST_COPIES, keyed=False),
    OpColumns(OpKind.ADMIT_WITH_HOST, keyed=True, columns=("admit_host_num_new_tokens",)),
    OpColumns(OpKind.FINISH_DEFERRED, keyed=True),
    OpColumns(OpKind.TAKE_BLOCK_COPIES_RETAINED, keyed=False),
    OpColumns(OpKind.RELEASE_BLOCK_COPIES, keyed=False),
    # Written by the vLLM integration's recorder itself (two spans share one count column,
    # and the hashes go to host_sync_keys): not through OpWriter.
    OpColumns(
        OpKind.HOST_SYNC,
        keyed=False,
        columns=("host_sync_actions", "host_sync_num_keys"),
        spans=(
            Span("host_sync_num_keys", "host_sync_keys", hashes=True),
            Span("host_sync_num_keys", "host_sync_group_ids"),
        ),
    ),
    OpColumns(
        OpKind.COMMON_BLOCKS,
        keyed=False,
        columns=("common_num_keys",),
        spans=(Span("common_num_keys", "common_keys"),),
    ),
    OpColumns(OpKind.EXTEND_PROMPT, keyed=True, columns=("extend_prompt_num_tokens",)),
    OpColumns(
        OpKind.REPORT_HIT,
        keyed=True,
        columns=("report_hit_num_groups",),
        spans=(Span("report_hit_num_groups", "report_hit_num_blocks"),),
    ),
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


class _Writers(dict[int, Callable[..., None]]):
    """Per op kind, its writer, made on first use.

    It holds the program and the hashes kept aside, not the :class:`OpWriter`: a writer that
    referred back to its owner would make a reference cycle, which only the garbage collector
    frees, holding the whole program (a coalesced Step's columns) until it runs; the mirror
    builds a program every few engine turns, and the collections that cycle set off ran in
    the engine's turns, each walking the dead programs' columns.
    """

    __slots__ = ("_pending", "_program")

    def __init__(self, program: StepProgram, pending: list[bytes]) -> None:
        super().__init__()
        self._program = program
        self._pending = pending

    def __missing__(self, kind: int) -> Callable[..., None]:
        writer = self[kind] = _make_writer(self._program, self._pending, OP_TABLE[kind])
        return writer


class OpWriter:
    """Appends ops to a program's columns as the op table says (see the module docstring).

    ``writer.op[kind]`` is the kind's writer, made on first use: called with the request key
    (keyed kinds only) and one value per per-op column, in the row's order (for a span's count
    column, the span's entries: the writer counts them). Hashes written to a bytes column are
    kept aside and joined once by :meth:`flush`.

    Attributes:
        program: The program written to.
        op: Per op kind, its writer (``KeyError``: no such kind).
    """

    __slots__ = ("_pending", "op", "program")

    def __init__(self, program: StepProgram) -> None:
        """Write into ``program`` (its columns keep what they hold)."""
        self.program = program
        self._pending: list[bytes] = []
        self.op: dict[int, Callable[..., None]] = _Writers(program, self._pending)

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


def _make_writer(program: StepProgram, pending: list[bytes], row: OpColumns) -> Callable[..., None]:
    # One closure per kind, its appends spelled out for the shapes the table has (a writer
    # is called once per op, on the builders' hot paths); other shapes take the loop.
    kind = int(row.kind)
    ops, keys = program.ops.append, program.request_keys.append
    columns: list[tuple[_Put, _Put | None]] = []
    for column in row.columns:
        if sum(span.count == column for span in row.spans) > 1:
            raise TypeError(f"{row.kind.name} ops are not written through OpWriter")
        span = next((span for span in row.spans if span.count == column), None)
        gather = None
        if span is not None:
            gather = pending.extend if span.hashes else getattr(program, span.data).extend
        columns.append((getattr(program, column).append, gather))
    shape = (row.keyed, *(gather is not None for _, gather in columns))
    if shape == (True, False, False):
        (first, _), (second, _) = columns

        def keyed_values(k: int, a: object, b: object) -> None:
            ops(kind)
            keys(k)
            first(a)
            second(b)

        return keyed_values
    if shape == (True, True, True):
        (count1, data1), (count2, data2) = columns
        assert data1 is not None
        assert data2 is not None

        def keyed_spans(k: int, a: Sequence[Any], b: Sequence[Any]) -> None:
            ops(kind)
            keys(k)
            count1(len(a))
            data1(a)
            count2(len(b))
            data2(b)

        return keyed_spans
    if shape == (True, False):
        ((only, _),) = columns

        def keyed_value(k: int, a: object) -> None:
            ops(kind)
            keys(k)
            only(a)

        return keyed_value
    return _any_shape(program, kind, row.keyed, columns)


def _any_shape(
    program: StepProgram, kind: int, keyed: bool, columns: list[tuple[_Put, _Put | None]]
) -> Callable[..., None]:
    ops, keys = program.ops.append, program.request_keys.append

    def write(*args: Any) -> None:
        values = args[1:] if keyed else args
        if len(values) != len(columns):
            raise TypeError(f"op kind {kind} takes {len(columns)} column values")
        ops(kind)
        if keyed:
            keys(args[0])
        for (put, gather), value in zip(columns, values, strict=True):
            if gather is None:
                put(value)
            else:
                put(len(value))
                gather(value)

    return write
