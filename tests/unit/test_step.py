"""The Step interpreter (kvcm.core.step): atomicity, the new op kinds, and the fixed defects."""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.limits import Limits
from kvcm.core.manager import SlotOptions
from kvcm.core.pool import Pool, PoolConfig, PoolRegistry
from kvcm.core.program import (
    AllocOptions,
    HitSpec,
    ItemStatus,
    NewRequestSpec,
    OpKind,
    StepProgram,
)
from kvcm.core.snapshot import decode_pool, encode_pool

BLOCK = 16
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=64,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)


def _pool(limits: Limits | None = None) -> Pool:
    options = PoolConfig(max_model_len=512, explicit_layout=LAYOUT)
    return Pool("p", options) if limits is None else Pool("p", options, limits=limits)


def _spec(pool: Pool, key: int, prompt: list[int]) -> NewRequestSpec:
    hasher = BlockHasher(BLOCK, pool.hashing.algorithm, pool.hashing.seed)
    return NewRequestSpec(
        key=key,
        request_id=f"r{key}",
        prompt_token_ids=prompt,
        block_hashes=b"".join(hasher.hash_token_ids(prompt)),
    )


def _admit(pool: Pool, key: int, prompt: list[int], *, finish: bool = False) -> list[int]:
    """Add and allocate a request (cached blocks afterwards); its block ids."""
    ops = [OpKind.ADD_REQUEST, OpKind.ALLOCATE] + ([OpKind.FINISH] if finish else [])
    outcome = pool.run_step(
        StepProgram(
            ops=list(ops),
            request_keys=[key, key] if finish else [key],
            new_requests=[_spec(pool, key, prompt)],
            alloc_num_new_tokens=[len(prompt)],
            alloc_num_computed_tokens=[0],
        )
    )
    assert outcome.alloc_statuses == [ItemStatus.OK]
    return outcome.alloc_block_ids


def test_add_then_a_refused_op_leaves_no_request() -> None:
    pool = _pool()
    before = pool.state_fingerprint()
    with pytest.raises(InvalidArgumentError) as caught:
        pool.run_step(
            StepProgram(
                ops=[OpKind.ADD_REQUEST, OpKind.CACHE_BLOCKS],
                request_keys=[5],
                new_requests=[_spec(pool, 5, list(range(40)))],
                cache_num_computed_tokens=[41],
            )
        )
    assert caught.value.op_index == 1
    assert caught.value.field == "cache_num_computed_tokens[0]"
    assert 5 not in pool.requests
    assert pool.state_fingerprint() == before
    # And an op the core would refuse only at execution (caching a request holding no blocks).
    with pytest.raises(NotFoundError) as refused:
        pool.run_step(
            StepProgram(
                ops=[OpKind.ADD_REQUEST, OpKind.CACHE_BLOCKS],
                request_keys=[5],
                new_requests=[_spec(pool, 5, list(range(40)))],
                cache_num_computed_tokens=[16],
            )
        )
    assert refused.value.op_index == 1
    assert pool.state_fingerprint() == before


def _hit_program(key: int, hit: HitSpec) -> StepProgram:
    return StepProgram(
        ops=[OpKind.ALLOCATE],
        request_keys=[key],
        alloc_num_new_tokens=[8],
        alloc_num_computed_tokens=[0],
        alloc_options={0: AllocOptions(hit=hit)},
    )


def test_a_hit_of_another_prompt_or_a_repeated_block_is_refused() -> None:
    pool = _pool()
    other = _admit(pool, 1, [7] * 40, finish=True)  # 2 cached full blocks of another prompt
    pool.add_request(2, "r2", list(range(40)), _spec(pool, 2, list(range(40))).block_hashes)
    before = pool.state_fingerprint()
    for ids in ([other[0], other[1]], [other[0], other[0]]):
        with pytest.raises(FailedPreconditionError, match="look the request up again"):
            pool.run_step(_hit_program(2, HitSpec(num_tokens=32, block_ids=(ids,))))
        with pytest.raises(FailedPreconditionError):
            pool.allocate(2, 8, 0, hit=HitSpec(num_tokens=32, block_ids=(ids,)))
        assert pool.state_fingerprint() == before


