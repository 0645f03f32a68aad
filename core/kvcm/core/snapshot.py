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
integer columns for the per-block state, behind a magic, a version and a CRC-32. Decoding
never builds anything outside that allow-list, so a snapshot is safe to take from a client.

Cost: one pass over blocks and requests; per-block columns are packed arrays, so a pool of a
million blocks encodes and decodes in about a second.
"""

from __future__ import annotations

import enum
import struct
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING, Any, Final

from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.common.hashing import BlockHash, BlockHashWithGroupId
from kvcm.core.limits import DEFAULT_LIMITS, Limits
from kvcm.core.pool_types import PoolState
from kvcm.core.program import StepOutcome
from kvcm.core.request import Request, RequestStatus
from kvcm.core.stats import PrefixCacheStats

if TYPE_CHECKING:
    from kvcm.core.block import KVCacheBlock
    from kvcm.core.manager import KVCacheManager
    from kvcm.core.pool import Pool
    from kvcm.core.pool_types import PoolConfig

__all__ = ["SNAPSHOT_VERSION", "decode_pool", "encode_pool", "encode_state", "fresh_extras"]

_MAGIC: Final = b"KVCMSNAP"
SNAPSHOT_VERSION: Final = 1
_HEADER: Final = struct.Struct("<8sIIQ")  # magic, version, crc32 of the body, body length

# The value classes a snapshot may name (decoding builds nothing else).
_DATACLASSES: Final[Mapping[str, type]] = {
    cls.__name__: cls
    for cls in (BlockStored, BlockRemoved, AllBlocksCleared, PrefixCacheStats, StepOutcome)
}
_ENUMS: Final[Mapping[str, type[enum.Enum]]] = {RequestStatus.__name__: RequestStatus}


# ---------------------------------------------------------------------------- the codec
class _Writer:
    """Tagged values: N none, T/F bool, I int64, J big int, D float, B bytes, S str, L list,
    U tuple, M dict (pairs), A packed int64 array, C dataclass, E enum."""

    __slots__ = ("out",)

    def __init__(self) -> None:
        self.out = bytearray()

    def value(self, value: object) -> None:
        out = self.out
        if value is None:
            out += b"N"
        elif value is True:
            out += b"T"
        elif value is False:
            out += b"F"
        elif isinstance(value, enum.Enum):
            self._named(b"E", type(value).__name__)
            self.value(value.value)
        elif isinstance(value, int):
            if -(1 << 63) <= value < (1 << 63):
                out += b"I"
                out += struct.pack("<q", value)
            else:
                self._blob(b"J", str(value).encode())
        elif isinstance(value, float):
            out += b"D"
            out += struct.pack("<d", value)
        elif isinstance(value, (bytes, bytearray)):
            self._blob(b"B", bytes(value))
        elif isinstance(value, str):
            self._blob(b"S", value.encode())
        elif isinstance(value, array):
            self._blob(b"A", value.tobytes())
        elif isinstance(value, (list, tuple, deque)):
            out += b"U" if isinstance(value, tuple) else b"L"
            out += struct.pack("<Q", len(value))
            for item in value:
                self.value(item)
        elif isinstance(value, dict):
            out += b"M"
            out += struct.pack("<Q", len(value))
            for key, item in value.items():
                self.value(key)
                self.value(item)
        elif is_dataclass(value) and type(value).__name__ in _DATACLASSES:
            self._named(b"C", type(value).__name__)
            self.value({f.name: getattr(value, f.name) for f in fields(value)})
        else:
            raise TypeError(f"a snapshot cannot hold {type(value).__name__}")

    def ints(self, values: list[int]) -> None:
        self.value(array("q", values))

    def _blob(self, tag: bytes, data: bytes) -> None:
        self.out += tag
        self.out += struct.pack("<Q", len(data))
        self.out += data

    def _named(self, tag: bytes, name: str) -> None:
        self._blob(tag, name.encode())


class _Reader:
    """Reads what :class:`_Writer` wrote; any inconsistency is InvalidArgumentError."""

    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.at = 0

    def _take(self, size: int) -> memoryview:
        end = self.at + size
        if size < 0 or end > len(self.data):
            raise InvalidArgumentError("the snapshot is truncated", field="data")
        chunk = self.data[self.at : end]
        self.at = end
        return chunk

    def _length(self) -> int:
        (size,) = struct.unpack("<Q", self._take(8))
        return int(size)

    def value(self) -> Any:
        tag = bytes(self._take(1))
        if tag == b"N":
            return None
        if tag == b"T":
            return True
        if tag == b"F":
            return False
        if tag == b"I":
            return struct.unpack("<q", self._take(8))[0]
        if tag == b"J":
            return int(bytes(self._take(self._length())).decode())
        if tag == b"D":
            return struct.unpack("<d", self._take(8))[0]
        if tag == b"B":
            return bytes(self._take(self._length()))
        if tag == b"S":
            return bytes(self._take(self._length())).decode()
        if tag == b"A":
            packed = array("q")
            packed.frombytes(self._take(self._length()))
            return packed.tolist()
        if tag == b"L":
            return [self.value() for _ in range(self._length())]
        if tag == b"U":
            return tuple([self.value() for _ in range(self._length())])
        if tag == b"M":
            count = self._length()
            result = {}
            for _ in range(count):
                key = self.value()
                result[key] = self.value()
            return result
        if tag == b"E":
            name = bytes(self._take(self._length())).decode()
            cls = _ENUMS.get(name)
            if cls is None:
                raise InvalidArgumentError(f"the snapshot names unknown enum {name!r}")
            return cls(self.value())
        if tag == b"C":
            name = bytes(self._take(self._length())).decode()
            dataclass_type = _DATACLASSES.get(name)
            if dataclass_type is None:
                raise InvalidArgumentError(f"the snapshot names unknown class {name!r}")
            values = self.value()
            if not isinstance(values, dict):
                raise InvalidArgumentError(f"the snapshot's {name} is malformed")
            return _build(dataclass_type, values)
        raise InvalidArgumentError(f"the snapshot has an unknown tag {tag!r}", field="data")


def _build(cls: type, values: dict[Any, Any]) -> object:
    try:
        return cls(**values)
    except TypeError as exc:
        raise InvalidArgumentError(f"the snapshot's {cls.__name__} is malformed: {exc}") from None


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
            "events": [[event, now] for event, now in pool.event_log_contents()],
            "event_batches": _batch_state(pool),
            "stats_totals": list(pool.stats_totals()),
        },
    )


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
    body = _Writer()
    block_state = _block_pool_state(manager)
    if drop_pending_events:
        block_state["num_events_taken"] = manager.block_pool.num_events_emitted
        block_state["kv_event_queue"] = []
    body.value(block_state)
    body.value(_manager_state(manager, rename))
    body.value(_requests_state(requests, request_ids))
    body.value(dict(extras))
    payload = bytes(body.out)
    header = _HEADER.pack(_MAGIC, SNAPSHOT_VERSION, zlib.crc32(payload), len(payload))
    return header + payload


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
            }
        )
    metrics = manager.prefix_caching_metrics
    return {
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

    Raises:
        InvalidArgumentError: Not a snapshot, a damaged one (CRC), another version, or one
            whose blocks or groups do not match ``options``; ``field`` is ``"data"``.
        ConfigError: ``options`` cannot build a pool.
    """
    from kvcm.core.pool import Pool

    body = _check_header(data)
    reader = _Reader(body)
    block_state = reader.value()
    manager_state = reader.value()
    request_state = reader.value()
    extras = reader.value()
    if reader.at != len(body):
        raise InvalidArgumentError("the snapshot has trailing bytes", field="data")
    pool = Pool(name, options, limits=limits, blocks_in_use=blocks_in_use)
    manager = pool.ready_manager()
    try:
        _restore_block_pool(manager, block_state)
        _restore_manager(manager, manager_state)
        _restore_requests(pool, request_state)
        _restore_extras(pool, extras)
    except (KeyError, IndexError, TypeError, ValueError, struct.error) as exc:
        if isinstance(exc, InvalidArgumentError):
            raise
        raise InvalidArgumentError(
            f"the snapshot does not fit pool {name!r}'s config: {exc!r}", field="data"
        ) from None
    return pool


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


