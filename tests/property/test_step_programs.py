"""Random Step programs on a Pool: a rejected one changes nothing, an accepted one equals the
same ops run one by one through the unary calls.

Two pools live side by side from identical histories: ``stepped`` runs each program through
the interpreter, ``unary`` replays an accepted program op by op through Pool's unary methods
(stopping where the Step stopped, at the first allocation that does not fit). Programs draw
keys from a tiny space, so unknown keys, finished keys, counts beyond a request's tokens and
malformed columns come up often.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import KVCMError
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.invariants import pool_violations
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import ItemStatus, NewRequestSpec, OpKind, StepProgram

BLOCK = 16
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
OPTIONS = PoolConfig(
    max_model_len=128,
    hash_seed="kvcm-property",
    explicit_layout=KVCacheConfig(
        num_blocks=12,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)
PROFILE = settings.get_profile(os.environ.get("KVCM_PROPERTY_PROFILE", "kvcm-ci"))

keys = st.integers(0, 3)
ops = st.one_of(
    st.tuples(st.just("add"), keys, st.integers(1, 60) | st.sampled_from([0, 140]), st.booleans()),
    st.tuples(st.just("add"), keys, st.integers(1, 60), st.just(True)),
    st.tuples(st.just("append"), keys, st.integers(1, 20) | st.just(0)),
    st.tuples(st.just("alloc"), keys, st.integers(1, 70), st.sampled_from([0, 0, 0, 0, 200])),
    st.tuples(st.just("alloc"), keys, st.integers(0, 70), st.integers(0, 80)),
    st.tuples(st.just("cache"), keys, st.integers(0, 16)),
    st.tuples(st.just("skip"), keys, st.integers(0, 30)),
    st.tuples(st.just("preempt"), keys),
    st.tuples(st.just("finish"), keys),
    st.tuples(st.just("new_step")),
    st.tuples(st.just("evict"), st.lists(st.integers(0, 12), max_size=3)),
    st.tuples(st.just("reset")),
    st.tuples(st.just("extra_key"), keys),
)


def _build(pool: Pool, program_ops: list[tuple[Any, ...]]) -> StepProgram:
    hasher = BlockHasher(BLOCK, pool.hashing.algorithm, pool.hashing.seed)
    p = StepProgram()
    for op in program_ops:
        kind = op[0]
        if kind == "add":
            prompt = [op[1] * 1000 + i for i in range(op[2])]
            hashes = b"".join(hasher.hash_token_ids(prompt)) if op[3] else b""
            p.ops.append(OpKind.ADD_REQUEST)
            p.new_requests.append(
                NewRequestSpec(
                    key=op[1], request_id=f"r{op[1]}", prompt_token_ids=prompt, block_hashes=hashes
                )
            )
        elif kind == "append":
            p.ops.append(OpKind.APPEND_TOKENS)
            p.request_keys.append(op[1])
            p.append_num_tokens.append(op[2])
            p.append_token_ids.extend(range(op[2]))
            p.append_num_block_hashes.append(0)
        elif kind == "alloc":
            p.ops.append(OpKind.ALLOCATE)
            p.request_keys.append(op[1])
            p.alloc_num_new_tokens.append(op[2])
            p.alloc_num_computed_tokens.append(op[3])
        elif kind == "cache":
            p.ops.append(OpKind.CACHE_BLOCKS)
            p.request_keys.append(op[1])
            p.cache_num_computed_tokens.append(op[2])
        elif kind == "skip":
            p.ops.append(OpKind.REMOVE_SKIPPED_BLOCKS)
            p.request_keys.append(op[1])
            p.remove_skipped_total_computed_tokens.append(op[2])
        elif kind in ("preempt", "finish"):
            p.ops.append(OpKind.PREEMPT if kind == "preempt" else OpKind.FINISH)
            p.request_keys.append(op[1])
        elif kind == "new_step":
            p.ops.append(OpKind.NEW_STEP_STARTS)
        elif kind == "evict":
            p.ops.append(OpKind.EVICT_BLOCKS)
            p.evict_num_block_ids.append(len(op[1]))
            p.evict_block_ids.extend(op[1])
        elif kind == "reset":
            p.ops.append(OpKind.RESET_PREFIX_CACHE)
        else:  # a malformed column: one key too many
            p.request_keys.append(op[1])
    return p


def _replay(pool: Pool, p: StepProgram) -> tuple[list[int], list[int], list[bool]]:
    """Run ``p``'s ops through the unary calls; the statuses, block ids and resets."""
    statuses: list[int] = []
    ids: list[int] = []
    resets: list[bool] = []
    k = n_add = n_append = n_alloc = n_cache = n_skip = n_evict = tokens = evicted = 0
    for op in p.ops:
        if op == OpKind.ADD_REQUEST:
            new = p.new_requests[n_add]
            n_add += 1
            pool.add_request(new.key, new.request_id, new.prompt_token_ids, new.block_hashes)
            continue
        if op == OpKind.NEW_STEP_STARTS:
            pool.ready_manager().new_step_starts()
            continue
        if op == OpKind.RESET_PREFIX_CACHE:
            resets.append(pool.reset_prefix_cache())
            continue
        if op == OpKind.EVICT_BLOCKS:
            count = p.evict_num_block_ids[n_evict]
            n_evict += 1
            pool.evict_blocks(p.evict_block_ids[evicted : evicted + count])
            evicted += count
            continue
        key = p.request_keys[k]
        k += 1
        if op == OpKind.APPEND_TOKENS:
            count = p.append_num_tokens[n_append]
            n_append += 1
            pool.append_tokens(key, p.append_token_ids[tokens : tokens + count], b"")
            tokens += count
        elif op == OpKind.ALLOCATE:
            new_ids = pool.allocate(
                key, p.alloc_num_new_tokens[n_alloc], p.alloc_num_computed_tokens[n_alloc]
            )
            n_alloc += 1
            if new_ids is None:
                statuses.append(ItemStatus.DOES_NOT_FIT)
                break
            statuses.append(ItemStatus.OK)
            for group in new_ids:
                ids.extend(group)
        elif op == OpKind.CACHE_BLOCKS:
            pool.cache_blocks(key, p.cache_num_computed_tokens[n_cache])
            n_cache += 1
        elif op == OpKind.REMOVE_SKIPPED_BLOCKS:
            pool.remove_skipped_blocks(key, p.remove_skipped_total_computed_tokens[n_skip])
            n_skip += 1
        else:
            pool.free(key, preempt=op == OpKind.PREEMPT)
    return statuses, ids, resets


