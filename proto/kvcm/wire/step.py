"""The Step codec: ``kvcm.v1.StepRequest``/``StepResponse`` <-> the core's program values.

Decoding is a list copy per column (a decode step of hundreds of requests costs a few lists,
no per-op objects); the semantics live in :mod:`kvcm.core.step`, not here. The packed columns
are the op table's (:data:`kvcm.core.op_table.COLUMNS`): the program's and the message's
fields have the same names.
"""

from __future__ import annotations

from typing import Any, Final, cast

from kvcm.common.errors import InvalidArgumentError
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS
from kvcm.core.op_table import COLUMNS
from kvcm.core.program import (
    NO_LOOKUP_BOUND,
    AllocOptions,
    HitSpec,
    NewRequestSpec,
    StepOutcome,
    StepProgram,
)
from kvcm.v1 import scheduler_pb2
from kvcm.wire.blocks import grouped_from_proto, slot_options_from_proto, slot_options_to_proto

__all__ = [
    "STEP_REJECTION_TRAILER",
    "alloc_options_from_proto",
    "outcome_from_proto",
    "outcome_to_proto",
    "program_from_proto",
    "program_to_proto",
    "step_rejection_from_trailers",
    "step_rejection_to_trailer",
]

# The trailing-metadata key a rejected Step carries its kvcm.v1.StepRejection in.
STEP_REJECTION_TRAILER = "kvcm-step-rejection-bin"
# The framing of one StepRequest.alloc_options entry (length-delimited) and of its
# alloc_index (a varint), from the message descriptors.
_ALLOC_OPTIONS_TAG: Final = bytes(
    ((scheduler_pb2.StepRequest.DESCRIPTOR.fields_by_name["alloc_options"].number << 3) | 2,)
)
_ALLOC_INDEX_TAG: Final = bytes(
    ((scheduler_pb2.StepAllocOptions.DESCRIPTOR.fields_by_name["alloc_index"].number << 3) | 0,)
)
# In-flight-only alloc_options entries (one per allocation of vLLM's async loop) are encoded
# and decoded once per distinct value: framed entry bytes by (alloc_index, count), and the
# decoded (alloc_index, options) by an entry's bytes. Bounded: cleared when full.
_IN_FLIGHT_FRAMES: Final[dict[tuple[int, int], bytes]] = {}
_DECODED_ENTRIES: Final[dict[bytes, tuple[int, AllocOptions]]] = {}
_MAX_CACHED_ENTRIES: Final = 1 << 16
# The op table's columns that are packed repeated scalars on the wire (new_requests is a
# list of messages, append_block_hashes one bytes field).
_PACKED: Final = tuple(
    c for c in COLUMNS if c not in ("new_requests", "append_block_hashes", "host_sync_keys")
)


def step_rejection_to_trailer(
    op_index: int | None, field: str, reason: str
) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata of a rejected Step (the caller makes the strings safe to send)."""
    rejection = scheduler_pb2.StepRejection(field=field, reason=reason)
    if op_index is not None:
        rejection.op_index = op_index
    return ((STEP_REJECTION_TRAILER, rejection.SerializeToString()),)


def step_rejection_from_trailers(trailers: object) -> tuple[int | None, str, str] | None:
    """``(op_index, field, reason)`` from a failed call's trailing metadata, if it has one.

    A malformed trailer answers ``None``: it must never hide the status it came with.
    """
    if not trailers:
        return None
    for item in trailers:  # type: ignore[attr-defined]
        key, value = item[0], item[1]
        if key != STEP_REJECTION_TRAILER or not isinstance(value, bytes):
            continue
        message = scheduler_pb2.StepRejection()
        try:
            message.ParseFromString(value)
        except Exception:
            return None
        op_index = message.op_index if message.HasField("op_index") else None
        return op_index, message.field, message.reason
    return None


def _new_request(new: scheduler_pb2.NewRequest) -> NewRequestSpec:
    return NewRequestSpec(
        key=new.request_key,
        request_id=new.request_id,
        prompt_token_ids=list(new.prompt_token_ids),
        block_hashes=new.block_hashes,
        lora_id=new.lora_id if new.HasField("lora_id") else None,
        lora_name=new.lora_name if new.HasField("lora_name") else None,
        cache_salt=new.cache_salt if new.HasField("cache_salt") else None,
        skip_reading_prefix_cache=new.skip_reading_prefix_cache,
        report_cached_blocks=new.report_cached_blocks,
    )


def alloc_options_from_proto(entry: scheduler_pb2.StepAllocOptions, position: int) -> AllocOptions:
    """The core's ``AllocOptions`` of one wire entry."""
    lookup: int | None = None
    if entry.HasField("lookup"):
        bound = entry.lookup
        lookup = (
            bound.max_cache_hit_length
            if bound.HasField("max_cache_hit_length")
            else NO_LOOKUP_BOUND
        )
    hit: HitSpec | None = None
    if entry.HasField("hit"):
        hit = HitSpec(
            num_tokens=entry.hit.num_new_computed_tokens,
            block_ids=grouped_from_proto(entry.hit.blocks, f"alloc_options[{position}].hit"),
            shared_prefix_boundary=(
                entry.hit.shared_prefix_boundary
                if entry.hit.HasField("shared_prefix_boundary")
                else None
            ),
        )
    options, in_flight = slot_options_from_proto(entry.options)
    return AllocOptions(
        lookup=lookup, hit=hit, slot_options=options, num_in_flight_tokens=in_flight
    )


