"""Decode context parallelism (DCP): kvcm's KVCacheManager against vLLM 0.33.0's.

Under DCP (``decode_context_parallel_size`` n) each attention layer's token positions are
spread over n ranks, so one scheduler block spans n ranks' blocks: vLLM's managers work with
``block_size * n`` for every attention group, hash requests at that size (one group) or at the
gcd of the scaled sizes (several), and keep Mamba states whole on every rank. Each scenario
replays the same seeded scheduler-like workload through vLLM's manager built with
``dcp_world_size`` and kvcm's built with the same value (``_workloads``: every call's answer
and, after every step, the whole pool state compared). A Mamba hybrid under DCP is compared in
test_mamba_align_compat.py, vLLM's EngineCore with DCP in test_vllm_scheduler.py.

Prefill context parallelism needs no scenario: vLLM 0.33's scheduler builds its manager with
``pcp_world_size=1`` whatever the setting, so its manager decides as without PCP.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from _drivers import CHUNKED, FULL, MLA, SWA, GroupDesc, KvcmSide, Layout, VllmSide
from _workloads import Knobs, Scenario, Tally, run_workload

_BUSY = Knobs(
    lora=True,
    salts=True,
    max_drafts=2,
    max_lookahead=2,
    external=0.15,
    full_sequence_must_fit=0.3,
    max_reserved_blocks=2,
    evict=0.15,
    reset=0.05,
    drain_and_reset=0.03,
    in_flight=0.3,
    skip_reading=0.05,
    max_hit_len=0.1,
    max_prompt_len=120,
)
_PRESSURE = Knobs(max_running=8, token_budgets=(16, 48), max_prompt_len=80, evict=0.1, max_drafts=2)


def _layout(groups: tuple[GroupDesc, ...], dcp: int, **kw: Any) -> Layout:
    return Layout(groups, dcp_world_size=dcp, **kw)


SCENARIOS = [
    Scenario(
        "full4-dcp2", _layout((GroupDesc(FULL, 4),), 2, num_blocks=48, max_model_len=256), _BUSY
    ),
    Scenario(
        "full4-dcp4-pressure-watermark",
        _layout((GroupDesc(FULL, 4),), 4, num_blocks=20, max_model_len=192, watermark=0.1),
        _PRESSURE,
    ),
    Scenario(
        "mla8-dcp4-xxhash",
        _layout((GroupDesc(MLA, 8),), 4, num_blocks=40, max_model_len=320, hash_algorithm="xxhash"),
        _BUSY,
    ),
    # Two full-attention groups of different block sizes: scheduler block lcm(8, 16) = 16,
    # hash block gcd = 8 after scaling by DCP 2 (4 and 8 tokens per rank).
    Scenario(
        "hybrid-full4-full8-dcp2",
        _layout(
            (GroupDesc(FULL, 4), GroupDesc(FULL, 8, dtype="bfloat16")),
            2,
            num_blocks=80,
            max_model_len=256,
        ),
        _BUSY,
    ),
    Scenario(
        "no-cache-full4-dcp4",
        _layout((GroupDesc(FULL, 4),), 4, num_blocks=32, max_model_len=192, enable_caching=False),
        Knobs(max_drafts=2, max_lookahead=2, full_sequence_must_fit=0.3, external=0.2),
    ),
]

SEEDS = (0, 1)


@pytest.fixture
def vllm_env(vllm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Restore vLLM's process-global NONE_HASH after the test; events carry int hashes."""
    del vllm
    from vllm.v1.core import kv_cache_utils as kcu

    monkeypatch.setattr(kcu, "NONE_HASH", getattr(kcu, "NONE_HASH", None), raising=False)
    monkeypatch.setattr(kcu, "_NONE_HASH_SEED", getattr(kcu, "_NONE_HASH_SEED", None))
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_dcp_manager_matches_vllm(vllm_env: None, scenario: Scenario, seed: int) -> None:
    ref = VllmSide(scenario.layout)
    ours = KvcmSide(scenario.layout)
    layout = scenario.layout
    # The scaled sizes are vLLM's: its managers' block sizes and its resolution's.
    theirs = [m.block_size for m in ref.manager.coordinator.single_type_managers]
    assert [m.block_size for m in ours.manager.coordinator.single_type_managers] == theirs
    assert theirs == layout.block_sizes
    assert ours.manager.scheduler_block_size == layout.scheduler_block_size
    assert ours.manager.hash_block_size == layout.hash_block_size
    tally: Tally = run_workload(scenario, seed, ref, ours)
    print(
        f"\n{scenario.name}/{seed}: {tally.ops} ops compared, {tally.snapshots} snapshots, "
        f"{tally.hits} hits, {tally.not_fit} does-not-fit, {tally.preemptions} preemptions, "
        f"{tally.events} events"
    )
    assert tally.ops > 500
    if layout.enable_caching:
        assert tally.hits > 0


