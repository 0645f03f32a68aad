"""BlockPool against a reference model: random programs of allocate / hit / cache / free / evict.

The model is the pool's contract written the plain way: a Python list for the free queue (front
is evicted first), a ref count and a key per block, and a dict from key to the block ids cached
under it in insertion order. After every step the pool must equal the model (free-queue order
included) and keep its structural invariants (``check_pool_invariants``, shared with the manager
machine).

"Tables" stand for the block tables of requests: a table holds a request (for its block hashes)
and its blocks; a new table first adopts the longest run of cached blocks for its tokens (touch),
as a manager does with a cache hit.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.common.hashing import (
    BlockHash,
    BlockHasher,
    BlockHashWithGroupId,
    get_block_hash,
    make_block_hash_with_group_id,
)
from kvcm.core.block import KVCacheBlock
from kvcm.core.block_pool import BlockPool
from kvcm.core.invariants import block_pool_violations
from kvcm.core.request import Request

BLOCK_SIZE = 2
GROUP_ID = 0
# Prompts are a prefix of one of a few stems plus a short tail from a tiny alphabet, so hits,
# shared blocks and duplicate keys are common. Hypothesis leans to small draws, so the draws
# say how much to cut off (the simplest prompt is a whole stem: four full blocks).
STEMS = ((0, 1, 2, 0, 1, 2, 0, 1), (0, 0, 0, 0, 0, 0, 0, 0), (2, 1, 2, 1, 0, 0, 1, 1))
TOKENS = st.builds(
    lambda stem, cut, tail: [*STEMS[stem][: len(STEMS[stem]) - cut], *tail] or [0],
    st.integers(0, len(STEMS) - 1),
    st.integers(0, len(STEMS[0])),
    st.lists(st.integers(0, 2), max_size=3),
)


# ----------------------------------------------------------------- shared invariants
def walk_free_queue(pool: BlockPool) -> list[KVCacheBlock]:
    """The free queue front to back, checking every link both ways and the sentinels."""
    queue = pool.free_block_queue
    head, tail = queue._head, queue._tail
    assert head.block_id == -1, "the head sentinel is not a real block"
    assert tail.block_id == -1, "the tail sentinel is not a real block"
    assert head.prev_free_block is None
    assert tail.next_free_block is None
    forward: list[KVCacheBlock] = []
    node = head.next_free_block
    prev = head
    while node is not tail:
        assert node is not None, "forward walk fell off the list before the tail"
        assert node.prev_free_block is prev, f"block {node.block_id}: prev link broken"
        forward.append(node)
        assert len(forward) <= len(pool.blocks), "cycle in the free queue"
        prev, node = node, node.next_free_block
    assert tail.prev_free_block is prev
    backward: list[KVCacheBlock] = []
    node = tail.prev_free_block
    while node is not head:
        assert node is not None, "backward walk fell off the list before the head"
        backward.append(node)
        assert len(backward) <= len(pool.blocks), "cycle in the free queue (backward)"
        node = node.prev_free_block
    assert backward[::-1] == forward, "forward and backward walks disagree"
    assert len(forward) == queue.num_free_blocks == pool.get_num_free_blocks()
    return forward


def check_pool_invariants(pool: BlockPool, tables: Iterable[Sequence[KVCacheBlock]]) -> None:
    """The structural invariants of a pool whose blocks are held by ``tables``.

    * The free list is well linked (both ways, sentinels at the ends, length counted).
    * Every block's ref_cnt equals the number of tables holding it (null block excluded).
    * No block is both free and held; every unheld block is free: free + in use == N - 1.
    * Every prefix-cache entry's blocks carry that key (as their primary or a secondary
      key), and every block with a key is in the map under it.
    * Usage is in [0, 1] and equals in-use / (N - 1).
    """
    num_usable = pool.num_gpu_blocks - 1
    null = pool.null_block
    assert null.block_id == 0
    assert null.is_null
    assert null.ref_cnt == 0
    assert null.block_hash is None
    assert null.prev_free_block is None
    assert null.next_free_block is None

    free = walk_free_queue(pool)
    free_ids = [block.block_id for block in free]
    assert len(set(free_ids)) == len(free_ids), "a block is queued twice"
    assert 0 not in free_ids, "the null block is in the free queue"

    holders = [0] * pool.num_gpu_blocks
    for table in tables:
        for block in table:
            if not block.is_null:
                holders[block.block_id] += 1
    free_set = set(free_ids)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by "
            f"{holders[block.block_id]} tables"
        )
        held = holders[block.block_id] > 0
        assert held != (block.block_id in free_set), (
            f"block {block.block_id} is {'both free and held' if held else 'neither'}"
        )
        if held:
            assert block.prev_free_block is None
            assert block.next_free_block is None
    num_in_use = sum(1 for count in holders[1:] if count)
    assert len(free_ids) + num_in_use == num_usable

    cached = pool.cached_block_ids()
    secondary = pool._secondary_keys
    for key, block_ids in cached.items():
        assert block_ids, f"empty entry for {key!r}"
        assert len(set(block_ids)) == len(block_ids)
        for block_id in block_ids:
            block = pool.blocks[block_id]
            assert block.block_hash == key or key in secondary.get(block_id, {}), (
                f"block {block_id} is cached under a key it does not carry"
            )
    for block in pool.blocks:
        if block.block_hash is not None:
            assert block.block_id in cached.get(block.block_hash, ()), (
                f"block {block.block_id} carries a key the map does not know"
            )
        else:
            assert block.block_id not in secondary
    assert pool.num_cached_blocks == sum(1 for b in pool.blocks if b.block_hash is not None)

    usage = pool.get_usage()
    assert 0.0 <= usage <= 1.0
    if num_usable:
        assert usage == pytest.approx(num_in_use / num_usable)


# ----------------------------------------------------------------------- the model
@dataclass
class PoolModel:
    """The pool's contract, kept the obvious way."""

    num_blocks: int
    enable_caching: bool
    free: list[int] = field(default_factory=list)
    ref: list[int] = field(default_factory=list)
    key: list[BlockHashWithGroupId | None] = field(default_factory=list)
    cached: dict[BlockHashWithGroupId, list[int]] = field(default_factory=dict)
    events: list[tuple[object, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(1, self.num_blocks))
        self.ref = [0] * self.num_blocks
        self.key = [None] * self.num_blocks

    def lookup(self, key: BlockHashWithGroupId) -> int | None:
        ids = self.cached.get(key)
        return ids[0] if ids else None

    def _uncache(self, block_id: int) -> None:
        key = self.key[block_id]
        if key is None:
            return
        ids = self.cached[key]
        ids.remove(block_id)
        if not ids:
            del self.cached[key]
        self.key[block_id] = None
        self.events.append(("removed", get_block_hash(key)))

    def get_new(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        if any(self.key[block_id] is not None for block_id in taken):
            event("get_new_blocks: evicts a cached block")
        for block_id in taken:
            self._uncache(block_id)
            self.ref[block_id] = 1
        return taken

    def touch(self, ids: Iterable[int]) -> None:
        for block_id in ids:
            if self.ref[block_id] == 0:
                self.free.remove(block_id)
            self.ref[block_id] += 1

    def release(self, ids: Iterable[int]) -> None:
        front: list[int] = []
        back: list[int] = []
        for block_id in ids:
            self.ref[block_id] -= 1
            if self.ref[block_id] == 0:
                cached = self.enable_caching and self.key[block_id] is not None
                (back if cached else front).append(block_id)
        self.free = front + self.free + back

    def cache(self, ids: Sequence[int], hashes: Sequence[BlockHash], parent: int | None) -> None:
        for block_id, block_hash in zip(ids, hashes, strict=True):
            key = make_block_hash_with_group_id(block_hash, GROUP_ID)
            self.key[block_id] = key
            self.cached.setdefault(key, []).append(block_id)
        self.events.append(("stored", list(hashes), parent))

    def evict(self, ids: Iterable[int]) -> None:
        for block_id in ids:
            self._uncache(block_id)

    def reset(self) -> bool:
        if any(self.ref[1:]):
            return False
        self.key = [None] * self.num_blocks
        self.cached = {}
        self.events.append(("cleared",))
        return True


def _event_view(event: object) -> tuple[object, ...]:
    if isinstance(event, BlockStored):
        return ("stored", list(event.block_hashes), event.parent_block_hash)
    if isinstance(event, BlockRemoved):
        assert len(event.block_hashes) == 1
        return ("removed", event.block_hashes[0])
    assert isinstance(event, AllBlocksCleared), event
    return ("cleared",)


@dataclass(eq=False)
class Table:
    """One request's block table (what a per-group manager keeps)."""

    request: Request
    blocks: list[KVCacheBlock]
    num_cached: int


# --------------------------------------------------------------------- the machine
class BlockPoolMachine(RuleBasedStateMachine):
    """Random programs against one pool and its model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool
        self.model: PoolModel
        self.live: list[Table] = []
        self.hasher = BlockHasher(BLOCK_SIZE, seed="property")
        self.num_requests = 0

    # Pools of 2..16 blocks: small enough that allocations fail and cached blocks are reused.
    # A few tables from the start, so that programs go straight to sharing and freeing.
    @initialize(
        num_smaller=st.integers(0, 14),
        disable_caching=st.booleans(),
        first_tables=st.lists(st.tuples(TOKENS, st.booleans()), max_size=4),
    )
    def build(
        self, num_smaller: int, disable_caching: bool, first_tables: list[tuple[list[int], bool]]
    ) -> None:
        num_blocks, enable_caching = 16 - num_smaller, not disable_caching
        self.pool = BlockPool(num_blocks, enable_caching, BLOCK_SIZE, enable_kv_cache_events=True)
        self.model = PoolModel(num_blocks, enable_caching)
        for tokens, cache_now in first_tables:
            self._add_table(tokens, cache_now)

    # ------------------------------------------------------------------------ helpers
    def _request(self, tokens: list[int]) -> Request:
        self.num_requests += 1
        return Request(f"r{self.num_requests}", tokens, block_hasher=self.hasher)

    def _snapshot(self) -> object:
        pool = self.pool
        return (
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            pool.cached_block_ids(),
            len(pool.kv_event_queue),
        )

    def _lookup_hits(self, request: Request) -> list[KVCacheBlock]:
        # The longest run of cached blocks, as a manager's cache-hit search finds it.
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes:
            found = self.pool.get_cached_block(block_hash, [GROUP_ID])
            expected = self.model.lookup(make_block_hash_with_group_id(block_hash, GROUP_ID))
            if found is None:
                assert expected is None
                break
            assert [b.block_id for b in found] == [expected]
            hits.append(found[0])
        return hits

    def _take(self, num_blocks: int) -> list[KVCacheBlock]:
        new_blocks = self.pool.get_new_blocks(num_blocks)
        assert [b.block_id for b in new_blocks] == self.model.get_new(num_blocks)
        for block in new_blocks:
            assert block.ref_cnt == 1
            assert block.block_hash is None
        return new_blocks

    def _cache(self, table: Table) -> None:
        # Cache the table's blocks that became full since the last call.
        request = table.request
        num_cached = table.num_cached
        num_full = min(len(table.blocks), len(request.block_hashes))
        if not self.pool.enable_caching or num_full <= num_cached:
            return
        hashes = request.block_hashes[num_cached:num_full]
        if any(make_block_hash_with_group_id(h, GROUP_ID) in self.model.cached for h in hashes):
            event("cache: a key is already cached under another block")
        self.pool.cache_full_blocks(
            request, table.blocks, num_cached, num_full, BLOCK_SIZE, GROUP_ID
        )
        parent = request.block_hashes[num_cached - 1] if num_cached else None
        self.model.cache([b.block_id for b in table.blocks[num_cached:num_full]], hashes, parent)
        table.num_cached = num_full

    # -------------------------------------------------------------------------- rules
    # NOTE: Hypothesis tries rules with fewer arguments (then by name) first, so the rules
    # that build state draw their values from `data` and are named to sort early.
    @rule(data=st.data())
    def add_table(self, data: st.DataObject) -> None:
        """Adopt the cached prefix (touch), take new blocks for the rest, maybe cache them."""
        self._add_table(data.draw(TOKENS, label="tokens"), data.draw(st.booleans(), label="cache"))

    def _add_table(self, tokens: list[int], cache_now: bool) -> None:
        request = self._request(tokens)
        hits = self._lookup_hits(request)
        num_needed = -(-len(tokens) // BLOCK_SIZE) - len(hits)
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed + num_evictable_hits > self.pool.get_num_free_blocks():
            event("new table: does not fit")
            return
        if hits:
            event(f"new table: hit, {'some' if num_evictable_hits else 'no'} hit blocks free")
        self.pool.touch(hits)
        self.model.touch(b.block_id for b in hits)
        table = Table(request, hits + self._take(num_needed), len(hits))
        self.live.append(table)
        if cache_now:
            self._cache(table)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def append_tokens(self, data: st.DataObject) -> None:
        """Append tokens to a table's request and allocate the blocks they need."""
        table = data.draw(st.sampled_from(self.live), label="table")
        tokens = data.draw(TOKENS, label="tokens")
        cache_now = data.draw(st.booleans(), label="cache_now")
        num_needed = -(-(table.request.num_tokens + len(tokens)) // BLOCK_SIZE) - len(table.blocks)
        if num_needed > self.pool.get_num_free_blocks():
            event("append: does not fit")
            return
        table.request.append_output_token_ids(tokens)
        table.blocks.extend(self._take(num_needed))
        if cache_now:
            self._cache(table)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        """Cache a table's blocks that became full since the last call."""
        self._cache(data.draw(st.sampled_from(self.live)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_table(self, data: st.DataObject) -> None:
        """Release a table tail first (its tail is evicted before its head)."""
        table = data.draw(st.sampled_from(self.live))
        self.live.remove(table)
        self.pool.free_blocks(reversed(table.blocks))
        self.model.release(b.block_id for b in reversed(table.blocks))

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        """Evict some ids (cached or not, free or in use) from the prefix cache."""
        ids = data.draw(st.lists(st.integers(0, self.model.num_blocks - 1), max_size=5))
        self.pool.evict_blocks(ids)
        self.model.evict(ids)

    @precondition(lambda self: self.num_requests)
    @rule()
    def reset_prefix_cache(self) -> None:
        accepted = self.model.reset()
        event(f"reset: {'accepted' if accepted else 'refused'}")
        assert self.pool.reset_prefix_cache() == accepted

    @rule(data=st.data(), kind=st.sampled_from(["evict", "take", "free"]))
    def bad_input_changes_nothing(self, data: st.DataObject, kind: str) -> None:
        """Rejected calls raise their typed error and leave the pool as it was.

        evict: an id outside the pool (or not an int); take: more blocks than are free;
        free: a free block after some held ones (their references must be restored).
        """
        pool = self.pool
        before = self._snapshot()
        if kind == "evict":
            bad = data.draw(st.sampled_from([-1, pool.num_gpu_blocks, "1", 1.0]))
            with pytest.raises(InvalidArgumentError):
                pool.evict_blocks([pool.num_gpu_blocks - 1, bad])  # type: ignore[list-item]
        elif kind == "take":
            extra = data.draw(st.integers(1, 3))
            with pytest.raises(FailedPreconditionError):
                pool.get_new_blocks(pool.get_num_free_blocks() + extra)
        else:
            free = pool.free_block_queue.get_all_free_blocks()
            if not free:
                return
            held = data.draw(st.sampled_from(self.live)).blocks if self.live else []
            ordered = [*reversed(held), data.draw(st.sampled_from(free))]
            with pytest.raises(FailedPreconditionError):
                pool.free_blocks(ordered)
        assert self._snapshot() == before

    # --------------------------------------------------------------------- invariants
    @invariant()
    def pool_invariants(self) -> None:
        check_pool_invariants(self.pool, (t.blocks for t in self.live))
        assert list(block_pool_violations(self.pool)) == []  # the core's own checker agrees

    @invariant()
    def pool_equals_model(self) -> None:
        pool, model = self.pool, self.model
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == model.free
        assert [b.ref_cnt for b in pool.blocks[1:]] == model.ref[1:]
        assert [b.block_hash for b in pool.blocks] == model.key
        assert pool.cached_block_ids() == model.cached
        assert [_event_view(e) for e in pool.take_events()] == model.events
        model.events.clear()


BlockPoolMachine.TestCase.settings = settings.get_profile(
    os.environ.get("KVCM_PROPERTY_PROFILE", "kvcm-ci")
)
TestBlockPool = BlockPoolMachine.TestCase


def test_rejected_free_of_an_iterator_changes_nothing() -> None:
    pool = BlockPool(4, True, BLOCK_SIZE)
    held = pool.get_new_blocks(1)
    free = pool.free_block_queue.get_all_free_blocks()[0]
    with pytest.raises(FailedPreconditionError):
        pool.free_blocks(iter([*held, free]))
    check_pool_invariants(pool, [held])
