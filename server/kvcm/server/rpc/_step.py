"""The Step RPC: validate a whole scheduler step, then run it on the pool's core.

``validate_step`` walks the ops through a shadow of the request table (keys added and
finished, token counts after appends) and the columns, and raises
:class:`~kvcm.server.rpc._status.StepRejectedError` at the first op that would fail as a unary
call; nothing has changed then. ``execute_step`` then runs the ops on the core with cursors
over the packed columns, gathering the response columns in lists written once at the end
(no per-item objects).
"""

from __future__ import annotations

from typing import Final

from kvcm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCMError,
    NotFoundError,
)
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS, CacheHit, KVCacheManager, SlotOptions
from kvcm.core.pool import Pool
from kvcm.core.request import RequestStatus
from kvcm.server.rpc._convert import slot_options_from_proto
from kvcm.server.rpc._status import StepRejectedError
from kvcm.v1 import common_pb2, scheduler_pb2

__all__ = ["execute_step", "run_step", "validate_step"]

_ADD: Final = scheduler_pb2.STEP_OP_KIND_ADD_REQUEST
_APPEND: Final = scheduler_pb2.STEP_OP_KIND_APPEND_TOKENS
_ALLOCATE: Final = scheduler_pb2.STEP_OP_KIND_ALLOCATE
_CACHE: Final = scheduler_pb2.STEP_OP_KIND_CACHE_BLOCKS
_SKIPPED: Final = scheduler_pb2.STEP_OP_KIND_REMOVE_SKIPPED_BLOCKS
_PREEMPT: Final = scheduler_pb2.STEP_OP_KIND_PREEMPT
_FINISH: Final = scheduler_pb2.STEP_OP_KIND_FINISH
_NEW_STEP: Final = scheduler_pb2.STEP_OP_KIND_NEW_STEP_STARTS
_NAMES: Final[dict[int, str]] = {
    _ADD: "ADD_REQUEST",
    _APPEND: "APPEND_TOKENS",
    _ALLOCATE: "ALLOCATE",
    _CACHE: "CACHE_BLOCKS",
    _SKIPPED: "REMOVE_SKIPPED_BLOCKS",
    _PREEMPT: "PREEMPT",
    _FINISH: "FINISH",
    _NEW_STEP: "NEW_STEP_STARTS",
}
_OK: Final = common_pb2.ITEM_STATUS_OK
_DOES_NOT_FIT: Final = common_pb2.ITEM_STATUS_DOES_NOT_FIT
_NO_TOKEN_BUDGET: Final = common_pb2.ITEM_STATUS_NO_TOKEN_BUDGET


def run_step(pool: Pool, message: scheduler_pb2.StepRequest) -> scheduler_pb2.StepResponse:
    """Check the exactly-once guard, validate, execute; remember the answer for retries.

    Raises:
        FailedPreconditionError: The pool is not READY or step_seq is out of sequence.
        StepRejectedError: The Step failed validation (nothing ran).
    """
    manager = pool.ready_manager()
    has_seq = message.HasField("step_seq")
    if has_seq:
        seq = message.step_seq
        if seq == pool.last_step_seq and seq > 0:
            cached = pool.last_step_response
            assert isinstance(cached, scheduler_pb2.StepResponse)
            return cached
        if seq != pool.last_step_seq + 1:
            raise StepRejectedError(
                FailedPreconditionError(
                    f"step_seq {seq} is out of sequence: pool {pool.name!r} last applied "
                    f"{pool.last_step_seq}, expects {pool.last_step_seq + 1}"
                ),
                None,
                "step_seq",
            )
    validate_step(pool, message)
    response = execute_step(pool, manager, message)
    if has_seq:
        response.step_seq = message.step_seq
        pool.last_step_seq = message.step_seq
        pool.last_step_response = response
    return response


def _reject(op_index: int | None, op: int, error: KVCMError, field: str) -> StepRejectedError:
    """The rejection of op ``op_index`` (or of the whole Step when ``None``)."""
    if op_index is None:
        return StepRejectedError(error, None, field)
    prefixed = type(error)(f"ops[{op_index}] {_NAMES.get(op, str(op))}: {error}")
    return StepRejectedError(prefixed, op_index, field)


