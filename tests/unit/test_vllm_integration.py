"""kvcm.integrations.vllm without vLLM: settings, the Step recorder and the sinks.

The schedulers themselves need vLLM and are tested against it in
tests/compat/test_vllm_scheduler.py.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import pytest

from kvcm.common.errors import ConfigError
from kvcm.core.block import KVCacheBlock
from kvcm.core.manager import KVCacheBlocks
from kvcm.core.program import ItemStatus, OpKind
from kvcm.integrations.vllm import (
    CollectingSink,
    KvcmSettings,
    NullSink,
    StepRecorder,
    StepSink,
    _shipper,
)
from kvcm.integrations.vllm._convert import RequestView
from kvcm.integrations.vllm._recorder import _answer_ids, answer_groups
from kvcm.integrations.vllm._shipper import GrpcStepShipper

HASH = 32


class FakeVllmRequest:
    """The attributes of vLLM's Request that the integration reads (no vLLM needed)."""

    def __init__(self, request_id: str, prompt: list[int], block_size: int = 4) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.block_size = block_size
        self.block_hashes: list[bytes] = []
        self.lora_request = None
        self.cache_salt = None
        self.mm_features: list[Any] = []
        self.prompt_embeds = None
        self.session_id = None
        self.skip_reading_prefix_cache = False
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_preemptions = 0
        self.status = 1  # WAITING
        self._rehash()

    def _rehash(self) -> None:
        full = len(self.all_token_ids) // self.block_size
        while len(self.block_hashes) < full:
            self.block_hashes.append(bytes([len(self.block_hashes) % 256]) * HASH)

    def append(self, token: int) -> None:
        self.all_token_ids.append(token)
        self._rehash()


# ----------------------------------------------------------------------------- settings
def test_settings_read_additional_config_before_environment() -> None:
    settings = KvcmSettings.from_sources(
        {"kvcm": {"pool_id": "p0", "max_backlog": 3}},
        {"KVCM_POOL_ID": "ignored", "KVCM_ADDRESS": "kvcm:50051", "KVCM_STEP_TIMEOUT_S": "2.5"},
    )
    assert settings == KvcmSettings(
        address="kvcm:50051", pool_id="p0", mode="mirror", step_timeout_s=2.5, max_backlog=3
    )


def test_settings_read_pool_labels() -> None:
    from_env = KvcmSettings.from_sources(None, {"KVCM_POOL_LABELS": "role=prefill, tenant=a"})
    assert from_env.labels == {"role": "prefill", "tenant": "a"}
    given = KvcmSettings.from_sources({"kvcm": {"labels": {"role": "decode"}}}, {})
    assert given.labels == {"role": "decode"}


def test_settings_read_the_shipper() -> None:
    assert KvcmSettings().shipper == "thread"
    assert KvcmSettings.from_sources(None, {"KVCM_SHIPPER": "process"}).shipper == "process"
    given = KvcmSettings.from_sources({"kvcm": {"shipper": "process"}}, {"KVCM_SHIPPER": "x"})
    assert given.shipper == "process"


def test_settings_default_without_kvcm_section() -> None:
    assert KvcmSettings.from_sources(None, {}) == KvcmSettings()
    assert KvcmSettings.from_sources({"other": 1}, {}) == KvcmSettings()


