"""The lookup port's framing: ``Lookup`` over a plain (or TLS) TCP stream, without gRPC.

Both sides of the port import this module (the server's ``kvcm.server.lookup_port``, the SDK's
``lookup_address`` connections), so they read each frame alike; docs/lookup.md describes the
protocol for routers written in other languages. Every frame is a 9-byte header, then its
payload::

    offset 0  4 bytes  magic and version, b"KVL1"
    offset 4  1 byte   kind (FrameKind)
    offset 5  4 bytes  payload length, unsigned little-endian
    offset 9  payload

    HELLO    client: the bearer token, UTF-8 (may be empty); server: empty (accepted)
    REQUEST  u64 LE request id, then kvcm.v1.LookupRequest bytes
    ANSWER   u64 LE request id, then kvcm.v1.LookupResponse bytes
    ERROR    u64 LE request id, u32 LE gRPC status code, then the message, UTF-8

An ERROR about the connection rather than one request (a bad header, a refused hello, too many
connections) carries :data:`NO_REQUEST_ID`, and the server closes the connection after it.
"""

from __future__ import annotations

import enum
import struct
from typing import Final

__all__ = [
    "HEADER",
    "HELLO_MAX_BYTES",
    "MAGIC",
    "NO_REQUEST_ID",
    "FrameKind",
    "FrameError",
    "decode_error",
    "decode_header",
    "encode_answer",
    "encode_error",
    "encode_frame",
    "encode_hello",
    "encode_request",
    "split_id",
]

MAGIC: Final = b"KVL1"
"""The first four bytes of every frame: the protocol and its version."""
HEADER: Final = struct.Struct("<4sBI")
"""magic, kind, payload length (9 bytes, little-endian)."""
_ID: Final = struct.Struct("<Q")
_ID_CODE: Final = struct.Struct("<QI")
NO_REQUEST_ID: Final = 2**64 - 1
"""The request id of an ERROR about the whole connection (clients should not use it)."""
HELLO_MAX_BYTES: Final = 64 * 1024
"""Longest HELLO payload the server reads (a token); longer is refused and the connection
closed (before authentication, a peer may not make the server buffer more)."""


@enum.unique
class FrameKind(enum.IntEnum):
    """What a frame carries (the header's fifth byte)."""

    HELLO = 1
    REQUEST = 2
    ANSWER = 3
    ERROR = 4


class FrameError(Exception):
    """A frame that breaks the protocol (bad magic, unknown kind, short payload)."""


def encode_frame(kind: FrameKind, payload: bytes) -> bytes:
    """One frame: the header, then ``payload``."""
    return HEADER.pack(MAGIC, kind, len(payload)) + payload


def encode_hello(token: str) -> bytes:
    """The client's HELLO frame with its bearer token (``""``: none)."""
    return encode_frame(FrameKind.HELLO, token.encode("utf-8"))


def encode_request(request_id: int, request: bytes) -> bytes:
    """A REQUEST frame: ``request_id`` and the serialized ``LookupRequest``."""
    return HEADER.pack(MAGIC, FrameKind.REQUEST, 8 + len(request)) + _ID.pack(request_id) + request


def encode_answer(request_id: int, response: bytes) -> bytes:
    """An ANSWER frame: ``request_id`` and the serialized ``LookupResponse``."""
    return HEADER.pack(MAGIC, FrameKind.ANSWER, 8 + len(response)) + _ID.pack(request_id) + response


def encode_error(request_id: int, code: int, message: str) -> bytes:
    """An ERROR frame: ``request_id``, a gRPC status code and its message."""
    text = message.encode("utf-8", "backslashreplace")
    return encode_frame(FrameKind.ERROR, _ID_CODE.pack(request_id, code) + text)


def decode_header(data: bytes | bytearray, offset: int = 0) -> tuple[FrameKind, int]:
    """``(kind, payload length)`` of the frame header at ``data[offset:]`` (at least
    :data:`HEADER` ``.size`` bytes).

    Raises:
        FrameError: The magic is not :data:`MAGIC` or the kind is unknown.
    """
    magic, kind, length = HEADER.unpack_from(data, offset)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    try:
        return FrameKind(kind), length
    except ValueError:
        raise FrameError(f"unknown frame kind {kind}") from None


def split_id(payload: bytes) -> tuple[int, bytes]:
    """``(request id, message bytes)`` of a REQUEST or ANSWER payload.

    Raises:
        FrameError: The payload is shorter than the 8-byte id.
    """
    if len(payload) < _ID.size:
        raise FrameError(f"payload of {len(payload)} bytes has no 8-byte request id")
    return _ID.unpack_from(payload)[0], payload[_ID.size :]


def decode_error(payload: bytes) -> tuple[int, int, str]:
    """``(request id, status code, message)`` of an ERROR payload.

    Raises:
        FrameError: The payload is shorter than its id and code.
    """
    if len(payload) < _ID_CODE.size:
        raise FrameError(f"error payload of {len(payload)} bytes has no id and code")
    request_id, code = _ID_CODE.unpack_from(payload)
    return request_id, code, payload[_ID_CODE.size :].decode("utf-8", "replace")
