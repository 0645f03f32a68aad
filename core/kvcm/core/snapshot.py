"""Pool snapshots: a READY pool's whole state as bytes, and back.

:func:`encode_pool` writes everything :meth:`~kvcm.core.pool.Pool.state_fingerprint` covers
(so everything a later call's answer depends on): every block's reference count, hash and
hashed length, the free-queue order, the prefix-cache map in insertion order (the first block
under a key answers lookups), each group manager's block tables, cached-block counts and new
block ids, the manager's requests and statistics, the request table, the exactly-once guard,
the counters, the event log with its sequence numbers, and the statistics totals.
:func:`decode_pool` builds a pool from the same :class:`~kvcm.core.pool_types.PoolConfig` and
installs that state: the restored pool has the same fingerprint and answers every later call
as the original would.

Uses: the vLLM mirror repairs a server's copy of its pool (``ResyncPool``); the server's data
directory keeps pools across restarts. A snapshot holds no configuration (the caller keeps the
pool's config beside it) and nothing executable: the format is a small tagged encoding of
ints, floats, strings, bytes, lists and a fixed allow-list of kvcm value classes, with packed
integer columns for the per-block state, behind a magic, a version and a CRC-32
(:mod:`kvcm.core._snapshot_codec`). Decoding never builds anything outside that allow-list.

A snapshot is client input (``ResyncPool``) and is checked like a Step: a malformed encoding
or a value out of its type or range is refused with an error naming where it is
(``block_pool.free[3]``), the pool's config wins over the snapshot (its blocks, groups and
``max_model_len`` must match), and the state built must keep every invariant of
:mod:`kvcm.core.invariants` before anyone sees the pool.

Cost: one pass over blocks and requests; per-block columns are packed arrays, so a pool of a
million blocks encodes and decodes in about a second.
"""

from __future__ import annotations

import struct
import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError, KVCMError
from kvcm.common.events import BlockRemoved, BlockStored
from kvcm.common.hashing import BlockHash, BlockHashWithGroupId
from kvcm.core._snapshot_codec import (
    Reader,
    Writer,
    as_int,
    as_ints,
    as_list,
    as_type,
    bad,
    encoded_list,
    event_entry,
    fields_of,
    short,
)
from kvcm.core.host_tier import HOST_TIER_COUNTERS, HostTier, restore_swapped
from kvcm.core.invariants import COUNTER_LIMIT, REQUEST_KEY_LIMIT, TOKEN_ID_LIMIT, check_pool
from kvcm.core.limits import DEFAULT_LIMITS, Limits
from kvcm.core.pool_types import PoolState
from kvcm.core.program import StepOutcome
from kvcm.core.request import Request, RequestStatus
from kvcm.core.single_type_managers import MambaManager
from kvcm.core.stats import PrefixCacheStats

if TYPE_CHECKING:
    from kvcm.core.block import KVCacheBlock
    from kvcm.core.manager import KVCacheManager
    from kvcm.core.pool import Pool
    from kvcm.core.pool_types import PoolConfig

__all__ = [
    "SNAPSHOT_VERSION",
    "decode_pool",
    "decode_sections",
    "encode_pool",
    "encode_sections",
    "encode_state",
    "fresh_extras",
]

_MAGIC: Final = b"KVCMSNAP"
SNAPSHOT_VERSION: Final = 1
_HEADER: Final = struct.Struct("<8sIIQ")  # magic, version, crc32 of the body, body length


# ---------------------------------------------------------------------------- encoding
def encode_pool(pool: Pool) -> bytes:
    """A READY pool's state as bytes (see the module docstring).

    Raises:
        FailedPreconditionError: The pool is not READY (a pool waiting for its workers has
            no state beyond its registrations).
    """
    manager = pool.manager
    if pool.state is not PoolState.READY or manager is None:
        raise FailedPreconditionError(f"pool {pool.name!r} is not READY: nothing to snapshot")
    return encode_state(
        manager,
        pool.requests,
        pool.request_ids,
        extras={
            "last_step_seq": pool.last_step_seq,
            "last_step_outcome": pool.last_step_outcome,
            "allocations_not_fit_total": pool.allocations_not_fit_total,
            "failed_plans": pool.failed_plans,
            "max_model_len": pool.max_model_len,
            "event_next_sequence": pool.last_event_sequence + 1,
            # Each kept event's entry is written once and kept by the log (a long log's
            # snapshot re-encodes only its new events): the bytes a list of them writes.
            "events": encoded_list(pool._events.encoded(event_entry)),
            "event_batches": _batch_state(pool),
            "stats_totals": list(pool.stats_totals()),
            "registrations": _registrations(pool),
            **({} if pool.host_tier is None else {"host_tier": host_tier_state(pool.host_tier)}),
        },
    )


