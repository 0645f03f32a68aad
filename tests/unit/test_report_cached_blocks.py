"""A request's ``report_cached_blocks`` (vLLM's ``kv_cache_report_mode="full"``) in the core.

The events themselves are compared with vLLM's in tests/compat/test_manager_compat.py (the
``report-full`` scenarios); here: validation, the pool and Step paths, snapshots, forks, and
the one place kvcm deliberately differs (a Mamba hit ending in an unhashed block, where vLLM
raises IndexError).
"""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError, NotFoundError
from kvcm.common.events import BlockStored
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.block_pool import BlockPool
from kvcm.core.fork import fork_request
from kvcm.core.invariants import pool_violations
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.program import NewRequestSpec, OpKind, StepProgram
from kvcm.core.request import Request
from kvcm.core.snapshot import decode_pool, decode_sections, encode_pool, encode_sections

BS = 4
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16)
PROMPT = list(range(1, 11))  # two full blocks and a partial one


def _options(events: bool = True) -> PoolConfig:
    groups = (KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=FULL),)
    layout = KVCacheConfig(num_blocks=16, kv_cache_tensors=(), kv_cache_groups=groups)
    return PoolConfig(max_model_len=64, explicit_layout=layout, enable_kv_cache_events=events)


def _hashes(pool: Pool, tokens: list[int]) -> bytes:
    return b"".join(
        BlockHasher(BS, pool.hashing.algorithm, pool.hashing.seed).hash_token_ids(tokens)
    )


def _warm(pool: Pool) -> None:
    """Request 1 computes PROMPT and frees it: its two full blocks stay cached."""
    pool.add_request(1, "warm", PROMPT, _hashes(pool, PROMPT))
    assert pool.allocate(1, len(PROMPT), 0) is not None
    pool.free(1, preempt=False)
    assert pool.manager is not None
    pool.manager.take_events()


def test_the_flag_must_be_a_bool() -> None:
    with pytest.raises(InvalidArgumentError, match="report_cached_blocks must be a bool"):
        Request("r", [1], report_cached_blocks=1)  # type: ignore[arg-type]
    assert Request("r", [1]).report_cached_blocks is False


@pytest.mark.parametrize("report", [False, True])
def test_a_hit_is_reported_as_stored_only_when_asked(report: bool) -> None:
    pool = Pool("p", _options())
    _warm(pool)
    assert pool.manager is not None
    pool.add_request(2, "again", PROMPT, _hashes(pool, PROMPT), report_cached_blocks=report)
    hit = pool.get_computed_blocks(2, None)
    assert hit.num_computed_tokens == 8
    events = pool.manager.take_events()
    if not report:
        assert events == []
        return
    (event,) = events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == pool.requests[2].block_hashes[:2]
    assert event.parent_block_hash is None
    assert event.token_ids == PROMPT[:8]
    assert (event.block_size, event.group_idx) == (BS, 0)
    assert event.kv_cache_spec_kind == "full_attention"
    # Nothing about the cached blocks changed: a second lookup reports them again.
    assert pool.get_computed_blocks(2, None).num_computed_tokens == 8
    assert pool.manager.take_events() == [event]


def test_no_events_without_a_hit_or_with_events_off() -> None:
    pool = Pool("p", _options())
    assert pool.manager is not None
    pool.add_request(1, "cold", PROMPT, _hashes(pool, PROMPT), report_cached_blocks=True)
    assert pool.get_computed_blocks(1, None).num_computed_tokens == 0
    assert pool.manager.take_events() == []
    quiet = Pool("q", _options(events=False))
    _warm(quiet)
    quiet.add_request(2, "again", PROMPT, _hashes(quiet, PROMPT), report_cached_blocks=True)
    assert quiet.get_computed_blocks(2, None).num_computed_tokens == 8
    assert quiet.manager is not None
    assert quiet.manager.take_events() == []


def test_the_step_add_op_carries_the_flag_and_checks_its_type() -> None:
    pool = Pool("p", _options())
    _warm(pool)
    bad = StepProgram(
        ops=[OpKind.ADD_REQUEST],
        new_requests=[
            NewRequestSpec(
                key=2,
                request_id="again",
                prompt_token_ids=PROMPT,
                report_cached_blocks="yes",  # type: ignore[arg-type]
            )
        ],
    )
    before = pool.state_fingerprint()
    with pytest.raises(InvalidArgumentError, match="report_cached_blocks must be a bool") as e:
        pool.run_step(bad)
    assert e.value.field == "new_requests[0].report_cached_blocks"
    assert pool.state_fingerprint() == before
    good = StepProgram(
        ops=[OpKind.ADD_REQUEST],
        new_requests=[
            NewRequestSpec(
                key=2, request_id="again", prompt_token_ids=PROMPT, report_cached_blocks=True
            )
        ],
    )
    pool.run_step(good)
    assert pool.requests[2].report_cached_blocks is True


