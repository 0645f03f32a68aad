"""kvcm's one workload generator, and the drivers that play it against a pool.

Not a library module: the demo (``examples/demo.py``), the integration tests and the benches
import it from this folder. Three things:

- :func:`make_workload`: a deterministic multi-user chat trace (shared system prompts,
  multi-turn follow-ups, output lengths, arrival steps). Every example and test that needs
  traffic draws it from here.
- :class:`ReplayScheduler`: replays a trace through Steps with vLLM's scheduling decisions
  (below).
- :func:`run_shared_prefix_workload`: drives a pool call by call through the SDK (add, look
  up, allocate, free), for the HTTP and Prometheus tests that count per-RPC metrics.

The replay scheduler makes vLLM's scheduling decisions with kvcm's Step semantics, one
scheduler step at a time:

1. **Running requests**, in order: finished ones are freed; the others append the token they
   sampled and allocate one slot (decode) or their next prefill chunk, within the step's token
   budget. If one does not fit, the last running request is preempted and the rest retried (one
   more Step per preemption), as vLLM's running loop does.
2. **Waiting requests**, in order (preempted ones first): each is added (first time only),
   looked up and allocated in one ALLOCATE with a lookup, capped by the budget left. The
   first that does not fit (or finds no budget) stops admission for this step.

Every Step goes through ``backend``: a callable taking a ``StepBuilder`` and answering a
``StepResult`` (``SchedulerClient.step`` bound to a pool, or an in-process executor).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcm.client import (
    ItemStatus,
    PoolConfig,
    SchedulerClient,
    StepBuilder,
    StepResult,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import NotFoundError
from kvcm.common.hashing import HashAlgorithm
from kvcm.common.specs import FullAttentionSpec

if TYPE_CHECKING:
    from kvcm.common.hashing import BlockHash, BlockHasher, MultiModalFeature

__all__ = [
    "BLOCK_SIZE",
    "MISSING_POOL",
    "ReplayScheduler",
    "ReplayStats",
    "StepBackend",
    "TraceRequest",
    "WorkloadOptions",
    "WorkloadReport",
    "create_pool",
    "make_workload",
    "run_shared_prefix_workload",
]

StepBackend = Callable[[StepBuilder], StepResult]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadOptions:
    """A multi-user chat workload with shared system prompts and multi-turn conversations.

    Attributes:
        num_requests: Requests in the trace.
        num_system_prompts: Distinct system prompts every conversation starts with one of.
        system_prompt_tokens: Range of system prompt lengths, in tokens.
        user_tokens: Range of user message lengths, in tokens.
        output_tokens: Range of response lengths, in tokens.
        follow_up_probability: Chance that a request continues an earlier conversation
            (its prompt is that conversation's prompt, response and a new message).
        arrivals_per_step: Requests that arrive per scheduler step.
        vocab_size: Token ids are drawn from ``[0, vocab_size)``.
        seed: Random seed; the same options give the same trace.
    """

    num_requests: int = 200
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (200, 600)
    user_tokens: tuple[int, int] = (16, 160)
    output_tokens: tuple[int, int] = (4, 48)
    follow_up_probability: float = 0.5
    arrivals_per_step: int = 4
    vocab_size: int = 32000
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives, its prompt and the tokens it will generate."""

    request_id: str
    arrival_step: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]


def make_workload(options: WorkloadOptions) -> list[TraceRequest]:
    """The trace for ``options`` (deterministic)."""
    rng = random.Random(options.seed)

    def tokens(bounds: tuple[int, int]) -> tuple[int, ...]:
        return tuple(rng.randrange(options.vocab_size) for _ in range(rng.randint(*bounds)))

    system_prompts = [
        tokens(options.system_prompt_tokens) for _ in range(options.num_system_prompts)
    ]
    conversations: list[tuple[int, ...]] = []
    trace = []
    for index in range(options.num_requests):
        if conversations and rng.random() < options.follow_up_probability:
            history = conversations[rng.randrange(len(conversations))]
        else:
            history = system_prompts[rng.randrange(len(system_prompts))]
        prompt = history + tokens(options.user_tokens)
        output = tokens(options.output_tokens)
        conversations.append(prompt + output)
        trace.append(
            TraceRequest(
                request_id=f"req-{index}",
                arrival_step=index // max(1, options.arrivals_per_step),
                prompt_token_ids=prompt,
                output_token_ids=output,
            )
        )
    return trace