def host_tier_state(host: HostTier) -> dict[str, object]:
    """A tier's section of a snapshot's extras (``extras["host_tier"]``)."""
    # The tier's whole state: keys in recency order (least recent first) with their host
    # blocks, which of them are pending, pins, private blocks, the free list in its order
    # (the next block taken is its last), swapped requests, counters, the copies and events
    # not taken yet. Host block -1 in a swapped table: a null device block.
    keys = bytearray()
    lengths: list[int] = []
    blocks: list[int] = []
    pending: list[int] = []
    for position, key in enumerate(host._order):
        keys += key
        lengths.append(len(key))
        blocks.append(host._where[key])
        if key in host._pending:
            pending.append(position)
    d2h, h2d = host._d2h, host._h2d
    return {
        "num_blocks": host.num_blocks,
        "keys": bytes(keys),
        "key_lengths": array("q", lengths),
        "key_blocks": array("q", blocks),
        "pending": array("q", pending),
        "pinned": array("q", list(host._pins)),
        "pin_counts": array("q", list(host._pins.values())),
        "private": array("q", sorted(host._private)),
        "free": array("q", host._free),
        "swapped": {
            owner: [
                record.num_tokens,
                [
                    array("q", [-1 if entry is None else entry[0] for entry in table])
                    for table in record.tables
                ],
            ]
            for owner, record in host._swapped.items()
        },
        "counters": array("q", [host._counters[name] for name in HOST_TIER_COUNTERS]),
        "device_to_host": array("q", [i for pair in d2h for i in pair]),
        "host_to_device": array("q", [i for pair in h2d for i in pair]),
        "events": list(host._events),
    }


def _registrations(pool: Pool) -> list[object]:
    # Each rank as register_worker takes it; a pool planned by its workers is rebuilt from
    # them (the plan is deterministic), so a checkpoint restores it.
    world_size = pool.options.world_size or max(pool.registrations, default=-1) + 1
    return [
        [rank, world_size, [[n, s] for n, s in reg.specs.items()], reg.available_memory_bytes]
        for rank, reg in sorted(pool.registrations.items())
    ]


def _batch_state(pool: Pool) -> list[object]:
    next_batch, batches = pool.event_batches()
    return [next_batch, [list(record) for record in batches]]


def fresh_extras(*, last_step_seq: int, max_model_len: int) -> dict[str, object]:
    """Pool-level values of a copy with no history of its own (no events, no counters)."""
    return {
        "last_step_seq": last_step_seq,
        "last_step_outcome": None,
        "allocations_not_fit_total": 0,
        "failed_plans": 0,
        "max_model_len": max_model_len,
        "event_next_sequence": 1,
        "events": [],
        "stats_totals": [PrefixCacheStats(), PrefixCacheStats()],
    }


def encode_state(
    manager: KVCacheManager,
    requests: Mapping[int, Request],
    request_ids: Mapping[int, str],
    *,
    extras: Mapping[str, object],
    drop_pending_events: bool = False,
) -> bytes:
    """Encode a manager and its request table (``requests`` keyed by request key; the
    manager's tables are keyed by each request's ``request_id``, which the snapshot replaces
    by the key, as a pool names its requests).

    ``extras`` are the pool-level values :func:`encode_pool` writes (the vLLM mirror writes
    its own: a fresh event log and counters). ``drop_pending_events``: leave out events the
    manager recorded but nobody took yet (a server's copy publishes them after every call).
    """
    rename = {request.request_id: str(key) for key, request in requests.items()}
    block_state = _block_pool_state(manager)
    if drop_pending_events:
        block_state["num_events_taken"] = manager.block_pool.num_events_emitted
        block_state["kv_event_queue"] = []
    return encode_sections(
        [
            block_state,
            _manager_state(manager, rename),
            _requests_state(requests, request_ids),
            dict(extras),
        ]
    )


def encode_sections(sections: Sequence[object]) -> bytes:
    """A snapshot of the four sections :func:`decode_sections` returns (block pool, manager,
    requests, extras), framed with the magic, version and CRC (for tools and tests that edit
    a snapshot; :func:`decode_pool` checks whatever they wrote)."""
    body = Writer()
    for section in sections:
        body.value(section)
    payload = bytes(body.out)
    header = _HEADER.pack(_MAGIC, SNAPSHOT_VERSION, zlib.crc32(payload), len(payload))
    return header + payload


def decode_sections(data: bytes) -> list[Any]:
    """The snapshot's four sections as plain values (maps, lists, ints, bytes, the allow-listed
    value classes), without building a pool.

    Raises:
        InvalidArgumentError: Not a snapshot, a damaged one, or a malformed encoding (names
            where); ``field`` is ``"data"``.
    """
    body = _check_header(data)
    reader = Reader(body)
    sections = []
    for section in _SECTIONS:
        reader.path = [section]
        sections.append(reader.value())
    if reader.at != len(body):
        raise InvalidArgumentError("the snapshot has trailing bytes", field="data")
    return sections


