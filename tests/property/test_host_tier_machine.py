"""A pool with a host tier against a reference model: admissions with host hits, finishes,
swap-outs and swap-ins, with both tiers' invariants checked after every step.

The model is the host tier's contract written the plain way: a dict from key to host block,
a list for the eviction order (front evicted first), a stack of free host blocks, pins per
host block and the swapped requests. The machine drives a real ``Pool`` (a real device block
pool, a real ``HostTier``); the device pool's demotions are observed where the pool makes them
(its ``demote`` hook) and replayed on the model, which then must equal the tier exactly:
the keys and their host blocks, the eviction order, the pins, and every copy answered.

After every step:

* the device pool keeps every invariant ``kvcm.core.invariants.pool_violations`` checks;
* every host block is exactly one of free, keyed (one key) or private (a swapped block);
  keys are held once; the tier holds at most its capacity;
* the recency order holds every key once, in the model's order (pins keep a key's place);
  the evictable keys are exactly the ready, unpinned ones;
* pins are exactly the swapped requests' references;
* every copy answered moved the block the model says: a demotion copies the evicted device
  block into the host block its key got; a load copies the host block of the request's key
  at each position into the device block the request holds there, which is then cached
  under that key (a key may be in both tiers after a load: the tier is inclusive).

A rule restores the pool from its own snapshot at any point (a checkpoint restore): the copy
has the same fingerprint, and the machine goes on with it against the same model (the copies
not taken yet included), so a restored tier decides every later call as the original would.
"""

from __future__ import annotations

import os

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher, BlockHashWithGroupId, make_block_hash_with_group_id
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.host_tier import HostTier
from kvcm.core.invariants import pool_violations
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.request import RequestStatus
from kvcm.core.snapshot import decode_pool, encode_pool

BLOCK_SIZE = 2
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16)
NUM_DEVICE_BLOCKS = 9
LAYOUT = KVCacheConfig(
    num_blocks=NUM_DEVICE_BLOCKS,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)
# Prompts: a prefix of one of a few stems plus a short tail, so hits and shared keys are common.
STEMS = ((0, 1, 2, 0, 1, 2, 0, 1), (0, 0, 0, 0, 0, 0, 0, 0), (2, 1, 2, 1, 0, 0, 1, 1))
TOKENS = st.builds(
    lambda stem, cut, tail: [*STEMS[stem][: len(STEMS[stem]) - cut], *tail] or [0],
    st.integers(0, len(STEMS) - 1),
    st.integers(0, len(STEMS[0])),
    st.lists(st.integers(0, 3), max_size=3),
)

Key = BlockHashWithGroupId


