"""Every invariant a pool keeps, checked in one place.

The core keeps its invariants by construction: each operation validates before it changes
anything and then moves the state from one consistent shape to the next (the NOTE comments at
:class:`~kvcm.core.block.KVCacheBlock`, :class:`~kvcm.core.block.FreeKVCacheBlockQueue`,
:class:`~kvcm.core.block_pool.BlockPool`, the per-type managers and the stats say which). A
state that did not come from those operations (a snapshot a client uploads, a checkpoint read
from disk) must be checked against them before a pool is built on it: a free queue naming a
block twice, a ref count that disagrees with the block tables or a request longer than the
pool's ``max_model_len`` would later make a valid Step fail inside the core.

Levels (each includes the one before):

* :func:`block_pool_violations`: blocks, the free queue, the prefix-cache map, the pending
  events and counters of one :class:`~kvcm.core.block_pool.BlockPool`;
* :func:`manager_violations`: every group's block tables (ref counts equal the number of
  tables holding each block, null blocks only where a group skips tokens, cached-block counts
  within the tables, new block ids), the requests holding blocks and the prefix-cache
  statistics of a :class:`~kvcm.core.manager.KVCacheManager`;
* :func:`pool_violations`: a :class:`~kvcm.core.pool.Pool`'s request table (keys, tokens,
  hashes and counts in range, tables only for live requests), its counters, exactly-once
  guard, event log and statistics totals.

:func:`check_pool` raises :class:`~kvcm.common.errors.InvalidArgumentError` naming the first
violation's place (``blocks[5].ref_cnt``, ``requests[7].num_computed_tokens``). Pure and
O(state) (one pass over blocks, tables, requests and events): run it where a state comes from
outside (snapshots), after every step of the property tests, and from a debug endpoint; never
on the hot path.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kvcm.common.errors import InvalidArgumentError
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.core.block import KVCacheBlock
from kvcm.core.program import EXECUTED_STATUSES, StepOutcome
from kvcm.core.request import Request, RequestStatus
from kvcm.core.stats import PrefixCacheStats, PrefixCachingMetrics

if TYPE_CHECKING:
    from kvcm.core.block_pool import BlockPool
    from kvcm.core.manager import KVCacheManager
    from kvcm.core.pool import Pool

__all__ = [
    "COUNTER_LIMIT",
    "REQUEST_KEY_LIMIT",
    "TOKEN_ID_LIMIT",
    "Violation",
    "block_pool_violations",
    "check_pool",
    "manager_violations",
    "pool_violations",
]

TOKEN_ID_LIMIT: Final = 1 << 32
"""Token ids are below this (``uint32`` on the wire)."""
REQUEST_KEY_LIMIT: Final = 1 << 64
"""Request keys are below this (``uint64`` on the wire)."""
COUNTER_LIMIT: Final = 1 << 53
"""Counters, sequence numbers and ids a pool reaches stay below this (exact as a float, far
from any wire limit even after years of increments)."""
_INT64_LIMIT: Final = 1 << 63
_GROUP_ID_NBYTES: Final = 4
_INT_ONLY: Final = frozenset({int})
_GROUP_ID: Final = operator.itemgetter(slice(-4, None))  # a cache key's group id bytes
_VALID_STATUSES: Final = frozenset(int(status) for status in EXECUTED_STATUSES)


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant.

    Attributes:
        path: Where, as a path into the pool's state (``free_queue[3]``, ``blocks[5].ref_cnt``,
            ``groups[1].req_to_blocks['7'][2]``, ``requests[7].num_computed_tokens``).
        message: What is wrong.
    """

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def check_pool(pool: Pool, *, field: str | None = None) -> None:
    """Raise unless ``pool`` keeps every invariant (see the module docstring).

    Args:
        pool: The pool (a pool still waiting for its workers has only its pool-level state).
        field: The ``field`` the error carries (``"data"`` for an uploaded snapshot).

    Raises:
        InvalidArgumentError: The first violation, its path in the message.
    """
    for violation in pool_violations(pool):
        raise InvalidArgumentError(
            f"pool {pool.name!r} breaks an invariant at {violation}", field=field
        )


# ------------------------------------------------------------------------ scalar checks
def _int_in(value: object, low: int, high: int) -> bool:
    """``value`` is an int (not a bool) in ``[low, high)``."""
    return type(value) is int and low <= value < high


def _opt_int_in(value: object, low: int, high: int) -> bool:
    return value is None or _int_in(value, low, high)


def _opt_str(value: object) -> bool:
    return value is None or type(value) is str


def _ints_in(values: object, low: int, high: int) -> bool:
    """``values`` is a list of ints in ``[low, high)`` (one pass, no per-item calls)."""
    if type(values) is not list:
        return False
    if not set(map(type, values)) <= _INT_ONLY:  # map(type): one C-level pass
        return False
    return not values or (low <= min(values) and max(values) < high)