def test_a_repeated_own_block_is_refused_and_a_true_hit_adopted() -> None:
    pool = _pool()
    prompt = list(range(40))
    own = _admit(pool, 1, prompt, finish=True)
    pool.add_request(2, "r2", prompt, _spec(pool, 2, prompt).block_hashes)
    before = pool.state_fingerprint()
    with pytest.raises(FailedPreconditionError):
        pool.allocate(2, 8, 0, hit=HitSpec(num_tokens=32, block_ids=([own[0], own[0]],)))
    assert pool.state_fingerprint() == before
    ids = pool.allocate(2, 8, 0, hit=HitSpec(num_tokens=32, block_ids=([own[0], own[1]],)))
    assert ids is not None
    assert pool.ready_manager().get_block_ids("2")[0][:2] == own[:2]


def test_external_tokens_beyond_the_request_are_refused_without_a_change() -> None:
    pool = _pool()
    prompt = list(range(40))
    own = _admit(pool, 1, prompt, finish=True)
    pool.add_request(2, "r2", prompt, _spec(pool, 2, prompt).block_hashes)
    before = pool.state_fingerprint()
    hit = HitSpec(num_tokens=32, block_ids=(own[:2],))
    with pytest.raises(InvalidArgumentError, match="num_external_computed_tokens") as caught:
        pool.allocate(2, 8, 0, hit=hit, options=SlotOptions(num_external_computed_tokens=2**32 - 1))
    assert caught.value.field is not None
    assert "num_external_computed_tokens" in caught.value.field
    assert pool.state_fingerprint() == before
    assert pool.get_computed_blocks(2, None).blocks.get_block_ids() == (own[:2],)


def test_a_live_request_without_blocks_has_empty_tables() -> None:
    pool = _pool()
    pool.add_request(3, "r3", [1, 2, 3], b"")
    assert pool.ready_manager().get_block_ids("3") == ([],)
    assert pool.ready_manager().get_blocks("3").blocks == ((),) or all(
        not group for group in pool.ready_manager().get_blocks("3").blocks
    )


def test_limits_are_checked_first() -> None:
    pool = _pool(Limits(max_step_ops=2, max_step_tokens=10))
    before = pool.state_fingerprint()
    with pytest.raises(ResourceExhaustedError, match="max_step_ops") as ops:
        pool.run_step(StepProgram(ops=[OpKind.NEW_STEP_STARTS] * 3))
    assert ops.value.field == "max_step_ops"
    with pytest.raises(ResourceExhaustedError, match="max_step_tokens"):
        pool.run_step(
            StepProgram(ops=[OpKind.ADD_REQUEST], new_requests=[_spec(pool, 1, list(range(11)))])
        )
    assert pool.state_fingerprint() == before
    registry = PoolRegistry(limits=Limits(max_pools=1))
    assert registry.max_pools == 1
    assert PoolRegistry(max_pools=3).max_pools == 3


def test_evict_and_reset_run_in_a_step() -> None:
    pool = _pool()
    own = _admit(pool, 1, list(range(40)), finish=True)
    manager = pool.ready_manager()
    cached = manager.block_pool.num_cached_blocks
    outcome = pool.run_step(
        StepProgram(
            ops=[OpKind.EVICT_BLOCKS, OpKind.RESET_PREFIX_CACHE],
            evict_num_block_ids=[1],
            evict_block_ids=[own[0]],
        )
    )
    assert outcome.num_ops_executed == 2
    assert outcome.reset == [True]
    assert cached > 0
    assert manager.block_pool.num_cached_blocks == 0
    with pytest.raises(InvalidArgumentError, match="evict_block_ids") as caught:
        pool.run_step(
            StepProgram(ops=[OpKind.EVICT_BLOCKS], evict_num_block_ids=[1], evict_block_ids=[0])
        )
    assert caught.value.field == "evict_block_ids[0]"


