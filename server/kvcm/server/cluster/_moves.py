"""Moving a pool between live replicas, and draining a replica (``kvcm cluster move|drain``).

The same mechanism as a failover, driven by an operator instead of a lease expiry:

1. the target becomes the pool's standby (one etcd transaction, same epoch, compare-and-swap
   on the record); the primary's replication seeds it and it follows live;
2. once the target has applied every record the primary had shipped when step 2 began (its
   ``GetReplicaState.seq`` reaches the primary's), one more transaction names the target
   primary, the old primary its standby, and the **epoch plus one**;
3. every replica's watch delivers the record: the target promotes its copy, the old primary
   steps down (fencing: in ``sync`` mode it acknowledges nothing more; a call it had applied
   and not yet acknowledged answers UNAVAILABLE and its client resends it to the new
   primary, a Step by its ``step_seq``) and is then seeded as the standby.

Nothing here runs inside a replica: it is etcd transactions plus ``ReplicaService`` reads
(admin role), so a replica's public surface does not grow. Where the cluster speaks TLS, the
etcd session and the replicas' channels take the operator's credentials
(``etcd_credentials``, ``replica_credentials``).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvcm.server.cluster._etcd import EtcdSession
from kvcm.server.cluster.placement import Placement
from kvcm.v1 import replica_pb2, replica_pb2_grpc

__all__ = ["MoveError", "drain_replica", "move_pool"]

_POLL_S = 0.05
# The TLS credentials of the replicas' channels in this move or drain (None: plaintext).
_REPLICA_CREDENTIALS: contextvars.ContextVar[grpc.ChannelCredentials | None] = (
    contextvars.ContextVar("kvcm_move_replica_credentials", default=None)
)


class MoveError(Exception):
    """A move that cannot be done (unknown pool or replica, no copy in time); nothing more
    changed than the message says."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Etcd:
    session: EtcdSession
    prefix: str

    def placement_key(self, pool_id: str) -> bytes:
        return f"{self.prefix}/placement/{pool_id}".encode()

    async def placement(self, pool_id: str) -> Placement | None:
        key = self.placement_key(pool_id)
        got = await self.session.call(lambda c: c.get(key))
        return None if got is None else Placement.decode(got.value)

    async def placements(self) -> list[Placement]:
        prefix = f"{self.prefix}/placement/".encode()
        listing = await self.session.call(lambda c: c.get_prefix(prefix))
        return [Placement.decode(kv.value) for kv in listing]

    async def live(self) -> set[str]:
        prefix = f"{self.prefix}/replicas/".encode()
        listing = await self.session.call(lambda c: c.get_prefix(prefix))
        return {str(json.loads(kv.value)["address"]) for kv in listing}

    async def swap(self, expected: Placement, new: Placement) -> bool:
        key = self.placement_key(expected.pool_id)
        tx = self.session.client.transactions

        async def swap(client: Any) -> tuple[bool, Any]:
            return await client.transaction(  # type: ignore[no-any-return]
                compare=[tx.value(key) == expected.encode()],
                success=[tx.put(key, new.encode())],
                failure=[],
            )

        won, _ = await self.session.call(swap)
        return bool(won)


async def _replica_state(
    address: str, pool_id: str, metadata: Sequence[tuple[str, str]], timeout_s: float
) -> replica_pb2.GetReplicaStateResponse:
    credentials = _REPLICA_CREDENTIALS.get()
    async with (
        grpc.aio.insecure_channel(address)
        if credentials is None
        else grpc.aio.secure_channel(address, credentials)
    ) as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]
        answer: replica_pb2.GetReplicaStateResponse = await stub.GetReplicaState(
            replica_pb2.GetReplicaStateRequest(pool_id=pool_id),
            timeout=timeout_s,
            metadata=tuple(metadata),
        )
        return answer


async def move_pool(
    endpoints: Sequence[tuple[str, int]],
    prefix: str,
    pool_id: str,
    target: str,
    *,
    metadata: Sequence[tuple[str, str]] = (),
    timeout_s: float = 60.0,
    etcd_credentials: Callable[[], grpc.ChannelCredentials] | None = None,
    replica_credentials: grpc.ChannelCredentials | None = None,
) -> Placement:
    """Make ``target`` (a live replica's advertise address) the primary of ``pool_id``.

    Args:
        endpoints: etcd's client endpoints, ``(host, port)``.
        prefix: The cluster's etcd key prefix (``etcd_prefix``).
        pool_id: The pool.
        target: The advertise address of the replica that is to serve it.
        metadata: Sent with each ``GetReplicaState`` (an admin token's ``authorization``).
        timeout_s: How long the target may take to catch up and promote.
        etcd_credentials: TLS to etcd (:func:`kvcm.server.tls.etcd_credentials`; ``None``:
            plaintext).
        replica_credentials: TLS to the replicas (``None``: plaintext).

    Returns:
        The pool's placement once ``target`` serves it (unchanged if it already did).

    Raises:
        MoveError: No such pool, ``target`` is not live, or the target's copy did not catch
            up (or promote) within ``timeout_s``.
        EtcdUnavailableError: etcd could not be reached.
    """
    session = EtcdSession(endpoints, timeout_s=5.0, credentials=etcd_credentials)
    _REPLICA_CREDENTIALS.set(replica_credentials)
    try:
        return await _move(_Etcd(session, prefix), pool_id, target, metadata, timeout_s)
    finally:
        await session.close()


