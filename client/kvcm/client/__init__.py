"""kvcm's client SDK for schedulers and GPU workers.

- ``SchedulerClient`` / ``AsyncSchedulerClient``: every scheduler, admin and event call, sync
  and asyncio, with the Step RPC (``StepBuilder`` -> ``StepResult``) as the hot path.
- ``RemoteKVCacheManager``: vLLM 0.33's ``KVCacheManager`` methods over a kvcm pool.
- ``WorkerClient``: registers a rank's layers and builds its KV-cache tensors.
- ``lookup(LookupQuery)`` on both scheduler clients: routers' exact prefix lookup across pools;
  ``route_pd(PdRouteQuery)``: a P/D proxy's choice of prefill and decode engine on it.

Failures raise ``ServiceError`` subclasses (which are also the ``kvcm.common.errors`` classes
the core raises), never ``grpc.RpcError``. Names are imported on first use, so importing the
package costs nothing and torch is only imported by the tensor helpers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcm.client._base import RETRY_POLICY, RetryPolicy, TlsConfig
    from kvcm.client._errors import (
        CallCancelledError,
        DeadlineExceededError,
        InternalError,
        OutOfRangeError,
        PermissionDeniedError,
        ServiceAlreadyExistsError,
        ServiceError,
        ServiceFailedPreconditionError,
        ServiceInvalidArgumentError,
        ServiceNotFoundError,
        ServiceOutOfRangeError,
        ServiceResourceExhaustedError,
        StatusCode,
        StepRejection,
        UnavailableError,
        UnimplementedError,
    )
    from kvcm.client._step import HostAllocResult, LookupResult, StepBuilder, StepResult
    from kvcm.client._transfers import Transfer, TransferListing, TransferState
    from kvcm.client._types import (
        DEFAULT_TIMEOUT_S,
        REGISTER_WORKER_TIMEOUT_S,
        USE_CLIENT_DEFAULT,
        CacheHit,
        EventBatch,
        FreeMode,
        HashingParameters,
        ItemStatus,
        KVCacheBlocks,
        LeaseExpiry,
        PoolConfig,
        PoolInfo,
        PoolListing,
        PoolState,
        PoolSummary,
        PrefixCacheStats,
        RequestBlocks,
        SlotOptions,
        Usage,
        UseClientDefault,
    )
    from kvcm.client.aio import AsyncEventStream, AsyncSchedulerClient
    from kvcm.client.remote_manager import RemoteKVCacheManager, SchedulerRequest
    from kvcm.client.scheduler import EventStream, SchedulerClient
    from kvcm.client.worker import WorkerClient, WorkerRegistration
    from kvcm.core.lookup import LookupAnswer, LookupQuery, PoolHit, PoolLoad
    from kvcm.core.pd_route import HeldRequest, PdRoute, PdRouteQuery, PdScope

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "REGISTER_WORKER_TIMEOUT_S",
    "RETRY_POLICY",
    "USE_CLIENT_DEFAULT",
    "AsyncEventStream",
    "AsyncSchedulerClient",
    "CacheHit",
    "CallCancelledError",
    "DeadlineExceededError",
    "EventBatch",
    "EventStream",
    "FreeMode",
    "LeaseExpiry",
    "HashingParameters",
    "HeldRequest",
    "InternalError",
    "HostAllocResult",
    "ItemStatus",
    "KVCacheBlocks",
    "LookupAnswer",
    "LookupQuery",
    "LookupResult",
    "OutOfRangeError",
    "PdRoute",
    "PdRouteQuery",
    "PdScope",
    "PermissionDeniedError",
    "PoolConfig",
    "PoolHit",
    "PoolInfo",
    "PoolListing",
    "PoolLoad",
    "PoolState",
    "PoolSummary",
    "PrefixCacheStats",
    "RemoteKVCacheManager",
    "RequestBlocks",
    "RetryPolicy",
    "SchedulerClient",
    "SchedulerRequest",
    "ServiceAlreadyExistsError",
    "ServiceError",
    "ServiceFailedPreconditionError",
    "ServiceInvalidArgumentError",
    "ServiceNotFoundError",
    "ServiceOutOfRangeError",
    "ServiceResourceExhaustedError",
    "SlotOptions",
    "StatusCode",
    "StepBuilder",
    "StepRejection",
    "StepResult",
    "TlsConfig",
    "Transfer",
    "TransferListing",
    "TransferState",
    "UnavailableError",
    "UnimplementedError",
    "Usage",
    "UseClientDefault",
    "WorkerClient",
    "WorkerRegistration",
]

_MODULE_OF = {
    "AsyncEventStream": "aio",
    "AsyncSchedulerClient": "aio",
    "CacheHit": "_types",
    "CallCancelledError": "_errors",
    "DEFAULT_TIMEOUT_S": "_types",
    "DeadlineExceededError": "_errors",
    "EventBatch": "_types",
    "EventStream": "scheduler",
    "FreeMode": "_types",
    "LeaseExpiry": "_types",
    "HashingParameters": "_types",
    "HeldRequest": "kvcm.core.pd_route",
    "InternalError": "_errors",
    "ItemStatus": "_types",
    "HostAllocResult": "_step",
    "KVCacheBlocks": "_types",
    "LookupAnswer": "kvcm.core.lookup",
    "LookupQuery": "kvcm.core.lookup",
    "LookupResult": "_step",
    "PoolHit": "kvcm.core.lookup",
    "PoolLoad": "kvcm.core.lookup",
    "OutOfRangeError": "_errors",
    "PdRoute": "kvcm.core.pd_route",
    "PdRouteQuery": "kvcm.core.pd_route",
    "PdScope": "kvcm.core.pd_route",
    "PermissionDeniedError": "_errors",
    "PoolConfig": "_types",
    "PoolInfo": "_types",
    "PoolListing": "_types",
    "PoolState": "_types",
    "PoolSummary": "_types",
    "PrefixCacheStats": "_types",
    "REGISTER_WORKER_TIMEOUT_S": "_types",
    "RETRY_POLICY": "_base",
    "RemoteKVCacheManager": "remote_manager",
    "RequestBlocks": "_types",
    "RetryPolicy": "_base",
    "TlsConfig": "_base",
    "Transfer": "_transfers",
    "TransferListing": "_transfers",
    "TransferState": "_transfers",
    "SchedulerClient": "scheduler",
    "SchedulerRequest": "remote_manager",
    "ServiceAlreadyExistsError": "_errors",
    "ServiceError": "_errors",
    "ServiceFailedPreconditionError": "_errors",
    "ServiceInvalidArgumentError": "_errors",
    "ServiceNotFoundError": "_errors",
    "ServiceOutOfRangeError": "_errors",
    "ServiceResourceExhaustedError": "_errors",
    "SlotOptions": "_types",
    "StatusCode": "_errors",
    "StepBuilder": "_step",
    "StepRejection": "_errors",
    "StepResult": "_step",
    "USE_CLIENT_DEFAULT": "_types",
    "UnavailableError": "_errors",
    "UnimplementedError": "_errors",
    "Usage": "_types",
    "UseClientDefault": "_types",
    "WorkerClient": "worker",
    "WorkerRegistration": "worker",
}


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    qualified = module if module.startswith("kvcm.") else f"{__name__}.{module}"
    value = getattr(importlib.import_module(qualified), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