def _range(low: int, high: int) -> str:
    return f"must be an int in [{low}, {high})"


# --------------------------------------------------------------------------- block pool
def block_pool_violations(
    pool: BlockPool,
    *,
    num_groups: int | None = None,
    hash_length: int | None = None,
    max_tokens: int | None = None,
) -> Iterator[Violation]:
    """The broken invariants of a block pool, first found first.

    Args:
        pool: The block pool.
        num_groups: Groups of its manager (cache keys name one); ``None``: not checked.
        hash_length: Bytes of a block hash (a cache key has 4 more); ``None``: not checked.
        max_tokens: Longest prefix a cache entry covers (``max_model_len``); ``None``: not
            checked.
    """
    blocks = pool.blocks
    num_blocks = pool.num_gpu_blocks
    if type(blocks) is not list or len(blocks) != num_blocks:
        yield Violation("blocks", f"must hold the pool's {num_blocks} blocks")
        return
    yield from _block_records(pool)
    yield from _free_queue(pool)
    yield from _prefix_cache(pool, num_groups, hash_length, max_tokens)
    if type(pool.kv_event_queue) is not list:
        yield Violation("kv_event_queue", "must be a list")
    else:
        if pool.kv_event_queue and not pool.enable_kv_cache_events:
            yield Violation("kv_event_queue", "holds events but the pool records none")
        for index, event in enumerate(pool.kv_event_queue):
            yield from _event(event, f"kv_event_queue[{index}]", hash_length)
    for name in ("_num_events_taken", "num_evicted_blocks"):
        if not _int_in(getattr(pool, name), 0, COUNTER_LIMIT):
            yield Violation(name.lstrip("_"), _range(0, COUNTER_LIMIT))


def _block_records(pool: BlockPool) -> Iterator[Violation]:
    # Whole-column checks (C-level passes); the per-block message only once one fails.
    blocks = pool.blocks
    null = pool.null_block
    if null is not blocks[0]:
        yield Violation("null_block", "must be block 0")
    if not set(map(type, blocks)) <= {KVCacheBlock} or [b.block_id for b in blocks] != list(
        range(len(blocks))
    ):
        bad = next(
            i for i, b in enumerate(blocks) if type(b) is not KVCacheBlock or b.block_id != i
        )
        yield Violation(f"blocks[{bad}]", "is not the pool's block of this id")
        return
    nulls = [b.block_id for b in blocks if b.is_null]
    if nulls != [0]:
        yield Violation("blocks", f"block 0 and only block 0 is the null block, got {nulls}")
    ref_cnts = [b.ref_cnt for b in blocks]
    if not set(map(type, ref_cnts)) <= _INT_ONLY or min(ref_cnts) < 0:
        bad = next(i for i, r in enumerate(ref_cnts) if type(r) is not int or r < 0)
        yield Violation(f"blocks[{bad}].ref_cnt", f"must be an int >= 0, got {ref_cnts[bad]!r}")
    if null.ref_cnt or null.block_hash is not None or null.block_hash_num_tokens is not None:
        yield Violation("blocks[0]", "the null block has no references and no hash")


def _free_queue(pool: BlockPool) -> Iterator[Violation]:
    # NOTE: a non-null block is queued exactly when its ref_cnt is 0; queued blocks are linked
    # both ways between the sentinels; blocks outside the queue have no links.
    # One walk collects the queue (bounded: a cycle stops it), then whole-list checks.
    blocks = pool.blocks
    num_blocks = len(blocks)
    queue = pool.free_block_queue
    head, tail = queue._head, queue._tail
    order: list[KVCacheBlock] = []
    append = order.append
    block = head.next_free_block
    for _ in range(num_blocks + 1):
        if block is tail or block is None:
            break
        append(block)
        block = block.next_free_block
    if block is not tail:
        reason = "the queue's links end before its tail" if block is None else "holds a cycle"
        yield Violation(f"free_queue[{len(order)}]", reason)
        return
    if not set(map(type, order)) <= {KVCacheBlock}:
        yield Violation("free_queue", "holds something that is not a block")
        return
    ids = [b.block_id for b in order]
    foreign = [
        i for i, (b, bid) in enumerate(zip(order, ids, strict=True))
        if type(bid) is not int or not 0 <= bid < num_blocks or blocks[bid] is not b
    ]  # fmt: skip
    if foreign:
        yield Violation(f"free_queue[{foreign[0]}]", "is not one of the pool's blocks")
        return
    queued = set(ids)
    if len(queued) != len(ids):
        first = {bid: i for i, bid in reversed(list(enumerate(ids)))}
        twice = next(i for i, bid in enumerate(ids) if first[bid] != i)
        yield Violation(f"free_queue[{twice}]", f"block {ids[twice]} is queued twice")
        return
    previous = [head, *order[:-1]] if order else []
    broken = [i for i, (b, p) in enumerate(zip(order, previous, strict=True))
              if b.prev_free_block is not p]  # fmt: skip
    if broken:
        yield Violation(f"free_queue[{broken[0]}]", "the block's back link is broken")
    if 0 in queued:
        yield Violation(f"free_queue[{ids.index(0)}]", "the null block is never free")
    held = [i for i, b in enumerate(order) if b.ref_cnt != 0 and not b.is_null]
    if held:
        b = order[held[0]]
        yield Violation(
            f"free_queue[{held[0]}]", f"block {b.block_id} is free but has ref_cnt {b.ref_cnt}"
        )
    last = order[-1] if order else head
    if tail.prev_free_block is not last or head.prev_free_block or tail.next_free_block:
        yield Violation("free_queue", "the sentinels' links are broken")
    if queue.num_free_blocks != len(order):
        yield Violation(
            "free_queue.num_free_blocks",
            f"is {queue.num_free_blocks}, the queue holds {len(order)}",
        )
    lost = [b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null
            and b.block_id not in queued]  # fmt: skip
    if lost:
        yield Violation(f"blocks[{lost[0]}]", "has ref_cnt 0 but is not in the free queue")
    linked = [b.block_id for b in blocks if b.block_id not in queued
              and (b.prev_free_block is not None or b.next_free_block is not None)]  # fmt: skip
    if linked:
        yield Violation(f"blocks[{linked[0]}]", "is not in the free queue but has links")


