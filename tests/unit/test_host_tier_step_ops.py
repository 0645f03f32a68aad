"""SWAP_OUT, SWAP_IN and TAKE_HOST_COPIES: a Step answers what the core's direct calls do."""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCMError,
    ResourceExhaustedError,
)
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.op_table import OpWriter
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import ItemStatus, OpKind, StepOutcome, StepProgram
from kvcm.wire.step import outcome_from_proto, outcome_to_proto

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=16,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)


def _pool(host_blocks: int) -> Pool:
    config = PoolConfig(
        max_model_len=512,
        explicit_layout=LAYOUT,
        host_tier_bytes=host_blocks * SPEC.page_size_bytes,
    )
    return Pool("p", config)


def _run(pool: Pool, key: int, tokens: list[int]) -> None:
    hasher = BlockHasher(pool.hashing.hash_block_size, pool.hashing.algorithm, pool.hashing.seed)
    pool.add_request(key, f"r{key}", tokens, b"".join(hasher.hash_token_ids(tokens)))
    assert pool.allocate(key, len(tokens), 0) is not None
    pool.request(key).num_computed_tokens = len(tokens)


def _step(pool: Pool, *ops: tuple[int, ...]) -> StepOutcome:
    program = StepProgram()
    writer = OpWriter(program)
    for kind, *args in ops:
        writer.op[kind](*args)
    outcome = pool.run_step(writer.flush())
    # The wire carries every answer as it is.
    back = outcome_from_proto(outcome_to_proto(outcome))
    assert back.swap_out_swapped == outcome.swap_out_swapped
    assert back.host_alloc_block_ids == outcome.host_alloc_block_ids
    assert back.host_d2h_block_ids == outcome.host_d2h_block_ids
    assert back.host_h2d_block_ids == outcome.host_h2d_block_ids
    return outcome


def _flood(pool: Pool, key: int, base: int) -> None:
    _run(pool, key, [base + i for i in range(15 * 16)])
    pool.free(key, preempt=False)


def test_swap_out_and_in_through_step_match_the_direct_calls() -> None:
    direct, stepped = _pool(8), _pool(8)
    for pool in (direct, stepped):
        _run(pool, 1, list(range(40)))
        pool.take_host_copies()
    out = direct.swap_out(1)
    assert out is not None
    outcome = _step(stepped, (OpKind.SWAP_OUT, 1, 40), (OpKind.TAKE_HOST_COPIES,))
    assert outcome.swap_out_swapped == [True]
    assert outcome.host_num_d2h == [3]
    assert outcome.host_num_h2d == [0]
    pairs = outcome.host_d2h_block_ids
    assert list(zip(pairs[::2], pairs[1::2], strict=True)) == out == direct.take_host_copies()[0]
    assert stepped.state_fingerprint() == direct.state_fingerprint()
    # The device loses the cached blocks: the swap-in copies every block back.
    for pool in (direct, stepped):
        _flood(pool, 2, 5000)
    admission = direct.swap_in(1, 1)
    assert admission is not None
    d2h, h2d = direct.take_host_copies()
    outcome = _step(stepped, (OpKind.SWAP_IN, 1, 1), (OpKind.TAKE_HOST_COPIES,))
    assert outcome.host_alloc_statuses == [int(ItemStatus.OK)]
    assert outcome.host_alloc_num_device_hit_tokens == [admission.num_device_hit_tokens]
    assert outcome.host_alloc_num_host_hit_tokens == [admission.num_host_hit_tokens] == [40]
    assert (
        outcome.host_alloc_block_ids
        == direct.ready_manager().get_block_ids(direct.request(1).request_id)[0]
    )
    assert outcome.host_num_h2d == [3]
    h = outcome.host_h2d_block_ids
    assert list(zip(h[::2], h[1::2], strict=True)) == admission.host_to_device == h2d
    d = outcome.host_d2h_block_ids
    assert list(zip(d[::2], d[1::2], strict=True)) == d2h
    assert stepped.state_fingerprint() == direct.state_fingerprint()