def test_snapshots_and_forks_keep_the_flag_and_old_snapshots_load() -> None:
    pool = Pool("p", _options())
    _warm(pool)
    pool.add_request(2, "again", PROMPT, _hashes(pool, PROMPT), report_cached_blocks=True)
    assert pool.allocate(2, 2, 8) is not None
    child = fork_request(pool, 2, 3, "child", 10)
    assert child.report_cached_blocks is True
    data = encode_pool(pool)
    restored = decode_pool(data, "p", _options())
    assert restored.state_fingerprint() == pool.state_fingerprint()
    assert list(pool_violations(restored)) == []
    assert restored.requests[2].report_cached_blocks is True
    # A snapshot written before the flag existed (15 entries per request) loads unreported.
    sections = decode_sections(data)
    for entry in sections[2]:
        entry.pop()
    old = decode_pool(encode_sections(sections), "p", _options())
    assert [r.report_cached_blocks for r in old.requests.values()] == [False, False]
    sections[2][0].extend([False, "x"])
    with pytest.raises(InvalidArgumentError, match=r"requests\[0\]"):
        decode_pool(encode_sections(sections), "p", _options())


def test_a_hit_past_the_last_hashed_block_is_reported_up_to_it() -> None:
    # A Mamba hit may end inside a block the request's tokens do not fill: vLLM's report
    # indexes past the request's hashes (IndexError); kvcm reports the blocks that have one.
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4,
                     enable_kv_cache_events=True)  # fmt: skip
    request = Request("r", list(range(1, 15)), block_hasher=BlockHasher(4, "sha256", None))
    assert len(request.block_hashes) == 3
    pool.emit_cached_block_events(request, 2, 8, 1)  # blocks of 8 tokens: only one is full
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [request.block_hashes[1]]
    assert event.token_ids == list(range(1, 9))
    assert (event.block_size, event.group_idx, event.parent_block_hash) == (8, 1, None)
    pool.emit_cached_block_events(request, 0, 8, 1)
    assert pool.take_events() == []


def _state(pool: Pool) -> list[object]:
    """The pool's snapshot sections, without the block pool's count of events taken."""
    sections = decode_sections(encode_pool(pool))
    sections[0].pop("num_events_taken")
    return sections


def _report(key: int, *counts: object) -> StepProgram:
    return StepProgram(
        ops=[OpKind.REPORT_HIT],
        request_keys=[key],
        report_hit_num_groups=[len(counts)],
        report_hit_num_blocks=list(counts),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("report", [False, True])
def test_the_report_hit_op_publishes_what_the_lookup_publishes(report: bool) -> None:
    # The vLLM mirror looks requests up itself and sends REPORT_HIT where its lookup reported:
    # the pool publishes the same event as its own lookup of the request, and only for a
    # request that asked for reports.
    pool = Pool("p", _options())
    _warm(pool)
    assert pool.manager is not None
    pool.add_request(2, "again", PROMPT, _hashes(pool, PROMPT), report_cached_blocks=report)
    pool.get_computed_blocks(2, None)
    looked_up = pool.manager.take_events()
    assert len(looked_up) == int(report)
    before = _state(pool)
    pool.run_step(_report(2, 2))
    assert pool.manager.take_events() == looked_up
    assert _state(pool) == before  # a report changes nothing but the count of events
    pool.run_step(_report(2, 0))  # a group that did not hit publishes nothing
    assert pool.manager.take_events() == []


def test_the_report_hit_op_publishes_nothing_with_events_off() -> None:
    quiet = Pool("q", _options(events=False))
    _warm(quiet)
    quiet.add_request(2, "again", PROMPT, _hashes(quiet, PROMPT), report_cached_blocks=True)
    quiet.run_step(_report(2, 2))
    assert quiet.manager is not None
    assert quiet.manager.take_events() == []


@pytest.mark.parametrize(
    ("program", "error", "field"),
    [
        # One count per group (the pool has one).
        (_report(2, 1, 1), InvalidArgumentError, "report_hit_num_groups[0]"),
        (_report(2), InvalidArgumentError, "report_hit_num_groups[0]"),
        # At most the blocks over the request's 10 tokens (3 of 4 tokens each).
        (_report(2, 4), InvalidArgumentError, "report_hit_num_blocks[0]"),
        (_report(2, -1), InvalidArgumentError, "report_hit_num_blocks[0]"),
        (_report(2, 1.0), InvalidArgumentError, "report_hit_num_blocks[0]"),
        (
            StepProgram(ops=[OpKind.REPORT_HIT], request_keys=[2], report_hit_num_groups=[1]),
            InvalidArgumentError,
            "report_hit_num_blocks",
        ),
        (
            StepProgram(
                ops=[OpKind.REPORT_HIT],
                request_keys=[2],
                report_hit_num_groups=[1.0],  # type: ignore[list-item]
                report_hit_num_blocks=[1],
            ),
            InvalidArgumentError,
            "report_hit_num_groups[0]",
        ),
        (
            StepProgram(ops=[OpKind.REPORT_HIT], request_keys=[2]),
            InvalidArgumentError,
            "report_hit_num_groups",
        ),
        (_report(9, 1), NotFoundError, "request_keys[0]"),
    ],
    ids=[
        "two-counts",
        "no-count",
        "past-tokens",
        "negative",
        "not-int",
        "short",
        "count-not-int",
        "none",
        "key",
    ],
)
def test_a_refused_report_hit_names_its_entry_and_publishes_nothing(
    program: StepProgram, error: type[Exception], field: str
) -> None:
    pool = Pool("p", _options())
    _warm(pool)
    pool.add_request(2, "again", PROMPT, _hashes(pool, PROMPT), report_cached_blocks=True)
    before = _state(pool)
    with pytest.raises(error) as caught:
        pool.run_step(program)
    assert getattr(caught.value, "field", None) == field
    assert getattr(caught.value, "op_index", None) == 0
    assert _state(pool) == before
    assert pool.manager is not None
    assert pool.manager.take_events() == []