def test_step_seq_answers_the_remembered_outcome() -> None:
    pool = _pool()
    program = StepProgram(
        ops=[OpKind.ADD_REQUEST, OpKind.ALLOCATE],
        request_keys=[1],
        new_requests=[_spec(pool, 1, list(range(20)))],
        alloc_num_new_tokens=[20],
        alloc_num_computed_tokens=[0],
        step_seq=1,
    )
    first = pool.run_step(program)
    fingerprint = pool.state_fingerprint()
    assert pool.run_step(program) == first
    assert pool.state_fingerprint() == fingerprint
    with pytest.raises(FailedPreconditionError) as caught:
        pool.run_step(StepProgram(step_seq=5))
    assert caught.value.field == "step_seq"


def _late_hit_program(pool: Pool, hit: HitSpec, *, evict: list[int]) -> StepProgram:
    """Request 3 decodes (an ALLOCATE that may evict), EVICT_BLOCKS, request 2 adopts ``hit``."""
    return StepProgram(
        ops=[OpKind.ALLOCATE, OpKind.EVICT_BLOCKS, OpKind.ALLOCATE],
        request_keys=[3, 2],
        alloc_num_new_tokens=[1, 8],
        alloc_num_computed_tokens=[16, 0],
        alloc_options={1: AllocOptions(hit=hit)},
        evict_num_block_ids=[len(evict)],
        evict_block_ids=evict,
    )


def _late_hit_pool() -> tuple[Pool, list[int], list[int]]:
    pool = _pool()
    prompt = list(range(40))
    own = _admit(pool, 1, prompt, finish=True)  # the prompt's 2 full blocks, cached and free
    other = _admit(pool, 4, [9] * 40, finish=True)  # another prompt's, cached and free
    pool.add_request(2, "r2", prompt, _spec(pool, 2, prompt).block_hashes)
    _admit(pool, 3, [5] * 16)  # holds one full block; its next token needs a new block
    return pool, own, other


def test_a_hit_after_an_op_that_can_evict_is_checked_when_it_runs() -> None:
    """vLLM looks waiting requests up after allocating for running ones: such a hit adopts."""
    pool, own, _other = _late_hit_pool()
    outcome = pool.run_step(
        _late_hit_program(pool, HitSpec(num_tokens=32, block_ids=(own[:2],)), evict=[])
    )
    assert outcome.alloc_statuses == [ItemStatus.OK, ItemStatus.OK]
    assert outcome.num_ops_executed == 3
    assert pool.ready_manager().get_block_ids("2")[0][:2] == own[:2]


def test_a_hit_evicted_by_an_earlier_op_answers_hit_stale_and_stops_there() -> None:
    pool, own, _other = _late_hit_pool()
    # Unchanged by the stop: the decode and the eviction ran, request 2 holds nothing.
    outcome = pool.run_step(
        _late_hit_program(pool, HitSpec(num_tokens=32, block_ids=(own[:2],)), evict=[own[1]])
    )
    assert outcome.alloc_statuses == [ItemStatus.OK, ItemStatus.HIT_STALE]
    assert outcome.num_ops_executed == 3
    assert outcome.alloc_num_block_ids == [1, 0]
    manager = pool.ready_manager()
    assert not manager.holds_blocks("2")
    assert manager.holds_blocks("3")
    assert pool.requests[2].num_computed_tokens == 0


def test_a_foreign_late_hit_adopts_nothing() -> None:
    pool, _own, other = _late_hit_pool()
    free_before = pool.ready_manager().num_free_blocks
    outcome = pool.run_step(
        _late_hit_program(pool, HitSpec(num_tokens=32, block_ids=(other[:2],)), evict=[])
    )
    assert outcome.alloc_statuses == [ItemStatus.OK, ItemStatus.HIT_STALE]
    assert not pool.ready_manager().holds_blocks("2")
    assert pool.ready_manager().num_free_blocks == free_before - 1  # request 3's new block