class _Validation:
    """One validation pass: the shadow request table, the message and the cold ops' cursors.

    The shadow maps a request key to ``[num_tokens, holds blocks (-1: not asked yet),
    num_hashes]``, or to ``None`` once finished in this Step. APPEND_TOKENS and ALLOCATE (the
    ops of a decode step) are checked inline in :func:`validate_step`; the rest here.
    """

    __slots__ = ("keys", "message", "n_add", "n_cache", "n_skipped", "pool", "shadow")

    def __init__(self, pool: Pool, message: scheduler_pb2.StepRequest, keys: list[int]) -> None:
        self.pool = pool
        self.message = message
        self.keys = keys
        self.shadow: dict[int, list[int] | None] = {}
        self.n_add = self.n_cache = self.n_skipped = 0

    def state(self, op_index: int, op: int, k: int) -> tuple[int, list[int]]:
        """The shadow of the request named by ``request_keys[k]`` (slow path: first sight)."""
        if k >= len(self.keys):
            raise _too_few(op_index, op, "request_keys")
        key = self.keys[k]
        state = self.shadow.get(key)
        if state is None:
            request = None if key in self.shadow else self.pool.requests.get(key)
            if request is None:
                raise _reject(
                    op_index,
                    op,
                    NotFoundError(
                        f"request_keys[{k}]={key} is not live in pool {self.pool.name!r}"
                    ),
                    f"request_keys[{k}]",
                )
            state = [request.num_tokens, -1, len(request.block_hashes)]
            self.shadow[key] = state
        return key, state

    def holds_blocks(self, key: int, state: list[int]) -> bool:
        """Whether the request holds blocks for sure (asked of the core once)."""
        if state[1] < 0:
            manager = self.pool.manager
            assert manager is not None
            state[1] = int(manager.holds_blocks(str(key)))
        return bool(state[1])

    def cold_op(self, op_index: int, op: int, k: int) -> int:
        """Check an op other than APPEND_TOKENS and ALLOCATE; returns the next key cursor."""
        if op == _NEW_STEP:
            return k
        if op == _ADD:
            _check_add(self, op_index, self.message, self.n_add)
            self.n_add += 1
            return k
        if op in (_CACHE, _SKIPPED):
            self._check_commit(op_index, op, k)
            return k + 1
        if op == _PREEMPT:
            _, state = self.state(op_index, op, k)
            state[1] = 0
            return k + 1
        if op == _FINISH:
            key, _ = self.state(op_index, op, k)
            self.shadow[key] = None
            return k + 1
        raise _reject(
            op_index,
            op,
            InvalidArgumentError(f"ops[{op_index}] has unknown kind {op}"),
            f"ops[{op_index}]",
        )

    def _check_commit(self, op_index: int, op: int, k: int) -> None:
        """CACHE_BLOCKS / REMOVE_SKIPPED_BLOCKS: a token count within the request's tokens."""
        _, state = self.state(op_index, op, k)
        message = self.message
        if op == _CACHE:
            name, column, index = (
                "cache_num_computed_tokens",
                message.cache_num_computed_tokens,
                self.n_cache,
            )
            self.n_cache += 1
        else:
            name, column, index = (
                "remove_skipped_total_computed_tokens",
                message.remove_skipped_total_computed_tokens,
                self.n_skipped,
            )
            self.n_skipped += 1
        if index >= len(column):
            raise _too_few(op_index, op, name)
        if column[index] > state[0]:
            raise _reject(
                op_index,
                op,
                InvalidArgumentError(
                    f"{name}[{index}]={column[index]} exceeds the request's {state[0]} tokens"
                ),
                f"{name}[{index}]",
            )


def _too_few(op_index: int, op: int, column: str) -> StepRejectedError:
    """The rejection of an op whose column has run out of entries."""
    return _reject(op_index, op, InvalidArgumentError(f"{column} has too few entries"), column)