@pytest.mark.parametrize(
    ("additional", "environ", "message"),
    [
        ({"kvcm": {"pool": "x"}}, {}, "unknown keys \\['pool'\\]"),
        ({"kvcm": {"mode": "local"}}, {}, "mode must be one of"),
        ({}, {"KVCM_MAX_BACKLOG": "many"}, "kvcm settings"),
        ({"kvcm": {"step_timeout_s": 0}}, {}, "step_timeout_s must be > 0"),
        ({"kvcm": {"max_backlog": 0}}, {}, "max_backlog must be >= 1"),
        ({"kvcm": ["address"]}, {}, "must be a mapping"),
        ({}, {"KVCM_POOL_LABELS": "role"}, "not key=value"),
        ({"kvcm": {"labels": {"bad key": "x"}}}, {}, "kvcm labels"),
        ({}, {"KVCM_SHIPPER": "fork"}, "shipper must be one of \\('thread', 'process'\\)"),
    ],
)
def test_settings_refuse_bad_values(additional: Any, environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KvcmSettings.from_sources(additional, environ)


# ----------------------------------------------------------------------------- recorder
def test_recorder_adds_once_then_appends_deltas() -> None:
    sink = CollectingSink()
    recorder = StepRecorder(sink, num_groups=1, hash_block_size=4)
    request = FakeVllmRequest("a", list(range(10)))
    view = RequestView(request)
    recorder.allocate(view, 10, None, None, ([1, 2, 3],))
    request.append(99)
    request.append(98)  # 12 tokens: a third full block and its hash
    view.sync()
    request.num_computed_tokens = 10
    view.sync()
    recorder.allocate(view, 2, None, None, None)
    recorder.free("a", finished=True)
    step = recorder.close_step()
    assert step is not None
    assert step is sink.steps[0]
    program = step.program
    assert program.ops == [
        OpKind.ADD_REQUEST,
        OpKind.ALLOCATE,
        OpKind.APPEND_TOKENS,
        OpKind.ALLOCATE,
        OpKind.FINISH,
    ]
    (spec,) = program.new_requests
    assert spec.prompt_token_ids == list(range(10))
    assert spec.block_hashes == b"".join(request.block_hashes[:2])
    assert program.request_keys == [spec.key, spec.key, spec.key, spec.key]
    assert program.append_num_tokens == [2]
    assert program.append_token_ids == [99, 98]
    assert program.append_num_block_hashes == [1]
    assert program.append_block_hashes == request.block_hashes[2]
    assert program.alloc_num_new_tokens == [10, 2]
    assert program.alloc_num_computed_tokens == [0, 10]
    assert program.continue_on_does_not_fit
    assert program.step_seq == 1
    assert step.expected.alloc_statuses == [ItemStatus.OK, ItemStatus.DOES_NOT_FIT]
    assert step.expected.alloc_num_block_ids == [3, 0]
    assert step.expected.alloc_block_ids == [1, 2, 3]
    assert recorder.key_of("a") is None


def test_recorder_keeps_an_answer_as_ids_not_as_its_objects() -> None:
    """An allocation's new blocks are noted as their ids: the scheduler's KVCacheBlocks (and its
    lists) die at the end of its turn, not once the step is shipped, so a turn where every
    request gets a block leaves nothing more for the garbage collector than vLLM's does."""
    sink = CollectingSink()
    recorder = StepRecorder(sink, num_groups=2, hash_block_size=4)
    view = RequestView(FakeVllmRequest("a", list(range(10))))
    answer = KVCacheBlocks(([KVCacheBlock(5), KVCacheBlock(9)], [KVCacheBlock(2)]))
    references = sys.getrefcount(answer)
    recorder.allocate(view, 10, None, None, answer)
    assert sys.getrefcount(answer) == references
    step = recorder.close_step()
    assert step is not None
    assert step.expected.alloc_num_block_ids == [2, 1]
    assert step.expected.alloc_block_ids == [5, 9, 2]
    # The shipper process reads the same notes: the ids per group.
    assert answer_groups(_answer_ids(answer)) == ((5, 9), (2,))
    assert answer_groups(_answer_ids(KVCacheBlocks(([], [])))) == ((), ())
    assert answer_groups(_answer_ids(KVCacheBlocks(([KVCacheBlock(4)],)))) == ((4,),)
    assert answer_groups(_answer_ids(KVCacheBlocks(([KVCacheBlock(4), KVCacheBlock(6)],)))) == (
        (4, 6),
    )


def test_building_a_step_leaves_no_garbage_for_the_collector() -> None:
    """A built program (its columns, its op writer) is freed by reference counting once nobody
    holds it: the mirror builds one every few engine turns, and a reference cycle there kept
    each program until the garbage collector ran, in the engine's turns, walking its columns."""
    sink = CollectingSink()
    recorder = StepRecorder(sink, num_groups=1, hash_block_size=4)
    views = [RequestView(FakeVllmRequest(f"r{index}", list(range(10)))) for index in range(4)]
    for view in views:
        recorder.allocate(view, 10, None, None, ([1, 2, 3],))
        recorder.cache_blocks(view, 10)
    recorder.evict_blocks({7})
    recorder.free("r0", finished=True)
    recorder.close_step()
    gc.collect()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        (step,) = sink.steps
        assert step.program.ops  # built here, with its writer
        del step
        sink.steps.clear()
        gc.collect()
        kinds = {type(thing).__name__ for thing in gc.garbage}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not kinds & {"StepProgram", "StepOutcome", "OpWriter", "_Writers"}, kinds


def test_recorder_preempt_keeps_the_request_and_empty_steps_send_nothing() -> None:
    sink = CollectingSink()
    recorder = StepRecorder(sink, num_groups=2, hash_block_size=4)
    view = RequestView(FakeVllmRequest("b", [1, 2, 3]))
    recorder.cache_blocks(view, 3)
    recorder.free("b", finished=False)
    recorder.free("never-seen", finished=True)
    recorder.new_step_starts()
    recorder.evict_blocks({5, 3})
    recorder.reset_prefix_cache(False)
    step = recorder.close_step()
    assert step is not None
    assert step.program.ops == [
        OpKind.ADD_REQUEST,
        OpKind.CACHE_BLOCKS,
        OpKind.PREEMPT,
        OpKind.NEW_STEP_STARTS,
        OpKind.EVICT_BLOCKS,
        OpKind.RESET_PREFIX_CACHE,
    ]
    assert step.program.evict_block_ids == [3, 5]
    assert step.expected.reset == [False]
    assert recorder.key_of("b") == step.program.new_requests[0].key
    assert recorder.close_step() is None
    assert len(sink.steps) == 1


def test_request_view_refuses_multimodal_and_embeddings() -> None:
    request = FakeVllmRequest("c", [1, 2])
    request.mm_features = [object()]
    with pytest.raises(Exception, match="multi-modal"):
        RequestView(request)
    request.mm_features = []
    request.prompt_embeds = object()
    with pytest.raises(Exception, match="prompt embeddings"):
        RequestView(request)


def _record_decode(recorder: StepRecorder, num_steps: int) -> list[Any]:
    # Three requests admitted in step 1, then decoding one token per step (an in-flight
    # token each); one finishes in step 4, a fourth arrives in step 5.
    requests = [FakeVllmRequest(name, list(range(6))) for name in "abc"]
    steps = []
    for seq in range(1, num_steps + 1):
        recorder.new_step_starts()
        if seq == 5:
            requests.append(FakeVllmRequest("d", list(range(7))))
        for request in requests:
            view = RequestView(request)
            fresh = request.num_computed_tokens == 0
            num_new = len(request.all_token_ids) if fresh else 1
            request.num_in_flight_tokens = 0 if fresh else 1
            view.sync()
            recorder.allocate(view, num_new, None, None, ([seq],) if fresh else ([],))
            request.num_computed_tokens += num_new
            request.append(100 + seq)
        if seq == 4:
            recorder.free("b", finished=True)
            requests = [r for r in requests if r.request_id != "b"]
        step = recorder.close_step()
        assert step is not None
        steps.append(step)
    return steps


def test_recorder_builds_consecutive_steps_into_the_program_coalesce_makes() -> None:
    from kvcm.integrations.vllm._shipper import coalesce

    one_by_one = StepRecorder(CollectingSink(), num_groups=1, hash_block_size=4)
    batched = StepRecorder(CollectingSink(), num_groups=1, hash_block_size=4)
    separate = _record_decode(one_by_one, 7)
    together = _record_decode(batched, 7)
    first = batched.build_batch(together, max_ops=10_000, max_tokens=10_000)
    assert first is not None
    count, program, expected = first
    assert count == 7
    assert (program, expected) == coalesce(separate)
    assert program.num_steps == 7
    assert program.step_seq == 7
    assert batched.tracked() == one_by_one.tracked()
    with pytest.raises(RuntimeError, match="coalesced program"):
        _ = together[0].program
    # Nothing left to build from the front: the next batch starts with a step not built.
    assert batched.build_batch(together, max_ops=10_000, max_tokens=10_000) is None


def test_recorder_batches_stop_at_the_op_and_token_limits() -> None:
    from kvcm.integrations.vllm._shipper import coalesce

    batched = StepRecorder(CollectingSink(), num_groups=1, hash_block_size=4)
    one_by_one = StepRecorder(CollectingSink(), num_groups=1, hash_block_size=4)
    together = _record_decode(batched, 6)
    separate = _record_decode(one_by_one, 6)
    # Step 1 (3 ADD_REQUEST + 3 ALLOCATE and NEW_STEP_STARTS, 18 tokens) is taken whatever
    # the limits; a step after it only while the counted bound fits.
    only_first = batched.build_batch(together, max_ops=1, max_tokens=1)
    assert only_first is not None
    assert only_first[0] == 1
    assert only_first[1:] == coalesce(separate[:1])
    # Steps 2 and 3 count 3 tokens and at most 12 ops each (3 per note, 4 notes).
    by_tokens = batched.build_batch(together[1:], max_ops=10_000, max_tokens=6)
    assert by_tokens is not None
    assert by_tokens[0] == 2
    assert by_tokens[1:] == coalesce(separate[1:3])
    by_ops = batched.build_batch(together[3:], max_ops=23, max_tokens=10_000)
    assert by_ops is not None
    assert by_ops[0] == 1
    assert by_ops[1:] == coalesce(separate[3:4])
    rest = batched.build_batch(together[4:], max_ops=10_000, max_tokens=10_000)
    assert rest is not None
    assert rest[1:] == coalesce(separate[4:])


# ----------------------------------------------------------------------------- sinks
def test_local_sinks_ship_nothing_and_say_so() -> None:
    """What the manager asks every sink, answered by the sinks that ship nothing."""
    for sink in (NullSink(), CollectingSink()):
        assert sink.acknowledges_each_answer is False
        assert sink.wants_snapshot is False
        assert sink.flush(0.0) is True
        assert sink.lag() is None
        sink.submit_snapshot(3, b"ignored")
        sink.close(0.0)
    collecting = CollectingSink()
    collecting.close()
    assert collecting.closed


@pytest.mark.parametrize("synchronous", [False, True])
def test_the_shipper_is_a_step_sink_and_remote_mode_acknowledges_each_answer(
    synchronous: bool,
) -> None:
    """The gRPC shipper answers the protocol: remote mode is its synchronous flavour."""
    shipper: StepSink = GrpcStepShipper(
        address="127.0.0.1:1",
        pool_id="p",
        pool_config=lambda: pytest.fail("no pool is created by these calls"),
        synchronous=synchronous,
    )
    try:
        assert shipper.acknowledges_each_answer is synchronous
        assert shipper.wants_snapshot is False
        assert shipper.flush(0.0) is True  # nothing submitted
        lag = shipper.lag()
        assert lag is not None
        assert lag.backlog_steps == 0
    finally:
        shipper.close(0.0)


@pytest.mark.parametrize("synchronous", [False, True])
def test_the_shipping_thread_collects_young_garbage_only_while_the_engine_waits(
    synchronous: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a unit of work, the shipping thread collects the youngest generation (and the
    middle one when this collection is the one that would trigger it) while the engine waits
    for its model, once the young count is half-way to its threshold: not while the engine is
    inside a scheduler call, not when the engine left long ago, not in remote mode."""
    shipper = GrpcStepShipper(
        address="127.0.0.1:1",
        pool_id="p",
        pool_config=lambda: pytest.fail("no pool is created by these calls"),
        synchronous=synchronous,
    )
    collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    # "Just left" is within FRESH_S of the leave: widened, so that a loaded machine pausing
    # this thread between the leave and the call does not make the engine's leave old.
    monkeypatch.setattr(_shipper, "FRESH_S", 5.0)
    saved = gc.get_threshold()
    gc.collect()
    gc.set_threshold(4000, 3, 10)
    gc.callbacks.append(seen)
    try:
        turns = shipper.turns
        young = [[] for _ in range(1000)]  # a quarter of the threshold: not yet
        turns.enter()
        turns.leave()
        shipper._collect_in_the_wait()
        assert collections == []
        young += [[] for _ in range(1500)]  # past half
        turns.enter()  # the engine is inside a scheduler call: never then
        shipper._collect_in_the_wait()
        assert collections == []
        turns.leave()
        shipper._collect_in_the_wait()
        if synchronous:
            assert collections == []
            return
        assert collections == [0]
        assert gc.get_count()[0] < 100
        young += [[] for _ in range(2500)]
        turns.left_at -= 10.0  # the engine left long ago: its next call may be near
        shipper._collect_in_the_wait()
        assert collections == [0]
        # The collection that would trigger the middle generation's collects it too.
        while gc.get_count()[1] + 1 < 3:
            gc.collect(0)
        young += [[] for _ in range(2500)]
        collections.clear()
        turns.enter()
        turns.leave()
        shipper._collect_in_the_wait()
        assert collections == [1]
        del young
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*saved)
        shipper.close(0.0)