def _key_violation(key: object, hash_length: int | None, num_groups: int | None) -> str | None:
    if type(key) is not bytes:
        return f"a cache key must be bytes, got {type(key).__name__}"
    if hash_length is not None and len(key) != hash_length + _GROUP_ID_NBYTES:
        return f"a cache key has {hash_length + _GROUP_ID_NBYTES} bytes, got {len(key)}"
    if len(key) < _GROUP_ID_NBYTES:
        return "a cache key ends with a 4-byte group id"
    if num_groups is not None and int.from_bytes(key[-_GROUP_ID_NBYTES:], "big") >= num_groups:
        return f"a cache key names a group beyond the pool's {num_groups}"
    return None


def _bad_keys(keys: list[Any], hash_length: int | None, num_groups: int | None) -> list[int]:
    """Indices of the keys :func:`_key_violation` refuses (whole-list checks first)."""
    if (
        set(map(type, keys)) <= {bytes}
        and (hash_length is None or set(map(len, keys)) <= {hash_length + _GROUP_ID_NBYTES})
        and (
            num_groups is None
            or not keys
            or max(map(_GROUP_ID, keys)) < num_groups.to_bytes(_GROUP_ID_NBYTES, "big")
        )
    ):
        return []
    return [i for i, key in enumerate(keys) if _key_violation(key, hash_length, num_groups)]


def _prefix_cache(
    pool: BlockPool, num_groups: int | None, hash_length: int | None, max_tokens: int | None
) -> Iterator[Violation]:
    # NOTE (BlockPool): a block's first key is block.block_hash, further keys are in
    # _secondary_keys; the map holds exactly the keys of the blocks, never the null block's.
    blocks = pool.blocks
    cached = pool._cached
    secondary = pool._secondary_keys
    step = pool.hash_block_size
    limit = COUNTER_LIMIT if max_tokens is None else max_tokens + 1
    if not pool.enable_caching and (cached or secondary):
        yield Violation("cached", "a pool without prefix caching caches nothing")
    hashed = [b for b in blocks if b.block_hash is not None]
    stray = [b.block_id for b in blocks if b.block_hash is None
             and (b.block_hash_num_tokens is not None or b.block_id in secondary)]  # fmt: skip
    if stray:
        yield Violation(f"blocks[{stray[0]}]", "has a prefix length or secondary keys, no hash")
    keys: list[Any] = [b.block_hash for b in hashed]
    bad = _bad_keys(keys, hash_length, num_groups)
    if bad:
        problem = _key_violation(keys[bad[0]], hash_length, num_groups)
        yield Violation(f"blocks[{hashed[bad[0]].block_id}].block_hash", str(problem))
        return
    entries = list(map(cached.get, keys))
    unknown = [b.block_id for b, e in zip(hashed, entries, strict=True)
               if e is not b and not (type(e) is dict and e.get(b.block_id) is b)]  # fmt: skip
    if unknown:
        yield Violation(f"blocks[{unknown[0]}].block_hash", "the prefix-cache map does not know it")
    tokens: list[Any] = [b.block_hash_num_tokens for b in hashed]
    if tokens and not (
        set(map(type, tokens)) <= _INT_ONLY
        and min(tokens) >= 1
        and max(tokens) < limit
        and (step == 1 or not any(t % step for t in tokens))
    ):
        yield Violation(
            "blocks.block_hash_num_tokens",
            f"a hashed block's prefix length is a positive multiple of {step} below {limit}",
        )
    if pool._num_cached_blocks != len(hashed):
        yield Violation(
            "num_cached_blocks", f"is {pool._num_cached_blocks}, {len(hashed)} blocks are cached"
        )
    yield from _cache_map(pool, num_groups, hash_length)


