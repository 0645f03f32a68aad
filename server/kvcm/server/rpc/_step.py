"""The Step RPC: validate a whole scheduler step, then run it on the pool's core.

``validate_step`` walks the ops through a shadow of the request table (keys added and
finished, token counts after appends) and the columns, and raises
:class:`~kvcm.server.rpc._status.StepRejectedError` at the first op that would fail as a unary
call; nothing has changed then. ``execute_step`` then runs the ops on the core with cursors
over the packed columns, building the response columns directly (no per-item objects).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from kvcm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCMError,
    NotFoundError,
)
from kvcm.server.core.manager import DEFAULT_SLOT_OPTIONS, CacheHit, KVCacheManager, SlotOptions
from kvcm.server.core.pool import Pool
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
_NAMES: Final = {
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

# The shadow of one request during validation: [num_tokens, holds blocks for sure, hashes].
_Shadow = list[int]


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


class _Validator:
    """One validation pass over a Step (see the module docstring)."""

    def __init__(self, pool: Pool, message: scheduler_pb2.StepRequest) -> None:
        self.pool = pool
        self.message = message
        self.shadow: dict[int, _Shadow | None] = {}
        self.op_index = 0
        self.op_name = ""
        self.key_cursor = 0
        holds = pool.ready_manager().holds_blocks
        self._holds: Callable[[str], bool] = holds

    def fail(self, error: KVCMError, field: str) -> StepRejectedError:
        prefixed = type(error)(f"ops[{self.op_index}] {self.op_name}: {error}")
        return StepRejectedError(prefixed, self.op_index, field)

    def next_key(self) -> tuple[int, _Shadow]:
        keys = self.message.request_keys
        index = self.key_cursor
        if index >= len(keys):
            raise self.fail(
                InvalidArgumentError("request_keys has too few entries"), "request_keys"
            )
        self.key_cursor += 1
        key = keys[index]
        state = self.shadow.get(key, ...)  # Ellipsis: not in the shadow yet
        if state is ...:
            request = self.pool.requests.get(key)
            state = None
            if request is not None:
                state = [
                    request.num_tokens,
                    int(self._holds(request.request_id)),
                    len(request.block_hashes),
                ]
            self.shadow[key] = state
        if state is None:
            raise self.fail(
                NotFoundError(
                    f"request_keys[{index}]={key} is not live in pool {self.pool.name!r}"
                ),
                f"request_keys[{index}]",
            )
        return key, state


def _column(validator: _Validator, name: str, column: object, index: int) -> int:
    values = column  # a packed repeated field
    if index >= len(values):  # type: ignore[arg-type]
        raise validator.fail(InvalidArgumentError(f"{name} has too few entries"), name)
    value: int = values[index]  # type: ignore[index]
    return value


def validate_step(pool: Pool, message: scheduler_pb2.StepRequest) -> None:
    """Validate a whole Step against the pool without changing anything.

    Raises:
        StepRejectedError: The first failing op (or the malformed columns).
    """
    v = _Validator(pool, message)
    max_model_len = pool.max_model_len
    options_by_index = _alloc_options(v, message)
    n_add = n_append = n_alloc = n_cache = n_skipped = 0
    token_cursor = hash_cursor = 0
    hash_length = pool.hashing.hash_length_bytes
    for op_index, op in enumerate(message.ops):
        v.op_index = op_index
        v.op_name = _NAMES.get(op, str(op))
        if op == _APPEND:
            key, state = v.next_key()
            num_tokens = _column(v, "append_num_tokens", message.append_num_tokens, n_append)
            num_hashes = _column(
                v, "append_num_block_hashes", message.append_num_block_hashes, n_append
            )
            field = f"append_num_tokens[{n_append}]"
            n_append += 1
            token_cursor += num_tokens
            if token_cursor > len(message.append_token_ids):
                raise v.fail(InvalidArgumentError("append_token_ids has too few entries"), field)
            hash_cursor += num_hashes * hash_length
            if hash_cursor > len(message.append_block_hashes):
                raise v.fail(
                    InvalidArgumentError("append_block_hashes has too few hashes"),
                    f"append_num_block_hashes[{n_append - 1}]",
                )
            try:
                pool.check_append(key, num_tokens, num_hashes, state[0], state[2])
            except InvalidArgumentError as exc:
                raise v.fail(exc, field) from None
            state[0] += num_tokens
            state[2] += num_hashes
        elif op == _ALLOCATE:
            key, state = v.next_key()
            num_new = _column(v, "alloc_num_new_tokens", message.alloc_num_new_tokens, n_alloc)
            num_computed = _column(
                v, "alloc_num_computed_tokens", message.alloc_num_computed_tokens, n_alloc
            )
            _check_allocate(
                v,
                state,
                num_new=num_new,
                num_computed=num_computed,
                entry=options_by_index.get(n_alloc),
                index=n_alloc,
                max_model_len=max_model_len,
            )
            n_alloc += 1
        elif op == _ADD:
            if n_add >= len(message.new_requests):
                raise v.fail(
                    InvalidArgumentError("new_requests has too few entries"), "new_requests"
                )
            new = message.new_requests[n_add]
            field = f"new_requests[{n_add}]"
            n_add += 1
            key = new.request_key
            known = v.shadow.get(key, ...)
            live = key in pool.requests if known is ... else known is not None
            if live:
                raise v.fail(AlreadyExistsError(f"request key {key} is live"), field)
            try:
                pool.check_new_request(key, len(new.prompt_token_ids), len(new.block_hashes))
            except InvalidArgumentError as exc:
                raise v.fail(exc, field) from None
            v.shadow[key] = [
                len(new.prompt_token_ids),
                0,
                len(new.block_hashes) // pool.hashing.hash_length_bytes,
            ]
        elif op in (_CACHE, _SKIPPED):
            key, state = v.next_key()
            if op == _CACHE:
                name, column, index = (
                    "cache_num_computed_tokens",
                    message.cache_num_computed_tokens,
                    n_cache,
                )
                n_cache += 1
            else:
                name, column, index = (
                    "remove_skipped_total_computed_tokens",
                    message.remove_skipped_total_computed_tokens,
                    n_skipped,
                )
                n_skipped += 1
            value = _column(v, name, column, index)
            if value > state[0]:
                raise v.fail(
                    InvalidArgumentError(
                        f"{name}[{index}]={value} exceeds the request's {state[0]} tokens"
                    ),
                    f"{name}[{index}]",
                )
        elif op == _PREEMPT:
            _, state = v.next_key()
            state[1] = 0
        elif op == _FINISH:
            key, _ = v.next_key()
            v.shadow[key] = None
        elif op != _NEW_STEP:
            raise v.fail(
                InvalidArgumentError(f"ops[{op_index}] has unknown kind {op}"), f"ops[{op_index}]"
            )
    _check_consumed(
        message,
        v,
        (
            ("request_keys", v.key_cursor, len(message.request_keys)),
            ("new_requests", n_add, len(message.new_requests)),
            ("alloc_num_new_tokens", n_alloc, len(message.alloc_num_new_tokens)),
            ("alloc_num_computed_tokens", n_alloc, len(message.alloc_num_computed_tokens)),
            ("append_num_tokens", n_append, len(message.append_num_tokens)),
            ("append_num_block_hashes", n_append, len(message.append_num_block_hashes)),
            ("append_token_ids", token_cursor, len(message.append_token_ids)),
            ("append_block_hashes", hash_cursor, len(message.append_block_hashes)),
            ("cache_num_computed_tokens", n_cache, len(message.cache_num_computed_tokens)),
            (
                "remove_skipped_total_computed_tokens",
                n_skipped,
                len(message.remove_skipped_total_computed_tokens),
            ),
        ),
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


def _check_consumed(
    message: scheduler_pb2.StepRequest,
    v: _Validator,
    columns: tuple[tuple[str, int, int], ...],
) -> None:
    del message, v
    for name, used, size in columns:
        if used != size:
            raise StepRejectedError(
                InvalidArgumentError(f"{name} has {size} entries, the ops consume {used}"),
                None,
                name,
            )


def _alloc_options(
    v: _Validator, message: scheduler_pb2.StepRequest
) -> dict[int, scheduler_pb2.StepAllocOptions]:
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
    del v
    return entries


def _check_allocate(
    v: _Validator,
    state: _Shadow,
    *,
    num_new: int,
    num_computed: int,
    entry: scheduler_pb2.StepAllocOptions | None,
    index: int,
    max_model_len: int,
) -> None:
    num_tokens = state[0]
    if num_computed > num_tokens:
        raise v.fail(
            InvalidArgumentError(
                f"alloc_num_computed_tokens[{index}]={num_computed} exceeds the request's "
                f"{num_tokens} tokens"
            ),
            f"alloc_num_computed_tokens[{index}]",
        )
    lookup = entry is not None and entry.HasField("lookup")
    external = entry.options.num_external_computed_tokens if entry is not None else 0
    if lookup:
        if num_computed:
            raise v.fail(
                InvalidArgumentError(
                    f"alloc_num_computed_tokens[{index}]={num_computed}: an ALLOCATE with a "
                    "lookup is for a waiting request with no computed tokens"
                ),
                f"alloc_num_computed_tokens[{index}]",
            )
        if state[1]:
            raise v.fail(
                InvalidArgumentError(
                    f"alloc_options for allocation {index}: lookup for a request that holds blocks"
                ),
                f"alloc_options[{index}].lookup",
            )
        return
    if num_new == 0 and external == 0:
        raise v.fail(
            InvalidArgumentError(
                f"alloc_num_new_tokens[{index}] must be > 0 when there is nothing to adopt"
            ),
            f"alloc_num_new_tokens[{index}]",
        )
    if num_computed + num_new > max_model_len:
        raise v.fail(
            InvalidArgumentError(
                f"alloc_num_computed_tokens[{index}] + alloc_num_new_tokens[{index}] = "
                f"{num_computed + num_new} exceeds max_model_len {max_model_len}"
            ),
            f"alloc_num_new_tokens[{index}]",
        )


def execute_step(
    pool: Pool, manager: KVCacheManager, message: scheduler_pb2.StepRequest
) -> scheduler_pb2.StepResponse:
    """Run a validated Step (see the module docstring); returns its response.

    Raises:
        StepRejectedError: The core rejected an op validation could not foresee (the ops
            before it ran).
    """
    response = scheduler_pb2.StepResponse()
    op_index = 0
    try:
        op_index = _execute(pool, manager, message, response)
    except KVCMError as exc:
        raise StepRejectedError(
            type(exc)(
                f"ops[{_failed_op(response)}] rejected by the core after "
                f"{_failed_op(response)} ops ran: {exc}"
            ),
            _failed_op(response),
            "ops",
        ) from exc
    del op_index
    return response


def _failed_op(response: scheduler_pb2.StepResponse) -> int:
    return response.num_ops_executed


def _execute(
    pool: Pool,
    manager: KVCacheManager,
    message: scheduler_pb2.StepRequest,
    response: scheduler_pb2.StepResponse,
) -> int:
    requests = pool.requests
    keys = message.request_keys
    hash_length = pool.hashing.hash_length_bytes
    append_tokens = message.append_token_ids
    append_hashes = message.append_block_hashes
    alloc_new = message.alloc_num_new_tokens
    alloc_computed = message.alloc_num_computed_tokens
    options_by_index = {entry.alloc_index: entry for entry in message.alloc_options}
    default_lookahead = message.default_num_lookahead_tokens
    default_options = (
        SlotOptions(num_lookahead_tokens=default_lookahead)
        if default_lookahead
        else DEFAULT_SLOT_OPTIONS
    )
    budget = message.token_budget if message.HasField("token_budget") else None
    stop = not message.continue_on_does_not_fit
    statuses = response.alloc_statuses
    counts = response.alloc_num_block_ids
    block_ids = response.alloc_block_ids
    num_groups = manager.num_kv_cache_groups
    k = n_add = n_append = n_alloc = n_cache = n_skipped = 0
    token_cursor = hash_cursor = 0
    executed = 0
    for op in message.ops:
        response.num_ops_executed = executed
        executed += 1
        if op == _ALLOCATE:
            request = requests[keys[k]]
            k += 1
            num_new = alloc_new[n_alloc]
            request.num_computed_tokens = alloc_computed[n_alloc]
            entry = options_by_index.get(n_alloc) if options_by_index else None
            n_alloc += 1
            if entry is None:
                request.num_in_flight_tokens = 0
                blocks = pool.allocate_slots(request, num_new, None, default_options)
                if blocks is None:
                    statuses.append(_DOES_NOT_FIT)
                    counts.extend([0] * num_groups)
                    if stop:
                        break
                    continue
                statuses.append(_OK)
                for group in blocks.blocks:
                    counts.append(len(group))
                    block_ids.extend([block.block_id for block in group])
                if budget is not None:
                    budget = max(0, budget - num_new)
                continue
            status, budget = _allocate_with_options(
                pool,
                manager,
                request=request,
                num_new=num_new,
                entry=entry,
                default_lookahead=default_lookahead,
                budget=budget,
                response=response,
            )
            if status != _OK and stop:
                break
        elif op == _APPEND:
            request = requests[keys[k]]
            k += 1
            num_tokens = message.append_num_tokens[n_append]
            num_hashes = message.append_num_block_hashes[n_append]
            n_append += 1
            tokens = append_tokens[token_cursor : token_cursor + num_tokens]
            token_cursor += num_tokens
            size = num_hashes * hash_length
            raw = append_hashes[hash_cursor : hash_cursor + size]
            hash_cursor += size
            hashes = [raw[i : i + hash_length] for i in range(0, size, hash_length)]
            pool.apply_append(request, tokens, hashes)  # type: ignore[arg-type]
        elif op == _NEW_STEP:
            manager.new_step_starts()
        elif op == _ADD:
            new = message.new_requests[n_add]
            n_add += 1
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
        elif op == _CACHE:
            request = requests[keys[k]]
            k += 1
            manager.cache_blocks(request, message.cache_num_computed_tokens[n_cache])
            n_cache += 1
        elif op == _SKIPPED:
            request = requests[keys[k]]
            k += 1
            total = message.remove_skipped_total_computed_tokens[n_skipped]
            n_skipped += 1
            manager.remove_skipped_blocks(request.request_id, total)
        elif op == _PREEMPT:
            pool.free(keys[k], preempt=True)
            k += 1
        else:  # _FINISH; validation allowed no other kind
            pool.free(keys[k], preempt=False)
            k += 1
    response.num_ops_executed = executed
    if budget is not None:
        response.token_budget_left = budget
    return executed


def _allocate_with_options(
    pool: Pool,
    manager: KVCacheManager,
    *,
    request: object,
    num_new: int,
    entry: scheduler_pb2.StepAllocOptions,
    default_lookahead: int,
    budget: int | None,
    response: scheduler_pb2.StepResponse,
) -> tuple[int, int | None]:
    from kvcm.server.core.request import Request

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
            _answer(
                response,
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
        _answer(
            response, _DOES_NOT_FIT, num_groups=num_groups, ids=None, hit_tokens=looked, num_new=0
        )
        return _DOES_NOT_FIT, budget
    if hit is not None:
        manager.record_prefix_cache_stats(request, hit.num_computed_tokens)
        ids = manager.get_block_ids(request.request_id)
        _answer(
            response,
            _OK,
            num_groups=num_groups,
            ids=ids,
            hit_tokens=hit.num_computed_tokens,
            num_new=num_new,
        )
    else:
        _answer(
            response,
            _OK,
            num_groups=num_groups,
            ids=blocks.get_block_ids(),
            hit_tokens=None,
            num_new=0,
        )
    if budget is not None:
        budget = max(0, budget - num_new)
    return _OK, budget


def _answer(
    response: scheduler_pb2.StepResponse,
    status: int,
    *,
    num_groups: int,
    ids: tuple[list[int], ...] | None,
    hit_tokens: int | None,
    num_new: int,
) -> None:
    response.alloc_statuses.append(status)
    if ids is None:
        response.alloc_num_block_ids.extend([0] * num_groups)
    else:
        for group in ids:
            response.alloc_num_block_ids.append(len(group))
            response.alloc_block_ids.extend(group)
    if hit_tokens is not None:
        response.lookup_num_computed_tokens.append(hit_tokens)
        response.lookup_num_new_tokens.append(num_new)
