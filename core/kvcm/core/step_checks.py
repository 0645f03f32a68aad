"""The Step program's checks: validation against a shadow of the request table.

:func:`validate_program` is the half of :mod:`kvcm.core.step` that decides whether a program
runs at all; the unary calls of :class:`~kvcm.core.pool.Pool` use the same functions
(:func:`check_new_request`, :func:`check_append`, :func:`check_hit`). See
:mod:`kvcm.core.step` for the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from kvcm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCMError,
    NotFoundError,
    ResourceExhaustedError,
)
from kvcm.common.hashing import BlockHash
from kvcm.core.block_pool import _group_suffix
from kvcm.core.limits import Limits
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS
from kvcm.core.program import (
    NO_LOOKUP_BOUND,
    AllocOptions,
    HitSpec,
    ItemStatus,
    OpKind,
    StepProgram,
)
from kvcm.core.request import Request
from kvcm.core.single_type_managers import hashes_at_block_size

if TYPE_CHECKING:
    from kvcm.core.manager import KVCacheManager
    from kvcm.core.pool import Pool

__all__ = [
    "check_append",
    "check_hit",
    "check_limits",
    "check_new_request",
    "validate_program",
]

_ADD: Final = int(OpKind.ADD_REQUEST)
_APPEND: Final = int(OpKind.APPEND_TOKENS)
_ALLOCATE: Final = int(OpKind.ALLOCATE)
_CACHE: Final = int(OpKind.CACHE_BLOCKS)
_SKIPPED: Final = int(OpKind.REMOVE_SKIPPED_BLOCKS)
_PREEMPT: Final = int(OpKind.PREEMPT)
_FINISH: Final = int(OpKind.FINISH)
_NEW_STEP: Final = int(OpKind.NEW_STEP_STARTS)
_EVICT: Final = int(OpKind.EVICT_BLOCKS)
_RESET: Final = int(OpKind.RESET_PREFIX_CACHE)
_RECORD: Final = int(OpKind.RECORD_PREFIX_STATS)
_OK: Final = int(ItemStatus.OK)
_DOES_NOT_FIT: Final = int(ItemStatus.DOES_NOT_FIT)
_NO_TOKEN_BUDGET: Final = int(ItemStatus.NO_TOKEN_BUDGET)
# Shadow "holds blocks" states: unknown (ask the core), no, yes, maybe (allocated in this
# program: it may not have fit).
_UNKNOWN, _NO, _YES, _MAYBE = -1, 0, 1, 2
_NONE_DEFERRED: frozenset[int] = frozenset()


def _name(op: int) -> str:
    try:
        return OpKind(op).name
    except ValueError:
        return str(op)


def _reject(error: KVCMError, op_index: int | None, op: int, field: str) -> KVCMError:
    """``error`` for op ``op_index`` (or the program as a whole), naming ``field``."""
    if op_index is None:
        error.field, error.op_index = field, None
        return error
    prefixed = type(error)(f"ops[{op_index}] {_name(op)}: {error}", field=field, op_index=op_index)
    return prefixed


def _too_few(op_index: int, op: int, column: str) -> KVCMError:
    return _reject(InvalidArgumentError(f"{column} has too few entries"), op_index, op, column)


def check_limits(limits: Limits, program: StepProgram) -> None:
    """The service's limits on one program, checked before anything else.

    Raises:
        ResourceExhaustedError: More ops or token ids than the limits allow (names the limit).
    """
    if len(program.ops) > limits.max_step_ops:
        raise ResourceExhaustedError(
            f"the Step has {len(program.ops)} ops, more than max_step_ops {limits.max_step_ops}",
            field="max_step_ops",
        )
    num_tokens = len(program.append_token_ids)
    if num_tokens <= limits.max_step_tokens:
        for new in program.new_requests:
            num_tokens += len(new.prompt_token_ids)
    if num_tokens > limits.max_step_tokens:
        raise ResourceExhaustedError(
            f"the Step carries more than max_step_tokens {limits.max_step_tokens} token ids",
            field="max_step_tokens",
        )


# ----------------------------------------------------------------------------- validation
class _Shadow:
    """One validation pass: the shadow request table and the cold ops' cursors.

    ``table`` maps a request key to ``[num_tokens, holds blocks, num_hashes, tokens or None]``
    (tokens only when the pool verifies hashes), or to ``None`` once finished in this program.
    """

    __slots__ = (
        "allocated",
        "deferred_hits",
        "evicting",
        "keys",
        "manager",
        "n_add",
        "n_cache",
        "n_evict",
        "n_evict_ids",
        "n_record",
        "n_skipped",
        "pool",
        "program",
        "table",
        "verify",
    )

    def __init__(self, pool: Pool, manager: KVCacheManager, program: StepProgram) -> None:
        self.pool = pool
        self.manager = manager
        self.program = program
        self.keys = program.request_keys
        self.table: dict[int, list[Any] | None] = {}
        self.verify = pool.options.verify_block_hashes
        self.n_add = self.n_cache = self.n_skipped = self.n_evict = self.n_evict_ids = 0
        self.n_record = 0
        self.evicting = False  # an op that can evict cached blocks was seen
        self.allocated: set[int] = set()
        self.deferred_hits: set[int] = set()  # alloc indices whose hit is checked at run time

    def state(self, op_index: int, op: int, k: int) -> tuple[int, list[Any]]:
        """The shadow of the request named by ``request_keys[k]`` (first sight: the table)."""
        if k >= len(self.keys):
            raise _too_few(op_index, op, "request_keys")
        key = self.keys[k]
        state = self.table.get(key)
        if state is None:
            request = None if key in self.table else self.pool.requests.get(key)
            if request is None:
                raise _reject(
                    NotFoundError(
                        f"request_keys[{k}]={key} is not live in pool {self.pool.name!r}"
                    ),
                    op_index,
                    op,
                    f"request_keys[{k}]",
                )
            tokens = list(request.all_token_ids) if self.verify else None
            state = [request.num_tokens, _UNKNOWN, len(request.block_hashes), tokens, request]
            self.table[key] = state
        return key, state

    def holds(self, key: int, state: list[Any]) -> int:
        """The shadow's "holds blocks" state (asked of the core once)."""
        if state[1] == _UNKNOWN:
            request = state[4]
            assert isinstance(request, Request)
            state[1] = _YES if self.manager.holds_blocks(request.request_id) else _NO
        value = state[1]
        assert isinstance(value, int)
        return value