def validate_step(pool: Pool, message: scheduler_pb2.StepRequest) -> None:
    """Validate a whole Step against the pool without changing anything.

    Raises:
        StepRejectedError: The first failing op (or the malformed columns).
    """
    keys = list(message.request_keys)
    v = _Validation(pool, message, keys)
    max_model_len = pool.max_model_len
    hash_block_size = pool.hashing.hash_block_size if pool.options.enable_caching else 0
    hash_length = pool.hashing.hash_length_bytes
    options_by_index = _alloc_options(message) if message.alloc_options else {}
    alloc_new = list(message.alloc_num_new_tokens)
    alloc_computed = list(message.alloc_num_computed_tokens)
    num_allocs = min(len(alloc_new), len(alloc_computed))
    append_tokens = list(message.append_num_tokens)
    append_hashes = list(message.append_num_block_hashes)
    num_appends = min(len(append_tokens), len(append_hashes))
    num_token_ids = len(message.append_token_ids)
    num_hash_bytes = len(message.append_block_hashes)
    shadow_get = v.shadow.get
    k = n_append = n_alloc = token_cursor = hash_cursor = 0
    # APPEND_TOKENS and ALLOCATE are a decode step's ops: checked inline, with a fast test that
    # sends only suspicious ops to the full checks (which produce the messages).
    for op_index, op in enumerate(message.ops):
        if op == _APPEND:
            state = shadow_get(keys[k]) if k < len(keys) else None
            key, state = (keys[k], state) if state is not None else v.state(op_index, op, k)
            k += 1
            if n_append >= num_appends:
                raise _too_few(op_index, op, "append_num_tokens")
            num_tokens = append_tokens[n_append]
            num_hashes = append_hashes[n_append]
            token_cursor += num_tokens
            hash_cursor += num_hashes * hash_length
            if token_cursor > num_token_ids or hash_cursor > num_hash_bytes:
                raise _reject(
                    op_index,
                    op,
                    InvalidArgumentError("append_token_ids or append_block_hashes is too short"),
                    f"append_num_tokens[{n_append}]",
                )
            before = state[0]
            if (
                num_tokens == 0
                or before + num_tokens > max_model_len
                or (
                    num_hashes
                    and not _hashes_expected(
                        before, num_tokens, num_hashes, state[2], hash_block_size
                    )
                )
            ):
                try:
                    pool.check_append(key, num_tokens, num_hashes, before, state[2])
                except InvalidArgumentError as exc:
                    raise _reject(op_index, op, exc, f"append_num_tokens[{n_append}]") from None
            state[0] = before + num_tokens
            state[2] += num_hashes
            n_append += 1
        elif op == _ALLOCATE:
            state = shadow_get(keys[k]) if k < len(keys) else None
            key, state = (keys[k], state) if state is not None else v.state(op_index, op, k)
            k += 1
            if n_alloc >= num_allocs:
                raise _too_few(op_index, op, "alloc_num_new_tokens")
            num_new = alloc_new[n_alloc]
            num_computed = alloc_computed[n_alloc]
            entry = options_by_index.get(n_alloc) if options_by_index else None
            if (
                entry is not None
                or num_computed > state[0]
                or num_new == 0
                or num_computed + num_new > max_model_len
            ):
                _check_allocate(
                    v,
                    op_index,
                    key,
                    state,
                    num_new=num_new,
                    num_computed=num_computed,
                    entry=entry,
                    index=n_alloc,
                )
            n_alloc += 1
        else:
            k = v.cold_op(op_index, op, k)
    _check_consumed(
        v,
        num_keys=k,
        num_allocs=n_alloc,
        num_appends=n_append,
        num_token_ids=token_cursor,
        num_hash_bytes=hash_cursor,
    )
    if options_by_index and max(options_by_index) >= n_alloc:
        raise StepRejectedError(
            InvalidArgumentError(
                f"alloc_options names alloc_index {max(options_by_index)} but the Step has "
                f"{n_alloc} ALLOCATE ops"
            ),
            None,
            "alloc_options",
        )


def _hashes_expected(
    before: int, num_tokens: int, num_hashes: int, hashes_before: int, hash_block_size: int
) -> bool:
    """Whether an append's hashes are the ones it must carry (see ``Pool.check_append``)."""
    if not hash_block_size:
        return False
    return (
        hashes_before == before // hash_block_size
        and num_hashes == (before + num_tokens) // hash_block_size - before // hash_block_size
    )