def _cache_map(
    pool: BlockPool, num_groups: int | None, hash_length: int | None
) -> Iterator[Violation]:
    blocks = pool.blocks
    num_blocks = len(blocks)
    cached = pool._cached
    secondary = pool._secondary_keys
    keys: list[Any] = list(cached)
    bad = _bad_keys(keys, hash_length, num_groups)
    if bad:
        key = keys[bad[0]]
        yield Violation(f"cached[{key!r}]", str(_key_violation(key, hash_length, num_groups)))
        return
    # The common entry: one block whose primary key it is.
    odd = [k for k, e in cached.items() if type(e) is not KVCacheBlock or e.block_hash != k
           or not 0 <= e.block_id < num_blocks or blocks[e.block_id] is not e]  # fmt: skip
    for key in odd:
        entry = cached[key]
        path = f"cached[{key!r}]"
        members = list(entry.values()) if type(entry) is dict else [entry]
        if not members:
            yield Violation(path, "an entry holds at least one block")
        for member in members:
            if (
                type(member) is not KVCacheBlock
                or not 0 <= member.block_id < num_blocks
                or blocks[member.block_id] is not member
            ):
                yield Violation(path, "maps to a block that is not the pool's")
                break
            if type(entry) is dict and entry.get(member.block_id) is not member:
                yield Violation(path, "maps to a block under another block's id")
                break
            if member.block_hash != key and key not in secondary.get(member.block_id, ()):
                yield Violation(path, f"block {member.block_id} does not carry this key")
    for block_id, block_keys in secondary.items():
        path = f"secondary_keys[{block_id}]"
        if not _int_in(block_id, 1, num_blocks) or type(block_keys) is not dict or not block_keys:
            yield Violation(path, "names a block of the pool and at least one key")
            continue
        block = blocks[block_id]
        for key in block_keys:
            if key == block.block_hash or not _maps_to(cached.get(key), block):
                yield Violation(path, "a secondary key must map to its block, apart from its hash")
                break


def _maps_to(entry: object, block: KVCacheBlock) -> bool:
    if type(entry) is dict:
        return entry.get(block.block_id) is block
    return entry is block


# ------------------------------------------------------------------------------ events
def _event(event: object, path: str, hash_length: int | None) -> Iterator[Violation]:
    """An event of the kinds the core emits, with fields its wire forms can carry."""
    kind = type(event)
    if kind is AllBlocksCleared:
        return
    if kind is not BlockStored and kind is not BlockRemoved:
        yield Violation(path, f"is not a KV event, got {kind.__name__}")
        return
    assert isinstance(event, (BlockStored, BlockRemoved))
    if type(event.block_hashes) is not list or not all(
        _hash_ok(h, hash_length) for h in event.block_hashes
    ):
        yield Violation(f"{path}.block_hashes", "must be a list of block hashes")
    if not _opt_str(event.medium):
        yield Violation(f"{path}.medium", "must be a str or None")
    for name in ("locality", "ownership"):
        if not _opt_str(getattr(event, name)):
            yield Violation(f"{path}.{name}", "must be a str or None")
    if not _opt_int_in(event.group_idx, 0, TOKEN_ID_LIMIT):
        yield Violation(f"{path}.group_idx", "must be None or an int in [0, 2**32)")
    if isinstance(event, BlockStored):
        yield from _stored(event, path, hash_length)


def _hash_ok(value: object, hash_length: int | None) -> bool:
    # Events restored from snapshots older than full-width hashes carry vLLM's int form.
    if type(value) is bytes:
        return hash_length is None or len(value) == hash_length
    return _int_in(value, 0, REQUEST_KEY_LIMIT)


