"""Fork, copy-on-write, promotion, demotion and swaps mixed, on one pool with a host tier,
against one reference model of the seed's V0 allocator semantics, both tiers checked after
every step.

The reference model (docs/fork-cow.md, "Against V0") is vLLM V0's prefix-caching block
allocator pair (a device allocator and a host allocator, ``../shared/seeds/003_*``) written
the plain way:

* device: each request's block table as a list of block ids, reference counts derived from
  the tables, the hash each full block was promoted with;
* host: a dict from key to host block, a list for the eviction order (front evicted first),
  a stack of free host blocks, pins per host block and the swapped requests
  (``test_host_tier_machine.HostModel``).

It predicts: a fork shares the parent's computed blocks, the partial last one included; the
first write into a shared partial block copies it (the writer gets a new block, the others
keep the original); a block that fills is promoted (cached under its hash); a cached device
block evicted for reuse is demoted to the host tier (a device-to-host copy) unless the tier
holds its key; a swap-out copies each full block once per key (a key the tier holds is
pinned, not copied: V0's host allocator deduplicates immutable blocks by content) and each
partial block once per holder (V0 swaps mutable blocks block by block), the request then
holding no device block; a swap-in takes the device's hit first and copies the rest back
into new blocks, each a private one (a forked request's partial block comes back unshared,
so no copy-on-write follows); a free drops only the freed request's references.

The documented differences from V0 (docs/fork-cow.md) are part of the model: a promoted
block whose hash is cached already stays (V0 remaps it onto the cached block), and host hits
load into new device blocks while the key stays in the host tier (inclusive tiers).

The machine mixes every operation on every kind of request: a fork of a request loaded from
the host tier, a swap-out of a forked request or of a group of siblings sharing a partial
block, a copy-on-write after a swap-in, promotions of blocks that were swapped, demotions of
blocks a fork promoted; and restores the pool from its own snapshot at any point.
"""

from __future__ import annotations

import os

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_host_tier_machine import HostModel

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher, BlockHashWithGroupId, make_block_hash_with_group_id
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.fork import fork_request, pool_common_computed_block_ids, take_fork_copies
from kvcm.core.host_tier import HostTier
from kvcm.core.invariants import pool_violations
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import OpKind, StepProgram
from kvcm.core.request import RequestStatus
from kvcm.core.snapshot import decode_pool, encode_pool

BLOCK_SIZE = 2
NUM_DEVICE_BLOCKS = 11
NUM_HOST_BLOCKS = 5
MAX_LEN = 20
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=NUM_DEVICE_BLOCKS,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)
STEMS = ((0, 1, 2, 0, 1, 2, 0, 1), (0, 0, 0, 0, 0, 0, 0, 0), (2, 1, 2, 1, 0, 0, 1, 1))
TOKENS = st.builds(
    lambda stem, cut, tail: [*STEMS[stem][: len(STEMS[stem]) - cut], *tail] or [0],
    st.integers(0, len(STEMS) - 1),
    st.integers(0, len(STEMS[0])),
    st.lists(st.integers(0, 3), max_size=3),
)
Key = BlockHashWithGroupId


class ForkSwapMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool(
            "p",
            PoolConfig(
                max_model_len=MAX_LEN,
                explicit_layout=LAYOUT,
                host_tier_bytes=NUM_HOST_BLOCKS * SPEC.page_size_bytes,
            ),
        )
        self.hasher = BlockHasher(BLOCK_SIZE, self.pool.hashing.algorithm, self.pool.hashing.seed)
        self.host_model = HostModel(NUM_HOST_BLOCKS)
        self.next_key = 1
        # Device model: key -> block ids, tokens, computed tokens; block -> promoted hash.
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.promoted: dict[int, bytes] = {}
        self.swapped: list[int] = []  # keys swapped out (their tokens in self.tokens)
        self.expected_d2h: list[tuple[int, int]] = []
        self.expected_h2d: list[tuple[int, int]] = []
        self._watch()

    def _watch(self) -> None:
        manager = self.pool.manager
        assert manager is not None
        host = self.pool.host_tier
        assert host is not None
        self.manager, self.host = manager, host
        self.group = manager.coordinator.single_type_managers[0]
        block_pool = manager.block_pool
        real = block_pool.demote
        assert real is not None

        def observed(key: Key, device_id: int) -> object:
            # The device evicts this cached block to reuse it: demoted (V0 would lose it).
            copy = self.host_model.demote(key, device_id)
            if copy is not None:
                self.expected_d2h.append(copy)
            return real(key, device_id)

        block_pool.demote = observed

    # ------------------------------------------------------------------- model helpers
    def refs(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for table in self.tables.values():
            for block_id in table:
                counts[block_id] = counts.get(block_id, 0) + 1
        return counts

    def _hashes(self, key: int) -> list[bytes]:
        return list(self.hasher.hash_token_ids(self.tokens[key]))

    def _keys(self, key: int) -> list[Key]:
        return [make_block_hash_with_group_id(h, 0) for h in self._hashes(key)]

    def _real(self, key: int) -> list[int]:
        return [block.block_id for block in self.group.req_to_blocks.get(str(key), [])]

    def _promote(self, key: int) -> None:
        hashes = self._hashes(key)
        for index in range(self.computed[key] // BLOCK_SIZE):
            self.promoted[self.tables[key][index]] = hashes[index]

    def _adopt(self, key: int, first_new: int) -> None:
        # The pool's table after an allocation: blocks before first_new were the model's
        # (or device hits it checks), the rest were free (their old promotion is gone).
        real = self._real(key)
        refs = self.refs()
        for block_id in real[first_new:]:
            assert refs.get(block_id, 0) == 0, f"block {block_id} handed out while referenced"
            self.promoted.pop(block_id, None)
        self.tables[key] = real

    def _check_hit(self, key: int, num_hit_blocks: int) -> None:
        # A device hit shares cached blocks holding the request's hashes, in order.
        hashes = self._hashes(key)
        for position, block_id in enumerate(self._real(key)[:num_hit_blocks]):
            assert self.promoted.get(block_id) == hashes[position], f"hit block {block_id}"

    def _table(self, key: int) -> list[tuple[Key | None, int]]:
        blocks = self.manager.get_blocks(str(key)).blocks[0]
        return [(block.block_hash, block.block_id) for block in blocks]

    def _drop(self, key: int) -> None:
        del self.tables[key], self.tokens[key], self.computed[key]

    # ------------------------------------------------------------------------- rules
    @rule(tokens=TOKENS)
    def admit(self, tokens: list[int]) -> None:
        # Admission with both tiers' hits: device hit, then host hit loaded into new blocks.
        key = self.next_key
        self.next_key += 1
        self.pool.add_request(key, f"r{key}", tokens, b"".join(self.hasher.hash_token_ids(tokens)))
        self.tokens[key] = list(tokens)
        hit, num_host = self.pool.lookup_tiers(key)
        keys = self._keys(key)
        first = hit.num_computed_tokens // BLOCK_SIZE
        limit = (len(tokens) - 1) // BLOCK_SIZE
        num_loaded = self.host_model.hit(keys[first:limit])
        assert num_host == num_loaded * BLOCK_SIZE
        self.host_model.guard = set(keys[first : first + num_loaded])
        admission = self.pool.admit_with_host(key, len(tokens) - hit.num_computed_tokens - num_host)
        self.host_model.guard = set()
        if admission is None:
            event("admit: does not fit")
            self.pool.free(key, preempt=False)
            del self.tokens[key]
            return
        event(f"admit: device hit {first > 0}, host hit {num_loaded > 0}")
        self._check_hit(key, first)
        self._adopt(key, first)
        ids = self.tables[key]
        expected = self.host_model.load(
            keys[first : first + num_loaded], ids[first : first + num_loaded]
        )
        assert admission.host_to_device == expected
        self.expected_h2d.extend(expected)
        self.pool.request(key).num_computed_tokens = len(tokens)  # the step ran
        self.computed[key] = len(tokens)
        self._promote(key)
        assert take_fork_copies(self.pool) == []

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tables)))
        child = self.next_key
        self.next_key += 1
        if data.draw(st.booleans()):
            fork_request(self.pool, parent, child, f"r{child}", self.computed[parent])
        else:
            outcome = self.pool.run_step(
                StepProgram(
                    ops=[OpKind.FORK],
                    request_keys=[parent],
                    fork_child_keys=[child],
                    fork_num_computed_tokens=[self.computed[parent]],
                )
            )
            assert outcome.copy_block_ids == []
        shared = -(-self.computed[parent] // BLOCK_SIZE)
        self.tables[child] = self.tables[parent][:shared]
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        event(f"fork: partial tail {self.computed[parent] % BLOCK_SIZE != 0}")
        assert take_fork_copies(self.pool) == []

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        key = data.draw(st.sampled_from(sorted(self.tables)))
        if len(self.tokens[key]) >= MAX_LEN:
            self.pool.free(key, preempt=False)
            self._drop(key)
            return
        before = len(self.pool.request(key).block_hashes)
        self.tokens[key].append(token)
        self.pool.append_tokens(key, [token], b"".join(self._hashes(key)[before:]))
        computed, table = self.computed[key], self.tables[key]
        index = computed // BLOCK_SIZE
        shared_tail = computed % BLOCK_SIZE != 0 and self.refs()[table[index]] > 1
        refs_before = self.refs()
        if self.pool.allocate(key, 1, computed) is None:
            event("decode: does not fit")
            assert take_fork_copies(self.pool) == []
            assert self._real(key) == table
            self.pool.free(key, preempt=False)
            self._drop(key)
            return
        copies = take_fork_copies(self.pool)
        real = self._real(key)
        if shared_tail:
            event("decode: copy-on-write")
            ((source, destination),) = copies
            assert source == table[index]
            assert destination == real[index] != source
            assert refs_before.get(destination, 0) == 0
            self.promoted.pop(destination, None)
            self.tables[key] = [*table[:index], destination]
            self._adopt(key, index + 1)
            assert self.refs().get(source, 0) >= 1  # another holder keeps the original
        else:
            assert copies == []
            assert real[: len(table)] == table
            self._adopt(key, len(table))
        self.computed[key] = computed + 1
        self._promote(key)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.tables)))
        self.pool.free(key, preempt=preempt)
        self._drop(key)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.tables)))
        table = self._table(key)
        copies = self.pool.swap_out(key)
        expected = self.host_model.swap_out(str(key), table)
        assert copies == expected
        if copies is None:
            event("swap_out: no room")
            return
        shares = any(self.refs()[block_id] > 1 for block_id in self.tables[key])
        event(f"swap_out: shares blocks {shares}")
        self.expected_d2h.extend(copies)
        self._swap_done(key)

    def _swap_done(self, key: int) -> None:
        assert self.pool.request(key).status is RequestStatus.PREEMPTED
        assert self._real(key) == []  # holds no device block
        del self.tables[key]
        self.swapped.append(key)

    @precondition(lambda self: len(self.tables) >= 2)
    @rule(data=st.data())
    def swap_out_group(self, data: st.DataObject) -> None:
        keys = data.draw(
            st.lists(st.sampled_from(sorted(self.tables)), min_size=2, max_size=3, unique=True)
        )
        tables = {key: self._table(key) for key in keys}
        out = self.pool.swap_out_group(keys)
        expected = self.host_model.swap_out_group([(str(key), tables[key]) for key in keys])
        if expected is None:
            assert out is None
            event("swap_out_group: no room")
            return
        assert out is not None
        assert {str(key): copies for key, copies in out.items()} == expected
        shared = set(self.tables[keys[0]]).intersection(*(self.tables[k] for k in keys[1:]))
        event(f"swap_out_group: members share blocks {bool(shared)}")
        for key in keys:
            self.expected_d2h.extend(out[key])
            self._swap_done(key)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.swapped))
        num_swapped = self.host.swapped_tokens(str(key))
        assert num_swapped is not None
        request = self.pool.request(key)
        admission = self.pool.swap_in(key, request.num_tokens - num_swapped or 1)
        if admission is None:
            event("swap_in: does not fit")
            assert self._real(key) == []
            return
        event(f"swap_in: device hit {admission.num_device_hit_tokens > 0}")
        assert admission.num_device_hit_tokens + admission.num_host_hit_tokens == num_swapped
        first = admission.num_device_hit_tokens // BLOCK_SIZE
        self.swapped.remove(key)
        self._check_hit(key, first)
        self.tables[key] = []
        self._adopt(key, first)
        expected = self.host_model.swap_in(str(key), first, self.tables[key])
        assert admission.host_to_device == expected
        self.expected_h2d.extend(expected)
        # Every block from the swap on is the request's own: a later write copies nothing.
        refs = self.refs()
        assert all(refs[block_id] == 1 for block_id in self.tables[key][first:])
        request.num_computed_tokens = request.num_tokens
        self.computed[key] = request.num_tokens
        self._promote(key)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def finish_swapped(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.swapped))
        self.swapped.remove(key)
        self.pool.free(key, preempt=False)
        self.host_model.drop(str(key))
        del self.tokens[key]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def common(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.tables)), min_size=1, unique=True))
        (answer,) = pool_common_computed_block_ids(self.pool, keys)
        cached = [self.tables[k][: self.computed[k] // BLOCK_SIZE] for k in keys]
        expected: list[int] = []
        for column in zip(*cached, strict=False):
            if len(set(column)) != 1:
                break
            expected.append(column[0])
        assert answer == expected

    @rule()
    def take_copies(self) -> None:
        assert self.pool.take_host_copies() == (self.expected_d2h, self.expected_h2d)
        self.expected_d2h, self.expected_h2d = [], []

    @rule()
    def restore_from_a_snapshot(self) -> None:
        restored = decode_pool(encode_pool(self.pool), "p", self.pool.options)
        assert restored.state_fingerprint() == self.pool.state_fingerprint()
        self.pool = restored
        self._watch()

    # -------------------------------------------------------------------- invariants
    @invariant()
    def device_pool_keeps_its_invariants(self) -> None:
        assert list(pool_violations(self.pool)) == []

    @invariant()
    def device_tables_and_references_match_the_model(self) -> None:
        refs = self.refs()
        for key, table in self.tables.items():
            assert self._real(key) == table, f"request {key}"
        assert set(self.group.req_to_blocks) == {str(key) for key in self.tables}
        free_ids = {
            block.block_id
            for block in self.manager.block_pool.free_block_queue.get_all_free_blocks()
        }
        for block in self.manager.block_pool.blocks:
            if block.is_null:
                continue
            assert block.ref_cnt == refs.get(block.block_id, 0), f"block {block.block_id}"
            assert (block.block_id in free_ids) == (block.ref_cnt == 0)

    @invariant()
    def promotions_match_the_model(self) -> None:
        block_pool = self.manager.block_pool
        for block_id, block_hash in self.promoted.items():
            key = make_block_hash_with_group_id(block_hash, 0)
            assert block_pool.blocks[block_id].block_hash == key, f"block {block_id}"
        for block in block_pool.blocks:
            if block.block_hash is not None and not block.is_null:
                assert block.block_id in self.promoted, f"block {block.block_id} cached unseen"
        for key in self.tables:
            assert self.group.num_cached_block.get(str(key), 0) == self.computed[key] // BLOCK_SIZE

    @invariant()
    def sharing_of_partial_blocks_is_checked_for_copies(self) -> None:
        refs = self.refs()
        forked = self.manager.forked_requests()
        for key, table in self.tables.items():
            index = self.computed[key] // BLOCK_SIZE
            if self.computed[key] % BLOCK_SIZE and refs[table[index]] > 1:
                assert str(key) in forked, f"request {key} shares its partial block unseen"

    @invariant()
    def host_tier_matches_the_model(self) -> None:
        host: HostTier = self.host
        model = self.host_model
        assert host.keys() == model.hold
        assert host.recency() == model.order
        assert host.pinned() == model.pins
        assert host.private_blocks() == model.private
        assert sorted(host.swapped()) == sorted(str(key) for key in self.swapped)
        for owner, record in model.swapped.items():
            _, tables = host.swapped()[owner]
            assert list(tables[0]) == [host_id for host_id, _ in record]
        keyed = host.keys()
        assert len(keyed) + len(host.private_blocks()) + host.num_free == host.num_blocks

    @invariant()
    def a_request_is_on_one_tier(self) -> None:
        # Running requests hold device blocks and no swap record; swapped ones the reverse.
        assert not set(self.tables) & set(self.swapped)
        for key in self.swapped:
            assert self.host.swapped_tokens(str(key)) is not None
            assert self._real(key) == []


ForkSwapMachine.TestCase.settings = settings(
    settings.get_profile(os.environ.get("KVCM_PROPERTY_PROFILE", "kvcm-ci")),
    max_examples=int(os.environ.get("KVCM_FORK_SWAP_EXAMPLES", "100")),
)
TestForkSwap = ForkSwapMachine.TestCase