def test_a_late_hit_of_the_wrong_shape_is_still_refused_before_anything_runs() -> None:
    pool, own, _other = _late_hit_pool()
    before = pool.state_fingerprint()
    with pytest.raises(InvalidArgumentError) as caught:
        pool.run_step(
            _late_hit_program(pool, HitSpec(num_tokens=32, block_ids=([own[0]],)), evict=[])
        )
    assert caught.value.field == "alloc_options[1].hit"
    assert pool.state_fingerprint() == before


def test_the_outcome_names_the_delayed_allocations_that_fit_and_keeps_them_out_of_state() -> None:
    """StepOutcome.delayed_keys: the keys whose ALLOCATE fit with delay_cache_blocks (the
    server tracks their transfers), in op order; fingerprints leave it out, a snapshot keeps it
    with the remembered answer (a Step retried after a restart gets it back)."""
    pool = _pool()
    prompts = {key: [key] * 300 for key in (3, 1, 2)}
    delayed = AllocOptions(slot_options=SlotOptions(delay_cache_blocks=True))
    program = StepProgram(
        ops=[OpKind.ADD_REQUEST] * 3 + [OpKind.ALLOCATE] * 4,
        request_keys=[3, 1, 2, 2],
        new_requests=[_spec(pool, key, prompt) for key, prompt in prompts.items()],
        alloc_num_new_tokens=[300, 300, 300, 200],
        alloc_num_computed_tokens=[0, 0, 0, 300],
        alloc_options={0: delayed, 2: delayed, 3: delayed},
        continue_on_does_not_fit=True,
        step_seq=1,
    )
    outcome = pool.run_step(program)
    assert outcome.alloc_statuses == [ItemStatus.OK] * 3 + [ItemStatus.DOES_NOT_FIT]
    assert outcome.delayed_keys == [3, 2]
    assert pool.run_step(program).delayed_keys == [3, 2]  # the remembered answer
    fingerprint = pool.state_fingerprint()
    snapshot = encode_pool(pool)
    restored = decode_pool(snapshot, pool.name, pool.options)
    assert restored.run_step(program).delayed_keys == [3, 2]
    outcome.delayed_keys.clear()
    assert pool.state_fingerprint() == fingerprint


# ------------------------------------------------------------------------ EXTEND_PROMPT
def _session(pool: Pool, key: int = 3) -> None:
    """A request of a 20-token prompt that then appended 14 tokens (a streaming session's
    kept outputs and next chunk)."""
    _admit(pool, key, list(range(1, 21)))
    pool.run_step(
        StepProgram(
            ops=[OpKind.APPEND_TOKENS],
            request_keys=[key],
            append_num_tokens=[14],
            append_token_ids=list(range(100, 114)),
            append_num_block_hashes=[1],
            append_block_hashes=b"".join(
                BlockHasher(BLOCK, pool.hashing.algorithm, pool.hashing.seed).hash_token_ids(
                    list(range(1, 21)) + list(range(100, 114))
                )[1:2]
            ),
        )
    )


def _append_then_extend(end: int) -> StepProgram:
    """Two more tokens for request 3, then its prompt end at ``end``."""
    return StepProgram(
        ops=[OpKind.APPEND_TOKENS, OpKind.EXTEND_PROMPT],
        request_keys=[3, 3],
        append_num_tokens=[2],
        append_token_ids=[7, 8],
        append_num_block_hashes=[0],
        extend_prompt_num_tokens=[end],
    )


