"""KVCacheManager against a reference model: random scheduler programs over three layouts.

A program adds requests whose prompts share prefixes (a few stems, a tiny alphabet), admits
them (``get_computed_blocks`` + ``allocate_slots`` with a random token budget), runs chunked
prefill and decode steps (appending sampled tokens), preempts a request whose step does not fit
(as vLLM's scheduler does), frees requests, evicts blocks by id, resets the prefix cache and,
for layouts with a sliding window, frees blocks that left the window.

The model keeps what a scheduler knows: which requests hold block tables and how many token
slots each was given. After every step the manager must keep the pool invariants (shared with the
BlockPool machine: accounting, ref counts equal the tables holding a block, free xor held, the
cache map, a well-linked free list, usage in [0, 1]) and the model's: each table covers exactly
its slots, full-attention tables hold no null block, sliding-window tables only null out blocks
below the window, freed requests hold nothing. For pure full attention the model also predicts
hits (the longest run of cached keys, first-cached block answering) and whether an allocation
fits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_block_pool_machine import check_pool_invariants

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from kvcm.common.hashing import BlockHasher, make_block_hash_with_group_id
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvcm.core.block import KVCacheBlock
from kvcm.core.block_pool import BlockPool
from kvcm.core.invariants import manager_violations
from kvcm.core.manager import (
    CacheHit,
    KVCacheManager,
    KVCacheManagerConfig,
    SlotOptions,
)
from kvcm.core.request import Request, RequestStatus

MAX_MODEL_LEN = 40
STEMS = (
    (0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2),
    (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    (2, 1, 2, 1, 0, 0, 1, 1, 2, 2, 0, 1),
)
# The simplest prompt is a whole stem; draws say how much to cut off and what to add.
PROMPTS = st.builds(
    lambda stem, cut, tail: [*STEMS[stem][: len(STEMS[stem]) - cut], *tail] or [0],
    st.integers(0, len(STEMS) - 1),
    st.integers(0, len(STEMS[0])),
    st.lists(st.integers(0, 2), max_size=4),
)
LAYOUTS = ("full", "sliding", "hybrid")


def _full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16
    )


def _sliding(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype=DType.FLOAT16,
        sliding_window=window,
    )


def _specs(layout: str, window: int) -> list[KVCacheSpec]:
    if layout == "full":
        return [_full(2)]
    if layout == "sliding":
        return [_sliding(2, window)]
    # Different block sizes: hits align to their lcm (4), hashes come every gcd (2) tokens.
    return [_full(4), _sliding(2, window)]


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(eq=False)
class ModelRequest:
    """What the scheduler knows of a request."""

    request: Request
    holds: bool = False  # holds block tables (allocated, not freed or preempted since)
    slots: int = 0  # token slots its tables were grown to

    @property
    def request_id(self) -> str:
        return self.request.request_id


class ManagerMachine(RuleBasedStateMachine):
    """Random scheduler programs against one manager and its model."""

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager
        self.specs: list[KVCacheSpec] = []
        self.hasher: BlockHasher
        self.requests: list[ModelRequest] = []
        self.freed: list[str] = []
        self.num_added = 0

    @initialize(
        layout=st.sampled_from(LAYOUTS),
        num_smaller=st.integers(0, 18),
        window=st.integers(3, 7),
        prompts=st.lists(PROMPTS, min_size=2, max_size=6),
    )
    def build(self, layout: str, num_smaller: int, window: int, prompts: list[list[int]]) -> None:
        """A pool of 6..24 blocks (small enough to run out, large enough to share) and a few
        waiting requests, so that programs go straight to scheduling."""
        self.layout = layout
        self.specs = _specs(layout, window)
        groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(self.specs)]
        self.manager = KVCacheManager(
            KVCacheManagerConfig(
                kv_cache_config=KVCacheConfig(
                    num_blocks=24 - num_smaller, kv_cache_tensors=[], kv_cache_groups=groups
                ),
                max_model_len=MAX_MODEL_LEN,
            )
        )
        self.hasher = BlockHasher(self.manager.hash_block_size, seed="property")
        for prompt in prompts:
            self._add(prompt)

    # ------------------------------------------------------------------------ helpers
    @property
    def pool(self) -> BlockPool:
        return self.manager.block_pool

    def _waiting(self) -> list[ModelRequest]:
        return [r for r in self.requests if not r.holds]

    def _running(self) -> list[ModelRequest]:
        return [r for r in self.requests if r.holds]

    def _tables(self) -> list[Sequence[KVCacheBlock]]:
        tables: list[Sequence[KVCacheBlock]] = []
        for r in self._running():
            tables.extend(self.manager.get_blocks(r.request_id).blocks)
        return tables

    def _snapshot(self) -> object:
        pool = self.pool
        return (
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            pool.cached_block_ids(),
            {r.request_id: self.manager.get_block_ids(r.request_id) for r in self._running()},
            [(r.request.num_computed_tokens, r.request.num_tokens) for r in self.requests],
        )

    def _expected_full_hit(self, request: Request) -> list[int]:
        # Pure full attention: the longest run of cached keys, capped so that the last token
        # is computed; each key answers with the block cached under it first.
        block_size = self.specs[0].block_size
        cached = self.pool.cached_block_ids()
        ids: list[int] = []
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // block_size]:
            entry = cached.get(make_block_hash_with_group_id(block_hash, 0))
            if entry is None:
                break
            ids.append(entry[0])
        return ids

    def _check_hit(self, request: Request, hit: CacheHit) -> None:
        num_hit = hit.num_computed_tokens
        assert 0 <= num_hit <= request.num_tokens - 1
        assert num_hit % self.manager.scheduler_block_size == 0
        hash_block_size = self.manager.hash_block_size
        secondary = self.pool._secondary_keys
        cached = self.pool.cached_block_ids()
        for group_id, (spec, blocks) in enumerate(zip(self.specs, hit.blocks.blocks, strict=True)):
            assert len(blocks) * spec.block_size == num_hit
            scale = spec.block_size // hash_block_size
            for index, block in enumerate(blocks):
                if block.is_null:
                    assert isinstance(spec, SlidingWindowSpec), "null hit in a full group"
                    continue
                # A hit block carries the request's key for its position.
                key = make_block_hash_with_group_id(
                    request.block_hashes[(index + 1) * scale - 1], group_id
                )
                assert block.block_hash == key or key in secondary.get(block.block_id, {})
                # Blocks are not de-duplicated: the block cached first under a key answers.
                assert cached[key][0] == block.block_id
                if len(cached[key]) > 1:
                    event("hit: a key with several cached blocks answers")
        if self.layout == "full":
            assert hit.blocks.get_block_ids() == (self._expected_full_hit(request),)

    def _num_blocks_needed(
        self, model: ModelRequest, num_slots: int, hit_blocks: Sequence[KVCacheBlock]
    ) -> int:
        # Pure full attention: new blocks for the slots, plus hit blocks that must leave the
        # free queue.
        block_size = self.specs[0].block_size
        if model.holds:
            held = len(self.manager.get_blocks(model.request_id).blocks[0])
            return max(0, _cdiv(num_slots, block_size) - held)
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        return _cdiv(num_slots, block_size) - len(hit_blocks) + num_free_hits

    def _allocate(
        self, model: ModelRequest, num_new_tokens: int, hit: CacheHit | None, lookahead: int
    ) -> bool:
        request = model.request
        num_hit = 0 if hit is None else hit.num_computed_tokens
        num_slots = min(
            request.num_computed_tokens + num_hit + num_new_tokens + lookahead, MAX_MODEL_LEN
        )
        hit_blocks = [] if hit is None else hit.blocks.blocks[0]
        expected_fit = None
        if self.layout == "full":
            needed = self._num_blocks_needed(model, num_slots, hit_blocks)
            expected_fit = needed <= self.manager.num_free_blocks
        before = None if model.holds else self._snapshot()
        options = SlotOptions(num_lookahead_tokens=lookahead)
        blocks = self.manager.allocate_slots(request, num_new_tokens, hit, options)
        if expected_fit is not None:
            assert (blocks is not None) == expected_fit
        if blocks is None:
            event(f"allocate: does not fit ({'running' if model.holds else 'new'})")
            if before is not None:
                assert self._snapshot() == before, "a refused admission changed the state"
            return False
        tables = self.manager.get_blocks(request.request_id).blocks
        for new_blocks, table in zip(blocks.blocks, tables, strict=True):
            if new_blocks:
                assert list(table[-len(new_blocks) :]) == list(new_blocks)
            for block in new_blocks:
                assert block.ref_cnt == 1
        request.num_computed_tokens += num_hit + num_new_tokens
        request.status = RequestStatus.RUNNING
        model.holds = True
        model.slots = max(model.slots, num_slots)
        return True

    def _preempt(self, model: ModelRequest) -> None:
        self.manager.free(model.request)
        request = model.request
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        model.holds = False
        model.slots = 0

    def _add(self, prompt: list[int]) -> None:
        self.num_added += 1
        request = Request(f"req{self.num_added}", prompt, block_hasher=self.hasher)
        self.requests.append(ModelRequest(request))

    # -------------------------------------------------------------------------- rules
    # NOTE: Hypothesis tries rules with fewer arguments (then by name) first, so the rules
    # that build state take one `data` argument and are named to sort early.
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        """A new request arrives (its prompt's full blocks are hashed)."""
        self._add(data.draw(PROMPTS, label="prompt"))

    @precondition(lambda self: self._waiting())
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Look the request up and allocate a budget of its remaining tokens (or refuse)."""
        model = data.draw(st.sampled_from(self._waiting()), label="request")
        request = model.request
        hit = self.manager.get_computed_blocks(request)
        self._check_hit(request, hit)
        if hit.num_computed_tokens:
            event("admit: prefix hit")
        remaining = request.num_tokens - hit.num_computed_tokens
        budget = data.draw(st.integers(1, 16), label="budget")
        lookahead = data.draw(st.integers(0, 2), label="lookahead")
        self.nadm = getattr(self, "nadm", 0) + 1
        if self._allocate(model, min(budget, remaining), hit, lookahead):
            self.manager.record_prefix_cache_stats(request, hit.num_computed_tokens)

    @precondition(lambda self: any(r.holds for r in self.requests))
    @rule(data=st.data())
    def continue_running(self, data: st.DataObject) -> None:
        """Schedule a running request: the rest of its prefill, or a decode step.

        A decode step first appends the token sampled in the previous step. A step that does
        not fit preempts the request (freed, back to waiting from token 0).
        """
        model = data.draw(st.sampled_from(self._running()), label="request")
        request = model.request
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= MAX_MODEL_LEN:
                event("decode: at max_model_len, finished")
                self._free(model)
                return
            request.append_output_token_ids(data.draw(st.integers(0, 2), label="token"))
        remaining = request.num_tokens - request.num_computed_tokens
        budget = data.draw(st.integers(1, 16), label="budget")
        lookahead = data.draw(st.integers(0, 2), label="lookahead")
        if not self._allocate(model, min(budget, remaining), None, lookahead):
            event("step: preempted")
            self._preempt(model)

    @precondition(
        lambda self: any(
            r.holds and r.request.num_computed_tokens == r.request.num_tokens for r in self.requests
        )
    )
    @rule(data=st.data())
    def append_tokens(self, data: st.DataObject) -> None:
        """Several tokens land at once (accepted draft tokens), then one step computes them."""
        candidates = [
            r
            for r in self._running()
            if r.request.num_computed_tokens == r.request.num_tokens
            and r.request.num_tokens + 3 <= MAX_MODEL_LEN
        ]
        if not candidates:
            return
        model = data.draw(st.sampled_from(candidates), label="request")
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3), label="tokens")
        model.request.append_output_token_ids(tokens)
        if not self._allocate(model, len(tokens), None, 0):
            event("step: preempted")
            self._preempt(model)

    def _free(self, model: ModelRequest) -> None:
        self.manager.free(model.request)
        self.requests.remove(model)
        self.freed.append(model.request_id)
        assert not self.manager.holds_blocks(model.request_id)
        # vLLM 0.33 answers empty tables for a request holding no blocks.
        assert all(not group for group in self.manager.get_block_ids(model.request_id))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """A request finishes or is aborted (waiting ones hold nothing; that is fine)."""
        self._free(data.draw(st.sampled_from(self.requests), label="request"))

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        """Evict some ids from the prefix cache (cached or not, free or in use)."""
        num_blocks = self.pool.num_gpu_blocks
        self.manager.evict_blocks(
            data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=4), label="ids")
        )

    @precondition(lambda self: self.num_added)
    @rule(data=st.data())
    def reset_prefix_cache(self, data: st.DataObject) -> None:
        """Refused while any request holds a real block; otherwise every key is gone.

        ``data`` is unused: with one argument the rule sorts after the state-building ones.
        """
        del data
        expected = not any(not block.is_null for table in self._tables() for block in table)
        event(f"reset: {'accepted' if expected else 'refused'}")
        assert self.manager.reset_prefix_cache() == expected
        if expected:
            assert self.pool.cached_block_ids() == {}

    @precondition(lambda self: self.layout != "full" and any(r.holds for r in self.requests))
    @rule(data=st.data())
    def remove_skipped_blocks(self, data: st.DataObject) -> None:
        """Free the blocks that left the window: exactly those below it become null."""
        model = data.draw(st.sampled_from(self._running()), label="request")
        num_computed = model.request.num_computed_tokens
        self.manager.remove_skipped_blocks(model.request_id, num_computed)
        tables = self.manager.get_blocks(model.request_id).blocks
        for spec, table in zip(self.specs, tables, strict=True):
            if not isinstance(spec, SlidingWindowSpec):
                continue
            num_skipped = max(0, num_computed - spec.sliding_window + 1) // spec.block_size
            expected = min(num_skipped, len(table))
            if expected:
                event("remove_skipped_blocks: nulls a block")
            assert [b.is_null for b in table] == [True] * expected + [False] * (
                len(table) - expected
            )

    @rule(data=st.data(), kind=st.sampled_from(["unknown", "negative", "running_hit", "stale"]))
    def bad_input_changes_nothing(self, data: st.DataObject, kind: str) -> None:
        """Contract violations raise their typed error and change nothing.

        unknown: remove_skipped_blocks for a request holding no blocks; negative: a negative
        token count; running_hit: a running request brings a cache hit; stale: a hit block
        was evicted between the lookup and the allocation.
        """
        manager = self.manager
        if kind == "unknown":
            before = self._snapshot()
            with pytest.raises(NotFoundError):
                manager.remove_skipped_blocks("nobody", 0)
        elif kind == "negative" and self.requests:
            model = data.draw(st.sampled_from(self.requests), label="request")
            before = self._snapshot()
            with pytest.raises(InvalidArgumentError):
                manager.allocate_slots(model.request, -1)
        elif kind == "running_hit" and self._running():
            model = data.draw(st.sampled_from(self._running()), label="request")
            probe = Request("probe", model.request.all_token_ids, block_hasher=self.hasher)
            hit = manager.get_computed_blocks(probe)
            if not hit.num_computed_tokens:
                return
            before = self._snapshot()
            with pytest.raises(InvalidArgumentError):
                manager.allocate_slots(model.request, 1, hit)
        elif kind == "stale" and self._waiting():
            model = data.draw(st.sampled_from(self._waiting()), label="request")
            hit = manager.get_computed_blocks(model.request)
            real = [b for group in hit.blocks.blocks for b in group if not b.is_null]
            if not real:
                return
            manager.evict_blocks([data.draw(st.sampled_from(real), label="evicted").block_id])
            before = self._snapshot()
            with pytest.raises(FailedPreconditionError):
                manager.allocate_slots(model.request, 1, hit)
            event("stale hit rejected")
        else:
            return
        assert self._snapshot() == before

    # --------------------------------------------------------------------- invariants
    @invariant()
    def pool_invariants(self) -> None:
        check_pool_invariants(self.pool, self._tables())
        assert 0.0 <= self.manager.usage <= 1.0
        assert list(manager_violations(self.manager)) == []  # the core's own checker agrees

    @invariant()
    def tables_match_the_model(self) -> None:
        manager = self.manager
        for model in self.requests:
            request = model.request
            assert manager.holds_blocks(model.request_id) == model.holds
            if not model.holds:
                continue
            assert request.num_computed_tokens <= model.slots
            tables = manager.get_blocks(model.request_id).blocks
            num_holders = len(self._running())
            for spec, table in zip(self.specs, tables, strict=True):
                block_size = spec.block_size
                # The table covers exactly the slots it was given.
                assert len(table) == _cdiv(model.slots, block_size)
                nulls = [b.is_null for b in table]
                num_leading_nulls = nulls.index(False) if False in nulls else len(nulls)
                assert not any(nulls[num_leading_nulls:]), "a null block after a real one"
                if isinstance(spec, SlidingWindowSpec):
                    window_start = max(0, request.num_computed_tokens - spec.sliding_window + 1)
                    assert num_leading_nulls <= window_start // block_size
                else:
                    assert num_leading_nulls == 0
            common = manager.get_num_common_prefix_blocks(model.request_id)
            for spec, table, num_common in zip(self.specs, tables, common, strict=True):
                if isinstance(spec, SlidingWindowSpec):
                    assert num_common == 0
                    continue
                expected = 0
                for block in table:
                    if block.ref_cnt != num_holders:
                        break
                    expected += 1
                assert num_common == expected
        for request_id in self.freed:
            assert not manager.holds_blocks(request_id)


ManagerMachine.TestCase.settings = settings.get_profile(
    os.environ.get("KVCM_PROPERTY_PROFILE", "kvcm-ci")
)
TestManager = ManagerMachine.TestCase