def _check_add(
    v: _Validation, op_index: int, message: scheduler_pb2.StepRequest, n_add: int
) -> None:
    if n_add >= len(message.new_requests):
        raise _reject(
            op_index,
            _ADD,
            InvalidArgumentError("new_requests has too few entries"),
            "new_requests",
        )
    new = message.new_requests[n_add]
    field = f"new_requests[{n_add}]"
    key = new.request_key
    live = v.shadow[key] is not None if key in v.shadow else key in v.pool.requests
    if live:
        raise _reject(op_index, _ADD, AlreadyExistsError(f"request key {key} is live"), field)
    try:
        v.pool.check_new_request(key, len(new.prompt_token_ids), len(new.block_hashes))
        if new.HasField("lora_id") and new.lora_id < 0:
            raise InvalidArgumentError(f"lora_id must be >= 0, got {new.lora_id}")
    except InvalidArgumentError as exc:
        raise _reject(op_index, _ADD, exc, field) from None
    v.shadow[key] = [
        len(new.prompt_token_ids),
        0,
        len(new.block_hashes) // v.pool.hashing.hash_length_bytes,
    ]


def _check_consumed(
    v: _Validation,
    *,
    num_keys: int,
    num_allocs: int,
    num_appends: int,
    num_token_ids: int,
    num_hash_bytes: int,
) -> None:
    """Every column entry was consumed by an op: none missing, none left over."""
    message = v.message
    columns = (
        ("request_keys", num_keys, message.request_keys),
        ("new_requests", v.n_add, message.new_requests),
        ("alloc_num_new_tokens", num_allocs, message.alloc_num_new_tokens),
        ("alloc_num_computed_tokens", num_allocs, message.alloc_num_computed_tokens),
        ("append_num_tokens", num_appends, message.append_num_tokens),
        ("append_num_block_hashes", num_appends, message.append_num_block_hashes),
        ("append_token_ids", num_token_ids, message.append_token_ids),
        ("append_block_hashes", num_hash_bytes, message.append_block_hashes),
        ("cache_num_computed_tokens", v.n_cache, message.cache_num_computed_tokens),
        (
            "remove_skipped_total_computed_tokens",
            v.n_skipped,
            message.remove_skipped_total_computed_tokens,
        ),
    )
    for name, used, column in columns:
        size = len(column)
        if used != size:
            raise StepRejectedError(
                InvalidArgumentError(f"{name} has {size} entries, the ops consume {used}"),
                None,
                name,
            )


def _alloc_options(message: scheduler_pb2.StepRequest) -> dict[int, scheduler_pb2.StepAllocOptions]:
    entries: dict[int, scheduler_pb2.StepAllocOptions] = {}
    last = -1
    for position, entry in enumerate(message.alloc_options):
        if entry.alloc_index <= last:
            raise StepRejectedError(
                InvalidArgumentError(
                    f"alloc_options[{position}].alloc_index={entry.alloc_index} is not "
                    "strictly increasing"
                ),
                None,
                f"alloc_options[{position}].alloc_index",
            )
        last = entry.alloc_index
        entries[last] = entry
    return entries


def _check_allocate(
    v: _Validation,
    op_index: int,
    key: int,
    state: list[int],
    *,
    num_new: int,
    num_computed: int,
    entry: scheduler_pb2.StepAllocOptions | None,
    index: int,
) -> None:
    num_tokens = state[0]
    max_model_len = v.pool.max_model_len

    def reject(message: str, field: str) -> StepRejectedError:
        return _reject(op_index, _ALLOCATE, InvalidArgumentError(message), field)

    if num_computed > num_tokens:
        raise reject(
            f"alloc_num_computed_tokens[{index}]={num_computed} exceeds the request's "
            f"{num_tokens} tokens",
            f"alloc_num_computed_tokens[{index}]",
        )
    lookup = entry is not None and entry.HasField("lookup")
    external = entry.options.num_external_computed_tokens if entry is not None else 0
    if lookup:
        if num_computed:
            raise reject(
                f"alloc_num_computed_tokens[{index}]={num_computed}: an ALLOCATE with a "
                "lookup is for a waiting request with no computed tokens",
                f"alloc_num_computed_tokens[{index}]",
            )
        if v.holds_blocks(key, state):
            raise reject(
                f"alloc_options for allocation {index}: lookup for a request that holds blocks",
                f"alloc_options[{index}].lookup",
            )
        return
    if num_new == 0 and external == 0:
        raise reject(
            f"alloc_num_new_tokens[{index}] must be > 0 when there is nothing to adopt",
            f"alloc_num_new_tokens[{index}]",
        )
    if num_computed + num_new > max_model_len:
        raise reject(
            f"alloc_num_computed_tokens[{index}] + alloc_num_new_tokens[{index}] = "
            f"{num_computed + num_new} exceeds max_model_len {max_model_len}",
            f"alloc_num_new_tokens[{index}]",
        )


