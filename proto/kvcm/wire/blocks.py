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


def slot_options_from_proto(
    message: scheduler_pb2.SlotOptions, default_lookahead: int = 0
) -> tuple[SlotOptions, int]:
    """The core's ``SlotOptions`` and ``num_in_flight_tokens`` of wire options.

    Args:
        message: The wire options.
        default_lookahead: Lookahead when the message leaves it unset (a Step's default).

    Returns:
        The options (the shared default instance when every knob is default) and the
        request's in-flight tokens.
    """
    lookahead = (
        message.num_lookahead_tokens
        if message.HasField("num_lookahead_tokens")
        else default_lookahead
    )
    in_flight = message.num_in_flight_tokens if message.HasField("num_in_flight_tokens") else 0
    has_scheduled = message.has_scheduled_reqs if message.HasField("has_scheduled_reqs") else True
    options = SlotOptions(
        num_lookahead_tokens=lookahead,
        num_external_computed_tokens=message.num_external_computed_tokens,
        delay_cache_blocks=message.delay_cache_blocks,
        num_encoder_tokens=message.num_encoder_tokens,
        full_sequence_must_fit=message.full_sequence_must_fit,
        reserved_blocks=message.reserved_blocks,
        has_scheduled_reqs=has_scheduled,
    )
    if options == DEFAULT_SLOT_OPTIONS:
        options = DEFAULT_SLOT_OPTIONS
    return options, in_flight