class _Live:
    """A request the scheduler holds, with what the pool has been told about it."""

    __slots__ = (
        "added",
        "all_token_ids",
        "block_hashes",
        "key",
        "num_computed_tokens",
        "num_hashes_sent",
        "num_output",
        "num_tokens_sent",
        "preempted",
        "trace",
    )

    def __init__(self, trace: TraceRequest, key: int) -> None:
        self.trace = trace
        self.key = key
        self.all_token_ids = list(trace.prompt_token_ids)
        self.block_hashes: list[BlockHash] = []
        self.num_computed_tokens = 0
        self.num_output = 0
        self.num_tokens_sent = 0
        self.num_hashes_sent = 0
        self.added = False
        self.preempted = False

    # HashableRequest
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    prompt_embeds: object | None = None

    @property
    def mm_features(self) -> Sequence[MultiModalFeature]:
        return ()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def finished(self) -> bool:
        return self.num_output >= len(self.trace.output_token_ids)


@dataclass(slots=True)
class ReplayStats:
    """What a replay did so far.

    Attributes:
        steps: Scheduler steps run.
        rpcs: Steps sent (one per scheduler step, plus one per preemption retry).
        admitted: Lookup allocations that fit.
        finished: Requests that completed.
        preemptions: Preemptions.
        query_tokens: Tokens looked up at first admission.
        hit_tokens: Of those, tokens found in the prefix cache.
        allocations: Allocation items answered.
        results: Per Step, the answer (kept when ``keep_results``).
    """

    steps: int = 0
    rpcs: int = 0
    admitted: int = 0
    finished: int = 0
    preemptions: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    allocations: int = 0
    results: list[StepResult] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens at first admission, 0..1."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class ReplayScheduler:
    """Replays a trace through Steps with vLLM's scheduling decisions (module docstring)."""

    def __init__(
        self,
        backend: StepBackend,
        trace: Sequence[TraceRequest],
        hasher: BlockHasher | None,
        *,
        max_num_batched_tokens: int = 2048,
        max_num_running: int = 64,
        keep_results: bool = False,
    ) -> None:
        """Prepare a replay.

        Args:
            backend: Runs one Step.
            trace: The requests, by arrival step.
            hasher: The pool's hasher; ``None`` for a pool without prefix caching.
            max_num_batched_tokens: Tokens per scheduler step (vLLM's token budget).
            max_num_running: Running requests at most (vLLM's max_num_seqs).
            keep_results: Keep every Step's answer in ``stats.results``.
        """
        self._backend = backend
        self._arrivals = deque(sorted(trace, key=lambda r: r.arrival_step))
        self._hasher = hasher
        self._max_tokens = max_num_batched_tokens
        self._max_running = max_num_running
        self._keep = keep_results
        self._waiting: deque[_Live] = deque()
        self._running: list[_Live] = []
        self._to_finish: list[_Live] = []
        self._carry: StepBuilder | None = None
        self._free_keys: list[int] = []
        self._next_key = 0
        self.stats = ReplayStats()

    @property
    def done(self) -> bool:
        """Whether every request finished."""
        return not (
            self._arrivals or self._waiting or self._running or self._to_finish or self._carry
        )

    def run(self, max_steps: int = 100_000) -> ReplayStats:
        """Run steps until the trace is done (or ``max_steps``)."""
        while not self.done and self.stats.steps < max_steps:
            self.step()
        return self.stats

    # --------------------------------------------------------------------------- a step
    def step(self) -> None:
        """Run one scheduler step (one Step, plus one per preemption)."""
        while self._arrivals and self._arrivals[0].arrival_step <= self.stats.steps:
            trace = self._arrivals.popleft()
            key = self._free_keys.pop() if self._free_keys else self._take_key()
            self._waiting.append(_Live(trace, key))
        # A preemption that ended the last step's running loop rides on this step's Step.
        builder, self._carry = self._carry or StepBuilder(), None
        for live in self._to_finish:
            builder.finish(live.key)
            self._free_keys.append(live.key)
        self._to_finish.clear()
        builder.new_step_starts()
        budget, preempted = self._schedule_running(builder)
        # As vLLM: no admissions in a step that had to preempt.
        if (
            not preempted
            and budget > 0
            and self._waiting
            and len(self._running) < self._max_running
        ):
            self._schedule_waiting(budget)
        for live in list(self._running):
            self._sample(live)
        self.stats.steps += 1

    def _take_key(self) -> int:
        key = self._next_key
        self._next_key += 1
        return key

    def _send(self, builder: StepBuilder) -> StepResult:
        result = self._backend(builder)
        self.stats.rpcs += 1
        self.stats.allocations += result.num_allocations_executed
        if self._keep:
            self.stats.results.append(result)
        return result

    def _sync_tokens(self, builder: StepBuilder, live: _Live) -> int | None:
        # Queue the tokens (and newly full block hashes) the pool has not seen; returns the
        # APPEND op's index, or None when there was nothing to send.
        if live.num_tokens_sent == live.num_tokens:
            return None
        hashes = self._hashes(live)
        op_index = builder.num_ops
        builder.append_tokens(
            live.key,
            live.all_token_ids[live.num_tokens_sent :],
            hashes[live.num_hashes_sent :],
        )
        return op_index

    def _hashes(self, live: _Live) -> list[BlockHash]:
        hasher = self._hasher
        hashes = live.block_hashes
        if hasher is not None and (len(hashes) + 1) * hasher.block_size <= live.num_tokens:
            hashes.extend(hasher.hash_request_blocks(live))
        return hashes

    def _mark_sent(self, live: _Live) -> None:
        live.num_tokens_sent = live.num_tokens
        live.num_hashes_sent = len(live.block_hashes)

    def _schedule_running(self, builder: StepBuilder) -> tuple[int, bool]:
        """Allocate for the running requests; returns the budget left and whether any request
        was preempted."""
        budget = self._max_tokens
        pending = list(self._running)
        preempted = False
        while True:
            planned: list[tuple[_Live, int, int | None]] = []  # (request, tokens, append op)
            for live in pending:
                num_new = min(live.num_tokens - live.num_computed_tokens, budget)
                if num_new <= 0:
                    continue
                append_op = self._sync_tokens(builder, live)
                builder.allocate(live.key, num_new, live.num_computed_tokens)
                planned.append((live, num_new, append_op))
                budget -= num_new
            result = self._send(builder)
            failed = self._settle_running(planned, result)
            if failed is None:
                return budget, preempted
            # The failed allocation and the ones after it did not take: give their budget back,
            # preempt the last running request, and retry the rest in one more Step.
            index_failed = next(i for i, (live, _, _) in enumerate(planned) if live is failed)
            budget += sum(tokens for _, tokens, _ in planned[index_failed:])
            victim = self._running.pop()
            builder = StepBuilder()
            builder.preempt(victim.key)
            self._preempted(victim)
            preempted = True
            if victim is failed:
                self._carry = builder  # nothing left to allocate: send it with the next Step
                return budget, preempted
            pending = [live for live, _, _ in planned[index_failed:] if live is not victim]

    def _settle_running(
        self, planned: list[tuple[_Live, int, int | None]], result: StepResult
    ) -> _Live | None:
        for index, (live, num_new, append_op) in enumerate(planned):
            if append_op is not None and append_op < result.num_ops_executed:
                self._mark_sent(live)
            if result.status(index) is ItemStatus.OK:
                live.num_computed_tokens += num_new
            else:
                return live
        return None

    def _preempted(self, live: _Live) -> None:
        live.num_computed_tokens = 0
        live.preempted = True
        self.stats.preemptions += 1
        self._waiting.appendleft(live)

    def _schedule_waiting(self, budget: int) -> None:
        builder = StepBuilder(token_budget=budget)
        planned: list[tuple[_Live, int | None, int | None]] = []  # (request, add op, append op)
        num_slots = self._max_running - len(self._running)
        for live in list(self._waiting)[:num_slots]:
            add_op = None
            append_op = None
            if not live.added:
                add_op = builder.num_ops
                hashes = self._hashes(live)
                builder.add_request(
                    live.key,
                    live.all_token_ids,
                    hashes,
                    request_id=live.trace.request_id,
                )
            else:
                append_op = self._sync_tokens(builder, live)
            builder.allocate(live.key, live.num_tokens, 0, lookup=True)
            planned.append((live, add_op, append_op))
        result = self._send(builder)
        # Follow the answer, not a plan: admit exactly the allocations the pool made.
        for index, (live, add_op, append_op) in enumerate(planned):
            if add_op is not None and add_op < result.num_ops_executed:
                live.added = True
                self._mark_sent(live)
            if append_op is not None and append_op < result.num_ops_executed:
                self._mark_sent(live)
            lookup = result.lookup(index)
            if result.status(index) is not ItemStatus.OK or lookup is None:
                continue
            if not live.preempted:
                self.stats.query_tokens += live.num_tokens
                self.stats.hit_tokens += lookup.num_computed_tokens
            self.stats.admitted += 1
            live.num_computed_tokens = lookup.num_computed_tokens + lookup.num_new_tokens
            self._waiting.remove(live)
            self._running.append(live)

    def _sample(self, live: _Live) -> None:
        # A request whose every token is computed produced its next token this step.
        if live.num_computed_tokens < live.num_tokens:
            return
        token = live.trace.output_token_ids[live.num_output]
        live.num_output += 1
        if live.finished:
            self._running.remove(live)
            self._to_finish.append(live)
            self.stats.finished += 1
            return
        live.all_token_ids.append(token)


