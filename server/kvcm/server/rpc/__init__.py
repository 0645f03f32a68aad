"""kvcm's gRPC layer: thin servicers over the core, one error table, the Step codec.

``add_servicers`` registers the four kvcm.v1 services on a ``grpc.aio`` server;
``TelemetryInterceptor`` maps errors to statuses and observes every call.
"""

from __future__ import annotations

import grpc

from kvcm.server.rpc._admin import AdminServicer
from kvcm.server.rpc._events import EventServicer
from kvcm.server.rpc._interceptor import TelemetryInterceptor
from kvcm.server.rpc._scheduler import SchedulerServicer
from kvcm.server.rpc._state import PoolRuntime, ServerState
from kvcm.server.rpc._status import (
    STATUS_FOR_ERROR,
    STEP_REJECTION_TRAILER,
    AbortRpc,
    StepRejectedError,
    status_of,
)
from kvcm.server.rpc._worker import WorkerServicer
from kvcm.v1 import service_pb2, service_pb2_grpc

__all__ = [
    "SERVICE_NAMES",
    "STATUS_FOR_ERROR",
    "STEP_REJECTION_TRAILER",
    "AbortRpc",
    "AdminServicer",
    "EventServicer",
    "PoolRuntime",
    "SchedulerServicer",
    "ServerState",
    "StepRejectedError",
    "TelemetryInterceptor",
    "WorkerServicer",
    "add_servicers",
    "status_of",
]

SERVICE_NAMES: tuple[str, ...] = tuple(
    service.full_name for service in service_pb2.DESCRIPTOR.services_by_name.values()
)


def add_servicers(server: grpc.aio.Server, state: ServerState) -> None:
    """Register the four kvcm.v1 services on ``server``, all serving ``state``."""
    service_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(state), server)  # type: ignore[no-untyped-call]
    service_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(state), server)  # type: ignore[no-untyped-call]
    service_pb2_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(state), server)  # type: ignore[no-untyped-call]
    service_pb2_grpc.add_EventServiceServicer_to_server(EventServicer(state), server)  # type: ignore[no-untyped-call]