def _block_pool_state(manager: KVCacheManager) -> dict[str, object]:
    pool = manager.block_pool
    blocks = pool.blocks
    ref_cnts = [b.ref_cnt for b in blocks]
    hash_lengths: list[int] = []
    hashed_tokens: list[int] = []
    hashes = bytearray()
    for block in blocks:
        key = block.block_hash
        if key is None:
            hash_lengths.append(-1)
        else:
            hash_lengths.append(len(key))
            hashes += key
        num_tokens = block.block_hash_num_tokens
        hashed_tokens.append(-1 if num_tokens is None else num_tokens)
    cache_keys = bytearray()
    cache_key_lengths: list[int] = []
    cache_entries: list[int] = []  # per key: -1 - count for a dict entry, then the ids
    for key, entry in pool._cached.items():
        cache_keys += key
        cache_key_lengths.append(len(key))
        if isinstance(entry, dict):
            cache_entries.append(-1 - len(entry))
            cache_entries.extend(entry)
        else:
            cache_entries.append(entry.block_id)
    return {
        "num_blocks": len(blocks),
        "ref_cnts": array("q", ref_cnts),
        "hash_lengths": array("q", hash_lengths),
        "hashed_tokens": array("q", hashed_tokens),
        "hashes": bytes(hashes),
        "free": array("q", [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]),
        "cache_keys": bytes(cache_keys),
        "cache_key_lengths": array("q", cache_key_lengths),
        "cache_entries": array("q", cache_entries),
        "secondary_keys": {block_id: list(keys) for block_id, keys in pool._secondary_keys.items()},
        "num_cached_blocks": pool.num_cached_blocks,
        "kv_event_queue": list(pool.kv_event_queue),
        "num_events_taken": pool._num_events_taken,
        "num_evicted_blocks": pool.num_evicted_blocks,
    }


def _manager_state(manager: KVCacheManager, rename: Mapping[str, str]) -> dict[str, object]:
    groups = []
    for group in manager.coordinator.single_type_managers:
        groups.append(
            {
                "req_to_blocks": {
                    rename.get(rid, rid): array("q", [b.block_id for b in blocks])
                    for rid, blocks in group.req_to_blocks.items()
                },
                "num_cached_block": {
                    rename.get(rid, rid): count for rid, count in group.num_cached_block.items()
                },
                "new_block_ids": array("q", group.new_block_ids),
                **_group_extra(group, rename),
            }
        )
    metrics = manager.prefix_caching_metrics
    state: dict[str, object] = {
        "groups": groups,
        "requests": sorted(rename.get(rid, rid) for rid in manager.requests_holding_blocks),
        "prefix_cache_stats": manager.prefix_cache_stats,
        "metrics": [
            metrics.aggregated_requests,
            metrics.aggregated_query_total,
            metrics.aggregated_query_hit,
            [list(interval) for interval in metrics._intervals],
        ],
    }
    junctions = manager.coordinator._junctions
    if junctions:  # sparse retention: where each request's last lookup found a shared prefix
        state["junctions"] = {rename.get(rid, rid): at for rid, at in sorted(junctions.items())}
    if manager.retained_copy_batches:  # an asynchronous KV consumer's copies in flight
        state["retained_copies"] = [
            [block.block_id for block in batch] for batch in manager.retained_copy_batches
        ]
    return state


def _group_extra(group: Any, rename: Mapping[str, str]) -> dict[str, object]:
    # Per-step state of sub-block hits and align-mode Mamba, only where there is some (older
    # snapshots have none): the copies not handed out yet and the partial hits awaiting
    # their copy; Mamba's previous state, retired prefix, allocated requests, prefill
    # checkpoints and the keys cached this step.
    extra: dict[str, object] = {}
    if group._partial_hit_reqs:
        extra["partial_hits"] = {
            rename.get(rid, rid): [index, block.block_id]
            for rid, (index, block) in group._partial_hit_reqs.items()
        }
    if group._pending_cow_copies:
        extra["pending_copies"] = [
            [source.block_id, copy.block_id] for source, copy in group._pending_cow_copies
        ]
    if isinstance(group, MambaManager) and group.align:
        mamba = {
            "last_state": {rename.get(r, r): i for r, i in group._last_state_block_idx.items()},
            "retired": {rename.get(r, r): i for r, i in group._num_retired_blocks.items()},
            "allocated": sorted(rename.get(r, r) for r in group._allocated_block_reqs),
            "checkpoints": {
                rename.get(r, r): [position, index]
                for r, (position, index) in group._checkpoints.items()
            },
            "cached_this_step": sorted(bytes(key) for key in group.cached_blocks_this_step),
        }
        if any(mamba.values()):
            extra["mamba"] = mamba
    return {"extra": extra} if extra else {}


