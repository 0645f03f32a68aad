"""Step programs: one scheduler step's mutations of a pool, as plain Python values.

A :class:`StepProgram` is what a scheduler sends once per step (the SDK's ``StepBuilder`` and
the vLLM mirror build one; ``kvcm.wire`` turns it into a ``kvcm.v1.StepRequest`` and back), what
:meth:`kvcm.core.pool.Pool.run_step` interprets, and what the journal records. It is columnar,
exactly like the wire message, so that decoding is a list copy and a decode step of hundreds of
requests costs a few lists rather than hundreds of objects. Which columns each op kind
consumes, front to back, is the op table's to say (:mod:`kvcm.core.op_table`: a row per
kind, from which the interpreter, the consumption check, the codec, the SDK's builder and
the vLLM integration's recorder derive what they walk or fill).

Every column is consumed exactly. The interpreter's contract (:mod:`kvcm.core.step` has the
full rules; docs/api.md the atomicity guarantee):

* a program is validated whole against the pool before anything runs; a rejected program
  raises one :class:`~kvcm.common.errors.KVCMError` subclass whose ``field`` names the column
  entry at fault and ``op_index`` the op, and leaves the pool identical;
* "does not fit" and "no token budget" are values (:class:`ItemStatus`), and by default the
  program stops at the first one: the ops after it do not run;
* ``step_seq`` is an exactly-once guard: the pool's last applied seq + 1 runs, the same seq
  again answers the remembered outcome without running anything. A program that is
  ``num_steps`` consecutive scheduler steps concatenated (a shipper catching up) carries the
  last one's seq: its first step must be the pool's last applied seq + 1.

Nothing here does I/O or imports protobuf: the scheduler process runs the same interpreter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final

from kvcm.core.manager import DEFAULT_SLOT_OPTIONS, SlotOptions

__all__ = [
    "EXECUTED_STATUSES",
    "AllocOptions",
    "HitSpec",
    "ItemStatus",
    "NewRequestSpec",
    "OpKind",
    "StepOutcome",
    "StepProgram",
]


@enum.unique
class OpKind(enum.IntEnum):
    """The ops of a Step program (values equal ``kvcm.v1.StepOpKind``)."""

    ADD_REQUEST = 1
    APPEND_TOKENS = 2
    ALLOCATE = 3
    CACHE_BLOCKS = 4
    REMOVE_SKIPPED_BLOCKS = 5
    PREEMPT = 6
    FINISH = 7
    NEW_STEP_STARTS = 8
    EVICT_BLOCKS = 9
    RESET_PREFIX_CACHE = 10
    RECORD_PREFIX_STATS = 11
    FORK = 12
    TAKE_BLOCK_COPIES = 13
    SWAP_OUT = 14
    SWAP_IN = 15
    TAKE_HOST_COPIES = 16
    ADMIT_WITH_HOST = 17
    FINISH_DEFERRED = 18
    TAKE_BLOCK_COPIES_RETAINED = 19
    RELEASE_BLOCK_COPIES = 20
    HOST_SYNC = 21
    COMMON_BLOCKS = 22
    EXTEND_PROMPT = 23
    REPORT_HIT = 24


@enum.unique
class ItemStatus(enum.IntEnum):
    """The outcome of one ALLOCATE (values equal ``kvcm.v1.ItemStatus``; the SDK's too)."""

    OK = 1
    """Allocated."""
    DOES_NOT_FIT = 2
    """Not enough free blocks (vLLM's ``allocate_slots`` returning ``None``); nothing changed."""
    NO_TOKEN_BUDGET = 3
    """A lookup allocation found nothing to compute within the step's token budget."""
    NOT_EXECUTED = 4
    """The Step stopped before this allocation; nothing changed for it. Never in a
    ``StepOutcome`` (it lists executed allocations only): a result read against its program
    (the SDK's ``StepResult``) gives it to the allocations the Step did not reach."""
    HIT_STALE = 5
    """A caller-supplied hit checked when its allocation ran no longer held the request's
    block hashes (an earlier op of the Step evicted them); nothing changed for it and the
    Step stopped there. Look the request up again."""


EXECUTED_STATUSES: Final = frozenset(
    status for status in ItemStatus if status is not ItemStatus.NOT_EXECUTED
)
"""The statuses an executed ALLOCATE can have (what ``StepOutcome.alloc_statuses`` holds)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRequestSpec:
    """A request the scheduler starts tracking (ADD_REQUEST).

    Attributes:
        key: The scheduler's key for the request; not live in the pool.
        request_id: vLLM's request id (messages, events).
        prompt_token_ids: The prompt; non-empty, at most max_model_len tokens.
        block_hashes: The prompt's full hash blocks' hashes, concatenated; all of them or none.
        lora_id: vLLM's LoRA id (events).
        lora_name: vLLM's LoRA name (events, hash verification).
        cache_salt: vLLM's cache salt (hash verification).
        skip_reading_prefix_cache: Never look this request up.
        report_cached_blocks: Report its prefix-cache hits in KV events (vLLM's "full" mode).
    """

    key: int
    request_id: str
    prompt_token_ids: list[int]
    block_hashes: bytes = b""
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False
    report_cached_blocks: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class HitSpec:
    """A prefix hit handed to an ALLOCATE by the caller (unary AllocateSlots' new_computed).

    The interpreter checks that every block holds the request's block hash at its position now
    (FailedPreconditionError otherwise: look the request up again).

    Attributes:
        num_tokens: Tokens the hit covers.
        block_ids: The hit's block ids, one list per KV-cache group.
        shared_prefix_boundary: The lookup's shared-prefix junction (vLLM's third answer of
            ``get_computed_blocks``; 0: none): the request keeps it for sparse retention.
            ``None``: keep what the pool's own lookup of the request found.
    """

    num_tokens: int
    block_ids: tuple[list[int], ...]
    shared_prefix_boundary: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocOptions:
    """The extra arguments of one ALLOCATE (only allocations that need them carry one).

    Attributes:
        lookup: Look the request up right before allocating (a waiting request) with this
            bound on the hit (``-1``: vLLM's default, num_tokens - 1); ``None``: no lookup.
            ``alloc_num_new_tokens`` is then an upper bound, capped by the tokens left and the
            token budget (vLLM's waiting loop).
        hit: A hit the caller looked up before (exclusive with ``lookup``).
        slot_options: allocate_slots' rarely used knobs; ``num_lookahead_tokens`` left at its
            default takes the program's ``default_num_lookahead_tokens``.
        num_in_flight_tokens: vLLM's request.num_in_flight_tokens (async scheduling).
    """

    lookup: int | None = None
    hit: HitSpec | None = None
    slot_options: SlotOptions = DEFAULT_SLOT_OPTIONS
    num_in_flight_tokens: int = 0


NO_LOOKUP_BOUND: Final = -1
TRANSIENT: Final = "kvcm.transient"
"""A dataclass field's metadata key: the field is an answer, not state (state fingerprints
leave it out; snapshots keep it only when it is not empty, for the retry of a lost answer)."""


@dataclass(slots=True, kw_only=True)
class StepProgram:
    """One Step: ops and their argument columns (see the module docstring)."""

    ops: list[int] = field(default_factory=list)
    request_keys: list[int] = field(default_factory=list)
    new_requests: list[NewRequestSpec] = field(default_factory=list)
    alloc_num_new_tokens: list[int] = field(default_factory=list)
    alloc_num_computed_tokens: list[int] = field(default_factory=list)
    alloc_options: dict[int, AllocOptions] = field(default_factory=dict)
    append_num_tokens: list[int] = field(default_factory=list)
    append_token_ids: list[int] = field(default_factory=list)
    append_num_block_hashes: list[int] = field(default_factory=list)
    append_block_hashes: bytes = b""
    cache_num_computed_tokens: list[int] = field(default_factory=list)
    remove_skipped_total_computed_tokens: list[int] = field(default_factory=list)
    evict_num_block_ids: list[int] = field(default_factory=list)
    evict_block_ids: list[int] = field(default_factory=list)
    record_hit_tokens: list[int] = field(default_factory=list)
    fork_child_keys: list[int] = field(default_factory=list)
    fork_num_computed_tokens: list[int] = field(default_factory=list)
    swap_out_num_computed_tokens: list[int] = field(default_factory=list)
    swap_in_num_new_tokens: list[int] = field(default_factory=list)
    admit_host_num_new_tokens: list[int] = field(default_factory=list)
    host_sync_actions: list[int] = field(default_factory=list)
    host_sync_num_keys: list[int] = field(default_factory=list)
    host_sync_keys: bytes = b""
    host_sync_group_ids: list[int] = field(default_factory=list)
    common_num_keys: list[int] = field(default_factory=list)
    common_keys: list[int] = field(default_factory=list)
    extend_prompt_num_tokens: list[int] = field(default_factory=list)
    report_hit_num_groups: list[int] = field(default_factory=list)
    report_hit_num_blocks: list[int] = field(default_factory=list)
    default_num_lookahead_tokens: int = 0
    token_budget: int | None = None
    continue_on_does_not_fit: bool = False
    step_seq: int | None = None
    num_steps: int = 1
    # What the sender reports about its own progress (not interpreted; the server's lag
    # metrics): the newest step its scheduler had closed, and the age of step_seq, when sent.
    scheduler_step_seq: int = 0
    step_age_s: float = 0.0


@dataclass(slots=True, kw_only=True)
class StepOutcome:
    """What a Step answered (columnar, like :class:`StepProgram`).

    Attributes:
        num_ops_executed: ops[0:num_ops_executed] ran; the rest changed nothing.
        alloc_statuses: One :class:`ItemStatus` value per executed ALLOCATE.
        alloc_num_block_ids: Per executed ALLOCATE, one count per group of its entries in
            ``alloc_block_ids`` (0 unless OK). Without a lookup: the new blocks; with one,
            every block the request holds (the hit, then the new blocks).
        alloc_block_ids: The block ids, concatenated.
        lookup_num_computed_tokens: Per executed ALLOCATE with a lookup: the hit in tokens.
        lookup_num_new_tokens: ... and the tokens actually allocated (0 unless OK).
        reset: Per executed RESET_PREFIX_CACHE: whether it reset.
        token_budget_left: Budget after the executed ops (when the program set one).
        step_seq: Echo of the program's step_seq.
        copy_block_ids: The block copies the Step's allocations made (copy-on-write of a
            shared partial block after a FORK), flattened ``source, destination`` pairs in
            the order made; workers run them before the step's forward pass. Transient: not
            in snapshots or fingerprints.
        drained_copy_block_ids: The block copies of sub-block prefix hits (docs/mamba.md)
            each executed TAKE_BLOCK_COPIES drained, flattened ``source, destination`` pairs
            in drain order; workers run them before that step's forward pass. Transient.
        drained_num_copies: Per executed TAKE_BLOCK_COPIES, how many pairs of
            ``drained_copy_block_ids`` it drained (a coalesced program's drains, in order).
            Transient.
        swap_out_swapped: Per executed SWAP_OUT: whether the request was swapped to the
            host tier (``False``: the tier had no room and it was preempted by
            recomputation). Transient, as every host-tier answer below.
        host_alloc_statuses: Per executed SWAP_IN or ADMIT_WITH_HOST, in op order: OK or
            DOES_NOT_FIT (nothing changed: a swapped request stays swapped).
        host_alloc_num_block_ids: ... one count per group of its entries in
            ``host_alloc_block_ids`` (every block the request holds; 0 unless OK).
        host_alloc_block_ids: The block ids, concatenated.
        host_alloc_num_device_hit_tokens: ... its tokens hit on the device.
        host_alloc_num_host_hit_tokens: ... and its tokens copied back from the host tier.
        host_d2h_block_ids: The host tier's device-to-host copies each executed
            TAKE_HOST_COPIES drained (demotions and swap-outs), flattened
            ``device_block_id, host_block_id`` pairs in order.
        host_h2d_block_ids: ... and its host-to-device copies (host hits, swap-ins),
            flattened ``host_block_id, device_block_id`` pairs.
        host_num_d2h: Per executed TAKE_HOST_COPIES, its pairs of ``host_d2h_block_ids``.
        host_num_h2d: Per executed TAKE_HOST_COPIES, its pairs of ``host_h2d_block_ids``.
        common_num_block_ids: Per executed COMMON_BLOCKS, one count per group: how many
            entries of ``common_block_ids`` are that group's common computed blocks.
        common_block_ids: The common computed blocks of every executed COMMON_BLOCKS.
        delayed_keys: The request keys of the executed ALLOCATEs that fit with
            ``delay_cache_blocks`` (P/D transfers the server tracks), in op order. Not on the
            wire and not part of a pool's state (fingerprints leave it out; a snapshot keeps it
            with the remembered answer).
    """

    num_ops_executed: int = 0
    alloc_statuses: list[int] = field(default_factory=list)
    alloc_num_block_ids: list[int] = field(default_factory=list)
    alloc_block_ids: list[int] = field(default_factory=list)
    lookup_num_computed_tokens: list[int] = field(default_factory=list)
    lookup_num_new_tokens: list[int] = field(default_factory=list)
    reset: list[bool] = field(default_factory=list)
    token_budget_left: int | None = None
    step_seq: int | None = None
    copy_block_ids: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    drained_copy_block_ids: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    drained_num_copies: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    swap_out_swapped: list[bool] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    host_alloc_statuses: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    host_alloc_num_block_ids: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    host_alloc_block_ids: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    host_alloc_num_device_hit_tokens: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    host_alloc_num_host_hit_tokens: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    host_d2h_block_ids: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    host_h2d_block_ids: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    host_num_d2h: list[int] = field(default_factory=list, compare=False, metadata={TRANSIENT: True})
    host_num_h2d: list[int] = field(default_factory=list, compare=False, metadata={TRANSIENT: True})
    common_num_block_ids: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    common_block_ids: list[int] = field(
        default_factory=list, compare=False, metadata={TRANSIENT: True}
    )
    delayed_keys: list[int] = field(default_factory=list, compare=False, metadata={TRANSIENT: True})
