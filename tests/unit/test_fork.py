"""Fork and copy-on-write on a real pool: the cases the property machine reaches rarely."""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec, SlidingWindowSpec
from kvcm.core.fork import fork_request, pool_common_computed_block_ids, take_fork_copies
from kvcm.core.invariants import pool_violations
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import NewRequestSpec, OpKind, StepProgram
from kvcm.core.snapshot import decode_pool, encode_pool

BS = 4
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16)


def _pool(num_blocks: int, *specs: object) -> Pool:
    groups = tuple(
        KVCacheGroupSpec(layer_names=(f"l{i}",), kv_cache_spec=spec)  # type: ignore[arg-type]
        for i, spec in enumerate(specs or (FULL,))
    )
    layout = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=(), kv_cache_groups=groups)
    return Pool("p", PoolConfig(max_model_len=64, explicit_layout=layout))


def _admit(pool: Pool, key: int, tokens: list[int]) -> list[int]:
    hasher = BlockHasher(BS, pool.hashing.algorithm, pool.hashing.seed)
    pool.add_request(key, f"r{key}", tokens, b"".join(hasher.hash_token_ids(tokens)))
    ids = pool.allocate(key, len(tokens), 0)
    assert ids is not None
    return ids[0]


def _table(pool: Pool, key: int) -> list[int]:
    assert pool.manager is not None
    return pool.manager.get_block_ids(str(key))[0]


def test_child_shares_the_partial_block_and_the_first_writer_copies() -> None:
    pool = _pool(8)
    parent = _admit(pool, 1, [1, 2, 3, 4, 5, 6])  # one full block, one partial
    child = fork_request(pool, 1, 2, "child", 6)
    assert child.num_computed_tokens == 6
    assert _table(pool, 2) == parent
    assert take_fork_copies(pool) == []
    assert pool.manager is not None
    blocks = pool.manager.block_pool.blocks
    assert [blocks[i].ref_cnt for i in parent] == [2, 2]
    # The child writes first: it gets the copy, the parent keeps the original.
    pool.append_tokens(2, [9], b"")
    assert pool.allocate(2, 1, 6) == ([],)
    (copy,) = take_fork_copies(pool)
    assert copy[0] == parent[1]
    assert _table(pool, 2) == [parent[0], copy[1]]
    assert [blocks[i].ref_cnt for i in parent] == [2, 1]
    # The parent's next write is into a block no one else holds now: no copy.
    pool.append_tokens(1, [7], b"")
    assert pool.allocate(1, 1, 6) == ([],)
    assert take_fork_copies(pool) == []
    assert _table(pool, 1) == parent
    # Common computed blocks: the cached full block both hold.
    assert pool_common_computed_block_ids(pool, [1, 2]) == ([parent[0]],)
    # Freeing the child releases only its references.
    pool.free(2, preempt=False)
    assert [blocks[i].ref_cnt for i in parent] == [1, 1]
    assert list(pool_violations(pool)) == []


def test_a_copy_that_does_not_fit_changes_nothing() -> None:
    pool = _pool(4)  # the null block, two for the parent, one left
    parent = _admit(pool, 1, [1, 2, 3, 4, 5, 6])
    fork_request(pool, 1, 2, "child", 6)
    _admit(pool, 3, [8, 8])  # the last free block
    before = pool.state_fingerprint()
    pool.append_tokens(2, [9], b"")
    fingerprint_after_append = pool.state_fingerprint()
    assert before != fingerprint_after_append  # the token was appended
    assert pool.allocate(2, 1, 6) is None
    assert take_fork_copies(pool) == []
    assert _table(pool, 2) == parent
    assert list(pool_violations(pool)) == []


def test_fork_refusals_name_the_cause_and_change_nothing() -> None:
    pool = _pool(8)
    _admit(pool, 1, [1, 2, 3, 4, 5])
    before = pool.state_fingerprint()
    with pytest.raises(InvalidArgumentError, match="num_computed_tokens"):
        fork_request(pool, 1, 2, "child", 6)
    with pytest.raises(AlreadyExistsError):
        fork_request(pool, 1, 1, "child", 5)
    assert pool.state_fingerprint() == before
    window = SlidingWindowSpec(
        block_size=BS, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16, sliding_window=8
    )
    hybrid = _pool(8, FULL, window)
    _admit(hybrid, 1, [1, 2, 3, 4, 5])
    with pytest.raises(FailedPreconditionError, match="full attention"):
        fork_request(hybrid, 1, 2, "child", 5)
    assert 2 not in hybrid.requests