def program_from_proto(msg: scheduler_pb2.StepRequest) -> StepProgram:
    """The core's program of a wire Step (no semantic checks: the interpreter's job).

    Raises:
        InvalidArgumentError: alloc_options' alloc_index is not strictly increasing, or a hit's
            block counts do not add up (names the field).
    """
    options: dict[int, AllocOptions] = {}
    last = -1
    decoded = _DECODED_ENTRIES
    for position, entry in enumerate(msg.alloc_options):
        # An in-flight count and nothing else (every allocation of vLLM's async loop) is
        # decoded once per distinct encoding: its bytes find its index and its options.
        raw = entry.SerializeToString()
        known = decoded.get(raw)
        if known is None:
            index = entry.alloc_index
            value = alloc_options_from_proto(entry, position)
            if _in_flight_only(value):
                if len(decoded) >= _MAX_CACHED_ENTRIES:
                    decoded.clear()
                decoded[raw] = (index, value)
        else:
            index, value = known
        if index <= last:
            raise InvalidArgumentError(
                f"alloc_options[{position}].alloc_index={index} is not strictly increasing",
                field=f"alloc_options[{position}].alloc_index",
            )
        last = index
        options[index] = value
    program = StepProgram(
        ops=list(msg.ops),
        new_requests=[_new_request(new) for new in msg.new_requests],
        alloc_options=options,
        append_block_hashes=msg.append_block_hashes,
        host_sync_keys=msg.host_sync_keys,
        default_num_lookahead_tokens=msg.default_num_lookahead_tokens,
        token_budget=msg.token_budget if msg.HasField("token_budget") else None,
        continue_on_does_not_fit=msg.continue_on_does_not_fit,
        step_seq=msg.step_seq if msg.HasField("step_seq") else None,
        num_steps=msg.num_steps or 1,
        scheduler_step_seq=msg.scheduler_step_seq,
        step_age_s=msg.step_age_s,
    )
    for name in _PACKED:
        setattr(program, name, list(getattr(msg, name)))
    return program