# ------------------------------------------------------------------ call-by-call SDK driver
BLOCK_SIZE = 16
"""Block size of the pools :func:`create_pool` makes."""
MISSING_POOL = "no-such-pool"
"""The pool :func:`run_shared_prefix_workload` names to make one RPC fail with NOT_FOUND."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadReport:
    """What the driver did (not what the server counted).

    Attributes:
        admitted: Requests whose prompt got slots.
        not_fit: Allocations answered "does not fit".
    """

    admitted: int
    not_fit: int


def create_pool(client: SchedulerClient, pool_id: str, *, num_blocks: int = 48) -> None:
    """Create a one-group full-attention pool planned at once (no workers needed)."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16
    )
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )
    client.create_pool(
        pool_id,
        PoolConfig(
            max_model_len=4096, explicit_layout=layout, hash_algorithm=HashAlgorithm.SHA256_CBOR
        ),
    )


def run_shared_prefix_workload(
    client: SchedulerClient,
    pool_id: str,
    *,
    num_requests: int = 60,
    num_prefixes: int = 3,
    prefix_blocks: int = 4,
    suffix_tokens: int = 24,
    max_running: int = 3,
    first_key: int = 0,
    seed: int = 0,
) -> WorkloadReport:
    """Admit requests that share prompt prefixes, the way a scheduler admits waiting ones.

    The prompts are :func:`make_workload`'s (``num_prefixes`` system prompts of
    ``prefix_blocks`` full blocks, a ``suffix_tokens`` user message, no follow-ups). Each
    request is added, looked up in the prefix cache, and given slots for its prompt; at most
    ``max_running`` hold blocks at once (the oldest finishes first). At the end one oversized
    request does not fit, every request is finished, and one call names a pool that does not
    exist.

    Returns:
        How many requests got slots and how many allocations did not fit.
    """
    hasher = client.block_hasher(pool_id)
    prefix_tokens = prefix_blocks * BLOCK_SIZE
    trace = make_workload(
        WorkloadOptions(
            num_requests=num_requests,
            num_system_prompts=num_prefixes,
            system_prompt_tokens=(prefix_tokens, prefix_tokens),
            user_tokens=(suffix_tokens, suffix_tokens),
            follow_up_probability=0.0,
            seed=seed,
        )
    )
    running: deque[int] = deque()
    admitted = not_fit = 0
    for key, request in enumerate(trace, start=first_key):
        prompt = list(request.prompt_token_ids)
        if not _admit(client, pool_id, key, prompt, hasher.hash_token_ids(prompt)):
            not_fit += 1
            continue
        admitted += 1
        running.append(key)
        if len(running) > max_running:
            client.free(pool_id, running.popleft())
    # Larger than the whole pool: answered "does not fit", counted by the server.
    huge_key = first_key + num_requests
    (oversized,) = make_workload(
        WorkloadOptions(
            num_requests=1,
            num_system_prompts=1,
            system_prompt_tokens=(BLOCK_SIZE * 64, BLOCK_SIZE * 64),
            user_tokens=(0, 0),
            seed=seed + 1,
        )
    )
    huge = list(oversized.prompt_token_ids)
    if not _admit(client, pool_id, huge_key, huge, hasher.hash_token_ids(huge)):
        not_fit += 1
    else:
        running.append(huge_key)
    while running:
        client.free(pool_id, running.popleft())
    try:
        client.get_usage(MISSING_POOL)
    except NotFoundError:
        pass
    else:  # pragma: no cover - the server would be wrong
        raise AssertionError(f"pool {MISSING_POOL!r} exists")
    return WorkloadReport(admitted=admitted, not_fit=not_fit)


def _admit(
    client: SchedulerClient,
    pool_id: str,
    key: int,
    prompt: list[int],
    hashes: Sequence[BlockHash],
) -> bool:
    """Add, look up and allocate one waiting request; finish it again if it does not fit."""
    client.add_request(pool_id, key, prompt, hashes, request_id=f"req-{key}")
    hit = client.get_computed_blocks(pool_id, key)
    blocks = client.allocate_slots(
        pool_id, key, len(prompt) - hit.num_computed_tokens, hit.num_computed_tokens, hit=hit
    )
    if blocks is None:
        client.free(pool_id, key)
        return False
    return True