def _restore_group_extra(group: Any, saved: object, where: str, blocks: list[Any]) -> None:
    n = len(blocks)
    s = fields_of(saved, where, (), ("partial_hits", "pending_copies", "mamba"))
    hits = as_type(s.get("partial_hits", {}), f"{where}.partial_hits", dict)
    group._partial_hit_reqs = {}
    for rid, pair in hits.items():
        index, block_id = as_ints(pair, f"{where}.partial_hits[{rid!r}]", 0, n, 2)
        group._partial_hit_reqs[as_type(rid, f"{where}.partial_hits", str)] = (
            index,
            blocks[block_id],
        )
    group._pending_cow_copies = []
    for k, pair in enumerate(as_list(s.get("pending_copies", []), f"{where}.pending_copies")):
        source, copy = as_ints(pair, f"{where}.pending_copies[{k}]", 1, n, 2)
        group._pending_cow_copies.append((blocks[source], blocks[copy]))
    if not isinstance(group, MambaManager) or not group.align:
        if "mamba" in s:
            raise bad(f"{where}.mamba", "is saved for a group that is not align-mode Mamba")
        return
    m = fields_of(
        s.get("mamba", {}),
        f"{where}.mamba",
        (),
        ("last_state", "retired", "allocated", "checkpoints", "cached_this_step"),
    )

    def counts(name: str) -> dict[str, int]:
        table = as_type(m.get(name, {}), f"{where}.mamba.{name}", dict)
        return {
            as_type(rid, f"{where}.mamba.{name}", str): as_int(
                value, f"{where}.mamba.{name}[{rid!r}]", -1, COUNTER_LIMIT
            )
            for rid, value in table.items()
        }

    group._last_state_block_idx = counts("last_state")
    group._num_retired_blocks = counts("retired")
    group._allocated_block_reqs = {
        as_type(rid, f"{where}.mamba.allocated", str)
        for rid in as_list(m.get("allocated", []), f"{where}.mamba.allocated")
    }
    checkpoints = as_type(m.get("checkpoints", {}), f"{where}.mamba.checkpoints", dict)
    group._checkpoints = {}
    for rid, pair in checkpoints.items():
        position, index = as_ints(pair, f"{where}.mamba.checkpoints[{rid!r}]", 0, COUNTER_LIMIT, 2)
        group._checkpoints[as_type(rid, f"{where}.mamba.checkpoints", str)] = (position, index)
    group.cached_blocks_this_step = {
        as_type(key, f"{where}.mamba.cached_this_step", bytes)
        for key in as_list(m.get("cached_this_step", []), f"{where}.mamba.cached_this_step")
    }


def _requests_state(
    requests: Mapping[int, Request], request_ids: Mapping[int, str]
) -> list[object]:
    return [
        [
            key,
            request_ids.get(key, str(key)),
            array("q", request.prompt_token_ids),
            array("q", request.all_token_ids),
            b"".join(request.block_hashes),
            len(request.block_hashes),
            request.status,
            request.num_computed_tokens,
            request.num_in_flight_tokens,
            request.num_preemptions,
            request.lora_id,
            request.lora_name,
            request.lora_path,
            request.cache_salt,
            request.skip_reading_prefix_cache,
            request.report_cached_blocks,
        ]
        for key, request in sorted(requests.items())
    ]


# ---------------------------------------------------------------------------- decoding
def decode_pool(
    data: bytes,
    name: str,
    options: PoolConfig,
    *,
    limits: Limits = DEFAULT_LIMITS,
    blocks_in_use: Callable[[], int] = lambda: 0,
) -> Pool:
    """A READY pool called ``name``, created with ``options``, in the snapshot's state.

    The snapshot is checked like a Step: every value must have its type and range (an error
    names its place, ``block_pool.free[3]``), ``options`` wins over the snapshot (its blocks,
    groups and ``max_model_len`` must match), and the state built must keep every invariant
    of :mod:`kvcm.core.invariants`. Nothing outside the new pool is touched.

    Raises:
        InvalidArgumentError: Not a snapshot, a damaged one (CRC), another version, a value
            out of its type or range, a state that breaks an invariant, or one that does not
            match ``options``; ``field`` is ``"data"``.
        ConfigError: ``options`` cannot build a pool.
    """
    from kvcm.core.pool import Pool

    sections = decode_sections(data)
    pool = Pool(name, options, limits=limits, blocks_in_use=blocks_in_use)
    block_state, manager_state, request_state, extras = sections
    _register_workers(pool, extras, limits)
    manager = pool.ready_manager()
    try:
        _restore_block_pool(manager, block_state)
        _restore_manager(manager, manager_state)
        _restore_requests(pool, request_state)
        _restore_extras(pool, extras)
        _restore_host_tier(pool, extras)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        if isinstance(exc, InvalidArgumentError):
            raise
        # The checks below name the place of every fault they foresee; this is the net.
        raise InvalidArgumentError(
            f"the snapshot is malformed for pool {name!r}: {exc!r}", field="data"
        ) from None
    check_pool(pool, field="data")
    return pool


_SECTIONS: Final = ("block_pool", "manager", "requests", "extras")


def _check_header(data: bytes) -> bytes:
    if len(data) < _HEADER.size:
        raise InvalidArgumentError("not a kvcm snapshot (too short)", field="data")
    magic, version, crc, length = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise InvalidArgumentError("not a kvcm snapshot (bad magic)", field="data")
    if version != SNAPSHOT_VERSION:
        raise InvalidArgumentError(
            f"snapshot version {version} is not {SNAPSHOT_VERSION}", field="data"
        )
    body = data[_HEADER.size :]
    if len(body) != length or zlib.crc32(body) != crc:
        raise InvalidArgumentError("the snapshot is damaged (length or CRC)", field="data")
    return body


# ------------------------------------------------------------------------- restoring
_BLOCK_POOL_FIELDS: Final = (
    "num_blocks", "ref_cnts", "hash_lengths", "hashed_tokens", "hashes", "free", "cache_keys",
    "cache_key_lengths", "cache_entries", "secondary_keys", "num_cached_blocks",
    "kv_event_queue", "num_events_taken", "num_evicted_blocks",
)  # fmt: skip