def _add(pool: Pool, key: int, tokens: list[int]) -> None:
    hasher = BlockHasher(pool.hashing.hash_block_size, pool.hashing.algorithm, pool.hashing.seed)
    pool.add_request(key, f"r{key}", tokens, b"".join(hasher.hash_token_ids(tokens)))


def test_a_demoted_prefix_is_admitted_with_host_hits_as_the_direct_call() -> None:
    direct, stepped = _pool(8), _pool(8)
    prompt = list(range(64))  # four blocks
    for pool in (direct, stepped):
        _run(pool, 1, prompt)
        pool.free(1, preempt=False)
        _flood(pool, 2, 5000)  # the device evicts the prompt's blocks: they demote
        _add(pool, 3, [*prompt, 7, 8, 9])
    assert direct.lookup_tiers(3)[1] == 64
    admission = direct.admit_with_host(3, 3)
    assert admission is not None
    d2h, h2d = direct.take_host_copies()
    assert len(d2h) >= 4  # the demotions
    # An upper bound larger than what is left is capped, as a lookup ALLOCATE's.
    outcome = _step(stepped, (OpKind.ADMIT_WITH_HOST, 3, 500), (OpKind.TAKE_HOST_COPIES,))
    assert outcome.host_alloc_statuses == [int(ItemStatus.OK)]
    assert outcome.host_alloc_num_device_hit_tokens == [admission.num_device_hit_tokens] == [0]
    assert outcome.host_alloc_num_host_hit_tokens == [admission.num_host_hit_tokens] == [64]
    held = direct.ready_manager().get_block_ids(direct.request(3).request_id)
    assert outcome.host_alloc_block_ids == held[0]
    h = outcome.host_h2d_block_ids
    assert list(zip(h[::2], h[1::2], strict=True)) == admission.host_to_device == h2d
    d = outcome.host_d2h_block_ids
    assert list(zip(d[::2], d[1::2], strict=True)) == d2h
    assert stepped.request(3).num_computed_tokens == direct.request(3).num_computed_tokens == 64
    assert stepped.state_fingerprint() == direct.state_fingerprint()
    # A running request cannot be admitted again; a bad bound names its column.
    error = _refused(stepped, (OpKind.ADMIT_WITH_HOST, 3, 1))
    assert error.field == "request_keys[0]"
    _add(stepped, 4, [1, 2, 3])
    error = _refused(stepped, (OpKind.ADMIT_WITH_HOST, 4, 0))
    assert error.field == "admit_host_num_new_tokens[0]"


def test_a_full_tier_preempts_by_recomputation() -> None:
    direct, stepped = _pool(1), _pool(1)
    for pool in (direct, stepped):
        _run(pool, 1, list(range(40)))
    assert direct.swap_out(1) is None
    direct.free(1, preempt=True)
    outcome = _step(stepped, (OpKind.SWAP_OUT, 1, 40))
    assert outcome.swap_out_swapped == [False]
    assert stepped.state_fingerprint() == direct.state_fingerprint()


def _refused(pool: Pool, *ops: tuple[int, ...]) -> KVCMError:
    before = pool.state_fingerprint()
    with pytest.raises(KVCMError) as info:
        _step(pool, *ops)
    assert pool.state_fingerprint() == before
    return info.value


