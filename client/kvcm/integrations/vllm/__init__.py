"""kvcm for vLLM 0.33: its real scheduler, with kvcm managing the KV cache.

Set ``SchedulerConfig.scheduler_cls`` (``--scheduler-cls``) to
``kvcm.integrations.vllm.KvcmAsyncScheduler`` (or ``KvcmScheduler`` without async
scheduling); settings come from ``--additional-config '{"kvcm": {...}}'`` or ``KVCM_*``
variables. See docs/vllm.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcm.integrations.vllm._manager import MirrorKVCacheManager, MirrorManagerConfig
from kvcm.integrations.vllm._metrics import register_engine_metrics
from kvcm.integrations.vllm._recorder import RecordedStep, StepRecorder
from kvcm.integrations.vllm._settings import KvcmSettings
from kvcm.integrations.vllm._sinks import CollectingSink, LocalSink, NullSink, StepSink

if TYPE_CHECKING:
    from kvcm.integrations.vllm._nixl import KvcmNixlConnector
    from kvcm.integrations.vllm._offload import KvcmOffloadingManager, KvcmOffloadingSpec
    from kvcm.integrations.vllm._scheduler import (
        KvcmAsyncScheduler,
        KvcmScheduler,
        check_supported,
    )

# The schedulers subclass vLLM's: import vLLM only when one is asked for, so the settings, the
# recorder and the sinks stay importable (and testable) without vLLM.
_NEEDS_VLLM = frozenset({"KvcmAsyncScheduler", "KvcmScheduler", "check_supported"})
# vLLM's offloading connector loads the spec by name from this package (spec_module_path).
_OFFLOAD = frozenset({"KvcmOffloadingManager", "KvcmOffloadingSpec"})
# vLLM's KV-connector factory loads the connector by name from this package
# (kv_connector_module_path); it subclasses vLLM's NIXL connector.
_CONNECTOR = frozenset({"KvcmNixlConnector"})


def __getattr__(name: str) -> Any:
    if name in _CONNECTOR:
        from kvcm.integrations.vllm import _nixl

        return getattr(_nixl, name)
    if name in _OFFLOAD:
        from kvcm.integrations.vllm import _offload

        return getattr(_offload, name)
    if name in _NEEDS_VLLM:
        from kvcm.integrations.vllm import _scheduler

        return getattr(_scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CollectingSink",
    "KvcmAsyncScheduler",
    "KvcmNixlConnector",
    "KvcmOffloadingManager",
    "KvcmOffloadingSpec",
    "KvcmScheduler",
    "KvcmSettings",
    "LocalSink",
    "MirrorKVCacheManager",
    "MirrorManagerConfig",
    "NullSink",
    "RecordedStep",
    "StepRecorder",
    "StepSink",
    "check_supported",
    "register_engine_metrics",
]