def _restore_block_pool(manager: KVCacheManager, state: object) -> None:
    from kvcm.core.block import FreeKVCacheBlockQueue

    pool = manager.block_pool
    blocks = pool.blocks
    n = len(blocks)
    s = fields_of(state, "block_pool", _BLOCK_POOL_FIELDS)
    if s["num_blocks"] != n:
        raise bad("block_pool.num_blocks", f"is {short(s['num_blocks'])}, the config's {n}")
    ref_cnts = as_ints(s["ref_cnts"], "block_pool.ref_cnts", 0, COUNTER_LIMIT, n)
    lengths = as_ints(s["hash_lengths"], "block_pool.hash_lengths", -1, 1 << 16, n)
    tokens = as_ints(s["hashed_tokens"], "block_pool.hashed_tokens", -1, COUNTER_LIMIT, n)
    hashes = as_type(s["hashes"], "block_pool.hashes", bytes)
    if sum(length for length in lengths if length > 0) != len(hashes):
        raise bad("block_pool.hashes", "must hold exactly the hash_lengths' bytes")
    at = 0
    for block, ref_cnt, length, num_tokens in zip(blocks, ref_cnts, lengths, tokens, strict=True):
        block.ref_cnt = ref_cnt
        if length < 0:
            block.block_hash = None
        else:
            block.block_hash = BlockHashWithGroupId(hashes[at : at + length])
            at += length
        block.block_hash_num_tokens = None if num_tokens < 0 else num_tokens
    free_ids = as_ints(s["free"], "block_pool.free", 1, n)
    if len(set(free_ids)) != len(free_ids):
        twice = next(i for i, b in enumerate(free_ids) if b in free_ids[:i])
        raise bad(f"block_pool.free[{twice}]", f"queues block {free_ids[twice]} twice")
    for block in blocks:
        block.prev_free_block = block.next_free_block = None
    pool.free_block_queue = FreeKVCacheBlockQueue([blocks[i] for i in free_ids])
    pool._cached = _cache_map(s, blocks)
    secondary = as_type(s["secondary_keys"], "block_pool.secondary_keys", dict)
    pool._secondary_keys = {}
    for block_id, keys in secondary.items():
        where = f"block_pool.secondary_keys[{block_id!r}]"
        as_int(block_id, where, 1, n)
        pool._secondary_keys[block_id] = {
            BlockHashWithGroupId(as_type(k, f"{where}[{i}]", bytes)): None
            for i, k in enumerate(as_list(keys, where))
        }
    pool._num_cached_blocks = as_int(
        s["num_cached_blocks"], "block_pool.num_cached_blocks", 0, COUNTER_LIMIT
    )
    pool.kv_event_queue = as_list(s["kv_event_queue"], "block_pool.kv_event_queue")
    pool._num_events_taken = as_int(
        s["num_events_taken"], "block_pool.num_events_taken", 0, COUNTER_LIMIT
    )
    pool.num_evicted_blocks = as_int(
        s["num_evicted_blocks"], "block_pool.num_evicted_blocks", 0, COUNTER_LIMIT
    )


def _cache_map(
    s: Mapping[str, Any], blocks: Sequence[KVCacheBlock]
) -> dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]]:
    n = len(blocks)
    keys = as_type(s["cache_keys"], "block_pool.cache_keys", bytes)
    lengths = as_ints(s["cache_key_lengths"], "block_pool.cache_key_lengths", 0, 1 << 16)
    entries = as_ints(s["cache_entries"], "block_pool.cache_entries", -n, n)
    if sum(lengths) != len(keys):
        raise bad("block_pool.cache_keys", "must hold exactly the cache_key_lengths' bytes")
    cached: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}
    at = cursor = 0
    for index, length in enumerate(lengths):
        where = f"block_pool.cache_entries[{cursor}]"
        key = BlockHashWithGroupId(keys[at : at + length])
        at += length
        if key in cached:
            raise bad(f"block_pool.cache_keys[{index}]", "repeats a key")
        if cursor >= len(entries):
            raise bad(where, "is missing")
        head = entries[cursor]
        cursor += 1
        if head >= 0:
            cached[key] = blocks[as_int(head, where, 1, n)]
            continue
        ids = entries[cursor : cursor + (-1 - head)]
        if len(ids) != -1 - head or len(set(ids)) != len(ids) or min(ids) < 1:
            raise bad(where, f"must be followed by {-1 - head} distinct block ids")
        cached[key] = {i: blocks[i] for i in ids}
        cursor += len(ids)
    if cursor != len(entries):
        raise bad("block_pool.cache_entries", f"has {len(entries) - cursor} entries too many")
    return cached