def validate_program(pool: Pool, manager: KVCacheManager, program: StepProgram) -> frozenset[int]:
    """Validate a whole program against the pool without changing anything.

    Returns:
        The ALLOCATE indices whose caller-supplied hit must be checked against the cache when
        the op runs (an earlier op may evict, or the Step appends the hashes it needs).

    Raises:
        KVCMError: The first failing op (``op_index`` set) or the malformed program.
    """
    _check_program_fields(program)
    v = _Shadow(pool, manager, program)
    keys = program.request_keys
    num_keys = len(keys)
    max_model_len = pool.max_model_len
    hash_block_size = pool.hashing.hash_block_size if pool.options.enable_caching else 0
    hash_length = pool.hashing.hash_length_bytes
    options_by_index = program.alloc_options
    alloc_new = program.alloc_num_new_tokens
    alloc_computed = program.alloc_num_computed_tokens
    num_allocs = min(len(alloc_new), len(alloc_computed))
    append_tokens = program.append_num_tokens
    append_hashes = program.append_num_block_hashes
    num_appends = min(len(append_tokens), len(append_hashes))
    num_token_ids = len(program.append_token_ids)
    num_hash_bytes = len(program.append_block_hashes)
    verify = v.verify
    table_get = v.table.get
    k = n_append = n_alloc = token_cursor = hash_cursor = 0
    # APPEND_TOKENS and ALLOCATE are a decode step's ops: checked inline, with a fast test that
    # sends only suspicious ops to the full checks (which produce the messages).
    for op_index, op in enumerate(program.ops):
        if op == _APPEND:
            state = table_get(keys[k]) if k < num_keys else None
            key, state = (keys[k], state) if state is not None else v.state(op_index, op, k)
            k += 1
            if n_append >= num_appends:
                raise _too_few(op_index, op, "append_num_tokens")
            num_tokens = append_tokens[n_append]
            num_hashes = append_hashes[n_append]
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
                    and not _hashes_expected(
                        before, num_tokens, num_hashes, hashes_before, hash_block_size
                    )
                )
            ):
                _check_append_slow(
                    v, op_index, key, n_append, before, hashes_before,
                    num_tokens=num_tokens, num_hashes=num_hashes,
                    short=token_cursor > num_token_ids or hash_cursor > num_hash_bytes,
                )  # fmt: skip
            state[0] = before + num_tokens
            state[2] = hashes_before + num_hashes
            if verify:
                _verify_append(v, op_index, n_append, state, start, num_tokens, num_hashes)
            n_append += 1
        elif op == _ALLOCATE:
            state = table_get(keys[k]) if k < num_keys else None
            key, state = (keys[k], state) if state is not None else v.state(op_index, op, k)
            k += 1
            if n_alloc >= num_allocs:
                raise _too_few(op_index, op, "alloc_num_new_tokens")
            num_new = alloc_new[n_alloc]
            num_computed = alloc_computed[n_alloc]
            entry = options_by_index.get(n_alloc) if options_by_index else None
            have = state[0]
            if (
                entry is not None
                or num_computed < 0
                or num_computed > have
                or num_new <= 0
                or num_computed + num_new > max_model_len
            ):
                _check_allocate(v, op_index, key, state, num_new, num_computed, entry, n_alloc)
            v.allocated.add(key)
            if state[1] != _YES:
                state[1] = _MAYBE
            v.evicting = True
            n_alloc += 1
        else:
            k = _check_cold_op(v, op_index, op, k)
    _check_consumed(v, k, n_alloc, n_append, token_cursor, hash_cursor)
    if options_by_index and max(options_by_index) >= n_alloc:
        raise InvalidArgumentError(
            f"alloc_options names alloc index {max(options_by_index)} but the Step has "
            f"{n_alloc} ALLOCATE ops",
            field="alloc_options",
        )
    return frozenset(v.deferred_hits) if v.deferred_hits else _NONE_DEFERRED


