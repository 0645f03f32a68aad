"""Recording a scheduler step's manager mutations as one kvcm Step program.

The mirror answers every KV-cache manager call locally and appends the calls that change the
pool to a :class:`~kvcm.core.program.StepProgram`; once per ``schedule()`` (and once per
``update_from_output()`` that changed anything) the program is closed and handed, with the
answers the mirror gave (a :class:`~kvcm.core.program.StepOutcome`), to a :class:`StepSink`.
Sinks are pluggable: the local ones here keep or drop programs; the gRPC shipper (next stage)
sends them to the kvcm server, which runs the same interpreter on the authoritative copy and
verifies the answers.

Requests are keyed by small ints in order of first appearance; a request's prompt and vLLM's
block hashes go out once (ADD_REQUEST), and later tokens and hashes as deltas (APPEND_TOKENS).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvcm.core.program import (
    AllocOptions,
    HitSpec,
    ItemStatus,
    NewRequestSpec,
    OpKind,
    StepOutcome,
    StepProgram,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from kvcm.core.manager import SlotOptions
    from kvcm.integrations.vllm._convert import RequestView

__all__ = [
    "CollectingSink",
    "NullSink",
    "RecordedStep",
    "StepRecorder",
    "StepSink",
]

_ADD_REQUEST = int(OpKind.ADD_REQUEST)
_APPEND_TOKENS = int(OpKind.APPEND_TOKENS)
_ALLOCATE = int(OpKind.ALLOCATE)
_CACHE_BLOCKS = int(OpKind.CACHE_BLOCKS)
_REMOVE_SKIPPED = int(OpKind.REMOVE_SKIPPED_BLOCKS)
_PREEMPT = int(OpKind.PREEMPT)
_FINISH = int(OpKind.FINISH)
_NEW_STEP_STARTS = int(OpKind.NEW_STEP_STARTS)
_EVICT_BLOCKS = int(OpKind.EVICT_BLOCKS)
_RESET_PREFIX_CACHE = int(OpKind.RESET_PREFIX_CACHE)
_RECORD_PREFIX_STATS = int(OpKind.RECORD_PREFIX_STATS)
_OK = int(ItemStatus.OK)
_DOES_NOT_FIT = int(ItemStatus.DOES_NOT_FIT)


@dataclass(slots=True, kw_only=True)
class RecordedStep:
    """One closed step: the program and what the mirror answered.

    Attributes:
        program: The ops, in call order.
        expected: The mirror's answers (the remote copy must answer the same).
    """

    program: StepProgram
    expected: StepOutcome


class StepSink(Protocol):
    """Where closed steps go (a local sink, or the gRPC shipper of the next stage)."""

    def submit(self, step: RecordedStep) -> None:
        """Take one closed step; must not block the scheduler for long (ship asynchronously)."""

    def close(self) -> None:
        """Flush and release resources (the scheduler's ``shutdown()``)."""


class NullSink:
    """Drops every step (mirror mode without a server: the local copy is the only one)."""

    def submit(self, step: RecordedStep) -> None:
        """Drop ``step``."""
        del step

    def close(self) -> None:
        """Nothing to release."""


@dataclass(slots=True)
class CollectingSink:
    """Keeps every step in memory (tests and debugging).

    Attributes:
        steps: The steps, in submission order.
        closed: Whether ``close`` was called.
    """

    steps: list[RecordedStep] = field(default_factory=list)
    closed: bool = False

    def submit(self, step: RecordedStep) -> None:
        """Keep ``step``."""
        self.steps.append(step)

    def close(self) -> None:
        """Mark the sink closed."""
        self.closed = True


class _Tracked:
    # What the program has told the pool about one request so far.
    __slots__ = ("key", "num_hashes_sent", "num_tokens_sent")

    def __init__(self, key: int, num_tokens_sent: int, num_hashes_sent: int) -> None:
        self.key = key
        self.num_tokens_sent = num_tokens_sent
        self.num_hashes_sent = num_hashes_sent


class StepRecorder:
    """Builds one :class:`StepProgram` per step from the mirror's mutating calls.

    Attributes:
        sink: Where closed steps go.
        num_steps: Steps closed so far (the next program's ``step_seq`` is this + 1).
    """

    __slots__ = (
        "_expected",
        "_hash_block_size",
        "_next_key",
        "_num_groups",
        "_program",
        "_send_hashes",
        "_tracked",
        "num_steps",
        "sink",
    )

    def __init__(
        self,
        sink: StepSink,
        *,
        num_groups: int,
        hash_block_size: int,
        send_hashes: bool = True,
    ) -> None:
        """Record into fresh programs handed to ``sink``.

        Args:
            sink: Where closed steps go.
            num_groups: KV-cache groups of the pool (per-group answer counts).
            hash_block_size: Tokens per block hash (which hashes belong to the prompt).
            send_hashes: Ship block hashes (``False`` for a pool without prefix caching).
        """
        self._send_hashes = send_hashes
        self.sink = sink
        self._num_groups = num_groups
        self._hash_block_size = hash_block_size
        self.num_steps = 0
        self._next_key = 1
        self._tracked: dict[str, _Tracked] = {}
        self._program = StepProgram(continue_on_does_not_fit=True)
        self._expected = StepOutcome()

    # ------------------------------------------------------------------ requests
    def _sync_request(self, view: RequestView) -> int:
        # ADD_REQUEST on first sight, then APPEND_TOKENS for whatever grew since.
        tracked = self._tracked.get(view.request_id)
        program = self._program
        tokens = view.all_token_ids
        # A pool without prefix caching takes no block hashes (the interpreter refuses them).
        hashes = view.block_hashes if self._send_hashes else ()
        if tracked is None:
            key = self._next_key
            self._next_key += 1
            num_prompt = view.num_prompt_tokens
            num_prompt_hashes = min(len(hashes), num_prompt // self._hash_block_size)
            program.ops.append(_ADD_REQUEST)
            program.new_requests.append(
                NewRequestSpec(
                    key=key,
                    request_id=view.request_id,
                    prompt_token_ids=list(tokens[:num_prompt]),
                    block_hashes=b"".join(hashes[:num_prompt_hashes]),
                    lora_id=view.lora_id,
                    lora_name=view.lora_name,
                    cache_salt=view.cache_salt,
                    skip_reading_prefix_cache=view.skip_reading_prefix_cache,
                )
            )
            tracked = _Tracked(key, num_prompt, num_prompt_hashes)
            self._tracked[view.request_id] = tracked
        num_tokens = len(tokens)
        num_hashes = len(hashes)
        if num_tokens != tracked.num_tokens_sent or num_hashes != tracked.num_hashes_sent:
            new_tokens = tokens[tracked.num_tokens_sent :]
            new_hashes = hashes[tracked.num_hashes_sent :]
            program.ops.append(_APPEND_TOKENS)
            program.request_keys.append(tracked.key)
            program.append_num_tokens.append(len(new_tokens))
            program.append_token_ids.extend(new_tokens)
            program.append_num_block_hashes.append(len(new_hashes))
            program.append_block_hashes += b"".join(new_hashes)
            tracked.num_tokens_sent = num_tokens
            tracked.num_hashes_sent = num_hashes
        return tracked.key

    # ------------------------------------------------------------------ ops
    def allocate(
        self,
        view: RequestView,
        num_new_tokens: int,
        hit: HitSpec | None,
        slot_options: SlotOptions | None,
        result: Sequence[Sequence[int]] | None,
    ) -> None:
        """Record one allocate_slots call and the mirror's answer.

        Args:
            view: The request as the core saw it.
            num_new_tokens: The call's num_new_tokens.
            hit: The adopted prefix hit, if any.
            slot_options: Non-default knobs, if any.
            result: New block ids per group, or ``None`` when it did not fit.
        """
        key = self._sync_request(view)
        program = self._program
        index = len(program.alloc_num_new_tokens)
        program.ops.append(_ALLOCATE)
        program.request_keys.append(key)
        program.alloc_num_new_tokens.append(num_new_tokens)
        program.alloc_num_computed_tokens.append(view.num_computed_tokens)
        if hit is not None or slot_options is not None or view.num_in_flight_tokens:
            options = AllocOptions(hit=hit, num_in_flight_tokens=view.num_in_flight_tokens)
            if slot_options is not None:
                options = AllocOptions(
                    hit=hit,
                    slot_options=slot_options,
                    num_in_flight_tokens=view.num_in_flight_tokens,
                )
            program.alloc_options[index] = options
        expected = self._expected
        if result is None:
            expected.alloc_statuses.append(_DOES_NOT_FIT)
            expected.alloc_num_block_ids.extend([0] * self._num_groups)
            return
        expected.alloc_statuses.append(_OK)
        for group in result:
            expected.alloc_num_block_ids.append(len(group))
            expected.alloc_block_ids.extend(group)

    def cache_blocks(self, view: RequestView, num_computed_tokens: int) -> None:
        """Record one cache_blocks call."""
        key = self._sync_request(view)
        self._program.ops.append(_CACHE_BLOCKS)
        self._program.request_keys.append(key)
        self._program.cache_num_computed_tokens.append(num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Record one remove_skipped_blocks call (the request must be known)."""
        tracked = self._tracked[request_id]
        self._program.ops.append(_REMOVE_SKIPPED)
        self._program.request_keys.append(tracked.key)
        self._program.remove_skipped_total_computed_tokens.append(total_computed_tokens)

    def free(self, request_id: str, *, finished: bool) -> None:
        """Record a free: FINISH forgets the request, PREEMPT keeps its tokens in the pool."""
        if finished:
            tracked = self._tracked.pop(request_id, None)
            op = _FINISH
        else:
            tracked = self._tracked.get(request_id)
            op = _PREEMPT
        if tracked is None:
            return  # never shown to the pool: nothing to free there
        self._program.ops.append(op)
        self._program.request_keys.append(tracked.key)

    def record_prefix_stats(self, view: RequestView, num_hits: int) -> None:
        """Record RECORD_PREFIX_STATS (vLLM counted an admitted request's lookup)."""
        key = self._sync_request(view)
        self._program.ops.append(_RECORD_PREFIX_STATS)
        self._program.request_keys.append(key)
        self._program.record_hit_tokens.append(num_hits)

    def new_step_starts(self) -> None:
        """Record NEW_STEP_STARTS."""
        self._program.ops.append(_NEW_STEP_STARTS)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Record EVICT_BLOCKS (ids sorted, so the program does not depend on set order)."""
        ids = sorted(block_ids)
        self._program.ops.append(_EVICT_BLOCKS)
        self._program.evict_num_block_ids.append(len(ids))
        self._program.evict_block_ids.extend(ids)

    def reset_prefix_cache(self, reset: bool) -> None:
        """Record RESET_PREFIX_CACHE and whether the mirror reset."""
        self._program.ops.append(_RESET_PREFIX_CACHE)
        self._expected.reset.append(reset)

    # ------------------------------------------------------------------ steps
    @property
    def pending(self) -> bool:
        """Whether ops were recorded since the last close."""
        return bool(self._program.ops)

    def close_step(self) -> RecordedStep | None:
        """Close the current program and submit it; ``None`` (nothing sent) when empty."""
        program = self._program
        if not program.ops:
            return None
        self.num_steps += 1
        program.step_seq = self.num_steps
        expected = self._expected
        expected.num_ops_executed = len(program.ops)
        expected.step_seq = self.num_steps
        step = RecordedStep(program=program, expected=expected)
        self._program = StepProgram(continue_on_does_not_fit=True)
        self._expected = StepOutcome()
        self.sink.submit(step)
        return step

    def tracked(self) -> dict[str, tuple[int, int, int]]:
        """Requests the pool holds: request id -> (key, tokens sent, block hashes sent)."""
        return {
            request_id: (t.key, t.num_tokens_sent, t.num_hashes_sent)
            for request_id, t in self._tracked.items()
        }

    def key_of(self, request_id: str) -> int | None:
        """The key the programs use for a live request, or ``None``."""
        tracked = self._tracked.get(request_id)
        return None if tracked is None else tracked.key
