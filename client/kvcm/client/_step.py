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
from typing import Final, NamedTuple

from kvcm.client._types import ItemStatus, KVCacheBlocks, SlotOptions
from kvcm.common.errors import InvalidArgumentError
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS
from kvcm.core.op_table import OpWriter
from kvcm.core.program import (
    NO_LOOKUP_BOUND,
    AllocOptions,
    HitSpec,
    NewRequestSpec,
    OpKind,
    StepOutcome,
    StepProgram,
)
from kvcm.v1 import scheduler_pb2
from kvcm.wire import outcome_from_proto, program_to_proto

__all__ = ["HostAllocResult", "LookupResult", "StepBuilder", "StepResult"]

_OK: Final = int(ItemStatus.OK)


def check_in_flight_tokens(value: object) -> None:
    """Refuse an in-flight token count that is not a non-negative int (before it travels)."""
    if type(value) is not int or value < 0:
        raise InvalidArgumentError(
            f"num_in_flight_tokens must be a non-negative int, got {value!r}",
            field="num_in_flight_tokens",
        )


def check_report_cached_blocks(value: object) -> None:
    """Refuse a report_cached_blocks that is not a bool (before it travels)."""
    if type(value) is not bool:
        raise InvalidArgumentError(
            f"report_cached_blocks must be a bool, got {value!r}", field="report_cached_blocks"
        )


def _joined(block_hashes: Sequence[bytes] | bytes) -> bytes:
    return block_hashes if isinstance(block_hashes, bytes) else b"".join(block_hashes)