def _stored(event: BlockStored, path: str, hash_length: int | None) -> Iterator[Violation]:
    parent = event.parent_block_hash
    if parent is not None and not _hash_ok(parent, hash_length):
        yield Violation(f"{path}.parent_block_hash", "must be None or a block hash")
    if not _ints_in(event.token_ids, 0, TOKEN_ID_LIMIT):
        yield Violation(f"{path}.token_ids", "must be a list of token ids")
    # A host tier's events use the placeholder form of vLLM's offloading connector: no
    # tokens and block_size 0 (the device's events carried the tokens).
    low = 0 if event.token_ids == [] else 1
    if not _int_in(event.block_size, low, TOKEN_ID_LIMIT):
        yield Violation(f"{path}.block_size", _range(low, TOKEN_ID_LIMIT))
    if not _opt_int_in(event.lora_id, 0, _INT64_LIMIT):
        yield Violation(f"{path}.lora_id", "must be None or an int in [0, 2**63)")
    for name in ("lora_name", "kv_cache_spec_kind", "session_id"):
        if not _opt_str(getattr(event, name)):
            yield Violation(f"{path}.{name}", "must be a str or None")
    if not _opt_int_in(event.kv_cache_spec_sliding_window, 0, TOKEN_ID_LIMIT):
        yield Violation(f"{path}.kv_cache_spec_sliding_window", "must be None or a uint32")
    extra = event.extra_keys
    if extra is not None and (
        type(extra) is not list or not all(_extra_keys_ok(keys) for keys in extra)
    ):
        yield Violation(f"{path}.extra_keys", "must be None or a list of per-block key tuples")
    lookahead = event.lookahead_token_ids
    if lookahead is not None and (
        type(lookahead) is not list
        or not all(_ints_in(ids, 0, TOKEN_ID_LIMIT) for ids in lookahead)
    ):
        yield Violation(f"{path}.lookahead_token_ids", "must be None or lists of token ids")


def _extra_keys_ok(keys: object) -> bool:
    if keys is None:
        return True
    if type(keys) is not tuple:
        return False
    for key in keys:
        if type(key) in (str, bytes) or _int_in(key, -_INT64_LIMIT, _INT64_LIMIT):
            continue
        # A multi-modal key: (identifier, offset in the item).
        if not (
            type(key) is tuple
            and len(key) == 2
            and (type(key[0]) is str or _int_in(key[0], -_INT64_LIMIT, _INT64_LIMIT))
            and _int_in(key[1], -_INT64_LIMIT, _INT64_LIMIT)
        ):
            return False
    return True


# ------------------------------------------------------------------------------ manager
def manager_violations(
    manager: KVCacheManager, *, hash_length: int | None = None
) -> Iterator[Violation]:
    """The broken invariants of a manager and its block pool, first found first.

    Args:
        manager: The manager.
        hash_length: Bytes of a block hash; ``None``: not checked.
    """
    pool = manager.block_pool
    yield from block_pool_violations(
        pool,
        num_groups=manager.num_kv_cache_groups,
        hash_length=hash_length,
        max_tokens=manager.max_model_len,
    )
    blocks = pool.blocks
    num_blocks = len(blocks)
    holders = manager._requests
    if type(holders) is not set or not all(type(rid) is str for rid in holders):
        yield Violation("requests_holding_blocks", "must be a set of request ids")
        return
    references = [0] * num_blocks
    for group in manager.coordinator.single_type_managers:
        yield from _group_tables(group, holders, references)
    for k, batch in enumerate(manager.retained_copy_batches):
        # Retained copy drains hold one reference per entry (an asynchronous KV consumer).
        for position, block in enumerate(batch):
            if type(block) is not KVCacheBlock or blocks[block.block_id] is not block:
                yield Violation(
                    f"retained_copies[{k}][{position}]", "is not one of the pool's blocks"
                )
                return
            references[block.block_id] += 1
    for block in blocks[1:]:
        if type(block.ref_cnt) is int and block.ref_cnt != references[block.block_id]:
            yield Violation(
                f"blocks[{block.block_id}].ref_cnt",
                f"is {block.ref_cnt}, {references[block.block_id]} block-table entries hold it",
            )
    if manager.log_stats:
        stats = manager.prefix_cache_stats
        if type(stats) is not PrefixCacheStats:
            yield Violation("prefix_cache_stats", "must be a PrefixCacheStats")
        else:
            yield from _stats(stats, "prefix_cache_stats")
    elif manager.prefix_cache_stats is not None:
        yield Violation("prefix_cache_stats", "a pool without log_stats keeps none")
    yield from _metrics(manager.prefix_caching_metrics)