def _check_program_fields(program: StepProgram) -> None:
    """The program-wide scalars."""
    if program.default_num_lookahead_tokens < 0:
        raise InvalidArgumentError(
            "default_num_lookahead_tokens must be >= 0, got "
            f"{program.default_num_lookahead_tokens}",
            field="default_num_lookahead_tokens",
        )
    if program.token_budget is not None and program.token_budget < 0:
        raise InvalidArgumentError(
            f"token_budget must be >= 0, got {program.token_budget}", field="token_budget"
        )
    for index in program.alloc_options:
        if index < 0:
            raise InvalidArgumentError(
                f"alloc_options has a negative alloc index {index}", field="alloc_options"
            )


def _hashes_expected(
    before: int, num_tokens: int, num_hashes: int, hashes_before: int, hash_block_size: int
) -> bool:
    """Whether an append's hashes are the ones it must carry (see ``check_append``)."""
    if not hash_block_size:
        return False
    return (
        hashes_before == before // hash_block_size
        and num_hashes == (before + num_tokens) // hash_block_size - before // hash_block_size
    )


def _check_append_slow(  # noqa: PLR0917 (private helper)
    v: _Shadow,
    op_index: int,
    key: int,
    n_append: int,
    before: int,
    hashes_before: int,
    *,
    num_tokens: int,
    num_hashes: int,
    short: bool,
) -> None:
    field = f"append_num_tokens[{n_append}]"
    if num_hashes < 0:
        raise _reject(
            InvalidArgumentError(f"append_num_block_hashes[{n_append}] must be >= 0"),
            op_index,
            _APPEND,
            f"append_num_block_hashes[{n_append}]",
        )
    if num_tokens < 0:
        raise _reject(
            InvalidArgumentError(f"{field} must be > 0, got {num_tokens}"), op_index, _APPEND, field
        )
    if short:
        raise _reject(
            InvalidArgumentError("append_token_ids or append_block_hashes is too short"),
            op_index,
            _APPEND,
            field,
        )
    try:
        check_append(
            v.pool, key, num_tokens, num_hashes, num_before=before, hashes_before=hashes_before
        )
    except InvalidArgumentError as exc:
        raise _reject(exc, op_index, _APPEND, field) from None


