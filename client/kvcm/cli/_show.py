"""How the operator's commands print: aligned tables for people, JSON for scripts.

The JSON of a record is its fields, recursively (enums by name, bytes as hex), so a field the
SDK's records gain shows up in ``--json`` without a change here.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kvcm.client import EventBatch, LookupAnswer, PoolInfo
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = [
    "describe_lines",
    "event_batch_lines",
    "jsonable",
    "lookup_lines",
    "percent",
    "table",
]


def jsonable(value: Any) -> Any:
    """``value`` as JSON-ready data: records as objects, enums by name, bytes as hex."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bytes | bytearray):
        return bytes(value).hex()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: jsonable(v) for k, v in value._asdict().items()}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def percent(value: float | None) -> str:
    """``0.125`` -> ``12.5%`` (``-`` when unknown)."""
    return "-" if value is None else f"{100.0 * value:.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return lines


def labels_text(labels: Mapping[str, str]) -> str:
    """``k=v,k=v`` sorted (``-`` when none)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-"


def _lag_text(info: PoolInfo) -> str:
    progress = info.step_progress
    if progress is None:
        return "-"
    return (
        f"step {progress.last_step_seq}, {progress.steps_behind} behind, "
        f"applied {progress.since_applied_s:.1f}s ago"
    )


def _events_text(info: PoolInfo) -> str:
    if not info.config.enable_kv_cache_events:
        return "off (created without enable_kv_cache_events)"
    text = f"last sequence {info.last_event_sequence} (epoch {info.epoch})"
    zmq = info.zmq_events
    if zmq is not None:
        text += (
            f"; ZMQ {zmq.endpoint} topic {zmq.topic!r} last seq {zmq.last_seq}"
            f"{' (dedicated)' if zmq.dedicated else ''}"
        )
        if zmq.replay_endpoint:
            text += f", replay {zmq.replay_endpoint}"
    return text


def _lease_text(info: PoolInfo) -> str:
    config = info.config
    if config.scheduler_lease_s <= 0:
        return "none (scheduler_lease_s 0)"
    return f"scheduler {config.scheduler_lease_s:g}s, on expiry {config.lease_expiry.name}"


def describe_lines(info: PoolInfo, hit_rate: float | None) -> list[str]:
    """``kvcm describe``'s text: the pool, then its groups and its config."""
    planned = info.kv_cache_config
    num_blocks = planned.num_blocks if planned is not None else 0
    hashing = info.hashing
    world = info.config.world_size
    ranks = " ".join(str(r) for r in info.registered_ranks) or "none"
    stats = info.prefix_cache
    rows: list[tuple[str, str]] = [
        ("pool", info.pool_id),
        ("state", info.state.name),
        ("epoch", str(info.epoch)),
        ("labels", labels_text(info.config.labels)),
        (
            "usage",
            f"{percent(info.usage)} ({info.num_free_blocks} of {num_blocks} blocks free)",
        ),
        ("requests", str(info.num_requests)),
        (
            "hit rate",
            f"{percent(hit_rate)} ({stats.hits} of {stats.queries} tokens; recent "
            f"{percent(stats.recent_hit_rate)})",
        ),
        ("events", _events_text(info)),
        ("lag", _lag_text(info)),
        ("leases", _lease_text(info)),
        (
            "hashing",
            f"{hashing.algorithm.name.lower()}, {hashing.hash_block_size} tokens a block, "
            f"{hashing.hash_length_bytes}-byte hashes",
        ),
        ("ranks", f"{ranks} (world size {world})" if world else "explicit layout"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if planned is not None:
        lines += ["", "groups:"]
        group_rows = [
            (
                index,
                type(group.kv_cache_spec).__name__,
                group.kv_cache_spec.block_size,
                len(group.layer_names),
                ",".join(group.layer_names[:3]) + ("..." if len(group.layer_names) > 3 else ""),
            )
            for index, group in enumerate(planned.kv_cache_groups)
        ]
        lines += [
            "  " + line
            for line in table(["GROUP", "SPEC", "BLOCK_SIZE", "LAYERS", "NAMES"], group_rows)
        ]
    lines += ["", "config:"]
    config = jsonable(info.config)
    config.pop("explicit_layout", None)  # the groups above
    config.pop("labels", None)
    width = max(len(k) for k in config)
    lines += [f"  {k.ljust(width)}  {'-' if v is None else v}" for k, v in sorted(config.items())]
    return lines


def lookup_lines(answer: LookupAnswer) -> list[str]:
    """``kvcm lookup``'s text: the ranked pools, the skipped ones, the scope's size."""
    rows = [
        (
            rank,
            hit.pool_id,
            hit.num_hit_tokens,
            hit.num_tokens,
            percent(hit.num_hit_tokens / hit.num_tokens if hit.num_tokens else 0.0),
            percent(hit.load.usage),
            hit.load.num_running,
            hit.load.num_waiting,
            f"{hit.score:.4f}",
        )
        for rank, hit in enumerate(answer.pools, start=1)
    ]
    headers = ["RANK", "POOL", "HIT_TOKENS", "TOKENS", "HIT", "USAGE", "RUNNING", "WAITING"]
    lines = table([*headers, "SCORE"], rows) if rows else ["no pool answered"]
    lines += [f"skipped {pool_id}: {reason}" for pool_id, reason in answer.skipped]
    lines.append(f"{answer.num_pools_in_scope} pool(s) in scope")
    return lines


def _hashes(hashes: Sequence[bytes | int]) -> str:
    shown = [h.hex()[:16] if isinstance(h, bytes) else f"{h:x}" for h in hashes[:4]]
    return " ".join(shown) + (f" ... ({len(hashes)})" if len(hashes) > 4 else "")


def event_line(sequence: int | None, event: object) -> str:
    """One event in one line (``sequence`` ``None``: the wire numbers batches, not events)."""
    where = "" if sequence is None else f"{sequence} "
    if isinstance(event, BlockStored):
        group = "" if event.group_idx is None else f" group {event.group_idx}"
        parent = event.parent_block_hash
        return (
            f"{where}BlockStored{group}: {len(event.block_hashes)} block(s) "
            f"[{_hashes(event.block_hashes)}] parent "
            f"{parent.hex()[:16] if parent else '-'}, {len(event.token_ids)} tokens"
        )
    if isinstance(event, BlockRemoved):
        group = "" if event.group_idx is None else f" group {event.group_idx}"
        return (
            f"{where}BlockRemoved{group}: {len(event.block_hashes)} block(s) "
            f"[{_hashes(event.block_hashes)}]"
        )
    if isinstance(event, AllBlocksCleared):
        return f"{where}AllBlocksCleared"
    return f"{where}{type(event).__name__}"


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%H:%M:%S.%f")[:-3]


def event_batch_lines(pool_id: str, batch: EventBatch) -> list[str]:
    """A gRPC stream batch: a header line, then one indented line per event."""
    count = len(batch.events)
    span = (
        f"seq {batch.first_sequence}-{batch.last_sequence}"
        if count
        else f"no events (next seq {batch.first_sequence})"
    )
    lines = [
        f"{pool_id} {span} epoch {batch.pool_epoch} at {_when(batch.timestamp_unix_seconds)} "
        f"({count} event{'s' if count != 1 else ''})"
    ]
    lines += [
        "  " + event_line(batch.first_sequence + i, event) for i, event in enumerate(batch.events)
    ]
    return lines


def zmq_batch_lines(topic: str, seq: int, batch: Sequence[Any]) -> list[str]:
    """A ZMQ batch (vLLM's ``[ts, events, data_parallel_rank]``, events as tagged maps)."""
    timestamp, events, *rest = batch
    rank = rest[0] if rest else None
    lines = [
        f"{topic} seq {seq} at {_when(float(timestamp))} rank {rank} "
        f"({len(events)} event{'s' if len(events) != 1 else ''})"
    ]
    for event in events:
        kind = event.get("type", "?") if isinstance(event, Mapping) else str(event)
        hashes = event.get("block_hashes", []) if isinstance(event, Mapping) else []
        detail = f": {len(hashes)} block(s) [{_hashes(hashes)}]" if hashes else ""
        lines.append(f"  {kind}{detail}")
    return lines