def _group_tables(group: object, holders: set[str], references: list[int]) -> Iterator[Violation]:
    from kvcm.core.single_type_managers import SingleTypeKVCacheManager

    assert isinstance(group, SingleTypeKVCacheManager)
    blocks = group.block_pool.blocks
    num_blocks = len(blocks)
    prefix = f"groups[{group.kv_cache_group_id}]"
    tables = group.req_to_blocks
    # NOTE: an allocation gives the request a table in every group; a free drops them all.
    if type(tables) is not dict or set(tables) != holders:
        yield Violation(
            f"{prefix}.req_to_blocks", "must hold a table for exactly the requests holding blocks"
        )
        return
    skips = group.skips_tokens
    for request_id, table in tables.items():
        path = f"{prefix}.req_to_blocks[{request_id!r}]"
        if type(table) is not list:
            yield Violation(path, "must be a list of blocks")
            continue
        for position, block in enumerate(table):
            if type(block) is not KVCacheBlock or not (
                0 <= block.block_id < num_blocks and blocks[block.block_id] is block
            ):
                yield Violation(f"{path}[{position}]", "is not one of the pool's blocks")
                return
            if block.is_null:
                if not skips:
                    yield Violation(
                        f"{path}[{position}]",
                        "the null block stands only where a group skips tokens",
                    )
                continue
            references[block.block_id] += 1
    cached_counts = group.num_cached_block
    if type(cached_counts) is not dict:
        yield Violation(f"{prefix}.num_cached_block", "must be a dict")
        return
    for request_id, count in cached_counts.items():
        held = tables.get(request_id)
        if held is None:
            yield Violation(
                f"{prefix}.num_cached_block[{request_id!r}]", "names a request holding no blocks"
            )
        elif not _int_in(count, 0, len(held) + 1):
            yield Violation(
                f"{prefix}.num_cached_block[{request_id!r}]",
                f"must be in [0, {len(held)}] (the table's blocks), got {count!r}",
            )
    new_ids = group.new_block_ids
    if not group.records_new_block_ids and new_ids:
        yield Violation(f"{prefix}.new_block_ids", "the group records no new block ids")
    elif not _ints_in(new_ids, 1, num_blocks):
        yield Violation(f"{prefix}.new_block_ids", f"must be block ids in [1, {num_blocks})")


# ---------------------------------------------------------------------------- statistics
_STATS_COUNTERS: Final = (
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
)


def _stats(stats: PrefixCacheStats, path: str) -> Iterator[Violation]:
    reset: object = stats.reset  # declared bool; a decoded state may hold anything
    if type(reset) is not bool:
        yield Violation(f"{path}.reset", "must be a bool")
    bad = [n for n in _STATS_COUNTERS if not _int_in(getattr(stats, n), 0, COUNTER_LIMIT)]
    if bad:
        yield Violation(f"{path}.{bad[0]}", _range(0, COUNTER_LIMIT))
        return
    # Every request counted looked up at least one token; hits are part of the lookups.
    if not stats.hits <= stats.queries or stats.requests > stats.queries:
        yield Violation(path, "hits <= queries and requests <= queries")
    if not stats.preempted_hits <= stats.preempted_queries or (
        stats.preempted_requests > stats.preempted_queries
    ):
        yield Violation(path, "preempted_hits <= preempted_queries, requests <= queries")
    by_source = stats.hits_by_source
    if type(by_source) is not dict or not all(
        type(k) is str and _int_in(v, 0, COUNTER_LIMIT) for k, v in by_source.items()
    ):
        yield Violation(f"{path}.hits_by_source", "must map sources (str) to counts")


def _metrics(metrics: PrefixCachingMetrics) -> Iterator[Violation]:
    # NOTE (PrefixCachingMetrics): the aggregates are the sums over the intervals, and the
    # window drops old intervals while it holds more than max_recent_requests requests.
    path = "prefix_caching_metrics"
    intervals = metrics._intervals
    sums = [0, 0, 0]
    for index, interval in enumerate(intervals):
        if (
            type(interval) is not tuple
            or len(interval) != 3
            or not all(_int_in(v, 0, COUNTER_LIMIT) for v in interval)
            or interval[0] < 1
            or interval[2] > interval[1]
        ):
            yield Violation(
                f"{path}.intervals[{index}]", "must be (requests >= 1, queries, hits <= queries)"
            )
            return
        for position in range(3):
            sums[position] += interval[position]
    aggregates = [
        metrics.aggregated_requests,
        metrics.aggregated_query_total,
        metrics.aggregated_query_hit,
    ]
    if aggregates != sums:
        yield Violation(path, f"the aggregates {aggregates} are not the intervals' sums {sums}")
    elif len(intervals) > 1 and sums[0] > metrics.max_recent_requests:
        yield Violation(path, f"holds more than {metrics.max_recent_requests} recent requests")


# --------------------------------------------------------------------------------- pool
def pool_violations(pool: Pool) -> Iterator[Violation]:
    """The broken invariants of a pool, first found first (see the module docstring)."""
    manager = pool.manager
    hash_length = pool.hashing.hash_length_bytes
    if manager is not None:
        if pool.max_model_len != manager.max_model_len:
            yield Violation("max_model_len", f"must be the manager's {manager.max_model_len}")
            return
        yield from manager_violations(manager, hash_length=hash_length)
    yield from _requests(pool, hash_length)
    if manager is None and pool.requests:
        yield Violation("requests", "a pool waiting for its workers has no requests")
    if not _int_in(pool.last_step_seq, 0, REQUEST_KEY_LIMIT):
        yield Violation("last_step_seq", _range(0, REQUEST_KEY_LIMIT))
    for name in ("allocations_not_fit_total", "failed_plans"):
        if not _int_in(getattr(pool, name), 0, COUNTER_LIMIT):
            yield Violation(name, _range(0, COUNTER_LIMIT))
    outcome = pool.last_step_outcome
    if outcome is not None:
        num_blocks = 0 if manager is None else manager.block_pool.num_gpu_blocks
        yield from _outcome(outcome, pool.last_step_seq, num_blocks)
    yield from _event_log(pool, hash_length)
    total, untaken = pool.stats_totals()
    for path, stats in (("stats_total", total), ("stats_untaken", untaken)):
        if type(stats) is not PrefixCacheStats:
            yield Violation(path, "must be a PrefixCacheStats")
            return
        broken = list(_stats(stats, path))
        yield from broken
        if broken:
            return
    for name in _STATS_COUNTERS:
        if getattr(untaken, name) > getattr(total, name):
            yield Violation(f"stats_untaken.{name}", "the untaken counters are part of the totals")
            break


