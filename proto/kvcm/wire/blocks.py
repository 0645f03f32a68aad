"""Grouped block ids and ``allocate_slots`` options on the wire.

``GroupedBlockIds`` carries every group's ids in one flat list plus one count per group, so a
message holds two packed repeated fields however many groups a pool has.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcm.common.errors import InvalidArgumentError
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS, SlotOptions
from kvcm.v1 import common_pb2, scheduler_pb2

__all__ = [
    "fill_grouped",
    "grouped_from_proto",
    "slot_options_from_proto",
    "slot_options_to_proto",
]


def fill_grouped(block_ids: Sequence[Sequence[int]], message: common_pb2.GroupedBlockIds) -> None:
    """Fill a ``GroupedBlockIds`` from per-group id lists."""
    for group in block_ids:
        message.block_ids.extend(group)
        message.num_block_ids.append(len(group))


def grouped_from_proto(
    message: common_pb2.GroupedBlockIds, field: str = "blocks"
) -> tuple[list[int], ...]:
    """Per-group id lists of a ``GroupedBlockIds``.

    Raises:
        InvalidArgumentError: The counts do not add up to the ids (names ``field``).
    """
    counts = message.num_block_ids
    ids = list(message.block_ids)
    if sum(counts) != len(ids):
        raise InvalidArgumentError(
            f"{field}: num_block_ids sums to {sum(counts)}, block_ids has {len(ids)} entries",
            field=field,
        )
    groups: list[list[int]] = []
    start = 0
    for count in counts:
        groups.append(ids[start : start + count])
        start += count
    return tuple(groups)


def slot_options_to_proto(
    options: SlotOptions,
    num_in_flight_tokens: int = 0,
    message: scheduler_pb2.SlotOptions | None = None,
    *,
    in_step: bool = False,
) -> scheduler_pb2.SlotOptions:
    """The wire options of the core's ``SlotOptions`` and a request's in-flight tokens.

    Fields at their defaults stay unset. An unset ``num_lookahead_tokens`` (``None``) is left
    out and an explicit 0 is sent, except ``in_step``: in a Step both take the Step's
    ``default_num_lookahead_tokens``, so 0 is left out too.

    Args:
        options: The options.
        num_in_flight_tokens: The request's in-flight tokens (vLLM's
            ``request.num_in_flight_tokens``).
        message: The message to fill; ``None``: a new one.
        in_step: Whether the options are a Step's ALLOCATE's.

    Returns:
        The filled message.
    """
    if message is None:
        message = scheduler_pb2.SlotOptions()
    lookahead = options.num_lookahead_tokens
    if lookahead is not None and (lookahead or not in_step):
        message.num_lookahead_tokens = lookahead
    message.num_external_computed_tokens = options.num_external_computed_tokens
    message.delay_cache_blocks = options.delay_cache_blocks
    message.num_encoder_tokens = options.num_encoder_tokens
    message.full_sequence_must_fit = options.full_sequence_must_fit
    message.reserved_blocks = options.reserved_blocks
    if not options.has_scheduled_reqs:
        message.has_scheduled_reqs = False
    if num_in_flight_tokens:
        message.num_in_flight_tokens = num_in_flight_tokens
    return message


def slot_options_from_proto(
    message: scheduler_pb2.SlotOptions, default_lookahead: int | None = None
) -> tuple[SlotOptions, int]:
    """The core's ``SlotOptions`` and the request's in-flight tokens of wire options.

    Args:
        message: The wire options.
        default_lookahead: Lookahead when the message leaves it unset; ``None``: unset.

    Returns:
        The options (the shared default instance when every knob is default) and the
        request's in-flight tokens (unset: 0).
    """
    lookahead = (
        message.num_lookahead_tokens
        if message.HasField("num_lookahead_tokens")
        else default_lookahead
    )
    has_scheduled = message.has_scheduled_reqs if message.HasField("has_scheduled_reqs") else True
    external, encoder = message.num_external_computed_tokens, message.num_encoder_tokens
    delay, full, reserved = (
        message.delay_cache_blocks,
        message.full_sequence_must_fit,
        message.reserved_blocks,
    )
    if (
        lookahead is None
        and has_scheduled
        and not (external or encoder or delay or full or reserved)
    ):
        # The common case (vLLM's async loop: an in-flight count and nothing else).
        return DEFAULT_SLOT_OPTIONS, message.num_in_flight_tokens
    options = SlotOptions(
        num_lookahead_tokens=lookahead,
        num_external_computed_tokens=external,
        delay_cache_blocks=delay,
        num_encoder_tokens=encoder,
        full_sequence_must_fit=full,
        reserved_blocks=reserved,
        has_scheduled_reqs=has_scheduled,
    )
    return options, message.num_in_flight_tokens