def test_bad_swaps_are_refused_naming_the_field_and_change_nothing() -> None:
    plain = Pool("q", PoolConfig(max_model_len=512, explicit_layout=LAYOUT))
    _run(plain, 1, list(range(40)))
    for op in (
        (OpKind.SWAP_OUT, 1, 40),
        (OpKind.SWAP_IN, 1, 0),
        (OpKind.TAKE_HOST_COPIES,),
        (OpKind.ADMIT_WITH_HOST, 1, 1),
    ):
        error = _refused(plain, op)
        assert isinstance(error, FailedPreconditionError)
        assert error.field == "config.host_tier_bytes"
        assert "host_tier_bytes" in str(error)
    pool = _pool(8)
    _run(pool, 1, list(range(40)))
    error = _refused(pool, (OpKind.SWAP_IN, 1, 1))  # running, not swapped
    assert isinstance(error, FailedPreconditionError)
    assert error.field == "request_keys[0]"
    error = _refused(pool, (OpKind.SWAP_OUT, 1, 41))
    assert isinstance(error, InvalidArgumentError)
    assert error.field == "swap_out_num_computed_tokens[0]"
    # Swapped out and in within one Step: refused (swap in a later Step).
    error = _refused(pool, (OpKind.SWAP_OUT, 1, 40), (OpKind.SWAP_IN, 1, 1))
    assert error.field == "request_keys[1]"
    # Twice in one Step: the second names its key.
    error = _refused(pool, (OpKind.SWAP_OUT, 1, 40), (OpKind.SWAP_OUT, 1, 40))
    assert error.field == "request_keys[1]"
    assert _step(pool, (OpKind.SWAP_OUT, 1, 40)).swap_out_swapped == [True]
    error = _refused(pool, (OpKind.SWAP_IN, 1, 1000))
    assert isinstance(error, InvalidArgumentError)
    assert error.field == "swap_in_num_new_tokens[0]"
    error = _refused(pool, (OpKind.SWAP_IN, 1, 1), (OpKind.SWAP_IN, 1, 1))
    assert error.field == "request_keys[1]"
    error = _refused(pool, (OpKind.SWAP_IN, 7, 1))
    assert error.field == "request_keys[0]"
    # A swapped request is swapped in, not allocated for (nor admitted afresh), until finished.
    error = _refused(pool, (OpKind.ALLOCATE, 1, 16, 0))
    assert isinstance(error, FailedPreconditionError)
    assert error.field == "request_keys[0]"
    error = _refused(pool, (OpKind.ADMIT_WITH_HOST, 1, 16))
    assert error.field == "request_keys[0]"
    error = _refused(
        pool, (OpKind.SWAP_IN, 1, 1), (OpKind.SWAP_OUT, 1, 40), (OpKind.ALLOCATE, 1, 1, 0)
    )
    assert error.field == "request_keys[1]"  # swapped in, then out: a later Step
    program = StepProgram(ops=[OpKind.SWAP_IN], request_keys=[1])
    before = pool.state_fingerprint()
    with pytest.raises(InvalidArgumentError) as info:
        pool.run_step(program)
    assert info.value.field == "swap_in_num_new_tokens"
    assert pool.state_fingerprint() == before
    host = pool.host_tier
    assert host is not None
    assert host.swapped_tokens(pool.request(1).request_id) == 40
    outcome = _step(pool, (OpKind.FINISH, 1), (OpKind.TAKE_HOST_COPIES,))
    assert outcome.num_ops_executed == 2
    assert host.swapped() == {}


def test_a_client_that_never_drains_is_refused_until_it_does() -> None:
    """Undrained copies are bounded: past twice the two tiers' blocks a Step without
    TAKE_HOST_COPIES is refused (naming ``ops``, changing nothing); one that drains runs."""
    pool = _pool(8)  # 8 host blocks, 16 device blocks: the limit is 48 pending copies
    base = 0
    while pool.host_tier is not None and pool.host_tier.num_pending_copies <= 48:
        _flood(pool, 100 + base, 10_000 * (base + 1))  # each flood demotes the last one's
        base += 1
    error = _refused(pool, (OpKind.NEW_STEP_STARTS,))
    assert isinstance(error, ResourceExhaustedError)
    assert error.field == "ops"
    assert "TAKE_HOST_COPIES" in str(error)
    outcome = _step(pool, (OpKind.NEW_STEP_STARTS,), (OpKind.TAKE_HOST_COPIES,))
    assert len(outcome.host_d2h_block_ids) // 2 > 48
    assert pool.host_tier is not None
    assert pool.host_tier.num_pending_copies == 0
    _step(pool, (OpKind.NEW_STEP_STARTS,))  # drained: accepted again
