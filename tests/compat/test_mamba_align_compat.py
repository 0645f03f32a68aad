"""Hybrid Mamba models with prefix caching: kvcm's KVCacheManager against vLLM 0.33.0's.

vLLM runs the Mamba layers of a hybrid model in "align" mode when prefix caching is on: the
state after every block boundary is a checkpoint that may enter the prefix cache, and when
the hash block is smaller than the Mamba block, hits land on hash-block boundaries and a hit
ending inside a block is served through a copy of that block. Each scenario drives both
managers through the same seeded scheduler-like loop (chunks split as vLLM's scheduler
splits them for align mode: at block boundaries, the last cacheable boundary and the
prompt's tail hash boundary), with shared prefixes, resends, decode, preemption under
pressure and finishes, and compares every answer: block ids, hits and junctions, copies,
new block ids, events, stats, the hit rate and, after every step, the whole pool state.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType

import pytest
from _drivers import FULL, MAMBA, SWA, GroupDesc, KvcmSide, Layout, RequestSpec, VllmSide
from _workloads import Pair, Tally, align_chunk


@dataclass(frozen=True)
class MambaScenario:
    """A hybrid layout and how hard the loop drives it."""

    name: str
    layout: Layout
    steps: int
    token_budget: int
    max_running: int = 6
    max_output: int = 40
    max_lookahead: int = 0
    # Steps after which kvcm's side is replaced by a pool restored from its snapshot.
    round_trips: tuple[int, ...] = ()
    # Schedule as vLLM does with a KV connector (NIXL's lookup, external tokens loaded
    # synchronously or asynchronously, boundary-state hand-offs drained every step).
    connector: bool = False
    # Free as vLLM's scheduler does on an asynchronous KV consumer (defer_block_free): most
    # finished requests popped (pop_blocks_for_free) and returned in one pool call at their
    # fence, copy retentions kept one step past their drain; fences reached a step or two
    # later (_drain_deferred_frees).
    deferred_frees: bool = False


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    num_output: int
    num_computed: int = 0
    running: bool = False
    generated: int = 0
    junction: int = 0
    chunks: list[int] = field(default_factory=list)


class _Loop:
    """The scheduler-like loop: one step = lookups, allocations, copies, outputs."""

    def __init__(self, scenario: MambaScenario, seed: int, pair: Pair) -> None:
        self.s = scenario
        self.layout = scenario.layout
        self.pair = pair
        self.rng = random.Random(seed)
        mamba = next(g for g in self.layout.groups if g.kind == MAMBA)
        self.block = mamba.block_size
        self.hash_block = self.layout.hash_block_size
        # vLLM's partial hash hits; under DCP a Mamba block equal to the hash block also
        # serves them (the scaled full-attention blocks are the larger ones).
        self.partial = self.hash_block < self.block or (
            self.layout.dcp_world_size > 1 and self.hash_block == self.block
        )
        self.prefixes = [
            [self.rng.randrange(1, 30000) for _ in range(self.layout.max_model_len)]
            for _ in range(4)
        ]
        self.sent: list[list[int]] = []
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.next_id = 0
        self.num_copies = 0
        self.sub_block_hits = 0
        self.sched_block = self.layout.scheduler_block_size
        # Connector scenarios: requests whose asynchronous load completes next step, and
        # what the connector paths did.
        self.loading: list[_Req] = []
        self.connector_counts = dict.fromkeys(
            ("external", "async", "truncated", "diverged", "relookup", "offloads", "tails"), 0
        )
        # Deferred frees: vLLM's scheduler's step sequence numbers and its queue of
        # (fence, request id or None for a copy drain).
        self.sched_seq = self.processed_seq = 0
        self.deferred: deque[tuple[int, str | None]] = deque()
        self.deferred_counts = dict.fromkeys(("requests", "copy-drains", "immediate"), 0)

    # ------------------------------------------------------------------ requests
    def _new_prompt(self) -> list[int]:
        rng = self.rng
        if self.sent and rng.random() < 0.2:
            return list(rng.choice(self.sent))  # a resend: hits end at its tail boundary
        limit = self.layout.max_model_len - self.s.max_output - 8
        shared = rng.choice(self.prefixes)[: rng.randrange(0, limit)]
        own = [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 200))]
        return (shared + own)[:limit]

    def _add(self) -> None:
        rid = str(self.next_id)  # numeric: a snapshot names requests by their int keys
        self.next_id += 1
        prompt = self._new_prompt()
        self.sent.append(prompt)
        self.pair.both("add_request", RequestSpec(rid, prompt))
        self.waiting.append(_Req(rid, prompt, self.rng.randrange(1, self.s.max_output)))

    def _split(self, req: _Req, start: int, num_new: int) -> int:
        # vLLM's scheduler for align mode (no Eagle, no shared-prefix checkpoint).
        return align_chunk(
            self.layout,
            num_prompt=len(req.prompt),
            num_tokens=len(req.prompt) + req.generated,
            start=start,
            num_new=num_new,
            junction=req.junction,
            token_budget=self.s.token_budget,
        )

    def _preempt(self, req: _Req) -> None:
        self.pair.call("free", req.rid)
        self.pair.tally.preemptions += 1
        req.num_computed = 0
        req.running = False
        self.pair.both("update", req.rid, status="PREEMPTED", num_computed_tokens=0)
        self.running.remove(req)
        self.waiting.insert(0, req)

    def _finish(self, req: _Req) -> None:
        if self.s.connector:
            # A KV producer's scheduler hands a finished request's valid partial tail off.
            tails = self.pair.call("finalize_partial_tail_offloads", req.rid)
            self.connector_counts["tails"] += len(tails)
        if self.s.deferred_frees and self.rng.random() < 0.8:
            # Scheduled in the step still in flight: popped now, returned at its fence.
            self.pair.call("pop_blocks_for_free", req.rid)
            self.deferred.append((self.sched_seq, req.rid))
            self.deferred_counts["requests"] += 1
        else:
            self.pair.call("free", req.rid)
            self.deferred_counts["immediate"] += self.s.deferred_frees
        self.pair.both("update", req.rid, status="FINISHED_STOPPED")
        self.pair.both("drop_request", req.rid)
        self.running.remove(req)

    def _take_copies(self) -> int:
        if not self.s.deferred_frees:
            return len(self.pair.call("take_copies"))
        copies = self.pair.call("take_copies_retained")
        if copies:  # the step that runs them is the next one scheduled with tokens
            self.deferred.append((self.sched_seq + 1, None))
            self.deferred_counts["copy-drains"] += 1
        return len(copies)

    def _process(self, everything: bool = False) -> None:
        # update_from_output of the oldest step in flight (one or two may be), then vLLM's
        # _drain_deferred_frees: in queue order, stopping at the first fence not reached.
        behind = self.sched_seq - self.processed_seq
        if everything:
            self.processed_seq = self.sched_seq
        elif behind > 1 or (behind and self.rng.random() < 0.6):
            self.processed_seq += 1
        while self.deferred and self.deferred[0][0] <= self.processed_seq:
            _, rid = self.deferred.popleft()
            if rid is None:
                self.pair.call("release_copies")
            else:
                self.pair.call("free_popped", rid)

    # ------------------------------------------------------------------ one step
    def step(self, index: int) -> None:
        pair = self.pair
        pair.where = f"step {index}"
        if self.s.deferred_frees:
            self._process()
        pair.call("new_step_starts")
        budget = self.s.token_budget
        scheduled: list[tuple[_Req, int]] = []
        for req in list(self.running):
            if budget <= 0:
                break
            num_tokens = len(req.prompt) + req.generated
            remaining = num_tokens - req.num_computed
            num_new = self._split(req, req.num_computed, min(remaining, budget))
            if num_new <= 0:
                continue
            lookahead = self.rng.randrange(0, self.s.max_lookahead + 1) if remaining == 1 else 0
            options = {"num_lookahead_tokens": lookahead} if lookahead else {}
            if pair.allocate(req.rid, num_new, False, **options) is None:
                self._preempt(req)
                continue
            scheduled.append((req, num_new))
            budget -= num_new
        self._finish_loads()
        while self.waiting and budget > 0 and len(self.running) < self.s.max_running:
            req = self.waiting[0]
            num_tokens = len(req.prompt) + req.generated
            if req.num_computed:
                # Its asynchronous load completed: no lookup, nothing adopted.
                hit = req.num_computed
                num_new = self._split(req, hit, min(num_tokens - hit, budget))
                if num_new <= 0 or pair.allocate(req.rid, num_new, False) is None:
                    break
            elif self.s.connector:
                admitted = self._admit_with_connector(req, budget)
                if admitted is None:
                    break
                if not admitted:
                    continue  # loading asynchronously
                hit, num_new = admitted
            else:
                _ids, hit, junction = pair.call("get_computed_blocks", req.rid, None)
                req.junction = junction
                if hit:
                    pair.tally.hits += 1
                    self.sub_block_hits += hit % self.sched_block != 0
                num_new = self._split(req, hit, min(num_tokens - hit, budget))
                if num_new <= 0:
                    break
                gate = self.rng.random() < 0.3
                if pair.allocate(req.rid, num_new, True, full_sequence_must_fit=gate) is None:
                    break
                pair.call("record_prefix_cache_stats", req.rid, hit)
            self.waiting.pop(0)
            req.num_computed = hit
            req.running = True
            pair.both("update", req.rid, status="RUNNING", num_computed_tokens=hit)
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new
        if self.s.connector:
            offloads = pair.call("take_boundary_state_offloads")
            self.connector_counts["offloads"] += sum(map(len, offloads.values()))
        self.num_copies += self._take_copies()
        if scheduled:
            self.sched_seq += 1  # a step with tokens (the fence only moves then)
        pair.call("take_new_block_ids")
        pair.events()
        for req, num_new in scheduled:
            if not req.running:
                continue
            req.num_computed += num_new
            pair.both("update", req.rid, num_computed_tokens=req.num_computed)
            if req.num_computed >= len(req.prompt) + req.generated:
                if req.generated >= req.num_output:
                    self._finish(req)
                    continue
                req.generated += 1
                pair.both("append_tokens", req.rid, [self.rng.randrange(1, 30000)])
        if self.s.connector:
            # Aborts mid-prefill: one ending right at its prompt's tail boundary hands that
            # partial tail block off (finalize_partial_tail_offloads).
            prefilling = [r for r in self.running if r.num_computed < len(r.prompt)]
            if prefilling and self.rng.random() < 0.3:
                self._finish(self.rng.choice(prefilling))
        pair.call("make_prefix_cache_stats")
        pair.hit_rate()
        pair.usage()
        pair.call("num_free_blocks")
        pair.snapshot()

    def _admit_with_connector(self, req: _Req, budget: int) -> tuple[int, int] | bool | None:
        # vLLM's scheduler with a KV connector whose lookup reports full attention's own
        # hit (NIXL): the connector offers tokens past the block-aligned local hit; a longer
        # offer drops the local sub-block tail, a diverged hit nobody completes is looked up
        # again. Answers (computed tokens, tokens to compute), False for an asynchronous
        # load started, or None when the request does not fit.
        pair = self.pair
        counts = self.connector_counts
        rng = self.rng
        ids, local, junction, diverged = pair.call(
            "get_computed_blocks_for_connector", req.rid, None
        )
        counts["diverged"] += diverged
        num_tokens = len(req.prompt) + req.generated
        tail = local % self.sched_block
        aligned = local - tail
        # NIXL (pull) loads asynchronously: a remote prefill all the prompt but the last
        # token (Mamba's decoder recomputes it), a remote decode's blocks what its prefill
        # engine holds (at least kv_recompute_threshold = 64 tokens).
        ext = 0
        num_prompt = len(req.prompt)
        if req.generated == 0 and rng.random() < 0.5:
            end = num_prompt - 1
            if rng.random() < 0.3:
                end = rng.randrange(0, num_prompt + 1)
                if end - aligned < 64:
                    end = 0
            ext = max(end - aligned, 0)
        if tail and ext > tail and self._lagging_window(ids, aligned):
            # A sliding-window group's own hit ends before the aligned endpoint: vLLM's
            # truncate_computed_blocks asserts (its engine would stop), kvcm's refuses; the
            # loop goes on as if the connector offered nothing.
            pair.both_raise("truncate_hit", req.rid, aligned)
            counts["refused"] = counts.get("refused", 0) + 1
            ext = 0
        if tail and ext > tail:
            pair.call("truncate_hit", req.rid, aligned)
            counts["truncated"] += 1
            local = aligned
        elif tail:
            ext = 0
        load_async = ext > 0
        if diverged and ext == 0:
            counts["relookup"] += 1
            _ids, local, junction = pair.call("get_computed_blocks", req.rid, None)
        req.junction = junction
        if local:
            pair.tally.hits += 1
            self.sub_block_hits += local % self.sched_block != 0
        computed = local + ext
        counts["external"] += ext > 0
        groups = tuple(range(len(self.layout.groups)))
        if load_async:
            if (
                pair.allocate(
                    req.rid,
                    0,
                    True,
                    num_external_computed_tokens=ext,
                    delay_cache_blocks=True,
                    skip_zeroing_group_ids=groups,
                )
                is None
            ):
                return None
            counts["async"] += 1
            pair.call("record_prefix_cache_stats", req.rid, local)
            pair.both(
                "update", req.rid, status="WAITING_FOR_REMOTE_KVS", num_computed_tokens=computed
            )
            req.num_computed = computed
            self.waiting.pop(0)
            self.loading.append(req)
            return False
        num_new = self._split(req, computed, min(num_tokens - computed, budget))
        if num_new <= 0:
            return None
        gate = rng.random() < 0.3
        if pair.allocate(req.rid, num_new, True, full_sequence_must_fit=gate) is None:
            return None
        pair.call("record_prefix_cache_stats", req.rid, local)
        return computed, num_new

    def _lagging_window(self, ids: tuple[list[int], ...], end: int) -> bool:
        return any(
            group.kind == SWA and len(group_ids) < end // group.block_size
            for group, group_ids in zip(self.layout.groups, ids, strict=True)
        )

    def _finish_loads(self) -> None:
        # Loads started last step completed: cache what arrived; a whole prompt recomputes
        # its last token (vLLM's _update_waiting_for_remote_kv).
        loaded, self.loading = self.loading, []
        for req in loaded:
            self.pair.call("cache_blocks", req.rid, req.num_computed)
            num_tokens = len(req.prompt) + req.generated
            if req.num_computed == num_tokens:
                req.num_computed = num_tokens - 1
            self.pair.both(
                "update", req.rid, status="WAITING", num_computed_tokens=req.num_computed
            )
            self.waiting.insert(0, req)

    def run(self) -> None:
        for index in range(self.s.steps):
            while len(self.waiting) < 3:
                self._add()
            self.step(index)
            if index in self.s.round_trips:
                _round_trip(self.pair.ours, self.layout)
                self.pair.snapshot()
        for req in self.loading:
            self.pair.call("free", req.rid)
        for req in list(self.running):
            self._finish(req)
        if self.s.connector:
            self.pair.call("take_boundary_state_offloads")
        self._take_copies()
        if self.s.deferred_frees:
            self.sched_seq += 1
            self._process(everything=True)
            assert not self.deferred
        self.pair.events()
        self.pair.snapshot()


def _round_trip(side: KvcmSide, layout: Layout) -> None:
    # Snapshot kvcm's manager (align-mode bookkeeping, partial hits and pending copies
    # included), restore it into a fresh pool as a server does (every invariant checked), and
    # carry on with the restored manager and requests.
    from kvcm.common.hashing import HashAlgorithm
    from kvcm.core.pool_types import PoolConfig
    from kvcm.core.snapshot import decode_pool, encode_state, fresh_extras

    manager = side.manager
    # Requests popped for a deferred free are still the pool's (as the mirror's snapshots
    # keep them) until their blocks go back.
    popped = side._popped
    requests = {int(rid): request for rid, request in (*side.requests.items(), *popped.items())}
    data = encode_state(
        manager,
        requests,
        {key: str(key) for key in requests},
        extras=fresh_extras(last_step_seq=0, max_model_len=layout.max_model_len),
    )
    config = manager.config
    pool = decode_pool(
        data,
        "round-trip",
        PoolConfig(
            max_model_len=config.max_model_len,
            explicit_layout=config.kv_cache_config,
            scheduler_block_size=manager.scheduler_block_size,
            hash_block_size=manager.hash_block_size,
            max_in_flight_tokens=config.max_in_flight_tokens,
            enable_caching=config.enable_caching,
            hash_algorithm=HashAlgorithm(layout.hash_algorithm),
            hash_seed=layout.hash_seed,
            enable_kv_cache_events=True,
            log_stats=True,
            watermark=config.watermark,
            prefix_cache_retention_interval=config.prefix_cache_retention_interval,
            decode_context_parallel_size=config.dcp_world_size,
        ),
    )
    assert pool.manager is not None
    side.manager = pool.manager
    side.requests = {str(key): request for key, request in pool.requests.items()}
    side._popped = {rid: side.requests.pop(rid) for rid in popped}
    for request in side.requests.values():
        # A server's requests get their hashes from the client's programs; this side hashes
        # the tokens it appends itself, as before.
        request._block_hasher = side.hasher


def _mamba(block_size: int, **kw: object) -> GroupDesc:
    return GroupDesc(MAMBA, block_size, mamba_cache_mode="align", **kw)  # type: ignore[arg-type]


SCENARIOS = [
    # Hash block 64 under a Mamba block of 256: sub-block hits and their copies.
    MambaScenario(
        "full64-mamba256-dense",
        Layout((GroupDesc(FULL, 64), _mamba(256)), num_blocks=90, max_model_len=1536),
        steps=180,
        token_budget=512,
    ),
    MambaScenario(
        "full64-mamba256-retention-default",
        Layout((GroupDesc(FULL, 64), _mamba(256)), num_blocks=90, max_model_len=1536, retention=0),
        steps=180,
        token_budget=512,
    ),
    MambaScenario(
        "full64-swa64-mamba256",
        Layout(
            (GroupDesc(FULL, 64), GroupDesc(SWA, 64, 128), _mamba(256)),
            num_blocks=120,
            max_model_len=1536,
        ),
        steps=150,
        token_budget=512,
    ),
    MambaScenario(
        "full64-swa64-mamba256-retention-512",
        Layout(
            (GroupDesc(FULL, 64), GroupDesc(SWA, 64, 128), _mamba(256)),
            num_blocks=120,
            max_model_len=1536,
            retention=512,
        ),
        steps=150,
        token_budget=512,
    ),
    # Prefill checkpoints exported inside a chunk, speculative blocks and lookahead slots.
    MambaScenario(
        "full64-mamba256-checkpoints-spec",
        Layout(
            (
                GroupDesc(FULL, 64),
                _mamba(
                    256,
                    num_speculative_blocks=1,
                    num_prefill_checkpoint_blocks=1,
                    prefill_checkpoint_alignment=64,
                ),
            ),
            num_blocks=160,
            max_model_len=1536,
            retention=0,
        ),
        steps=150,
        token_budget=768,
        max_lookahead=2,
        round_trips=tuple(range(1, 150, 2)),
    ),
    # As vLLM serves real hybrid models: attention blocks as large as the Mamba block, and
    # --prefix-match-unit 64 for hits on 64-token boundaries.
    MambaScenario(
        "full256-mamba256-prefix-match-unit-64",
        Layout(
            (GroupDesc(FULL, 256), _mamba(256)),
            num_blocks=26,
            max_model_len=1536,
            retention=0,
            prefix_match_unit=64,
        ),
        steps=150,
        token_budget=512,
        round_trips=tuple(range(0, 150, 2)),
    ),
    # With a KV connector (NIXL's lookup and loads, boundary-state hand-offs), under
    # pressure so that groups' hits diverge.
    MambaScenario(
        "connector-full64-mamba256",
        Layout((GroupDesc(FULL, 64), _mamba(256)), num_blocks=70, max_model_len=1536),
        steps=150,
        token_budget=512,
        connector=True,
    ),
    MambaScenario(
        "connector-full256-mamba256-prefix-match-unit-64",
        Layout(
            (GroupDesc(FULL, 256), _mamba(256)),
            num_blocks=26,
            max_model_len=1536,
            retention=0,
            prefix_match_unit=64,
        ),
        steps=150,
        token_budget=512,
        connector=True,
    ),
    MambaScenario(
        "connector-full64-swa64-mamba256",
        Layout(
            (GroupDesc(FULL, 64), GroupDesc(SWA, 64, 128), _mamba(256)),
            num_blocks=100,
            max_model_len=1536,
        ),
        steps=120,
        token_budget=512,
        connector=True,
    ),
    # An asynchronous KV consumer (vLLM's defer_block_free): finished requests popped and
    # returned in one pool call at their fence, copy retentions held until theirs; cached
    # blocks of both groups reach the free queue as vLLM's single call puts them. Snapshot
    # round trips carry the retained drains and the popped requests.
    MambaScenario(
        "deferred-full64-mamba256-round-trips",
        Layout((GroupDesc(FULL, 64), _mamba(256)), num_blocks=70, max_model_len=1536),
        steps=150,
        token_budget=512,
        deferred_frees=True,
        round_trips=tuple(range(2, 150, 3)),
    ),
    MambaScenario(
        "connector-deferred-full64-swa64-mamba256",
        Layout(
            (GroupDesc(FULL, 64), GroupDesc(SWA, 64, 128), _mamba(256)),
            num_blocks=100,
            max_model_len=1536,
        ),
        steps=120,
        token_budget=512,
        connector=True,
        deferred_frees=True,
    ),
    # Decode context parallelism (vLLM's decode_context_parallel_size): full attention's
    # blocks span the DCP ranks (64 tokens per rank x 2 = 128 here, hash block 128 under a
    # Mamba block of 256), Mamba states are whole on every rank.
    MambaScenario(
        "dcp2-full64-mamba256",
        Layout(
            (GroupDesc(FULL, 64), _mamba(256)), num_blocks=90, max_model_len=1536, dcp_world_size=2
        ),
        steps=150,
        token_budget=512,
        round_trips=tuple(range(1, 150, 3)),
    ),
    # DCP 4: full attention 32 x 4 = 128-token blocks beside a Mamba block of 64, the hash
    # block: vLLM serves hits on 64-token boundaries inside full attention's blocks (without
    # DCP a Mamba block equal to the hash block would not).
    MambaScenario(
        "dcp4-full32-mamba64",
        Layout(
            (GroupDesc(FULL, 32), _mamba(64)), num_blocks=120, max_model_len=1024, dcp_world_size=4
        ),
        steps=150,
        token_budget=384,
    ),
    # Hash block equal to the Mamba block: hits on whole blocks only, no copies.
    MambaScenario(
        "full128-mamba128",
        Layout((GroupDesc(FULL, 128), _mamba(128)), num_blocks=120, max_model_len=1024),
        steps=150,
        token_budget=384,
    ),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_mamba_align_matches_vllm(vllm: ModuleType, scenario: MambaScenario) -> None:
    del vllm
    tally = Tally()
    pair = Pair(VllmSide(scenario.layout), KvcmSide(scenario.layout), tally)
    if scenario.connector:
        # vLLM's manager always collects boundary states; kvcm's when an engine drains them.
        pair.ours.manager.enable_boundary_state_offloads()
    loop = _Loop(scenario, seed=sum(map(ord, scenario.name)), pair=pair)
    loop.run()
    print(
        f"\n{scenario.name}: {tally.ops} ops compared, {tally.snapshots} snapshots, "
        f"{tally.hits} hits ({loop.sub_block_hits} sub-block), {loop.num_copies} copies, "
        f"{tally.not_fit} does-not-fit, {tally.preemptions} preemptions, {tally.events} events"
    )
    assert tally.hits > 0
    assert tally.ops > 2000
    if loop.partial:
        assert loop.sub_block_hits > 0
    if loop.hash_block < loop.block:
        # Hits inside a Mamba block are served through a copy of its state.
        assert loop.num_copies > 0
    if scenario.connector:
        print(f"connector paths: {loop.connector_counts}")
        counts = loop.connector_counts
        assert counts["external"]
        assert counts["async"]
        assert counts["offloads"]
    if scenario.deferred_frees:
        print(f"deferred frees: {loop.deferred_counts}")
        assert loop.deferred_counts["requests"] > 10
        assert loop.deferred_counts["copy-drains"] > 5