def _restore_block_pool(manager: KVCacheManager, state: dict[str, Any]) -> None:
    from kvcm.core.block import FreeKVCacheBlockQueue

    pool = manager.block_pool
    blocks = pool.blocks
    if state["num_blocks"] != len(blocks):
        raise InvalidArgumentError(
            f"the snapshot has {state['num_blocks']} blocks, the config {len(blocks)}",
            field="data",
        )
    hashes: bytes = state["hashes"]
    at = 0
    for block, ref_cnt, length, tokens in zip(
        blocks, state["ref_cnts"], state["hash_lengths"], state["hashed_tokens"], strict=True
    ):
        block.ref_cnt = ref_cnt
        if length < 0:
            block.block_hash = None
        else:
            block.block_hash = BlockHashWithGroupId(hashes[at : at + length])
            at += length
        block.block_hash_num_tokens = None if tokens < 0 else tokens
    free = [blocks[i] for i in state["free"]]
    for block in blocks:
        block.prev_free_block = block.next_free_block = None
    pool.free_block_queue = FreeKVCacheBlockQueue(free)
    cached: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}
    keys: bytes = state["cache_keys"]
    entries: list[int] = state["cache_entries"]
    at = cursor = 0
    for length in state["cache_key_lengths"]:
        key = BlockHashWithGroupId(keys[at : at + length])
        at += length
        head = entries[cursor]
        cursor += 1
        if head >= 0:
            cached[key] = blocks[head]
        else:
            count = -1 - head
            cached[key] = {i: blocks[i] for i in entries[cursor : cursor + count]}
            cursor += count
    pool._cached = cached
    pool._secondary_keys = {
        int(block_id): dict.fromkeys(BlockHashWithGroupId(k) for k in keys_)
        for block_id, keys_ in state["secondary_keys"].items()
    }
    pool._num_cached_blocks = state["num_cached_blocks"]
    pool.kv_event_queue = list(state["kv_event_queue"])
    pool._num_events_taken = state["num_events_taken"]
    pool.num_evicted_blocks = state["num_evicted_blocks"]