def _restore_manager(manager: KVCacheManager, state: object) -> None:
    blocks = manager.block_pool.blocks
    n = len(blocks)
    groups = manager.coordinator.single_type_managers
    s = fields_of(
        state,
        "manager",
        ("groups", "requests", "prefix_cache_stats", "metrics"),
        ("junctions", "retained_copies"),
    )
    saved_groups = as_list(s["groups"], "manager.groups")
    if len(saved_groups) != len(groups):
        raise bad("manager.groups", f"has {len(saved_groups)} groups, the config {len(groups)}")
    for index, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        where = f"manager.groups[{index}]"
        g = fields_of(
            saved, where, ("req_to_blocks", "num_cached_block", "new_block_ids"), ("extra",)
        )
        tables = as_type(g["req_to_blocks"], f"{where}.req_to_blocks", dict)
        group.req_to_blocks = {
            as_type(rid, f"{where}.req_to_blocks", str): [
                blocks[i] for i in as_ints(ids, f"{where}.req_to_blocks[{rid!r}]", 0, n)
            ]
            for rid, ids in tables.items()
        }
        counts = as_type(g["num_cached_block"], f"{where}.num_cached_block", dict)
        group.num_cached_block = {
            as_type(rid, f"{where}.num_cached_block", str): as_int(
                count, f"{where}.num_cached_block[{rid!r}]", 0, n + 1
            )
            for rid, count in counts.items()
        }
        group.new_block_ids = as_ints(g["new_block_ids"], f"{where}.new_block_ids", 0, n)
        _restore_group_extra(group, g.get("extra", {}), f"{where}.extra", blocks)
    holders = as_list(s["requests"], "manager.requests")
    manager._requests = {as_type(rid, "manager.requests", str) for rid in holders}
    junctions = as_type(s.get("junctions", {}), "manager.junctions", dict)
    manager.coordinator._junctions = {
        as_type(rid, "manager.junctions", str): as_int(
            at, f"manager.junctions[{rid!r}]", 1, COUNTER_LIMIT
        )
        for rid, at in junctions.items()
    }
    manager.retained_copy_batches = deque(
        [blocks[i] for i in as_ints(batch, f"manager.retained_copies[{k}]", 1, n)]
        for k, batch in enumerate(as_list(s.get("retained_copies", []), "manager.retained_copies"))
    )
    stats = as_type(s["prefix_cache_stats"], "manager.prefix_cache_stats",
                   PrefixCacheStats, type(None))  # fmt: skip
    if manager.log_stats:  # a snapshot of a copy that kept no stats starts them afresh
        manager.prefix_cache_stats = stats if stats is not None else PrefixCacheStats()
    requests, queries, hits, intervals = as_list(s["metrics"], "manager.metrics", 4)
    metrics = manager.prefix_caching_metrics
    metrics.aggregated_requests = as_int(requests, "manager.metrics[0]", 0, COUNTER_LIMIT)
    metrics.aggregated_query_total = as_int(queries, "manager.metrics[1]", 0, COUNTER_LIMIT)
    metrics.aggregated_query_hit = as_int(hits, "manager.metrics[2]", 0, COUNTER_LIMIT)
    metrics._intervals = deque()
    for k, interval in enumerate(as_list(intervals, "manager.metrics[3]")):
        where = f"manager.metrics[3][{k}]"
        counts = as_ints(as_list(interval, where), where, 0, COUNTER_LIMIT, 3)
        metrics._intervals.append((counts[0], counts[1], counts[2]))


def _restore_requests(pool: Pool, state: object) -> None:
    size = pool.hashing.hash_length_bytes
    for index, entry in enumerate(as_list(state, "requests")):
        where = f"requests[{index}]"
        fields = as_list(entry, where)
        if len(fields) == 15:  # written before report_cached_blocks existed
            fields.append(False)
        (
            key, request_id, prompt, tokens, hashes, num_hashes, status, computed,
            in_flight, preemptions, lora_id, lora_name, lora_path, cache_salt, skip, report,
        ) = as_list(fields, where, 16)  # fmt: skip
        as_int(key, f"{where}.key", 0, REQUEST_KEY_LIMIT)
        if key in pool.requests:
            raise bad(f"{where}.key", f"repeats request key {key}")
        as_type(request_id, f"{where}.request_id", str)
        as_ints(tokens, f"{where}.all_token_ids", 0, TOKEN_ID_LIMIT)
        as_type(hashes, f"{where}.block_hashes", bytes)
        if len(hashes) != as_int(num_hashes, f"{where}.num_block_hashes", 0, COUNTER_LIMIT) * size:
            raise bad(f"{where}.block_hashes", f"must hold {num_hashes} hashes of {size} bytes")
        for offset, name, value in (
            (10, "lora_id", lora_id),
            (11, "lora_name", lora_name),
            (12, "lora_path", lora_path),
            (13, "cache_salt", cache_salt),
        ):
            as_type(value, f"{where}.{name}", int if offset == 10 else str, type(None))
        try:
            request = Request(
                str(key),
                as_ints(prompt, f"{where}.prompt_token_ids", 0, TOKEN_ID_LIMIT),
                lora_id=lora_id,
                lora_name=lora_name,
                lora_path=lora_path,
                cache_salt=cache_salt,
                status=as_type(status, f"{where}.status", RequestStatus),
                skip_reading_prefix_cache=as_type(skip, f"{where}.skip_reading_prefix_cache", bool),
                report_cached_blocks=as_type(report, f"{where}.report_cached_blocks", bool),
            )
        except InvalidArgumentError as exc:
            raise bad(where, str(exc)) from None
        request.all_token_ids = tokens
        request.block_hashes = [BlockHash(hashes[i * size : (i + 1) * size]) for i in
                                range(num_hashes)]  # fmt: skip
        request.num_computed_tokens = as_int(
            computed, f"{where}.num_computed_tokens", 0, REQUEST_KEY_LIMIT
        )
        request.num_in_flight_tokens = as_int(
            in_flight, f"{where}.num_in_flight_tokens", 0, REQUEST_KEY_LIMIT
        )
        request.num_preemptions = as_int(
            preemptions, f"{where}.num_preemptions", 0, REQUEST_KEY_LIMIT
        )
        pool.requests[key] = request
        pool.request_ids[key] = request_id


