"""ReplicaService: the gRPC face of :class:`~kvcm.server.cluster.replication.Replication`.

Codecs only: ``ShipRecords`` hands the stream to the standby side, ``SetPlacement`` installs a
placement (how a test or an operator sets one without etcd), ``GetReplicaState`` reads a
pool's replication state. Registered only with a data directory (replication needs the
journal). Every method needs the ``replica`` role on every pool (``replica:*``) or ``admin:*``
(``access.RULES``): a tenant's token can neither ship records nor set a placement.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from kvcm.server.cluster.placement import Placement
from kvcm.server.cluster.replication import PromotionRefusedError, Replication
from kvcm.server.rpc import AbortRpc
from kvcm.v1 import replica_pb2, replica_pb2_grpc

__all__ = ["ReplicaServicer", "add_replica_servicer"]

Context: TypeAlias = Any


class ReplicaServicer(replica_pb2_grpc.ReplicaServiceServicer):
    """ShipRecords, SetPlacement, GetReplicaState over one :class:`Replication`."""

    def __init__(self, replication: Replication) -> None:
        """Serve ``replication``."""
        self._replication = replication

    async def ShipRecords(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[replica_pb2.ShipRecordsRequest], context: Context
    ) -> AsyncIterator[replica_pb2.ShipRecordsResponse]:
        """Apply what a primary ships (see :meth:`Replication.ship_records`)."""
        async for answer in self._replication.ship_records(request_iterator):
            yield answer

    async def SetPlacement(  # noqa: N802
        self, request: replica_pb2.SetPlacementRequest, context: Context
    ) -> replica_pb2.SetPlacementResponse:
        """Install a pool's placement on this replica."""
        problem = None
        if not request.pool_id:
            problem = "pool_id: must not be empty"
        elif not request.primary:
            problem = "primary: must not be empty"
        elif request.standby == request.primary:
            problem = f"standby: must differ from primary ({request.primary!r})"
        elif request.placement_epoch < 1:
            problem = "placement_epoch: must be >= 1 (placements start at epoch 1)"
        if problem is not None:
            raise AbortRpc(
                grpc.StatusCode.INVALID_ARGUMENT, f"SetPlacement: {problem}: nothing was changed"
            )
        placement = Placement(
            pool_id=request.pool_id,
            primary=request.primary,
            standby=request.standby or None,
            epoch=request.placement_epoch,
        )
        if request.mode not in (
            replica_pb2.REPLICATION_MODE_UNSPECIFIED,
            replica_pb2.REPLICATION_MODE_SYNC,
            replica_pb2.REPLICATION_MODE_ASYNC,
        ):
            raise AbortRpc(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"SetPlacement: mode: unknown value {request.mode}: nothing was changed",
            )
        replication = self._replication
        known = replication.pools.get(request.pool_id)
        if known is not None and request.placement_epoch < known.epoch:
            raise AbortRpc(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"SetPlacement: placement_epoch: {request.placement_epoch} is older than "
                f"{known.epoch}, the pool's epoch here: nothing was changed",
            )
        sync = request.mode != replica_pb2.REPLICATION_MODE_ASYNC
        try:
            role = await replication.set_placement(placement, sync=sync)
        except PromotionRefusedError as exc:
            raise AbortRpc(grpc.StatusCode.FAILED_PRECONDITION, f"SetPlacement: {exc}") from None
        entry = replication.entry(request.pool_id)
        return replica_pb2.SetPlacementResponse(role=role.value, placement_epoch=entry.epoch)

    async def GetReplicaState(  # noqa: N802
        self, request: replica_pb2.GetReplicaStateRequest, context: Context
    ) -> replica_pb2.GetReplicaStateResponse:
        """The pool's replication state on this replica."""
        if not request.pool_id:
            raise AbortRpc(
                grpc.StatusCode.INVALID_ARGUMENT, "GetReplicaState: pool_id: must not be empty"
            )
        return await self._replication.describe(request.pool_id)


def add_replica_servicer(server: grpc.aio.Server, replication: Replication) -> None:
    """Register ReplicaService on ``server``."""
    servicer = ReplicaServicer(replication)
    replica_pb2_grpc.add_ReplicaServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