def execute_step(
    pool: Pool, manager: KVCacheManager, message: scheduler_pb2.StepRequest
) -> scheduler_pb2.StepResponse:
    """Run a validated Step (see the module docstring); returns its response.

    Raises:
        StepRejectedError: The core rejected an op validation could not foresee (the ops
            before it ran; the message says so).
    """
    response = scheduler_pb2.StepResponse()
    _execute(pool, manager, message, response)
    return response


def _execute(
    pool: Pool,
    manager: KVCacheManager,
    message: scheduler_pb2.StepRequest,
    response: scheduler_pb2.StepResponse,
) -> int:
    requests = pool.requests
    keys = list(message.request_keys)
    hash_length = pool.hashing.hash_length_bytes
    append_tokens = message.append_token_ids
    append_hashes = message.append_block_hashes
    append_counts = list(message.append_num_tokens)
    append_hash_counts = list(message.append_num_block_hashes)
    alloc_new = list(message.alloc_num_new_tokens)
    alloc_computed = list(message.alloc_num_computed_tokens)
    allocate = manager.allocate_slots
    verify = pool.options.verify_block_hashes
    running = RequestStatus.RUNNING
    options_by_index = {entry.alloc_index: entry for entry in message.alloc_options}
    default_lookahead = message.default_num_lookahead_tokens
    default_options = (
        SlotOptions(num_lookahead_tokens=default_lookahead)
        if default_lookahead
        else DEFAULT_SLOT_OPTIONS
    )
    budget = message.token_budget if message.HasField("token_budget") else None
    stop = not message.continue_on_does_not_fit
    answers = _Answers()
    statuses, counts, block_ids = answers.statuses, answers.counts, answers.block_ids
    no_blocks = [0] * manager.num_kv_cache_groups
    cold = _ColdOps(pool, manager, message, keys).run
    k = n_append = n_alloc = token_cursor = hash_cursor = 0
    op_index = -1
    try:
        for op_index, op in enumerate(message.ops):  # noqa: B007 (read after the loop)
            if op == _ALLOCATE:
                request = requests[keys[k]]
                k += 1
                num_new = alloc_new[n_alloc]
                request.num_computed_tokens = alloc_computed[n_alloc]
                entry = options_by_index.get(n_alloc) if options_by_index else None
                n_alloc += 1
                if entry is not None:
                    status, budget = _allocate_with_options(
                        pool,
                        manager,
                        request=request,
                        num_new=num_new,
                        entry=entry,
                        default_lookahead=default_lookahead,
                        budget=budget,
                        answers=answers,
                    )
                    if status != _OK and stop:
                        break
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
                if not num_hashes and not verify:
                    request.all_token_ids.extend(tokens)
                    continue
                size = num_hashes * hash_length
                raw = append_hashes[hash_cursor : hash_cursor + size]
                hash_cursor += size
                hashes = [raw[i : i + hash_length] for i in range(0, size, hash_length)]
                pool.apply_append(request, tokens, hashes)  # type: ignore[arg-type]
            else:
                k = cold(op, k)
    except KVCMError as exc:
        raise StepRejectedError(
            type(exc)(f"ops[{op_index}] rejected by the core after {op_index} ops ran: {exc}"),
            op_index,
            "ops",
        ) from exc
    answers.write(response)
    response.num_ops_executed = op_index + 1
    if budget is not None:
        response.token_budget_left = budget
    return op_index + 1


