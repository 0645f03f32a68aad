"""StepBuilder encodes the api.md worked example column by column; StepResult decodes answers."""

from __future__ import annotations

import pytest

from kvcm.client import ItemStatus, KVCacheBlocks, SlotOptions, StepBuilder, StepResult
from kvcm.common.errors import InvalidArgumentError
from kvcm.v1 import common_pb2, scheduler_pb2

H = scheduler_pb2


def _worked_example() -> StepBuilder:
    step = StepBuilder(step_seq=42, token_budget=2048)
    step.finish(7)
    step.append_tokens(3, [1234], [b"\x01" * 32])
    step.append_tokens(5, [99])
    step.new_step_starts()
    assert step.allocate(3, 1, 47) == 0
    assert step.allocate(5, 1, 32) == 1
    step.add_request(9, list(range(40)), [b"\x02" * 32, b"\x03" * 32], request_id="req-9")
    assert step.allocate(9, 40, 0, lookup=True) == 2
    return step


def test_builder_encodes_the_worked_example() -> None:
    message = _worked_example().to_proto("engine-0")
    assert message.pool_id == "engine-0"
    assert message.step_seq == 42
    assert message.token_budget == 2048
    assert list(message.ops) == [
        H.STEP_OP_KIND_FINISH,
        H.STEP_OP_KIND_APPEND_TOKENS,
        H.STEP_OP_KIND_APPEND_TOKENS,
        H.STEP_OP_KIND_NEW_STEP_STARTS,
        H.STEP_OP_KIND_ALLOCATE,
        H.STEP_OP_KIND_ALLOCATE,
        H.STEP_OP_KIND_ADD_REQUEST,
        H.STEP_OP_KIND_ALLOCATE,
    ]
    assert list(message.request_keys) == [7, 3, 5, 3, 5, 9]
    assert list(message.append_num_tokens) == [1, 1]
    assert list(message.append_token_ids) == [1234, 99]
    assert list(message.append_num_block_hashes) == [1, 0]
    assert message.append_block_hashes == b"\x01" * 32
    assert list(message.alloc_num_new_tokens) == [1, 1, 40]
    assert list(message.alloc_num_computed_tokens) == [47, 32, 0]
    assert len(message.alloc_options) == 1
    assert message.alloc_options[0].alloc_index == 2
    assert message.alloc_options[0].HasField("lookup")
    assert not message.alloc_options[0].lookup.HasField("max_cache_hit_length")
    (new_request,) = message.new_requests
    assert new_request.request_key == 9
    assert new_request.request_id == "req-9"
    assert list(new_request.prompt_token_ids) == list(range(40))
    assert new_request.block_hashes == b"\x02" * 32 + b"\x03" * 32


def test_builder_unset_guards_stay_unset_and_options_travel_only_when_needed() -> None:
    step = StepBuilder()
    step.allocate(1, 4, 0)
    step.allocate(2, 4, 0, options=SlotOptions(num_lookahead_tokens=3, has_scheduled_reqs=False))
    step.allocate(3, 4, 0, lookup=True, max_cache_hit_length=16)
    step.cache_blocks(1, 4)
    step.remove_skipped_blocks(1, 4)
    step.preempt(2)
    message = step.to_proto("p")
    assert not message.HasField("step_seq")
    assert not message.HasField("token_budget")
    assert [entry.alloc_index for entry in message.alloc_options] == [1, 2]
    options = message.alloc_options[0].options
    assert options.num_lookahead_tokens == 3
    assert options.HasField("has_scheduled_reqs")
    assert not options.has_scheduled_reqs
    assert not message.alloc_options[0].HasField("lookup")
    assert message.alloc_options[1].lookup.max_cache_hit_length == 16
    assert list(message.cache_num_computed_tokens) == [4]
    assert list(message.remove_skipped_total_computed_tokens) == [4]
    assert step.lookup_allocations == (2,)
    assert step.num_ops == len(step) == 6


def test_max_cache_hit_length_needs_a_lookup() -> None:
    with pytest.raises(InvalidArgumentError, match="lookup"):
        StepBuilder().allocate(1, 4, 0, max_cache_hit_length=8)


def test_decode_step_stays_under_20_bytes_per_item() -> None:
    step = StepBuilder(step_seq=1000)
    step.new_step_starts()
    for key in range(256):
        step.append_tokens(key, [31999])
        step.allocate(key, 1, 1000 + key)
    size = step.to_proto("engine-0").ByteSize()
    assert size / 256 < 20


def test_result_decodes_the_worked_example_answer() -> None:
    response = H.StepResponse(
        num_ops_executed=8,
        step_seq=42,
        token_budget_left=2038,
        alloc_statuses=[common_pb2.ITEM_STATUS_OK] * 3,
        alloc_num_block_ids=[0, 1, 3],
        alloc_block_ids=[812, 17, 18, 813],
        lookup_num_computed_tokens=[32],
        lookup_num_new_tokens=[8],
    )
    result = StepResult(response, 3, (2,))
    assert result.statuses == [ItemStatus.OK] * 3
    assert result.blocks(0) == KVCacheBlocks(([],))
    assert result.blocks(1) == KVCacheBlocks(([812],))
    assert result.blocks(2) == KVCacheBlocks(([17, 18, 813],))
    lookup = result.lookup(2)
    assert lookup is not None
    assert (lookup.num_computed_tokens, lookup.num_new_tokens) == (32, 8)
    assert result.lookup(0) is None
    assert result.token_budget_left == 2038
    assert result.step_seq == 42


