"""The snapshot encoding: a small tagged format, its reader and typed access to what it read.

Private to :mod:`kvcm.core.snapshot`. :class:`Writer` writes ints, floats, strings, bytes,
lists, maps, packed int64 columns and an allow-list of value classes and enums; :class:`Reader`
reads them back and builds nothing else. Every fault the reader or the typed accessors find is
an :class:`~kvcm.common.errors.InvalidArgumentError` (``field="data"``) whose message names the
place (``block_pool.free[3]``, ``extras.events[2][0]``): a snapshot is client input.
"""

from __future__ import annotations

import enum
import re
import struct
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import Any, Final

from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.common.specs import spec_classes
from kvcm.core.program import TRANSIENT, StepOutcome
from kvcm.core.request import RequestStatus
from kvcm.core.stats import PrefixCacheStats

__all__ = [
    "Encoded",
    "Reader",
    "Writer",
    "as_int",
    "as_ints",
    "as_list",
    "as_type",
    "bad",
    "encoded_list",
    "event_entry",
    "fields_of",
    "short",
]

# The value classes a snapshot may name (decoding builds nothing else), with a rank's
# registered layer specs (a pool planned by its workers): the spec classes whose traits allow
# them (``traits.snapshot``).
_DATACLASSES: Final[Mapping[str, type]] = {
    cls.__name__: cls
    for cls in (
        BlockStored,
        BlockRemoved,
        AllBlocksCleared,
        PrefixCacheStats,
        StepOutcome,
        *(spec for spec in spec_classes() if spec.traits.snapshot),
    )
}
_ENUMS: Final[Mapping[str, type[enum.Enum]]] = {cls.__name__: cls for cls in (RequestStatus, DType)}
# Decoding bounds: no value of a real snapshot nests deeper or needs a longer integer.
_MAX_DEPTH: Final = 32
_BIG_INT: Final = re.compile(rb"-?[0-9]{1,40}")
_MISSING: Final = object()
_SIMPLE_TAGS: Final[Mapping[bytes, object]] = {b"N": None, b"T": True, b"F": False}
_INT_ONLY: Final = frozenset({int})
_KEY_TYPES: Final = frozenset({type(None), bool, int, float, str, bytes})


# ---------------------------------------------------------------------------- the codec
class Encoded(bytes):
    """A value already written by :class:`Writer` (its tagged bytes), copied as it is."""

    __slots__ = ()


def event_entry(event: object, now: float) -> bytes:
    """An event log entry ``[event, timestamp]`` as a snapshot writes it (the one encoding
    :meth:`EventLog.encoded` and :meth:`EventLog.digest` keep per event)."""
    writer = Writer()
    writer.value([event, now])
    return bytes(writer.out)


def encoded_list(items: Sequence[bytes]) -> Encoded:
    """A list whose items are already written (:func:`event_entry`'s)."""
    return Encoded(b"L" + struct.pack("<Q", len(items)) + b"".join(items))


class Writer:
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
        elif isinstance(value, Encoded):
            out += value
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
            # An answer-only field is kept when it holds something: a Step retried after a
            # restart must get the copies and swaps its lost answer carried (empty ones are
            # left out, so a snapshot without them is the bytes it always was).
            kept = [
                f.name
                for f in fields(value)
                if TRANSIENT not in f.metadata or getattr(value, f.name)
            ]
            self.value({name: getattr(value, name) for name in kept})
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