@pytest.mark.parametrize(
    ("group", "vllm_reason"),
    [
        (GroupDesc(SWA, 4, 8), "DCP not support sliding window attn now."),
        (GroupDesc(CHUNKED, 4, 16), "DCP not support chunked local attn now."),
    ],
    ids=("sliding-window", "chunked-local"),
)
@pytest.mark.parametrize("hybrid", [False, True], ids=("alone", "beside-full"))
def test_dcp_refused_where_vllm_refuses(
    vllm_env: None, group: GroupDesc, vllm_reason: str, hybrid: bool
) -> None:
    """Local attention under DCP: vLLM's hybrid coordinator refuses it when built, a lone
    group's manager asserts at its first lookup; kvcm refuses both when the pool is built,
    with the hybrid coordinator's reason."""
    from vllm.v1.core.kv_cache_utils import BlockHash

    from kvcm.common.errors import ConfigError

    groups = (GroupDesc(FULL, 4), group) if hybrid else (group,)
    layout = _layout(groups, 2, num_blocks=32, max_model_len=128)
    reason = (
        "DCP with hybrid KV cache layouts only supports full-attention, Mamba, and replicated "
        f"draft groups, got: {type(VllmSide._spec(group)).__name__}."
    )
    if hybrid:
        with pytest.raises(AssertionError) as theirs:
            VllmSide(layout)
        assert str(theirs.value) == reason
    else:
        ref = VllmSide(layout)
        coordinator = ref.manager.coordinator
        with pytest.raises(AssertionError, match=vllm_reason):
            coordinator.find_longest_cache_hit([BlockHash(b"x" * 32)] * 4, 64)
    with pytest.raises(ConfigError) as ours:
        KvcmSide(layout)
    assert str(ours.value) == f"dcp_world_size=2: group {len(groups) - 1}: {reason}"


def test_report_full_under_dcp_where_vllms_report_fails(vllm_env: None) -> None:
    """vLLM's kv_cache_report_mode="full" with DCP: its report views the hashes at the spec's
    per-rank block size (4 tokens), below the hash block (8), and asserts on the first hit. kvcm
    reports at the scheduler's block size: the hit's blocks as cache_full_blocks stored them."""
    from _drivers import RequestSpec

    layout = _layout((GroupDesc(FULL, 4),), 2, num_blocks=48, max_model_len=256)
    ref, ours = VllmSide(layout), KvcmSide(layout)
    prompt = list(range(1, 41))
    for side in (ref, ours):
        side.add_request(RequestSpec("warm", prompt))
        side.get_computed_blocks("warm", None)
        assert side.allocate_slots("warm", len(prompt), True) is not None
        side.free("warm")
        side.add_request(RequestSpec("again", prompt, report_full=True))
    stored = ours.take_events()
    assert stored == [e for e in stored if type(e).__name__ == "BlockStored"]
    with pytest.raises(AssertionError):
        ref.manager.get_computed_blocks(ref.requests["again"])
    ref.requests["again"].kv_cache_report_mode = "incremental"  # the report is what raised
    assert ref.manager.get_computed_blocks(ref.requests["again"])[1] == 32
    _, num, _ = ours.get_computed_blocks("again", None)
    assert num == 32
    (reported,) = ours.take_events()
    (first,) = stored
    assert reported.block_hashes == first.block_hashes[: num // 8]
    assert reported.token_ids == prompt[:num]
    assert (reported.block_size, reported.parent_block_hash) == (8, None)