def test_result_of_a_stopped_step_marks_the_rest_not_executed() -> None:
    ok, no_fit = common_pb2.ITEM_STATUS_OK, common_pb2.ITEM_STATUS_DOES_NOT_FIT
    response = H.StepResponse(
        num_ops_executed=3,
        alloc_statuses=[ok, no_fit],
        alloc_num_block_ids=[1, 2, 0, 0],  # two groups
        alloc_block_ids=[5, 6, 7],
    )
    result = StepResult(response, 4)
    assert result.statuses == [
        ItemStatus.OK,
        ItemStatus.DOES_NOT_FIT,
        ItemStatus.NOT_EXECUTED,
        ItemStatus.NOT_EXECUTED,
    ]
    assert result.blocks(0) == KVCacheBlocks(([5], [6, 7]))
    assert result.blocks(1) is None
    assert result.blocks(3) is None
    assert result.num_allocations_executed == 2
    assert result.step_seq is None
    assert result.token_budget_left is None


def test_kv_cache_blocks_behave_like_the_cores() -> None:
    a = KVCacheBlocks(([1, 2], [3]))
    b = KVCacheBlocks(([4], []))
    assert (a + b).get_block_ids() == ([1, 2, 4], [3])
    assert a.get_block_ids([1]) == ([3],)
    assert a.new_empty() == KVCacheBlocks(([], []))
    assert not a.new_empty()
    assert a.num_groups == 2


@pytest.mark.parametrize(
    "field", ["num_external_computed_tokens", "num_encoder_tokens", "reserved_blocks"]
)
def test_slot_options_reject_negative_counts(field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        SlotOptions(**{field: -1})  # type: ignore[arg-type]


def test_bulk_decode_records_the_same_ops_as_one_by_one() -> None:
    one_by_one = StepBuilder()
    bulk = StepBuilder()
    hashes = [b"", b"\x07" * 32, b""]
    for key, token, computed, block_hash in zip(
        [4, 9, 2], [11, 12, 13], [40, 47, 5], hashes, strict=True
    ):
        one_by_one.append_tokens(key, [token], [block_hash] if block_hash else [])
        one_by_one.allocate(key, 1, computed)
    assert bulk.decode([4, 9, 2], [11, 12, 13], [40, 47, 5], hashes) == range(3)
    assert bulk.to_proto("p") == one_by_one.to_proto("p")
    plain = StepBuilder()
    plain.decode([1], [2], [3])
    assert list(plain.to_proto("p").append_num_block_hashes) == [0]
    with pytest.raises(InvalidArgumentError, match="same length"):
        plain.decode([1, 2], [3], [4, 5])


def test_builder_program_round_trips_through_the_wire_codec() -> None:
    from kvcm.core.program import HitSpec
    from kvcm.wire import program_from_proto, program_to_proto

    step = _worked_example()
    step.allocate(3, 2, 48, options=SlotOptions(num_lookahead_tokens=2), num_in_flight_tokens=3)
    step.allocate(5, 16, 16, hit=HitSpec(num_tokens=16, block_ids=([4],)))
    # A lookup's shared-prefix junction travels with its hit (sparse retention).
    step.allocate(6, 16, 0, hit=HitSpec(num_tokens=0, block_ids=([],), shared_prefix_boundary=32))
    step.allocate(7, 16, 0, hit=HitSpec(num_tokens=0, block_ids=([],), shared_prefix_boundary=0))
    step.evict_blocks([1, 2])
    step.reset_prefix_cache()
    step.decode([3, 5], [1, 2], [50, 33], [b"\x04" * 32, b""])
    program = step.build()
    assert program_from_proto(program_to_proto(program, "p")) == program
    assert program.alloc_options[3].num_in_flight_tokens == 3


def test_sdk_item_status_is_the_core_enum() -> None:
    from kvcm.core.program import EXECUTED_STATUSES
    from kvcm.core.program import ItemStatus as CoreItemStatus
    from kvcm.v1 import common_pb2

    assert ItemStatus is CoreItemStatus
    # Every wire value has its member, with the same number.
    for name, number in common_pb2.ItemStatus.items():
        if number:
            assert ItemStatus[name.removeprefix("ITEM_STATUS_")] == number
    # NOT_EXECUTED is what a result reads for allocations a Step did not reach, never what
    # the interpreter answers.
    assert ItemStatus.NOT_EXECUTED not in EXECUTED_STATUSES
    assert set(EXECUTED_STATUSES) | {ItemStatus.NOT_EXECUTED} == set(ItemStatus)