def test_extend_prompt_moves_the_prompt_end_and_survives_a_snapshot() -> None:
    from kvcm.core.invariants import check_pool

    pool = _pool()
    _session(pool)
    before = pool.state_fingerprint()
    pool.run_step(
        StepProgram(
            ops=[OpKind.EXTEND_PROMPT, OpKind.EXTEND_PROMPT],
            request_keys=[3, 3],
            extend_prompt_num_tokens=[27, 34],  # two chunks in one (coalesced) program
        )
    )
    request = pool.requests[3]
    assert request.num_prompt_tokens == 34
    assert request.prompt_token_ids == list(range(1, 21)) + list(range(100, 114))
    assert request.num_output_tokens == 0
    assert pool.state_fingerprint() != before  # the prompt is state
    check_pool(pool)
    restored = decode_pool(encode_pool(pool), pool.name, pool.options)
    assert restored.requests[3].num_prompt_tokens == 34
    assert restored.state_fingerprint() == pool.state_fingerprint()
    # The same end again changes nothing (a step replayed after a snapshot that has it).
    after = pool.state_fingerprint()
    pool.run_step(
        StepProgram(ops=[OpKind.EXTEND_PROMPT], request_keys=[3], extend_prompt_num_tokens=[34])
    )
    assert pool.state_fingerprint() == after


@pytest.mark.parametrize(
    ("program", "error", "field", "op_index"),
    [
        # Beyond the request's tokens (34): its chunk must be appended first.
        (
            StepProgram(
                ops=[OpKind.EXTEND_PROMPT], request_keys=[3], extend_prompt_num_tokens=[35]
            ),
            InvalidArgumentError,
            "extend_prompt_num_tokens[0]",
            0,
        ),
        # Below the prompt's end (20): a prompt only grows.
        (
            StepProgram(
                ops=[OpKind.EXTEND_PROMPT], request_keys=[3], extend_prompt_num_tokens=[19]
            ),
            InvalidArgumentError,
            "extend_prompt_num_tokens[0]",
            0,
        ),
        # Below the end an earlier op of the same program gave it.
        (
            StepProgram(
                ops=[OpKind.EXTEND_PROMPT, OpKind.EXTEND_PROMPT],
                request_keys=[3, 3],
                extend_prompt_num_tokens=[30, 25],
            ),
            InvalidArgumentError,
            "extend_prompt_num_tokens[1]",
            1,
        ),
        # Beyond the tokens even though an earlier op of the program appended some: counted.
        (
            _append_then_extend(37),
            InvalidArgumentError,
            "extend_prompt_num_tokens[0]",
            1,
        ),
        (
            StepProgram(ops=[OpKind.EXTEND_PROMPT], request_keys=[3]),
            InvalidArgumentError,
            "extend_prompt_num_tokens",
            0,
        ),
        (
            StepProgram(ops=[OpKind.EXTEND_PROMPT], request_keys=[9], extend_prompt_num_tokens=[1]),
            NotFoundError,
            "request_keys[0]",
            0,
        ),
        # A value of another type (a program built past the type checker).
        (
            StepProgram(
                ops=[OpKind.EXTEND_PROMPT], request_keys=[3], extend_prompt_num_tokens=[True]
            ),
            InvalidArgumentError,
            "extend_prompt_num_tokens[0]",
            0,
        ),
    ],
    ids=[
        "past-tokens",
        "below-prompt",
        "below-earlier",
        "past-appended",
        "missing",
        "no-key",
        "not-int",
    ],
)
def test_a_refused_extend_prompt_names_its_entry_and_changes_nothing(
    program: StepProgram, error: type[Exception], field: str, op_index: int
) -> None:
    pool = _pool()
    _session(pool)
    before = pool.state_fingerprint()
    with pytest.raises(error) as caught:
        pool.run_step(program)
    assert getattr(caught.value, "field", None) == field
    assert getattr(caught.value, "op_index", None) == op_index
    assert pool.state_fingerprint() == before
    assert pool.requests[3].num_prompt_tokens == 20


def test_extend_prompt_within_the_appended_tokens_of_the_same_program() -> None:
    pool = _pool()
    _session(pool)
    pool.run_step(_append_then_extend(36))
    assert pool.requests[3].prompt_token_ids[-3:] == [113, 7, 8]
    assert pool.requests[3].num_prompt_tokens == 36