def check_append(
    pool: Pool, key: int, num_tokens: int, num_hashes: int, *, num_before: int, hashes_before: int
) -> None:
    """Validate an append of ``num_tokens`` tokens with ``num_hashes`` hashes.

    A request whose hashes cover all its full blocks sends the hashes of the blocks the
    tokens fill, or none (it then stays unhashed beyond that point); a request already
    behind sends none.

    Raises:
        InvalidArgumentError: No tokens, beyond max_model_len, wrong number of hashes.
    """
    if num_tokens <= 0:
        raise InvalidArgumentError(f"request key {key}: token_ids must not be empty")
    total = num_before + num_tokens
    if total > pool.max_model_len:
        raise InvalidArgumentError(
            f"request key {key}: {total} tokens exceed max_model_len {pool.max_model_len}"
        )
    if num_hashes == 0:
        return
    expected_before = pool.expected_num_hashes(num_before)
    expected = pool.expected_num_hashes(total) - expected_before
    if hashes_before != expected_before:
        raise InvalidArgumentError(
            f"request key {key}: block_hashes must be empty: the request carries "
            f"{hashes_before} of its {expected_before} block hashes"
        )
    if num_hashes != expected:
        raise InvalidArgumentError(
            f"request key {key}: block_hashes must hold {expected} hashes for the blocks "
            f"the tokens fill (or none), got {num_hashes}"
        )


def _verify_append(  # noqa: PLR0917 (private helper)
    v: _Shadow,
    op_index: int,
    n_append: int,
    state: list[Any],
    start: int,
    num_tokens: int,
    num_hashes: int,
) -> None:
    # verify_block_hashes (a debugging option): hash the shadow's tokens like the server.
    tokens = state[3]
    request = state[4]
    assert isinstance(tokens, list)
    assert isinstance(request, Request)
    tokens.extend(v.program.append_token_ids[start : start + num_tokens])
    if not num_hashes:
        return
    size = v.pool.hashing.hash_length_bytes
    first = int(state[2]) - num_hashes
    offset = sum(v.program.append_num_block_hashes[:n_append]) * size
    raw = v.program.append_block_hashes[offset : offset + num_hashes * size]
    sent = [BlockHash(raw[i : i + size]) for i in range(0, len(raw), size)]
    if (
        v.pool.computed_hashes(tokens, request.lora_name, request.cache_salt)[first:][:num_hashes]
        != sent
    ):
        raise _reject(
            InvalidArgumentError(
                f"request key {request.request_id}: block_hashes differ from the server's"
            ),
            op_index,
            _APPEND,
            f"append_block_hashes[{n_append}]",
        )