async def _move(
    etcd: _Etcd,
    pool_id: str,
    target: str,
    metadata: Sequence[tuple[str, str]],
    timeout_s: float,
) -> Placement:
    prefix = etcd.prefix
    deadline = time.monotonic() + timeout_s
    while True:
        current = await etcd.placement(pool_id)
        if current is None:
            raise MoveError(f"pool {pool_id!r} has no placement under {prefix}/")
        if current.primary == target:
            return current
        if target not in await etcd.live():
            raise MoveError(f"{target} is not a live replica under {prefix}/replicas/")
        if current.standby != target:
            standing = dataclasses.replace(current, standby=target)
            if not await etcd.swap(current, standing):
                continue  # the record changed meanwhile (a failover, another move): again
            current = standing
        # The target follows once seeded (``has_copy``); then wait for it to hold what the
        # primary had shipped on that link when it was seen seeded.
        state = await _wait_for_copy(target, pool_id, current.epoch, metadata, deadline)
        shipped = (await _replica_state(current.primary, pool_id, metadata, 10.0)).seq
        while state.seq < shipped:
            if time.monotonic() > deadline or not state.has_copy:
                raise MoveError(
                    f"pool {pool_id!r}: {target} did not catch up with its primary within "
                    f"{timeout_s:g}s (record {state.seq} of {shipped}); it stays the standby"
                )
            await asyncio.sleep(_POLL_S)
            state = await _replica_state(target, pool_id, metadata, 10.0)
        moved = dataclasses.replace(  # the pool keeps its replication mode
            current, primary=target, standby=current.primary, epoch=current.epoch + 1
        )
        if not await etcd.swap(current, moved):
            continue
        while (await _replica_state(target, pool_id, metadata, 10.0)).role != "primary":
            if time.monotonic() > deadline:
                raise MoveError(
                    f"pool {pool_id!r}: placed on {target} at epoch {moved.epoch}, which has "
                    f"not promoted its copy within {timeout_s:g}s"
                )
            await asyncio.sleep(_POLL_S)
        # The old primary stepped down; once the new primary seeded it, the pool has a
        # standby again (a failover right after the move loses nothing).
        await _wait_for_copy(current.primary, pool_id, moved.epoch, metadata, deadline)
        return moved


async def _wait_for_copy(
    address: str,
    pool_id: str,
    epoch: int,
    metadata: Sequence[tuple[str, str]],
    deadline: float,
) -> replica_pb2.GetReplicaStateResponse:
    """The replica's state once it is the pool's standby at ``epoch`` with a seeded copy."""
    while True:
        state = await _replica_state(address, pool_id, metadata, 10.0)
        if state.role == "standby" and state.placement_epoch == epoch and state.has_copy:
            return state
        if time.monotonic() > deadline:
            raise MoveError(
                f"pool {pool_id!r}: {address} holds no copy of the pool at epoch {epoch} "
                f"(it is {state.role or 'without it'} at epoch {state.placement_epoch}); "
                "the placement stays as it is"
            )
        await asyncio.sleep(_POLL_S)


async def drain_replica(
    endpoints: Sequence[tuple[str, int]],
    prefix: str,
    address: str,
    *,
    metadata: Sequence[tuple[str, str]] = (),
    timeout_s: float = 60.0,
    etcd_credentials: Callable[[], grpc.ChannelCredentials] | None = None,
    replica_credentials: grpc.ChannelCredentials | None = None,
) -> list[Placement]:
    """Move every pool whose primary is ``address`` to its standby (if live), else to the
    live replica with the fewest primaries (then standbys, then address), one pool at a time;
    ``address`` is left with standbys only (stopping it then costs no failover of a primary).
    The arguments are :func:`move_pool`'s.

    Returns:
        The moved pools' new placements.

    Raises:
        MoveError: No other live replica, or a move failed (the pools before it stay moved).
        EtcdUnavailableError: etcd could not be reached.
    """
    session = EtcdSession(endpoints, timeout_s=5.0, credentials=etcd_credentials)
    _REPLICA_CREDENTIALS.set(replica_credentials)
    try:
        return await _drain(_Etcd(session, prefix), address, metadata, timeout_s)
    finally:
        await session.close()


async def _drain(
    etcd: _Etcd, address: str, metadata: Sequence[tuple[str, str]], timeout_s: float
) -> list[Placement]:
    moved: list[Placement] = []
    while True:
        placements = await etcd.placements()
        left = sorted(p.pool_id for p in placements if p.primary == address)
        if not left:
            return moved
        others = (await etcd.live()) - {address}
        if not others:
            raise MoveError(f"drain {address}: no other live replica to move its pools to")
        primaries = dict.fromkeys(others, 0)
        standbys = dict.fromkeys(others, 0)
        for placement in placements:
            if placement.primary in primaries:
                primaries[placement.primary] += 1
            if placement.standby in standbys:
                standbys[placement.standby] += 1
        first = next(p for p in placements if p.pool_id == left[0])
        if first.standby in others:  # already holds a copy: the cheapest move
            target = first.standby
        else:
            target = min(others, key=lambda a: (primaries[a], standbys[a], a))
        moved.append(await _move(etcd, left[0], target, metadata, timeout_s))