def program_to_proto(program: StepProgram, pool_id: str) -> scheduler_pb2.StepRequest:
    """The wire Step of a program, for pool ``pool_id``."""
    packed: dict[str, Any] = {name: getattr(program, name) for name in _PACKED}
    msg = scheduler_pb2.StepRequest(
        pool_id=pool_id,
        ops=cast("list[scheduler_pb2.StepOpKind]", program.ops),
        append_block_hashes=program.append_block_hashes,
        host_sync_keys=program.host_sync_keys,
        **packed,
        default_num_lookahead_tokens=program.default_num_lookahead_tokens,
        continue_on_does_not_fit=program.continue_on_does_not_fit,
    )
    if program.token_budget is not None:
        msg.token_budget = program.token_budget
    if program.step_seq is not None:
        msg.step_seq = program.step_seq
    if program.num_steps != 1:
        msg.num_steps = program.num_steps
    if program.scheduler_step_seq:
        msg.scheduler_step_seq = program.scheduler_step_seq
        msg.step_age_s = program.step_age_s
    for new in program.new_requests:
        wire = msg.new_requests.add(
            request_key=new.key,
            request_id=new.request_id,
            prompt_token_ids=new.prompt_token_ids,
            block_hashes=new.block_hashes,
            skip_reading_prefix_cache=new.skip_reading_prefix_cache,
            report_cached_blocks=new.report_cached_blocks,
        )
        if new.lora_id is not None:
            wire.lora_id = new.lora_id
        if new.lora_name is not None:
            wire.lora_name = new.lora_name
        if new.cache_salt is not None:
            wire.cache_salt = new.cache_salt
    if program.alloc_options:
        _alloc_options_to_proto(msg, program.alloc_options)
    return msg


def _in_flight_only(entry: AllocOptions) -> bool:
    # Options that only carry vLLM's in-flight count (every allocation of its async loop).
    return entry.lookup is None and entry.hit is None and entry.slot_options is DEFAULT_SLOT_OPTIONS


def _in_flight_frame(index: int, num_in_flight_tokens: int) -> bytes:
    # The framed alloc_options entry of in-flight-only options (what protobuf encodes for
    # StepAllocOptions(alloc_index=index, options=...), field by field in number order).
    body: bytes = scheduler_pb2.StepAllocOptions(
        options=slot_options_to_proto(DEFAULT_SLOT_OPTIONS, num_in_flight_tokens, in_step=True)
    ).SerializeToString()
    if index:  # proto3 leaves a zero alloc_index out
        body = _ALLOC_INDEX_TAG + _varint(index) + body
    frame = _ALLOC_OPTIONS_TAG + _varint(len(body)) + body
    frames = _IN_FLIGHT_FRAMES
    if len(frames) >= _MAX_CACHED_ENTRIES:
        frames.clear()
    frames[index, num_in_flight_tokens] = frame
    return frame


def _alloc_options_to_proto(
    msg: scheduler_pb2.StepRequest, entries: dict[int, AllocOptions]
) -> None:
    # Entries with an in-flight count and nothing else are appended as their encoding, made
    # once per (alloc_index, count) and merged in runs (a message object per entry costs ~5x
    # more, and building the framing per entry ~3x). Others are built as messages; the entries
    # stay in alloc_index order, so the bytes are the same.
    frames = _IN_FLIGHT_FRAMES
    run: list[bytes] = []
    for index, entry in sorted(entries.items()):
        if (
            entry.lookup is None
            and entry.hit is None
            and entry.slot_options is DEFAULT_SLOT_OPTIONS
        ):
            count = entry.num_in_flight_tokens
            frame = frames.get((index, count))
            run.append(frame if frame is not None else _in_flight_frame(index, count))
            continue
        if run:
            msg.MergeFromString(b"".join(run))
            run = []
        wire_entry = msg.alloc_options.add(alloc_index=index)
        wire_entry.options.SetInParent()
        slot_options_to_proto(
            entry.slot_options, entry.num_in_flight_tokens, wire_entry.options, in_step=True
        )
        if entry.lookup is not None:
            wire_entry.lookup.SetInParent()
            if entry.lookup != NO_LOOKUP_BOUND:
                wire_entry.lookup.max_cache_hit_length = entry.lookup
        if entry.hit is not None:
            wire_entry.hit.num_new_computed_tokens = entry.hit.num_tokens
            if entry.hit.shared_prefix_boundary is not None:
                wire_entry.hit.shared_prefix_boundary = entry.hit.shared_prefix_boundary
            for group in entry.hit.block_ids:
                wire_entry.hit.blocks.block_ids.extend(group)
                wire_entry.hit.blocks.num_block_ids.append(len(group))
    if run:
        msg.MergeFromString(b"".join(run))