def _sane_op(live: list[int]) -> st.SearchStrategy[tuple[Any, ...]]:
    """An op that is mostly valid for the live keys (prompts and allocations in range)."""
    if not live:
        return st.tuples(st.just("add"), keys, st.integers(1, 60), st.just(True))
    key = st.sampled_from(live)
    return st.one_of(
        st.tuples(st.just("alloc"), key, st.integers(1, 40), st.just(0)),
        st.tuples(st.just("append"), key, st.integers(1, 8)),
        st.tuples(st.just("cache"), key, st.integers(0, 16)),
        st.tuples(st.just("finish"), key),
        st.tuples(st.just("preempt"), key),
        st.tuples(st.just("add"), keys, st.integers(1, 60), st.just(True)),
        st.tuples(st.just("reset")),
        st.tuples(st.just("evict"), st.lists(st.integers(1, 11), max_size=2)),
    )


@settings(PROFILE, max_examples=min(PROFILE.max_examples, 150))
@given(st.data())
def test_rejected_programs_change_nothing_accepted_ones_equal_unary_calls(
    data: st.DataObject,
) -> None:
    stepped = Pool("a", OPTIONS)
    unary = Pool("a", OPTIONS)
    for _ in range(data.draw(st.integers(1, 14))):
        live = sorted(stepped.requests)
        program_ops = data.draw(
            st.lists(st.one_of(_sane_op(live), _sane_op(live), ops), min_size=1, max_size=5)
        )
        program = _build(stepped, program_ops)
        before = stepped.state_fingerprint()
        try:
            outcome = stepped.run_step(program)
        except KVCMError:
            rejected = True
        else:
            rejected = False
        assert list(pool_violations(stepped)) == []
        if rejected:
            assert stepped.state_fingerprint() == before
            continue
        statuses, ids, resets = _replay(unary, program)
        assert outcome.alloc_statuses == statuses
        assert outcome.alloc_block_ids == ids
        assert outcome.reset == resets
        assert stepped.state_fingerprint() == unary.state_fingerprint()
