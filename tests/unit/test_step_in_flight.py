"""A Step's ALLOCATE under async scheduling with speculative decoding: the computed count
includes the tokens still in flight (drafts not yet verified are no known tokens), so it may
run ahead of the request's tokens by at most ``num_in_flight_tokens``; beyond that the
program is refused naming the field, and nothing changes."""

from __future__ import annotations

import pytest
from test_step import _admit, _pool

from kvcm.common.errors import InvalidArgumentError
from kvcm.core.program import AllocOptions, ItemStatus, OpKind, StepProgram


def _allocate(computed: int, in_flight: int) -> StepProgram:
    return StepProgram(
        ops=[OpKind.ALLOCATE],
        request_keys=[1],
        alloc_num_new_tokens=[4],
        alloc_num_computed_tokens=[computed],
        alloc_options={0: AllocOptions(num_in_flight_tokens=in_flight)} if in_flight else {},
    )


def test_computed_tokens_may_run_ahead_by_the_tokens_in_flight_only() -> None:
    pool = _pool()
    _admit(pool, 1, list(range(40)))
    # 40 known tokens; a step of 1 + 3 drafts in flight: 43 computed, the next 4 scheduled.
    outcome = pool.run_step(_allocate(43, 4))
    assert outcome.alloc_statuses == [ItemStatus.OK]
    before = pool.state_fingerprint()
    for computed, in_flight, named in ((46, 4, "4 tokens in flight"), (41, 0, "40 tokens")):
        with pytest.raises(InvalidArgumentError, match=named) as caught:
            pool.run_step(_allocate(computed, in_flight))
        assert caught.value.field == "alloc_num_computed_tokens[0]"
        assert pool.state_fingerprint() == before
