"""The Step codec's alloc_options: the bytes of protobuf's own encoding, whichever path wrote them.

``program_to_proto`` appends entries that carry only an in-flight count (every allocation of
vLLM's async loop) as pre-encoded bytes; every other entry is built as a message. Whatever the
mix, the message must serialize to exactly what building every entry as a message gives, in
``alloc_index`` order, and decode back to the same program.
"""

from __future__ import annotations

import random

import pytest

from kvcm.common.errors import InvalidArgumentError
from kvcm.core.manager import SlotOptions
from kvcm.core.program import NO_LOOKUP_BOUND, AllocOptions, HitSpec, StepProgram
from kvcm.v1 import scheduler_pb2
from kvcm.wire import program_from_proto, program_to_proto


def _message_built(program: StepProgram) -> bytes:
    # Every entry through the message API: the reference encoding.
    msg = scheduler_pb2.StepRequest()
    for index in sorted(program.alloc_options):
        entry = program.alloc_options[index]
        wire = msg.alloc_options.add(alloc_index=index)
        options = entry.slot_options
        wire.options.SetInParent()
        wire.options.num_external_computed_tokens = options.num_external_computed_tokens
        wire.options.delay_cache_blocks = options.delay_cache_blocks
        wire.options.num_encoder_tokens = options.num_encoder_tokens
        wire.options.full_sequence_must_fit = options.full_sequence_must_fit
        wire.options.reserved_blocks = options.reserved_blocks
        if options.num_lookahead_tokens:
            wire.options.num_lookahead_tokens = options.num_lookahead_tokens
        if not options.has_scheduled_reqs:
            wire.options.has_scheduled_reqs = False
        if entry.num_in_flight_tokens:
            wire.options.num_in_flight_tokens = entry.num_in_flight_tokens
        if entry.lookup is not None:
            wire.lookup.SetInParent()
            if entry.lookup != NO_LOOKUP_BOUND:
                wire.lookup.max_cache_hit_length = entry.lookup
        if entry.hit is not None:
            wire.hit.num_new_computed_tokens = entry.hit.num_tokens
            for group in entry.hit.block_ids:
                wire.hit.blocks.block_ids.extend(group)
                wire.hit.blocks.num_block_ids.append(len(group))
    return msg.SerializeToString()


def _alloc_options_bytes(program: StepProgram) -> bytes:
    encoded = program_to_proto(program, "pool")
    only = scheduler_pb2.StepRequest()
    only.alloc_options.extend(encoded.alloc_options)
    return only.SerializeToString()


def _random_entry(rng: random.Random) -> AllocOptions:
    draw = rng.random()
    if draw < 0.6:  # in-flight only, zero included (an entry with nothing set)
        return AllocOptions(num_in_flight_tokens=rng.choice([0, 1, 2, 127, 128, 300, 70000]))
    if draw < 0.75:
        return AllocOptions(lookup=rng.choice([NO_LOOKUP_BOUND, 0, 48]))
    if draw < 0.9:
        return AllocOptions(
            hit=HitSpec(num_tokens=32, block_ids=([3, 4], [5, 6])),
            num_in_flight_tokens=rng.choice([0, 1]),
        )
    return AllocOptions(
        slot_options=SlotOptions(num_lookahead_tokens=2, has_scheduled_reqs=False),
        num_in_flight_tokens=rng.choice([0, 5]),
    )


@pytest.mark.parametrize("seed", range(40))
def test_mixed_entries_encode_as_protobuf_does_and_round_trip(seed: int) -> None:
    rng = random.Random(seed)
    program = StepProgram(continue_on_does_not_fit=True)
    num_allocs = rng.randrange(1, 600)
    program.ops = [3] * num_allocs
    program.request_keys = list(range(num_allocs))
    program.alloc_num_new_tokens = [1] * num_allocs
    program.alloc_num_computed_tokens = [16] * num_allocs
    # Dense (every allocation) or sparse, index 0 and multi-byte indexes included.
    indexes = range(num_allocs) if seed % 2 else sorted(rng.sample(range(num_allocs), 7))
    for index in indexes:
        program.alloc_options[index] = _random_entry(rng)
    assert _alloc_options_bytes(program) == _message_built(program)
    assert program_from_proto(program_to_proto(program, "pool")) == program


def test_async_decode_step_shares_one_encoding_per_count() -> None:
    # The async loop's decode step: every allocation has one token in flight.
    program = StepProgram(continue_on_does_not_fit=True)
    program.ops = [3] * 300
    program.request_keys = list(range(300))
    program.alloc_num_new_tokens = [1] * 300
    program.alloc_num_computed_tokens = [40] * 300
    shared = AllocOptions(num_in_flight_tokens=1)
    program.alloc_options = dict.fromkeys(range(300), shared)
    encoded = program_to_proto(program, "pool")
    assert [entry.alloc_index for entry in encoded.alloc_options] == list(range(300))
    assert {entry.options.num_in_flight_tokens for entry in encoded.alloc_options} == {1}
    assert _alloc_options_bytes(program) == _message_built(program)
    decoded = program_from_proto(scheduler_pb2.StepRequest.FromString(encoded.SerializeToString()))
    assert decoded == program


def test_in_flight_entries_decoded_from_the_cache_are_checked_as_fresh_ones() -> None:
    # Entries decoded once are found again by their bytes: the same program, in-flight-only
    # entries shared; out-of-order indexes are still refused, naming the entry.
    program = StepProgram(continue_on_does_not_fit=True)
    program.ops = [3] * 5
    program.request_keys = list(range(5))
    program.alloc_num_new_tokens = [1] * 5
    program.alloc_num_computed_tokens = [40] * 5
    program.alloc_options = {
        0: AllocOptions(num_in_flight_tokens=1),
        2: AllocOptions(num_in_flight_tokens=3),
        3: AllocOptions(lookup=NO_LOOKUP_BOUND, num_in_flight_tokens=1),
        4: AllocOptions(num_in_flight_tokens=1),
    }
    wire = program_to_proto(program, "pool").SerializeToString()
    first = program_from_proto(scheduler_pb2.StepRequest.FromString(wire))
    second = program_from_proto(scheduler_pb2.StepRequest.FromString(wire))
    assert first == second == program
    assert second.alloc_options[0] is first.alloc_options[0]
    assert second.alloc_options[3] is not first.alloc_options[3]  # not in-flight only
    swapped = scheduler_pb2.StepRequest.FromString(wire)
    entries = list(swapped.alloc_options)
    del swapped.alloc_options[:]
    swapped.alloc_options.extend([entries[0], entries[3], entries[1], entries[2]])
    with pytest.raises(InvalidArgumentError) as raised:
        program_from_proto(swapped)
    assert raised.value.field == "alloc_options[2].alloc_index"
