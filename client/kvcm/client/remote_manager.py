"""RemoteKVCacheManager: vLLM 0.33's ``KVCacheManager`` surface, served by a kvcm pool.

A scheduler written against vLLM's in-process manager calls the same methods with the same
arguments and reads results of the same shapes; the pool lives in the kvcm server.

This is the manager of a scheduler that keeps **no copy** of its pool: the server decides every
answer, so it attaches to a pool in any state (prefixes cached by earlier runs included) and
follows what others change there (an operator's evictions or clear of the prefix cache). vLLM
itself runs on ``kvcm.integrations.vllm`` instead, whose one manager is a local mirror of the
pool (kvcm's core decides, and the server's copy gets the Step programs; its ``remote`` mode
waits for the server to acknowledge each answer). The mirror cannot stand in for this class:
the server has no call that hands a pool's state to a new client, and a mirror that attaches
to a pool replaces the pool's state with its own.

What is batched: calls that answer nothing (``free``, ``cache_blocks``,
``remove_skipped_blocks``, ``new_step_starts``, and the tokens and block hashes a request gained
since it was last sent) are queued, in call order, and travel as ops of the next Step RPC. Calls
that answer something send the queue first:

===============================  ================================================================
call                             round trips
===============================  ================================================================
``allocate_slots`` (no hit)      1: one Step carrying the queue and the ALLOCATE
``allocate_slots_many``          1: one Step carrying the queue and every ALLOCATE (vLLM's loop
                                 over running requests; stops at the first that does not fit)
``allocate_slots`` with a hit    1 (+1 when the queue is not empty): the unary AllocateSlots
``get_computed_blocks``          1 (+1 when the queue is not empty); none when caching is off
``flush``                        1 when the queue is not empty
everything else                  1 (+1 when the queue is not empty)
===============================  ================================================================

A queued call's errors surface from the call that sends it. A rejected Step changes nothing on
the server; the SDK drops it and rolls its own bookkeeping back. A Step whose outcome is unknown
(deadline, connection lost) leaves the manager out of step with the pool: every later call
raises ``FailedPreconditionError`` (create a new pool, or a new manager after ``free``-ing).

Requests are hashed client-side with the pool's ``BlockHasher`` (algorithm, seed and block size
from the server), unless ``hash_requests=False`` says the requests already carry the pool's hashes
(e.g. kvcm ``Request`` objects built with ``manager.block_hasher``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final, Protocol

from kvcm.client._errors import DeadlineExceededError, ServiceError, UnavailableError
from kvcm.client._events import EventFollower
from kvcm.client._step import StepBuilder, StepResult
from kvcm.client._types import (
    USE_CLIENT_DEFAULT,
    CacheHit,
    FreeMode,
    KVCacheBlocks,
    PrefixCacheStats,
    SlotOptions,
    UseClientDefault,
)
from kvcm.common.errors import FailedPreconditionError, NotFoundError
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS

if TYPE_CHECKING:
    from kvcm.client.scheduler import SchedulerClient
    from kvcm.common.events import KVCacheEvent
    from kvcm.common.hashing import BlockHash, BlockHasher, MultiModalFeature

__all__ = ["RemoteKVCacheManager", "SchedulerRequest"]


class SchedulerRequest(Protocol):
    """What the manager reads from a request (kvcm's ``Request`` has all of it).

    vLLM's ``Request`` needs a thin adapter for ``lora_name`` / ``lora_id`` (vLLM keeps them in
    ``lora_request``).
    """

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_in_flight_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...
    @property
    def lora_name(self) -> str | None: ...
    @property
    def lora_id(self) -> int | None: ...
    @property
    def lora_path(self) -> str | None: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def mm_features(self) -> Sequence[MultiModalFeature]: ...
    @property
    def prompt_embeds(self) -> object | None: ...
    @property
    def status(self) -> object: ...
    @property
    def skip_reading_prefix_cache(self) -> bool: ...


def _reports_cached_blocks(request: object) -> bool:
    """vLLM's per-request ``kv_cache_report_mode`` (from ``SamplingParams.extra_args``; only
    "full" turns it on), else a kvcm request's ``report_cached_blocks``."""
    mode: object = getattr(request, "kv_cache_report_mode", None)
    if mode is not None:
        return mode == "full"
    return getattr(request, "report_cached_blocks", False) is True


