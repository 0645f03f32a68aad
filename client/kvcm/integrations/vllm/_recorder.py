"""Recording a scheduler step's manager mutations as one kvcm Step program.

The mirror answers every KV-cache manager call locally and notes the calls that change the
pool; once per ``schedule()`` (and once per ``update_from_output()`` that changed anything) the
step is closed and handed to a sink as a :class:`RecordedStep`: a
:class:`~kvcm.core.program.StepProgram` with the answers the mirror gave (a
:class:`~kvcm.core.program.StepOutcome`). Sinks are pluggable
(:mod:`kvcm.integrations.vllm._sinks`: the protocol, and local sinks that keep or drop
steps); the gRPC shipper sends them to the kvcm server, which runs the same interpreter on the
authoritative copy and verifies the answers.

Recording is split in two so that it costs the scheduler's thread next to nothing:

* **noting** (the scheduler thread, inside each manager call): one tuple per call, holding
  the call's arguments, the request's counters and the lengths of its token and block-hash
  lists at that moment (vLLM only appends to both), and the mirror's answer as the core
  returned it;
* **building** (whoever first reads ``RecordedStep.program``: the shipping thread, or a
  snapshot at a step boundary): the notes of every step up to that one are turned into
  columnar programs, in step order, under one lock.

Requests are keyed by small ints in order of first appearance; a request's prompt and vLLM's
block hashes go out once (ADD_REQUEST), and later tokens and hashes as deltas (APPEND_TOKENS).
A recorder whose sink is a ``NullSink`` notes nothing (nothing would read it).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from array import array
from typing import TYPE_CHECKING, Any, Final

from kvcm.common.hashing import get_group_id
from kvcm.core.manager import KVCacheBlocks
from kvcm.core.op_table import OpWriter
from kvcm.core.program import (
    AllocOptions,
    HitSpec,
    ItemStatus,
    NewRequestSpec,
    OpKind,
    StepOutcome,
    StepProgram,
)
from kvcm.integrations.vllm._sinks import NullSink

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from kvcm.core.manager import SlotOptions
    from kvcm.integrations.vllm._convert import RequestView
    from kvcm.integrations.vllm._sinks import StepSink

__all__ = ["SYNCED_KINDS", "RecordedStep", "StepRecorder"]

_OK = int(ItemStatus.OK)
_DOES_NOT_FIT = int(ItemStatus.DOES_NOT_FIT)
# A note is ``(op kind, ...)``. ALLOCATE notes and notes of SYNCED_KINDS carry the
# request's view and what it held when noted (the request is brought up to date first); notes
# of the other kinds carry the op's own values.
_ALLOCATE: Final = OpKind.ALLOCATE
SYNCED_KINDS: Final = frozenset(
    {
        OpKind.CACHE_BLOCKS,
        OpKind.REMOVE_SKIPPED_BLOCKS,
        OpKind.RECORD_PREFIX_STATS,
        OpKind.EXTEND_PROMPT,
        OpKind.REPORT_HIT,
    }
)
# The op values the inline writes append (the op table's rows for them: APPEND_TOKENS takes
# a key, a token span and a hash span; ALLOCATE a key and two values).
_APPEND_TOKENS_OP: Final = int(OpKind.APPEND_TOKENS)
_ALLOCATE_OP: Final = int(OpKind.ALLOCATE)
_NEW_STEP_STARTS: Final = OpKind.NEW_STEP_STARTS
_NEW_STEP_STARTS_OP: Final = int(OpKind.NEW_STEP_STARTS)
_HOST_SYNC_OP: Final = int(OpKind.HOST_SYNC)
_NEW_STEP_NOTE: tuple[Any, ...] = (_NEW_STEP_STARTS,)
_RELEASE_COPIES_NOTE: tuple[Any, ...] = (OpKind.RELEASE_BLOCK_COPIES,)
_FINISH: Final = OpKind.FINISH
_FINISH_DEFERRED: Final = OpKind.FINISH_DEFERRED


class RecordedStep:
    """One closed step: the program and what the mirror answered.

    A step closed by a :class:`StepRecorder` is built when ``program`` or ``expected`` is
    first read (in step order, together with every earlier step not built yet); one made
    from a ready program is built already.

    Attributes:
        step_seq: The program's ``step_seq`` (``None`` for a ready program without one).
        closed_at: ``time.monotonic()`` when the step was closed (0.0: unknown).
    """

    __slots__ = (
        "_batched",
        "_expected",
        "_notes",
        "_program",
        "_recorder",
        "closed_at",
        "step_seq",
    )

    def __init__(
        self,
        *,
        program: StepProgram | None = None,
        expected: StepOutcome | None = None,
        closed_at: float = 0.0,
    ) -> None:
        """A built step (``program`` and ``expected`` given), or an empty one to fill."""
        self._program = program
        self._expected = expected
        self._notes: list[tuple[Any, ...]] = []
        self._recorder: StepRecorder | None = None
        self._batched = False  # built into a coalesced program (StepRecorder.build_batch)
        self.step_seq = None if program is None else program.step_seq
        self.closed_at = closed_at

    @property
    def recorder(self) -> StepRecorder | None:
        """The recorder that closed the step (``None``: made from a ready program)."""
        return self._recorder

    @property
    def program(self) -> StepProgram:
        """The ops, in call order.

        Raises:
            RuntimeError: The step was built into a coalesced program (it has none of its
                own).
        """
        if self._program is None:
            self._build()
        assert self._program is not None
        return self._program

    @property
    def expected(self) -> StepOutcome:
        """The mirror's answers (the remote copy must answer the same); raises as
        ``program`` does."""
        if self._expected is None:
            self._build()
        assert self._expected is not None
        return self._expected

    def _build(self) -> None:
        if self._batched:
            raise RuntimeError(
                f"step {self.step_seq} was built into a coalesced program: it has none of its own"
            )
        assert self._recorder is not None
        self._recorder.build_through(self)


class _Tracked:
    # What the programs built so far have told the pool about one request.
    __slots__ = ("key", "num_hashes_sent", "num_tokens_sent")

    def __init__(self, key: int, num_tokens_sent: int, num_hashes_sent: int) -> None:
        self.key = key
        self.num_tokens_sent = num_tokens_sent
        self.num_hashes_sent = num_hashes_sent


class StepRecorder:
    """Notes the mirror's mutating calls and builds one :class:`StepProgram` per step.

    The note methods (``allocate`` ... ``reset_prefix_cache``, ``close_step``) run on the
    scheduler thread; building (``RecordedStep.program``, :meth:`tracked`, :meth:`key_of`)
    may run on any thread.

    Attributes:
        num_steps: Steps closed so far (the next program's ``step_seq`` is this + 1).
    """

    __slots__ = (
        "_hash_block_size",
        "_hash_lookahead",
        "_in_flight_options",
        "_keeps_steps",
        "_lock",
        "_next_key",
        "_no_blocks",
        "_notes",
        "_off",
        "_send_hashes",
        "_sink",
        "_tracked",
        "_unbuilt",
        "_zero_counts",
        "clock",
        "num_steps",
    )

    def __init__(
        self,
        sink: StepSink,
        *,
        num_groups: int,
        hash_block_size: int,
        send_hashes: bool = True,
        clock: Any = None,
        no_blocks: object = None,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        """Record into fresh programs handed to ``sink``.

        Args:
            sink: Where closed steps go.
            num_groups: KV-cache groups of the pool (per-group answer counts).
            hash_block_size: Tokens per block hash (which hashes belong to the prompt).
            send_hashes: Ship block hashes (``False`` for a pool without prefix caching).
            clock: Stamps ``RecordedStep.closed_at`` (``None``: ``time.monotonic``).
            no_blocks: The answer the mirror gives an allocation that fits without a new
                block (its shared empty ``KVCacheBlocks``): recorded without looking inside.
            num_hash_lookahead_tokens: Tokens after each block its hash also covers (EAGLE's
                lookahead hashes): a prompt carries ``(n - this) // hash_block_size`` hashes.
        """
        self._send_hashes = send_hashes
        self._zero_counts = [0] * num_groups
        self._no_blocks = no_blocks if no_blocks is not None else object()
        self._hash_block_size = hash_block_size
        self._hash_lookahead = num_hash_lookahead_tokens
        self.clock = clock if clock is not None else time.monotonic
        self.num_steps = 0
        self._next_key = 1
        self._tracked: dict[str, _Tracked] = {}
        self._notes: list[tuple[Any, ...]] = []
        self._unbuilt: collections.deque[RecordedStep] = collections.deque()
        self._lock = threading.Lock()
        self._in_flight_options: dict[int, AllocOptions] = {}
        self._sink: StepSink = sink
        self._off = isinstance(sink, NullSink)
        self._keeps_steps = not getattr(sink, "builds_elsewhere", False)

    def options(self) -> dict[str, Any]:
        """The keyword arguments that make a recorder build the same programs from the same
        notes (the shipper process builds its own recorder with them)."""
        return {
            "num_groups": len(self._zero_counts),
            "hash_block_size": self._hash_block_size,
            "send_hashes": self._send_hashes,
            "num_hash_lookahead_tokens": self._hash_lookahead,
        }

    @property
    def sink(self) -> StepSink:
        """Where closed steps go (a :class:`NullSink` turns noting off)."""
        return self._sink

    @sink.setter
    def sink(self, sink: StepSink) -> None:
        self._sink = sink
        self._off = isinstance(sink, NullSink)
        # A sink that ``builds_elsewhere`` (the shipper process) takes each step's notes and
        # keeps what the pool was told itself (its ``tracked()``): no step waits here.
        self._keeps_steps = not getattr(sink, "builds_elsewhere", False)

    # ------------------------------------------------------------------ notes (scheduler thread)
    def allocate(
        self,
        view: RequestView,
        num_new_tokens: int,
        hit: HitSpec | None,
        slot_options: SlotOptions | None,
        result: KVCacheBlocks | Sequence[Sequence[int]] | None,
    ) -> None:
        """Note one allocate_slots call and the mirror's answer.

        Args:
            view: The request as the core saw it.
            num_new_tokens: The call's num_new_tokens.
            hit: The adopted prefix hit, if any.
            slot_options: Non-default knobs, if any.
            result: The new blocks (or their ids per group), or ``None`` when they did not fit.
        """
        if self._off:
            return
        if result is not self._no_blocks and isinstance(result, KVCacheBlocks):
            # Kept as ids, not as the answer's objects: the scheduler drops those by the end of
            # its turn, so a turn where every request gets a block (a decode boundary) leaves
            # no three tracked objects per request behind it for the garbage collector until
            # the step is shipped (vLLM's own turn leaves none).
            answer: object = _answer_ids(result)
        else:
            answer = result
        tokens = view.all_token_ids
        hashes = view.block_hashes
        self._notes.append(
            (
                OpKind.ALLOCATE,
                view,
                tokens,
                len(tokens),
                hashes,
                len(hashes),
                num_new_tokens,
                view.num_computed_tokens,
                view.num_in_flight_tokens,
                hit,
                slot_options,
                answer,
            )
        )

    def cache_blocks(self, view: RequestView, num_computed_tokens: int) -> None:
        """Note one cache_blocks call."""
        if not self._off:
            self._note_synced(OpKind.CACHE_BLOCKS, view, num_computed_tokens)

    def remove_skipped_blocks(self, view: RequestView, total_computed_tokens: int) -> None:
        """Note one remove_skipped_blocks call (the request must hold blocks). The request's
        tokens go first: vLLM counts tokens an asynchronous step sampled after the request's
        last allocation (a KV connector's request_finished), which the pool must know of."""
        if not self._off:
            self._note_synced(OpKind.REMOVE_SKIPPED_BLOCKS, view, total_computed_tokens)

    def free(self, request_id: str, *, finished: bool, deferred: bool = False) -> None:
        """Note a free: FINISH forgets the request, PREEMPT keeps its tokens in the pool;
        ``deferred``: FINISH_DEFERRED (vLLM's deferred free, every group in one pool call)."""
        if not self._off:
            kind = OpKind.FINISH if finished else OpKind.PREEMPT
            self._notes.append((OpKind.FINISH_DEFERRED if deferred else kind, request_id))

    def record_prefix_stats(self, view: RequestView, num_hits: int) -> None:
        """Note RECORD_PREFIX_STATS (vLLM counted an admitted request's lookup)."""
        if not self._off:
            self._note_synced(OpKind.RECORD_PREFIX_STATS, view, num_hits)

    def extend_prompt(self, view: RequestView) -> None:
        """Note EXTEND_PROMPT: the request's prompt grew to ``view.num_prompt_tokens`` (a
        streaming-input session's next chunk); its tokens go first."""
        if not self._off:
            self._note_synced(OpKind.EXTEND_PROMPT, view, view.num_prompt_tokens)

    def report_hit(self, view: RequestView, num_blocks: tuple[int, ...]) -> None:
        """Note REPORT_HIT: the mirror's lookup reported the request's hit as stored (vLLM's
        ``kv_cache_report_mode="full"``), ``num_blocks`` per group; its tokens go first. The
        core calls it (``on_hit_reported``) with the request's view."""
        if not self._off:
            self._note_synced(OpKind.REPORT_HIT, view, num_blocks)

    def _note_synced(self, kind: OpKind, view: RequestView, value: object) -> None:
        # A note of SYNCED_KINDS: the request's lists and their lengths now (the request is
        # brought up to date before the op), and the op's one value.
        tokens = view.all_token_ids
        hashes = view.block_hashes
        self._notes.append((kind, view, tokens, len(tokens), hashes, len(hashes), value))

    def new_step_starts(self) -> None:
        """Note NEW_STEP_STARTS."""
        if not self._off:
            self._notes.append(_NEW_STEP_NOTE)

    def take_block_copies(self, copies: Sequence[tuple[int, int]], *, retain: bool = False) -> None:
        """Note TAKE_BLOCK_COPIES: the mirror drained these copies (sub-block hits) and
        dropped their blocks' extra references; ``retain``: TAKE_BLOCK_COPIES_RETAINED, the
        references kept until a RELEASE_BLOCK_COPIES."""
        if not self._off:
            kind = OpKind.TAKE_BLOCK_COPIES_RETAINED if retain else OpKind.TAKE_BLOCK_COPIES
            self._notes.append((kind, tuple(copies)))

    def release_block_copies(self) -> None:
        """Note RELEASE_BLOCK_COPIES (the oldest retained drain's references dropped)."""
        if not self._off:
            self._notes.append(_RELEASE_COPIES_NOTE)

    def host_sync(self, action: int, keys: Sequence[bytes]) -> None:
        """Note HOST_SYNC: one call of the engine's offloading connector into its host tier
        (a :class:`~kvcm.core.host_tier.SyncAction` on the tier's keys)."""
        if not self._off:
            self._notes.append((OpKind.HOST_SYNC, action, tuple(keys)))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Note EVICT_BLOCKS (ids sorted, so the program does not depend on set order)."""
        if not self._off:
            self._notes.append((OpKind.EVICT_BLOCKS, sorted(block_ids)))

    def reset_prefix_cache(self, reset: bool) -> None:
        """Note RESET_PREFIX_CACHE and whether the mirror reset."""
        if not self._off:
            self._notes.append((OpKind.RESET_PREFIX_CACHE, reset))

    @property
    def pending(self) -> bool:
        """Whether calls were noted since the last close."""
        return bool(self._notes)

    def close_step(self) -> RecordedStep | None:
        """Close the current step and submit it; ``None`` (nothing sent) when empty."""
        notes = self._notes
        if not notes:
            return None
        self.num_steps += 1
        step = RecordedStep(closed_at=self.clock())
        step.step_seq = self.num_steps
        step._notes = notes
        step._recorder = self
        self._notes = []
        if self._keeps_steps:
            self._unbuilt.append(step)
        self._sink.submit(step)
        return step

    def extend_notes(self, notes: Iterable[tuple[Any, ...]]) -> None:
        """Add notes made elsewhere (the shipper process rebuilds the engine's notes with
        its own request views); the next :meth:`close_step` closes them as one step."""
        self._notes.extend(notes)

    def restore(
        self, tracked: dict[str, tuple[int, int, int]], *, next_key: int, num_steps: int
    ) -> None:
        """Start from a snapshot's requests: request id -> (key, tokens sent, block hashes
        sent), the next request's key, the steps closed so far. For a fresh recorder (the
        shipper process after a resync); the next step closed is ``num_steps + 1``."""
        with self._lock:
            self._tracked = {
                request_id: _Tracked(key, num_tokens, num_hashes)
                for request_id, (key, num_tokens, num_hashes) in tracked.items()
            }
            self._next_key = next_key
            self.num_steps = num_steps

    # ------------------------------------------------------------------ building (any thread)
    def build_through(self, step: RecordedStep | None = None) -> None:
        """Build every closed step up to ``step`` (``None``: all of them), in order."""
        with self._lock:
            unbuilt = self._unbuilt
            while unbuilt:
                if step is not None and step._program is not None:
                    return
                self._build(unbuilt.popleft())

    def tracked(self) -> dict[str, tuple[int, int, int]]:
        """Requests the pool holds after the last closed step: request id -> (key, tokens
        sent, block hashes sent)."""
        if not self._keeps_steps:
            sink: Any = self._sink
            elsewhere: dict[str, tuple[int, int, int]] = sink.tracked()
            return elsewhere
        self.build_through()
        with self._lock:
            return {
                request_id: (t.key, t.num_tokens_sent, t.num_hashes_sent)
                for request_id, t in self._tracked.items()
            }

    def key_of(self, request_id: str) -> int | None:
        """The key the programs use for a live request (after the last closed step)."""
        if not self._keeps_steps:
            found = self.tracked().get(request_id)
            return None if found is None else found[0]
        self.build_through()
        tracked = self._tracked.get(request_id)
        return None if tracked is None else tracked.key

    def build_batch(
        self, steps: Sequence[RecordedStep], *, max_ops: int, max_tokens: int
    ) -> tuple[int, StepProgram, StepOutcome] | None:
        """Build the first of ``steps`` and the ones after it into one coalesced program.

        What :func:`~kvcm.integrations.vllm._shipper.coalesce` makes of the steps' own
        programs, without making them: the steps' notes are written one after the other into
        one program (``num_steps`` of them, the last one's ``step_seq``) and one outcome. The
        steps taken are consecutive and not built yet; after the first, a step is taken only
        while the program stays within ``max_ops`` ops and ``max_tokens`` token ids (counted
        from the notes before writing). A step built this way has no program of its own.

        Returns:
            ``(number of steps taken, program, expected)``, or ``None`` when the first step
            is built already or is not this recorder's next one to build.
        """
        with self._lock:
            unbuilt = self._unbuilt
            if not steps or not unbuilt or unbuilt[0] is not steps[0]:
                return None
            taken: list[RecordedStep] = []
            num_ops = num_tokens = 0
            sent: dict[str, int] = {}  # tokens the program will have sent, per request
            tracked_by_id = self._tracked
            # A copy of the front (one C call: the scheduler thread may append meanwhile).
            front = list(itertools.islice(unbuilt, len(steps)))
            for step, queued in zip(steps, front, strict=False):
                if step is not queued:
                    break
                # At most three ops per note (ADD_REQUEST, APPEND_TOKENS and its own), and
                # the token ids the request grew by since the tokens already counted.
                step_ops = 3 * len(step._notes)
                step_tokens = 0
                for note in step._notes:
                    if note[0] is _FINISH or note[0] is _FINISH_DEFERRED:  # the id may return
                        sent[note[1]] = 0
                    elif note[0] is _ALLOCATE or note[0] in SYNCED_KINDS:
                        request_id = note[1].request_id
                        before = sent.get(request_id)
                        if before is None:
                            known = tracked_by_id.get(request_id)
                            before = 0 if known is None else known.num_tokens_sent
                        if note[3] > before:
                            step_tokens += note[3] - before
                            sent[request_id] = note[3]
                if taken and (
                    num_ops + step_ops > max_ops or num_tokens + step_tokens > max_tokens
                ):
                    break
                num_ops += step_ops
                num_tokens += step_tokens
                taken.append(step)
            for _ in taken:
                unbuilt.popleft()
            program = StepProgram(continue_on_does_not_fit=True)
            expected = StepOutcome()
            self._write([step._notes for step in taken], program, expected)
            for step in taken:
                step._notes = []
                step._batched = True
            last = taken[-1].step_seq
            program.step_seq = last
            program.num_steps = len(taken)
            expected.num_ops_executed = len(program.ops)
            expected.step_seq = last
            return len(taken), program, expected

    def _build(self, step: RecordedStep) -> None:
        program = StepProgram(continue_on_does_not_fit=True)
        expected = StepOutcome()
        self._write((step._notes,), program, expected)
        program.step_seq = step.step_seq
        expected.num_ops_executed = len(program.ops)
        expected.step_seq = step.step_seq
        step._expected = expected
        step._program = program
        step._notes = []

    def _write(
        self,
        notes_per_step: Iterable[list[tuple[Any, ...]]],
        program: StepProgram,
        expected: StepOutcome,
    ) -> None:
        # Every op's columns are the op table's (OpWriter). The ops of a decode step (an
        # ALLOCATE of a request the pool knows, its APPEND_TOKENS before it, an in-flight
        # count and an empty answer, and the step's NEW_STEP_STARTS) are written inline,
        # straight into the columns; the rest go through the writer (a note gives the kind
        # and its row's values, for the synced kinds after the request's key).
        writer = OpWriter(program)
        write = writer.op
        ops, keys = program.ops.append, program.request_keys.append
        allocated = program.alloc_num_new_tokens
        alloc_new, alloc_computed = allocated.append, program.alloc_num_computed_tokens.append
        append_counts = program.append_num_tokens.append
        append_tokens = program.append_token_ids.extend
        append_hash_counts = program.append_num_block_hashes.append
        append_hashes = writer.pending
        options_at = program.alloc_options
        in_flight_options = self._in_flight_options
        statuses = expected.alloc_statuses.append
        block_counts = expected.alloc_num_block_ids
        no_blocks = self._no_blocks
        send_hashes = self._send_hashes
        tracked_by_id = self._tracked
        host_hashes: list[bytes] = []
        for note in itertools.chain.from_iterable(notes_per_step):
            kind = note[0]
            if kind is _ALLOCATE:
                (
                    _,
                    view,
                    tokens,
                    num_tokens,
                    hashes,
                    num_hashes,
                    num_new,
                    num_computed,
                    in_flight,
                    hit,
                    slot_options,
                    result,
                ) = note
                tracked = tracked_by_id.get(view.request_id)
                if tracked is None:
                    tracked = self._add_request(write, note)
                if not send_hashes:  # a pool without prefix caching takes no block hashes
                    num_hashes = 0
                # APPEND_TOKENS of whatever grew since (the lengths are the ones the call saw).
                sent_tokens = tracked.num_tokens_sent
                sent_hashes = tracked.num_hashes_sent
                key = tracked.key
                if num_tokens != sent_tokens or num_hashes != sent_hashes:
                    ops(_APPEND_TOKENS_OP)
                    keys(key)
                    append_counts(num_tokens - sent_tokens)
                    append_tokens(tokens[sent_tokens:num_tokens])
                    append_hash_counts(num_hashes - sent_hashes)
                    if num_hashes != sent_hashes:
                        append_hashes(hashes[sent_hashes:num_hashes])
                    tracked.num_tokens_sent = num_tokens
                    tracked.num_hashes_sent = num_hashes
                index = len(allocated)
                ops(_ALLOCATE_OP)
                keys(key)
                alloc_new(num_new)
                alloc_computed(num_computed)
                if hit is None and slot_options is None:
                    if in_flight:
                        # Every decode step of vLLM's async loop: one shared value per count.
                        options = in_flight_options.get(in_flight)
                        if options is None:
                            options = in_flight_options[in_flight] = AllocOptions(
                                num_in_flight_tokens=in_flight
                            )
                        options_at[index] = options
                elif slot_options is None:
                    options_at[index] = AllocOptions(hit=hit, num_in_flight_tokens=in_flight)
                else:
                    options_at[index] = AllocOptions(
                        hit=hit, slot_options=slot_options, num_in_flight_tokens=in_flight
                    )
                if result is no_blocks:  # a decode step's allocation is mostly empty
                    statuses(_OK)
                    block_counts += self._zero_counts
                else:
                    self._add_answer(expected, result)
            elif kind is _NEW_STEP_STARTS:  # one per step: no key, no column
                ops(_NEW_STEP_STARTS_OP)
            elif kind in SYNCED_KINDS:  # one value after the request's key
                write[kind](self._sync_request(write, note), note[6])
            elif kind is _FINISH or kind is OpKind.PREEMPT or kind is _FINISH_DEFERRED:
                # FINISH(_DEFERRED) forgets the request; PREEMPT keeps its tokens in the pool.
                found = (
                    tracked_by_id.get(note[1])
                    if kind is OpKind.PREEMPT
                    else tracked_by_id.pop(note[1], None)
                )
                if found is not None:  # else never shown to the pool: nothing to free there
                    write[kind](found.key)
            elif kind is OpKind.RESET_PREFIX_CACHE:
                write[kind]()
                expected.reset.append(note[1])
            elif kind is OpKind.TAKE_BLOCK_COPIES or kind is OpKind.TAKE_BLOCK_COPIES_RETAINED:
                write[kind]()
                expected.drained_num_copies.append(len(note[1]))
                for pair in note[1]:
                    expected.drained_copy_block_ids.extend(pair)
            elif kind is OpKind.HOST_SYNC:  # its two spans share a count: written here
                _, action, host_keys = note
                ops(_HOST_SYNC_OP)
                program.host_sync_actions.append(action)
                program.host_sync_num_keys.append(len(host_keys))
                program.host_sync_group_ids.extend([get_group_id(k) for k in host_keys])
                host_hashes.extend([k[:-4] for k in host_keys])
            else:  # EVICT_BLOCKS: the note holds the op's values
                write[kind](*note[1:])
        writer.flush()
        if host_hashes:
            program.host_sync_keys += b"".join(host_hashes)

    def _add_request(
        self, write: dict[int, Callable[..., None]], note: tuple[Any, ...]
    ) -> _Tracked:
        # ADD_REQUEST on first sight: the prompt and its hashes (the call saw at least those).
        # The prompt as the view first saw it: a streaming session's later chunks each have
        # their EXTEND_PROMPT note, after this one (the view's own end may have moved since).
        view, tokens, hashes, num_hashes = note[1], note[2], note[4], note[5]
        if not self._send_hashes:
            hashes = ()
            num_hashes = 0
        key = self._next_key
        self._next_key += 1
        num_prompt = view.num_first_prompt_tokens
        num_prompt_hashes = min(
            num_hashes, max(num_prompt - self._hash_lookahead, 0) // self._hash_block_size
        )
        write[OpKind.ADD_REQUEST](
            NewRequestSpec(
                key=key,
                request_id=view.request_id,
                prompt_token_ids=list(tokens[:num_prompt]),
                block_hashes=b"".join(hashes[:num_prompt_hashes]),
                lora_id=view.lora_id,
                lora_name=view.lora_name,
                cache_salt=view.cache_salt,
                skip_reading_prefix_cache=view.skip_reading_prefix_cache,
                report_cached_blocks=view.report_cached_blocks,
            )
        )
        tracked = _Tracked(key, num_prompt, num_prompt_hashes)
        self._tracked[view.request_id] = tracked
        return tracked

    def _sync_request(self, write: dict[int, Callable[..., None]], note: tuple[Any, ...]) -> int:
        # ADD_REQUEST on first sight, then APPEND_TOKENS for whatever grew since; the lengths
        # are the ones the call saw (the lists may have grown since).
        _, view, tokens, num_tokens, hashes, num_hashes = note[:6]
        if not self._send_hashes:  # a pool without prefix caching takes no block hashes
            hashes = ()
            num_hashes = 0
        tracked = self._tracked.get(view.request_id)
        if tracked is None:
            tracked = self._add_request(write, note)
        sent_tokens = tracked.num_tokens_sent
        sent_hashes = tracked.num_hashes_sent
        if num_tokens != sent_tokens or num_hashes != sent_hashes:
            write[OpKind.APPEND_TOKENS](
                tracked.key, tokens[sent_tokens:num_tokens], hashes[sent_hashes:num_hashes]
            )
            tracked.num_tokens_sent = num_tokens
            tracked.num_hashes_sent = num_hashes
        return tracked.key

    def _add_answer(
        self,
        expected: StepOutcome,
        result: array[int] | Sequence[Sequence[int]] | None,
    ) -> None:
        # An ALLOCATE's answer other than "fits, no new block".
        if result is None:
            expected.alloc_statuses.append(_DOES_NOT_FIT)
            expected.alloc_num_block_ids += self._zero_counts
            return
        expected.alloc_statuses.append(_OK)
        if isinstance(result, array):  # _answer_ids: groups, the counts per group, the ids
            num_groups = result[0]
            expected.alloc_num_block_ids.extend(result[1 : 1 + num_groups])
            expected.alloc_block_ids.extend(result[1 + num_groups :])
            return
        for ids in result:
            expected.alloc_num_block_ids.append(len(ids))
            expected.alloc_block_ids.extend(ids)


def _answer_ids(result: KVCacheBlocks) -> array[int]:
    """An allocation's answer as one untracked array: the number of groups, the number of new
    blocks per group, then their ids in group order."""
    groups = result.blocks
    if len(groups) == 1 and len(groups[0]) == 1:
        # A decode boundary's answer in a one-group pool: one block (a third of the cost).
        return array("q", (1, 1, groups[0][0].block_id))
    ids = array("q", [len(groups)])
    ids.extend([len(blocks) for blocks in groups])
    for blocks in groups:
        ids.extend([block.block_id for block in blocks])
    return ids


def answer_groups(ids: array[int]) -> tuple[tuple[int, ...], ...]:
    """The new block ids per group of an answer kept by :func:`_answer_ids`."""
    num_groups = ids[0]
    groups = []
    start = 1 + num_groups
    for count in ids[1 : 1 + num_groups]:
        groups.append(tuple(ids[start : start + count]))
        start += count
    return tuple(groups)
