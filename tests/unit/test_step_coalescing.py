"""Coalesced Steps: consecutive programs concatenated run as they run one by one.

The vLLM shipper sends every step queued while its last call was out as one program
(``kvcm.integrations.vllm._shipper.coalesce``) whose ``num_steps`` says which steps it
covers. Run on a pool, it must leave the same state and give the same answers as the steps
run one at a time; the step_seq guard counts its first step.
"""

from __future__ import annotations

import pytest

from kvcm.client import StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.fingerprint import state_fingerprint
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import ItemStatus, OpKind, StepProgram
from kvcm.integrations.vllm import RecordedStep
from kvcm.integrations.vllm._shipper import coalesce, outcomes_agree

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=512,
    hash_seed="coalesce",
    explicit_layout=KVCacheConfig(
        num_blocks=9,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)


def _programs(pool: Pool, count: int) -> list[StepProgram]:
    """Steps that admit, decode (a block fills every 16 tokens), preempt and finish; some
    allocations do not fit (the pool is small)."""
    hasher = pool.hashing.block_hasher()
    tokens: dict[int, list[int]] = {}
    programs = []
    for seq in range(1, count + 1):
        step = StepBuilder()
        step.continue_on_does_not_fit = True
        step.step_seq = seq
        step.new_step_starts()
        key = seq
        prompt = [seq % 7 + 1] * 40
        tokens[key] = list(prompt)
        step.add_request(key, prompt, hasher.hash_token_ids(prompt))
        step.allocate(key, 40, 0)
        for other in range(max(1, seq - 3), seq):
            if seq - other == 3:
                step.finish(other)
                continue
            tokens[other].append(seq)
            done = len(tokens[other]) - 1
            before = len(hasher.hash_token_ids(tokens[other][:-1]))
            step.append_tokens(other, [seq], hasher.hash_token_ids(tokens[other])[before:])
            step.allocate(other, 1, done)
        programs.append(step.build())
    return programs


def _steps(count: int) -> tuple[list[RecordedStep], Pool]:
    recorded = Pool("pool", CONFIG)
    steps = []
    for program in _programs(recorded, count):
        expected = recorded.run_step(program)
        steps.append(RecordedStep(program=program, expected=expected))
    return steps, recorded


def test_a_coalesced_step_runs_as_its_steps_one_by_one() -> None:
    steps, one_by_one = _steps(12)
    statuses = [status for step in steps for status in step.expected.alloc_statuses]
    assert ItemStatus.DOES_NOT_FIT in statuses  # the steps go on past one that does not fit
    assert ItemStatus.OK in statuses
    coalesced = Pool("pool", CONFIG)  # the same name: the fingerprints compare the state
    for chunk in (steps[0:1], steps[1:5], steps[5:12]):
        program, expected = (
            (chunk[0].program, chunk[0].expected) if len(chunk) == 1 else coalesce(chunk)
        )
        assert program.num_steps == len(chunk)
        assert program.step_seq == chunk[-1].program.step_seq
        outcome = coalesced.run_step(program)
        assert outcomes_agree(expected, outcome)
        # A repeat (a retry after a lost reply) answers the same and runs nothing.
        assert coalesced.run_step(program) is outcome
    assert coalesced.last_step_seq == one_by_one.last_step_seq == 12
    # Everything but the remembered outcome (the coalesced one covers its 7 steps) is equal:
    # blocks, free queue, prefix cache, requests, events, counters.
    coalesced.last_step_outcome = one_by_one.last_step_outcome = None
    assert state_fingerprint(coalesced) == state_fingerprint(one_by_one)


def test_the_guard_counts_a_coalesced_steps_first_step() -> None:
    steps, _ = _steps(6)
    pool = Pool("guarded", CONFIG)
    pool.run_step(steps[0].program)
    skipping, _ = coalesce(steps[2:5])  # steps 3-5 while the pool last applied 1
    with pytest.raises(FailedPreconditionError, match="steps 3-5"):
        pool.run_step(skipping)
    assert pool.last_step_seq == 1
    program, _ = coalesce(steps[1:5])
    pool.run_step(program)
    assert pool.last_step_seq == 5


@pytest.mark.parametrize(("num_steps", "step_seq"), [(0, 3), (4, 3), (2, None)])
def test_num_steps_needs_a_step_seq_that_covers_it(num_steps: int, step_seq: int | None) -> None:
    pool = Pool("bad", CONFIG)
    program = StepProgram(step_seq=step_seq, num_steps=num_steps)
    program.ops.append(int(OpKind.NEW_STEP_STARTS))
    with pytest.raises(InvalidArgumentError, match="num_steps") as caught:
        pool.run_step(program)
    assert caught.value.field == "num_steps"
    assert pool.last_step_seq == 0