class _Tracked:
    """The manager's view of one request the pool knows: its key and what was sent.

    Doubles as the ``HashableRequest`` the pool's hasher reads when hashing client-side.
    """

    __slots__ = (
        "block_hashes",
        "key",
        "num_hashes_sent",
        "num_prompt_sent",
        "num_tokens_sent",
        "request",
    )

    def __init__(self, request: SchedulerRequest, key: int) -> None:
        self.request = request
        self.key = key
        self.num_tokens_sent = 0
        self.num_hashes_sent = 0
        self.num_prompt_sent = 0
        self.block_hashes: list[BlockHash] = []

    # HashableRequest, delegated to the scheduler's request.
    @property
    def all_token_ids(self) -> Sequence[int]:
        return self.request.all_token_ids

    @property
    def lora_name(self) -> str | None:
        return self.request.lora_name

    @property
    def lora_path(self) -> str | None:
        return self.request.lora_path

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt

    @property
    def mm_features(self) -> Sequence[MultiModalFeature]:
        return self.request.mm_features

    @property
    def prompt_embeds(self) -> object | None:
        return self.request.prompt_embeds


# Journal entry kinds: how to undo an op the server did not run.
_ADDED: Final = 0
_SENT: Final = 1
_FREED: Final = 2
_PROMPTED: Final = 3