def _check_allocate(  # noqa: PLR0917 (private helper)
    v: _Shadow,
    op_index: int,
    key: int,
    state: list[Any],
    num_new: int,
    num_computed: int,
    entry: AllocOptions | None,
    index: int,
) -> None:
    num_tokens = state[0]
    assert isinstance(num_tokens, int)
    max_model_len = v.pool.max_model_len

    def reject(
        message: str, field: str, error: type[KVCMError] = InvalidArgumentError
    ) -> KVCMError:
        return _reject(error(message), op_index, _ALLOCATE, field)

    if num_computed < 0:
        raise reject(
            f"alloc_num_computed_tokens[{index}] must be >= 0, got {num_computed}",
            f"alloc_num_computed_tokens[{index}]",
        )
    if num_new < 0:
        raise reject(
            f"alloc_num_new_tokens[{index}] must be >= 0, got {num_new}",
            f"alloc_num_new_tokens[{index}]",
        )
    if num_computed > num_tokens:
        raise reject(
            f"alloc_num_computed_tokens[{index}]={num_computed} exceeds the request's "
            f"{num_tokens} tokens",
            f"alloc_num_computed_tokens[{index}]",
        )
    options = entry.slot_options if entry is not None else DEFAULT_SLOT_OPTIONS
    hit_tokens = 0
    if entry is not None:
        _check_alloc_options(v, entry, index, num_tokens, num_computed, reject)
        if entry.lookup is not None or entry.hit is not None:
            where = "lookup" if entry.lookup is not None else "hit"
            if num_computed:
                raise reject(
                    f"alloc_num_computed_tokens[{index}]={num_computed}: an ALLOCATE with a "
                    f"{where} is for a request with no computed tokens",
                    f"alloc_num_computed_tokens[{index}]",
                )
            if key in v.allocated and not v.program.continue_on_does_not_fit:
                raise reject(
                    f"an ALLOCATE with a {where} follows another ALLOCATE of request key {key}",
                    f"alloc_options[{index}].{where}",
                )
            if v.holds(key, state) == _YES:
                raise reject(
                    f"alloc_options[{index}]: a {where} for a request that holds blocks",
                    f"alloc_options[{index}].{where}",
                )
        if entry.lookup is not None:
            return  # the lookup caps num_new_tokens at execution
        if entry.hit is not None:
            request = state[4]
            assert isinstance(request, Request)
            # The cache part of the check is exact here only when nothing earlier in the
            # program can evict and the request's hashes are all in the table already;
            # otherwise the interpreter checks it when the ALLOCATE runs (HIT_STALE).
            deferred = v.evicting or state[2] != len(request.block_hashes)
            try:
                check_hit(v.pool, v.manager, request, entry.hit, num_tokens, cache=not deferred)
            except KVCMError as exc:
                raise _reject(exc, op_index, _ALLOCATE, f"alloc_options[{index}].hit") from None
            if deferred:
                v.deferred_hits.add(index)
            hit_tokens = entry.hit.num_tokens
    if num_new == 0 and hit_tokens == 0 and options.num_external_computed_tokens == 0:
        raise reject(
            f"alloc_num_new_tokens[{index}] must be > 0 when there is nothing to adopt",
            f"alloc_num_new_tokens[{index}]",
        )
    if num_computed + hit_tokens + num_new > max_model_len:
        raise reject(
            f"alloc_num_computed_tokens[{index}] + hit + alloc_num_new_tokens[{index}] = "
            f"{num_computed + hit_tokens + num_new} exceeds max_model_len {max_model_len}",
            f"alloc_num_new_tokens[{index}]",
        )


def _check_alloc_options(  # noqa: PLR0917 (private helper)
    v: _Shadow,
    entry: AllocOptions,
    index: int,
    num_tokens: int,
    num_computed: int,
    reject: object,
) -> None:
    assert callable(reject)
    options = entry.slot_options
    field = f"alloc_options[{index}]"
    if entry.lookup is not None and entry.hit is not None:
        raise reject(f"{field}: lookup and hit are exclusive", f"{field}.hit")
    if entry.lookup is not None and entry.lookup < NO_LOOKUP_BOUND:
        raise reject(
            f"{field}.lookup must be >= 0 (or -1: the default), got {entry.lookup}",
            f"{field}.lookup",
        )
    if entry.num_in_flight_tokens < 0:
        raise reject(f"{field}.num_in_flight_tokens must be >= 0", f"{field}.num_in_flight_tokens")
    for name in (
        "num_lookahead_tokens",
        "num_external_computed_tokens",
        "num_encoder_tokens",
        "reserved_blocks",
    ):
        value = getattr(options, name)
        if value < 0:
            raise reject(
                f"{field}.options.{name} must be >= 0, got {value}", f"{field}.options.{name}"
            )
    external = options.num_external_computed_tokens
    if num_computed + external > num_tokens:
        raise reject(
            f"{field}.options.num_external_computed_tokens={external}: with "
            f"{num_computed} computed tokens it exceeds the request's {num_tokens} tokens",
            f"{field}.options.num_external_computed_tokens",
        )
    pool = v.pool
    if options.num_lookahead_tokens > pool.max_model_len:
        raise reject(
            f"{field}.options.num_lookahead_tokens={options.num_lookahead_tokens} exceeds "
            f"max_model_len {pool.max_model_len}",
            f"{field}.options.num_lookahead_tokens",
        )
    capacity = v.manager.block_pool.num_gpu_blocks * max(
        m.block_size for m in v.manager.coordinator.single_type_managers
    )
    if options.num_encoder_tokens > capacity:
        raise reject(
            f"{field}.options.num_encoder_tokens={options.num_encoder_tokens} exceeds the "
            f"pool's {capacity} token slots",
            f"{field}.options.num_encoder_tokens",
        )
    if options.reserved_blocks > v.manager.block_pool.num_gpu_blocks:
        raise reject(
            f"{field}.options.reserved_blocks={options.reserved_blocks} exceeds the pool's "
            f"{v.manager.block_pool.num_gpu_blocks} blocks",
            f"{field}.options.reserved_blocks",
        )


