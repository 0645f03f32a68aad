"""Forged snapshots: a real snapshot's content edited, the frame and CRC recomputed.

``draw_forgery`` takes a valid snapshot (``kvcm.core.snapshot.encode_pool``) and edits it the
way a hostile tenant with a scheduler token would: one value anywhere in the four sections
(block pool, manager, requests, extras; every field of the format, nested values and the
fields of events and statistics included) replaced by a hostile value, an int nudged, a list
entry duplicated, dropped or swapped, a map key dropped or added, a hash byte flipped; or one
value replaced by a damaged encoding (a non-digit or 5,000-digit integer, invalid UTF-8, an
unknown enum value, a list as a map key, 200k-deep nesting, a 7-byte packed array, a count
beyond the data). Some edits keep the state consistent (a permuted free queue, other event
times, other counters that still add up) and must then be accepted and behave.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from collections.abc import Iterator
from typing import Any

from hypothesis import strategies as st

from kvcm.core.request import RequestStatus
from kvcm.core.snapshot import decode_sections, encode_sections
from kvcm.core.stats import PrefixCacheStats

__all__ = ["NAMED_FORGERIES", "RAW_ENCODINGS", "draw_forgery", "reframe"]

_HEADER = struct.Struct("<8sIIQ")
_SECTIONS = ("block_pool", "manager", "requests", "extras")
_MARKER = 0x5EED_F00D_5EED_F00D

HOSTILE_VALUES: tuple[object, ...] = (
    -1, 0, 1, 2, 3, 7, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63),
    "x", "", "1", b"", b"\x00" * 36, b"\xff" * 7, [], {}, None, True, False, 1.5,
    math.nan, math.inf, -0.0, [0], [-1], [1, 1], {"x": 1}, {1: 2}, (1, 2), [[0]],
    PrefixCacheStats(requests=3, queries=1, hits=5),
    PrefixCacheStats(requests=1, queries=2**60, hits=2**60),
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.RUNNING,
)  # fmt: skip


def _blob(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


RAW_ENCODINGS: tuple[tuple[str, bytes], ...] = (
    ("non-digit integer", _blob(b"J", b"12a")),
    ("5,000-digit integer", _blob(b"J", b"9" * 5000)),
    ("empty integer", _blob(b"J", b"")),
    ("invalid UTF-8", _blob(b"S", b"\xff\xfe")),
    ("unknown enum value", _blob(b"E", b"RequestStatus") + b"I" + struct.pack("<q", 99)),
    ("enum value of a wrong type", _blob(b"E", b"RequestStatus") + _blob(b"S", b"RUNNING")),
    ("unknown enum", _blob(b"E", b"os.system") + b"N"),
    ("unknown class", _blob(b"C", b"Popen") + b"M" + struct.pack("<Q", 0)),
    ("class without its fields", _blob(b"C", b"BlockStored") + b"M" + struct.pack("<Q", 0)),
    ("class with a list", _blob(b"C", b"BlockRemoved") + b"L" + struct.pack("<Q", 0)),
    ("list as a key", b"M" + struct.pack("<Q", 1) + b"L" + struct.pack("<Q", 0) + b"N"),
    ("repeated key", b"M" + struct.pack("<Q", 2) + (b"I" + struct.pack("<q", 1) + b"N") * 2),
    ("200k-deep nesting", (b"L" + struct.pack("<Q", 1)) * 200_000 + b"N"),
    ("7-byte array", _blob(b"A", b"\x01" * 7)),
    ("count beyond the data", b"L" + struct.pack("<Q", 2**62)),
    ("blob beyond the data", b"B" + struct.pack("<Q", 2**40)),
    ("unknown tag", b"Z"),
    ("truncated int", b"I\x01\x02"),
)


def reframe(body: bytes) -> bytes:
    """A snapshot frame (magic, version, CRC-32, length) around ``body``."""
    return _HEADER.pack(b"KVCMSNAP", 1, zlib.crc32(body), len(body)) + body


# ------------------------------------------------------------------------------- paths
def _children(node: object) -> Iterator[tuple[object, object]]:
    """(step, child) of a container: list index, map key, or a value class's field name."""
    if isinstance(node, (list, tuple)):
        yield from enumerate(node)
    elif isinstance(node, dict):
        yield from node.items()
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            yield f".{field.name}", getattr(node, field.name)