class RemoteKVCacheManager:
    """vLLM 0.33's ``KVCacheManager`` methods over one kvcm pool (see the module docstring).

    Not thread-safe: one manager per scheduler, as vLLM has one manager per engine.

    Attributes:
        pool_id: The pool.
        block_hasher: The pool's hasher (build requests with it to skip client-side hashing).
        num_kv_cache_groups: Groups of the pool.
        max_model_len: The pool's context length, in tokens.
        enable_caching: Whether the pool caches prefixes.
        empty_kv_cache_blocks: The shared "no blocks" result.
    """

    def __init__(
        self,
        client: SchedulerClient,
        pool_id: str,
        *,
        hash_requests: bool = True,
        last_step_seq: int | None = None,
        timeout: float | UseClientDefault = USE_CLIENT_DEFAULT,
    ) -> None:
        """Attach to a READY pool.

        Args:
            client: The client to call the server with (shared, not owned).
            pool_id: The pool.
            hash_requests: Hash requests with the pool's hasher; ``False``: send the requests'
                own ``block_hashes`` (they must come from ``block_hasher``'s parameters).
            last_step_seq: The pool's last applied Step sequence number (0 for a new pool) to
                make every Step exactly-once and retried on UNAVAILABLE; ``None``: off.
            timeout: Deadline of every call, in seconds.

        Raises:
            ServiceNotFoundError: No such pool.
            FailedPreconditionError: The pool is not planned yet.
        """
        info = client.describe_pool(pool_id, timeout=timeout)
        if info.kv_cache_config is None:
            raise FailedPreconditionError(f"pool {pool_id!r} is not READY (workers pending)")
        self._client = client
        self._timeout = timeout
        self.pool_id = pool_id
        self.block_hasher: BlockHasher = info.hashing.block_hasher()
        self.num_kv_cache_groups = len(info.kv_cache_config.kv_cache_groups)
        self.max_model_len = info.config.max_model_len
        self.enable_caching = info.config.enable_caching
        self.log_stats = info.config.log_stats
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple([] for _ in range(self.num_kv_cache_groups))
        )
        self._empty_hit = CacheHit(self.empty_kv_cache_blocks, 0)
        self._hash_block_size = info.hashing.hash_block_size
        self._hash_requests = hash_requests
        self._step_seq = last_step_seq
        self._by_id: dict[str, _Tracked] = {}
        self._free_keys: list[int] = []
        self._next_key = 0
        self._pending = StepBuilder()
        # (op index, kind, tracked, tokens (or prompt end) sent before, hashes sent before),
        # per recorded op that changed the bookkeeping above: undone when the server did not
        # run the op.
        self._journal: list[tuple[int, int, _Tracked, int, int]] = []
        self._out_of_sync: ServiceError | None = None
        self._events = (
            EventFollower(client, pool_id, info.last_event_sequence, info.epoch)
            if info.config.enable_kv_cache_events
            else None
        )

    # ------------------------------------------------------------------------ bookkeeping
    def _tracked(self, request: SchedulerRequest) -> _Tracked:
        """The request's tracker, queueing ADD_REQUEST and the tokens it gained since."""
        tracked = self._by_id.get(request.request_id)
        if tracked is None:
            tracked = self._add(request)
        if request.num_tokens != tracked.num_tokens_sent:
            self._send_tokens(tracked)
        if request.num_prompt_tokens != tracked.num_prompt_sent:
            self._send_prompt_end(tracked)
        return tracked

    def _add(self, request: SchedulerRequest) -> _Tracked:
        key = self._free_keys.pop() if self._free_keys else self._new_key()
        tracked = _Tracked(request, key)
        num_prompt = len(request.prompt_token_ids)
        hashes = self._hashes(tracked)
        num_prompt_hashes = num_prompt // self._hash_block_size if self.enable_caching else 0
        pending = self._pending
        self._journal.append((pending.num_ops, _ADDED, tracked, 0, 0))
        pending.add_request(
            key,
            request.all_token_ids[:num_prompt],
            hashes[:num_prompt_hashes],
            request_id=request.request_id,
            lora_id=request.lora_id,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
            skip_reading_prefix_cache=request.skip_reading_prefix_cache,
            report_cached_blocks=_reports_cached_blocks(request),
        )
        tracked.num_tokens_sent = num_prompt
        tracked.num_hashes_sent = num_prompt_hashes
        tracked.num_prompt_sent = num_prompt
        self._by_id[request.request_id] = tracked
        return tracked

    def _new_key(self) -> int:
        key = self._next_key
        self._next_key += 1
        return key

    def _hashes(self, tracked: _Tracked) -> Sequence[BlockHash]:
        if not self.enable_caching:
            return ()
        if not self._hash_requests:
            return tracked.request.block_hashes
        hashes = tracked.block_hashes
        if (len(hashes) + 1) * self._hash_block_size > tracked.request.num_tokens:
            return hashes  # no block became full: skip the hasher (most decode steps)
        new_hashes = self.block_hasher.hash_request_blocks(tracked)
        if new_hashes:
            tracked.block_hashes.extend(new_hashes)
        return tracked.block_hashes

    def _send_tokens(self, tracked: _Tracked) -> None:
        request = tracked.request
        num_tokens = request.num_tokens
        hashes = self._hashes(tracked)
        num_hashes = num_tokens // self._hash_block_size if self.enable_caching else 0
        num_hashes = min(num_hashes, len(hashes))
        pending = self._pending
        self._journal.append(
            (pending.num_ops, _SENT, tracked, tracked.num_tokens_sent, tracked.num_hashes_sent)
        )
        pending.append_tokens(
            tracked.key,
            request.all_token_ids[tracked.num_tokens_sent : num_tokens],
            hashes[tracked.num_hashes_sent : num_hashes],
        )
        tracked.num_tokens_sent = num_tokens
        tracked.num_hashes_sent = num_hashes

    def _send_prompt_end(self, tracked: _Tracked) -> None:
        # A streaming-input session's next chunk (vLLM's _update_request_as_session) made
        # the prompt longer: its tokens went first (_send_tokens), now its end.
        pending = self._pending
        self._journal.append((pending.num_ops, _PROMPTED, tracked, tracked.num_prompt_sent, 0))
        num_prompt = tracked.request.num_prompt_tokens
        pending.extend_prompt(tracked.key, num_prompt)
        tracked.num_prompt_sent = num_prompt

    def _known(self, request_id: str) -> _Tracked:
        tracked = self._by_id.get(request_id)
        if tracked is None:
            raise NotFoundError(f"request {request_id!r} is not known to pool {self.pool_id!r}")
        return tracked

    # ---------------------------------------------------------------------------- sending
    def _check_in_sync(self) -> None:
        if self._out_of_sync is not None:
            raise FailedPreconditionError(
                f"RemoteKVCacheManager of pool {self.pool_id!r} is out of step with the pool "
                f"after a call with an unknown outcome ({self._out_of_sync})"
            ) from self._out_of_sync

    def _send(self, step: StepBuilder) -> StepResult:
        """Send ``step`` (the queue, maybe plus allocations) and settle the bookkeeping."""
        self._check_in_sync()
        self._pending = StepBuilder()
        journal, self._journal = self._journal, []
        if self._step_seq is not None:
            step.step_seq = self._step_seq + 1
        try:
            result = self._client.step(self.pool_id, step, timeout=self._timeout)
        except (DeadlineExceededError, UnavailableError) as exc:
            self._out_of_sync = exc
            raise
        except ServiceError:
            self._settle(journal, 0)  # rejected whole: nothing ran
            raise
        if self._step_seq is not None:
            self._step_seq += 1
        self._settle(journal, result.num_ops_executed)
        return result

    def _settle(self, journal: list[tuple[int, int, _Tracked, int, int]], num_ran: int) -> None:
        # Ops before num_ran ran: release the keys of finished requests. Ops after it did
        # not: undo what recording them changed, newest first.
        for op_index, kind, tracked, tokens_before, hashes_before in reversed(journal):
            if op_index < num_ran:
                if kind == _FREED:
                    self._free_keys.append(tracked.key)
                continue
            request_id = tracked.request.request_id
            if kind == _ADDED:
                del self._by_id[request_id]
                self._free_keys.append(tracked.key)
            elif kind == _SENT:
                tracked.num_tokens_sent = tokens_before
                tracked.num_hashes_sent = hashes_before
            elif kind == _PROMPTED:
                tracked.num_prompt_sent = tokens_before
            else:
                self._by_id[request_id] = tracked

    def flush(self) -> None:
        """Send the queued calls now (one Step), if any."""
        if self._pending.num_ops:
            self._send(self._pending)

    def _call(self) -> None:
        # Before any unary call: the server must have seen everything queued.
        self._check_in_sync()
        self.flush()

    # ---------------------------------------------------------------------- vLLM surface
    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use, 0..1."""
        self._call()
        return self._client.get_usage(self.pool_id, timeout=self._timeout).usage

    def get_computed_blocks(
        self, request: SchedulerRequest, max_cache_hit_length: int | None = None
    ) -> CacheHit:
        """The request's longest prefix-cache hit: ``(blocks, num_computed_tokens)``.

        Args:
            request: The request (added to the pool on first sight).
            max_cache_hit_length: Upper bound of the hit; ``None``: ``num_tokens - 1``.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self._empty_hit
        tracked = self._tracked(request)
        self._call()
        return self._client.get_computed_blocks(
            self.pool_id, tracked.key, max_cache_hit_length, timeout=self._timeout
        )

    def allocate_slots(  # noqa: PLR0917 (vLLM's positional signature)
        self,
        request: SchedulerRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
    ) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` new tokens: the new blocks, or ``None`` if they do not fit.

        Arguments as vLLM's ``allocate_slots``; ``request.num_computed_tokens`` is read as the
        tokens computed before this call.
        """
        in_flight = request.num_in_flight_tokens
        options = _slot_options(
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            num_encoder_tokens=num_encoder_tokens,
            full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved_blocks,
            has_scheduled_reqs=has_scheduled_reqs,
        )
        tracked = self._tracked(request)
        if new_computed_blocks is not None and (num_new_computed_tokens or new_computed_blocks):
            # A hit travels only in the unary call (a Step can only look up afresh).
            self._call()
            return self._client.allocate_slots(
                self.pool_id,
                tracked.key,
                num_new_tokens,
                request.num_computed_tokens,
                hit=CacheHit(new_computed_blocks, num_new_computed_tokens),
                options=options,
                num_in_flight_tokens=in_flight,
                timeout=self._timeout,
            )
        step = self._pending
        step.allocate(
            tracked.key,
            num_new_tokens,
            request.num_computed_tokens,
            options=options,
            num_in_flight_tokens=in_flight,
        )
        return self._send(step).blocks(0)

    def allocate_slots_many(
        self,
        requests: Sequence[SchedulerRequest],
        num_new_tokens: Sequence[int],
        *,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlocks | None]:
        """``allocate_slots`` for many running requests in one Step, in order.

        vLLM's scheduler allocates its running requests one by one and preempts when one does
        not fit; this runs the same allocations in one round trip and stops at the first that
        does not fit, as the loop would.

        Args:
            requests: Running requests (no prefix hits to adopt), in scheduling order.
            num_new_tokens: Tokens to allocate for each.
            num_lookahead_tokens: Speculative slots for every allocation.

        Returns:
            One result per allocation that ran: blocks, and ``None`` only as the last entry
            when that one did not fit. The requests after it were not touched: preempt, then
            call again with the rest.
        """
        step = self._pending
        step.default_num_lookahead_tokens = num_lookahead_tokens
        first_alloc = step.num_allocations
        for request, count in zip(requests, num_new_tokens, strict=True):
            tracked = self._tracked(request)
            step.allocate(
                tracked.key,
                count,
                request.num_computed_tokens,
                num_in_flight_tokens=request.num_in_flight_tokens,
            )
        result = self._send(step)
        executed = result.all_blocks()[first_alloc:]
        return executed

    def free(self, request: SchedulerRequest) -> None:
        """Free the request's blocks (queued).

        A finished request (status ``FINISHED_*``) is forgotten; any other is preempted: the
        pool keeps its tokens and counts the preemption. Unknown requests are ignored.
        """
        self._free(request, finished=_is_finished(request.status))

    def free_with_mode(self, request: SchedulerRequest, mode: FreeMode) -> None:
        """``free`` with an explicit mode instead of reading the request's status (queued)."""
        self._free(request, finished=mode is FreeMode.FINISHED)

    def _free(self, request: SchedulerRequest, *, finished: bool) -> None:
        tracked = self._by_id.get(request.request_id)
        if tracked is None:
            return
        pending = self._pending
        if finished:
            self._journal.append((pending.num_ops, _FREED, tracked, 0, 0))
            pending.finish(tracked.key)
            del self._by_id[request.request_id]
        else:
            pending.preempt(tracked.key)

    def cache_blocks(self, request: SchedulerRequest, num_computed_tokens: int) -> None:
        """Cache the request's full blocks within ``num_computed_tokens`` tokens (queued)."""
        tracked = self._tracked(request)
        self._pending.cache_blocks(tracked.key, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the request's blocks outside the attention window (queued).

        Raises:
            NotFoundError: The request is not known to the pool.
        """
        tracked = self._known(request_id)
        self._pending.remove_skipped_blocks(tracked.key, total_computed_tokens)

    def new_step_starts(self) -> None:
        """Tell the pool's managers a scheduler step starts (queued)."""
        self._pending.new_step_starts()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks from the prefix cache."""
        self._call()
        self._client.evict_blocks(self.pool_id, block_ids, timeout=self._timeout)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; ``False`` (nothing changed) while blocks are in use."""
        self._call()
        return self._client.reset_prefix_cache(self.pool_id, timeout=self._timeout)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks every running request shares."""
        tracked = self._known(running_request_id)
        self._call()
        return self._client.get_num_common_prefix_blocks(
            self.pool_id, tracked.key, timeout=self._timeout
        )

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (ids)."""
        return KVCacheBlocks(self.get_block_ids(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group."""
        tracked = self._known(request_id)
        self._call()
        return self._client.get_block_ids(self.pool_id, tracked.key, timeout=self._timeout)

    def take_new_block_ids(self) -> list[int]:
        """Drain the attention blocks allocated since the last take (for zeroing)."""
        self._call()
        return self._client.take_new_block_ids(self.pool_id, timeout=self._timeout)

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Drain the pool's prefix-cache counters (``None`` when its log_stats is off)."""
        self._call()
        return self._client.take_prefix_cache_stats(self.pool_id, timeout=self._timeout)

    def record_prefix_cache_stats(self, request: SchedulerRequest, num_hits: int) -> None:
        """Accepted for vLLM compatibility; the pool counts hits itself, at lookup."""
        del request, num_hits

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the pool's KV events up to now (empty when the pool publishes none)."""
        if self._events is None:
            return []
        self._call()
        info = self._client.describe_pool(self.pool_id, timeout=self._timeout)
        return self._events.take_until(info.last_event_sequence)

    def close(self) -> None:
        """Send what is queued and stop following events (the client stays open)."""
        try:
            if self._out_of_sync is None:
                self.flush()
        finally:
            if self._events is not None:
                self._events.close()

    def __enter__(self) -> RemoteKVCacheManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _is_finished(status: object) -> bool:
    # vLLM's and kvcm's RequestStatus share member names; every finished one says so.
    name = getattr(status, "name", "")
    return isinstance(name, str) and name.startswith("FINISHED")


def _slot_options(
    *,
    num_lookahead_tokens: int,
    num_external_computed_tokens: int,
    delay_cache_blocks: bool,
    num_encoder_tokens: int,
    full_sequence_must_fit: bool,
    reserved_blocks: int,
    has_scheduled_reqs: bool,
) -> SlotOptions:
    if not (
        num_lookahead_tokens
        or num_external_computed_tokens
        or delay_cache_blocks
        or num_encoder_tokens
        or full_sequence_must_fit
        or reserved_blocks
        or not has_scheduled_reqs
    ):
        return DEFAULT_SLOT_OPTIONS
    return SlotOptions(
        num_lookahead_tokens=num_lookahead_tokens or None,
        num_external_computed_tokens=num_external_computed_tokens,
        delay_cache_blocks=delay_cache_blocks,
        num_encoder_tokens=num_encoder_tokens,
        full_sequence_must_fit=full_sequence_must_fit,
        reserved_blocks=reserved_blocks,
        has_scheduled_reqs=has_scheduled_reqs,
    )