def _varint(value: int) -> bytes:
    # Protobuf's base-128 varint of a non-negative int.
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def outcome_to_proto(outcome: StepOutcome) -> scheduler_pb2.StepResponse:
    """The wire answer of a Step outcome (one bulk copy per column)."""
    response = scheduler_pb2.StepResponse(num_ops_executed=outcome.num_ops_executed)
    response.alloc_statuses.extend(outcome.alloc_statuses)
    response.alloc_num_block_ids.extend(outcome.alloc_num_block_ids)
    response.alloc_block_ids.extend(outcome.alloc_block_ids)
    if outcome.lookup_num_computed_tokens:
        response.lookup_num_computed_tokens.extend(outcome.lookup_num_computed_tokens)
        response.lookup_num_new_tokens.extend(outcome.lookup_num_new_tokens)
    if outcome.reset:
        response.reset.extend(outcome.reset)
    if outcome.copy_block_ids:
        response.copy_block_ids.extend(outcome.copy_block_ids)
    if outcome.drained_num_copies:
        response.drained_copy_block_ids.extend(outcome.drained_copy_block_ids)
        response.drained_num_copies.extend(outcome.drained_num_copies)
    if outcome.swap_out_swapped:
        response.swap_out_swapped.extend(outcome.swap_out_swapped)
    if outcome.host_alloc_statuses:
        response.host_alloc_statuses.extend(outcome.host_alloc_statuses)
        response.host_alloc_num_block_ids.extend(outcome.host_alloc_num_block_ids)
        response.host_alloc_block_ids.extend(outcome.host_alloc_block_ids)
        response.host_alloc_num_device_hit_tokens.extend(outcome.host_alloc_num_device_hit_tokens)
        response.host_alloc_num_host_hit_tokens.extend(outcome.host_alloc_num_host_hit_tokens)
    if outcome.host_num_d2h:
        response.host_d2h_block_ids.extend(outcome.host_d2h_block_ids)
        response.host_h2d_block_ids.extend(outcome.host_h2d_block_ids)
        response.host_num_d2h.extend(outcome.host_num_d2h)
        response.host_num_h2d.extend(outcome.host_num_h2d)
    if outcome.common_num_block_ids:
        response.common_num_block_ids.extend(outcome.common_num_block_ids)
        response.common_block_ids.extend(outcome.common_block_ids)
    if outcome.token_budget_left is not None:
        response.token_budget_left = outcome.token_budget_left
    if outcome.step_seq is not None:
        response.step_seq = outcome.step_seq
    return response


def outcome_from_proto(msg: scheduler_pb2.StepResponse) -> StepOutcome:
    """The core's outcome of a wire Step answer."""
    return StepOutcome(
        num_ops_executed=msg.num_ops_executed,
        alloc_statuses=list(msg.alloc_statuses),
        alloc_num_block_ids=list(msg.alloc_num_block_ids),
        alloc_block_ids=list(msg.alloc_block_ids),
        lookup_num_computed_tokens=list(msg.lookup_num_computed_tokens),
        lookup_num_new_tokens=list(msg.lookup_num_new_tokens),
        reset=list(msg.reset),
        copy_block_ids=list(msg.copy_block_ids),
        drained_copy_block_ids=list(msg.drained_copy_block_ids),
        drained_num_copies=list(msg.drained_num_copies),
        swap_out_swapped=list(msg.swap_out_swapped),
        host_alloc_statuses=list(msg.host_alloc_statuses),
        host_alloc_num_block_ids=list(msg.host_alloc_num_block_ids),
        host_alloc_block_ids=list(msg.host_alloc_block_ids),
        host_alloc_num_device_hit_tokens=list(msg.host_alloc_num_device_hit_tokens),
        host_alloc_num_host_hit_tokens=list(msg.host_alloc_num_host_hit_tokens),
        host_d2h_block_ids=list(msg.host_d2h_block_ids),
        host_h2d_block_ids=list(msg.host_h2d_block_ids),
        host_num_d2h=list(msg.host_num_d2h),
        host_num_h2d=list(msg.host_num_h2d),
        common_num_block_ids=list(msg.common_num_block_ids),
        common_block_ids=list(msg.common_block_ids),
        token_budget_left=msg.token_budget_left if msg.HasField("token_budget_left") else None,
        step_seq=msg.step_seq if msg.HasField("step_seq") else None,
    )
