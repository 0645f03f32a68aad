"""A pool's state as canonical bytes: what "a rejected call changes nothing" is checked against.

:func:`state_fingerprint` serializes everything a call to a :class:`~kvcm.core.pool.Pool` can
change: the block pool (every block's ref_cnt, hash keys and prefix length, the free-queue
order, the prefix-cache map, pending events, eviction counter), each group manager's tables
(per-request block ids, cached block counts, new block ids), the manager's set of requests
holding blocks, its prefix-cache statistics and the copy drains it retains, the request table
(tokens, hashes, status, computed and in-flight tokens, preemptions, LoRA, salt), the
exactly-once guard, the counters,
the sequenced event log, the statistics totals, and the host tier's whole state (its keys in
recency order with their host blocks, pending keys, pins, private blocks, the free list in
order, swapped requests, counters, and the copies and events not taken yet).

The cost is O(state): one pass over blocks and requests, no sorting beyond the
dictionaries' keys. Two pools in the same state give the same bytes (dictionaries are written
in key order; sets sorted), so the scheduler-side mirror can compare its copy with the
server's. The kept events enter as their log's digest (:meth:`EventLog.digest`, one hash per
event, kept): a pool keeping tens of thousands of events costs only the events published since
its last fingerprint, so replication can compare copies of a long-lived pool (see
docs/replication.md). Not for a Step's path: an audit every few hundred records.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING

from kvcm.core._snapshot_codec import event_entry
from kvcm.core.block import KVCacheBlock
from kvcm.core.program import TRANSIENT

if TYPE_CHECKING:
    from kvcm.core.pool import Pool

__all__ = ["state_fingerprint"]


def _canon(value: object) -> object:
    """A value made of tuples, ints, strs, bytes, floats, bools and None only."""
    if isinstance(value, enum.Enum):
        return (type(value).__name__, value.value)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, KVCacheBlock):
        return value.block_id
    if isinstance(value, dict):
        items = [(_canon(k), _canon(v)) for k, v in value.items()]
        return ("dict", tuple(sorted(items, key=repr)))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted((_canon(v) for v in value), key=repr)))
    if isinstance(value, Iterable):
        return tuple(_canon(v) for v in value)
    if is_dataclass(value):
        return (
            type(value).__name__,
            tuple(
                (f.name, _canon(getattr(value, f.name)))
                for f in fields(value)
                if TRANSIENT not in f.metadata
            ),
        )
    return (type(value).__name__, _canon(vars(value)) if hasattr(value, "__dict__") else None)


def _block(block: KVCacheBlock) -> tuple[object, ...]:
    return (
        block.block_id,
        block.ref_cnt,
        block.block_hash,
        block.block_hash_num_tokens,
        block.is_null,
    )


def _manager_state(pool: Pool) -> tuple[object, ...]:
    manager = pool.manager
    if manager is None:
        return ()
    block_pool = manager.block_pool
    free = tuple(b.block_id for b in block_pool.free_block_queue.get_all_free_blocks())
    groups = tuple(
        (
            m.kv_cache_group_id,
            _canon(m.req_to_blocks),
            _canon(m.num_cached_block),
            tuple(m.new_block_ids),
        )
        for m in manager.coordinator.single_type_managers
    )
    return (
        tuple(_block(b) for b in block_pool.blocks),
        free,
        _canon(block_pool.cached_block_ids()),
        _canon(block_pool.kv_event_queue),
        block_pool.num_evicted_blocks,
        block_pool.num_events_emitted,
        groups,
        _canon(manager.requests_holding_blocks),
        _canon(manager.prefix_cache_stats),
        _canon(manager.prefix_caching_metrics),
        *((_canon(manager.retained_copy_batches),) if manager.retained_copy_batches else ()),
    )


def _request_state(pool: Pool) -> tuple[object, ...]:
    out = []
    for key in sorted(pool.requests):
        r = pool.requests[key]
        out.append(
            (
                key,
                pool.request_ids[key],
                r.request_id,
                tuple(r.prompt_token_ids),
                tuple(r.all_token_ids),
                tuple(r.block_hashes),
                _canon(r.status),
                r.num_computed_tokens,
                r.num_in_flight_tokens,
                r.num_preemptions,
                r.lora_id,
                r.lora_name,
                r.cache_salt,
                r.skip_reading_prefix_cache,
                r.report_cached_blocks,
            )
        )
    return tuple(out)


def _host_tier_state(pool: Pool) -> tuple[object, ...] | None:
    host = pool.host_tier
    if host is None:
        return None
    where = host.keys()
    return (
        host.num_blocks,
        tuple((key, where[key]) for key in host.recency()),
        _canon(host.pending_keys()),
        _canon(host.pinned()),
        _canon(host.private_blocks()),
        tuple(host._free),
        _canon({owner: host.swapped_keys(owner) for owner in host.swapped()}),
        _canon(host.swapped()),
        _canon(host.stats()),
        tuple(host._d2h),
        tuple(host._h2d),
        _canon(host._events),
    )


def state_fingerprint(pool: Pool) -> bytes:
    """The pool's state as canonical bytes (see the module docstring)."""
    outcome = pool.last_step_outcome
    state = (
        pool.name,
        _canon(pool.state),
        _canon(sorted(pool.registrations)),
        pool.max_model_len,
        _manager_state(pool),
        _request_state(pool),
        pool.last_step_seq,
        _canon(outcome),
        pool.allocations_not_fit_total,
        pool.last_event_sequence,
        pool.oldest_event_sequence,
        pool._events.digest(event_entry),
        _canon(pool.stats_totals()),
        _host_tier_state(pool),
    )
    return repr(state).encode()