class _ColdOps:
    """Runs the validated ops other than ALLOCATE and APPEND_TOKENS, with their cursors."""

    __slots__ = ("keys", "manager", "message", "n_add", "n_cache", "n_skipped", "pool")

    def __init__(
        self,
        pool: Pool,
        manager: KVCacheManager,
        message: scheduler_pb2.StepRequest,
        keys: list[int],
    ) -> None:
        self.pool = pool
        self.manager = manager
        self.message = message
        self.keys = keys
        self.n_add = self.n_cache = self.n_skipped = 0

    def run(self, op: int, k: int) -> int:
        """Run ``op`` (its request named by ``request_keys[k]``); returns the next key cursor."""
        pool, manager, message = self.pool, self.manager, self.message
        if op == _NEW_STEP:
            manager.new_step_starts()
            return k
        if op == _ADD:
            new = message.new_requests[self.n_add]
            self.n_add += 1
            pool.add_request(
                new.request_key,
                new.request_id,
                new.prompt_token_ids,
                new.block_hashes,
                lora_id=new.lora_id if new.HasField("lora_id") else None,
                lora_name=new.lora_name if new.HasField("lora_name") else None,
                cache_salt=new.cache_salt if new.HasField("cache_salt") else None,
                skip_reading_prefix_cache=new.skip_reading_prefix_cache,
            )
            return k
        key = self.keys[k]
        if op == _CACHE:
            num_computed = message.cache_num_computed_tokens[self.n_cache]
            self.n_cache += 1
            manager.cache_blocks(pool.requests[key], num_computed)
        elif op == _SKIPPED:
            total = message.remove_skipped_total_computed_tokens[self.n_skipped]
            self.n_skipped += 1
            manager.remove_skipped_blocks(pool.requests[key].request_id, total)
        else:  # PREEMPT or FINISH; validation allowed no other kind
            pool.free(key, preempt=op == _PREEMPT)
        return k + 1


def _allocate_with_options(
    pool: Pool,
    manager: KVCacheManager,
    *,
    request: object,
    num_new: int,
    entry: scheduler_pb2.StepAllocOptions,
    default_lookahead: int,
    budget: int | None,
    answers: _Answers,
) -> tuple[int, int | None]:
    from kvcm.core.request import Request

    assert isinstance(request, Request)
    options, in_flight = slot_options_from_proto(entry.options, default_lookahead)
    request.num_in_flight_tokens = in_flight
    num_groups = manager.num_kv_cache_groups
    hit: CacheHit | None = None
    if entry.HasField("lookup"):
        bound = (
            entry.lookup.max_cache_hit_length
            if entry.lookup.HasField("max_cache_hit_length")
            else None
        )
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
            answers.add(
                _NO_TOKEN_BUDGET,
                num_groups=num_groups,
                ids=None,
                hit_tokens=hit.num_computed_tokens,
                num_new=0,
            )
            return _NO_TOKEN_BUDGET, budget
    blocks = pool.allocate_slots(request, num_new, hit, options)
    if blocks is None:
        looked = hit.num_computed_tokens if hit is not None else None
        answers.add(_DOES_NOT_FIT, num_groups=num_groups, ids=None, hit_tokens=looked, num_new=0)
        return _DOES_NOT_FIT, budget
    if hit is not None:
        manager.record_prefix_cache_stats(request, hit.num_computed_tokens)
        ids = manager.get_block_ids(request.request_id)
        answers.add(
            _OK,
            num_groups=num_groups,
            ids=ids,
            hit_tokens=hit.num_computed_tokens,
            num_new=num_new,
        )
    else:
        answers.add(
            _OK,
            num_groups=num_groups,
            ids=blocks.get_block_ids(),
            hit_tokens=None,
            num_new=0,
        )
    if budget is not None:
        budget = max(0, budget - num_new)
    return _OK, budget


class _Answers:
    """The response columns of the allocations, gathered in lists and written once."""

    __slots__ = ("block_ids", "counts", "lookup_computed", "lookup_new", "statuses")

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.counts: list[int] = []
        self.block_ids: list[int] = []
        self.lookup_computed: list[int] = []
        self.lookup_new: list[int] = []

    def add(
        self,
        status: int,
        *,
        num_groups: int,
        ids: tuple[list[int], ...] | None,
        hit_tokens: int | None,
        num_new: int,
    ) -> None:
        """One allocation's answer (``hit_tokens`` set: it looked the request up)."""
        self.statuses.append(status)
        if ids is None:
            self.counts.extend([0] * num_groups)
        else:
            for group in ids:
                self.counts.append(len(group))
                self.block_ids.extend(group)
        if hit_tokens is not None:
            self.lookup_computed.append(hit_tokens)
            self.lookup_new.append(num_new)

    def write(self, response: scheduler_pb2.StepResponse) -> None:
        """Copy the columns into ``response`` (one bulk extend each)."""
        response.alloc_statuses.extend(self.statuses)
        response.alloc_num_block_ids.extend(self.counts)
        response.alloc_block_ids.extend(self.block_ids)
        response.lookup_num_computed_tokens.extend(self.lookup_computed)
        response.lookup_num_new_tokens.extend(self.lookup_new)
