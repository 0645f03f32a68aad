"""kvcm's allocation core: vLLM 0.33 V1 KV-cache semantics as a pure-Python library.

Deterministic and I/O free: no grpc, fastapi or prometheus_client imports (a test proves it).

The public names below are imported lazily on first use, so importing one low-level module
(``kvcm.core.block``) does not pull in the whole manager stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcm.core.block import FreeKVCacheBlockQueue, KVCacheBlock
    from kvcm.core.block_pool import BlockPool
    from kvcm.core.coordinator import (
        HybridKVCacheCoordinator,
        KVCacheCoordinator,
        KVCacheCoordinatorNoPrefixCache,
        UnitaryKVCacheCoordinator,
        get_kv_cache_coordinator,
    )
    from kvcm.core.manager import (
        DEFAULT_SLOT_OPTIONS,
        CacheHit,
        KVCacheBlocks,
        KVCacheManager,
        KVCacheManagerConfig,
        SlotOptions,
    )
    from kvcm.core.request import Request, RequestStatus
    from kvcm.core.single_type_managers import (
        ChunkedLocalAttentionManager,
        CrossAttentionManager,
        FullAttentionManager,
        MambaManager,
        SingleTypeKVCacheManager,
        SlidingWindowManager,
        get_manager_for_kv_cache_spec,
    )
    from kvcm.core.stats import PrefixCacheStats, PrefixCachingMetrics

__all__ = [
    "DEFAULT_SLOT_OPTIONS",
    "BlockPool",
    "CacheHit",
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "HybridKVCacheCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheManager",
    "KVCacheManagerConfig",
    "MambaManager",
    "PrefixCacheStats",
    "PrefixCachingMetrics",
    "Request",
    "RequestStatus",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "SlotOptions",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
    "get_manager_for_kv_cache_spec",
]

_MODULE_OF = {
    "BlockPool": "block_pool",
    "CacheHit": "manager",
    "ChunkedLocalAttentionManager": "single_type_managers",
    "CrossAttentionManager": "single_type_managers",
    "DEFAULT_SLOT_OPTIONS": "manager",
    "FreeKVCacheBlockQueue": "block",
    "FullAttentionManager": "single_type_managers",
    "HybridKVCacheCoordinator": "coordinator",
    "KVCacheBlock": "block",
    "KVCacheBlocks": "manager",
    "KVCacheCoordinator": "coordinator",
    "KVCacheCoordinatorNoPrefixCache": "coordinator",
    "KVCacheManager": "manager",
    "KVCacheManagerConfig": "manager",
    "MambaManager": "single_type_managers",
    "PrefixCacheStats": "stats",
    "PrefixCachingMetrics": "stats",
    "Request": "request",
    "RequestStatus": "request",
    "SingleTypeKVCacheManager": "single_type_managers",
    "SlidingWindowManager": "single_type_managers",
    "SlotOptions": "manager",
    "UnitaryKVCacheCoordinator": "coordinator",
    "get_kv_cache_coordinator": "coordinator",
    "get_manager_for_kv_cache_spec": "single_type_managers",
}


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
