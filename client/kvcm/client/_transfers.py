"""The SDK's view of P/D transfer records (``kvcm.v1.TransferService``, docs/pd.md).

``Transfer`` is a frozen record decoded from ``kvcm.v1.Transfer`` (both clients' answers).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kvcm.v1 import pd_pb2
from kvcm.wire import grouped_from_proto

__all__ = [
    "Transfer",
    "TransferListing",
    "TransferState",
    "transfer_from_proto",
]


@enum.unique
class TransferState(enum.IntEnum):
    """A transfer's state (``kvcm.v1.TransferState``; see docs/pd.md)."""

    HELD = 1
    PLANNED = 2
    COMPLETED = 3
    RELEASED = 4
    EXPIRED = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """One P/D transfer record (fields as ``kvcm.v1.Transfer``'s).

    Attributes:
        pool_id: The source pool.
        transfer_id: The caller's id of the transfer.
        state: Its state.
        record_only: kvcm only records it (an engine's protocol keeps its blocks).
        request_key: The source request's key in its pool.
        request_id: The source request's id.
        num_tokens: Tokens the source holds computed.
        source_blocks: The source's block ids, per KV-cache group.
        lease_s: The lease (seconds of the server's awake time).
        lease_remaining_s: Seconds left when answered (negative: past it; 0 once ended).
        destination_pool_id: The pool that pulls ("" before a plan).
        hit_tokens: Tokens the destination already held (saved), ``pull_tokens`` it pulls.
        hit_blocks: ``hit_tokens`` in whole blocks; ``pull_blocks``: the blocks the pull covers.
        blocks_pulled: Blocks the destination reported pulled at the commit.
        started_at: Wall-clock start; ``ended_at`` its end (0: in flight).
        reason: Why it was released or expired.
        block_size: The source pool's block size.
        source_freed: Record-only: the engine reported the source freed.
    """

    pool_id: str
    transfer_id: str
    state: TransferState
    record_only: bool
    request_key: int
    request_id: str
    num_tokens: int
    source_blocks: tuple[tuple[int, ...], ...]
    lease_s: float
    lease_remaining_s: float
    destination_pool_id: str
    hit_tokens: int
    pull_tokens: int
    hit_blocks: int
    pull_blocks: int
    blocks_pulled: int
    started_at: float
    ended_at: float
    reason: str
    block_size: int
    source_freed: bool


def transfer_from_proto(message: pd_pb2.Transfer) -> Transfer:
    """Decode a ``kvcm.v1.Transfer``."""
    return Transfer(
        pool_id=message.pool_id,
        transfer_id=message.transfer_id,
        state=TransferState(message.state),
        record_only=message.record_only,
        request_key=message.request_key,
        request_id=message.request_id,
        num_tokens=message.num_tokens,
        source_blocks=tuple(tuple(ids) for ids in grouped_from_proto(message.source_blocks)),
        lease_s=message.lease_s,
        lease_remaining_s=message.lease_remaining_s,
        destination_pool_id=message.destination_pool_id,
        hit_tokens=message.hit_tokens,
        pull_tokens=message.pull_tokens,
        hit_blocks=message.hit_blocks,
        pull_blocks=message.pull_blocks,
        blocks_pulled=message.blocks_pulled,
        started_at=message.started_at,
        ended_at=message.ended_at,
        reason=message.reason,
        block_size=message.block_size,
        source_freed=message.source_freed,
    )


class TransferListing(list[Transfer]):
    """``list_transfers``' answer: a list of ``Transfer`` in the server's order.

    Attributes:
        missing_replicas: In a kvcm cluster, the replicas that did not answer a listing of
            every pool in time (their transfers are not listed); empty when every replica
            answered, and from one server.
    """

    __slots__ = ("missing_replicas",)

    def __init__(
        self, transfers: Iterable[Transfer], missing_replicas: tuple[str, ...] = ()
    ) -> None:
        """The transfers, and the replicas the listing missed."""
        super().__init__(transfers)
        self.missing_replicas = missing_replicas
