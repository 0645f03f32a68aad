"""Hostile Step programs: mostly consistent columns, then one column cut, grown or poisoned."""

from __future__ import annotations

from hypothesis import strategies as st

from _fuzz.calls import MAX_MODEL_LEN, NUM_BLOCKS, U32_MAX, U64_MAX, Target
from kvcm.v1 import scheduler_pb2

__all__ = ["draw_step"]

_ADD, _APPEND, _ALLOCATE, _CACHE, _SKIPPED, _PREEMPT, _FINISH, _NEW_STEP, _EVICT, _RESET = range(
    1, 11
)
_UNKEYED = (_ADD, _NEW_STEP, _EVICT, _RESET)
_COLUMNS = [
    "request_keys",
    "alloc_num_new_tokens",
    "alloc_num_computed_tokens",
    "append_num_tokens",
    "append_token_ids",
    "append_num_block_hashes",
    "cache_num_computed_tokens",
    "remove_skipped_total_computed_tokens",
    "evict_num_block_ids",
    "evict_block_ids",
]


def _clean_new_request(
    data: st.DataObject, target: Target, keys: list[int]
) -> scheduler_pb2.NewRequest:
    """A well-formed request under a key no one uses, with its right block hashes."""
    taken = set(keys) | set(target.reference.requests)
    key = next(key for key in range(len(taken) + 1) if key not in taken)
    tokens = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=24))
    hashes = b"".join(target.hasher().hash_token_ids(tokens))
    return scheduler_pb2.NewRequest(
        request_key=key, request_id=f"r{key}", prompt_token_ids=tokens, block_hashes=hashes
    )


def _op(
    data: st.DataObject,
    m: scheduler_pb2.StepRequest,
    target: Target,
    keys: list[int],
    *,
    clean: bool,
) -> None:
    """Append one op; ``clean`` draws only well-formed values (live keys, the request's own
    counts), so that whole programs get past validation and run."""
    from _fuzz.calls import _hashes, _key, _new_request, _request_tokens, _slot_options

    ops = [*(_ADD, _ADD, _APPEND, _ALLOCATE, _ALLOCATE, _ALLOCATE, _ALLOCATE, _CACHE)]
    ops += [_SKIPPED, _PREEMPT, _FINISH, _NEW_STEP, _EVICT, _RESET] + ([] if clean else [0, 11])
    op = data.draw(st.sampled_from(ops))
    live = sorted(set(keys) | set(target.reference.requests))
    if clean and op not in _UNKEYED and not live:
        op = _ADD
    m.ops.append(op)
    if op == _ADD:
        new = _clean_new_request(data, target, keys) if clean else _new_request(data, target)
        keys.append(new.request_key)
        m.new_requests.append(new)
        return
    if op == _EVICT:
        ids = data.draw(st.lists(st.integers(1, NUM_BLOCKS - 1), max_size=4))
        if not clean:
            ids += data.draw(st.lists(st.sampled_from([0, NUM_BLOCKS, U32_MAX]), max_size=1))
        m.evict_num_block_ids.append(len(ids))
        m.evict_block_ids.extend(ids)
        return
    if op in (_NEW_STEP, _RESET, 0, 11):
        return
    if clean:
        key = data.draw(st.sampled_from(live))
    elif keys and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(keys))
    else:
        key = _key(data, target)
    m.request_keys.append(key)
    request = target.reference.requests.get(key)
    if op == _APPEND:
        tokens = data.draw(st.lists(st.integers(0, 50), min_size=0, max_size=6))
        raw = _hashes(data, target, _request_tokens(target, key), tokens)
        m.append_num_tokens.append(len(tokens))
        m.append_token_ids.extend(tokens)
        size = target.reference.hashing.hash_length_bytes
        m.append_num_block_hashes.append(len(raw) // size)
        m.append_block_hashes += raw
    elif op == _ALLOCATE:
        computed = request.num_computed_tokens if request is not None else 0
        left = request.num_tokens - computed if request is not None else 4
        index = len(m.alloc_num_new_tokens)
        news, computeds = (
            ([left, 1], [computed]) if clean else ([left, 1, 0, U32_MAX], [computed, 0, U32_MAX])
        )
        m.alloc_num_new_tokens.append(data.draw(st.sampled_from(news)))
        m.alloc_num_computed_tokens.append(data.draw(st.sampled_from(computeds)))
        if data.draw(st.integers(0, 2)) == 0:
            entry = m.alloc_options.add(alloc_index=index)
            if data.draw(st.booleans()):
                entry.lookup.SetInParent()
                if data.draw(st.booleans()):
                    entry.lookup.max_cache_hit_length = data.draw(
                        st.sampled_from([0, 4, MAX_MODEL_LEN, U32_MAX])
                    )
            if data.draw(st.booleans()):
                entry.options.CopyFrom(_slot_options(data))
    elif op == _CACHE:
        num = request.num_computed_tokens if request is not None else 0
        m.cache_num_computed_tokens.append(
            num if clean else data.draw(st.sampled_from([num, 0, 4, U32_MAX]))
        )
    elif op == _SKIPPED:
        num = request.num_computed_tokens if request is not None else 0
        m.remove_skipped_total_computed_tokens.append(
            num if clean else data.draw(st.sampled_from([num, U32_MAX]))
        )


def _perturb(data: st.DataObject, m: scheduler_pb2.StepRequest) -> None:
    how = data.draw(st.sampled_from(["none"] * 8 + ["cut", "grow", "hashes", "options", "seq"]))
    if how in ("cut", "grow"):
        column = getattr(m, data.draw(st.sampled_from(_COLUMNS)))
        if how == "cut" and len(column):
            del column[-1]
        elif how == "grow":
            column.append(data.draw(st.sampled_from([0, 1, U32_MAX])))
    elif how == "hashes":
        m.append_block_hashes += b"\x00" * data.draw(st.sampled_from([1, 31, 32]))
    elif how == "options":
        m.alloc_options.add(alloc_index=data.draw(st.sampled_from([0, 5, U32_MAX])))
    elif how == "seq":
        m.step_seq = data.draw(st.sampled_from([0, 1, 2, U64_MAX]))


def draw_step(data: st.DataObject, target: Target) -> scheduler_pb2.StepRequest:
    """A Step program of 1-6 ops aimed at the target pool."""
    from _fuzz.calls import _pool_id

    clean = data.draw(st.booleans(), label="clean_step")
    m = scheduler_pb2.StepRequest(pool_id=target.pool_id if clean else _pool_id(data, target))
    keys: list[int] = []
    for _ in range(data.draw(st.integers(1, 6))):
        _op(data, m, target, keys, clean=clean)
    if data.draw(st.booleans()):
        m.continue_on_does_not_fit = True
    if data.draw(st.integers(0, 3)) == 0:
        m.token_budget = data.draw(st.sampled_from([0, 3, 16, U32_MAX]))
    if data.draw(st.integers(0, 3)) == 0:
        m.default_num_lookahead_tokens = data.draw(st.sampled_from([1, 4, U32_MAX]))
    if not clean:
        _perturb(data, m)
    return m
