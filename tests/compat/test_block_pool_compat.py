"""kvcm's BlockPool against vLLM 0.33.0's, driven by the same random operation sequences.

Both pools see the same calls: allocations after cache lookups (``get_cached_block`` +
``touch`` + ``get_new_blocks``), ``cache_full_blocks`` (with null blocks and masks), partial
entries (``cache_partial_block``), frees in tail-first order, sliding-window style skips
(blocks replaced by the null block and freed), ``evict_blocks`` and ``reset_prefix_cache``.
After every operation the test compares the answers, every block's ref_cnt and hash, the free
queue order, the hash -> blocks map and the events. Requests are hashed once with kvcm's
hasher; vLLM's pool sees the same hash bytes and token lists through a request-shaped view.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kvcm.common.hashing import BlockHasher
from kvcm.core.block_pool import BlockPool
from kvcm.core.request import Request

HASH_BLOCK_SIZE = 4
# Group 0 hashes at the pool's granularity, group 1 at twice it (a hybrid pool's larger group).
GROUP_BLOCK_SIZES = (4, 8)
NUM_BLOCKS = 24
NUM_OPS = 250
SEGMENTS = [list(range(base, base + 6)) for base in range(0, 60, 6)]


@pytest.fixture(scope="module")
def vllm_block_pool(vllm: ModuleType) -> ModuleType:
    """vLLM's block_pool module (skipped with the reason when vLLM is unavailable)."""
    del vllm
    return importlib.import_module("vllm.v1.core.block_pool")


@pytest.fixture(autouse=True)
def _full_event_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's full-width form, which kvcm's core publishes: the events compare digest for digest.
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")


class _Live:
    """One live request: its kvcm record, vLLM's view of it and both block tables."""

    def __init__(self, request: Request, view: SimpleNamespace, group_id: int) -> None:
        self.request = request
        self.view = view
        self.group_id = group_id
        self.block_size = GROUP_BLOCK_SIZES[group_id]
        self.ours: list[Any] = []
        self.theirs: list[Any] = []
        self.num_cached_blocks = 0