def test_a_restored_pool_keeps_the_sharing_and_copies_on_write() -> None:
    pool = _pool(8)
    parent = _admit(pool, 1, [1, 2, 3, 4, 5, 6])
    fork_request(pool, 1, 2, "child", 6)
    options = PoolConfig(max_model_len=64, explicit_layout=pool.options.explicit_layout)
    restored = decode_pool(encode_pool(pool), "p", options)
    assert restored.state_fingerprint() == pool.state_fingerprint()
    assert list(pool_violations(restored)) == []
    assert restored.request_ids[2] == "child"
    for each in (pool, restored):
        each.append_tokens(2, [9], b"")
        assert each.allocate(2, 1, 6) == ([],)
        (copy,) = take_fork_copies(each)
        assert copy[0] == parent[1]
        assert _table(each, 1) == parent
    assert restored.state_fingerprint() == pool.state_fingerprint()


def _prefill_and_fork(
    pool: Pool, tokens: list[int], counts: list[int], *, go_on: bool = False, options: bool = False
) -> StepProgram:
    # One Step: a prompt added and allocated, then forked (parallel samples admitted at once).
    from kvcm.core.op_table import OpWriter
    from kvcm.core.program import AllocOptions

    hasher = BlockHasher(BS, pool.hashing.algorithm, pool.hashing.seed)
    program = StepProgram(continue_on_does_not_fit=go_on)
    writer = OpWriter(program)
    writer.op[OpKind.ADD_REQUEST](
        NewRequestSpec(
            key=1,
            request_id="prompt",
            prompt_token_ids=tokens,
            block_hashes=b"".join(hasher.hash_token_ids(tokens)),
        )
    )
    writer.op[OpKind.ALLOCATE](1, len(tokens), 0)
    if options:
        program.alloc_options[0] = AllocOptions(num_in_flight_tokens=1)
    for child, count in enumerate(counts, start=2):
        writer.op[OpKind.FORK](1, child, count)
    return writer.flush()


def test_a_prompt_allocated_and_forked_in_one_step_equals_two_steps() -> None:
    """FORK after an ALLOCATE of the parent in the same program (parallel samples admitted in
    one Step) shares the blocks the ALLOCATE gave, as a FORK in the next Step does."""
    tokens = [1, 2, 3, 4, 5, 6]
    one, two = _pool(8), _pool(8)
    outcome = one.run_step(_prefill_and_fork(one, tokens, [6, 6]))
    assert outcome.num_ops_executed == 4
    two.run_step(_prefill_and_fork(two, tokens, []))
    for child in (2, 3):
        fork_request(two, 1, child, "prompt", 6)
    assert one.state_fingerprint() == two.state_fingerprint()
    assert _table(one, 2) == _table(one, 3) == _table(one, 1)
    assert list(pool_violations(one)) == []


def test_fork_after_an_allocation_in_the_step_is_refused_where_its_slots_are_not_exact() -> None:
    tokens = [1, 2, 3, 4, 5, 6]
    for kwargs, field, error in (
        # Runs on after does-not-fit: the FORK could follow an ALLOCATE that did not fit.
        ({"go_on": True}, "request_keys[1]", FailedPreconditionError),
        # An ALLOCATE with options (here an in-flight count) is not a plain one.
        ({"options": True}, "request_keys[1]", FailedPreconditionError),
    ):
        pool = _pool(8)
        before = pool.state_fingerprint()
        with pytest.raises(error) as info:
            pool.run_step(_prefill_and_fork(pool, tokens, [6], **kwargs))  # type: ignore[arg-type]
        assert info.value.field == field
        assert pool.state_fingerprint() == before
    # Beyond the tokens the ALLOCATE gave slots for (6 tokens, 2 blocks of 4: 8 slots, but the
    # request has 6 tokens).
    pool = _pool(8)
    with pytest.raises(InvalidArgumentError) as bad:
        pool.run_step(_prefill_and_fork(pool, tokens, [7]))
    assert bad.value.field == "fork_num_computed_tokens[0]"