def check_hit(
    pool: Pool,
    manager: KVCacheManager,
    request: Request,
    hit: HitSpec,
    num_tokens: int,
    *,
    cache: bool = True,
) -> None:
    """Check a caller-supplied hit against the prefix cache as it is now.

    Every hit block must hold the request's block hash at its position (for its group's
    block size); the null block only where that group's manager skips blocks. With ``cache``
    false only the shape is checked (groups, lengths, ids, null blocks): the program checks
    the cache part when its ALLOCATE runs.

    Raises:
        InvalidArgumentError: Wrong number of groups, an id outside the pool, a hit longer
            than the request, groups of different lengths in tokens.
        FailedPreconditionError: A block no longer holds the request's hash (look the request
            up again).
    """
    groups = hit.block_ids
    if len(groups) != manager.num_kv_cache_groups:
        raise InvalidArgumentError(
            f"hit has {len(groups)} groups, the pool {manager.num_kv_cache_groups}"
        )
    if not 0 <= hit.num_tokens <= num_tokens:
        raise InvalidArgumentError(
            f"hit.num_tokens must be in [0, {num_tokens}], got {hit.num_tokens}"
        )
    block_pool = manager.block_pool
    num_blocks = block_pool.num_gpu_blocks
    managers = manager.coordinator.single_type_managers
    hash_block_size = block_pool.hash_block_size
    for group_id, (ids, group) in enumerate(zip(groups, managers, strict=True)):
        if not ids:
            continue
        if len(ids) * group.block_size < hit.num_tokens or (
            (len(ids) - 1) * group.block_size >= hit.num_tokens
        ):
            raise InvalidArgumentError(
                f"hit group {group_id}: {len(ids)} blocks of {group.block_size} tokens do not "
                f"cover hit.num_tokens={hit.num_tokens}"
            )
        hashes = hashes_at_block_size(request.block_hashes, hash_block_size, group.block_size)
        suffix = _group_suffix(group_id)
        for position, block_id in enumerate(ids):
            if not 0 <= block_id < num_blocks:
                raise InvalidArgumentError(f"hit block id {block_id} is outside [0, {num_blocks})")
            if block_id == 0:
                if group.skips_tokens:
                    continue
                raise FailedPreconditionError(
                    f"hit group {group_id} position {position}: the null block stands only "
                    "where a group skips blocks; look the request up again"
                )
            if not cache:
                continue
            if position >= len(hashes) or not block_pool._maps_to(
                hashes[position] + suffix,  # type: ignore[arg-type]
                block_id,
            ):
                raise FailedPreconditionError(
                    f"hit block {block_id} (group {group_id}, position {position}) does not "
                    "hold the request's block hash now; look the request up again"
                )


def _check_cold_op(v: _Shadow, op_index: int, op: int, k: int) -> int:
    """Check an op other than APPEND_TOKENS and ALLOCATE; returns the next key cursor."""
    if op == _NEW_STEP:
        return k
    if op == _RESET:
        v.evicting = True
        return k
    if op == _ADD:
        _check_add(v, op_index)
        return k
    if op == _EVICT:
        _check_evict(v, op_index)
        v.evicting = True
        return k
    if op in (_CACHE, _SKIPPED):
        _check_commit(v, op_index, op, k)
        return k + 1
    if op == _RECORD:
        _check_record(v, op_index, k)
        return k + 1
    if op == _PREEMPT:
        _, state = v.state(op_index, op, k)
        state[1] = _NO
        return k + 1
    if op == _FINISH:
        key, _ = v.state(op_index, op, k)
        v.table[key] = None
        v.allocated.discard(key)
        return k + 1
    raise _reject(
        InvalidArgumentError(f"ops[{op_index}] has unknown kind {op}"),
        op_index,
        op,
        f"ops[{op_index}]",
    )


