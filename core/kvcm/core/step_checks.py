"""The Step program's checks: the rules validation applies, and its shadow request table.

:mod:`kvcm.core.step` walks a program once to validate it; its per-op validators keep the
cheap tests of a decode step inline and call the checks here, which produce the messages.
The unary calls of :class:`~kvcm.core.pool.Pool` use the same functions
(:func:`check_new_request`, :func:`check_append`, :func:`check_hit`). See
:mod:`kvcm.core.step` for the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
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
from kvcm.core.op_table import COLUMNS, OP_TABLE, op_name
from kvcm.core.program import NO_LOOKUP_BOUND, AllocOptions, HitSpec, OpKind, StepProgram
from kvcm.core.request import Request
from kvcm.core.single_type_managers import hashes_at_block_size

if TYPE_CHECKING:
    from kvcm.core.manager import KVCacheManager
    from kvcm.core.pool import Pool

__all__ = [
    "HOLDS_MAYBE",
    "HOLDS_NO",
    "HOLDS_YES",
    "Shadow",
    "check_add",
    "check_alloc_options",
    "check_allocate",
    "check_append",
    "check_append_slow",
    "check_commit",
    "check_consumed",
    "check_evict",
    "check_hit",
    "check_limits",
    "check_new_request",
    "check_program_fields",
    "check_record",
    "hashes_expected",
    "reject",
    "too_few",
    "verify_append",
]

# The kinds that can evict cached blocks (a caller's hit is then checked when it runs).
_EVICTING: Final = frozenset({OpKind.ALLOCATE, OpKind.EVICT_BLOCKS, OpKind.RESET_PREFIX_CACHE})
# Shadow "holds blocks" states: unknown (ask the core), no, yes, maybe (allocated in this
# program: it may not have fit).
_UNKNOWN: Final = -1
HOLDS_NO: Final = 0
HOLDS_YES: Final = 1
HOLDS_MAYBE: Final = 2


def reject(error: KVCMError, op_index: int | None, op: int, field: str) -> KVCMError:
    """``error`` for op ``op_index`` (or the program as a whole), naming ``field``."""
    if op_index is None:
        error.field, error.op_index = field, None
        return error
    return error.at_op(op_index, op_name(op), field)


def too_few(op_index: int, op: int, column: str) -> KVCMError:
    """``column`` has no entry left for op ``op_index``."""
    return reject(InvalidArgumentError(f"{column} has too few entries"), op_index, op, column)


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
class Shadow:
    """One validation pass: the shadow request table.

    ``table`` maps a request key to ``[num_tokens, holds blocks, num_hashes, tokens or None,
    request]`` (tokens only when the pool verifies hashes), or to ``None`` once finished in
    this program.
    """

    __slots__ = (
        "allocated",
        "deferred_hits",
        "keys",
        "manager",
        "pool",
        "program",
        "requests_get",
        "retained_copy_batches",
        "swapped",
        "table",
        "verify",
    )

    def __init__(self, pool: Pool, manager: KVCacheManager, program: StepProgram) -> None:
        """An empty shadow of ``pool``'s request table for ``program``."""
        self.pool = pool
        self.manager = manager
        self.program = program
        self.keys = program.request_keys
        self.table: dict[int, list[Any] | None] = {}
        self.requests_get = pool.requests.get
        self.verify = pool.options.verify_block_hashes
        self.allocated: set[int] = set()
        self.deferred_hits: set[int] = set()  # alloc indices whose hit is checked at run time
        self.swapped: dict[int, bool] = {}  # keys swapped out (True) or in (False) by ops so far
        # Retained copy drains after the ops so far (TAKE_BLOCK_COPIES_RETAINED adds one,
        # RELEASE_BLOCK_COPIES takes the oldest).
        self.retained_copy_batches = len(manager.retained_copy_batches)

    def is_swapped(self, key: int, request: Request) -> bool:
        """Whether the request is swapped out to the host tier after the ops so far."""
        swapped = self.swapped.get(key)
        if swapped is not None:
            return swapped
        host = self.pool.host_tier
        return host is not None and host.swapped_tokens(request.request_id) is not None

    def state(self, op_index: int, op: int, k: int) -> tuple[int, list[Any]]:
        """The shadow of the request named by ``request_keys[k]`` (first sight: the table)."""
        if k >= len(self.keys):
            raise too_few(op_index, op, "request_keys")
        key = self.keys[k]
        state = self.table.get(key)
        return key, state if state is not None else self.first_sight(op_index, op, k, key)

    def first_sight(self, op_index: int, op: int, k: int, key: int) -> list[Any]:
        """The shadow of ``key`` (``request_keys[k]``), not in the table yet or finished."""
        request = self.requests_get(key)
        if request is None or key in self.table:
            raise reject(
                NotFoundError(f"request_keys[{k}]={key} is not live in pool {self.pool.name!r}"),
                op_index,
                op,
                f"request_keys[{k}]",
            )
        tokens = request.all_token_ids
        state = [
            len(tokens),
            _UNKNOWN,
            len(request.block_hashes),
            list(tokens) if self.verify else None,
            request,
        ]
        self.table[key] = state
        return state

    def holds(self, key: int, state: list[Any]) -> int:
        """The shadow's "holds blocks" state (asked of the core once)."""
        if state[1] == _UNKNOWN:
            request = state[4]
            assert isinstance(request, Request)
            state[1] = HOLDS_YES if self.manager.holds_blocks(request.request_id) else HOLDS_NO
        value = state[1]
        assert isinstance(value, int)
        return value

    def evicting_before(self, op_index: int) -> bool:
        """Whether an op before ``op_index`` can evict cached blocks."""
        return not _EVICTING.isdisjoint(self.program.ops[:op_index])


