"""The Step interpreter: the one place where a Step program's semantics live.

:func:`run_step` checks the service's limits and the exactly-once guard, validates the whole
:class:`~kvcm.core.program.StepProgram` against the pool (:func:`validate_program`), then
executes it (:func:`execute_program`). The unary calls of :class:`~kvcm.core.pool.Pool` use the
same check functions, so a rule is written once.

Both phases walk the program with one dispatcher (:func:`_walk`) over the op table
(:mod:`kvcm.core.op_table`): it keeps the one cursor (the ``request_keys`` position and each
kind's ordinal, which indexes the kind's columns) and hands each op to its kind's handler.
Every kind has a validate and an execute handler, side by side below; a handler is made per
walk, for the kinds the program uses, and keeps the columns it reads in its closure.

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
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeAlias

from kvcm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCMError,
    NotFoundError,
    ResourceExhaustedError,
)
from kvcm.common.hashing import BlockHash, make_block_hash_with_group_id
from kvcm.core import step_checks as checks
from kvcm.core.fork import common_computed_block_ids, fork_request
from kvcm.core.host_tier import SyncAction, apply_sync
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS, CacheHit, KVCacheBlocks, SlotOptions
from kvcm.core.op_table import KEYED, OP_TABLE
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
from kvcm.core.step_checks import check_append, check_hit, check_limits, check_new_request

if TYPE_CHECKING:
    from kvcm.core.host_tier import HostAdmission, HostTier
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

_OK: Final = int(ItemStatus.OK)
_DOES_NOT_FIT: Final = int(ItemStatus.DOES_NOT_FIT)
_NO_TOKEN_BUDGET: Final = int(ItemStatus.NO_TOKEN_BUDGET)
_HIT_STALE: Final = int(ItemStatus.HIT_STALE)
_NONE_DEFERRED: Final[frozenset[int]] = frozenset()
_NUM_KINDS: Final = max(OP_TABLE) + 1
_KEYED_BY_KIND: Final = [KEYED.get(kind, 0) for kind in range(_NUM_KINDS)]


PhaseHook: TypeAlias = Callable[[str], AbstractContextManager[object]]
"""Wraps a phase of the interpreter (``"validate"``, ``"execute"``): e.g. a tracing span."""

Handler: TypeAlias = Callable[[int, int, int], None]
"""One op: ``(op_index, key position, ordinal among its kind)``; raises :class:`_Stop` to end
the walk after this op."""


class _Stop(Exception):  # noqa: N818 - control flow, never escapes the walk
    """An execute handler ends the walk after its op (an ALLOCATE that did not fit)."""


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


def validate_program(pool: Pool, manager: KVCacheManager, program: StepProgram) -> frozenset[int]:
    """Validate a whole program against the pool without changing anything.

    Returns:
        The ALLOCATE indices whose caller-supplied hit must be checked against the cache when
        the op runs (an earlier op may evict, or the Step appends the hashes it needs).

    Raises:
        KVCMError: The first failing op (``op_index`` set) or the malformed program.
    """
    checks.check_program_fields(program)
    host = pool.host_tier
    if host is not None:
        _check_host_copies_drained(pool.name, host, manager, program)
    v = checks.Shadow(pool, manager, program)
    _, num_keys, counts = _walk(program.ops, lambda kind: _PAIRS[kind][0](v))
    checks.check_consumed(program, num_keys, counts, pool.hashing.hash_length_bytes)
    options_by_index = program.alloc_options
    num_allocs = counts[OpKind.ALLOCATE]
    if options_by_index and max(options_by_index) >= num_allocs:
        raise InvalidArgumentError(
            f"alloc_options names alloc index {max(options_by_index)} but the Step has "
            f"{num_allocs} ALLOCATE ops",
            field="alloc_options",
        )
    return frozenset(v.deferred_hits) if v.deferred_hits else _NONE_DEFERRED


def _check_host_copies_drained(
    name: str, host: HostTier, manager: KVCacheManager, program: StepProgram
) -> None:
    """Refuse a Step that would let a host tier's undrained copies grow without bound.

    Each Step can record at most about one copy per device block and per host block; a client
    that drains with TAKE_HOST_COPIES every Step stays far below twice that. One that never
    drains is told so, instead of the list (and every checkpoint holding it) growing forever;
    a Step that drains is always accepted.
    """
    limit = 2 * (host.num_blocks + manager.block_pool.num_gpu_blocks)
    pending = host.num_pending_copies
    if pending > limit and OpKind.TAKE_HOST_COPIES not in program.ops:
        raise ResourceExhaustedError(
            f"pool {name!r} holds {pending} host-tier copies not yet taken (limit {limit}): "
            "a Step must drain them with TAKE_HOST_COPIES and hand them to the workers",
            field="ops",
        )


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
    outcome = StepOutcome(token_budget_left=program.token_budget)
    x = _Execution(pool, manager, program, outcome, deferred_hits)
    if manager.fork_copies:
        manager.fork_copies = []  # a Step answers its own copies (kvcm.core.fork)
    try:
        executed, _, _ = _walk(program.ops, lambda kind: _PAIRS[kind][1](x))
    except KVCMError as exc:  # pragma: no cover - validation covers what execution refuses
        raise StepExecutionBug(f"the core refused a validated Step op: {exc!r}") from exc
    outcome.num_ops_executed = executed
    if manager.fork_copies:
        outcome.copy_block_ids = [block_id for pair in manager.fork_copies for block_id in pair]
    # Sub-block hits (beside align-mode Mamba) queue block copies that stay pending, holding
    # a reference on both ends, until a TAKE_BLOCK_COPIES drains them (where vLLM's scheduler
    # calls take_kv_cache_block_copies), in this program or a later one.
    return outcome


# ----------------------------------------------------------------------------- the walk
def _walk(ops: list[int], make: Callable[[int], Handler]) -> tuple[int, int, list[int]]:
    """The one dispatcher: hand each op to its kind's handler, keeping the one cursor.

    Args:
        ops: The program's ops.
        make: The handler of an op kind (called once per kind the program uses).

    Returns:
        The ops walked (all, or up to the one whose handler raised :class:`_Stop`), the
        ``request_keys`` entries they took, and per op kind value how many ops of that kind
        they were.

    Raises:
        InvalidArgumentError: An op of no kind (names ``ops[i]``).
    """
    handlers: dict[int, Handler] = {}
    counts = [0] * _NUM_KINDS
    keyed = _KEYED_BY_KIND
    k = op_index = 0
    try:
        for op_index, op in enumerate(ops):
            try:
                handler = handlers[op]
            except KeyError:
                if op not in OP_TABLE:
                    raise checks.reject(
                        InvalidArgumentError(f"ops[{op_index}] has unknown kind {op}"),
                        op_index,
                        op,
                        f"ops[{op_index}]",
                    ) from None
                handler = handlers[op] = make(op)
            n = counts[op]
            counts[op] = n + 1
            handler(op_index, k, n)
            k += keyed[op]
    except _Stop:
        return op_index + 1, k, counts
    return len(ops), k, counts


class _Execution(NamedTuple):
    """What the execute handlers of one walk share."""

    pool: Pool
    manager: KVCacheManager
    program: StepProgram
    outcome: StepOutcome
    deferred_hits: frozenset[int]


# ---------------------------------------------------------------------------- ADD_REQUEST
def _validate_add(v: checks.Shadow) -> Handler:
    return lambda op_index, k, n: checks.check_add(v, op_index, n)


def _execute_add(x: _Execution) -> Handler:
    pool, new_requests = x.pool, x.program.new_requests

    def run(op_index: int, k: int, n: int) -> None:
        new = new_requests[n]
        pool.add_request(
            new.key,
            new.request_id,
            new.prompt_token_ids,
            new.block_hashes,
            lora_id=new.lora_id,
            lora_name=new.lora_name,
            cache_salt=new.cache_salt,
            skip_reading_prefix_cache=new.skip_reading_prefix_cache,
            report_cached_blocks=new.report_cached_blocks,
        )

    return run


# -------------------------------------------------------------------------- APPEND_TOKENS
def _validate_append(v: checks.Shadow) -> Handler:
    # A decode step's op: a cheap test sends only suspicious appends to the full checks.
    pool, program = v.pool, v.program
    keys, table_get, first_sight, verify = v.keys, v.table.get, v.first_sight, v.verify
    num_keys = len(keys)
    counts_tokens, counts_hashes = program.append_num_tokens, program.append_num_block_hashes
    num_appends = min(len(counts_tokens), len(counts_hashes))
    num_token_ids = len(program.append_token_ids)
    num_hash_bytes = len(program.append_block_hashes)
    max_model_len = pool.max_model_len
    hash_block_size = pool.hashing.hash_block_size if pool.options.enable_caching else 0
    lookahead = pool.options.num_hash_lookahead_tokens
    hash_length = pool.hashing.hash_length_bytes
    token_cursor = hash_cursor = 0
    kind = OpKind.APPEND_TOKENS

    def check(op_index: int, k: int, n: int) -> None:
        nonlocal token_cursor, hash_cursor
        if k >= num_keys:
            raise checks.too_few(op_index, kind, "request_keys")
        key = keys[k]
        state = table_get(key) or first_sight(op_index, kind, k, key)
        if n >= num_appends:
            raise checks.too_few(op_index, kind, "append_num_tokens")
        num_tokens = counts_tokens[n]
        num_hashes = counts_hashes[n]
        start = token_cursor
        token_cursor += num_tokens
        hash_cursor += num_hashes * hash_length
        before = state[0]
        hashes_before = state[2]
        if (
            num_tokens <= 0
            or num_hashes < 0
            or before + num_tokens > max_model_len
            or token_cursor > num_token_ids
            or hash_cursor > num_hash_bytes
            or (
                num_hashes
                and not checks.hashes_expected(
                    before, num_tokens, num_hashes, hashes_before, hash_block_size, lookahead
                )
            )
        ):
            checks.check_append_slow(
                v, op_index, key, n, before, hashes_before,
                num_tokens=num_tokens, num_hashes=num_hashes,
                short=token_cursor > num_token_ids or hash_cursor > num_hash_bytes,
            )  # fmt: skip
        state[0] = before + num_tokens
        state[2] = hashes_before + num_hashes
        if verify:
            checks.verify_append(v, op_index, n, state, start, num_tokens, num_hashes)

    return check


def _execute_append(x: _Execution) -> Handler:
    program = x.program
    requests, keys = x.pool.requests, program.request_keys
    counts_tokens, counts_hashes = program.append_num_tokens, program.append_num_block_hashes
    token_ids, hashes = program.append_token_ids, program.append_block_hashes
    hash_length = x.pool.hashing.hash_length_bytes
    token_cursor = hash_cursor = 0

    def run(op_index: int, k: int, n: int) -> None:
        nonlocal token_cursor, hash_cursor
        request = requests[keys[k]]
        num_tokens = counts_tokens[n]
        num_hashes = counts_hashes[n]
        if num_tokens == 1:  # a decode step's
            request.all_token_ids.append(token_ids[token_cursor])
        else:
            request.all_token_ids.extend(token_ids[token_cursor : token_cursor + num_tokens])
        token_cursor += num_tokens
        if num_hashes:
            size = num_hashes * hash_length
            raw = hashes[hash_cursor : hash_cursor + size]
            hash_cursor += size
            request.block_hashes.extend(
                [BlockHash(raw[i : i + hash_length]) for i in range(0, size, hash_length)]
            )

    return run


# ------------------------------------------------------------------------------- ALLOCATE
def _validate_allocate(v: checks.Shadow) -> Handler:
    # A decode step's op: a cheap test sends only suspicious allocations to the full checks.
    program, keys, table_get, first_sight = v.program, v.keys, v.table.get, v.first_sight
    allocated_add, holds_yes, holds_maybe = v.allocated.add, checks.HOLDS_YES, checks.HOLDS_MAYBE
    num_keys = len(keys)
    options_get = program.alloc_options.get if program.alloc_options else None
    alloc_new, alloc_computed = program.alloc_num_new_tokens, program.alloc_num_computed_tokens
    num_allocs = min(len(alloc_new), len(alloc_computed))
    max_model_len = v.pool.max_model_len
    kind = OpKind.ALLOCATE
    tiered = v.pool.host_tier is not None

    def check(op_index: int, k: int, n: int) -> None:
        if k >= num_keys:
            raise checks.too_few(op_index, kind, "request_keys")
        key = keys[k]
        state = table_get(key) or first_sight(op_index, kind, k, key)
        if n >= num_allocs:
            raise checks.too_few(op_index, kind, "alloc_num_new_tokens")
        num_new = alloc_new[n]
        num_computed = alloc_computed[n]
        entry = options_get(n) if options_get is not None else None
        if (
            entry is not None
            or num_computed < 0
            or num_computed > state[0]
            or num_new <= 0
            or num_computed + num_new > max_model_len
        ):
            checks.check_allocate(v, op_index, key, state, num_new, num_computed, entry, n)
        if tiered and state[1] != holds_yes and v.is_swapped(key, state[4]):
            raise checks.reject(
                FailedPreconditionError(
                    f"request key {key} is swapped out to the host tier: SWAP_IN it (or "
                    "FINISH it) before allocating"
                ),
                op_index,
                kind,
                f"request_keys[{k}]",
            )
        allocated_add(key)
        if state[1] != holds_yes:
            state[1] = holds_maybe

    return check


def _execute_allocate(x: _Execution) -> Handler:
    # The one allocation path: every ALLOCATE reaches the one allocate_slots call below, and
    # its bookkeeping (the not-fit counter, RUNNING, the answer) is written once.
    pool, manager, program, outcome = x.pool, x.manager, x.program, x.outcome
    requests, keys, deferred_hits = pool.requests, program.request_keys, x.deferred_hits
    alloc_new, alloc_computed = program.alloc_num_new_tokens, program.alloc_num_computed_tokens
    options_get = program.alloc_options.get if program.alloc_options else None
    lookahead = program.default_num_lookahead_tokens
    default_options = (
        SlotOptions(num_lookahead_tokens=lookahead) if lookahead else DEFAULT_SLOT_OPTIONS
    )
    allocate = manager.allocate_slots
    statuses, counts, block_ids = (
        outcome.alloc_statuses,
        outcome.alloc_num_block_ids,
        outcome.alloc_block_ids,
    )
    no_blocks = [0] * manager.num_kv_cache_groups
    running = RequestStatus.RUNNING
    stop = not program.continue_on_does_not_fit
    budget = program.token_budget

    def run(op_index: int, k: int, n: int) -> None:
        nonlocal budget
        request = requests[keys[k]]
        num_new = alloc_new[n]
        request.num_computed_tokens = alloc_computed[n]
        entry = options_get(n) if options_get is not None else None
        hit: CacheHit | None = None
        looked = False
        if entry is None:
            request.num_in_flight_tokens = 0
            options = default_options
        else:
            prepared = _prepare_allocation(
                x, request, num_new, entry, n in deferred_hits, lookahead, budget
            )
            if prepared is None:  # answered without allocating
                if stop:
                    raise _Stop
                return
            num_new, hit, options = prepared
            looked = entry.lookup is not None
        blocks = allocate(request, num_new, hit, options)
        if blocks is None:
            pool.allocations_not_fit_total += 1
            statuses.append(_DOES_NOT_FIT)
            counts.extend(no_blocks)
            if looked:
                assert hit is not None
                outcome.lookup_num_computed_tokens.append(hit.num_computed_tokens)
                outcome.lookup_num_new_tokens.append(0)
            if stop:
                raise _Stop
            return
        request.status = running
        statuses.append(_OK)
        if looked:
            assert hit is not None
            manager.record_prefix_cache_stats(request, hit.num_computed_tokens)
            ids = manager.get_block_ids(request.request_id)
            _answer(outcome, None, 0, ids, hit.num_computed_tokens, num_new)
        else:
            for group in blocks.blocks:
                counts.append(len(group))
                if group:  # a decode step's allocation is mostly empty
                    block_ids.extend([block.block_id for block in group])
        if budget is not None:
            budget = outcome.token_budget_left = max(0, budget - num_new)
        if entry is not None and options.delay_cache_blocks:
            outcome.delayed_keys.append(keys[k])

    return run


def _prepare_allocation(  # noqa: PLR0917 (private helper)
    x: _Execution,
    request: Request,
    num_new: int,
    entry: AllocOptions,
    deferred_hit: bool,
    lookahead: int,
    budget: int | None,
) -> tuple[int, CacheHit | None, SlotOptions] | None:
    """An ALLOCATE's options applied: ``(num_new, hit, options)`` to allocate with, or
    ``None`` once it answered without allocating (HIT_STALE, DOES_NOT_FIT, NO_TOKEN_BUDGET)."""
    pool, manager, outcome = x.pool, x.manager, x.outcome
    num_groups = manager.num_kv_cache_groups
    looked = entry.lookup is not None
    holds = manager.holds_blocks(request.request_id)
    if deferred_hit and not holds:
        assert entry.hit is not None
        try:
            check_hit(pool, manager, request, entry.hit, request.num_tokens)
        except FailedPreconditionError:
            _answer(outcome, _HIT_STALE, num_groups, None, None, 0)
            return None  # nothing adopted, nothing allocated
    options = entry.slot_options
    if not options.num_lookahead_tokens and lookahead:  # unset or 0: the Step's default
        options = replace(options, num_lookahead_tokens=lookahead)
    request.num_in_flight_tokens = entry.num_in_flight_tokens
    if holds and (looked or entry.hit is not None):
        # continue_on_does_not_fit: an earlier ALLOCATE of this request in the Step fit.
        pool.allocations_not_fit_total += 1
        _answer(outcome, _DOES_NOT_FIT, num_groups, None, 0 if looked else None, 0)
        return None
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
            return None
        return num_new, hit, options
    if entry.hit is not None:
        # The caller's lookup also found where a shared prefix ends (sparse retention).
        junction = entry.hit.shared_prefix_boundary
        if junction is not None:
            manager.set_shared_prefix_boundary(request.request_id, junction)
        return num_new, hit_of(manager, entry.hit), options
    return num_new, None, options


# ------------------------------------------------------- CACHE_BLOCKS, REMOVE_SKIPPED_BLOCKS
def _validate_commit(v: checks.Shadow) -> Handler:
    return lambda op_index, k, n: checks.check_commit(v, op_index, v.program.ops[op_index], k, n)


def _execute_cache(x: _Execution) -> Handler:
    manager, requests, keys = x.manager, x.pool.requests, x.program.request_keys
    column = x.program.cache_num_computed_tokens

    def run(op_index: int, k: int, n: int) -> None:
        request = requests[keys[k]]
        if manager.holds_blocks(request.request_id):  # else its ALLOCATE did not fit
            manager.cache_blocks(request, manager.num_cacheable_tokens(request, column[n]))

    return run


def _execute_skipped(x: _Execution) -> Handler:
    manager, requests, keys = x.manager, x.pool.requests, x.program.request_keys
    column = x.program.remove_skipped_total_computed_tokens

    def run(op_index: int, k: int, n: int) -> None:
        request_id = requests[keys[k]].request_id
        if manager.holds_blocks(request_id):  # else its ALLOCATE did not fit
            manager.remove_skipped_blocks(request_id, column[n])

    return run


# -------------------------------------------------------------- PREEMPT, FINISH(_DEFERRED)
def _validate_free(v: checks.Shadow) -> Handler:
    ops, state_of, table, discard = v.program.ops, v.state, v.table, v.allocated.discard
    preempt, holds_no = OpKind.PREEMPT, checks.HOLDS_NO

    def check(op_index: int, k: int, n: int) -> None:
        op = ops[op_index]
        key, state = state_of(op_index, op, k)
        if op == preempt:
            state[1] = holds_no
        else:
            table[key] = None
            discard(key)
            if v.swapped:
                v.swapped[key] = False  # a finished swapped request's host blocks are released

    return check


def _execute_free(x: _Execution) -> Handler:
    free, keys, ops, preempt = x.pool.free, x.program.request_keys, x.program.ops, OpKind.PREEMPT
    return lambda op_index, k, n: free(keys[k], preempt=ops[op_index] == preempt)


def _execute_free_deferred(x: _Execution) -> Handler:
    free, keys = x.pool.free, x.program.request_keys
    return lambda op_index, k, n: free(keys[k], preempt=False, in_one_call=True)


# ------------------------------------------------------------------------------ EVICT_BLOCKS
def _validate_evict(v: checks.Shadow) -> Handler:
    start = 0

    def check(op_index: int, k: int, n: int) -> None:
        nonlocal start
        start += checks.check_evict(v, op_index, n, start)

    return check


def _execute_evict(x: _Execution) -> Handler:
    manager, counts, ids = x.manager, x.program.evict_num_block_ids, x.program.evict_block_ids
    start = 0

    def run(op_index: int, k: int, n: int) -> None:
        nonlocal start
        count = counts[n]
        manager.evict_blocks(ids[start : start + count])
        start += count

    return run


# ----------------------------------------------------------------------- RECORD_PREFIX_STATS
def _validate_record(v: checks.Shadow) -> Handler:
    return lambda op_index, k, n: checks.check_record(v, op_index, k, n)


def _execute_record(x: _Execution) -> Handler:
    record, requests = x.manager.record_prefix_cache_stats, x.pool.requests
    keys, column = x.program.request_keys, x.program.record_hit_tokens
    return lambda op_index, k, n: record(requests[keys[k]], column[n])


# ------------------------------------------------------------------------------------ FORK
def _validate_fork(v: checks.Shadow) -> Handler:
    pool, manager, program = v.pool, v.manager, v.program
    children, computed = program.fork_child_keys, program.fork_num_computed_tokens
    kind = OpKind.FORK

    def check(op_index: int, k: int, n: int) -> None:
        key, state = v.state(op_index, kind, k)
        if n >= len(children) or n >= len(computed):
            column = "fork_child_keys" if n >= len(children) else "fork_num_computed_tokens"
            raise checks.too_few(op_index, kind, column)
        child, num_computed = children[n], computed[n]

        def fail(error: KVCMError, field: str) -> KVCMError:
            return checks.reject(error, op_index, kind, field)

        if not manager.fork_granule:
            raise fail(
                FailedPreconditionError(
                    f"pool {pool.name!r} cannot fork: its KV-cache groups must all be full "
                    "attention hashed at their own block size"
                ),
                f"request_keys[{k}]",
            )
        parent: Request = state[4]
        before = (
            pool.requests.get(key) is parent
            and parent.status is RequestStatus.RUNNING
            and manager.holds_blocks(parent.request_id)
        )
        # Allocated earlier in this program (a prompt admitted and forked in one Step, as
        # parallel samples are): the slots its ALLOCATEs give it, when that is exact.
        allocated = (
            _slots_allocated(program, op_index, key, pool.max_model_len)
            if key in v.allocated
            else None
        )
        if state[1] == checks.HOLDS_NO or (
            allocated is None and (key in v.allocated or not before)
        ):
            raise fail(
                FailedPreconditionError(
                    f"request key {key} must be running with blocks from before this Step, "
                    "or allocated earlier in it by plain ALLOCATEs in a Step that stops at "
                    "does-not-fit (not preempted, swapped or admitted with options), to be "
                    "forked"
                ),
                f"request_keys[{k}]",
            )
        live = v.table[child] is not None if child in v.table else child in pool.requests
        if live or child < 0:
            error: KVCMError = (
                AlreadyExistsError(pool.live_key_message(child))
                if live
                else InvalidArgumentError("key must be >= 0")
            )
            raise fail(error, f"fork_child_keys[{n}]")
        slots = (
            min(
                len(group.req_to_blocks[parent.request_id]) * group.block_size
                for group in manager.coordinator.single_type_managers
            )
            if before
            else 0
        )
        if allocated is not None:
            slots = max(slots, allocated)
        most = min(state[0], slots)
        if not 0 <= num_computed <= most:
            raise fail(
                InvalidArgumentError(
                    f"{num_computed} is outside 0..{most} (request key {key}'s tokens and slots)"
                ),
                f"fork_num_computed_tokens[{n}]",
            )
        shadow = Request(str(child), parent.prompt_token_ids, lora_id=parent.lora_id)
        tokens = state[3]
        v.table[child] = [
            state[0],
            checks.HOLDS_YES,
            state[2],
            list(tokens) if tokens is not None else None,
            shadow,
        ]
        v.allocated.discard(child)

    return check


def _slots_allocated(
    program: StepProgram, op_index: int, key: int, max_model_len: int
) -> int | None:
    """The fewest slots ``key`` holds at op ``op_index`` through the ALLOCATEs of it earlier
    in the program (``computed + new + lookahead`` tokens, capped at ``max_model_len``: every
    group's blocks hold at least that many), or ``None`` when that is not exact: the program
    runs on after does-not-fit (the FORK could follow an ALLOCATE that did not fit), or an
    ALLOCATE of it has options (a lookup, a hit, slot options), or another op allocated or
    freed its blocks (SWAP_OUT, SWAP_IN, ADMIT_WITH_HOST, PREEMPT)."""
    if program.continue_on_does_not_fit:
        return None
    ops, keys, options = program.ops, program.request_keys, program.alloc_options
    lookahead = program.default_num_lookahead_tokens
    position = ordinal = 0
    target: int | None = None
    for op in ops[:op_index]:
        keyed = _KEYED_BY_KIND[op] if op < _NUM_KINDS else 0
        mine = keyed and keys[position] == key
        if op == OpKind.ALLOCATE:
            if mine:
                if ordinal in options:
                    return None
                computed = program.alloc_num_computed_tokens[ordinal]
                target = computed + program.alloc_num_new_tokens[ordinal] + lookahead
            ordinal += 1
        elif mine and op in _ALLOCATING:
            return None
        position += keyed
    return None if target is None else min(target, max_model_len)


_ALLOCATING: Final = frozenset(
    {OpKind.SWAP_OUT, OpKind.SWAP_IN, OpKind.ADMIT_WITH_HOST, OpKind.PREEMPT}
)


def _execute_fork(x: _Execution) -> Handler:
    pool, keys = x.pool, x.program.request_keys
    children, computed = x.program.fork_child_keys, x.program.fork_num_computed_tokens

    def run(op_index: int, k: int, n: int) -> None:
        parent = keys[k]
        fork_request(pool, parent, children[n], pool.request_ids[parent], computed[n])

    return run


# ----------------------------------------------------- NEW_STEP_STARTS, RESET_PREFIX_CACHE
def _validate_nothing(v: checks.Shadow) -> Handler:
    return lambda op_index, k, n: None  # nothing to check: they take no columns


def _execute_new_step(x: _Execution) -> Handler:
    manager = x.manager

    def run(op_index: int, k: int, n: int) -> None:
        manager.new_step_starts()
        # vLLM's scheduler drains the attention block ids recorded for zeroing on every
        # step (take_new_block_ids); a pool fed by Steps (the vLLM mirror's copy) has no
        # other drain, so the ids a step recorded are dropped when the next one starts,
        # instead of growing with every block a Mamba pool ever allocated. A caller that
        # wants them takes them after its Step (TakeNewBlockIds), as before.
        manager.take_new_block_ids()

    return run


def _execute_reset(x: _Execution) -> Handler:
    manager, resets = x.manager, x.outcome.reset
    return lambda op_index, k, n: resets.append(manager.reset_prefix_cache())


# ---------------------------------------------------------------------- TAKE_BLOCK_COPIES
def _execute_take_copies(x: _Execution) -> Handler:
    # vLLM's scheduler drains the copies (take_kv_cache_block_copies) and, its connectors
    # deferring nothing beside Mamba layers, frees their retained ends at once.
    manager, outcome = x.manager, x.outcome
    drained, counts = outcome.drained_copy_block_ids, outcome.drained_num_copies

    def run(op_index: int, k: int, n: int) -> None:
        copies, retained = manager.take_kv_cache_block_copies()
        counts.append(len(copies))
        for source, destination in copies:
            drained.extend((source, destination))
        if retained:
            manager.block_pool.free_blocks(retained)

    return run


# ------------------------------------------- TAKE_BLOCK_COPIES_RETAINED, RELEASE_BLOCK_COPIES
def _validate_retain_copies(v: checks.Shadow) -> Handler:
    def check(op_index: int, k: int, n: int) -> None:
        v.retained_copy_batches += 1

    return check


def _execute_retain_copies(x: _Execution) -> Handler:
    # vLLM's scheduler when it defers frees (an asynchronous KV consumer): the drained copies'
    # blocks stay referenced until the step running the copies completed.
    manager, outcome = x.manager, x.outcome
    drained, counts = outcome.drained_copy_block_ids, outcome.drained_num_copies

    def run(op_index: int, k: int, n: int) -> None:
        copies, retained = manager.take_kv_cache_block_copies()
        counts.append(len(copies))
        for source, destination in copies:
            drained.extend((source, destination))
        manager.retain_block_copies(retained)

    return run


def _validate_release_copies(v: checks.Shadow) -> Handler:
    kind = OpKind.RELEASE_BLOCK_COPIES

    def check(op_index: int, k: int, n: int) -> None:
        if not v.retained_copy_batches:
            raise checks.reject(
                FailedPreconditionError(
                    f"pool {v.pool.name!r} retains no drained block copies to release "
                    "(TAKE_BLOCK_COPIES_RETAINED retains one drain per op)"
                ),
                op_index,
                kind,
                f"ops[{op_index}]",
            )
        v.retained_copy_batches -= 1

    return check


def _execute_release_copies(x: _Execution) -> Handler:
    release = x.manager.release_block_copies

    def run(op_index: int, k: int, n: int) -> None:
        release()

    return run


# ------------------------------------------------- SWAP_OUT, SWAP_IN, TAKE_HOST_COPIES
def _require_host_tier(v: checks.Shadow, op_index: int, op: int) -> None:
    """Refuse op ``op_index`` when the pool has no host tier, or one an engine's offloading
    connector keeps (FAILED_PRECONDITION)."""
    if v.pool.host_tier is not None:
        if v.pool.options.offload_host_blocks:
            raise checks.reject(
                FailedPreconditionError(
                    f"pool {v.pool.name!r}'s host tier is kept by an engine's offloading "
                    "connector (config.offload_host_blocks): it takes HOST_SYNC ops only"
                ),
                op_index,
                op,
                "config.offload_host_blocks",
            )
        return
    raise checks.reject(
        FailedPreconditionError(
            f"pool {v.pool.name!r} has no host tier (config.host_tier_bytes is 0)"
        ),
        op_index,
        op,
        "config.host_tier_bytes",
    )


def _validate_swap_out(v: checks.Shadow) -> Handler:
    pool, manager, kind = v.pool, v.manager, OpKind.SWAP_OUT
    column = v.program.swap_out_num_computed_tokens

    def check(op_index: int, k: int, n: int) -> None:
        _require_host_tier(v, op_index, kind)
        key, state = v.state(op_index, kind, k)
        if n >= len(column):
            raise checks.too_few(op_index, kind, "swap_out_num_computed_tokens")
        request: Request = state[4]
        if (
            pool.requests.get(key) is not request
            or key in v.allocated
            or state[1] == checks.HOLDS_NO
            or request.status is not RequestStatus.RUNNING
            or not manager.holds_blocks(request.request_id)
        ):
            raise checks.reject(
                FailedPreconditionError(
                    f"request key {key} must be running with blocks from before this Step "
                    "(not allocated, preempted or added earlier in it) to be swapped out"
                ),
                op_index,
                kind,
                f"request_keys[{k}]",
            )
        slots = min(
            len(group.req_to_blocks[request.request_id]) * group.block_size
            for group in manager.coordinator.single_type_managers
        )
        most = min(state[0], slots)
        if not 0 <= column[n] <= most:
            raise checks.reject(
                InvalidArgumentError(
                    f"{column[n]} is outside 0..{most} (request key {key}'s tokens and slots)"
                ),
                op_index,
                kind,
                f"swap_out_num_computed_tokens[{n}]",
            )
        state[1] = checks.HOLDS_NO
        v.allocated.add(key)  # no later op of this Step may allocate for it or swap it in
        v.swapped[key] = True

    return check


def _execute_swap_out(x: _Execution) -> Handler:
    pool, keys, swapped = x.pool, x.program.request_keys, x.outcome.swap_out_swapped
    column = x.program.swap_out_num_computed_tokens

    def run(op_index: int, k: int, n: int) -> None:
        key = keys[k]
        pool.requests[key].num_computed_tokens = column[n]
        if pool.swap_out(key) is None:  # no room in the tier: preempt by recomputation
            pool.free(key, preempt=True)
            swapped.append(False)
        else:
            swapped.append(True)

    return run


def _validate_swap_in(v: checks.Shadow) -> Handler:
    pool, column, kind = v.pool, v.program.swap_in_num_new_tokens, OpKind.SWAP_IN
    seen: set[int] = set()

    def check(op_index: int, k: int, n: int) -> None:
        _require_host_tier(v, op_index, kind)
        assert pool.host_tier is not None
        key, state = v.state(op_index, kind, k)
        if n >= len(column):
            raise checks.too_few(op_index, kind, "swap_in_num_new_tokens")
        request: Request = state[4]
        num_swapped = pool.host_tier.swapped_tokens(request.request_id)
        if (
            num_swapped is None
            or not v.is_swapped(key, request)
            or pool.requests.get(key) is not request
            or key in seen
            or key in v.allocated
            or v.holds(key, state) != checks.HOLDS_NO
        ):
            raise checks.reject(
                FailedPreconditionError(
                    f"request key {key} is not swapped out (before this Step, and not "
                    "allocated or swapped in earlier in it)"
                ),
                op_index,
                kind,
                f"request_keys[{k}]",
            )
        most = pool.max_model_len - num_swapped
        if not 0 <= column[n] <= most:
            raise checks.reject(
                InvalidArgumentError(
                    f"{column[n]} is outside 0..{most} (max_model_len {pool.max_model_len} "
                    f"after request key {key}'s {num_swapped} swapped tokens)"
                ),
                op_index,
                kind,
                f"swap_in_num_new_tokens[{n}]",
            )
        seen.add(key)
        v.allocated.add(key)
        v.swapped[key] = False
        state[1] = checks.HOLDS_MAYBE

    return check


def _execute_swap_in(x: _Execution) -> Handler:
    pool, manager, outcome = x.pool, x.manager, x.outcome
    keys, column = x.program.request_keys, x.program.swap_in_num_new_tokens
    no_blocks = [0] * manager.num_kv_cache_groups
    stop = not x.program.continue_on_does_not_fit

    def run(op_index: int, k: int, n: int) -> None:
        key = keys[k]
        admission = pool.swap_in(key, column[n])  # None: it stays swapped
        _answer_host(outcome, manager, pool.requests[key], admission, no_blocks)
        if admission is None and stop:
            raise _Stop

    return run


def _validate_admit_host(v: checks.Shadow) -> Handler:
    pool, column, kind = v.pool, v.program.admit_host_num_new_tokens, OpKind.ADMIT_WITH_HOST

    def check(op_index: int, k: int, n: int) -> None:
        _require_host_tier(v, op_index, kind)
        assert pool.host_tier is not None
        key, state = v.state(op_index, kind, k)
        if n >= len(column):
            raise checks.too_few(op_index, kind, "admit_host_num_new_tokens")
        request: Request = state[4]
        if (
            key in v.allocated
            or v.holds(key, state) != checks.HOLDS_NO
            or v.is_swapped(key, request)
        ):
            raise checks.reject(
                FailedPreconditionError(
                    f"request key {key} must be waiting (holding no blocks, not swapped out, "
                    "not allocated earlier in this Step) to be admitted with host hits"
                ),
                op_index,
                kind,
                f"request_keys[{k}]",
            )
        if not 1 <= column[n] <= pool.max_model_len:
            raise checks.reject(
                InvalidArgumentError(f"{column[n]} is outside 1..{pool.max_model_len}"),
                op_index,
                kind,
                f"admit_host_num_new_tokens[{n}]",
            )
        v.allocated.add(key)
        state[1] = checks.HOLDS_MAYBE

    return check


def _execute_admit_host(x: _Execution) -> Handler:
    pool, manager, outcome = x.pool, x.manager, x.outcome
    keys, column = x.program.request_keys, x.program.admit_host_num_new_tokens
    no_blocks = [0] * manager.num_kv_cache_groups
    stop = not x.program.continue_on_does_not_fit

    def run(op_index: int, k: int, n: int) -> None:
        key = keys[k]
        request = pool.requests[key]
        hit, num_host = looked_up = pool.lookup_tiers(key)
        num_new = min(column[n], request.num_tokens - hit.num_computed_tokens - num_host)
        admission = pool.admit_with_host(key, num_new, looked_up=looked_up)
        _answer_host(outcome, manager, request, admission, no_blocks)
        if admission is None and stop:
            raise _Stop

    return run


def _answer_host(
    outcome: StepOutcome,
    manager: KVCacheManager,
    request: Request,
    admission: HostAdmission | None,
    no_blocks: list[int],
) -> None:
    if admission is None:
        outcome.host_alloc_statuses.append(_DOES_NOT_FIT)
        outcome.host_alloc_num_block_ids.extend(no_blocks)
        outcome.host_alloc_num_device_hit_tokens.append(0)
        outcome.host_alloc_num_host_hit_tokens.append(0)
        return
    outcome.host_alloc_statuses.append(_OK)
    for group in manager.get_block_ids(request.request_id):
        outcome.host_alloc_num_block_ids.append(len(group))
        outcome.host_alloc_block_ids.extend(group)
    outcome.host_alloc_num_device_hit_tokens.append(admission.num_device_hit_tokens)
    outcome.host_alloc_num_host_hit_tokens.append(admission.num_host_hit_tokens)


def _validate_take_host_copies(v: checks.Shadow) -> Handler:
    def check(op_index: int, k: int, n: int) -> None:
        _require_host_tier(v, op_index, OpKind.TAKE_HOST_COPIES)

    return check


def _execute_take_host_copies(x: _Execution) -> Handler:
    host, outcome = x.pool.host_tier, x.outcome

    def run(op_index: int, k: int, n: int) -> None:
        assert host is not None
        d2h, h2d = host.take_copies()
        outcome.host_num_d2h.append(len(d2h))
        outcome.host_num_h2d.append(len(h2d))
        for pair in d2h:
            outcome.host_d2h_block_ids.extend(pair)
        for pair in h2d:
            outcome.host_h2d_block_ids.extend(pair)

    return run


# ---------------------------------------------------------------------------- HOST_SYNC
def _validate_host_sync(v: checks.Shadow) -> Handler:
    # Shapes only: every well-formed action has a meaning on any tier (apply_sync is total).
    pool, program, kind = v.pool, v.program, OpKind.HOST_SYNC
    actions, counts, group_ids = (
        program.host_sync_actions,
        program.host_sync_num_keys,
        program.host_sync_group_ids,
    )
    hash_length = pool.hashing.hash_length_bytes
    num_groups = len(v.manager.coordinator.single_type_managers)
    cursor = 0

    def check(op_index: int, k: int, n: int) -> None:
        nonlocal cursor
        if pool.host_tier is None or not pool.options.offload_host_blocks:
            raise checks.reject(
                FailedPreconditionError(
                    f"pool {pool.name!r} has no host tier kept by an engine's offloading "
                    "connector (config.offload_host_blocks is 0)"
                ),
                op_index,
                kind,
                "config.offload_host_blocks",
            )
        if n >= len(actions):
            raise checks.too_few(op_index, kind, "host_sync_actions")
        if n >= len(counts):
            raise checks.too_few(op_index, kind, "host_sync_num_keys")
        action, count = actions[n], counts[n]
        if action not in _SYNC_ACTIONS:
            raise checks.reject(
                InvalidArgumentError(
                    f"host_sync_actions[{n}]={action} is no SyncAction "
                    f"({min(_SYNC_ACTIONS)}..{max(_SYNC_ACTIONS)})"
                ),
                op_index,
                kind,
                f"host_sync_actions[{n}]",
            )
        if count < 0 or (action == SyncAction.CLEAR and count):
            raise checks.reject(
                InvalidArgumentError(
                    f"host_sync_num_keys[{n}]={count} is out of range (CLEAR takes no keys)"
                ),
                op_index,
                kind,
                f"host_sync_num_keys[{n}]",
            )
        end = cursor + count
        if end > len(group_ids):
            raise checks.too_few(op_index, kind, "host_sync_group_ids")
        if end * hash_length > len(program.host_sync_keys):
            raise checks.too_few(op_index, kind, "host_sync_keys")
        for position in range(cursor, end):
            if not 0 <= group_ids[position] < num_groups:
                raise checks.reject(
                    InvalidArgumentError(
                        f"host_sync_group_ids[{position}]={group_ids[position]} is outside "
                        f"[0, {num_groups})"
                    ),
                    op_index,
                    kind,
                    f"host_sync_group_ids[{position}]",
                )
        cursor = end

    return check


def _execute_host_sync(x: _Execution) -> Handler:
    program, host = x.program, x.pool.host_tier
    actions, counts, group_ids = (
        program.host_sync_actions,
        program.host_sync_num_keys,
        program.host_sync_group_ids,
    )
    raw = program.host_sync_keys
    hash_length = x.pool.hashing.hash_length_bytes
    tokens_per_key = [m.block_size for m in x.manager.coordinator.single_type_managers]
    cursor = 0

    def run(op_index: int, k: int, n: int) -> None:
        nonlocal cursor
        assert host is not None
        end = cursor + counts[n]
        keys = [
            make_block_hash_with_group_id(
                BlockHash(raw[i * hash_length : (i + 1) * hash_length]), group_ids[i]
            )
            for i in range(cursor, end)
        ]
        cursor = end
        apply_sync(host, actions[n], keys, tokens_per_key)

    return run


_SYNC_ACTIONS: Final = frozenset(int(action) for action in SyncAction)


# ------------------------------------------------------------------------ COMMON_BLOCKS
def _validate_common(v: checks.Shadow) -> Handler:
    pool, program, kind = v.pool, v.program, OpKind.COMMON_BLOCKS
    counts, keys = program.common_num_keys, program.common_keys
    cursor = 0

    def check(op_index: int, k: int, n: int) -> None:
        nonlocal cursor
        if n >= len(counts):
            raise checks.too_few(op_index, kind, "common_num_keys")
        count = counts[n]
        if count < 1:
            raise checks.reject(
                InvalidArgumentError(f"common_num_keys[{n}]={count}: at least one request"),
                op_index,
                kind,
                f"common_num_keys[{n}]",
            )
        end = cursor + count
        if end > len(keys):
            raise checks.too_few(op_index, kind, "common_keys")
        for position in range(cursor, end):
            key = keys[position]
            live = v.table[key] is not None if key in v.table else key in pool.requests
            if not live:
                raise checks.reject(
                    NotFoundError(f"request key {key} is not live in pool {pool.name!r}"),
                    op_index,
                    kind,
                    f"common_keys[{position}]",
                )
        cursor = end

    return check


def _execute_common(x: _Execution) -> Handler:
    # V0's get_common_computed_block_ids: per group, the leading cached blocks every request
    # holds at the same positions (a request holding no blocks has none).
    manager, program, outcome = x.manager, x.program, x.outcome
    counts, keys = program.common_num_keys, program.common_keys
    holds = manager.holds_blocks
    groups = manager.coordinator.single_type_managers
    cursor = 0

    def run(op_index: int, k: int, n: int) -> None:
        nonlocal cursor
        end = cursor + counts[n]
        request_ids = [str(key) for key in keys[cursor:end]]
        cursor = end
        if all(holds(request_id) for request_id in request_ids):
            answer = common_computed_block_ids(manager, request_ids)
        else:
            answer = tuple([] for _ in groups)
        for common in answer:
            outcome.common_num_block_ids.append(len(common))
            outcome.common_block_ids.extend(common)

    return run


# -------------------------------------------------------------------------- EXTEND_PROMPT
def _validate_extend(v: checks.Shadow) -> Handler:
    prompt_ends: dict[int, tuple[list[Any], int]] = {}
    return lambda op_index, k, n: checks.check_extend_prompt(v, op_index, k, n, prompt_ends)


def _execute_extend(x: _Execution) -> Handler:
    requests, keys = x.pool.requests, x.program.request_keys
    column = x.program.extend_prompt_num_tokens

    def run(op_index: int, k: int, n: int) -> None:
        request = requests[keys[k]]
        end = column[n]
        start = request.num_prompt_tokens
        if end > start:
            request.prompt_token_ids.extend(request.all_token_ids[start:end])
            request.num_prompt_tokens = end

    return run


# ----------------------------------------------------------------------------- REPORT_HIT
def _validate_report(v: checks.Shadow) -> Handler:
    start = 0

    def check(op_index: int, k: int, n: int) -> None:
        nonlocal start
        start += checks.check_report_hit(v, op_index, k, n, start)

    return check


def _execute_report(x: _Execution) -> Handler:
    requests, keys, program = x.pool.requests, x.program.request_keys, x.program
    coordinator, events = x.manager.coordinator, x.manager.block_pool.enable_kv_cache_events
    counts, blocks = program.report_hit_num_groups, program.report_hit_num_blocks
    start = 0

    def run(op_index: int, k: int, n: int) -> None:
        nonlocal start
        end = start + counts[n]
        request = requests[keys[k]]
        if events and request.report_cached_blocks:
            coordinator.emit_cached_block_counts(request, blocks[start:end])
        start = end

    return run


_Pair: TypeAlias = tuple[Callable[[checks.Shadow], Handler], Callable[[_Execution], Handler]]
_PAIRS: Final[dict[int, _Pair]] = {
    OpKind.ADD_REQUEST: (_validate_add, _execute_add),
    OpKind.APPEND_TOKENS: (_validate_append, _execute_append),
    OpKind.ALLOCATE: (_validate_allocate, _execute_allocate),
    OpKind.CACHE_BLOCKS: (_validate_commit, _execute_cache),
    OpKind.REMOVE_SKIPPED_BLOCKS: (_validate_commit, _execute_skipped),
    OpKind.PREEMPT: (_validate_free, _execute_free),
    OpKind.FINISH: (_validate_free, _execute_free),
    OpKind.NEW_STEP_STARTS: (_validate_nothing, _execute_new_step),
    OpKind.EVICT_BLOCKS: (_validate_evict, _execute_evict),
    OpKind.RESET_PREFIX_CACHE: (_validate_nothing, _execute_reset),
    OpKind.RECORD_PREFIX_STATS: (_validate_record, _execute_record),
    OpKind.FORK: (_validate_fork, _execute_fork),
    OpKind.TAKE_BLOCK_COPIES: (_validate_nothing, _execute_take_copies),
    OpKind.SWAP_OUT: (_validate_swap_out, _execute_swap_out),
    OpKind.SWAP_IN: (_validate_swap_in, _execute_swap_in),
    OpKind.TAKE_HOST_COPIES: (_validate_take_host_copies, _execute_take_host_copies),
    OpKind.ADMIT_WITH_HOST: (_validate_admit_host, _execute_admit_host),
    OpKind.HOST_SYNC: (_validate_host_sync, _execute_host_sync),
    OpKind.COMMON_BLOCKS: (_validate_common, _execute_common),
    OpKind.FINISH_DEFERRED: (_validate_free, _execute_free_deferred),
    OpKind.TAKE_BLOCK_COPIES_RETAINED: (_validate_retain_copies, _execute_retain_copies),
    OpKind.RELEASE_BLOCK_COPIES: (_validate_release_copies, _execute_release_copies),
    OpKind.EXTEND_PROMPT: (_validate_extend, _execute_extend),
    OpKind.REPORT_HIT: (_validate_report, _execute_report),
}
"""Per op kind, its validate and execute handlers' makers (one row per op table row)."""
assert set(_PAIRS) == set(OP_TABLE), "every op kind has a validate and an execute handler"


def hit_of(manager: KVCacheManager, hit: HitSpec) -> CacheHit:
    """The core's ``CacheHit`` of a checked :class:`HitSpec`."""
    blocks = manager.block_pool.blocks
    return CacheHit(
        KVCacheBlocks(tuple([blocks[i] for i in group] for group in hit.block_ids)),
        hit.num_tokens,
    )


def _answer(  # noqa: PLR0917 (private helper)
    outcome: StepOutcome,
    status: int | None,
    num_groups: int,
    ids: tuple[list[int], ...] | None,
    hit_tokens: int | None,
    num_new: int,
) -> None:
    """One allocation's answer (``hit_tokens`` set: it looked the request up; ``status``
    ``None``: appended already)."""
    if status is not None:
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