def _register_workers(pool: Pool, extras: object, limits: Limits) -> None:
    """Register the snapshot's ranks as they registered (planning a pool planned by them)."""
    if type(extras) is not dict:
        raise bad("extras", f"must be a map, got {type(extras).__name__}")
    for index, entry in enumerate(as_list(extras.get("registrations", []), "registrations")):
        where = f"extras.registrations[{index}]"
        rank, world_size, layers, memory = as_list(entry, where, 4)
        specs = {}
        for position, layer in enumerate(as_list(layers, f"{where}[2]")):
            name, spec = as_list(layer, f"{where}[2][{position}]", 2)
            specs[as_type(name, f"{where}[2][{position}][0]", str)] = spec
        try:
            pool.register_worker(
                as_int(rank, f"{where}[0]", 0, 1 << 32),
                as_int(world_size, f"{where}[1]", 0, 1 << 32),
                specs,
                as_int(memory, f"{where}[3]", 0, REQUEST_KEY_LIMIT),
                limits=limits,
            )
        except KVCMError as exc:
            raise bad(where, f"does not register: {exc}") from None
    if pool.manager is None:
        raise bad("extras.registrations", "do not plan the pool (its config has no layout)")


_EXTRAS_FIELDS: Final = (
    "last_step_seq", "last_step_outcome", "allocations_not_fit_total", "failed_plans",
    "max_model_len", "event_next_sequence", "events", "stats_totals",
)  # fmt: skip


def _restore_extras(pool: Pool, extras: object) -> None:
    e = fields_of(
        extras, "extras", _EXTRAS_FIELDS, optional=("event_batches", "registrations", "host_tier")
    )
    if e["max_model_len"] != pool.max_model_len:
        # The pool's config wins: a snapshot never changes how long a request may be.
        raise bad("extras.max_model_len", f"is {short(e['max_model_len'])}, the pool's "
                   f"config says {pool.max_model_len}")  # fmt: skip
    pool.last_step_seq = as_int(e["last_step_seq"], "extras.last_step_seq", 0, REQUEST_KEY_LIMIT)
    pool.last_step_outcome = as_type(
        e["last_step_outcome"], "extras.last_step_outcome", StepOutcome, type(None)
    )
    pool.allocations_not_fit_total = as_int(
        e["allocations_not_fit_total"], "extras.allocations_not_fit_total", 0, COUNTER_LIMIT
    )
    pool.failed_plans = as_int(e["failed_plans"], "extras.failed_plans", 0, COUNTER_LIMIT)
    events = []
    for index, entry in enumerate(as_list(e["events"], "extras.events")):
        event, now = as_list(entry, f"extras.events[{index}]", 2)
        events.append((event, as_type(now, f"extras.events[{index}][1]", float)))
    # Snapshots written before batches were numbered have no "event_batches".
    next_batch, batches = as_list(e.get("event_batches", [0, []]), "extras.event_batches", 2)
    records = []
    for index, record in enumerate(as_list(batches, "extras.event_batches[1]")):
        where = f"extras.event_batches[1][{index}]"
        seq, first, count, now = as_list(record, where, 4)
        for value in (seq, first, count):
            as_int(value, where, 0, COUNTER_LIMIT)
        records.append((seq, first, count, as_type(now, f"{where}[3]", float)))
    try:
        pool.restore_events(
            as_int(e["event_next_sequence"], "extras.event_next_sequence", 1, COUNTER_LIMIT),
            events,
            (as_int(next_batch, "extras.event_batches[0]", 0, COUNTER_LIMIT), records),
        )
    except InvalidArgumentError as exc:
        raise bad("extras.event_batches", f"do not fit the events: {exc}") from None
    total, untaken = as_list(e["stats_totals"], "extras.stats_totals", 2)
    pool.restore_stats_totals(
        as_type(total, "extras.stats_totals[0]", PrefixCacheStats),
        as_type(untaken, "extras.stats_totals[1]", PrefixCacheStats),
    )


_HOST_TIER_FIELDS: Final = (
    "num_blocks", "keys", "key_lengths", "key_blocks", "pending", "pinned", "pin_counts",
    "private", "free", "swapped", "counters", "device_to_host", "host_to_device", "events",
)  # fmt: skip