def _requests(pool: Pool, hash_length: int) -> Iterator[Violation]:
    requests = pool.requests
    ids = pool.request_ids
    if type(requests) is not dict or type(ids) is not dict or set(requests) != set(ids):
        yield Violation("request_ids", "must name exactly the live requests")
        return
    live: set[str] = set()
    for key, request in requests.items():
        path = f"requests[{key!r}]"
        if not _int_in(key, 0, REQUEST_KEY_LIMIT):
            yield Violation(path, f"a request key {_range(0, REQUEST_KEY_LIMIT)}")
            continue
        if type(ids[key]) is not str:
            yield Violation(f"request_ids[{key}]", "must be a str")
        if type(request) is not Request or request.request_id != str(key):
            yield Violation(path, "must be a request named by its key")
            continue
        live.add(request.request_id)
        yield from _request(pool, request, path, hash_length)
    manager = pool.manager
    if manager is not None:
        for request_id in manager._requests - live:
            yield Violation(
                f"requests_holding_blocks[{request_id!r}]", "names a request that is not live"
            )
            break
        by_id = {request.request_id: request for request in requests.values()}
        for request_id, junction in manager.coordinator._junctions.items():
            owner = by_id.get(request_id)
            if owner is None:
                yield Violation(f"junctions[{request_id!r}]", "names a request that is not live")
            elif type(junction) is not int or not 0 < junction <= owner.num_tokens:
                yield Violation(
                    f"junctions[{request_id!r}]", "must be a token position within the request"
                )


def _request(pool: Pool, request: Request, path: str, hash_length: int) -> Iterator[Violation]:
    max_model_len = pool.max_model_len
    prompt = request.prompt_token_ids
    tokens = request.all_token_ids
    if not prompt or not _ints_in(prompt, 0, TOKEN_ID_LIMIT):
        yield Violation(f"{path}.prompt_token_ids", "must be a non-empty list of token ids")
        return
    if not _ints_in(tokens, 0, TOKEN_ID_LIMIT) or tokens[: len(prompt)] != prompt:
        yield Violation(f"{path}.all_token_ids", "must be token ids starting with the prompt")
        return
    if request.num_prompt_tokens != len(prompt):
        yield Violation(f"{path}.num_prompt_tokens", "must be the prompt's length")
    num_tokens = len(tokens)
    if num_tokens > max_model_len:
        yield Violation(
            f"{path}.all_token_ids", f"{num_tokens} tokens exceed max_model_len {max_model_len}"
        )
    hashes = request.block_hashes
    max_hashes = pool.expected_num_hashes(num_tokens)
    if type(hashes) is not list or not all(
        type(h) is bytes and len(h) == hash_length for h in hashes
    ):
        yield Violation(f"{path}.block_hashes", f"must be a list of {hash_length}-byte hashes")
    elif len(hashes) > max_hashes:
        yield Violation(
            f"{path}.block_hashes", f"{len(hashes)} hashes, the tokens fill {max_hashes} blocks"
        )
    elif hashes and pool.options.verify_block_hashes:
        computed = pool.computed_hashes(tokens, request.lora_name, request.cache_salt)
        if computed[: len(hashes)] != hashes:
            yield Violation(f"{path}.block_hashes", "differ from the server's hashes")
    if not _int_in(request.num_computed_tokens, 0, num_tokens + 1):
        yield Violation(f"{path}.num_computed_tokens", _range(0, num_tokens + 1))
    if not _int_in(request.num_in_flight_tokens, 0, max_model_len + 1):
        yield Violation(f"{path}.num_in_flight_tokens", _range(0, max_model_len + 1))
    if not _int_in(request.num_preemptions, 0, COUNTER_LIMIT):
        yield Violation(f"{path}.num_preemptions", _range(0, COUNTER_LIMIT))
    if type(request.status) is not RequestStatus:
        yield Violation(f"{path}.status", "must be a RequestStatus")
    if not _opt_int_in(request.lora_id, 0, _INT64_LIMIT):
        yield Violation(f"{path}.lora_id", "must be None or an int in [0, 2**63)")
    for name in ("lora_name", "lora_path", "cache_salt"):
        if not _opt_str(getattr(request, name)):
            yield Violation(f"{path}.{name}", "must be a str or None")
    skip: object = request.skip_reading_prefix_cache
    if type(skip) is not bool:
        yield Violation(f"{path}.skip_reading_prefix_cache", "must be a bool")
    report: object = request.report_cached_blocks
    if type(report) is not bool:
        yield Violation(f"{path}.report_cached_blocks", "must be a bool")
    if request.mm_features or request.prompt_embeds is not None:
        yield Violation(path, "a pool's request carries no multi-modal inputs or embeddings")