class Reader:
    """Reads what :class:`Writer` wrote; any inconsistency is InvalidArgumentError naming
    where it is (``block_pool.free``, ``requests[3][7]``, ``extras.events[2][0].token_ids``)."""

    __slots__ = ("at", "data", "depth", "path")

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.at = 0
        self.depth = 0
        self.path: list[object] = []

    def fail(self, message: str) -> InvalidArgumentError:
        """The error for the value being read."""
        return bad(where_of(self.path), message)

    def _take(self, size: int) -> memoryview:
        end = self.at + size
        if size < 0 or end > len(self.data):
            raise self.fail("is truncated")
        chunk = self.data[self.at : end]
        self.at = end
        return chunk

    def _length(self) -> int:
        (size,) = struct.unpack("<Q", self._take(8))
        return int(size)

    def _count(self) -> int:
        # Each item takes at least one byte: a count beyond the bytes left is a lie.
        count = self._length()
        if count > len(self.data) - self.at:
            raise self.fail(f"claims {count} items, more than the bytes left")
        return count

    def _text(self) -> str:
        try:
            return bytes(self._take(self._length())).decode()
        except UnicodeDecodeError:
            raise self.fail("is not valid UTF-8") from None

    def value(self) -> Any:
        """The next value (see :class:`Writer` for the tags)."""
        tag = bytes(self._take(1))
        simple = _SIMPLE_TAGS.get(tag, _MISSING)
        if simple is not _MISSING:
            return simple
        if tag == b"I":
            return struct.unpack("<q", self._take(8))[0]
        if tag == b"D":
            return struct.unpack("<d", self._take(8))[0]
        if tag == b"B":
            return bytes(self._take(self._length()))
        if tag == b"S":
            return self._text()
        if tag == b"A":
            raw = self._take(self._length())
            if len(raw) % 8:
                raise self.fail(f"is a packed int64 array of {len(raw)} bytes")
            packed = array("q")
            packed.frombytes(raw)
            return packed.tolist()
        if tag == b"J":
            digits = bytes(self._take(self._length()))
            if not _BIG_INT.fullmatch(digits):
                raise self.fail("is not a decimal integer of at most 40 digits")
            return int(digits)
        if tag in b"LUMEC":
            self.depth += 1
            if self.depth > _MAX_DEPTH:
                raise self.fail(f"nests deeper than {_MAX_DEPTH} levels")
            value = self._nested(tag)
            self.depth -= 1
            return value
        raise self.fail(f"has an unknown tag {tag!r}")

    def _nested(self, tag: bytes) -> Any:
        path = self.path
        if tag in (b"L", b"U"):
            items = []
            count = self._count()
            path.append(0)
            for index in range(count):
                path[-1] = index
                items.append(self.value())
            path.pop()
            return items if tag == b"L" else tuple(items)
        if tag == b"M":
            return self._map()
        name = self._text()
        if tag == b"E":
            enum_type = _ENUMS.get(name)
            if enum_type is None:
                raise self.fail(f"names unknown enum {name!r}")
            raw = self.value()
            try:
                return enum_type(raw)
            except (ValueError, TypeError):
                raise self.fail(f"is {raw!r}, not a {name} value") from None
        dataclass_type = _DATACLASSES.get(name)
        if dataclass_type is None:
            raise self.fail(f"names unknown class {name!r}")
        values = self.value()
        names = {f.name for f in fields(dataclass_type)}
        if type(values) is not dict or not set(values) <= names:
            raise self.fail(f"is a malformed {name}")
        try:
            return dataclass_type(**values)
        except (TypeError, ValueError) as exc:  # a field missing, or out of its domain
            raise self.fail(f"is not a valid {name}: {exc}") from None

    def _map(self) -> dict[Any, Any]:
        result: dict[Any, Any] = {}
        path = self.path
        for index in range(self._count()):
            path.append(f"<key {index}>")
            key = self.value()
            if type(key) not in _KEY_TYPES:
                raise self.fail(f"is a {type(key).__name__}, not a map key")
            if key in result:
                raise self.fail(f"repeats the key {key!r}")
            path[-1] = key
            result[key] = self.value()
            path.pop()
        return result


def where_of(path: Sequence[object]) -> str:
    """A reader's path as text: ``extras.events[2][0]``."""
    parts = []
    for part in path:
        if type(part) is int:
            parts.append(f"[{part}]")
        elif type(part) is str and part.isidentifier():
            parts.append(f".{part}" if parts else part)
        else:
            parts.append(f"[{part!r}]")
    return "".join(parts) or "body"


def bad(where: str, message: str) -> InvalidArgumentError:
    """The error for a fault at ``where`` in the snapshot."""
    return InvalidArgumentError(f"the snapshot's {where} {message}", field="data")


# ----------------------------------------------------------------- typed access to values
def fields_of(value: object, where: str, names: Sequence[str], optional: Sequence[str] = ()) -> Any:
    """``value`` as a map with exactly ``names`` (and maybe ``optional``) as keys."""
    if type(value) is not dict:
        raise bad(where, f"must be a map, got {type(value).__name__}")
    missing = [n for n in names if n not in value]
    unknown = [k for k in value if k not in names and k not in optional]
    if missing or unknown:
        raise bad(where, f"must hold {list(names)}; missing {missing}, unknown {unknown}")
    return value


def as_int(value: object, where: str, low: int, high: int) -> int:
    """``value``, an int (not a bool) in ``[low, high)``."""
    if type(value) is not int or not low <= value < high:
        raise bad(where, f"must be an int in [{low}, {high}), got {short(value)}")
    return value


def as_ints(value: object, where: str, low: int, high: int, length: int | None = None) -> list[int]:
    """``value``, a list of ints in ``[low, high)`` (of ``length`` entries when given)."""
    if type(value) is not list or not set(map(type, value)) <= _INT_ONLY:
        raise bad(where, f"must be a list of ints, got {short(value)}")
    if length is not None and len(value) != length:
        raise bad(where, f"must hold {length} entries, got {len(value)}")
    if value and not (low <= min(value) and max(value) < high):
        at = next(i for i, v in enumerate(value) if not low <= v < high)
        raise bad(f"{where}[{at}]", f"must be in [{low}, {high}), got {value[at]}")
    return value


def as_list(value: object, where: str, length: int | None = None) -> list[Any]:
    """``value`` (a list or tuple) as a list (of ``length`` entries when given)."""
    if type(value) not in (list, tuple):
        raise bad(where, f"must be a list, got {type(value).__name__}")
    if length is not None and len(value) != length:  # type: ignore[arg-type]
        raise bad(where, f"must hold {length} entries, got {len(value)}")  # type: ignore[arg-type]
    return list(value)  # type: ignore[call-overload,no-any-return]


def as_type(value: object, where: str, *types: type) -> Any:
    """``value``, whose type is exactly one of ``types``."""
    if type(value) not in types:
        expected = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise bad(where, f"must be {expected}, got {type(value).__name__}")
    return value


def short(value: object) -> str:
    """``repr(value)``, cut for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