def _paths(node: object, prefix: tuple[object, ...] = ()) -> Iterator[tuple[object, ...]]:
    yield prefix
    for step, child in _children(node):
        yield from _paths(child, (*prefix, step))


def _is_field(node: object, step: object) -> bool:
    return isinstance(step, str) and step.startswith(".") and dataclasses.is_dataclass(node)


def _get(tree: object, path: tuple[object, ...]) -> Any:
    node: Any = tree
    for step in path:
        node = getattr(node, step[1:]) if _is_field(node, step) else node[step]  # type: ignore[index]
    return node


def _set(tree: list[Any], path: tuple[object, ...], value: object) -> None:
    """Replace the value at ``path`` (rebuilding tuples and frozen value classes above it)."""
    if len(path) == 1:
        tree[path[0]] = value  # type: ignore[index]
        return
    parent = _get(tree, path[:-1])
    step = path[-1]
    if _is_field(parent, step):
        assert isinstance(step, str)
        _set(tree, path[:-1], dataclasses.replace(parent, **{step[1:]: value}))
    elif isinstance(parent, tuple):
        items = list(parent)
        items[step] = value  # type: ignore[call-overload]
        _set(tree, path[:-1], tuple(items))
    else:
        parent[step] = value


def _describe(path: tuple[object, ...]) -> str:
    text = _SECTIONS[path[0]] if path and isinstance(path[0], int) else ""  # type: ignore[index]
    for step in path[1:]:
        text += step if isinstance(step, str) and step.startswith(".") else f"[{step!r}]"
    return text


# ----------------------------------------------------------------------------- edits
def _edit(data: st.DataObject, node: object) -> tuple[object, str]:
    """A new value for ``node`` and what was done."""
    kinds = ["hostile"]
    if type(node) is int:
        kinds += ["nudge", "nudge"]
    if isinstance(node, list) and node:
        kinds += ["duplicate", "drop", "swap", "shuffle"]
    if isinstance(node, dict):
        kinds += ["drop key", "add key"]
    if isinstance(node, bytes) and node:
        kinds += ["flip", "cut"]
    if type(node) is float:
        kinds += ["time"]
    kind = data.draw(st.sampled_from(kinds), label="edit")
    if kind == "nudge":
        assert type(node) is int
        delta = data.draw(st.sampled_from([-1, 1, 2, -2, 1000]), label="delta")
        return node + delta, f"{node} + {delta}"
    if isinstance(node, list) and kind in ("duplicate", "drop", "swap", "shuffle"):
        items = list(node)
        i = data.draw(st.integers(0, len(items) - 1), label="index")
        if kind == "duplicate":
            items.insert(data.draw(st.integers(0, len(items)), label="at"), items[i])
        elif kind == "drop":
            del items[i]
        elif kind == "swap":
            j = data.draw(st.integers(0, len(items) - 1), label="other")
            items[i], items[j] = items[j], items[i]
        else:
            items = data.draw(st.permutations(items), label="order")
        return items, f"{kind} entry {i}"
    if isinstance(node, dict) and kind in ("drop key", "add key"):
        items = dict(node)
        if kind == "drop key" and items:
            key = data.draw(st.sampled_from(sorted(items, key=repr)), label="key")
            del items[key]
            return items, f"drop key {key!r}"
        key = data.draw(st.sampled_from(["surprise", "1", 1, None, -1]), label="new key")
        items[key] = data.draw(st.sampled_from(HOSTILE_VALUES[:12]), label="new value")
        return items, f"add key {key!r}"
    if isinstance(node, bytes) and kind in ("flip", "cut"):
        at = data.draw(st.integers(0, len(node) - 1), label="byte")
        if kind == "flip":
            return node[:at] + bytes([node[at] ^ 0xFF]) + node[at + 1 :], f"flip byte {at}"
        return node[:at], f"cut at {at}"
    if kind == "time":
        value = data.draw(st.floats(allow_nan=True, allow_infinity=True), label="time")
        return value, f"time {value!r}"
    value = data.draw(st.sampled_from(HOSTILE_VALUES), label="hostile")
    return value, f"= {value!r}"