def _restore_host_tier(pool: Pool, extras: Mapping[str, Any]) -> None:
    """Install the snapshot's host tier (none saved: the pool's tier starts empty, as a copy
    written by the vLLM mirror has none). Every host block must be exactly one of free, keyed
    or private; pins, pending keys and swapped requests must agree with each other."""
    host = pool.host_tier
    if "host_tier" not in extras:
        return
    w = "extras.host_tier"
    if host is None:
        raise bad(w, "is saved for a pool whose config keeps no host tier")
    s = fields_of(extras["host_tier"], w, _HOST_TIER_FIELDS)
    nb = host.num_blocks
    if s["num_blocks"] != nb:
        raise bad(f"{w}.num_blocks", f"is {short(s['num_blocks'])}, the config's {nb}")
    raw = as_type(s["keys"], f"{w}.keys", bytes)
    lengths = as_ints(s["key_lengths"], f"{w}.key_lengths", 1, 1 << 16)
    if sum(lengths) != len(raw):
        raise bad(f"{w}.keys", "must hold exactly the key_lengths' bytes")
    key_blocks = as_ints(s["key_blocks"], f"{w}.key_blocks", 0, nb, len(lengths))
    order: list[BlockHashWithGroupId] = []
    at = 0
    for length in lengths:
        order.append(BlockHashWithGroupId(raw[at : at + length]))
        at += length
    _distinct(order, f"{w}.keys", "repeats a key")
    _distinct(key_blocks, f"{w}.key_blocks", "gives a host block two keys")
    positions = as_ints(s["pending"], f"{w}.pending", 0, len(order))
    _distinct(positions, f"{w}.pending", "names a key twice")
    pending = {order[i] for i in positions}
    pinned = as_ints(s["pinned"], f"{w}.pinned", 0, nb)
    _distinct(pinned, f"{w}.pinned", "names a host block twice")
    counts = as_ints(s["pin_counts"], f"{w}.pin_counts", 1, COUNTER_LIMIT, len(pinned))
    pins = dict(zip(pinned, counts, strict=True))
    private = as_ints(s["private"], f"{w}.private", 0, nb)
    _distinct(private, f"{w}.private", "names a host block twice")
    free = as_ints(s["free"], f"{w}.free", 0, nb)
    _distinct(free, f"{w}.free", "names a host block twice")
    keyed = dict(zip(key_blocks, order, strict=True))
    if set(free) & set(keyed) or set(free) & set(private) or set(keyed) & set(private):
        raise bad(f"{w}.free", "must hold the blocks that are neither keyed nor private")
    if len(free) + len(keyed) + len(private) != nb:
        raise bad(f"{w}.free", f"with the keyed and private blocks must make the {nb} blocks")
    for host_id in pinned:
        key = keyed.get(host_id)
        if (key is None and host_id not in private) or key in pending:
            raise bad(f"{w}.pinned", f"pins host block {host_id}, neither ready nor private")
    num_groups = len(pool.ready_manager().coordinator.single_type_managers)
    refs: dict[int, int] = {}
    swapped: dict[str, tuple[int, list[list[int]]]] = {}
    for owner, record in as_type(s["swapped"], f"{w}.swapped", dict).items():
        where = f"{w}.swapped[{owner!r}]"
        as_type(owner, where, str)
        if not owner.isdigit() or int(owner) not in pool.requests:
            raise bad(where, "names no request of the snapshot")
        num_tokens, tables = as_list(record, where, 2)
        as_int(num_tokens, f"{where}[0]", 0, COUNTER_LIMIT)
        rows = [
            as_ints(table, f"{where}[1][{g}]", -1, nb)
            for g, table in enumerate(as_list(tables, f"{where}[1]", num_groups))
        ]
        for host_id in (h for row in rows for h in row if h >= 0):
            if host_id not in private and (host_id not in keyed or keyed[host_id] in pending):
                raise bad(where, f"holds host block {host_id}, neither ready nor private")
            refs[host_id] = refs.get(host_id, 0) + 1
        swapped[owner] = (num_tokens, rows)
    for host_id in private:
        if refs.get(host_id) != 1 or pins.get(host_id) != 1:
            raise bad(f"{w}.private", f"block {host_id} must be one swapped block, pinned once")
    for host_id, count in refs.items():
        if pins.get(host_id, 0) < count:
            raise bad(f"{w}.pin_counts", f"pin host block {host_id} fewer times than swapped")
    counters = as_ints(s["counters"], f"{w}.counters", 0, COUNTER_LIMIT, len(HOST_TIER_COUNTERS))
    n = len(pool.ready_manager().block_pool.blocks)
    copies = []
    for name, first, second in (("device_to_host", n, nb), ("host_to_device", nb, n)):
        flat = as_ints(s[name], f"{w}.{name}", 0, max(n, nb))
        if len(flat) % 2:
            raise bad(f"{w}.{name}", "must hold pairs")
        pairs = list(zip(flat[::2], flat[1::2], strict=True))
        for index, (a, b) in enumerate(pairs):
            if a >= first or b >= second:
                raise bad(f"{w}.{name}[{2 * index}]", f"pair {(a, b)} is out of range")
        copies.append(pairs)
    events = as_list(s["events"], f"{w}.events")
    for index, event in enumerate(events):
        as_type(event, f"{w}.events[{index}]", BlockStored, BlockRemoved)
    host._order = OrderedDict.fromkeys(order)
    host._where = {key: host_id for host_id, key in keyed.items()}
    host._key_of = keyed
    host._pending = pending
    host._pins = pins
    host._private = set(private)
    host._free = free
    host._swapped = {
        owner: restore_swapped(num_tokens, rows, keyed, set(private))
        for owner, (num_tokens, rows) in swapped.items()
    }
    host._counters = dict(zip(HOST_TIER_COUNTERS, counters, strict=True))
    host._num_evictable = sum(
        1 for key in order if key not in pending and host._where[key] not in pins
    )
    host._d2h, host._h2d = copies
    host._events = events


def _distinct(values: Sequence[object], where: str, message: str) -> None:
    seen: set[object] = set()
    for index, value in enumerate(values):
        if value in seen:
            raise bad(f"{where}[{index}]", message)
        seen.add(value)
