"""kvcm's KVCacheManager against vLLM 0.33.0's, live, on seeded scheduler-like workloads.

Every scenario replays the same calls through both managers (``_workloads``): lookups, every
``allocate_slots`` knob (hits, lookahead, draft tokens, external tokens, delayed caching,
encoder tokens, the full-sequence gate, reserved blocks, the watermark), frees and
preemptions, ``cache_blocks``, ``evict_blocks``, ``reset_prefix_cache``,
``remove_skipped_blocks``, common-prefix counts, events, stats and the hit-rate metric, and
after every step the whole pool state. The number of compared operations is printed in the
terminal summary.
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType
from typing import Any

import pytest
from _drivers import (
    CHUNKED,
    CROSS,
    FULL,
    MAMBA,
    MLA,
    SWA,
    GroupDesc,
    KvcmSide,
    Layout,
    VllmSide,
)
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
)
_PLAIN = Knobs(evict=0.05, drain_and_reset=0.03, max_drafts=1)
_NO_CACHE = Knobs(
    max_drafts=2,
    max_lookahead=2,
    full_sequence_must_fit=0.3,
    in_flight=0.3,
    external=0.2,
    max_reserved_blocks=2,
)

# Hybrid full attention + Mamba in align mode (prefix caching of hybrid models): a hash block
# of 64 under a Mamba block of 256, so hits land inside Mamba blocks and are served through
# block copies; prompts long enough to span several Mamba blocks, with LoRA adapters and cache
# salts (other hash keys), evictions, resets, aborts and bounded lookups.
_MAMBA = Knobs(
    num_steps=100,
    max_arrivals=2,
    token_budgets=(256, 512, 768),
    max_prompt_len=1200,
    max_output=12,
    lora=True,
    salts=True,
    evict=0.1,
    reset=0.03,
    drain_and_reset=0.02,
    skip_reading=0.05,
    max_hit_len=0.1,
    abort=0.05,
    prefix_len=(64, 700),
    suffix_len=200,
    continuation_len=80,
)


def _g(kind: str, block_size: int, window: int = 0, **kw: Any) -> GroupDesc:
    return GroupDesc(kind, block_size, window, **kw)


SCENARIOS = [
    Scenario("full", Layout((_g(FULL, 4),), num_blocks=48, max_model_len=128), _BUSY),
    Scenario(
        "full-pressure-watermark",
        Layout((_g(FULL, 4),), num_blocks=20, max_model_len=64, watermark=0.1),
        Knobs(max_running=8, token_budgets=(16, 48), max_prompt_len=40, evict=0.1, max_drafts=2),
    ),
    Scenario(
        "full-xxhash-cbor-lora-salt",
        Layout((_g(FULL, 8),), num_blocks=40, max_model_len=160, hash_algorithm="xxhash_cbor"),
        Knobs(lora=True, salts=True, evict=0.1, reset=0.1, drain_and_reset=0.05),
    ),
    Scenario(
        "mla-sha256-cbor",
        Layout((_g(MLA, 4),), num_blocks=32, max_model_len=96, hash_algorithm="sha256_cbor"),
        _PLAIN,
    ),
    Scenario("swa", Layout((_g(SWA, 4, 10),), num_blocks=40, max_model_len=128), _BUSY),
    Scenario(
        "swa-pressure",
        Layout((_g(SWA, 4, 7),), num_blocks=16, max_model_len=96, hash_algorithm="xxhash"),
        Knobs(max_running=8, token_budgets=(8, 32), in_flight=0.5, evict=0.1, max_drafts=2),
    ),
    Scenario(
        "swa-extra-retained-in-flight-cap",
        Layout(
            (_g(SWA, 4, 9, extra_retained_tokens=3),),
            num_blocks=24,
            max_model_len=96,
            max_in_flight_tokens=12,
        ),
        Knobs(full_sequence_must_fit=0.6, in_flight=0.4, max_drafts=2, max_lookahead=1),
    ),
    Scenario(
        "hybrid-full8-swa4",
        Layout((_g(FULL, 8), _g(SWA, 4, 12)), num_blocks=80, max_model_len=160),
        _BUSY,
    ),
    Scenario(
        "hybrid-full-2swa-same-spec",
        Layout((_g(FULL, 4), _g(SWA, 4, 8), _g(SWA, 4, 8)), num_blocks=72, max_model_len=128),
        _BUSY,
    ),
    Scenario(
        "hybrid-three-specs",
        Layout((_g(FULL, 4), _g(SWA, 4, 6), _g(SWA, 8, 20)), num_blocks=90, max_model_len=160),
        _BUSY,
    ),
    Scenario(
        "hybrid-mixed-dtypes",
        Layout((_g(FULL, 4), _g(SWA, 4, 8, dtype="bfloat16")), num_blocks=48, max_model_len=96),
        _PLAIN,
    ),
    # Sparse prefix-cache retention (vLLM's prefix_cache_retention_interval): 0 is vLLM's
    # CacheConfig default, a positive interval keeps one window per segment, None is dense.
    # A 16-token full-attention block over 4-token windows of 2 blocks leaves room to mask.
    Scenario(
        "swa-retention-default",
        Layout((_g(SWA, 4, 10),), num_blocks=40, max_model_len=128, retention=0),
        _BUSY,
    ),
    Scenario(
        "hybrid-full16-swa4-retention-default",
        Layout((_g(FULL, 16), _g(SWA, 4, 6)), num_blocks=120, max_model_len=192, retention=0),
        _BUSY,
    ),
    Scenario(
        "hybrid-full16-swa4-retention-32",
        Layout((_g(FULL, 16), _g(SWA, 4, 6)), num_blocks=120, max_model_len=192, retention=32),
        _BUSY,
    ),
    Scenario(
        "hybrid-full16-swa4-dense",
        Layout((_g(FULL, 16), _g(SWA, 4, 6)), num_blocks=120, max_model_len=192),
        _BUSY,
    ),
    Scenario(
        "hybrid-three-specs-retention-default",
        Layout(
            (_g(FULL, 4), _g(SWA, 4, 6), _g(SWA, 8, 20)),
            num_blocks=90,
            max_model_len=160,
            retention=0,
        ),
        _PLAIN,
    ),
    Scenario(
        "chunked-local", Layout((_g(CHUNKED, 4, 16),), num_blocks=40, max_model_len=128), _BUSY
    ),
    Scenario(
        "hybrid-full-chunked",
        Layout((_g(FULL, 4), _g(CHUNKED, 4, 12)), num_blocks=64, max_model_len=128),
        _BUSY,
    ),
    Scenario(
        "hybrid-full64-mamba256-align",
        Layout(
            (_g(FULL, 64), _g(MAMBA, 256, mamba_cache_mode="align")),
            num_blocks=90,
            max_model_len=1536,
        ),
        _MAMBA,
    ),
    Scenario(
        "hybrid-full64-swa64-mamba256-align",
        Layout(
            (_g(FULL, 64), _g(SWA, 64, 128), _g(MAMBA, 256, mamba_cache_mode="align")),
            num_blocks=120,
            max_model_len=1536,
        ),
        _MAMBA,
    ),
    Scenario(
        "no-cache-full",
        Layout((_g(FULL, 4),), num_blocks=32, max_model_len=96, enable_caching=False),
        _NO_CACHE,
    ),
    Scenario(
        "no-cache-hybrid-swa",
        Layout(
            (_g(FULL, 8), _g(SWA, 4, 10)), num_blocks=48, max_model_len=96, enable_caching=False
        ),
        _NO_CACHE,
    ),
    Scenario(
        "no-cache-mamba",
        Layout(
            (_g(FULL, 4), _g(MAMBA, 8, num_speculative_blocks=1)),
            num_blocks=48,
            max_model_len=96,
            enable_caching=False,
        ),
        _NO_CACHE,
    ),
    Scenario(
        "no-cache-cross-attention",
        Layout((_g(FULL, 4), _g(CROSS, 4)), num_blocks=48, max_model_len=96, enable_caching=False),
        Knobs(encoder_tokens=20, max_drafts=1, full_sequence_must_fit=0.3, external=0.2),
    ),
    # vLLM's per-request kv_cache_report_mode="full": half the requests have their hits
    # reported as BlockStored events (per group, block sizes above the hash block size).
    Scenario(
        "report-full",
        Layout((_g(FULL, 4),), num_blocks=48, max_model_len=128),
        replace(_BUSY, report_full=0.5),
    ),
    Scenario(
        "report-full-hybrid-full8-swa16",
        Layout((_g(FULL, 8), _g(SWA, 16, 32)), num_blocks=64, max_model_len=128),
        replace(_BUSY, report_full=0.5),
    ),
    Scenario(
        "report-full-hybrid-full64-mamba256-align",
        Layout(
            (_g(FULL, 64), _g(MAMBA, 256, mamba_cache_mode="align")),
            num_blocks=90,
            max_model_len=1536,
        ),
        replace(_MAMBA, report_full=0.5),
    ),
]

SEEDS = (0, 1, 2)

_TOTAL = Tally()
SUMMARY_TITLE = "kvcm KVCacheManager vs vLLM 0.33.0"
SUMMARY_KEY = "kvcm_manager_compat_summary"  # tests/conftest.py reads it from xdist workers


class _Summary:
    """Terminal-summary plugin: how much was compared against vLLM this session."""

    @staticmethod
    def _line() -> str:
        ops = ", ".join(f"{name} {n}" for name, n in sorted(_TOTAL.by_op.items()))
        return (
            f"{_TOTAL.ops} manager operations compared ({ops}); {_TOTAL.snapshots} pool-state "
            f"snapshots; {_TOTAL.hits} hits, {_TOTAL.not_fit} does-not-fit, "
            f"{_TOTAL.preemptions} preemptions, {_TOTAL.events} events, {_TOTAL.resets} resets, "
            f"{_TOTAL.aborts} aborts; {_TOTAL.sub_block_hits} sub-block hits served through "
            f"{_TOTAL.copies} block copies"
        )

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # An xdist worker: hand the line to the controller (tests/conftest.py prints it).
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None and _TOTAL.ops:
            workeroutput[SUMMARY_KEY] = self._line()

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not _TOTAL.ops or hasattr(terminalreporter.config, "workeroutput"):
            return
        terminalreporter.write_sep("-", SUMMARY_TITLE)
        terminalreporter.write_line(self._line())


@pytest.fixture(scope="session", autouse=True)
def _summary(request: pytest.FixtureRequest) -> None:
    manager = request.config.pluginmanager
    if not manager.has_plugin("kvcm-manager-compat-summary"):
        manager.register(_Summary(), "kvcm-manager-compat-summary")


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
def test_manager_matches_vllm(vllm_env: None, scenario: Scenario, seed: int) -> None:
    ref = VllmSide(scenario.layout)
    ours = KvcmSide(scenario.layout)
    assert ours.manager.scheduler_block_size == scenario.layout.scheduler_block_size
    assert ours.manager.hash_block_size == scenario.layout.hash_block_size
    tally = run_workload(scenario, seed, ref, ours)
    _TOTAL.ops += tally.ops
    _TOTAL.snapshots += tally.snapshots
    _TOTAL.hits += tally.hits
    _TOTAL.not_fit += tally.not_fit
    _TOTAL.preemptions += tally.preemptions
    _TOTAL.events += tally.events
    _TOTAL.resets += tally.resets
    _TOTAL.aborts += tally.aborts
    _TOTAL.copies += tally.copies
    _TOTAL.sub_block_hits += tally.sub_block_hits
    for name, n in tally.by_op.items():
        _TOTAL.by_op[name] = _TOTAL.by_op.get(name, 0) + n
    assert tally.ops > 0
    if scenario.knobs.report_full:
        # The workload is about reported hits, not the align mode's sub-block hits.
        print(
            f"\n{scenario.name} seed {seed}: {tally.hits} hits, {tally.reported_hits} reported, "
            f"{tally.report_errors} reports vLLM raised on, {tally.events} events"
        )
        assert tally.reported_hits > 0
    elif any(g.kind == MAMBA and g.mamba_cache_mode == "align" for g in scenario.layout.groups):
        print(
            f"\n{scenario.name} seed {seed}: {tally.ops} ops compared, {tally.hits} hits "
            f"({tally.sub_block_hits} sub-block), {tally.copies} copies, {tally.events} events, "
            f"{tally.resets} resets, {tally.aborts} aborts, {tally.preemptions} preemptions"
        )
        # Hits inside Mamba blocks, served through copies, met the generator's ops.
        assert tally.sub_block_hits > 0
        assert tally.copies > 0
        assert tally.ops > 2000


def test_event_records_carry_vllm_fields(vllm_env: None) -> None:
    """kvcm's event records have every field of vLLM's (so routers read them unchanged)."""
    from dataclasses import fields

    from kvcm.common import events

    ref = VllmSide(Layout((_g(FULL, 4),), num_blocks=8, max_model_len=32))
    theirs = ref.event_field_names()
    ours: set[str] = set()
    for cls in (events.BlockStored, events.BlockRemoved, events.AllBlocksCleared):
        ours.update(f.name for f in fields(cls))
    assert theirs <= ours


@pytest.mark.parametrize(
    ("groups", "retention"),
    [
        ((_g(FULL, 4),), 16),  # no sliding-window or Mamba group to retain for
        ((_g(FULL, 16), _g(SWA, 4, 6)), 24),  # not a multiple of the scheduler block (16)
    ],
)
def test_retention_refused_as_vllm_refuses(
    vllm_env: None, groups: tuple[GroupDesc, ...], retention: int
) -> None:
    """A retention interval vLLM refuses, kvcm refuses with vLLM's reason."""
    from kvcm.common.errors import ConfigError

    layout = Layout(groups, num_blocks=32, max_model_len=64, retention=retention)
    with pytest.raises(ValueError, match="prefix_cache_retention_interval") as theirs:
        VllmSide(layout)
    with pytest.raises(ConfigError) as ours:
        KvcmSide(layout)
    assert str(ours.value) == str(theirs.value)


