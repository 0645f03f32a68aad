"""kvcm's host tier as the index of vLLM 0.33's offloading connector.

vLLM's ``OffloadingConnector`` loads an out-of-tree ``OffloadingSpec`` named by ``spec_name``
and ``spec_module_path`` in ``kv_connector_extra_config``::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvcmOffloadingSpec",
            "spec_module_path": "kvcm.integrations.vllm", "cpu_bytes_to_use": 8000000000}}'

:class:`KvcmOffloadingSpec` is vLLM's ``CPUOffloadingSpec`` (the same host buffer sizing, the
same worker: vLLM's CPU transfer handlers move the bytes) whose scheduler-side index,
:class:`KvcmOffloadingManager`, is a :class:`kvcm.core.host_tier.HostTier`: one host block per
offloaded chunk, an LRU eviction order, pins while loads run, pending blocks until their store
completes. The tier lives in the engine process, next to the scheduler (the connector calls it
synchronously on every step). Under kvcm's scheduler with a server (mirror or remote mode) every
call that changes the tier is also recorded as a HOST_SYNC op of the step's program
(:class:`~kvcm.core.host_tier.SyncAction`), which the server's pool (created with
``offload_host_blocks``) replays with the same :func:`~kvcm.core.host_tier.apply_sync`: its
Lookup, KV events and metrics show the engine's tier.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcm.common.errors import FailedPreconditionError
from kvcm.common.hashing import BlockHashWithGroupId
from kvcm.core.host_tier import HIT, PENDING, HostTier, SyncAction, apply_sync
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

__all__ = ["KvcmOffloadingManager", "KvcmOffloadingSpec"]

_LOOKUP = {HIT: LookupResult.HIT, PENDING: LookupResult.HIT_PENDING}


@dataclass
class _RequestKeys:
    # The chunks one request stored or read, first seen first (per-request scratch state in
    # vLLM's ReqContext).
    owner: object
    keys: dict[BlockHashWithGroupId, None] = field(default_factory=dict)


def _keys(keys: Iterable[OffloadKey]) -> list[BlockHashWithGroupId]:
    # vLLM's offload key and kvcm's cache key are the same bytes: the block hash, then the
    # group index in 4 big-endian bytes.
    return [BlockHashWithGroupId(key) for key in keys]


class KvcmOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` answered by a kvcm :class:`HostTier` (one chunk, one block).

    Attributes:
        host: The tier.
        sync: Called with each call that changes the tier, as ``(SyncAction, keys)`` after it
            was applied (kvcm's scheduler records them for the server); ``None``: nobody.
    """

    def __init__(
        self,
        num_chunks: int,
        *,
        enable_events: bool = False,
        tokens_per_key: Sequence[int] = (),
    ) -> None:
        """A tier of ``num_chunks`` host blocks; ``enable_events``: record OffloadingEvents;
        ``tokens_per_key``: per KV-cache group, the tokens one chunk holds (hit counts)."""
        self.host = HostTier(num_chunks, connector=True)
        self.sync: Callable[[int, Sequence[BlockHashWithGroupId]], None] | None = None
        self._tokens_per_key = tuple(tokens_per_key)
        self._events: list[OffloadingEvent] | None = [] if enable_events else None

    def _apply(self, action: SyncAction, keys: Sequence[BlockHashWithGroupId]) -> Any:
        # The one way the tier changes: the server's copy replays the same call (HOST_SYNC).
        result = apply_sync(self.host, action, keys, self._tokens_per_key)
        if self.sync is not None and (keys or action == SyncAction.CLEAR):
            self.sync(action, keys)
        return result

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the tier holds the chunk ready, HIT_PENDING while its store runs."""
        return _LOOKUP.get(self.host.lookup(BlockHashWithGroupId(key)), LookupResult.MISS)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """Host memory."""
        return CacheHitSource.HOST

    def _seen(self, req_context: ReqContext, keys: Iterable[BlockHashWithGroupId]) -> None:
        state = req_context.get_state(_RequestKeys)
        if state is None or state.owner is not self:
            state = _RequestKeys(self)
            req_context.set_state(state)
        state.keys.update(dict.fromkeys(keys))

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the chunks until ``complete_load``; where they are."""
        held = _keys(keys)
        for key in held:
            if self.host.lookup(key) != HIT:
                raise FailedPreconditionError(f"host tier holds no ready block for key {key!r}")
        self._seen(req_context, held)
        return CPULoadStoreSpec(self._apply(SyncAction.LOAD, held))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark a request's chunks used, its head the most recent."""
        self._apply(SyncAction.TOUCH, _keys(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin loaded chunks."""
        self._apply(SyncAction.LOADED, _keys(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve blocks for the chunks not held yet, evicting least recently used ones."""
        offered = _keys(keys)
        # Among the new chunks, the head ends most recent (a request's tail is evicted first).
        stored = self._apply(SyncAction.STORE, offered)
        if stored is None:
            return None
        new, host_ids, evicted = stored
        self._seen(req_context, (key for key in offered if key in self.host))
        if evicted and self._events is not None:
            self._events.append(
                OffloadingEvent(
                    keys=[OffloadKey(k) for k in evicted], medium=Medium.CPU, removed=True
                )
            )
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in new],
            store_spec=CPULoadStoreSpec(host_ids),
            evicted_keys=[OffloadKey(k) for k in evicted],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Make stored chunks loadable (or release them when the copy failed)."""
        pending = self.host.pending_keys()
        done = [key for key in _keys(keys) if key in pending]
        self._apply(SyncAction.STORED if success else SyncAction.STORE_FAILED, done)
        if done and self._events is not None:
            self._events.append(
                OffloadingEvent(
                    keys=[OffloadKey(k) for k in done],
                    medium=Medium.CPU,
                    removed=not success,
                    metadata_only=not success,
                )
            )

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Every request offloads chunk by chunk (vLLM's default policy)."""
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """The request used its chunks: touch them in prefix order (its head most recent)."""
        state = req_context.get_state(_RequestKeys)
        if state is None or state.owner is not self:
            return
        req_context.set_state(_RequestKeys(self))
        keys = [key for key in state.keys if key in self.host]
        positions = [req_context.get_offload_key_position(OffloadKey(key)) for key in keys]
        if None not in positions:
            order = sorted(range(len(keys)), key=positions.__getitem__)
            keys = [keys[i] for i in order]
        self._apply(SyncAction.TOUCH, keys)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The stores and evictions since the last take."""
        if self._events is None:
            return ()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Forget every chunk (the connector ignores the jobs in flight from now on)."""
        self._apply(SyncAction.CLEAR, [])


class KvcmOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading with kvcm's host tier as its scheduler-side index."""

    def __init__(self, config: Any) -> None:
        """Size the host buffer as vLLM's CPU spec does (``cpu_bytes_to_use``)."""
        super().__init__(config)
        self._kvcm_manager: KvcmOffloadingManager | None = None

    def get_manager(self) -> OffloadingManager:
        """The scheduler side's index: one :class:`KvcmOffloadingManager` per spec."""
        if self._kvcm_manager is None:
            tokens: dict[int, int] = {
                group.group_id: group.tokens_per_block * self.blocks_per_chunk
                for group in self.config.groups
            }
            self._kvcm_manager = KvcmOffloadingManager(
                self.num_chunks,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                tokens_per_key=[tokens.get(g, 0) for g in range(max(tokens, default=-1) + 1)],
            )
        return self._kvcm_manager