def _restore_manager(manager: KVCacheManager, state: dict[str, Any]) -> None:
    blocks = manager.block_pool.blocks
    groups = manager.coordinator.single_type_managers
    if len(state["groups"]) != len(groups):
        raise InvalidArgumentError(
            f"the snapshot has {len(state['groups'])} groups, the config {len(groups)}",
            field="data",
        )
    for group, saved in zip(groups, state["groups"], strict=True):
        group.req_to_blocks = {
            rid: [blocks[i] for i in ids] for rid, ids in saved["req_to_blocks"].items()
        }
        group.num_cached_block = dict(saved["num_cached_block"])
        group.new_block_ids = list(saved["new_block_ids"])
    manager._requests = set(state["requests"])
    stats = state["prefix_cache_stats"]
    if manager.log_stats:  # a snapshot of a copy that kept no stats starts them afresh
        manager.prefix_cache_stats = stats if stats is not None else PrefixCacheStats()
    metrics = manager.prefix_caching_metrics
    requests, queries, hits, intervals = state["metrics"]
    metrics.aggregated_requests = requests
    metrics.aggregated_query_total = queries
    metrics.aggregated_query_hit = hits
    metrics._intervals = deque(tuple(i) for i in intervals)


def _restore_requests(pool: Pool, state: list[list[Any]]) -> None:
    for entry in state:
        (
            key, request_id, prompt, tokens, hashes, num_hashes, status, computed,
            in_flight, preemptions, lora_id, lora_name, lora_path, cache_salt, skip,
        ) = entry  # fmt: skip
        request = Request(
            str(key),
            prompt,
            lora_id=lora_id,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            status=status,
            skip_reading_prefix_cache=skip,
        )
        request.all_token_ids = list(tokens)
        size = len(hashes) // num_hashes if num_hashes else 0
        request.block_hashes = [
            BlockHash(hashes[i * size : (i + 1) * size]) for i in range(num_hashes)
        ]
        request.num_computed_tokens = computed
        request.num_in_flight_tokens = in_flight
        request.num_preemptions = preemptions
        pool.requests[key] = request
        pool.request_ids[key] = request_id


def _restore_extras(pool: Pool, extras: dict[str, Any]) -> None:
    pool.last_step_seq = extras["last_step_seq"]
    pool.last_step_outcome = extras["last_step_outcome"]
    pool.allocations_not_fit_total = extras["allocations_not_fit_total"]
    pool.failed_plans = extras["failed_plans"]
    pool.max_model_len = extras["max_model_len"]
    # Snapshots written before batches were numbered have no "event_batches".
    next_batch, batches = extras.get("event_batches", (0, ()))
    pool.restore_events(
        extras["event_next_sequence"],
        [(event, now) for event, now in extras["events"]],
        (next_batch, [tuple(record) for record in batches]),
    )
    total, untaken = extras["stats_totals"]
    pool.restore_stats_totals(total, untaken)
