"""Fork, copy-on-write, promotion and free on a real pool against a reference model.

The model is the V0 prefix-caching allocator's sharing contract written the plain way: each
request's block table as a list of block ids, reference counts derived from the tables, the
hash each full block was promoted with. It cannot know which free block the pool hands out, so
it takes each new block id from the pool and checks it was free; everything else it predicts:

* a fork (a core call or a Step program's FORK op) shares the parent's computed blocks (the
  partial last one included), nothing copied;
* a decode into a partial last block that another request still holds gives the writer a new
  block in its place and answers the copy (that block's id -> the new one); a decode into a
  private or full block copies nothing;
* a block that fills is promoted: cached under the request's hash of that block;
* a free (finish or preemption) drops only the freed request's references;
* the common computed blocks of a group are the leading cached blocks all of them hold.

After every step: the pool's own invariants (``pool_violations``), every block's ``ref_cnt``
equals the model's count and no referenced block is in the free queue, every request's table is
the model's, every request that shares its partial block is one the manager checks for
copies, every request's cached blocks hold its hashes and are in the prefix cache under
them, every copy answered is well formed (source and destination differ, the destination was
free and is now the writer's, the source is still held by another request).
"""

from __future__ import annotations

import os

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher, make_block_hash_with_group_id
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.fork import fork_request, pool_common_computed_block_ids, take_fork_copies
from kvcm.core.invariants import pool_violations
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import OpKind, StepProgram

BLOCK_SIZE = 2
NUM_BLOCKS = 12
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=NUM_BLOCKS,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)
MAX_LEN = 24
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=7)


class ForkCowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool("p", PoolConfig(max_model_len=MAX_LEN, explicit_layout=LAYOUT))
        manager = self.pool.manager
        assert manager is not None
        self.manager = manager
        self.group = manager.coordinator.single_type_managers[0]
        self.hasher = BlockHasher(BLOCK_SIZE, self.pool.hashing.algorithm, self.pool.hashing.seed)
        self.next_key = 1
        self.tables: dict[int, list[int]] = {}  # the model: key -> block ids
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.promoted: dict[int, bytes] = {}  # block id -> hash it was cached with (model)

    # ---------------------------------------------------------------------- model helpers
    def refs(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for table in self.tables.values():
            for block_id in table:
                counts[block_id] = counts.get(block_id, 0) + 1
        return counts

    def _hashes(self, key: int) -> list[bytes]:
        return list(self.hasher.hash_token_ids(self.tokens[key]))

    def _promote(self, key: int) -> None:
        # Every full computed block of the request is cached under its hash.
        hashes = self._hashes(key)
        for index in range(self.computed[key] // BLOCK_SIZE):
            self.promoted[self.tables[key][index]] = hashes[index]

    def _take_new(self, key: int, real: list[int], start: int) -> None:
        refs = self.refs()
        for block_id in real[start:]:
            assert refs.get(block_id, 0) == 0, f"block {block_id} handed out while referenced"
            self.promoted.pop(block_id, None)
        self.tables[key] = list(real)

    def _real(self, key: int) -> list[int]:
        return [block.block_id for block in self.group.req_to_blocks.get(str(key), [])]

    def _finish(self, key: int) -> None:
        self.pool.free(key, preempt=False)
        del self.tables[key], self.tokens[key], self.computed[key]

    # ------------------------------------------------------------------------- rules
    @rule(tokens=TOKENS)
    def admit(self, tokens: list[int]) -> None:
        key = self.next_key
        self.next_key += 1
        self.pool.add_request(key, f"r{key}", tokens, b"".join(self.hasher.hash_token_ids(tokens)))
        if self.pool.allocate(key, len(tokens), 0) is None:
            event("admit: does not fit")
            self.pool.free(key, preempt=False)
            return
        self.tokens[key], self.computed[key] = list(tokens), len(tokens)
        self._take_new(key, self._real(key), 0)
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
        else:  # the same through a Step program's FORK op
            outcome = self.pool.run_step(
                StepProgram(
                    ops=[OpKind.FORK],
                    request_keys=[parent],
                    fork_child_keys=[child],
                    fork_num_computed_tokens=[self.computed[parent]],
                )
            )
            assert outcome.num_ops_executed == 1
            assert outcome.copy_block_ids == []
            assert self.pool.request_ids[child] == self.pool.request_ids[parent]
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
            self._finish(key)
            return
        before_hashes = len(self.pool.request(key).block_hashes)
        self.tokens[key].append(token)
        new_hashes = self._hashes(key)[before_hashes:]
        self.pool.append_tokens(key, [token], b"".join(new_hashes))
        computed = self.computed[key]
        table = self.tables[key]
        index = computed // BLOCK_SIZE
        shared_tail = computed % BLOCK_SIZE != 0 and self.refs()[table[index]] > 1
        refs_before = self.refs()
        if self.pool.allocate(key, 1, computed) is None:
            event("decode: does not fit")
            assert take_fork_copies(self.pool) == []
            assert self._real(key) == table, "a decode that did not fit changed the table"
            self._finish(key)
            return
        real = self._real(key)
        copies = take_fork_copies(self.pool)
        if shared_tail:
            event("decode: copy-on-write")
            assert len(copies) == 1
            source, destination = copies[0]
            assert source == table[index]
            assert destination == real[index] != source
            assert refs_before.get(destination, 0) == 0, "copied into a referenced block"
            assert real[:index] == table[:index]
            self.promoted.pop(destination, None)
            self.tables[key] = [*table[:index], destination]
            self._take_new(key, real, index + 1)
            # The source is still held by another request.
            assert self.refs().get(source, 0) >= 1
        else:
            assert copies == [], "a write into a private or new block copied"
            assert real[: len(table)] == table
            self._take_new(key, real, len(table))
        self.computed[key] = computed + 1
        self._promote(key)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(data.draw(st.sampled_from(sorted(self.tables))))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        # A preempted sample drops its references and holds nothing (it is not resumed here).
        key = data.draw(st.sampled_from(sorted(self.tables)))
        self.pool.free(key, preempt=True)
        del self.tables[key], self.tokens[key], self.computed[key]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def common(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.tables)), min_size=1, unique=True))
        (answer,) = pool_common_computed_block_ids(self.pool, keys)
        cached = [self.tables[k][: self.group.num_cached_block.get(str(k), 0)] for k in keys]
        expected: list[int] = []
        for column in zip(*cached, strict=False):
            if len(set(column)) != 1:
                break
            expected.append(column[0])
        assert answer == expected
        # The model's own view: the leading blocks all hold, each promoted.
        for block_id in answer:
            assert block_id in self.promoted

    # ---------------------------------------------------------------------- invariants
    @invariant()
    def pool_keeps_its_invariants(self) -> None:
        assert list(pool_violations(self.pool)) == []

    @invariant()
    def tables_and_ref_counts_match_the_model(self) -> None:
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
            assert (block.block_id in free_ids) == (block.ref_cnt == 0), "freed while held"

    @invariant()
    def every_request_sharing_a_partial_block_is_checked_for_copies(self) -> None:
        # The manager checks copy-on-write only for the requests it knows may share one.
        refs = self.refs()
        forked = self.manager.forked_requests()
        for key, table in self.tables.items():
            index = self.computed[key] // BLOCK_SIZE
            if self.computed[key] % BLOCK_SIZE and refs[table[index]] > 1:
                assert str(key) in forked, f"request {key} shares its partial block unseen"

    @invariant()
    def prefix_cache_matches_the_model(self) -> None:
        block_pool = self.manager.block_pool
        for block_id, block_hash in self.promoted.items():
            block = block_pool.blocks[block_id]
            key = make_block_hash_with_group_id(block_hash, 0)
            assert block.block_hash == key, f"block {block_id} lost its promotion"
            assert block_pool.get_cached_block(block_hash, [0]) is not None
        for block in block_pool.blocks:
            if block.block_hash is not None and not block.is_null:
                assert block.block_id in self.promoted, f"block {block.block_id} cached unseen"
        for key in self.tables:
            assert self.group.num_cached_block.get(str(key), 0) == self.computed[key] // BLOCK_SIZE


ForkCowMachine.TestCase.settings = settings(
    settings.get_profile(os.environ.get("KVCM_PROPERTY_PROFILE", "kvcm-ci")),
    max_examples=int(os.environ.get("KVCM_FORK_EXAMPLES", "100")),
)
TestForkCow = ForkCowMachine.TestCase