def check_program_fields(program: StepProgram) -> None:
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


def hashes_expected(  # noqa: PLR0917 (private helper)
    before: int,
    num_tokens: int,
    num_hashes: int,
    hashes_before: int,
    hash_block_size: int,
    lookahead: int = 0,
) -> bool:
    """Whether an append's hashes are the ones it must carry (see ``check_append``; a
    lookahead hash also covers ``lookahead`` tokens after its block)."""
    if not hash_block_size:
        return False
    expected_before = max(before - lookahead, 0) // hash_block_size
    return (
        hashes_before == expected_before
        and num_hashes
        == max(before + num_tokens - lookahead, 0) // hash_block_size - expected_before
    )


def check_append_slow(  # noqa: PLR0917 (private helper)
    v: Shadow,
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
    """The full checks of an append the cheap test found suspicious (they name the fault)."""
    field = f"append_num_tokens[{n_append}]"
    if num_hashes < 0:
        raise reject(
            InvalidArgumentError(f"append_num_block_hashes[{n_append}] must be >= 0"),
            op_index,
            OpKind.APPEND_TOKENS,
            f"append_num_block_hashes[{n_append}]",
        )
    if num_tokens < 0:
        raise reject(
            InvalidArgumentError(f"{field} must be > 0, got {num_tokens}"),
            op_index,
            OpKind.APPEND_TOKENS,
            field,
        )
    if short:
        raise reject(
            InvalidArgumentError("append_token_ids or append_block_hashes is too short"),
            op_index,
            OpKind.APPEND_TOKENS,
            field,
        )
    try:
        check_append(
            v.pool, key, num_tokens, num_hashes, num_before=before, hashes_before=hashes_before
        )
    except InvalidArgumentError as exc:
        raise reject(exc, op_index, OpKind.APPEND_TOKENS, field) from None


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


def verify_append(  # noqa: PLR0917 (private helper)
    v: Shadow,
    op_index: int,
    n_append: int,
    state: list[Any],
    start: int,
    num_tokens: int,
    num_hashes: int,
) -> None:
    """verify_block_hashes (a debugging option): hash the shadow's tokens like the server."""
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
        raise reject(
            InvalidArgumentError(
                f"request key {request.request_id}: block_hashes differ from the server's"
            ),
            op_index,
            OpKind.APPEND_TOKENS,
            f"append_block_hashes[{n_append}]",
        )


def check_allocate(  # noqa: PLR0917 (private helper)
    v: Shadow,
    op_index: int,
    key: int,
    state: list[Any],
    num_new: int,
    num_computed: int,
    entry: AllocOptions | None,
    index: int,
) -> None:
    """The full checks of ALLOCATE number ``index`` (its options, its hit, its counts)."""
    num_tokens = state[0]
    assert isinstance(num_tokens, int)
    max_model_len = v.pool.max_model_len

    def fail(message: str, field: str, error: type[KVCMError] = InvalidArgumentError) -> KVCMError:
        return reject(error(message), op_index, OpKind.ALLOCATE, field)

    if num_computed < 0:
        raise fail(
            f"alloc_num_computed_tokens[{index}] must be >= 0, got {num_computed}",
            f"alloc_num_computed_tokens[{index}]",
        )
    if num_new < 0:
        raise fail(
            f"alloc_num_new_tokens[{index}] must be >= 0, got {num_new}",
            f"alloc_num_new_tokens[{index}]",
        )
    # Under async scheduling the computed count includes the tokens still in flight (with
    # speculative decoding, drafts not yet verified, which are no known tokens).
    in_flight = entry.num_in_flight_tokens if entry is not None else 0
    if num_computed - max(in_flight, 0) > num_tokens:
        raise fail(
            f"alloc_num_computed_tokens[{index}]={num_computed} exceeds the request's "
            f"{num_tokens} tokens"
            + (f" and its {in_flight} tokens in flight" if in_flight > 0 else ""),
            f"alloc_num_computed_tokens[{index}]",
        )
    options = entry.slot_options if entry is not None else DEFAULT_SLOT_OPTIONS
    hit_tokens = 0
    if entry is not None:
        check_alloc_options(v, entry, index, num_tokens, num_computed, fail)
        if entry.lookup is not None or entry.hit is not None:
            hit_tokens = _check_adoption(v, op_index, key, state, num_computed, entry, index, fail)
            if entry.lookup is not None:
                return  # the lookup caps num_new_tokens at execution
    if num_new == 0 and hit_tokens == 0 and options.num_external_computed_tokens == 0:
        raise fail(
            f"alloc_num_new_tokens[{index}] must be > 0 when there is nothing to adopt",
            f"alloc_num_new_tokens[{index}]",
        )
    if num_computed + hit_tokens + num_new > max_model_len:
        raise fail(
            f"alloc_num_computed_tokens[{index}] + hit + alloc_num_new_tokens[{index}] = "
            f"{num_computed + hit_tokens + num_new} exceeds max_model_len {max_model_len}",
            f"alloc_num_new_tokens[{index}]",
        )


def _check_adoption(  # noqa: PLR0917 (private helper)
    v: Shadow,
    op_index: int,
    key: int,
    state: list[Any],
    num_computed: int,
    entry: AllocOptions,
    index: int,
    fail: Any,
) -> int:
    """An ALLOCATE with a lookup or a caller's hit: a request with nothing computed and no
    blocks, not allocated before in the program; the hit's shape (and, when that is exact
    already, the cache). Returns the hit's tokens (0 for a lookup)."""
    where = "lookup" if entry.lookup is not None else "hit"
    if num_computed:
        raise fail(
            f"alloc_num_computed_tokens[{index}]={num_computed}: an ALLOCATE with a "
            f"{where} is for a request with no computed tokens",
            f"alloc_num_computed_tokens[{index}]",
        )
    if key in v.allocated and not v.program.continue_on_does_not_fit:
        raise fail(
            f"an ALLOCATE with a {where} follows another ALLOCATE of request key {key}",
            f"alloc_options[{index}].{where}",
        )
    if v.holds(key, state) == HOLDS_YES:
        raise fail(
            f"alloc_options[{index}]: a {where} for a request that holds blocks",
            f"alloc_options[{index}].{where}",
        )
    if entry.hit is None:
        return 0
    request = state[4]
    assert isinstance(request, Request)
    # The cache part of the check is exact here only when nothing earlier in the program can
    # evict and the request's hashes are all in the table already; otherwise the interpreter
    # checks it when the ALLOCATE runs (HIT_STALE).
    deferred = v.evicting_before(op_index) or state[2] != len(request.block_hashes)
    try:
        check_hit(v.pool, v.manager, request, entry.hit, state[0], cache=not deferred)
    except KVCMError as exc:
        raise reject(exc, op_index, OpKind.ALLOCATE, f"alloc_options[{index}].hit") from None
    if deferred:
        v.deferred_hits.add(index)
    return entry.hit.num_tokens


def check_alloc_options(  # noqa: PLR0917 (private helper)
    v: Shadow,
    entry: AllocOptions,
    index: int,
    num_tokens: int,
    num_computed: int,
    fail: object,
) -> None:
    """ALLOCATE number ``index``'s options (``fail(message, field)`` makes the error)."""
    assert callable(fail)
    options = entry.slot_options
    field = f"alloc_options[{index}]"
    if entry.lookup is not None and entry.hit is not None:
        raise fail(f"{field}: lookup and hit are exclusive", f"{field}.hit")
    if entry.lookup is not None and entry.lookup < NO_LOOKUP_BOUND:
        raise fail(
            f"{field}.lookup must be >= 0 (or -1: the default), got {entry.lookup}",
            f"{field}.lookup",
        )
    if entry.num_in_flight_tokens < 0:
        raise fail(f"{field}.num_in_flight_tokens must be >= 0", f"{field}.num_in_flight_tokens")
    # (SlotOptions checked its counts when it was made.)
    external = options.num_external_computed_tokens
    if num_computed - entry.num_in_flight_tokens + external > num_tokens:
        raise fail(
            f"{field}.options.num_external_computed_tokens={external}: with "
            f"{num_computed} computed tokens it exceeds the request's {num_tokens} tokens",
            f"{field}.options.num_external_computed_tokens",
        )
    pool = v.pool
    lookahead = options.num_lookahead_tokens
    if lookahead is not None and lookahead > pool.max_model_len:
        raise fail(
            f"{field}.options.num_lookahead_tokens={lookahead} exceeds "
            f"max_model_len {pool.max_model_len}",
            f"{field}.options.num_lookahead_tokens",
        )
    capacity = v.manager.block_pool.num_gpu_blocks * max(
        m.block_size for m in v.manager.coordinator.single_type_managers
    )
    if options.num_encoder_tokens > capacity:
        raise fail(
            f"{field}.options.num_encoder_tokens={options.num_encoder_tokens} exceeds the "
            f"pool's {capacity} token slots",
            f"{field}.options.num_encoder_tokens",
        )
    if options.reserved_blocks > v.manager.block_pool.num_gpu_blocks:
        raise fail(
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
        # An align-mode Mamba group's state may end before the hit (vLLM's lookup for a KV
        # connector reports full attention's hit; the connector supplies the rest).
        lags = group.kv_cache_spec.partial_block_hits
        if (len(ids) * group.block_size < hit.num_tokens and not lags) or (
            (len(ids) - 1) * group.block_size >= hit.num_tokens
        ):
            raise InvalidArgumentError(
                f"hit group {group_id}: {len(ids)} blocks of {group.block_size} tokens do not "
                f"cover hit.num_tokens={hit.num_tokens}"
            )
        hashes = hashes_at_block_size(request.block_hashes, hash_block_size, group.block_size)
        suffix = _group_suffix(group_id)
        last = len(ids) - 1
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
            if position == last:
                # The last block holds the hash where the hit ends: its block's own, or for a
                # sub-block hit (beside align-mode Mamba) that of the hash block inside it.
                end = _last_block_key_index(
                    block_pool,
                    request,
                    block_id,
                    suffix,
                    position * group.block_size,
                    group.block_size,
                    hit.num_tokens // hash_block_size - 1,
                    lags=lags,
                )
                key = request.block_hashes[end] if 0 <= end < len(request.block_hashes) else None
            else:
                key = hashes[position] if position < len(hashes) else None
            if key is None or not block_pool._maps_to(
                key + suffix,  # type: ignore[arg-type]
                block_id,
            ):
                raise FailedPreconditionError(
                    f"hit block {block_id} (group {group_id}, position {position}) does not "
                    "hold the request's block hash now; look the request up again"
                )


def _last_block_key_index(  # noqa: PLR0917 (private helper of check_hit)
    block_pool: Any,
    request: Request,
    block_id: int,
    suffix: bytes,
    block_start: int,
    block_size: int,
    end: int,
    *,
    lags: bool,
) -> int:
    # The hash index inside the hit's last block (tokens from ``block_start``) that the block
    # holds: at or after ``end`` (a block keyed deeper holds the hit's prefix too; the hit was
    # cut there by another group), or for a lagging Mamba state at or before it. ``end`` when
    # none does (the caller then refuses the hit as stale).
    hash_block_size = block_pool.hash_block_size
    hashes = request.block_hashes
    first = block_start // hash_block_size
    last = min((block_start + block_size) // hash_block_size, len(hashes)) - 1
    candidates = range(end, first - 1, -1) if lags else range(max(end, first), last + 1)
    for index in candidates:
        if 0 <= index <= last and block_pool._maps_to(hashes[index] + suffix, block_id):
            return index
    return end


def check_add(v: Shadow, op_index: int, n_add: int) -> None:
    """ADD_REQUEST number ``n_add``: a key not live, a valid prompt (and hashes)."""
    program = v.program
    if n_add >= len(program.new_requests):
        raise too_few(op_index, OpKind.ADD_REQUEST, "new_requests")
    new = program.new_requests[n_add]
    field = f"new_requests[{n_add}]"
    key = new.key
    live = v.table[key] is not None if key in v.table else key in v.pool.requests
    if live:
        error = AlreadyExistsError(v.pool.live_key_message(key))
        raise reject(error, op_index, OpKind.ADD_REQUEST, field)
    try:
        check_new_request(v.pool, new.key, new.prompt_token_ids, new.block_hashes, new.lora_id)
    except InvalidArgumentError as exc:
        raise reject(exc, op_index, OpKind.ADD_REQUEST, field) from None
    if key < 0:
        raise reject(InvalidArgumentError("key must be >= 0"), op_index, OpKind.ADD_REQUEST, field)
    report: object = new.report_cached_blocks  # a program built past the type checker
    if type(report) is not bool:
        raise reject(
            InvalidArgumentError(f"report_cached_blocks must be a bool, got {report!r}"),
            op_index,
            OpKind.ADD_REQUEST,
            f"{field}.report_cached_blocks",
        )
    if v.verify and new.block_hashes:
        size = v.pool.hashing.hash_length_bytes
        raw = new.block_hashes
        sent = [BlockHash(raw[i : i + size]) for i in range(0, len(raw), size)]
        computed = v.pool.computed_hashes(new.prompt_token_ids, new.lora_name, new.cache_salt)
        if computed[: len(sent)] != sent:
            raise reject(
                InvalidArgumentError(f"request key {key}: block_hashes differ from the server's"),
                op_index,
                OpKind.ADD_REQUEST,
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
        HOLDS_NO,
        len(new.block_hashes) // v.pool.hashing.hash_length_bytes,
        tokens,
        request,
    ]
    v.allocated.discard(key)


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


def check_evict(v: Shadow, op_index: int, n: int, start: int) -> int:
    """EVICT_BLOCKS number ``n``, its ids from ``evict_block_ids[start]``: ids in the pool
    (not the null block). Returns how many ids it takes."""
    program = v.program
    if n >= len(program.evict_num_block_ids):
        raise too_few(op_index, OpKind.EVICT_BLOCKS, "evict_num_block_ids")
    count = program.evict_num_block_ids[n]
    if count < 0 or start + count > len(program.evict_block_ids):
        raise reject(
            InvalidArgumentError("evict_block_ids is too short"),
            op_index,
            OpKind.EVICT_BLOCKS,
            f"evict_num_block_ids[{n}]",
        )
    num_blocks = v.manager.block_pool.num_gpu_blocks
    for position in range(start, start + count):
        block_id = program.evict_block_ids[position]
        if not 1 <= block_id < num_blocks:
            raise reject(
                InvalidArgumentError(
                    f"evict_block_ids[{position}]={block_id} is outside [1, {num_blocks})"
                ),
                op_index,
                OpKind.EVICT_BLOCKS,
                f"evict_block_ids[{position}]",
            )
    return count


def check_commit(v: Shadow, op_index: int, op: int, k: int, index: int) -> None:
    """CACHE_BLOCKS / REMOVE_SKIPPED_BLOCKS number ``index``: a request holding blocks, a
    count in range."""
    key, state = v.state(op_index, op, k)
    (name,) = OP_TABLE[op].columns
    column = getattr(v.program, name)
    if index >= len(column):
        raise too_few(op_index, op, name)
    value = column[index]
    num_tokens = state[0]
    assert isinstance(num_tokens, int)
    if value < 0 or value > num_tokens:
        raise reject(
            InvalidArgumentError(f"{name}[{index}]={value} is outside [0, {num_tokens}]"),
            op_index,
            op,
            f"{name}[{index}]",
        )
    holds = v.holds(key, state)
    if holds == HOLDS_NO:
        raise reject(
            NotFoundError(f"request key {key} holds no blocks in pool {v.pool.name!r}"),
            op_index,
            op,
            f"request_keys[{k}]",
        )
    if op == OpKind.CACHE_BLOCKS and holds == HOLDS_YES and key not in v.allocated:
        request = state[4]
        assert isinstance(request, Request)
        if int(state[2]) == len(request.block_hashes):
            try:
                v.manager.check_cacheable(request, value)
            except InvalidArgumentError as exc:
                raise reject(exc, op_index, op, f"{name}[{index}]") from None


def check_record(v: Shadow, op_index: int, k: int, index: int) -> None:
    """RECORD_PREFIX_STATS number ``index``: a live request, a hit of at most its tokens."""
    _, state = v.state(op_index, OpKind.RECORD_PREFIX_STATS, k)
    column = v.program.record_hit_tokens
    if index >= len(column):
        raise too_few(op_index, OpKind.RECORD_PREFIX_STATS, "record_hit_tokens")
    value = column[index]
    num_tokens = state[0]
    if not 0 <= value <= num_tokens:
        raise reject(
            InvalidArgumentError(
                f"record_hit_tokens[{index}]={value} is outside [0, {num_tokens}] (the "
                "request's tokens)"
            ),
            op_index,
            OpKind.RECORD_PREFIX_STATS,
            f"record_hit_tokens[{index}]",
        )


def check_extend_prompt(
    v: Shadow, op_index: int, k: int, index: int, prompt_ends: dict[int, tuple[list[Any], int]]
) -> None:
    """EXTEND_PROMPT number ``index``: a live request, a prompt end between its prompt's
    length and its tokens (after the ops before it).

    Args:
        v: The validation pass.
        op_index: The op's position.
        k: Its ``request_keys`` position.
        index: Its ordinal among the program's EXTEND_PROMPTs.
        prompt_ends: Per request key, the shadow it was checked against and the prompt end an
            earlier EXTEND_PROMPT of this program gave it (updated here).
    """
    kind = OpKind.EXTEND_PROMPT
    key, state = v.state(op_index, kind, k)
    column = v.program.extend_prompt_num_tokens
    if index >= len(column):
        raise too_few(op_index, kind, "extend_prompt_num_tokens")
    value = column[index]
    earlier = prompt_ends.get(key)
    request = state[4]
    assert isinstance(request, Request)
    prompt_end = (
        earlier[1] if earlier is not None and earlier[0] is state else request.num_prompt_tokens
    )
    num_tokens = state[0]
    if type(value) is not int or not prompt_end <= value <= num_tokens:
        raise reject(
            InvalidArgumentError(
                f"extend_prompt_num_tokens[{index}]={value!r} is outside [{prompt_end}, "
                f"{num_tokens}] (the request's prompt length and its tokens: a prompt only "
                "grows, over tokens the request holds; append the chunk's tokens first)"
            ),
            op_index,
            kind,
            f"extend_prompt_num_tokens[{index}]",
        )
    prompt_ends[key] = (state, value)


def check_report_hit(v: Shadow, op_index: int, k: int, index: int, start: int) -> int:
    """REPORT_HIT number ``index``, its counts from ``report_hit_num_blocks[start]``: a live
    request, one count per KV-cache group, each at most the group's blocks over the request's
    tokens (after the ops before it). Returns how many counts it takes.

    Args:
        v: The validation pass.
        op_index: The op's position.
        k: Its ``request_keys`` position.
        index: Its ordinal among the program's REPORT_HITs.
        start: Where its counts start in ``report_hit_num_blocks``.
    """
    kind = OpKind.REPORT_HIT
    _, state = v.state(op_index, kind, k)
    program = v.program
    if index >= len(program.report_hit_num_groups):
        raise too_few(op_index, kind, "report_hit_num_groups")
    managers = v.manager.coordinator.single_type_managers
    count = program.report_hit_num_groups[index]
    if type(count) is not int or count != len(managers):
        raise reject(
            InvalidArgumentError(
                f"report_hit_num_groups[{index}]={count!r}: one count per KV-cache group "
                f"({len(managers)})"
            ),
            op_index,
            kind,
            f"report_hit_num_groups[{index}]",
        )
    counts = program.report_hit_num_blocks
    if start + count > len(counts):
        raise too_few(op_index, kind, "report_hit_num_blocks")
    num_tokens = state[0]
    assert isinstance(num_tokens, int)
    for position, manager in zip(range(start, start + count), managers, strict=True):
        value = counts[position]
        most = -(-num_tokens // manager.block_size)
        if type(value) is not int or not 0 <= value <= most:
            raise reject(
                InvalidArgumentError(
                    f"report_hit_num_blocks[{position}]={value!r} is outside [0, {most}] (group "
                    f"{manager.kv_cache_group_id}'s blocks over the request's {num_tokens} tokens)"
                ),
                op_index,
                kind,
                f"report_hit_num_blocks[{position}]",
            )
    return count


def check_consumed(
    program: StepProgram, num_keys: int, counts: Sequence[int], hash_length: int
) -> None:
    """Every column entry was consumed by an op: none missing, none left over.

    Args:
        program: The program.
        num_keys: The ``request_keys`` entries its ops took.
        counts: Per op kind value, how many ops of that kind it has.
        hash_length: Bytes per block hash (a bytes column's unit).
    """
    used = [num_keys, *map(counts.__getitem__, _KINDS)]
    for position, kind, count_column, hashed in _SPANS:
        n = counts[kind]
        if n:
            taken = sum(getattr(program, count_column)[:n])
            used[position] = taken * hash_length if hashed else taken
    sizes = list(map(len, _COLUMN_VALUES(program)))
    if used == sizes:
        return
    name, size, consumed = next(
        (name, size, consumed)
        for name, size, consumed in zip(COLUMNS, sizes, used, strict=True)
        if size != consumed
    )
    raise InvalidArgumentError(f"{name} has {size} entries, the ops consume {consumed}", field=name)


# Per column after request_keys (in COLUMNS' order), the kind whose ops consume it; a span's
# data column (its position in COLUMNS, its kind, its count column, whether it holds hashes)
# consumes what the count column says instead.
_KINDS: Final = tuple(kind for kind, row in OP_TABLE.items() for _ in (*row.columns, *row.spans))
_SPANS: Final = tuple(
    (COLUMNS.index(span.data), kind, span.count, span.hashes)
    for kind, row in OP_TABLE.items()
    for span in row.spans
)
_COLUMN_VALUES: Final = attrgetter(*COLUMNS)
