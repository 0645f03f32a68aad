"""kvcm's gRPC layer: thin servicers over the core, one error table, the Step codec.

``add_servicers`` registers the five kvcm.v1 services on a ``grpc.aio`` server;
``TelemetryInterceptor`` maps errors to statuses and observes every call.
"""

from __future__ import annotations

import grpc

from kvcm.server.rpc._admin import AdminServicer, check_replication_mode
from kvcm.server.rpc._durability import (
    JournalInterceptor,
    checkpoint_live,
    checkpoint_of,
    delete_pool_journaled,
    recover,
    replay_records,
)
from kvcm.server.rpc._events import EventServicer, subscriber_keepalive
from kvcm.server.rpc._handlers import UndecodableRequest, register_services
from kvcm.server.rpc._interceptor import MethodInterceptor, TelemetryInterceptor
from kvcm.server.rpc._leases import LeaseMonitor
from kvcm.server.rpc._lookup import LookupDeniedError, lookup_as
from kvcm.server.rpc._lookup_port import LookupPort
from kvcm.server.rpc._pd_route import PD_ROUTE_COUNTERS, RoutingServicer, route_pd, route_pd_as
from kvcm.server.rpc._scheduler import SchedulerServicer
from kvcm.server.rpc._state import PRINCIPAL, PoolRuntime, Principal, ServerState, may_hash
from kvcm.server.rpc._status import (
    STATUS_FOR_ERROR,
    AbortRpc,
    StepRejectedError,
    status_details,
    status_of,
)
from kvcm.server.rpc._transfers import (
    TransferServicer,
    TransferView,
    decode_transfers,
    encode_transfers,
    list_transfers,
    transfer_to_proto,
)
from kvcm.server.rpc._worker import WorkerServicer
from kvcm.v1 import service_pb2

__all__ = [
    "LookupDeniedError",
    "LookupPort",
    "lookup_as",
    "PD_ROUTE_COUNTERS",
    "route_pd",
    "route_pd_as",
    "PRINCIPAL",
    "Principal",
    "may_hash",
    "SERVICE_NAMES",
    "STATUS_FOR_ERROR",
    "AbortRpc",
    "AdminServicer",
    "EventServicer",
    "JournalInterceptor",
    "checkpoint_live",
    "delete_pool_journaled",
    "replay_records",
    "LeaseMonitor",
    "MethodInterceptor",
    "PoolRuntime",
    "SchedulerServicer",
    "ServerState",
    "StepRejectedError",
    "TelemetryInterceptor",
    "UndecodableRequest",
    "TransferServicer",
    "TransferView",
    "WorkerServicer",
    "add_servicers",
    "check_replication_mode",
    "decode_transfers",
    "encode_transfers",
    "list_transfers",
    "transfer_to_proto",
    "checkpoint_of",
    "recover",
    "status_details",
    "status_of",
    "subscriber_keepalive",
]

SERVICE_NAMES: tuple[str, ...] = tuple(
    service.full_name for service in service_pb2.DESCRIPTOR.services_by_name.values()
)


def add_servicers(server: grpc.aio.Server, state: ServerState) -> None:
    """Register the six kvcm.v1 services on ``server``, all serving ``state``.

    Requests decode through :mod:`~kvcm.server.rpc._handlers`: undecodable bytes end the call
    with INVALID_ARGUMENT (via the interceptor) instead of grpc's uncounted UNKNOWN.
    """
    register_services(
        server,
        {
            "AdminService": AdminServicer(state),
            "WorkerService": WorkerServicer(state),
            "SchedulerService": SchedulerServicer(state),
            "EventService": EventServicer(state),
            "LookupService": RoutingServicer(state),
            "TransferService": TransferServicer(state),
        },
    )