def _outcome(outcome: object, step_seq: int, num_blocks: int) -> Iterator[Violation]:
    path = "last_step_outcome"
    if type(outcome) is not StepOutcome:
        yield Violation(path, "must be a StepOutcome or None")
        return
    limits = {
        "alloc_num_block_ids": (0, num_blocks + 1),
        "alloc_block_ids": (0, max(num_blocks, 1)),
        "lookup_num_computed_tokens": (0, TOKEN_ID_LIMIT),
        "lookup_num_new_tokens": (0, TOKEN_ID_LIMIT),
    }
    for name, (low, high) in limits.items():
        if not _ints_in(getattr(outcome, name), low, high):
            yield Violation(f"{path}.{name}", f"must be a list of ints in [{low}, {high})")
    statuses = outcome.alloc_statuses
    if type(statuses) is not list or not all(
        type(s) is int and s in _VALID_STATUSES for s in statuses
    ):
        yield Violation(f"{path}.alloc_statuses", "must be ItemStatus values")
    reset = outcome.reset
    if type(reset) is not list or not all(type(r) is bool for r in reset):
        yield Violation(f"{path}.reset", "must be a list of bools")
    if not _int_in(outcome.num_ops_executed, 0, TOKEN_ID_LIMIT):
        yield Violation(f"{path}.num_ops_executed", _range(0, TOKEN_ID_LIMIT))
    if not _opt_int_in(outcome.token_budget_left, 0, TOKEN_ID_LIMIT):
        yield Violation(f"{path}.token_budget_left", "must be None or a uint32")
    if outcome.step_seq != step_seq:
        yield Violation(f"{path}.step_seq", f"must be last_step_seq {step_seq}")


def _event_log(pool: Pool, hash_length: int) -> Iterator[Violation]:
    # NOTE (EventLog): event i of the kept ones is numbered oldest_sequence + i; kept batches
    # are consecutive, within the kept events, numbered below next_batch.
    log = pool._events
    entries = log._events
    next_sequence = log.next_sequence
    if not _int_in(next_sequence, 1, COUNTER_LIMIT) or len(entries) > next_sequence - 1:
        yield Violation("events.next_sequence", "must follow the kept events")
        return
    if len(entries) > log.retention:
        yield Violation("events", f"keeps at most {log.retention} events (the pool's retention)")
    if not pool.options.enable_kv_cache_events and (entries or next_sequence != 1):
        yield Violation("events", "a pool without KV events publishes none")
    for index, entry in enumerate(entries):
        path = f"events[{index}]"
        if type(entry) is not tuple or len(entry) != 2:
            yield Violation(path, "must be (event, timestamp)")
            return
        event, now = entry
        if type(now) is not float or not math.isfinite(now) or now < 0:
            yield Violation(f"{path}.time", "must be a finite float >= 0")
        yield from _event(event, path, hash_length)
    next_batch = log.next_batch
    if not _int_in(next_batch, 0, COUNTER_LIMIT):
        yield Violation("events.next_batch", _range(0, COUNTER_LIMIT))
        return
    # NOTE: each publication is one batch: kept batches tile the newest events, the last one
    # ends at the last event and is numbered next_batch - 1.
    expected = log.oldest_sequence
    previous = None
    for index, record in enumerate(log._batches):
        path = f"events.batches[{index}]"
        if type(record) is not tuple or len(record) != 4:
            yield Violation(path, "must be (batch, first event, count, timestamp)")
            return
        seq, first, count, now = record
        if (
            not _int_in(seq, 0, next_batch)
            or not _int_in(first, expected, next_sequence)
            or (previous is not None and (seq != previous + 1 or first != expected))
            or not _int_in(count, 1, next_sequence - first + 1)
            or type(now) is not float
            or not math.isfinite(now)
        ):
            yield Violation(path, "batches are consecutive, within the kept events, before next")
            return
        previous = seq
        expected = first + count
    if previous is not None and (previous != next_batch - 1 or expected != next_sequence):
        yield Violation("events.batches", "the last kept batch is the last one published")
