"""Build a Step (a whole scheduler step in one message) and read its answer.

``StepBuilder`` records operations in the order they must run and keeps their arguments in
plain Python lists, one per column of ``kvcm.v1.StepRequest``; ``to_proto`` copies each list
into its packed field once. ``StepResult`` decodes the answer into one entry per allocation.

::

    builder = StepBuilder(token_budget=2048)
    builder.finish(7)
    builder.append_tokens(3, [1234], [hash_of_block_2])
    builder.new_step_starts()
    builder.allocate(3, 1, 47)
    builder.add_request(9, prompt, prompt_hashes, request_id="req-9")
    builder.allocate(9, 40, 0, lookup=True)
    result = client.step("engine-0", builder)
    result.blocks(1)            # request 9: hit blocks + new blocks (lookup allocations)
    result.lookup(1)            # (num_computed_tokens of the hit, num_new_tokens allocated)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvcm.client._types import DEFAULT_SLOT_OPTIONS, ItemStatus, KVCacheBlocks, SlotOptions
from kvcm.common.errors import InvalidArgumentError
from kvcm.v1 import scheduler_pb2

__all__ = ["LookupResult", "StepBuilder", "StepResult"]

_OP_ADD: Final = scheduler_pb2.STEP_OP_KIND_ADD_REQUEST
_OP_APPEND: Final = scheduler_pb2.STEP_OP_KIND_APPEND_TOKENS
_OP_ALLOCATE: Final = scheduler_pb2.STEP_OP_KIND_ALLOCATE
_OP_CACHE: Final = scheduler_pb2.STEP_OP_KIND_CACHE_BLOCKS
_OP_REMOVE_SKIPPED: Final = scheduler_pb2.STEP_OP_KIND_REMOVE_SKIPPED_BLOCKS
_OP_PREEMPT: Final = scheduler_pb2.STEP_OP_KIND_PREEMPT
_OP_FINISH: Final = scheduler_pb2.STEP_OP_KIND_FINISH
_OP_NEW_STEP: Final = scheduler_pb2.STEP_OP_KIND_NEW_STEP_STARTS

_OK: Final = int(ItemStatus.OK)
# Wire value -> ItemStatus; index 0 (UNSPECIFIED) reads as NOT_EXECUTED.
_ITEM_STATUS: Final = (
    ItemStatus.NOT_EXECUTED,
    ItemStatus.OK,
    ItemStatus.DOES_NOT_FIT,
    ItemStatus.NO_TOKEN_BUDGET,
    ItemStatus.NOT_EXECUTED,
)


def slot_options_to_proto(options: SlotOptions, message: scheduler_pb2.SlotOptions) -> None:
    """Fill a ``kvcm.v1.SlotOptions`` from the SDK's options (unset fields keep defaults).

    Args:
        options: The SDK's options.
        message: The message to fill.
    """
    if options.num_lookahead_tokens is not None:
        message.num_lookahead_tokens = options.num_lookahead_tokens
    message.num_external_computed_tokens = options.num_external_computed_tokens
    message.delay_cache_blocks = options.delay_cache_blocks
    message.num_encoder_tokens = options.num_encoder_tokens
    message.full_sequence_must_fit = options.full_sequence_must_fit
    message.reserved_blocks = options.reserved_blocks
    if not options.has_scheduled_reqs:
        message.has_scheduled_reqs = False
    if options.num_in_flight_tokens:
        message.num_in_flight_tokens = options.num_in_flight_tokens


def _joined(block_hashes: Sequence[bytes] | bytes) -> bytes:
    return block_hashes if isinstance(block_hashes, bytes) else b"".join(block_hashes)


class StepBuilder:
    """Records one scheduler step's operations for a single Step RPC.

    Operations run on the server in the order they are recorded, exactly as the equivalent
    unary calls would. A builder is meant to be used once; ``to_proto`` may be called again.

    Attributes:
        step_seq: Exactly-once guard: the pool's last applied step_seq + 1 (``None``: off).
            A Step with a step_seq may be retried safely (the SDK retries it on UNAVAILABLE).
        token_budget: Tokens the step may still schedule; caps lookup allocations, and every
            allocation that fits deducts its tokens. ``None``: no cap.
        default_num_lookahead_tokens: Lookahead of every allocation that does not set its own.
        continue_on_does_not_fit: Run every op even after an allocation that does not fit
            (by default the Step stops right after it).
    """

    __slots__ = (
        "_add_requests",
        "_alloc_computed",
        "_alloc_new_tokens",
        "_alloc_options",
        "_append_hashes",
        "_append_num_hashes",
        "_append_num_tokens",
        "_append_token_ids",
        "_cache_computed",
        "_keys",
        "_lookup_allocs",
        "_ops",
        "_remove_skipped",
        "continue_on_does_not_fit",
        "default_num_lookahead_tokens",
        "step_seq",
        "token_budget",
    )

    def __init__(
        self,
        *,
        step_seq: int | None = None,
        token_budget: int | None = None,
        default_num_lookahead_tokens: int = 0,
        continue_on_does_not_fit: bool = False,
    ) -> None:
        """Start an empty step.

        Args:
            step_seq: Exactly-once guard (see the class attributes); ``None``: off.
            token_budget: The step's token budget; ``None``: no cap.
            default_num_lookahead_tokens: Lookahead of allocations without their own.
            continue_on_does_not_fit: Run every op even after a "does not fit".
        """
        self.step_seq = step_seq
        self.token_budget = token_budget
        self.default_num_lookahead_tokens = default_num_lookahead_tokens
        self.continue_on_does_not_fit = continue_on_does_not_fit
        self._ops: list[scheduler_pb2.StepOpKind] = []
        self._keys: list[int] = []
        self._alloc_new_tokens: list[int] = []
        self._alloc_computed: list[int] = []
        self._alloc_options: list[scheduler_pb2.StepAllocOptions] = []
        self._lookup_allocs: list[int] = []
        self._append_num_tokens: list[int] = []
        self._append_token_ids: list[int] = []
        self._append_num_hashes: list[int] = []
        self._append_hashes: list[bytes] = []
        self._cache_computed: list[int] = []
        self._remove_skipped: list[int] = []
        self._add_requests: list[scheduler_pb2.NewRequest] = []

    # ------------------------------------------------------------------ request lifecycle
    def add_request(
        self,
        request_key: int,
        prompt_token_ids: Sequence[int],
        block_hashes: Sequence[bytes] | bytes = b"",
        *,
        request_id: str = "",
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        """Start tracking a request (ADD_REQUEST).

        Args:
            request_key: The scheduler's key for it; not live in the pool.
            prompt_token_ids: The prompt (non-empty).
            block_hashes: Hashes of the prompt's full hash blocks, in order.
            request_id: vLLM's request id, for logs and error messages.
            lora_id: LoRA id, published in events.
            lora_name: LoRA name, published in events.
            cache_salt: Only used by servers that verify hashes.
            skip_reading_prefix_cache: Never look this request up in the prefix cache.
        """
        message = scheduler_pb2.NewRequest(
            request_key=request_key,
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            block_hashes=_joined(block_hashes),
            skip_reading_prefix_cache=skip_reading_prefix_cache,
        )
        if lora_id is not None:
            message.lora_id = lora_id
        if lora_name is not None:
            message.lora_name = lora_name
        if cache_salt is not None:
            message.cache_salt = cache_salt
        self._ops.append(_OP_ADD)
        self._add_requests.append(message)

    def append_tokens(
        self,
        request_key: int,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes] = (),
    ) -> None:
        """Append tokens the request produced and the hashes of blocks they filled.

        Args:
            request_key: A live request.
            token_ids: The new tokens (non-empty).
            block_hashes: Hashes of the hash blocks these tokens completed, in order.
        """
        self._ops.append(_OP_APPEND)
        self._keys.append(request_key)
        self._append_num_tokens.append(len(token_ids))
        self._append_token_ids.extend(token_ids)
        self._append_num_hashes.append(len(block_hashes))
        if block_hashes:
            self._append_hashes.extend(block_hashes)

    def preempt(self, request_key: int) -> None:
        """Free the request's blocks and keep it (a preemption)."""
        self._ops.append(_OP_PREEMPT)
        self._keys.append(request_key)

    def finish(self, request_key: int) -> None:
        """Free the request's blocks and forget it (its key may be reused)."""
        self._ops.append(_OP_FINISH)
        self._keys.append(request_key)

    # -------------------------------------------------------------------- manager calls
    def allocate(
        self,
        request_key: int,
        num_new_tokens: int,
        num_computed_tokens: int,
        *,
        lookup: bool = False,
        max_cache_hit_length: int | None = None,
        options: SlotOptions = DEFAULT_SLOT_OPTIONS,
    ) -> int:
        """Allocate slots (ALLOCATE); with ``lookup``, look the request up first.

        Args:
            request_key: A live request.
            num_new_tokens: Tokens to allocate slots for; with ``lookup`` an upper bound (the
                server allocates ``min(num_new_tokens, tokens left after the hit, budget)``).
            num_computed_tokens: The request's computed tokens before this allocation.
            lookup: Run ``get_computed_blocks`` first and adopt the hit (a waiting request).
            max_cache_hit_length: With ``lookup``: cap of the hit; ``None``: num_tokens - 1.
            options: The rarely used knobs of ``allocate_slots``.

        Returns:
            The allocation's index among this step's allocations (for ``StepResult``).
        """
        if max_cache_hit_length is not None and not lookup:
            raise InvalidArgumentError("max_cache_hit_length needs lookup=True")
        index = len(self._alloc_new_tokens)
        self._ops.append(_OP_ALLOCATE)
        self._keys.append(request_key)
        self._alloc_new_tokens.append(num_new_tokens)
        self._alloc_computed.append(num_computed_tokens)
        if lookup or options is not DEFAULT_SLOT_OPTIONS:
            entry = scheduler_pb2.StepAllocOptions(alloc_index=index)
            if lookup:
                entry.lookup.SetInParent()
                if max_cache_hit_length is not None:
                    entry.lookup.max_cache_hit_length = max_cache_hit_length
                self._lookup_allocs.append(index)
            if options is not DEFAULT_SLOT_OPTIONS:
                slot_options_to_proto(options, entry.options)
            self._alloc_options.append(entry)
        return index

    def decode(
        self,
        request_keys: Sequence[int],
        token_ids: Sequence[int],
        num_computed_tokens: Sequence[int],
        block_hashes: Sequence[bytes] | None = None,
    ) -> range:
        """A decode step for many requests at once: per request, append its one new token
        (APPEND_TOKENS) and allocate one slot (ALLOCATE), in the order given.

        The same ops as ``append_tokens`` + ``allocate`` per request, recorded with one list
        operation per column (a 256-request decode step costs tens of microseconds to build).

        Args:
            request_keys: The running requests.
            token_ids: Each request's new token.
            num_computed_tokens: Each request's computed tokens before the allocation.
            block_hashes: Per request, the hash of the block its token completed, or ``b""``;
                ``None``: no request completed a block.

        Returns:
            The allocation indexes of the requests, in order.
        """
        count = len(request_keys)
        if len(token_ids) != count or len(num_computed_tokens) != count:
            raise InvalidArgumentError(
                "request_keys, token_ids and num_computed_tokens must have the same length"
            )
        first = len(self._alloc_new_tokens)
        ones = [1] * count
        self._ops.extend([_OP_APPEND, _OP_ALLOCATE] * count)
        keys = self._keys
        for key in request_keys:
            keys.append(key)
            keys.append(key)
        self._append_num_tokens.extend(ones)
        self._append_token_ids.extend(token_ids)
        if block_hashes is None:
            self._append_num_hashes.extend([0] * count)
        else:
            if len(block_hashes) != count:
                raise InvalidArgumentError("block_hashes must have one entry per request")
            self._append_num_hashes.extend([1 if h else 0 for h in block_hashes])
            self._append_hashes.extend(h for h in block_hashes if h)
        self._alloc_new_tokens.extend(ones)
        self._alloc_computed.extend(num_computed_tokens)
        return range(first, first + count)

    def cache_blocks(self, request_key: int, num_computed_tokens: int) -> None:
        """Cache the request's full blocks within its first ``num_computed_tokens`` tokens."""
        self._ops.append(_OP_CACHE)
        self._keys.append(request_key)
        self._cache_computed.append(num_computed_tokens)

    def remove_skipped_blocks(self, request_key: int, total_computed_tokens: int) -> None:
        """Free the request's blocks outside the attention window."""
        self._ops.append(_OP_REMOVE_SKIPPED)
        self._keys.append(request_key)
        self._remove_skipped.append(total_computed_tokens)

    def new_step_starts(self) -> None:
        """Tell the managers a scheduler step starts (NEW_STEP_STARTS)."""
        self._ops.append(_OP_NEW_STEP)

    # --------------------------------------------------------------------------- output
    @property
    def num_ops(self) -> int:
        """Operations recorded so far."""
        return len(self._ops)

    @property
    def num_allocations(self) -> int:
        """Allocations recorded so far."""
        return len(self._alloc_new_tokens)

    @property
    def lookup_allocations(self) -> tuple[int, ...]:
        """Indexes of the allocations with a lookup, ascending."""
        return tuple(self._lookup_allocs)

    def __len__(self) -> int:
        return len(self._ops)

    def to_proto(self, pool_id: str) -> scheduler_pb2.StepRequest:
        """The ``kvcm.v1.StepRequest`` for ``pool_id``."""
        message = scheduler_pb2.StepRequest(
            pool_id=pool_id,
            ops=self._ops,
            request_keys=self._keys,
            alloc_num_new_tokens=self._alloc_new_tokens,
            alloc_num_computed_tokens=self._alloc_computed,
            alloc_options=self._alloc_options,
            append_num_tokens=self._append_num_tokens,
            append_token_ids=self._append_token_ids,
            append_num_block_hashes=self._append_num_hashes,
            append_block_hashes=b"".join(self._append_hashes),
            cache_num_computed_tokens=self._cache_computed,
            remove_skipped_total_computed_tokens=self._remove_skipped,
            new_requests=self._add_requests,
            default_num_lookahead_tokens=self.default_num_lookahead_tokens,
            continue_on_does_not_fit=self.continue_on_does_not_fit,
        )
        if self.step_seq is not None:
            message.step_seq = self.step_seq
        if self.token_budget is not None:
            message.token_budget = self.token_budget
        return message


