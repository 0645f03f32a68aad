"""Seeded scheduler-like workloads replayed through two KV-cache managers in lock step.

``run_workload`` plays a small V1-style scheduler (chunked prefill, decode with draft tokens,
preempt-the-last-request on "does not fit", admission with prefix-cache lookups, KV-connector
tokens, frees on finish) against a ``Pair`` of sides from ``_drivers``. Every manager call goes
to both sides with the same arguments and their normalised answers must be equal; the answer
then steers the scheduler, so both sides walk the very same path. After every step the whole
pool state (free-queue order, ref counts, block hashes, the prefix-cache map) is compared too.

Prompts share prefixes on purpose: a library of system prompts, exact resends, and multi-turn
continuations of finished requests (prompt plus output), with optional LoRA adapters and cache
salts, so hits, evictions and events are frequent.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from _drivers import CROSS, MAMBA, Layout, RequestSpec, Snapshot, normalise_events

from kvcm.common.errors import KVCMError


@dataclass(frozen=True)
class Knobs:
    """How a workload behaves (probabilities per step or per call)."""

    num_steps: int = 120
    max_running: int = 6
    max_arrivals: int = 3
    token_budgets: tuple[int, ...] = (8, 16, 32, 64)
    max_prompt_len: int = 60
    max_output: int = 12
    lora: bool = False
    salts: bool = False
    max_drafts: int = 0
    max_lookahead: int = 0
    external: float = 0.0
    full_sequence_must_fit: float = 0.0
    max_reserved_blocks: int = 0
    evict: float = 0.0
    reset: float = 0.0
    drain_and_reset: float = 0.0
    in_flight: float = 0.0
    skip_reading: float = 0.0
    max_hit_len: float = 0.0
    remove_skipped: float = 0.2
    common_prefix: float = 0.3
    encoder_tokens: int = 0
    # Prompt shapes: shared-prefix lengths, tokens appended to a prefix or a continuation.
    prefix_len: tuple[int, int] = (2, 40)
    suffix_len: int = 24
    continuation_len: int = 12
    # Requests aborted (freed and forgotten) mid-flight, per step.
    abort: float = 0.0
    # Requests asking for vLLM's kv_cache_report_mode="full" (hits reported as stored).
    report_full: float = 0.0


@dataclass(frozen=True)
class Scenario:
    """A named layout and workload."""

    name: str
    layout: Layout
    knobs: Knobs


@dataclass
class Tally:
    """What one run compared."""

    ops: int = 0
    snapshots: int = 0
    hits: int = 0
    not_fit: int = 0
    preemptions: int = 0
    events: int = 0
    resets: int = 0
    aborts: int = 0
    copies: int = 0
    sub_block_hits: int = 0
    # Lookups that found a shared-prefix junction, and chunks that ended exactly there.
    junctions: int = 0
    junction_stops: int = 0
    # Hits of requests in the "full" report mode (each one reported as BlockStored events),
    # and lookups whose report raised IndexError in vLLM (redone unreported on both sides).
    reported_hits: int = 0
    report_errors: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


class MismatchError(AssertionError):
    """The two sides answered one call differently."""


class Pair:
    """Both sides, called in lock step; every compared call is counted."""

    def __init__(self, ref: Any, ours: Any, tally: Tally) -> None:
        self.ref = ref
        self.ours = ours
        self.tally = tally
        self.where = ""
        self._event_fields: set[str] = ref.event_field_names()

    def call(self, op: str, *args: Any) -> Any:
        """Call ``op`` on both sides and require equal answers."""
        theirs = getattr(self.ref, op)(*args)
        if getattr(self.ref, "report_failed", False):
            # vLLM's "full" report raised (a Mamba hit ending in an unhashed block): compare
            # the unreported lookups; kvcm's shortened report is tested on its own.
            self.ref.report_failed = False
            self.tally.report_errors += 1
            mine = getattr(self.ours, op)(*args, False)
        else:
            mine = getattr(self.ours, op)(*args)
        self._count(op)
        if theirs != mine:
            raise MismatchError(f"{self.where}: {op}{args!r}: vLLM {theirs!r} != kvcm {mine!r}")
        return theirs

    def allocate(self, request_id: str, num_new_tokens: int, use_hit: bool, **options: Any) -> Any:
        """``allocate_slots`` on both sides."""
        theirs = self.ref.allocate_slots(request_id, num_new_tokens, use_hit, **options)
        mine = self.ours.allocate_slots(request_id, num_new_tokens, use_hit, **options)
        self._count("allocate_slots")
        if theirs != mine:
            raise MismatchError(
                f"{self.where}: allocate_slots({request_id!r}, {num_new_tokens}, hit={use_hit}, "
                f"{options}): vLLM {theirs!r} != kvcm {mine!r}"
            )
        if theirs is None:
            self.tally.not_fit += 1
        return theirs

    def both_raise(self, op: str, *args: Any) -> None:
        """Call ``op`` on both sides; both must reject it (their state is compared later)."""
        raised = []
        for side in (self.ref, self.ours):
            try:
                getattr(side, op)(*args)
            except (ValueError, AssertionError, KVCMError):
                raised.append(True)
            else:
                raised.append(False)
        self._count(f"{op} (rejected)")
        if raised != [True, True]:
            raise MismatchError(f"{self.where}: {op}{args!r}: raised (vLLM, kvcm) = {raised}")

    def events(self) -> None:
        """Drain and compare the events (hashes in vLLM's external int form)."""
        theirs = self.ref.take_events()
        mine = self.ours.take_events()
        self._count("take_events")
        ref_norm = normalise_events(theirs, self._event_fields)
        our_norm = normalise_events(mine, self._event_fields)
        if ref_norm != our_norm:
            raise MismatchError(
                f"{self.where}: take_events: vLLM {ref_norm!r} != kvcm {our_norm!r}"
            )
        self.tally.events += len(theirs)

    def hit_rate(self) -> None:
        """Compare the recent-requests hit rate."""
        theirs, mine = self.ref.hit_rate(), self.ours.hit_rate()
        self._count("hit_rate")
        if not math.isclose(theirs, mine, rel_tol=1e-12, abs_tol=1e-15):
            raise MismatchError(f"{self.where}: hit rate: vLLM {theirs!r} != kvcm {mine!r}")

    def usage(self) -> None:
        """Compare the pool usage."""
        theirs, mine = self.ref.usage(), self.ours.usage()
        self._count("usage")
        if not math.isclose(theirs, mine, rel_tol=1e-12, abs_tol=1e-15):
            raise MismatchError(f"{self.where}: usage: vLLM {theirs!r} != kvcm {mine!r}")

    def snapshot(self) -> None:
        """Compare the whole pool state."""
        theirs: Snapshot = self.ref.snapshot()
        mine: Snapshot = self.ours.snapshot()
        self.tally.snapshots += 1
        for name in ("free_ids", "ref_cnts", "block_hashes", "cache"):
            a, b = getattr(theirs, name), getattr(mine, name)
            if a != b:
                raise MismatchError(f"{self.where}: pool state {name}: vLLM {a!r} != kvcm {b!r}")

    def both(self, op: str, *args: Any, **kwargs: Any) -> None:
        """A bookkeeping call on both sides (request fields, tokens); not a compared op."""
        getattr(self.ref, op)(*args, **kwargs)
        getattr(self.ours, op)(*args, **kwargs)

    def _count(self, op: str) -> None:
        self.tally.ops += 1
        self.tally.by_op[op] = self.tally.by_op.get(op, 0) + 1


_Tenant = tuple[tuple[str, int, str] | None, str | None]


@dataclass
class _Req:
    rid: str
    num_prompt_tokens: int
    tokens: list[int]
    max_output: int
    encoder_tokens: int
    tenant: _Tenant
    num_computed: int = 0
    num_preemptions: int = 0
    holds_blocks: bool = False
    remote_done: bool = False
    first_allocation: bool = True
    junction: int = 0
    report_full: bool = False


def _checkpoint(num_tokens: int, granularity: int) -> int:
    return max((num_tokens - 1) // granularity * granularity, 0)


def align_chunk(
    layout: Layout,
    *,
    num_prompt: int,
    num_tokens: int,
    start: int,
    num_new: int,
    junction: int,
    token_budget: int,
    shared_prefix_checkpoint: bool = False,
) -> int:
    """How many of ``num_new`` tokens from ``start`` a scheduler computes in one chunk when
    the layout's Mamba group runs in align mode (vLLM's split, no Eagle): chunks end on Mamba
    block boundaries, at the last cacheable boundary, at the prompt's tail hash boundary (for
    sub-block hits) and at the shared-prefix junction (exactly there within the prompt with
    vLLM's shared-prefix checkpoint, else floored to a Mamba block); decode is not split."""
    mamba = next(g for g in layout.groups if g.kind == MAMBA)
    block = mamba.block_size
    hash_block = layout.hash_block_size
    partial = hash_block < block or (layout.dcp_world_size > 1 and hash_block == block)
    prefill_end = max(num_prompt, num_tokens - 1)
    if start >= prefill_end:
        return num_new
    end = start + num_new
    last_cache = _checkpoint(num_tokens, block)
    checkpoint = _checkpoint(prefill_end, hash_block if partial else block)
    internal = (
        mamba.num_prefill_checkpoint_blocks > 0
        and end >= prefill_end
        and mamba.prefill_checkpoint_alignment is not None
        and start % hash_block == 0
        and -(-end // block) - 2 > (start - 1) // block
        and start + hash_block <= checkpoint
        and start < checkpoint < end
        and (checkpoint - start) % mamba.prefill_checkpoint_alignment == 0
    )
    if internal:
        last_cache = 0
    if end < prefill_end:
        aligned = end // block * block
        if aligned > start or block <= token_budget:
            end = aligned
    tail = _checkpoint(num_prompt, hash_block) if partial and not internal else 0
    floored = start + (junction - start) // block * block
    junction_stop = junction if shared_prefix_checkpoint and junction <= num_prompt else floored
    stops = (
        (start // block + 1) * block if start % block and not internal else 0,
        last_cache,
        tail if last_cache < tail < num_prompt else 0,
        junction_stop if start < junction < end else 0,
    )
    end = min((stop for stop in stops if start < stop < end), default=end)
    return max(end - start, 0)


class Workload:
    """One seeded scheduler run over a ``Pair``."""

    def __init__(self, scenario: Scenario, seed: int, pair: Pair) -> None:
        """Prepare the run (nothing is called yet)."""
        self.scenario = scenario
        self.layout: Layout = scenario.layout
        self.k = scenario.knobs
        self.rng = random.Random(f"{scenario.name}/{seed}")
        self.p = pair
        self.reqs: dict[str, _Req] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        self.remote: list[str] = []
        self.history: list[tuple[list[int], _Tenant]] = []
        self.in_flight: set[str] = set()
        self.next_id = 0
        self.step_no = 0
        rng = self.rng
        self.prefixes = [
            [rng.randrange(1, 30_000) for _ in range(rng.randint(*self.k.prefix_len))]
            for _ in range(5)
        ]
        # A Mamba group in align mode: chunks split as vLLM's scheduler splits them, and the
        # block copies of sub-block hits drained every step.
        self.mamba = next(
            (g for g in self.layout.groups if g.kind == MAMBA and g.mamba_cache_mode == "align"),
            None,
        )
        # vLLM's scheduler ends chunks at junctions when its manager keys them (its
        # mamba_shared_prefix_checkpoint; sub-block hits are on beside such a group).
        manager = getattr(pair.ref, "manager", None)
        self.junction_stops = bool(getattr(manager, "mamba_shared_prefix_checkpoint", False))
        self.loras: list[tuple[str, int, str] | None] = [None]
        if self.k.lora:
            self.loras += [("adapter-a", 1, "/lora/a"), ("adapter-b", 2, "/lora/b")]
        self.salts: list[str | None] = [None]
        if self.k.salts:
            self.salts += ["tenant-1", "tenant-2"]

    # ------------------------------------------------------------------------ requests
    def _new_prompt(self) -> tuple[list[int], _Tenant]:
        # A prompt, with the LoRA adapter and salt it runs under. Resends and multi-turn
        # continuations usually keep their origin's adapter and salt, so they can hit.
        rng = self.rng
        limit = min(self.k.max_prompt_len, self.layout.max_model_len - self.k.max_output - 2)
        tenant: _Tenant = (
            rng.choice(self.loras) if rng.random() < 0.3 else None,
            rng.choice(self.salts) if rng.random() < 0.3 else None,
        )
        mode = rng.random()
        if mode < 0.35:
            prompt = rng.choice(self.prefixes) + [
                rng.randrange(1, 30_000) for _ in range(rng.randint(0, self.k.suffix_len))
            ]
        elif mode < 0.8 and self.history:
            tokens, origin = rng.choice(self.history)
            if rng.random() < 0.8:
                tenant = origin
            prompt = list(tokens)
            if mode >= 0.55:
                prompt += [
                    rng.randrange(1, 30_000) for _ in range(rng.randint(1, self.k.continuation_len))
                ]
        else:
            prompt = [rng.randrange(1, 30_000) for _ in range(rng.randint(1, limit))]
        return prompt[: max(1, limit)], tenant

    def _add_request(self) -> None:
        rng = self.rng
        rid = f"req-{self.next_id}"
        self.next_id += 1
        prompt, tenant = self._new_prompt()
        spec = RequestSpec(
            request_id=rid,
            prompt=prompt,
            lora=tenant[0],
            cache_salt=tenant[1],
            skip_reading_prefix_cache=rng.random() < self.k.skip_reading,
            # Drawn only when on, so the other workloads keep their random streams.
            report_full=bool(self.k.report_full) and rng.random() < self.k.report_full,
        )
        self.p.both("add_request", spec)
        self._check_hashes(rid)
        encoder = rng.randint(1, self.k.encoder_tokens) if self.k.encoder_tokens else 0
        self.reqs[rid] = _Req(
            rid, len(prompt), list(prompt), rng.randint(1, self.k.max_output), encoder, tenant
        )
        self.reqs[rid].report_full = spec.report_full
        self.waiting.append(rid)

    def _check_hashes(self, rid: str) -> None:
        theirs, mine = self.p.ref.block_hashes(rid), self.p.ours.block_hashes(rid)
        if theirs != mine:
            raise MismatchError(f"{self.p.where}: block hashes of {rid}: {theirs!r} != {mine!r}")

    def _set(self, rid: str, **values: Any) -> None:
        self.p.both("update", rid, **values)

    def _chunk(self, req: _Req, start: int, num_new: int, budget: int) -> int:
        # The scheduler's chunk: as asked, or split for a Mamba group in align mode.
        if self.mamba is None:
            return num_new
        return align_chunk(
            self.layout,
            num_prompt=req.num_prompt_tokens,
            num_tokens=len(req.tokens),
            start=start,
            num_new=num_new,
            junction=req.junction,
            token_budget=budget,
            shared_prefix_checkpoint=self.junction_stops,
        )

    def _abort(self) -> None:
        # A client aborts a request mid-flight: running or waiting, holding blocks or not.
        # As vLLM's finish_requests: the status first, then the blocks freed.
        rid = self.rng.choice(sorted(self.reqs))
        del self.reqs[rid]
        for queue in (self.running, self.remote):
            if rid in queue:
                queue.remove(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)
        self._set(rid, status="FINISHED_ABORTED")
        self.p.call("free", rid)
        self.p.both("drop_request", rid)
        self.p.tally.aborts += 1

    def _preempt(self, rid: str) -> None:
        req = self.reqs[rid]
        self.p.call("free", rid)
        req.num_computed = 0
        req.num_preemptions += 1
        req.holds_blocks = False
        req.remote_done = False
        self._set(
            rid,
            status="PREEMPTED",
            num_computed_tokens=0,
            num_preemptions=req.num_preemptions,
            num_in_flight_tokens=0,
        )
        self.waiting.appendleft(rid)
        self.p.tally.preemptions += 1

    def _release(self, rid: str) -> None:
        # Free a request that holds blocks outside the running list (remote loads).
        req = self.reqs[rid]
        self.p.call("free", rid)
        req.num_computed = 0
        req.holds_blocks = False
        req.remote_done = False
        self._set(rid, num_computed_tokens=0, num_in_flight_tokens=0)

    def _finish(self, rid: str) -> None:
        req = self.reqs.pop(rid)
        self.p.call("free", rid)
        self._set(rid, status="FINISHED_STOPPED")
        self.p.both("drop_request", rid)
        self.history.append((req.tokens, req.tenant))
        if len(self.history) > 12:
            self.history.pop(0)

    # --------------------------------------------------------------------------- steps
    def run(self) -> None:
        """Run every step."""
        for step_no in range(self.k.num_steps):
            self.step_no = step_no
            self.p.where = f"{self.scenario.name} step {self.step_no}"
            self._step()

    def _step(self) -> None:
        rng, k = self.rng, self.k
        self.p.call("new_step_starts")
        for _ in range(rng.randint(0, k.max_arrivals)):
            self._add_request()
        self._finish_remote_loads()
        budget = rng.choice(k.token_budgets)
        scheduled: list[tuple[str, int, int]] = []
        budget, preempted = self._schedule_running(budget, scheduled)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        if self.mamba is not None:
            self.p.tally.copies += len(self.p.call("take_copies"))
        self._process_outputs(scheduled)
        self._settle_in_flight()
        self._random_calls()
        self._drain()

    def _finish_remote_loads(self) -> None:
        for rid in list(self.remote):
            if self.rng.random() < 0.5:
                continue
            req = self.reqs[rid]
            self.p.call("cache_blocks", rid, req.num_computed)
            self.remote.remove(rid)
            req.remote_done = True
            self._set(rid, status="PREEMPTED" if req.num_preemptions else "WAITING")
            self.waiting.appendleft(rid)

    def _schedule_running(
        self, budget: int, scheduled: list[tuple[str, int, int]]
    ) -> tuple[int, bool]:
        rng, k = self.rng, self.k
        max_len = self.layout.max_model_len
        preempted = False
        idx = 0
        while idx < len(self.running) and budget > 0:
            rid = self.running[idx]
            req = self.reqs[rid]
            remaining = len(req.tokens) - req.num_computed
            drafts = 0
            if remaining > 1:
                num_new = self._chunk(req, req.num_computed, min(remaining, budget), budget)
                if num_new <= 0:
                    idx += 1
                    continue
                if req.junction and req.num_computed + num_new == req.junction:
                    self.p.tally.junction_stops += 1
            else:
                drafts = min(rng.randint(0, k.max_drafts), max_len - len(req.tokens) - 1)
                drafts = max(drafts, 0)
                num_new = remaining + drafts
            lookahead = rng.randint(0, k.max_lookahead)
            if k.in_flight and rng.random() < k.in_flight:
                self._set(rid, num_in_flight_tokens=rng.randint(0, req.num_computed))
                self.in_flight.add(rid)
            options: dict[str, Any] = {"num_lookahead_tokens": lookahead}
            if k.encoder_tokens and rng.random() < 0.5:
                options["num_encoder_tokens"] = req.encoder_tokens
            victim = None
            while True:
                if self.p.allocate(rid, num_new, False, **options) is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim == rid:
                    break
            if victim == rid:
                break
            scheduled.append((rid, num_new, drafts))
            budget -= num_new
            idx += 1
        return budget, preempted

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[str, int, int]]) -> None:
        rng, k = self.rng, self.k
        while self.waiting and budget > 0 and len(self.running) < k.max_running:
            rid = self.waiting[0]
            req = self.reqs[rid]
            num_tokens = len(req.tokens)
            use_hit = not req.remote_done
            hit = 0
            if use_hit:
                bound = None
                if rng.random() < k.max_hit_len:
                    bound = rng.randint(0, num_tokens - 1)
                _, hit, req.junction = self.p.call("get_computed_blocks", rid, bound)
                if req.junction:
                    self.p.tally.junctions += 1
                if hit:
                    self.p.tally.hits += 1
                    self.p.tally.reported_hits += req.report_full
                    if hit % self.layout.scheduler_block_size:
                        self.p.tally.sub_block_hits += 1
                computed = hit
            else:
                computed = req.num_computed
            remaining = num_tokens - computed
            external, delay = 0, False
            if use_hit and remaining > 1 and rng.random() < k.external:
                external = rng.randint(1, remaining - 1)
                delay = rng.random() < 0.5
            num_new = 0 if delay else min(remaining - external, budget)
            if num_new:
                num_new = self._chunk(req, computed + external, num_new, budget)
                if num_new <= 0:
                    break
                if req.junction and computed + external + num_new == req.junction:
                    self.p.tally.junction_stops += 1
            options: dict[str, Any] = {
                "num_lookahead_tokens": rng.randint(0, k.max_lookahead),
                "num_external_computed_tokens": external,
                "delay_cache_blocks": delay,
                "full_sequence_must_fit": rng.random() < k.full_sequence_must_fit,
                "reserved_blocks": rng.randint(0, k.max_reserved_blocks),
                "has_scheduled_reqs": bool(scheduled),
            }
            if req.encoder_tokens:
                options["num_encoder_tokens"] = req.encoder_tokens
            if self.p.allocate(rid, num_new, use_hit, **options) is None:
                break
            self.waiting.popleft()
            req.holds_blocks = True
            if use_hit:
                self.p.call("record_prefix_cache_stats", rid, hit)
            req.num_computed = computed + external
            self._set(rid, num_computed_tokens=req.num_computed)
            if delay:
                self._set(rid, status="WAITING_FOR_REMOTE_KVS")
                self.remote.append(rid)
                continue
            req.remote_done = False
            self._set(rid, status="RUNNING")
            self.running.append(rid)
            scheduled.append((rid, num_new, 0))
            budget -= num_new

    def _process_outputs(self, scheduled: list[tuple[str, int, int]]) -> None:
        rng = self.rng
        max_len = self.layout.max_model_len
        for rid, num_new, drafts in scheduled:
            req = self.reqs.get(rid)
            if req is None or rid not in self.running:
                continue
            req.num_computed += num_new
            if req.num_computed < len(req.tokens):
                self._set(rid, num_computed_tokens=req.num_computed, num_in_flight_tokens=0)
                continue
            accepted = rng.randint(0, drafts)
            accepted = min(accepted, max_len - len(req.tokens) - 1)
            new_tokens = [rng.randrange(1, 30_000) for _ in range(1 + accepted)]
            req.tokens.extend(new_tokens)
            req.num_computed -= drafts - accepted
            self.p.both("append_tokens", rid, new_tokens)
            self._check_hashes(rid)
            self._set(rid, num_computed_tokens=req.num_computed, num_in_flight_tokens=0)
            num_output = len(req.tokens) - req.num_prompt_tokens
            if num_output >= req.max_output or len(req.tokens) >= max_len - 1:
                self.running.remove(rid)
                self._finish(rid)

    def _settle_in_flight(self) -> None:
        for rid in self.in_flight:
            if rid in self.reqs:
                self._set(rid, num_in_flight_tokens=0)
        self.in_flight.clear()

    def _random_calls(self) -> None:
        rng, k = self.rng, self.k
        num_blocks = self.layout.num_blocks
        if rng.random() < k.evict:
            ids = {rng.randrange(1, num_blocks) for _ in range(rng.randint(1, 4))}
            self.p.call("evict_blocks", ids)
        holders = [rid for rid in self.running if self.reqs[rid].holds_blocks]
        if holders and rng.random() < k.remove_skipped:
            rid = rng.choice(holders)
            self.p.call("remove_skipped_blocks", rid, rng.randint(0, self.reqs[rid].num_computed))
        if holders and rng.random() < 0.05:
            # Nothing to compute and nothing to adopt: both managers refuse, unchanged.
            self.p.both_raise("allocate_slots", rng.choice(holders), 0, False)
        if holders and rng.random() < k.common_prefix:
            self.p.call("num_common_prefix_blocks", rng.choice(holders))
        for rid in holders:
            self.p.call("get_block_ids", rid)
        if k.abort and self.reqs and rng.random() < k.abort:
            self._abort()
        if rng.random() < k.reset and self.p.call("reset_prefix_cache"):
            self.p.tally.resets += 1
        if rng.random() < k.drain_and_reset:
            for rid in list(reversed(self.running)):
                self.running.remove(rid)
                self._preempt(rid)
            for rid in list(self.remote):
                self.remote.remove(rid)
                self._preempt(rid)
            for rid in self.waiting:
                if self.reqs[rid].holds_blocks:
                    self._release(rid)
            if not self.p.call("reset_prefix_cache"):
                raise MismatchError(f"{self.p.where}: reset refused with no request holding blocks")
            self.p.tally.resets += 1

    def _drain(self) -> None:
        self.p.events()
        self.p.call("make_prefix_cache_stats")
        self.p.hit_rate()
        self.p.call("take_new_block_ids")
        self.p.call("num_free_blocks")
        self.p.usage()
        self.p.snapshot()


def run_workload(scenario: Scenario, seed: int, ref: Any, ours: Any) -> Tally:
    """Replay one seeded workload through both sides; raise ``MismatchError`` on any difference."""
    tally = Tally()
    pair = Pair(ref, ours, tally)
    Workload(scenario, seed, pair).run()
    return tally


def is_cross(layout: Layout) -> bool:
    """Whether the layout has a cross-attention group (needs encoder tokens)."""
    return any(g.kind == CROSS for g in layout.groups)