def _check_add(v: _Shadow, op_index: int) -> None:
    program = v.program
    n_add = v.n_add
    if n_add >= len(program.new_requests):
        raise _too_few(op_index, _ADD, "new_requests")
    new = program.new_requests[n_add]
    field = f"new_requests[{n_add}]"
    key = new.key
    live = v.table[key] is not None if key in v.table else key in v.pool.requests
    if live:
        error = AlreadyExistsError(v.pool.live_key_message(key))
        raise _reject(error, op_index, _ADD, field)
    try:
        check_new_request(v.pool, new.key, new.prompt_token_ids, new.block_hashes, new.lora_id)
    except InvalidArgumentError as exc:
        raise _reject(exc, op_index, _ADD, field) from None
    if key < 0:
        raise _reject(InvalidArgumentError("key must be >= 0"), op_index, _ADD, field)
    if v.verify and new.block_hashes:
        size = v.pool.hashing.hash_length_bytes
        raw = new.block_hashes
        sent = [BlockHash(raw[i : i + size]) for i in range(0, len(raw), size)]
        computed = v.pool.computed_hashes(new.prompt_token_ids, new.lora_name, new.cache_salt)
        if computed[: len(sent)] != sent:
            raise _reject(
                InvalidArgumentError(f"request key {key}: block_hashes differ from the server's"),
                op_index,
                _ADD,
                field,
            )
    request = Request(
        str(key),
        new.prompt_token_ids,
        lora_id=new.lora_id,
        lora_name=new.lora_name,
        cache_salt=new.cache_salt,
    )
    tokens = list(new.prompt_token_ids) if v.verify else None
    v.table[key] = [
        len(new.prompt_token_ids),
        _NO,
        len(new.block_hashes) // v.pool.hashing.hash_length_bytes,
        tokens,
        request,
    ]
    v.allocated.discard(key)
    v.n_add += 1


def check_new_request(
    pool: Pool, key: int, prompt: Sequence[int], block_hashes: bytes, lora_id: int | None
) -> None:
    """Validate a new request's prompt, hashes and LoRA id (without the request table).

    The prompt carries the hashes of all its full hash blocks, or none at all (an unhashed
    request: its blocks are never cached). With ``verify_block_hashes`` they must equal the
    server's.

    Raises:
        InvalidArgumentError: An empty or too long prompt, wrong hashes, a negative lora_id.
    """
    num_tokens = len(prompt)
    if num_tokens == 0:
        raise InvalidArgumentError(f"request key {key}: prompt_token_ids must not be empty")
    if num_tokens > pool.max_model_len:
        raise InvalidArgumentError(
            f"request key {key}: prompt_token_ids has {num_tokens} tokens, more than "
            f"max_model_len {pool.max_model_len}"
        )
    expected_hashes = pool.expected_num_hashes(num_tokens)
    expected = expected_hashes * pool.hashing.hash_length_bytes
    if len(block_hashes) not in (0, expected):
        raise InvalidArgumentError(
            f"request key {key}: block_hashes must hold {expected} bytes "
            f"({expected_hashes} hashes) or none, got {len(block_hashes)}"
        )
    if lora_id is not None and lora_id < 0:
        raise InvalidArgumentError(f"lora_id must be >= 0, got {lora_id}")


def _check_evict(v: _Shadow, op_index: int) -> None:
    program = v.program
    n = v.n_evict
    if n >= len(program.evict_num_block_ids):
        raise _too_few(op_index, _EVICT, "evict_num_block_ids")
    count = program.evict_num_block_ids[n]
    start = v.n_evict_ids
    if count < 0 or start + count > len(program.evict_block_ids):
        raise _reject(
            InvalidArgumentError("evict_block_ids is too short"),
            op_index,
            _EVICT,
            f"evict_num_block_ids[{n}]",
        )
    num_blocks = v.manager.block_pool.num_gpu_blocks
    for position in range(start, start + count):
        block_id = program.evict_block_ids[position]
        if not 1 <= block_id < num_blocks:
            raise _reject(
                InvalidArgumentError(
                    f"evict_block_ids[{position}]={block_id} is outside [1, {num_blocks})"
                ),
                op_index,
                _EVICT,
                f"evict_block_ids[{position}]",
            )
    v.n_evict += 1
    v.n_evict_ids = start + count