def test_retention_zero_is_accepted_without_sparse_groups(vllm_env: None) -> None:
    """vLLM's default (0) is fine on a full-attention-only model: both build and agree."""
    layout = Layout((_g(FULL, 4),), num_blocks=16, max_model_len=32, retention=0)
    assert VllmSide(layout).num_free_blocks() == KvcmSide(layout).num_free_blocks()


@pytest.mark.parametrize(
    ("extra_args", "reported"),
    [
        (None, False),
        ({}, False),
        ({"kv_cache_report_mode": "incremental"}, False),
        ({"kv_cache_report_mode": "full"}, True),
        # vLLM compares the mode with "full" only: anything else is its incremental mode.
        ({"kv_cache_report_mode": "FULL"}, False),
        ({"kv_cache_report_mode": 1}, False),
    ],
)
def test_request_view_reads_vllms_report_mode(
    vllm_env: None, extra_args: dict[str, Any] | None, reported: bool
) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvcm.integrations.vllm._convert import RequestView

    params = SamplingParams(max_tokens=4, extra_args=extra_args)
    source = Request("r", [1, 2, 3], sampling_params=params, pooling_params=None)
    assert (source.kv_cache_report_mode == "full") is reported
    assert RequestView(source).report_cached_blocks is reported


def test_request_view_reads_the_list_under_vllms_wrapper(vllm_env: None) -> None:
    """The view reads the plain list under vLLM's ``ConstantList`` (whose len() and slices run
    in Python, several times per allocate_slots) and follows vLLM's in-place changes to it:
    appended output tokens and a streaming session's truncation."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    from vllm.v1.utils import ConstantList

    from kvcm.integrations.vllm._convert import RequestView

    source = Request(
        "r", [1, 2, 3], sampling_params=SamplingParams(max_tokens=8), pooling_params=None
    )
    assert isinstance(source.all_token_ids, ConstantList)
    view = RequestView(source)
    assert type(view.all_token_ids) is list
    assert view.all_token_ids == [1, 2, 3]
    source.append_output_token_ids([4, 5])
    view.sync()
    assert view.all_token_ids == [1, 2, 3, 4, 5]
    assert view.num_tokens == source.num_tokens == 5
    del source._all_token_ids[2:]  # what vLLM's scheduler does to a streaming session
    view.sync()
    assert view.all_token_ids == list(source.all_token_ids) == [1, 2]


def test_request_view_reads_other_requests_through_all_token_ids(vllm_env: None) -> None:
    """A request whose ``_all_token_ids`` is not the list its ``all_token_ids`` wraps is read
    through ``all_token_ids``, as one without that attribute is."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvcm.integrations.vllm._convert import RequestView

    source = Request("r", [7, 8], sampling_params=SamplingParams(max_tokens=8), pooling_params=None)
    source._all_token_ids = [7, 8]  # no longer the list the wrapper holds: not trusted
    view = RequestView(source)
    assert view.all_token_ids is source.all_token_ids