class LookupResult:
    """What a lookup allocation found and allocated.

    Attributes:
        num_computed_tokens: The local prefix-cache hit, in tokens.
        num_new_tokens: Tokens actually allocated (the capped ``num_new_tokens``; 0 unless OK).
    """

    __slots__ = ("num_computed_tokens", "num_new_tokens")

    def __init__(self, num_computed_tokens: int, num_new_tokens: int) -> None:
        """Record a lookup's answer."""
        self.num_computed_tokens = num_computed_tokens
        self.num_new_tokens = num_new_tokens

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LookupResult):
            return NotImplemented
        return (self.num_computed_tokens, self.num_new_tokens) == (
            other.num_computed_tokens,
            other.num_new_tokens,
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"LookupResult(num_computed_tokens={self.num_computed_tokens}, "
            f"num_new_tokens={self.num_new_tokens})"
        )


class StepResult:
    """The answer to one Step, one entry per allocation.

    Allocations the Step did not reach read ``NOT_EXECUTED``.

    Attributes:
        num_ops_executed: Ops ``ops[0:num_ops_executed]`` ran; the rest changed nothing.
        statuses: One status per allocation of the Step (executed or not), in order.
        token_budget_left: Budget left after the executed ops, when the Step set one.
        step_seq: Echo of the Step's step_seq.
    """

    __slots__ = (
        "_blocks",
        "_lookups",
        "num_ops_executed",
        "statuses",
        "step_seq",
        "token_budget_left",
    )

    def __init__(
        self,
        response: scheduler_pb2.StepResponse,
        num_allocations: int,
        lookup_allocations: Sequence[int] = (),
    ) -> None:
        """Decode a ``kvcm.v1.StepResponse``.

        Args:
            response: The answer.
            num_allocations: Allocations the Step carried.
            lookup_allocations: Indexes of its lookup allocations, ascending.
        """
        self.num_ops_executed = response.num_ops_executed
        self.step_seq = response.step_seq if response.HasField("step_seq") else None
        self.token_budget_left = (
            response.token_budget_left if response.HasField("token_budget_left") else None
        )
        raw_statuses = list(response.alloc_statuses)
        num_executed = len(raw_statuses)
        statuses = [_ITEM_STATUS[s] if s < 5 else ItemStatus.NOT_EXECUTED for s in raw_statuses]
        if num_allocations > num_executed:
            statuses.extend([ItemStatus.NOT_EXECUTED] * (num_allocations - num_executed))
        self.statuses = statuses
        self._blocks = _decode_blocks(response, raw_statuses)
        computed = response.lookup_num_computed_tokens
        new_tokens = response.lookup_num_new_tokens
        self._lookups = {
            index: LookupResult(computed[i], new_tokens[i])
            for i, index in enumerate(lookup_allocations[: len(computed)])
        }

    @property
    def num_allocations_executed(self) -> int:
        """Allocations the Step reached (OK, DOES_NOT_FIT or NO_TOKEN_BUDGET)."""
        return len(self._blocks)

    def status(self, alloc_index: int) -> ItemStatus:
        """The outcome of allocation ``alloc_index``."""
        return self.statuses[alloc_index]

    def blocks(self, alloc_index: int) -> KVCacheBlocks | None:
        """Blocks of allocation ``alloc_index``; ``None`` unless its status is OK.

        Without a lookup: the newly allocated blocks (``allocate_slots``' answer). With a
        lookup: every block the request holds (the hit followed by the new blocks).
        """
        return self._blocks[alloc_index] if alloc_index < len(self._blocks) else None

    def all_blocks(self) -> list[KVCacheBlocks | None]:
        """``blocks(i)`` for every executed allocation, in order (the held list)."""
        return self._blocks

    def lookup(self, alloc_index: int) -> LookupResult | None:
        """The hit and allocated tokens of lookup allocation ``alloc_index`` (if executed)."""
        return self._lookups.get(alloc_index)

    def __repr__(self) -> str:
        return (
            f"StepResult(num_ops_executed={self.num_ops_executed}, "
            f"statuses={[s.name for s in self.statuses]})"
        )


def _decode_blocks(
    response: scheduler_pb2.StepResponse, raw_statuses: list[int]
) -> list[KVCacheBlocks | None]:
    num_executed = len(raw_statuses)
    if not num_executed:
        return []
    counts = list(response.alloc_num_block_ids)
    ids = list(response.alloc_block_ids)
    num_groups = len(counts) // num_executed
    results: list[KVCacheBlocks | None] = []
    append = results.append
    if num_groups == 1:
        # The common case, without the per-group loop; empty answers share one instance.
        empty = KVCacheBlocks(([],))
        pos = 0
        for status, count in zip(raw_statuses, counts, strict=True):
            if status != _OK:
                append(None)
            elif count == 0:
                append(empty)
            else:
                append(KVCacheBlocks((ids[pos : pos + count],)))
                pos += count
        return results
    pos = 0
    cursor = 0
    for status in raw_statuses:
        if status != _OK:
            cursor += num_groups
            append(None)
            continue
        groups = []
        for count in counts[cursor : cursor + num_groups]:
            groups.append(ids[pos : pos + count])
            pos += count
        cursor += num_groups
        append(KVCacheBlocks(tuple(groups)))
    return results
