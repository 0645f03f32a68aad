"""KVCMError's location: the bare message, the op it belongs to and the field path as parts.

A Step op's error renders ``ops[i] KIND: message``; the same rule as a unary call reports the
bare message; a role's lookup error names the role's field. Checked on the real core: a real
pool rejecting a real program, and a real P/D query naming an unknown pool.
"""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError, KVCMError, NotFoundError
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.lookup import LookupQuery
from kvcm.core.pd_route import PdRouteQuery, PdScope, by_role
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import OpKind, StepProgram

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=256,
    explicit_layout=KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)


def _pool() -> Pool:
    pool = Pool("p", CONFIG)
    pool.add_request(1, "r1", list(range(40)), b"")
    return pool


def test_an_ops_error_is_located_and_a_unary_call_reports_it_bare() -> None:
    pool = _pool()
    program = StepProgram(
        ops=[OpKind.NEW_STEP_STARTS, OpKind.ALLOCATE],
        request_keys=[1],
        alloc_num_new_tokens=[-1],
        alloc_num_computed_tokens=[0],
    )
    with pytest.raises(InvalidArgumentError) as step:
        pool.run_step(program)
    error = step.value
    assert (error.op_index, error.op_name) == (1, "ALLOCATE")
    assert error.path == ("alloc_num_new_tokens[0]",)
    assert str(error) == f"ops[1] ALLOCATE: {error.message}"
    assert not error.message.startswith("ops[")
    with pytest.raises(InvalidArgumentError) as unary:
        pool.allocate(1, -1, 0)
    assert str(unary.value) == error.message  # the same rule, without the op location
    assert unary.value.field == "alloc_num_new_tokens[0]"
    assert (unary.value.op_index, unary.value.op_name) == (None, None)


def test_at_op_and_unlocated_keep_class_message_and_field() -> None:
    bare = NotFoundError("request key 7 not found", field=("request_keys[2]",))
    located = bare.at_op(4, "FINISH", "request_keys[2]")
    assert type(located) is NotFoundError
    assert str(located) == "ops[4] FINISH: request key 7 not found"
    assert located.op_index == 4
    back = located.unlocated()
    assert (str(back), back.field, back.op_index) == (str(bare), "request_keys[2]", None)


def test_field_paths_are_parts_and_join_back_exactly() -> None:
    error = KVCMError("x", field="alloc_options[5].hit")
    assert error.path == ("alloc_options[5]", "hit")
    assert error.field == "alloc_options[5].hit"
    assert KVCMError("x", field=("a", "b[1]")).field == "a.b[1]"
    assert KVCMError("x").path is None
    assert KVCMError("x", field="").field == ""


def test_a_roles_lookup_error_names_the_roles_field() -> None:
    error = NotFoundError("scope.pool_ids[1]: pool 'gone' not found", field="scope.pool_ids[1]")
    renamed = by_role(error, "decode_scope")
    assert type(renamed) is NotFoundError
    assert str(renamed) == "decode_scope.pool_ids[1]: pool 'gone' not found"
    assert renamed.path == ("decode_scope", "pool_ids[1]")
    # Only the field's leading name is renamed, not a quoted pool id that looks like one.
    odd = InvalidArgumentError("scope.labels: key 'scope.x' is bad", field="scope.labels")
    assert str(by_role(odd, "prefill_scope")) == "prefill_scope.labels: key 'scope.x' is bad"
    assert by_role(InvalidArgumentError("no field"), "prefill_scope").field == ""


def test_a_pd_query_names_the_roles_field_of_a_bad_pool_id() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        PdRouteQuery(
            prompt=LookupQuery(block_hashes=b"\0" * 32),
            prefill=PdScope(pool_ids=("ok",)),
            decode=PdScope(pool_ids=("ok", "")),
        )
    assert caught.value.path is not None
    assert caught.value.path[0] == "decode_scope"
    assert str(caught.value).startswith("decode_scope.pool_ids[1]")
