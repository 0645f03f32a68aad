"""kvcm's KVCacheManager against vLLM 0.33.0's with EAGLE/MTP's manager inputs, live.

vLLM's scheduler hands its manager three things for a hidden-state drafter (EAGLE, EAGLE3,
MTP): ``use_eagle`` (the trailing-block drop, when lookahead hashes are off),
``num_hash_lookahead_tokens`` (each block hash also covers the next tokens: vLLM's default
for these drafters with prefix caching) and ``num_prefill_lookahead`` (multi-module MTP's
re-prefillable tokens). The generator of test_manager_compat.py drives both managers with
each combination the scheduler makes, on full attention, sliding window (sparse retention
too), hybrid full attention + sliding window, and hybrid full attention + Mamba in align mode
(lookahead hashes, and the drop, which moves Mamba's checkpoints back a hash block): block ids,
hits, copies, events (``lookahead_token_ids`` included), stats and pool state compared after
every step.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
from _drivers import FULL, MAMBA, SWA, KvcmSide, Layout, VllmSide
from _workloads import Scenario, run_workload
from test_manager_compat import _BUSY, _MAMBA, _g, vllm_env  # noqa: F401 (fixture)

# The drop (use_eagle), vLLM's default lookahead hashes, and multi-module MTP (3 modules:
# 2 re-prefillable tokens) with each.
_DROP = {"use_eagle": True, "prefill_lookahead": 1}
_LOOKAHEAD = {"hash_lookahead": 1, "prefill_lookahead": 1}
_MTP_DROP = {"use_eagle": True, "prefill_lookahead": 3}
_MTP_LOOKAHEAD = {"hash_lookahead": 3, "prefill_lookahead": 3}
# vLLM's Mamba shared-prefix checkpoint with the drop, and with lookahead hashes and the draft
# layers' group (full attention) marked.
_SPC_DROP = {**_DROP, "shared_prefix_checkpoint": True}
_SPC_LOOKAHEAD = {**_LOOKAHEAD, "eagle_groups": (0,), "shared_prefix_checkpoint": True}


def _scenario(name: str, layout: Layout, eagle: dict[str, Any], knobs: Any = _BUSY) -> Scenario:
    return Scenario(name, dataclasses.replace(layout, **eagle), knobs)


_FULL = Layout((_g(FULL, 4),), num_blocks=48, max_model_len=128)
_SWA = Layout((_g(SWA, 4, 10),), num_blocks=40, max_model_len=128)
_HYBRID = Layout((_g(FULL, 8), _g(SWA, 4, 12)), num_blocks=80, max_model_len=160)
_RETAINED = Layout((_g(FULL, 16), _g(SWA, 4, 6)), num_blocks=120, max_model_len=192, retention=0)
_MAMBA_ALIGN = Layout(
    (_g(FULL, 64), _g(MAMBA, 256, mamba_cache_mode="align")), num_blocks=90, max_model_len=1536
)

SCENARIOS = [
    _scenario("full-drop", _FULL, _DROP),
    _scenario("full-lookahead", _FULL, _LOOKAHEAD),
    _scenario("full-mtp-drop", _FULL, _MTP_DROP),
    _scenario("full-mtp-lookahead", _FULL, _MTP_LOOKAHEAD),
    _scenario("swa-drop", _SWA, _DROP),
    _scenario("hybrid-full8-swa4-drop", _HYBRID, _DROP),
    _scenario("hybrid-full8-swa4-mtp-lookahead", _HYBRID, _MTP_LOOKAHEAD),
    _scenario("hybrid-full16-swa4-retention-default-drop", _RETAINED, _DROP),
    _scenario("hybrid-full64-mamba256-align-lookahead", _MAMBA_ALIGN, _LOOKAHEAD, _MAMBA),
    # Three lookahead tokens move the Mamba prefill checkpoint back (one is the logits token).
    _scenario("hybrid-full64-mamba256-align-mtp-lookahead", _MAMBA_ALIGN, _MTP_LOOKAHEAD, _MAMBA),
    # The drop beside Mamba: checkpoints one hash block below the last boundary.
    _scenario("hybrid-full64-mamba256-align-drop", _MAMBA_ALIGN, _DROP, _MAMBA),
    # vLLM's enable_mamba_shared_prefix_checkpoint: chunks end at each request's junction,
    # where Mamba keys the state too. With the drop (every group an EAGLE group), and with
    # lookahead hashes beside a marked draft group (full attention, as EAGLE's layers join).
    _scenario("hybrid-full64-mamba256-align-drop-shared-prefix", _MAMBA_ALIGN, _SPC_DROP, _MAMBA),
    _scenario(
        "hybrid-full64-mamba256-align-lookahead-shared-prefix", _MAMBA_ALIGN, _SPC_LOOKAHEAD, _MAMBA
    ),
]
# The shared-prefix checkpoint's predicate, vLLM's: the flag asked for, an EAGLE group, sub-block
# hits, no re-prefillable tokens.
_SPC_FLAG = (
    ("drop", _SPC_DROP, True),
    ("lookahead-marked", _SPC_LOOKAHEAD, True),
    ("lookahead-unmarked", {**_LOOKAHEAD, "shared_prefix_checkpoint": True}, False),
    (
        "mtp-lookahead-marked",
        {**_SPC_LOOKAHEAD, "prefill_lookahead": 3, "hash_lookahead": 3},
        False,
    ),
    ("flag-off", {**_DROP, "eagle_groups": (0,)}, False),
)
# One seed in CI (about 25 s); KVCM_LONG=1 runs three.
SEEDS = (0, 1, 2) if os.environ.get("KVCM_LONG") else (0,)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_eagle_manager_matches_vllm(vllm_env: None, scenario: Scenario, seed: int) -> None:  # noqa: F811
    ref = VllmSide(scenario.layout)
    ours = KvcmSide(scenario.layout)
    layout = scenario.layout
    coordinator = ours.manager.coordinator
    assert coordinator.drop_eagle_group_ids == ref.manager.coordinator.drop_eagle_group_ids
    assert coordinator.num_reprefillable_tokens == (
        ref.manager.coordinator.num_reprefillable_tokens
    )
    assert ours.manager.block_pool.num_hash_lookahead_tokens == layout.hash_lookahead
    checkpoint = ref.manager.mamba_shared_prefix_checkpoint
    assert ours.manager.mamba_shared_prefix_checkpoint == checkpoint
    assert checkpoint == layout.shared_prefix_checkpoint
    tally = run_workload(scenario, seed, ref, ours)
    print(
        f"\n{scenario.name} seed {seed}: {tally.ops} ops compared, {tally.hits} hits "
        f"({tally.sub_block_hits} sub-block), {tally.copies} copies, {tally.events} events, "
        f"{tally.preemptions} preemptions, {tally.junctions} junctions "
        f"({tally.junction_stops} chunks ended there)"
    )
    assert tally.ops > 1000
    assert tally.hits > 0
    assert tally.events > 0
    if checkpoint:
        assert tally.junction_stops > 0


@pytest.mark.parametrize(
    ("eagle", "expected"), [c[1:] for c in _SPC_FLAG], ids=[c[0] for c in _SPC_FLAG]
)
def test_shared_prefix_checkpoint_predicate_matches_vllm(
    vllm_env: None,  # noqa: F811
    eagle: dict[str, Any],
    expected: bool,
) -> None:
    layout = dataclasses.replace(_MAMBA_ALIGN, **eagle)
    theirs = VllmSide(layout).manager.mamba_shared_prefix_checkpoint
    ours = KvcmSide(layout).manager
    assert theirs is expected
    assert ours.mamba_shared_prefix_checkpoint is expected
    # Only align-mode Mamba groups key the junction, and only when the predicate holds.
    flags = [
        getattr(m, "shared_prefix_checkpoint", False) for m in ours.coordinator.single_type_managers
    ]
    assert flags == [False, expected]
