"""Byte snapshots of a core ``Pool``, to prove that a rejected call changed nothing.

``pool_state`` walks the pool's whole object graph (the block pool with every block's
reference count, hash and free-queue neighbours, the prefix-cache map in insertion order, the
request table, the per-group managers, step_seq, counters and the event log) and renders it
deterministically. Two pools in the same state render to the same bytes, so the function also
compares the served pool with the in-process reference.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from types import FunctionType, MethodType, ModuleType
from typing import Any

from google.protobuf.message import Message

from kvcm.core.block import KVCacheBlock
from kvcm.core.event_log import EventLog
from kvcm.core.pool import Pool, PoolRegistry

__all__ = ["pool_state", "registry_state", "state_of"]

# What a reference pool cannot share with the served one: the servicer's cached Step answer
# (a protobuf object the reference never builds) and publication timestamps (wall clock).
_SERVED_ONLY = frozenset({"last_step_response"})


def _block(block: KVCacheBlock) -> str:
    prev_block, next_block = block.prev_free_block, block.next_free_block
    return (
        f"B{block.block_id}(ref={block.ref_cnt},hash={block.block_hash!r},"
        f"n={block.block_hash_num_tokens},prev={getattr(prev_block, 'block_id', None)},"
        f"next={getattr(next_block, 'block_id', None)},null={block.is_null})"
    )


def _attributes(obj: object) -> list[str]:
    names: set[str] = set()
    for cls in type(obj).__mro__:
        names.update(getattr(cls, "__slots__", ()))
    names.update(getattr(obj, "__dict__", {}))
    names.discard("__dict__")
    names.discard("__weakref__")
    return sorted(names)


class _Walker:
    def __init__(self, *, with_times: bool) -> None:
        self.with_times = with_times
        self.out: list[str] = []
        self.seen: dict[int, int] = {}

    def walk(self, obj: Any) -> None:
        out = self.out
        if obj is None or isinstance(obj, (bool, int, float, str, bytes, enum.Enum)):
            out.append(repr(obj))
        elif isinstance(obj, KVCacheBlock):
            out.append(_block(obj))
        elif isinstance(obj, Message):
            out.append(f"pb:{type(obj).__name__}:{obj.SerializeToString(deterministic=True)!r}")
        elif isinstance(obj, (FunctionType, MethodType, ModuleType, type)) or (
            isinstance(obj, Callable) and not hasattr(obj, "__dict__")  # type: ignore[arg-type]
        ):
            out.append("<code>")
        elif isinstance(obj, EventLog):
            self._event_log(obj)
        elif isinstance(obj, (list, tuple, deque)):
            out.append(f"{type(obj).__name__}[")
            for item in obj:
                self.walk(item)
            out.append("]")
        elif isinstance(obj, dict):
            out.append("{")
            for key, value in obj.items():
                self.walk(key)
                out.append(":")
                self.walk(value)
            out.append("}")
        elif isinstance(obj, (set, frozenset)):
            out.append("set" + repr(sorted(repr(item) for item in obj)))
        else:
            self._object(obj)

    def _object(self, obj: object) -> None:
        ref = self.seen.get(id(obj))
        if ref is not None:
            self.out.append(f"@{ref}")
            return
        self.seen[id(obj)] = len(self.seen)
        self.out.append(f"{type(obj).__name__}(")
        for name in _attributes(obj):
            if not self.with_times and name in _SERVED_ONLY:
                continue
            self.out.append(f"{name}=")
            try:
                value = getattr(obj, name)
            except AttributeError:
                self.out.append("<unset>")
                continue
            self.walk(value)
        self.out.append(")")

    def _event_log(self, log: EventLog) -> None:
        self.out.append(f"EventLog(retention={log.retention},next={log.last_sequence + 1},[")
        for event, stamp in log._events:
            self.walk(event)
            if self.with_times:
                self.out.append(repr(stamp))
        self.out.append("])")


def pool_state(pool: Pool, *, with_times: bool = True) -> bytes:
    """The pool's whole state, rendered deterministically.

    Args:
        pool: A core pool (served or in-process).
        with_times: Include what only the served pool has (event timestamps, the cached
            Step answer); off to compare a served pool with the in-process reference.

    Returns:
        Bytes equal for pools in equal states.
    """
    walker = _Walker(with_times=with_times)
    walker.walk(pool)
    return "".join(walker.out).encode()


def state_of(pool: Pool) -> bytes:
    """The pool's state for before/after comparisons: the core's fingerprint where it has one."""
    fingerprint: Callable[[], object] | None = getattr(pool, "state_fingerprint", None)
    if fingerprint is not None:
        value = fingerprint()
        return value if isinstance(value, bytes) else repr(value).encode()
    return pool_state(pool)


def registry_state(registry: PoolRegistry) -> dict[str, bytes]:
    """Every pool's state by pool id (pools created or deleted show as keys)."""
    return {pool.name: state_of(pool) for pool in registry.list()}