class StepBuilder:
    """Records one scheduler step's operations as a core ``StepProgram``.

    Each operation is written through the core's op table (``kvcm.core.op_table.OpWriter``),
    which knows the columns each op kind fills. Operations run on the server (or in-process,
    ``Pool.run_step(builder.program)``) in the order they are recorded, exactly as the
    equivalent unary calls would; the whole program is validated first, and a rejected one
    changes nothing. A builder is meant to be used once;
    ``program`` and ``to_proto`` may be read again.

    Attributes:
        program: The core program being built (``kvcm.core.program.StepProgram``); the clients
            send it with ``kvcm.wire.program_to_proto``.
        step_seq: Exactly-once guard: the pool's last applied step_seq + 1 (``None``: off).
            A Step with a step_seq may be retried safely (the SDK retries it on UNAVAILABLE).
        token_budget: Tokens the step may still schedule; caps lookup allocations, and every
            allocation that fits deducts its tokens. ``None``: no cap.
        default_num_lookahead_tokens: Lookahead of every allocation that does not set its own.
        continue_on_does_not_fit: Run every op even after an allocation that does not fit
            (by default the Step stops right after it).
    """

    __slots__ = ("_allocations", "_lookup_allocs", "_writer", "program")

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
        self.program = StepProgram(
            step_seq=step_seq,
            token_budget=token_budget,
            default_num_lookahead_tokens=default_num_lookahead_tokens,
            continue_on_does_not_fit=continue_on_does_not_fit,
        )
        self._writer = OpWriter(self.program)
        self._allocations = self._writer.columns(OpKind.ALLOCATE)[0]  # one entry per ALLOCATE
        self._lookup_allocs: list[int] = []

    @classmethod
    def from_program(cls, program: StepProgram) -> StepBuilder:
        """A builder around an existing program (to send a program built elsewhere).

        Args:
            program: The program; the builder records into it (it is not copied).
        """
        builder = cls.__new__(cls)
        builder.program = program
        builder._writer = OpWriter(program)
        builder._allocations = builder._writer.columns(OpKind.ALLOCATE)[0]
        builder._lookup_allocs = sorted(
            index for index, entry in program.alloc_options.items() if entry.lookup is not None
        )
        return builder

    # ------------------------------------------------------------------ step-wide settings
    @property
    def step_seq(self) -> int | None:
        """Exactly-once guard (see the class attributes)."""
        return self.program.step_seq

    @step_seq.setter
    def step_seq(self, value: int | None) -> None:
        self.program.step_seq = value

    @property
    def token_budget(self) -> int | None:
        """The step's token budget; ``None``: no cap."""
        return self.program.token_budget

    @token_budget.setter
    def token_budget(self, value: int | None) -> None:
        self.program.token_budget = value

    @property
    def default_num_lookahead_tokens(self) -> int:
        """Lookahead of allocations without their own."""
        return self.program.default_num_lookahead_tokens

    @default_num_lookahead_tokens.setter
    def default_num_lookahead_tokens(self, value: int) -> None:
        self.program.default_num_lookahead_tokens = value

    @property
    def continue_on_does_not_fit(self) -> bool:
        """Run every op even after a "does not fit"."""
        return self.program.continue_on_does_not_fit

    @continue_on_does_not_fit.setter
    def continue_on_does_not_fit(self, value: bool) -> None:
        self.program.continue_on_does_not_fit = value

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
        report_cached_blocks: bool = False,
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
            report_cached_blocks: Report its prefix-cache hits in KV events as BlockStored
                (vLLM's per-request ``kv_cache_report_mode="full"``).

        Raises:
            InvalidArgumentError: ``report_cached_blocks`` is not a bool.
        """
        check_report_cached_blocks(report_cached_blocks)
        self._writer.op[OpKind.ADD_REQUEST](
            NewRequestSpec(
                key=request_key,
                request_id=request_id,
                prompt_token_ids=list(prompt_token_ids),
                block_hashes=_joined(block_hashes),
                lora_id=lora_id,
                lora_name=lora_name,
                cache_salt=cache_salt,
                skip_reading_prefix_cache=skip_reading_prefix_cache,
                report_cached_blocks=report_cached_blocks,
            )
        )

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
        self._writer.op[OpKind.APPEND_TOKENS](request_key, token_ids, block_hashes)

    def extend_prompt(self, request_key: int, num_prompt_tokens: int) -> None:
        """Make the request's first ``num_prompt_tokens`` tokens its prompt (EXTEND_PROMPT: a
        streaming-input session's next chunk, vLLM's ``_update_request_as_session``). Append
        the chunk's tokens first; the end is at least the current prompt's and at most the
        request's tokens."""
        self._writer.op[OpKind.EXTEND_PROMPT](request_key, num_prompt_tokens)

    def preempt(self, request_key: int) -> None:
        """Free the request's blocks and keep it (a preemption)."""
        self._writer.op[OpKind.PREEMPT](request_key)

    def finish(self, request_key: int, *, deferred: bool = False) -> None:
        """Free the request's blocks and forget it (its key may be reused).

        ``deferred``: release them as vLLM's deferred free does (FINISH_DEFERRED; an
        asynchronous KV consumer's ``pop_blocks_for_free``, returned when the step in flight
        completed): every group's blocks in one pool call (docs/mamba.md)."""
        self._writer.op[OpKind.FINISH_DEFERRED if deferred else OpKind.FINISH](request_key)

    # -------------------------------------------------------------------- manager calls
    def allocate(
        self,
        request_key: int,
        num_new_tokens: int,
        num_computed_tokens: int,
        *,
        lookup: bool = False,
        max_cache_hit_length: int | None = None,
        hit: HitSpec | KVCacheBlocks | None = None,
        num_hit_tokens: int | None = None,
        options: SlotOptions = DEFAULT_SLOT_OPTIONS,
        num_in_flight_tokens: int = 0,
    ) -> int:
        """Allocate slots (ALLOCATE); with ``lookup``, look the request up first.

        Args:
            request_key: A live request.
            num_new_tokens: Tokens to allocate slots for; with ``lookup`` an upper bound (the
                server allocates ``min(num_new_tokens, tokens left after the hit, budget)``).
            num_computed_tokens: The request's computed tokens before this allocation.
            lookup: Run ``get_computed_blocks`` first and adopt the hit (a waiting request).
            max_cache_hit_length: With ``lookup``: cap of the hit; ``None``: num_tokens - 1.
            hit: A prefix hit the caller looked up before (unary AllocateSlots'
                ``new_computed``): a ``HitSpec``, or the hit's ``KVCacheBlocks`` together with
                ``num_hit_tokens``. Exclusive with ``lookup``; the server checks the blocks
                still hold the request's hashes.
            num_hit_tokens: Tokens a ``KVCacheBlocks`` hit covers.
            options: The rarely used knobs of ``allocate_slots``; ``num_lookahead_tokens``
                unset or 0 takes the Step's ``default_num_lookahead_tokens``.
            num_in_flight_tokens: The request's tokens scheduled but not settled (async
                scheduling; vLLM's ``request.num_in_flight_tokens``).

        Returns:
            The allocation's index among this step's allocations (for ``StepResult``).
        """
        if max_cache_hit_length is not None and not lookup:
            raise InvalidArgumentError("max_cache_hit_length needs lookup=True")
        if hit is not None and lookup:
            raise InvalidArgumentError("hit and lookup are exclusive", field="hit")
        if isinstance(hit, KVCacheBlocks):
            if num_hit_tokens is None:
                raise InvalidArgumentError(
                    "a KVCacheBlocks hit needs num_hit_tokens", field="num_hit_tokens"
                )
            hit = HitSpec(
                num_tokens=num_hit_tokens, block_ids=tuple(list(g) for g in hit.block_ids)
            )
        program, writer = self.program, self._writer
        index = len(self._allocations)
        writer.op[OpKind.ALLOCATE](request_key, num_new_tokens, num_computed_tokens)
        if lookup or hit is not None or options is not DEFAULT_SLOT_OPTIONS or num_in_flight_tokens:
            check_in_flight_tokens(num_in_flight_tokens)
            bound = None
            if lookup:
                bound = NO_LOOKUP_BOUND if max_cache_hit_length is None else max_cache_hit_length
                self._lookup_allocs.append(index)
            program.alloc_options[index] = AllocOptions(
                lookup=bound,
                hit=hit,
                slot_options=options,
                num_in_flight_tokens=num_in_flight_tokens,
            )
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
        if block_hashes is not None and len(block_hashes) != count:
            raise InvalidArgumentError("block_hashes must have one entry per request")
        program, writer = self.program, self._writer
        first = len(self._allocations)
        ones = [1] * count
        program.ops.extend([int(OpKind.APPEND_TOKENS), int(OpKind.ALLOCATE)] * count)
        keys = program.request_keys
        for key in request_keys:
            keys.append(key)
            keys.append(key)
        # The op table's columns, in its order: APPEND_TOKENS' token and hash counts (their
        # entries go to the spans), ALLOCATE's new and computed tokens.
        num_tokens, num_hashes = writer.columns(OpKind.APPEND_TOKENS)
        num_tokens.extend(ones)
        program.append_token_ids.extend(token_ids)
        if block_hashes is None:
            num_hashes.extend([0] * count)
        else:
            num_hashes.extend([1 if h else 0 for h in block_hashes])
            writer.pending([h for h in block_hashes if h])
        num_new, num_computed = writer.columns(OpKind.ALLOCATE)
        num_new.extend(ones)
        num_computed.extend(num_computed_tokens)
        return range(first, first + count)

    def cache_blocks(self, request_key: int, num_computed_tokens: int) -> None:
        """Cache the request's full blocks within its first ``num_computed_tokens`` tokens."""
        self._writer.op[OpKind.CACHE_BLOCKS](request_key, num_computed_tokens)

    def remove_skipped_blocks(self, request_key: int, total_computed_tokens: int) -> None:
        """Free the request's blocks outside the attention window."""
        self._writer.op[OpKind.REMOVE_SKIPPED_BLOCKS](request_key, total_computed_tokens)

    def new_step_starts(self) -> None:
        """Tell the managers a scheduler step starts (NEW_STEP_STARTS)."""
        self._writer.op[OpKind.NEW_STEP_STARTS]()

    # ---------------------------------------------------------------------- pool-wide ops
    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Evict these cached blocks from the prefix cache (EVICT_BLOCKS; unknown ids are
        refused by the server's validation)."""
        self._writer.op[OpKind.EVICT_BLOCKS](block_ids)

    def reset_prefix_cache(self) -> None:
        """Reset the prefix cache if no block is in use (RESET_PREFIX_CACHE; whether it did is
        ``StepResult.resets``)."""
        self._writer.op[OpKind.RESET_PREFIX_CACHE]()

    def record_prefix_stats(self, request_key: int, num_hits: int) -> None:
        """Count an admitted request in the pool's prefix-cache statistics with ``num_hits``
        hit tokens (RECORD_PREFIX_STATS: vLLM records at admission; a lookup allocation
        counts itself)."""
        self._writer.op[OpKind.RECORD_PREFIX_STATS](request_key, num_hits)

    def fork(self, request_key: int, child_key: int, num_computed_tokens: int) -> None:
        """Fork a running request (FORK; docs/fork-cow.md): ``child_key`` shares every block
        holding its first ``num_computed_tokens`` tokens, the partial last block included.
        The first write into a shared partial block is copied (``StepResult.copies``)."""
        self._writer.op[OpKind.FORK](request_key, child_key, num_computed_tokens)

    def common_computed_blocks(self, request_keys: Sequence[int]) -> None:
        """Ask for the common computed blocks of a group of requests (COMMON_BLOCKS, V0's
        ``get_common_computed_block_ids``; docs/fork-cow.md): per group, the leading cached
        blocks they all hold at the same positions (``StepResult.common_blocks``)."""
        self._writer.op[OpKind.COMMON_BLOCKS](list(request_keys))

    def take_block_copies(self, *, retain: bool = False) -> None:
        """Drain the block copies of sub-block prefix hits where vLLM's scheduler calls
        ``take_kv_cache_block_copies`` (TAKE_BLOCK_COPIES; docs/mamba.md): they are answered
        in ``StepResult.drained_copies`` and their blocks' extra references dropped.

        ``retain``: keep those references as one retained drain until
        :meth:`release_block_copies` (TAKE_BLOCK_COPIES_RETAINED: vLLM's scheduler when it
        defers frees, an asynchronous KV consumer)."""
        self._writer.op[OpKind.TAKE_BLOCK_COPIES_RETAINED if retain else OpKind.TAKE_BLOCK_COPIES]()

    def release_block_copies(self) -> None:
        """Drop the references of the oldest drain kept by ``take_block_copies(retain=True)``
        (RELEASE_BLOCK_COPIES: where vLLM's scheduler frees its copy retentions)."""
        self._writer.op[OpKind.RELEASE_BLOCK_COPIES]()

    def swap_out(self, request_key: int, num_computed_tokens: int) -> None:
        """Preempt a running request by swapping its blocks to the pool's host tier
        (SWAP_OUT; docs/host-tier.md) with its ``num_computed_tokens`` (what is swapped):
        ``StepResult.swapped_out`` says whether it swapped
        (else the tier had no room and it was preempted by recomputation)."""
        self._writer.op[OpKind.SWAP_OUT](request_key, num_computed_tokens)

    def swap_in(self, request_key: int, num_new_tokens: int) -> None:
        """Re-admit a request swapped out in an earlier Step (SWAP_IN), computing
        ``num_new_tokens`` after its swapped tokens (``StepResult.host_allocations``)."""
        self._writer.op[OpKind.SWAP_IN](request_key, num_new_tokens)

    def admit_with_host(self, request_key: int, num_new_tokens: int) -> None:
        """Admit a waiting request with its device hit and the host tier's hit after it
        (ADMIT_WITH_HOST), allocating at most ``num_new_tokens`` after both
        (``StepResult.host_allocations``; the loads come from ``take_host_copies``)."""
        self._writer.op[OpKind.ADMIT_WITH_HOST](request_key, num_new_tokens)

    def take_host_copies(self) -> None:
        """Drain the host tier's copies (TAKE_HOST_COPIES): ``StepResult.host_copies``."""
        self._writer.op[OpKind.TAKE_HOST_COPIES]()

    # --------------------------------------------------------------------------- output
    def build(self) -> StepProgram:
        """The core program recorded so far (the builder's own object, hashes joined)."""
        return self._writer.flush()

    @property
    def num_ops(self) -> int:
        """Operations recorded so far."""
        return len(self.program.ops)

    @property
    def num_allocations(self) -> int:
        """Allocations recorded so far."""
        return len(self._allocations)

    @property
    def lookup_allocations(self) -> tuple[int, ...]:
        """Indexes of the allocations with a lookup, ascending."""
        return tuple(self._lookup_allocs)

    def __len__(self) -> int:
        return len(self.program.ops)

    def to_proto(self, pool_id: str) -> scheduler_pb2.StepRequest:
        """The ``kvcm.v1.StepRequest`` for ``pool_id`` (``kvcm.wire.program_to_proto``)."""
        return program_to_proto(self.build(), pool_id)


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


class HostAllocResult(NamedTuple):
    """One executed SWAP_IN or ADMIT_WITH_HOST.

    Attributes:
        status: OK or DOES_NOT_FIT (nothing changed; a swapped request stays swapped).
        block_ids: Per group, every block the request holds (empty unless OK).
        num_device_hit_tokens: Tokens hit on the device.
        num_host_hit_tokens: Tokens copied back from the host tier.
    """

    status: ItemStatus
    block_ids: tuple[list[int], ...]
    num_device_hit_tokens: int
    num_host_hit_tokens: int


class StepResult:
    """The answer to one Step (a core ``StepOutcome``), one entry per allocation.

    Allocations the Step did not reach read ``NOT_EXECUTED``: the SDK's ``ItemStatus`` is the
    core's (same values) plus that one member, because "not reached" is a property of a
    result read against the program, never an outcome the interpreter produces.

    Attributes:
        outcome: The core's outcome (``kvcm.core.program.StepOutcome``).
        num_ops_executed: Ops ``ops[0:num_ops_executed]`` ran; the rest changed nothing.
        statuses: One status per allocation of the Step (executed or not), in order.
        token_budget_left: Budget left after the executed ops, when the Step set one.
        step_seq: Echo of the Step's step_seq.
    """

    __slots__ = (
        "_blocks",
        "_lookup_allocations",
        "_lookups",
        "_num_allocations",
        "_ops",
        "_statuses",
        "num_ops_executed",
        "outcome",
        "step_seq",
        "token_budget_left",
    )

    def __init__(
        self,
        outcome: StepOutcome | scheduler_pb2.StepResponse,
        num_allocations: int,
        lookup_allocations: Sequence[int] = (),
        ops: Sequence[int] = (),
    ) -> None:
        """Wrap a Step's outcome.

        The statuses, blocks and lookups are decoded when first read: the vLLM mirror's
        shipper compares only the outcome, and a 256-request decode step's blocks are 256
        small objects it would make for nothing.

        Args:
            outcome: The outcome (a ``kvcm.v1.StepResponse`` is decoded with
                ``kvcm.wire.outcome_from_proto``).
            num_allocations: Allocations the Step carried.
            lookup_allocations: Indexes of its lookup allocations, ascending.
            ops: The Step's ops (which answers ``common_blocks`` has).
        """
        if isinstance(outcome, scheduler_pb2.StepResponse):
            outcome = outcome_from_proto(outcome)
        self.outcome = outcome
        self.num_ops_executed = outcome.num_ops_executed
        self.step_seq = outcome.step_seq
        self.token_budget_left = outcome.token_budget_left
        self._num_allocations = num_allocations
        self._lookup_allocations = lookup_allocations
        self._ops = ops
        self._statuses: list[ItemStatus] | None = None
        self._blocks: list[KVCacheBlocks | None] | None = None
        self._lookups: dict[int, LookupResult] | None = None

    @property
    def statuses(self) -> list[ItemStatus]:
        """One status per allocation of the Step (executed or not), in order."""
        statuses = self._statuses
        if statuses is None:
            raw_statuses = self.outcome.alloc_statuses
            statuses = [_status(s) for s in raw_statuses]
            missing = self._num_allocations - len(raw_statuses)
            if missing > 0:
                statuses.extend([ItemStatus.NOT_EXECUTED] * missing)
            self._statuses = statuses
        return statuses

    def _decoded_blocks(self) -> list[KVCacheBlocks | None]:
        blocks = self._blocks
        if blocks is None:
            blocks = self._blocks = _decode_blocks(self.outcome)
        return blocks

    @classmethod
    def of(cls, builder: StepBuilder, outcome: StepOutcome) -> StepResult:
        """The result of ``builder``'s program answered by ``outcome`` (in-process or remote)."""
        return cls(
            outcome, builder.num_allocations, builder.lookup_allocations, builder.program.ops
        )

    @property
    def resets(self) -> list[bool]:
        """Per executed RESET_PREFIX_CACHE, whether it reset."""
        return self.outcome.reset

    @property
    def copies(self) -> list[tuple[int, int]]:
        """The Step's copy-on-write copies, ``(source, destination)`` block ids in the order
        made: hand them to the workers (``WorkerClient.apply_block_mappings(copies=...)``)."""
        ids = self.outcome.copy_block_ids
        return list(zip(ids[::2], ids[1::2], strict=True))

    @property
    def drained_copies(self) -> list[list[tuple[int, int]]]:
        """Per executed TAKE_BLOCK_COPIES, the sub-block hits' copies it drained,
        ``(source, destination)`` block ids in order: the workers run them before that step's
        forward pass."""
        ids = self.outcome.drained_copy_block_ids
        drains: list[list[tuple[int, int]]] = []
        start = 0
        for count in self.outcome.drained_num_copies:
            end = start + 2 * count
            drains.append(list(zip(ids[start:end:2], ids[start + 1 : end : 2], strict=True)))
            start = end
        return drains

    @property
    def common_blocks(self) -> list[tuple[list[int], ...]]:
        """Per executed COMMON_BLOCKS, per group, the common computed blocks' ids."""
        o = self.outcome
        counts, ids = o.common_num_block_ids, o.common_block_ids
        executed = self._ops[: self.num_ops_executed].count(OpKind.COMMON_BLOCKS)
        answers: list[tuple[list[int], ...]] = []
        if not executed:
            return answers
        num_groups = len(counts) // executed
        start = 0
        for first in range(0, len(counts), num_groups):
            answer = []
            for count in counts[first : first + num_groups]:
                answer.append(ids[start : start + count])
                start += count
            answers.append(tuple(answer))
        return answers

    @property
    def swapped_out(self) -> list[bool]:
        """Per executed SWAP_OUT: swapped to the host tier (``False``: recomputation)."""
        return self.outcome.swap_out_swapped

    @property
    def host_allocations(self) -> list[HostAllocResult]:
        """Per executed SWAP_IN or ADMIT_WITH_HOST, in op order, its answer."""
        o = self.outcome
        groups = len(o.host_alloc_num_block_ids) // max(1, len(o.host_alloc_statuses))
        results: list[HostAllocResult] = []
        start = 0
        for i, status in enumerate(o.host_alloc_statuses):
            ids: list[list[int]] = []
            for count in o.host_alloc_num_block_ids[i * groups : (i + 1) * groups]:
                ids.append(o.host_alloc_block_ids[start : start + count])
                start += count
            results.append(
                HostAllocResult(
                    _status(status),
                    tuple(ids),
                    o.host_alloc_num_device_hit_tokens[i],
                    o.host_alloc_num_host_hit_tokens[i],
                )
            )
        return results

    @property
    def host_copies(self) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
        """Per executed TAKE_HOST_COPIES, ``(device_to_host, host_to_device)``: pairs
        ``(device_block_id, host_block_id)`` and ``(host_block_id, device_block_id)``; the
        workers run the first list, then the second, before the forward pass."""
        o = self.outcome
        drains: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = []
        d_start = h_start = 0
        for num_d2h, num_h2d in zip(o.host_num_d2h, o.host_num_h2d, strict=True):
            d_end, h_end = d_start + 2 * num_d2h, h_start + 2 * num_h2d
            d2h, h2d = o.host_d2h_block_ids, o.host_h2d_block_ids
            drains.append(
                (
                    list(zip(d2h[d_start:d_end:2], d2h[d_start + 1 : d_end : 2], strict=True)),
                    list(zip(h2d[h_start:h_end:2], h2d[h_start + 1 : h_end : 2], strict=True)),
                )
            )
            d_start, h_start = d_end, h_end
        return drains

    @property
    def num_allocations_executed(self) -> int:
        """Allocations the Step reached (OK, DOES_NOT_FIT or NO_TOKEN_BUDGET)."""
        return len(self._decoded_blocks())

    def status(self, alloc_index: int) -> ItemStatus:
        """The outcome of allocation ``alloc_index``."""
        return self.statuses[alloc_index]

    def blocks(self, alloc_index: int) -> KVCacheBlocks | None:
        """Blocks of allocation ``alloc_index``; ``None`` unless its status is OK.

        Without a lookup: the newly allocated blocks (``allocate_slots``' answer). With a
        lookup: every block the request holds (the hit followed by the new blocks).
        """
        blocks = self._decoded_blocks()
        return blocks[alloc_index] if alloc_index < len(blocks) else None

    def all_blocks(self) -> list[KVCacheBlocks | None]:
        """``blocks(i)`` for every executed allocation, in order (the held list)."""
        return self._decoded_blocks()

    def lookup(self, alloc_index: int) -> LookupResult | None:
        """The hit and allocated tokens of lookup allocation ``alloc_index`` (if executed)."""
        lookups = self._lookups
        if lookups is None:
            computed = self.outcome.lookup_num_computed_tokens
            new_tokens = self.outcome.lookup_num_new_tokens
            lookups = self._lookups = {
                index: LookupResult(computed[i], new_tokens[i])
                for i, index in enumerate(self._lookup_allocations[: len(computed)])
            }
        return lookups.get(alloc_index)

    def __repr__(self) -> str:
        return (
            f"StepResult(num_ops_executed={self.num_ops_executed}, "
            f"statuses={[s.name for s in self.statuses]})"
        )


def _status(value: int) -> ItemStatus:
    try:
        return ItemStatus(value)
    except ValueError:
        return ItemStatus.NOT_EXECUTED


def _decode_blocks(outcome: StepOutcome) -> list[KVCacheBlocks | None]:
    raw_statuses = outcome.alloc_statuses
    num_executed = len(raw_statuses)
    if not num_executed:
        return []
    counts = outcome.alloc_num_block_ids
    ids = outcome.alloc_block_ids
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
