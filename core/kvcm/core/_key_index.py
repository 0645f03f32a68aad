"""The lookup's cross-pool key index: cache key -> the pool slots caching it, and the walk.

Two implementations answer identically (``tests/unit/test_lookup.py`` runs the lookup tests
against both):

* ``kvcm.core._lookup_index.KeyIndex``, compiled (``_lookup_index.c``, built by ``pip install``
  from pyproject.toml): its own open-addressing table of key -> sorted slot array, the walk in
  C with the next blocks' entries prefetched, one key added or removed in O(1) for the usual
  handful of holders;
* :class:`PyKeyIndex`, pure Python, used where the extension is not built: a dictionary of
  key -> bitmask (an int) of the slots.

:data:`KeyIndex` is the compiled one when it imports, else :class:`PyKeyIndex`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, compress, count, islice, repeat
from operator import is_not
from types import ModuleType
from typing import Final, Protocol

__all__ = ["COMPILED", "NATIVE", "KeyIndex", "KeyIndexLike", "PyKeyIndex", "key_chunks"]

MAX_SLOT: Final = 65534
"""The largest slot (the compiled sets hold 16-bit slots)."""


class KeyIndexLike(Protocol):
    """What :class:`kvcm.core.lookup.PrefixIndex` and the allocator use of a key index."""

    def __len__(self) -> int: ...

    def add(self, keys: Iterable[bytes], slot: int, /) -> None:
        """Put ``slot`` in the set of every key of ``keys``."""

    def discard(self, keys: Iterable[bytes], slot: int, /) -> None:
        """Take ``slot`` out of the set of every key of ``keys`` (a key left with none goes)."""

    def get(self, key: bytes, /) -> int:
        """The mask (bit ``i``: slot ``i``) of the slots holding ``key``; 0 if none."""

    def walk(
        self, raw: bytes, hash_size: int, suffix: bytes, max_blocks: int, scope: int, /
    ) -> list[tuple[int, int]]:
        """Walk a prompt: ``raw`` holds its ``hash_size``-byte block hashes, a block's key is
        its hash then ``suffix``; at most ``max_blocks`` blocks are read. Returns ``(blocks
        hit, mask of the slots of ``scope`` hitting exactly that many)`` by increasing depth,
        slots hitting nothing at depth 0; stops at the first block none of them still
        matching holds. ``[]`` when ``scope`` is 0."""


_CHUNK: Final = 256
_chunk_structs: dict[tuple[int, int], struct.Struct] = {}


def _chunk_struct(size: int, number: int) -> struct.Struct:
    """A struct splitting ``number`` consecutive ``size``-byte strings (cached)."""
    split = _chunk_structs.get((size, number))
    if split is None:
        if len(_chunk_structs) > 64:
            _chunk_structs.clear()
        split = _chunk_structs[size, number] = struct.Struct(f"{size}s" * number)
    return split


def key_chunks(
    raw: bytes, size: int, num_blocks: int, suffix: bytes
) -> Iterator[tuple[bytes, ...]]:
    """The first ``num_blocks`` ``size``-byte hashes of ``raw`` with ``suffix`` appended (the
    cache keys), ``_CHUNK`` at a time, so a walk that stops early makes few more than it reads.

    Each chunk is made in C: a struct splits the hashes, ``suffix.join`` interleaves the
    suffix, and a second struct splits the keys (about 3 times cheaper than slicing and
    concatenating block by block).
    """
    num_blocks = min(num_blocks, len(raw) // size)
    for first in range(0, num_blocks, _CHUNK):
        number = min(_CHUNK, num_blocks - first)
        hashes = _chunk_struct(size, number).unpack_from(raw, first * size)
        if not suffix:
            yield hashes
            continue
        keys = _chunk_struct(size + len(suffix), number)
        yield keys.unpack(suffix.join(hashes) + suffix)


class PyKeyIndex:
    """The key index in pure Python: a dictionary of key -> bitmask of the slots.

    Where a run of keys (a request's blocks, in order) held the same mask object, the new mask
    is computed once and that one object stored for the whole run, so a cached prefix keeps
    one mask object per stretch of equal holders: the walk intersects only where a block's
    mask is another object than the block before's.
    """

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        """An empty index."""
        self._keys: dict[bytes, int] = {}

    def __len__(self) -> int:
        """Keys held by at least one slot."""
        return len(self._keys)

    def add(self, keys: Iterable[bytes], slot: int, /) -> None:
        """Put ``slot`` in the set of every key of ``keys``."""
        index = self._keys
        get = index.get
        bit = 1 << _checked(slot)
        old: object = index  # never a value
        new = bit
        for key in keys:
            holders = get(key)
            if holders is not old:
                old = holders
                new = bit if holders is None else holders | bit
            index[key] = new

    def discard(self, keys: Iterable[bytes], slot: int, /) -> None:
        """Take ``slot`` out of the set of every key of ``keys`` (a key left with none goes)."""
        index = self._keys
        get = index.get
        keep = ~(1 << _checked(slot))
        old: object = index  # never a value; masks shared as in add
        holders = 0
        for key in keys:
            value = get(key)
            if value is None:
                continue
            if value is not old:
                old = value
                holders = value & keep
            if holders:
                index[key] = holders
            else:
                del index[key]

    def get(self, key: bytes, /) -> int:
        """The mask of the slots holding ``key``; 0 if none."""
        return self._keys.get(key, 0)

    def walk(
        self, raw: bytes, hash_size: int, suffix: bytes, max_blocks: int, scope: int, /
    ) -> list[tuple[int, int]]:
        """See :meth:`KeyIndexLike.walk`.

        One pass over the prompt's blocks, a chunk at a time. ``running`` is the mask of the
        slots holding every block so far; a slot leaves it at the first block it misses. Per
        block only the key's making and its read run (in C); the intersection is taken only
        where a block's mask is another object than the block before's (an ``is not`` per
        block, also in C).
        """
        get: Callable[[bytes, int], int] = self._keys.get
        running = scope
        if not running:
            return []
        levels: list[tuple[int, int]] = []
        depth = 0
        for chunk in key_chunks(raw, hash_size, max(0, max_blocks), suffix):
            holders = list(map(get, chunk, repeat(0)))
            # Where the holders may change: the chunk's first block (against the slots still
            # matching), then each block whose holders are not the block before's object.
            for offset in chain(
                (0,), compress(count(1), map(is_not, islice(holders, 1, None), holders))
            ):
                matching = running & holders[offset]
                if matching != running:
                    levels.append((depth + offset, running ^ matching))
                    running = matching
                    if not running:
                        return levels
            depth += len(chunk)
        levels.append((depth, running))
        return levels


def _checked(slot: int) -> int:
    if not 0 <= slot <= MAX_SLOT:
        raise ValueError(f"slot must be in [0, {MAX_SLOT}], got {slot}")
    return slot


NATIVE: ModuleType | None
"""The compiled module (``kvcm.core._lookup_index``), or ``None`` where it is not built."""
COMPILED: type[KeyIndexLike] | None
try:
    from kvcm.core import _lookup_index
except ImportError:  # not built: the pure-Python index answers the same
    NATIVE = COMPILED = None
else:
    NATIVE = _lookup_index
    COMPILED = _lookup_index.KeyIndex

KeyIndex: type[KeyIndexLike] = PyKeyIndex if COMPILED is None else COMPILED
"""The key index lookups use: the compiled one when it is built."""