def _check_commit(v: _Shadow, op_index: int, op: int, k: int) -> None:
    """CACHE_BLOCKS / REMOVE_SKIPPED_BLOCKS: a request holding blocks, a count in range."""
    key, state = v.state(op_index, op, k)
    program = v.program
    if op == _CACHE:
        name, column, index = (
            "cache_num_computed_tokens",
            program.cache_num_computed_tokens,
            v.n_cache,
        )
        v.n_cache += 1
    else:
        name, column, index = (
            "remove_skipped_total_computed_tokens",
            program.remove_skipped_total_computed_tokens,
            v.n_skipped,
        )
        v.n_skipped += 1
    if index >= len(column):
        raise _too_few(op_index, op, name)
    value = column[index]
    num_tokens = state[0]
    assert isinstance(num_tokens, int)
    if value < 0 or value > num_tokens:
        raise _reject(
            InvalidArgumentError(f"{name}[{index}]={value} is outside [0, {num_tokens}]"),
            op_index,
            op,
            f"{name}[{index}]",
        )
    holds = v.holds(key, state)
    if holds == _NO:
        raise _reject(
            NotFoundError(f"request key {key} holds no blocks in pool {v.pool.name!r}"),
            op_index,
            op,
            f"request_keys[{k}]",
        )
    if op == _CACHE and holds == _YES and key not in v.allocated:
        request = state[4]
        assert isinstance(request, Request)
        if int(state[2]) == len(request.block_hashes):
            try:
                v.manager.check_cacheable(request, value)
            except InvalidArgumentError as exc:
                raise _reject(exc, op_index, op, f"{name}[{index}]") from None


def _check_record(v: _Shadow, op_index: int, k: int) -> None:
    """RECORD_PREFIX_STATS: a live request, a hit of at most its tokens."""
    _, state = v.state(op_index, _RECORD, k)
    index = v.n_record
    column = v.program.record_hit_tokens
    if index >= len(column):
        raise _too_few(op_index, _RECORD, "record_hit_tokens")
    value = column[index]
    num_tokens = state[0]
    if not 0 <= value <= num_tokens:
        raise _reject(
            InvalidArgumentError(
                f"record_hit_tokens[{index}]={value} is outside [0, {num_tokens}] (the "
                "request's tokens)"
            ),
            op_index,
            _RECORD,
            f"record_hit_tokens[{index}]",
        )
    v.n_record += 1


def _check_consumed(  # noqa: PLR0917 (private helper)
    v: _Shadow, num_keys: int, num_allocs: int, num_appends: int, num_ids: int, num_bytes: int
) -> None:
    """Every column entry was consumed by an op: none missing, none left over."""
    p = v.program
    columns = (
        ("request_keys", num_keys, len(p.request_keys)),
        ("new_requests", v.n_add, len(p.new_requests)),
        ("alloc_num_new_tokens", num_allocs, len(p.alloc_num_new_tokens)),
        ("alloc_num_computed_tokens", num_allocs, len(p.alloc_num_computed_tokens)),
        ("append_num_tokens", num_appends, len(p.append_num_tokens)),
        ("append_num_block_hashes", num_appends, len(p.append_num_block_hashes)),
        ("append_token_ids", num_ids, len(p.append_token_ids)),
        ("append_block_hashes", num_bytes, len(p.append_block_hashes)),
        ("cache_num_computed_tokens", v.n_cache, len(p.cache_num_computed_tokens)),
        (
            "remove_skipped_total_computed_tokens",
            v.n_skipped,
            len(p.remove_skipped_total_computed_tokens),
        ),
        ("evict_num_block_ids", v.n_evict, len(p.evict_num_block_ids)),
        ("evict_block_ids", v.n_evict_ids, len(p.evict_block_ids)),
        ("record_hit_tokens", v.n_record, len(p.record_hit_tokens)),
    )
    for name, used, size in columns:
        if used != size:
            raise InvalidArgumentError(
                f"{name} has {size} entries, the ops consume {used}", field=name
            )
