"""The Step interpreter: the one place where a Step program's semantics live.

:func:`run_step` checks the service's limits and the exactly-once guard, validates the whole
:class:`~kvcm.core.program.StepProgram` against the pool (:func:`validate_program`), then
executes it (:func:`execute_program`). The unary calls of :class:`~kvcm.core.pool.Pool` use the
same check functions, so a rule is written once.

Atomicity: validation walks the ops through a shadow of the request table (keys added and
finished, token and hash counts after appends, whether the request holds blocks) and checks
everything execution could refuse: column consumption, counts against the request's tokens,
``max_model_len`` and the pool, caller-supplied hits against the prefix cache, and the hashes
themselves when the pool verifies them. A rejected program raises one
:class:`~kvcm.common.errors.KVCMError` (``field`` and ``op_index`` set) and leaves the pool
identical (:meth:`~kvcm.core.pool.Pool.state_fingerprint` does not change).

Execution does not raise. Should the core refuse an op anyway, that is a bug in validation: the
interpreter raises :class:`StepExecutionBug` (not a ``KVCMError``, so the service answers
INTERNAL instead of a client status), and the tests assert it never happens.

Rules beyond the unary calls' (all decided by validation, so deterministic):

* an ALLOCATE with a lookup or a caller hit is for a request with no computed tokens that holds
  no blocks, and must not follow another ALLOCATE of the same request in the program unless
  the program runs on after "does not fit" (``continue_on_does_not_fit``); then, if the earlier
  ALLOCATE fit, it answers DOES_NOT_FIT and changes nothing;
* a caller-supplied hit is checked against the cache before anything runs when that is exact
  (no earlier op of the program can evict cached blocks, and the request's block hashes are
  all in the pool already): a stale or foreign hit then rejects the program. Otherwise (vLLM's
  scheduler looks waiting requests up after it allocated for the running ones) validation
  checks the hit's shape and the cache part runs with the ALLOCATE: a hit block that does not
  hold the request's block hash there answers HIT_STALE, adopts nothing, and the program stops
  there as at DOES_NOT_FIT;
* with ``continue_on_does_not_fit``, CACHE_BLOCKS / REMOVE_SKIPPED_BLOCKS of a request whose
  ALLOCATE did not fit change nothing, and CACHE_BLOCKS caches at most the tokens the request's
  blocks hold.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import TYPE_CHECKING, Final, TypeAlias

from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError, KVCMError
from kvcm.common.hashing import BlockHash
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS, CacheHit, KVCacheBlocks, SlotOptions
from kvcm.core.program import (
    NO_LOOKUP_BOUND,
    AllocOptions,
    HitSpec,
    ItemStatus,
    OpKind,
    StepOutcome,
    StepProgram,
)
from kvcm.core.request import Request, RequestStatus
from kvcm.core.step_checks import (
    check_append,
    check_hit,
    check_limits,
    check_new_request,
    validate_program,
)

if TYPE_CHECKING:
    from kvcm.core.manager import KVCacheManager
    from kvcm.core.pool import Pool

__all__ = [
    "PhaseHook",
    "StepExecutionBug",
    "check_append",
    "check_hit",
    "check_limits",
    "check_new_request",
    "execute_program",
    "hit_of",
    "run_step",
    "validate_program",
]

_ADD: Final = int(OpKind.ADD_REQUEST)
_ALLOCATE: Final = int(OpKind.ALLOCATE)
_APPEND: Final = int(OpKind.APPEND_TOKENS)
_CACHE: Final = int(OpKind.CACHE_BLOCKS)
_SKIPPED: Final = int(OpKind.REMOVE_SKIPPED_BLOCKS)
_PREEMPT: Final = int(OpKind.PREEMPT)
_NEW_STEP: Final = int(OpKind.NEW_STEP_STARTS)
_EVICT: Final = int(OpKind.EVICT_BLOCKS)
_RESET: Final = int(OpKind.RESET_PREFIX_CACHE)
_RECORD: Final = int(OpKind.RECORD_PREFIX_STATS)
_OK: Final = int(ItemStatus.OK)
_DOES_NOT_FIT: Final = int(ItemStatus.DOES_NOT_FIT)
_NO_TOKEN_BUDGET: Final = int(ItemStatus.NO_TOKEN_BUDGET)
_HIT_STALE: Final = int(ItemStatus.HIT_STALE)


PhaseHook: TypeAlias = Callable[[str], AbstractContextManager[object]]
"""Wraps a phase of the interpreter (``"validate"``, ``"execute"``): e.g. a tracing span."""


class StepExecutionBug(AssertionError):  # noqa: N818 - a bug, not an error to handle
    """Raised when the core refuses an op of a validated program (a validation bug).

    Not a ``KVCMError``: the service answers INTERNAL, and the ops before it have run.
    """


def run_step(pool: Pool, program: StepProgram, *, phase: PhaseHook | None = None) -> StepOutcome:
    """Run one Step program on a READY pool (see the module docstring).

    Args:
        pool: The pool.
        program: The program.
        phase: Called with ``"validate"`` and ``"execute"``; the context manager it returns
            wraps that phase (a tracer's span). ``None``: no hook, no cost.

    Returns:
        The outcome; for a repeated ``step_seq``, the outcome remembered for it.

    Raises:
        FailedPreconditionError: The pool is not READY, or step_seq is out of sequence.
        ResourceExhaustedError: The program is beyond the pool's limits.
        KVCMError: The program failed validation (``field``/``op_index`` name the fault);
            nothing changed.
    """
    manager = pool.ready_manager()
    check_limits(pool.limits, program)
    seq = program.step_seq
    num_steps = program.num_steps
    if num_steps != 1 and (seq is None or not 1 <= num_steps <= seq):
        raise InvalidArgumentError(
            f"num_steps {num_steps} needs a step_seq of at least num_steps (got {seq})",
            field="num_steps",
        )
    if seq is not None:
        last = pool.last_step_seq
        if seq == last and seq > 0 and pool.last_step_outcome is not None:
            return pool.last_step_outcome
        if seq - num_steps != last:
            what = (
                f"step_seq {seq} is"
                if num_steps == 1
                else f"steps {seq - num_steps + 1}-{seq} (step_seq {seq}) are"
            )
            raise FailedPreconditionError(
                f"{what} out of sequence: pool {pool.name!r} last applied {last}, "
                f"expects {last + 1}",
                field="step_seq",
            )
    if phase is None:
        deferred_hits = validate_program(pool, manager, program)
        outcome = execute_program(pool, manager, program, deferred_hits)
    else:
        with phase("validate"):
            deferred_hits = validate_program(pool, manager, program)
        with phase("execute"):
            outcome = execute_program(pool, manager, program, deferred_hits)
    if seq is not None:
        outcome.step_seq = seq
        pool.last_step_seq = seq
        pool.last_step_outcome = outcome
    return outcome


# ------------------------------------------------------------------------------ execution
def execute_program(
    pool: Pool,
    manager: KVCacheManager,
    program: StepProgram,
    deferred_hits: frozenset[int] = frozenset(),
) -> StepOutcome:
    """Run a validated program (see the module docstring); returns its outcome.

    Args:
        pool: The pool.
        manager: Its ready manager.
        program: A program :func:`validate_program` accepted.
        deferred_hits: What :func:`validate_program` returned: the ALLOCATEs whose hit is
            checked against the cache when they run.

    Raises:
        StepExecutionBug: The core refused an op validation accepted (a bug).
    """
    try:
        return _execute(pool, manager, program, deferred_hits)
    except KVCMError as exc:  # pragma: no cover - validation covers what execution refuses
        raise StepExecutionBug(f"the core refused a validated Step op: {exc!r}") from exc


def _execute(
    pool: Pool, manager: KVCacheManager, program: StepProgram, deferred_hits: frozenset[int]
) -> StepOutcome:
    requests = pool.requests
    keys = program.request_keys
    hash_length = pool.hashing.hash_length_bytes
    append_tokens = program.append_token_ids
    append_hashes = program.append_block_hashes
    append_counts = program.append_num_tokens
    append_hash_counts = program.append_num_block_hashes
    alloc_new = program.alloc_num_new_tokens
    alloc_computed = program.alloc_num_computed_tokens
    allocate = manager.allocate_slots
    running = RequestStatus.RUNNING
    options_by_index = program.alloc_options
    default_lookahead = program.default_num_lookahead_tokens
    default_options = (
        SlotOptions(num_lookahead_tokens=default_lookahead)
        if default_lookahead
        else DEFAULT_SLOT_OPTIONS
    )
    budget = program.token_budget
    stop = not program.continue_on_does_not_fit
    outcome = StepOutcome()
    statuses, counts, block_ids = (
        outcome.alloc_statuses,
        outcome.alloc_num_block_ids,
        outcome.alloc_block_ids,
    )
    no_blocks = [0] * manager.num_kv_cache_groups
    cold = _ColdOps(pool, manager, program, outcome)
    k = n_append = n_alloc = token_cursor = hash_cursor = 0
    executed = 0
    for op in program.ops:
        executed += 1
        if op == _ALLOCATE:
            request = requests[keys[k]]
            k += 1
            num_new = alloc_new[n_alloc]
            request.num_computed_tokens = alloc_computed[n_alloc]
            entry = options_by_index.get(n_alloc) if options_by_index else None
            n_alloc += 1
            if entry is not None:
                if entry.hit is not None and (n_alloc - 1) in deferred_hits:
                    entry = _fresh_hit_or_none(pool, manager, request, entry, outcome)
                    if entry is None:
                        if stop:
                            break
                        continue
                status, budget = _allocate_with_options(
                    pool, manager, request, num_new, entry, default_lookahead, budget, outcome
                )
                if status != _OK:
                    if stop:
                        break
                elif entry.slot_options.delay_cache_blocks:
                    outcome.delayed_keys.append(keys[k - 1])
                continue
            request.num_in_flight_tokens = 0
            blocks = allocate(request, num_new, None, default_options)
            if blocks is None:
                pool.allocations_not_fit_total += 1
                statuses.append(_DOES_NOT_FIT)
                counts.extend(no_blocks)
                if stop:
                    break
                continue
            request.status = running
            statuses.append(_OK)
            for group in blocks.blocks:
                counts.append(len(group))
                block_ids.extend([block.block_id for block in group])
            if budget is not None:
                budget = max(0, budget - num_new)
        elif op == _APPEND:
            request = requests[keys[k]]
            k += 1
            num_tokens = append_counts[n_append]
            num_hashes = append_hash_counts[n_append]
            n_append += 1
            tokens = append_tokens[token_cursor : token_cursor + num_tokens]
            token_cursor += num_tokens
            if not num_hashes:
                request.all_token_ids.extend(tokens)
                continue
            size = num_hashes * hash_length
            raw = append_hashes[hash_cursor : hash_cursor + size]
            hash_cursor += size
            request.all_token_ids.extend(tokens)
            request.block_hashes.extend(
                [BlockHash(raw[i : i + hash_length]) for i in range(0, size, hash_length)]
            )
        else:
            k = cold.run(op, k)
    outcome.num_ops_executed = executed
    outcome.token_budget_left = budget
    return outcome


class _ColdOps:
    """Runs the validated ops other than ALLOCATE and APPEND_TOKENS, with their cursors."""

    __slots__ = ("keys", "manager", "n_add", "n_cache", "n_evict", "n_evict_ids", "n_record",
                 "n_skipped", "outcome", "pool", "program")  # fmt: skip

    def __init__(
        self, pool: Pool, manager: KVCacheManager, program: StepProgram, outcome: StepOutcome
    ) -> None:
        self.pool = pool
        self.manager = manager
        self.program = program
        self.outcome = outcome
        self.keys = program.request_keys
        self.n_add = self.n_cache = self.n_skipped = self.n_evict = self.n_evict_ids = 0
        self.n_record = 0

    def run(self, op: int, k: int) -> int:
        """Run ``op`` (its request named by ``request_keys[k]``); returns the next key cursor."""
        pool, manager, program = self.pool, self.manager, self.program
        if op == _NEW_STEP:
            manager.new_step_starts()
            return k
        if op == _RESET:
            self.outcome.reset.append(manager.reset_prefix_cache())
            return k
        if op == _EVICT:
            count = program.evict_num_block_ids[self.n_evict]
            start = self.n_evict_ids
            self.n_evict += 1
            self.n_evict_ids = start + count
            manager.evict_blocks(program.evict_block_ids[start : start + count])
            return k
        if op == _ADD:
            new = program.new_requests[self.n_add]
            self.n_add += 1
            pool.add_request(
                new.key,
                new.request_id,
                new.prompt_token_ids,
                new.block_hashes,
                lora_id=new.lora_id,
                lora_name=new.lora_name,
                cache_salt=new.cache_salt,
                skip_reading_prefix_cache=new.skip_reading_prefix_cache,
            )
            return k
        key = self.keys[k]
        request = pool.requests[key]
        if op == _CACHE:
            num_computed = program.cache_num_computed_tokens[self.n_cache]
            self.n_cache += 1
            if manager.holds_blocks(request.request_id):
                manager.cache_blocks(request, manager.num_cacheable_tokens(request, num_computed))
        elif op == _SKIPPED:
            total = program.remove_skipped_total_computed_tokens[self.n_skipped]
            self.n_skipped += 1
            if manager.holds_blocks(request.request_id):
                manager.remove_skipped_blocks(request.request_id, total)
        elif op == _RECORD:
            hits = program.record_hit_tokens[self.n_record]
            self.n_record += 1
            manager.record_prefix_cache_stats(request, hits)
        else:  # PREEMPT or FINISH; validation allowed no other kind
            pool.free(key, preempt=op == _PREEMPT)
        return k + 1


def _allocate_with_options(  # noqa: PLR0917 (private helper)
    pool: Pool,
    manager: KVCacheManager,
    request: Request,
    num_new: int,
    entry: AllocOptions,
    default_lookahead: int,
    budget: int | None,
    outcome: StepOutcome,
) -> tuple[int, int | None]:
    options = entry.slot_options
    if options.num_lookahead_tokens == 0 and default_lookahead:
        options = _with_lookahead(options, default_lookahead)
    request.num_in_flight_tokens = entry.num_in_flight_tokens
    num_groups = manager.num_kv_cache_groups
    hit: CacheHit | None = None
    looked = entry.lookup is not None
    if manager.holds_blocks(request.request_id) and (looked or entry.hit is not None):
        # continue_on_does_not_fit: an earlier ALLOCATE of this request in the Step fit.
        pool.allocations_not_fit_total += 1
        _answer(outcome, _DOES_NOT_FIT, num_groups, None, 0 if looked else None, 0)
        return _DOES_NOT_FIT, budget
    if entry.lookup is not None:
        bound = None if entry.lookup == NO_LOOKUP_BOUND else entry.lookup
        hit = manager.get_computed_blocks(request, bound)
        left = (
            request.num_tokens
            - request.num_computed_tokens
            - hit.num_computed_tokens
            - options.num_external_computed_tokens
        )
        num_new = min(num_new, left)
        if budget is not None:
            num_new = min(num_new, budget)
        if num_new <= 0:
            _answer(outcome, _NO_TOKEN_BUDGET, num_groups, None, hit.num_computed_tokens, 0)
            return _NO_TOKEN_BUDGET, budget
    elif entry.hit is not None:
        hit = hit_of(manager, entry.hit)
        # The caller's lookup also found where a shared prefix ends (sparse retention).
        junction = entry.hit.shared_prefix_boundary
        if junction is not None:
            manager.set_shared_prefix_boundary(request.request_id, junction)
    blocks = pool.allocate_slots(request, num_new, hit, options)
    if blocks is None:
        looked_tokens = hit.num_computed_tokens if looked and hit is not None else None
        _answer(outcome, _DOES_NOT_FIT, num_groups, None, looked_tokens, 0)
        return _DOES_NOT_FIT, budget
    if looked:
        assert hit is not None
        manager.record_prefix_cache_stats(request, hit.num_computed_tokens)
        ids = manager.get_block_ids(request.request_id)
        _answer(outcome, _OK, num_groups, ids, hit.num_computed_tokens, num_new)
    else:
        _answer(outcome, _OK, num_groups, blocks.get_block_ids(), None, 0)
    if budget is not None:
        budget = max(0, budget - num_new)
    return _OK, budget


def _fresh_hit_or_none(
    pool: Pool,
    manager: KVCacheManager,
    request: Request,
    entry: AllocOptions,
    outcome: StepOutcome,
) -> AllocOptions | None:
    """A deferred hit checked against the cache now: ``entry``, or ``None`` after answering
    HIT_STALE (nothing adopted, nothing allocated)."""
    assert entry.hit is not None
    if manager.holds_blocks(request.request_id):
        return entry  # an earlier ALLOCATE of it fit: _allocate_with_options answers that
    try:
        check_hit(pool, manager, request, entry.hit, request.num_tokens)
    except FailedPreconditionError:
        _answer(outcome, _HIT_STALE, manager.num_kv_cache_groups, None, None, 0)
        return None
    return entry


def _with_lookahead(options: SlotOptions, lookahead: int) -> SlotOptions:
    return replace(options, num_lookahead_tokens=lookahead)


def hit_of(manager: KVCacheManager, hit: HitSpec) -> CacheHit:
    """The core's ``CacheHit`` of a checked :class:`HitSpec`."""
    blocks = manager.block_pool.blocks
    return CacheHit(
        KVCacheBlocks(tuple([blocks[i] for i in group] for group in hit.block_ids)),
        hit.num_tokens,
    )


def _answer(  # noqa: PLR0917 (private helper)
    outcome: StepOutcome,
    status: int,
    num_groups: int,
    ids: tuple[list[int], ...] | None,
    hit_tokens: int | None,
    num_new: int,
) -> None:
    """One allocation's answer (``hit_tokens`` set: it looked the request up)."""
    outcome.alloc_statuses.append(status)
    if ids is None:
        outcome.alloc_num_block_ids.extend([0] * num_groups)
    else:
        for group in ids:
            outcome.alloc_num_block_ids.append(len(group))
            outcome.alloc_block_ids.extend(group)
    if hit_tokens is not None:
        outcome.lookup_num_computed_tokens.append(hit_tokens)
        outcome.lookup_num_new_tokens.append(num_new)