def draw_forgery(data: st.DataObject, snapshot: bytes) -> tuple[bytes, str]:
    """``snapshot`` with one hostile edit (valid frame and CRC) and a description of it."""
    sections = decode_sections(snapshot)
    paths = [p for p in _paths(sections) if p]
    path = data.draw(st.sampled_from(paths), label="path")
    where = _describe(path)
    if data.draw(st.integers(0, 4), label="raw?") == 0:
        name, raw = data.draw(st.sampled_from(RAW_ENCODINGS), label="encoding")
        _set(sections, path, _MARKER)
        body = encode_sections(sections)[_HEADER.size :]
        marker = b"I" + struct.pack("<q", _MARKER)
        return reframe(body.replace(marker, raw, 1)), f"{where}: {name}"
    value, how = _edit(data, _get(sections, path))
    _set(sections, path, value)
    return encode_sections(sections), f"{where}: {how}"


# ------------------------------------------------------------------------- named ones
def _edited(path: tuple[object, ...], value: object) -> Any:
    def forge(snapshot: bytes) -> bytes:
        sections = decode_sections(snapshot)
        _set(sections, path, value)
        return encode_sections(sections)

    return forge


def _appended(key: str, pick: Any) -> Any:
    def forge(snapshot: bytes) -> bytes:
        sections = decode_sections(snapshot)
        state = sections[0]
        state[key] = [*state[key], pick(state)]
        return encode_sections(sections)

    return forge


def _spliced(raw: bytes) -> Any:
    def forge(snapshot: bytes) -> bytes:
        sections = decode_sections(snapshot)
        sections[3]["failed_plans"] = _MARKER
        body = encode_sections(sections)[_HEADER.size :]
        return reframe(body.replace(b"I" + struct.pack("<q", _MARKER), raw, 1))

    return forge


NAMED_FORGERIES: dict[str, tuple[Any, str]] = {
    "free queue names block -1": (_edited((0, "free", 0), -1), "block_pool.free[0]"),
    "free queue names a block twice": (_appended("free", lambda s: s["free"][0]), "twice"),
    "negative ref count": (_edited((0, "ref_cnts", 2), -1), "block_pool.ref_cnts[2]"),
    "a block both held and free": (
        _appended("free", lambda s: next(i for i, r in enumerate(s["ref_cnts"]) if r > 0)),
        "is free but has ref_cnt",
    ),
    "request key is a string": (_edited((2, 0, 0), "1"), "requests[0].key"),
    "request key is 2**70": (_edited((2, 0, 0), 2**70), "requests[0].key"),
    "computed tokens past the prompt": (_edited((2, 0, 7), 10_000), "num_computed_tokens"),
    "garbage statistics": (
        _edited((3, "stats_totals", 0), PrefixCacheStats(requests=-5)),
        "stats_total.requests",
    ),
    "max_model_len overrides the config": (
        _edited((3, "max_model_len"), 1 << 20),
        "extras.max_model_len",
    ),
    **{
        name: (_spliced(raw), "extras.failed_plans")
        for name, raw in RAW_ENCODINGS
        if name not in ("repeated key", "truncated int")
    },
}
"""The forgeries the issue reported, each with a fragment of the message that names where."""