class HostModel:
    """The host tier's contract, plainly."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.hold: dict[Key, int] = {}
        self.order: list[Key] = []  # every held key, least recently used first
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest
        self.pins: dict[int, int] = {}
        self.private: set[int] = set()
        self.swapped: dict[str, list[tuple[int, Key | None]]] = {}
        self.guard: set[Key] = set()  # keys an admission is loading: never evicted meanwhile

    def take(self, protected: set[Key]) -> int | None:
        if self.free:
            return self.free.pop()
        for key in self.order:
            pinned = self.pins.get(self.hold[key], 0) > 0
            if key not in protected and key not in self.guard and not pinned:
                self.order.remove(key)
                return self.hold.pop(key)
        return None

    def demote(self, key: Key, device_id: int) -> tuple[int, int] | None:
        if key in self.hold:
            self.order.remove(key)
            self.order.append(key)
            return None
        host_id = self.take(set())
        if host_id is None:
            return None
        self.hold[key] = host_id
        self.order.append(key)
        return (device_id, host_id)

    def hit(self, keys: list[Key]) -> int:
        count = 0
        while count < len(keys) and keys[count] in self.hold:
            count += 1
        return count

    def load(self, keys: list[Key], device_ids: list[int]) -> list[tuple[int, int]]:
        for key in reversed(keys):
            self.order.remove(key)
            self.order.append(key)
        return [(self.hold[key], device) for key, device in zip(keys, device_ids, strict=True)]

    def pin(self, host_id: int) -> None:
        # Pins keep a key's place in the recency order.
        self.pins[host_id] = self.pins.get(host_id, 0) + 1

    def unpin(self, host_id: int, key: Key | None) -> None:
        self.pins[host_id] -= 1
        if self.pins[host_id]:
            return
        del self.pins[host_id]
        if key is None:
            self.private.discard(host_id)
            self.free.append(host_id)

    def swap_out(
        self, owner: str, table: list[tuple[Key | None, int]]
    ) -> list[tuple[int, int]] | None:
        held = {key for key, _ in table if key is not None and key in self.hold}
        needed = sum(1 for key, _ in table if key not in held)
        evictable = [k for k in self.order if k not in held and not self.pins.get(self.hold[k])]
        if needed > len(self.free) + len(evictable):
            return None
        copies: list[tuple[int, int]] = []
        record: list[tuple[int, Key | None]] = []
        for key, device_id in table:
            if key is not None and key in self.hold:
                self.pin(self.hold[key])
                record.append((self.hold[key], key))
                continue
            host_id = self.take(held)
            assert host_id is not None
            if key is not None:
                self.hold[key] = host_id
                self.order.append(key)
                self.pin(host_id)
                record.append((host_id, key))
            else:
                self.private.add(host_id)
                self.pin(host_id)
                record.append((host_id, None))
            copies.append((device_id, host_id))
        self.swapped[owner] = record
        return copies

    def swap_out_group(
        self, members: list[tuple[str, list[tuple[Key | None, int]]]]
    ) -> dict[str, list[tuple[int, int]]] | None:
        held = {k for _, t in members for k, _ in t if k is not None and k in self.hold}
        # Distinct new keys are copied once; unkeyed blocks each.
        new = {k for _, t in members for k, _ in t if k is not None and k not in self.hold}
        needed = len(new) + sum(1 for _, t in members for k, _ in t if k is None)
        evictable = [k for k in self.order if k not in held and not self.pins.get(self.hold[k])]
        if needed > len(self.free) + len(evictable):
            return None
        self.guard = set(held)
        out = {}
        for owner, table in members:
            copies = self.swap_out(owner, table)
            assert copies is not None
            out[owner] = copies
        self.guard = set()
        return out

    def swap_in(
        self, owner: str, first_copied: int, device_ids: list[int]
    ) -> list[tuple[int, int]]:
        copies = []
        for position, (host_id, key) in enumerate(self.swapped.pop(owner)):
            if position >= first_copied:
                copies.append((host_id, device_ids[position]))
            self.unpin(host_id, key)
        return copies

    def drop(self, owner: str) -> None:
        for host_id, key in self.swapped.pop(owner, []):
            self.unpin(host_id, key)


class HostTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.num_host = 4
        self.pool = Pool(
            "p",
            PoolConfig(
                max_model_len=64,
                explicit_layout=LAYOUT,
                host_tier_bytes=self.num_host * SPEC.page_size_bytes,
            ),
        )
        host = self.pool.host_tier
        assert host is not None
        assert host.num_blocks == self.num_host
        self.host: HostTier = host
        self.model = HostModel(self.num_host)
        self.hasher = BlockHasher(BLOCK_SIZE, self.pool.hashing.algorithm, self.pool.hashing.seed)
        self.next_key = 1
        self.running: list[int] = []
        self.swapped: list[int] = []
        self.expected_d2h: list[tuple[int, int]] = []
        self.expected_h2d: list[tuple[int, int]] = []
        self._watch()

    def _watch(self) -> None:
        manager = self.pool.manager
        assert manager is not None
        self.manager = manager
        block_pool = manager.block_pool
        real = block_pool.demote
        assert real is not None

        def observed(key: Key, device_id: int) -> object:
            # The device pool evicts this cached block: the model learns it here.
            copy = self.model.demote(key, device_id)
            if copy is not None:
                self.expected_d2h.append(copy)
            return real(key, device_id)

        block_pool.demote = observed

    # ----------------------------------------------------------------------- helpers
    def _keys(self, key: int) -> list[Key]:
        request = self.pool.request(key)
        return [make_block_hash_with_group_id(h, 0) for h in request.block_hashes]

    def _table(self, key: int) -> list[tuple[Key | None, int]]:
        blocks = self.manager.get_blocks(str(key)).blocks[0]
        return [(block.block_hash, block.block_id) for block in blocks]

    # ------------------------------------------------------------------------- rules
    @rule(tokens=TOKENS)
    def admit(self, tokens: list[int]) -> None:
        key = self.next_key
        self.next_key += 1
        self.pool.add_request(key, f"r{key}", tokens, b"".join(self.hasher.hash_token_ids(tokens)))
        hit, num_host = self.pool.lookup_tiers(key)
        keys = self._keys(key)
        first = hit.num_computed_tokens // BLOCK_SIZE
        limit = (len(tokens) - 1) // BLOCK_SIZE
        expected_blocks = self.model.hit(keys[first:limit])
        assert num_host == expected_blocks * BLOCK_SIZE
        num_new = len(tokens) - hit.num_computed_tokens - num_host
        self.model.guard = set(keys[first : first + expected_blocks])
        admission = self.pool.admit_with_host(key, num_new)
        self.model.guard = set()
        if admission is None:
            event("admit: does not fit")
            self.pool.free(key, preempt=False)
            return
        event(f"admit: host hit {expected_blocks > 0}")
        ids = [block_id for _, block_id in self._table(key)]
        expected = self.model.load(
            keys[first : first + expected_blocks], ids[first : first + expected_blocks]
        )
        assert admission.host_to_device == expected
        self.expected_h2d.extend(expected)
        for position in range(first, first + expected_blocks):
            # The loaded device block is cached under the key it was loaded for.
            assert self.manager.block_pool.blocks[ids[position]].block_hash == keys[position]
        request = self.pool.request(key)
        assert request.status is RequestStatus.RUNNING
        assert request.num_computed_tokens == len(tokens) - num_new
        request.num_computed_tokens = len(tokens)  # the step ran
        self.running.append(key)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        key = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.pool.free(key, preempt=False)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.running) - 1))
        key = self.running[index]
        table = self._table(key)
        copies = self.pool.swap_out(key)
        expected = self.model.swap_out(str(key), table)
        assert copies == expected
        if copies is None:
            event("swap_out: no room")
            return
        event("swap_out")
        self.expected_d2h.extend(copies)
        self.running.pop(index)
        self.swapped.append(key)
        assert self.pool.request(key).status is RequestStatus.PREEMPTED

    @precondition(lambda self: len(self.running) >= 2)
    @rule(data=st.data())
    def swap_out_group(self, data: st.DataObject) -> None:
        keys = data.draw(
            st.lists(st.sampled_from(self.running), min_size=2, max_size=3, unique=True)
        )
        tables = {key: self._table(key) for key in keys}
        out = self.pool.swap_out_group(keys)
        expected = self.model.swap_out_group([(str(key), tables[key]) for key in keys])
        if expected is None:
            assert out is None
            event("swap_out_group: no room")
            return
        event("swap_out_group")
        assert out is not None
        assert {str(key): copies for key, copies in out.items()} == expected
        for key in keys:
            self.expected_d2h.extend(out[key])
            self.running.remove(key)
            self.swapped.append(key)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.swapped) - 1))
        key = self.swapped[index]
        num_swapped = self.host.swapped_tokens(str(key))
        assert num_swapped is not None
        request = self.pool.request(key)
        admission = self.pool.swap_in(key, request.num_tokens - num_swapped or 1)
        if admission is None:
            event("swap_in: does not fit")
            return
        event("swap_in")
        assert admission.num_device_hit_tokens + admission.num_host_hit_tokens == num_swapped
        first = admission.num_device_hit_tokens // BLOCK_SIZE
        ids = [block_id for _, block_id in self._table(key)]
        expected = self.model.swap_in(str(key), first, ids)
        assert admission.host_to_device == expected
        self.expected_h2d.extend(expected)
        self.swapped.pop(index)
        request.num_computed_tokens = request.num_tokens
        self.running.append(key)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def finish_swapped(self, data: st.DataObject) -> None:
        key = self.swapped.pop(data.draw(st.integers(0, len(self.swapped) - 1)))
        self.pool.free(key, preempt=False)
        self.model.drop(str(key))

    @rule()
    def restore_from_a_snapshot(self) -> None:
        # A checkpoint restore: the copy holds the same state (fingerprint, host tier
        # included) and the rules go on with it against the same model, copies not taken
        # yet included.
        restored = decode_pool(encode_pool(self.pool), "p", self.pool.options)
        assert restored.state_fingerprint() == self.pool.state_fingerprint()
        assert restored.host_tier is not None
        self.pool, self.host = restored, restored.host_tier
        self._watch()

    @rule()
    def take_copies(self) -> None:
        assert self.pool.take_host_copies() == (self.expected_d2h, self.expected_h2d)
        self.expected_d2h, self.expected_h2d = [], []

    # -------------------------------------------------------------------- invariants
    @invariant()
    def device_pool_keeps_its_invariants(self) -> None:
        assert list(pool_violations(self.pool)) == []

    @invariant()
    def tiers_equal_the_model(self) -> None:
        host, model = self.host, self.model
        assert host.keys() == model.hold
        assert host.recency() == model.order
        assert host.lru_keys() == [k for k in model.order if not model.pins.get(model.hold[k])]
        assert host.pinned() == model.pins
        assert host.private_blocks() == model.private
        assert sorted(host.swapped()) == sorted(model.swapped)
        for owner, record in model.swapped.items():
            _, tables = host.swapped()[owner]
            assert list(tables[0]) == [host_id for host_id, _ in record]

    @invariant()
    def host_blocks_are_partitioned(self) -> None:
        host = self.host
        keyed = host.keys()
        assert len(keyed) <= host.num_blocks
        assert len(set(keyed.values())) == len(keyed), "a host block holds two keys"
        private = host.private_blocks()
        free = host.num_free
        assert not (set(keyed.values()) & private)
        assert len(keyed) + len(private) + free == host.num_blocks
        assert host.stats().num_used == host.num_blocks - free
        # The recency order holds every key once; the evictable ones are the ready, unpinned.
        assert sorted(host.recency()) == sorted(keyed)
        assert host.num_evictable == len(host.lru_keys())
        pinned = host.pinned()
        assert set(host.lru_keys()) == {
            key
            for key, host_id in keyed.items()
            if host_id not in pinned and key not in host.pending_keys()
        }
        # Pins are the swapped requests' references; private blocks are all pinned.
        references: dict[int, int] = {}
        for _, tables in host.swapped().values():
            for host_id in tables[0]:
                if host_id is not None:
                    references[host_id] = references.get(host_id, 0) + 1
        assert pinned == references
        assert private <= set(pinned)


HostTierMachine.TestCase.settings = settings(
    settings.get_profile(os.environ.get("KVCM_PROPERTY_PROFILE", "kvcm-ci")),
    max_examples=int(os.environ.get("KVCM_HOST_TIER_EXAMPLES", "120")),
)
TestHostTier = HostTierMachine.TestCase