class _Harness:
    """Both pools, the live requests and the comparisons."""

    def __init__(
        self, module: ModuleType, rng: random.Random, *, caching: bool, events: bool
    ) -> None:
        self.rng = rng
        self.caching = caching
        self.events = events
        self.ours = BlockPool(
            num_gpu_blocks=NUM_BLOCKS,
            enable_caching=caching,
            hash_block_size=HASH_BLOCK_SIZE,
            enable_kv_cache_events=events,
        )
        self.theirs = module.BlockPool(
            num_gpu_blocks=NUM_BLOCKS,
            enable_caching=caching,
            hash_block_size=HASH_BLOCK_SIZE,
            enable_kv_cache_events=events,
        )
        self.hasher = BlockHasher(block_size=HASH_BLOCK_SIZE, seed="compat")
        self.live: dict[str, _Live] = {}
        self.next_id = 0

    # ------------------------------------------------------------------------- requests
    def _new_request(self) -> _Live:
        rng = self.rng
        tokens: list[int] = []
        for _ in range(rng.randint(1, 5)):
            tokens.extend(rng.choice(SEGMENTS[:4]) if rng.random() < 0.7 else rng.choice(SEGMENTS))
        tokens = tokens[: rng.randint(1, len(tokens))]
        lora = rng.random() < 0.2
        salt = "salt" if rng.random() < 0.15 else None
        session = rng.choice([None, "s1", "s2"])
        request_id = f"r{self.next_id}"
        self.next_id += 1
        request = Request(
            request_id,
            tokens,
            block_hasher=self.hasher,
            lora_name="ad" if lora else None,
            lora_id=7 if lora else None,
            lora_path="/ad" if lora else None,
            cache_salt=salt,
            session_id=session,
        )
        lora_request = (
            SimpleNamespace(lora_name="ad", lora_path="/ad", name="ad", adapter_id=7)
            if lora
            else None
        )
        # Same list objects: output tokens and new hashes reach vLLM's view too.
        view = SimpleNamespace(
            request_id=request_id,
            block_hashes=request.block_hashes,
            all_token_ids=request.all_token_ids,
            lora_request=lora_request,
            cache_salt=salt,
            mm_features=[],
            prompt_embeds=None,
            session_id=session,
        )
        return _Live(request, view, rng.choice((0, 1)))

    def _hashes(self, live: _Live) -> list[bytes]:
        scale = live.block_size // HASH_BLOCK_SIZE
        return list(live.request.block_hashes[scale - 1 :: scale])

    # ------------------------------------------------------------------------ operations
    def op_admit(self) -> None:
        live = self._new_request()
        group_ids = [live.group_id]
        hits_ours: list[Any] = []
        hits_theirs: list[Any] = []
        if self.caching:
            max_hit_blocks = (live.request.num_tokens - 1) // live.block_size
            lookup_groups = group_ids if self.rng.random() < 0.7 else [0, 1]
            for block_hash in self._hashes(live)[:max_hit_blocks]:
                ours = self.ours.get_cached_block(block_hash, lookup_groups)  # type: ignore[arg-type]
                theirs = self.theirs.get_cached_block(block_hash, lookup_groups)
                assert _ids(ours) == _ids(theirs)
                if ours is None:
                    break
                index = lookup_groups.index(live.group_id)
                hits_ours.append(ours[index])
                hits_theirs.append(theirs[index])
        num_blocks = -(-live.request.num_tokens // live.block_size)
        num_new = num_blocks - len(hits_ours)
        evictable = sum(1 for block in hits_ours if block.ref_cnt == 0)
        if num_new + evictable > self.ours.get_num_free_blocks():
            return
        self.ours.touch(hits_ours)
        self.theirs.touch(hits_theirs)
        new_ours = self.ours.get_new_blocks(num_new)
        new_theirs = self.theirs.get_new_blocks(num_new)
        assert _ids(new_ours) == _ids(new_theirs)
        live.ours = hits_ours + new_ours
        live.theirs = hits_theirs + new_theirs
        live.num_cached_blocks = len(hits_ours)
        self.live[live.request.request_id] = live
        self._cache(live)

    def op_grow(self) -> None:
        live = self._pick()
        if live is None:
            return
        live.request.append_output_token_ids(
            [self.rng.randrange(100) for _ in range(self.rng.randint(1, 9))]
        )
        num_new = -(-live.request.num_tokens // live.block_size) - len(live.ours)
        if num_new > self.ours.get_num_free_blocks():
            return
        new_ours = self.ours.get_new_blocks(num_new)
        new_theirs = self.theirs.get_new_blocks(num_new)
        assert _ids(new_ours) == _ids(new_theirs)
        live.ours.extend(new_ours)
        live.theirs.extend(new_theirs)
        self._cache(live)

    def _cache(self, live: _Live) -> None:
        if not self.caching:
            return
        num_hashed = len(live.request.block_hashes) * HASH_BLOCK_SIZE
        num_full = min(live.request.num_tokens, num_hashed) // live.block_size
        start = live.num_cached_blocks
        if start < num_full:
            mask = None
            if self.rng.random() < 0.25:
                mask = [self.rng.random() < 0.6 for _ in range(num_full - start)]
            args = (start, num_full, live.block_size, live.group_id, mask)
            self.ours.cache_full_blocks(live.request, live.ours, *args)
            self.theirs.cache_full_blocks(live.view, live.theirs, *args)
            live.num_cached_blocks = num_full
        if live.block_size != HASH_BLOCK_SIZE:
            self._cache_partial(live)

    def _cache_partial(self, live: _Live) -> None:
        # The prompt's last hash boundary inside a larger block, as the full-attention
        # manager registers it; sometimes a random boundary or a forced replacement.
        request = live.request
        num_hashes = len(request.block_hashes)
        boundary = min((request.num_prompt_tokens - 1) // HASH_BLOCK_SIZE, num_hashes)
        if self.rng.random() < 0.3:
            boundary = self.rng.randint(0, num_hashes)
        num_tokens = boundary * HASH_BLOCK_SIZE
        if num_tokens == 0 or num_tokens % live.block_size == 0:
            return
        index = num_tokens // live.block_size
        if index >= len(live.ours):
            return
        replace = self.rng.random() < 0.1
        ours = self.ours.cache_partial_block(
            request, live.ours[index], num_tokens, live.group_id, live.block_size, replace
        )
        theirs = self.theirs.cache_partial_block(
            live.view, live.theirs[index], num_tokens, live.group_id, live.block_size, replace
        )
        assert ours == theirs

    def op_free(self) -> None:
        live = self._pick()
        if live is None:
            return
        del self.live[live.request.request_id]
        self.ours.free_blocks(live.ours[::-1])
        self.theirs.free_blocks(live.theirs[::-1])

    def op_skip(self) -> None:
        # A sliding window moving on: leading blocks become the null block and are freed,
        # nearest first, as the managers do.
        live = self._pick()
        if live is None or len(live.ours) < 2:
            return
        last = self.rng.randint(1, len(live.ours) - 1)
        freed_ours: list[Any] = []
        freed_theirs: list[Any] = []
        for i in range(last - 1, -1, -1):
            if live.ours[i].is_null:
                break
            freed_ours.append(live.ours[i])
            freed_theirs.append(live.theirs[i])
            live.ours[i] = self.ours.null_block
            live.theirs[i] = self.theirs.null_block
        self.ours.free_blocks(freed_ours)
        self.theirs.free_blocks(freed_theirs)

    def op_evict(self) -> None:
        block_ids = {self.rng.randrange(NUM_BLOCKS) for _ in range(self.rng.randint(1, 4))}
        self.ours.evict_blocks(block_ids)
        self.theirs.evict_blocks(block_ids)

    def op_reset(self) -> None:
        if self.rng.random() < 0.5:
            for request_id in list(self.live):
                live = self.live.pop(request_id)
                self.ours.free_blocks(live.ours[::-1])
                self.theirs.free_blocks(live.theirs[::-1])
        assert self.ours.reset_prefix_cache() == self.theirs.reset_prefix_cache()

    def _pick(self) -> _Live | None:
        if not self.live:
            return None
        return self.live[self.rng.choice(sorted(self.live))]

    # ------------------------------------------------------------------------ comparison
    def compare(self, step: int) -> None:
        ours, theirs = self.ours, self.theirs
        where = f"step {step}"
        assert _ids(ours.free_block_queue.get_all_free_blocks()) == _ids(
            theirs.free_block_queue.get_all_free_blocks()
        ), where
        assert ours.get_num_free_blocks() == theirs.get_num_free_blocks(), where
        assert ours.get_usage() == pytest.approx(theirs.get_usage()), where
        for mine, other in zip(ours.blocks, theirs.blocks, strict=True):
            assert (mine.block_id, mine.ref_cnt, mine.block_hash, mine.block_hash_num_tokens) == (
                other.block_id,
                other.ref_cnt,
                other.block_hash,
                other.block_hash_num_tokens,
            ), where
        assert ours.cached_block_ids() == _their_map(theirs), where
        assert ours.num_cached_blocks == sum(b.block_hash is not None for b in theirs.blocks)
        mine_events = [_event(e) for e in ours.take_events()]
        their_events = [_event(e) for e in theirs.take_events()]
        assert _canonical(mine_events) == _canonical(their_events), where


def _ids(blocks: list[Any] | None) -> list[int] | None:
    return None if blocks is None else [block.block_id for block in blocks]


def _their_map(pool: Any) -> dict[bytes, list[int]]:
    result: dict[bytes, list[int]] = {}
    for key, entry in pool.cached_block_hash_to_block._cache.items():
        result[key] = list(entry) if isinstance(entry, dict) else [entry.block_id]
    return result


def _event(event: Any) -> tuple[str, dict[str, Any]]:
    if dataclasses.is_dataclass(event):
        fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    else:
        fields = {name: getattr(event, name) for name in event.__struct_fields__}
    return type(event).__name__, fields


def _canonical(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    # A block's secondary keys sit in a set in vLLM (hash-seed order) and in insertion order
    # in kvcm; removals of one block may therefore come in another order. Sort each run of
    # consecutive removals.
    result: list[tuple[str, dict[str, Any]]] = []
    run: list[tuple[str, dict[str, Any]]] = []
    for event in [*events, ("end", {})]:
        if event[0] == "BlockRemoved":
            run.append(event)
            continue
        run.sort(key=lambda e: (e[1]["group_idx"], e[1]["block_hashes"]))
        result.extend(run)
        run = []
        if event[0] != "end":
            result.append(event)
    return result


_OPS = (
    ("op_admit", 40),
    ("op_grow", 20),
    ("op_free", 20),
    ("op_skip", 8),
    ("op_evict", 8),
    ("op_reset", 2),
)


@pytest.mark.parametrize(
    ("caching", "events"), [(True, True), (True, False), (False, True)], ids=str
)
@pytest.mark.parametrize("seed", range(12))
def test_same_ops_same_state(
    vllm_block_pool: ModuleType, seed: int, caching: bool, events: bool
) -> None:
    rng = random.Random(seed * 7919 + caching * 2 + events)
    harness = _Harness(vllm_block_pool, rng, caching=caching, events=events)
    names = [name for name, _ in _OPS]
    weights = [weight for _, weight in _OPS]
    harness.compare(-1)
    for step in range(NUM_OPS):
        getattr(harness, rng.choices(names, weights)[0])()
        harness.compare(step)
    assert harness.ours.num_evicted_blocks >= 0
