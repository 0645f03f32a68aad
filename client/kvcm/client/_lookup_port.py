"""The SDK's side of the lookup port (``lookup_address``): ``lookup()`` without gRPC.

A scheduler client given ``lookup_address`` sends its ``lookup()`` calls over one persistent
connection to the server's lookup port (docs/lookup.md#the-lookup-port) instead of the Lookup
RPC: the same ``LookupRequest`` and ``LookupResponse``, framed by :mod:`kvcm.wire.lookup_port`.
The connection opens at the first lookup (TLS with the client's roots and certificate when
the client uses TLS; its token in the HELLO), carries one lookup at a time (a lock, waited for
within the lookup's deadline), and is opened again once when it turns out broken (the server
restarted, or closed it on shutdown or idleness); a lookup that outlives its deadline in the
middle of its frames drops the connection (one still waiting for the lock leaves it alone).
After ``close()`` nothing opens it again. Errors are the SDK's classes for the status code the
server answers, as the gRPC path raises them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import ssl
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Final

from kvcm.client._errors import (
    DeadlineExceededError,
    InternalError,
    ServiceError,
    StatusCode,
    UnavailableError,
    error_from_status,
)
from kvcm.common.errors import InvalidArgumentError
from kvcm.v1 import lookup_pb2
from kvcm.wire.lookup_port import (
    HEADER,
    NO_REQUEST_ID,
    FrameError,
    FrameKind,
    decode_error,
    decode_header,
    encode_hello,
    encode_request,
    split_id,
)

if TYPE_CHECKING:
    from kvcm.client._base import TlsConfig

__all__ = ["AsyncLookupPortConnection", "LookupPortConnection", "split_lookup_address"]

_METHOD: Final = "Lookup"
_ANSWER_LIMIT: Final = 256 * 1024 * 1024
"""Longest frame accepted from the server (the SDK's gRPC message limit)."""


def split_lookup_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``lookup_address``.

    Raises:
        InvalidArgumentError: It is not ``host:port``.
    """
    host, _, port = address.rpartition(":")
    if not isinstance(address, str) or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgumentError(
            f"lookup_address must be 'host:port', got {address!r}", field="lookup_address"
        )
    return host.strip("[]"), int(port)


def _ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """A client TLS context of the client's gRPC TLS settings: its roots (``None``: the
    system's), and its certificate for a server that requires mutual TLS."""
    if tls.root_certificates is not None:
        context = ssl.create_default_context(cadata=tls.root_certificates.decode("ascii"))
    else:
        context = ssl.create_default_context()
    if tls.certificate_chain is not None and tls.private_key is not None:
        # ssl loads a certificate and key from files only: written to a private directory
        # and removed at once.
        with tempfile.TemporaryDirectory() as directory:
            cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
            for path, data in ((cert, tls.certificate_chain), (key, tls.private_key)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as handle:
                    handle.write(data)
            context.load_cert_chain(cert, key)
    return context


def _unavailable(address: str, exc: BaseException) -> UnavailableError:
    return UnavailableError(
        f"lookup port {address}: {exc or type(exc).__name__}",
        code=StatusCode.UNAVAILABLE,
        method=_METHOD,
    )


def _closed(address: str) -> UnavailableError:
    return UnavailableError(
        f"lookup port {address}: the client is closed", code=StatusCode.UNAVAILABLE, method=_METHOD
    )


def _deadline(address: str, timeout: float) -> DeadlineExceededError:
    return DeadlineExceededError(
        f"lookup port {address}: no answer within {timeout:g} s",
        code=StatusCode.DEADLINE_EXCEEDED,
        method=_METHOD,
    )


class _BrokenError(Exception):
    """The connection ended or broke the protocol: drop it (and open it again, once)."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(str(error))
        self.error = error


def _answer(kind: FrameKind, payload: bytes, request_id: int) -> lookup_pb2.LookupResponse:
    """The response of the frame answering ``request_id``.

    Raises:
        ServiceError: The server answered an error about this request.
        _BrokenError: It answered an error about the connection, or out of protocol.
    """
    try:
        if kind is FrameKind.ANSWER:
            got, body = split_id(payload)
            if got == request_id:
                response: lookup_pb2.LookupResponse = lookup_pb2.LookupResponse.FromString(body)
                return response
        elif kind is FrameKind.ERROR:
            got, code, message = decode_error(payload)
            error = error_from_status(code, message, _METHOD)
            if got == NO_REQUEST_ID:
                raise _BrokenError(error)
            if got == request_id:
                raise error
    except (FrameError, ValueError) as exc:  # ValueError: a protobuf DecodeError
        raise _BrokenError(_internal(f"undecodable {kind.name} frame: {exc}")) from None
    raise _BrokenError(_internal(f"a {kind.name} frame out of order (request {request_id})"))


def _internal(message: str) -> InternalError:
    return InternalError(message, code=StatusCode.INTERNAL, method=_METHOD)


class LookupPortConnection:
    """One connection to a lookup port, shared by a client's threads (one lookup at a time)."""

    def __init__(self, address: str, *, token: str | None, tls: TlsConfig | None) -> None:
        """Prepare the connection (opened at the first lookup).

        Raises:
            InvalidArgumentError: ``address`` is not ``host:port``.
        """
        self.address = address
        self._host, self._port = split_lookup_address(address)
        self._hello = encode_hello(token or "")
        self._context = _ssl_context(tls) if tls is not None else None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self._closed = False

    def lookup(
        self, request: lookup_pb2.LookupRequest, timeout: float
    ) -> lookup_pb2.LookupResponse:
        """``request``'s answer within ``timeout`` seconds.

        Raises:
            ServiceError: The server's error for it (the class of its status code);
                ``UnavailableError`` when the port cannot be reached, ``DeadlineExceededError``
                when no answer came in time.
        """
        frame_body = request.SerializeToString()
        give_up_at = time.monotonic() + timeout
        # Another thread's lookup holds the connection: wait for it within the deadline only
        # (nothing sent, the shared connection left alone).
        if not self._lock.acquire(timeout=max(timeout, 0.0)):
            raise _deadline(self.address, timeout)
        try:
            return self._lookup_locked(frame_body, give_up_at, timeout)
        finally:
            self._lock.release()

    def _lookup_locked(
        self, frame_body: bytes, give_up_at: float, timeout: float
    ) -> lookup_pb2.LookupResponse:
        for attempt in (1, 2):
            if self._closed:
                raise _closed(self.address)
            if time.monotonic() >= give_up_at:
                raise _deadline(self.address, timeout)
            reused = self._sock is not None
            request_id = next(self._ids)
            try:
                sock = self._sock if self._sock is not None else self._connect(give_up_at)
                sock.settimeout(max(give_up_at - time.monotonic(), 1e-3))
                sock.sendall(encode_request(request_id, frame_body))
                kind, payload = self._frame(sock)
                return _answer(kind, payload, request_id)
            except ServiceError:  # the server's answer (some are OSError subclasses)
                raise
            except TimeoutError:
                self._drop()
                raise _deadline(self.address, timeout) from None
            except _BrokenError as broken:
                self._drop()
                if not reused or attempt == 2:
                    raise broken.error from None
            except (OSError, EOFError) as exc:
                self._drop()
                if not reused or attempt == 2:
                    raise _unavailable(self.address, exc) from exc
            except BaseException:  # interrupted mid-frame: the stream is out of step
                self._drop()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _connect(self, give_up_at: float) -> socket.socket:
        """Open, secure and greet a connection (the server's HELLO read back)."""
        left = max(give_up_at - time.monotonic(), 1e-3)
        sock = socket.create_connection((self._host, self._port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is not None:
                sock = self._context.wrap_socket(sock, server_hostname=self._host)
            sock.sendall(self._hello)
            kind, payload = self._frame(sock)
        except BaseException:
            sock.close()
            self._buffer.clear()
            raise
        if kind is not FrameKind.HELLO:
            sock.close()
            self._buffer.clear()
            _answer(kind, payload, NO_REQUEST_ID - 1)  # raises the server's refusal
        self._sock = sock
        return sock

    def _frame(self, sock: socket.socket) -> tuple[FrameKind, bytes]:
        kind, length = _checked_header(self._read(sock, HEADER.size))
        return kind, self._read(sock, length)

    def _read(self, sock: socket.socket, size: int) -> bytes:
        buffer = self._buffer
        while len(buffer) < size:
            chunk = sock.recv(max(size - len(buffer), 1 << 16))
            if not chunk:
                raise EOFError("the server closed the connection")
            buffer += chunk
        data = bytes(buffer[:size])
        del buffer[:size]
        return data

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None
        self._buffer.clear()

    def close(self) -> None:
        """Close the connection for good (a later lookup raises ``UnavailableError``)."""
        self._closed = True
        with self._lock:
            self._drop()


class AsyncLookupPortConnection:
    """One connection to a lookup port for an asyncio client (one lookup at a time); create
    it inside the loop that uses it."""

    def __init__(self, address: str, *, token: str | None, tls: TlsConfig | None) -> None:
        """Prepare the connection (opened at the first lookup).

        Raises:
            InvalidArgumentError: ``address`` is not ``host:port``.
        """
        self.address = address
        self._host, self._port = split_lookup_address(address)
        self._hello = encode_hello(token or "")
        self._context = _ssl_context(tls) if tls is not None else None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._closed = False

    async def lookup(
        self, request: lookup_pb2.LookupRequest, timeout: float
    ) -> lookup_pb2.LookupResponse:
        """``request``'s answer within ``timeout`` seconds (see :class:`LookupPortConnection`).

        Raises:
            ServiceError: As :meth:`LookupPortConnection.lookup`.
        """
        frame_body = request.SerializeToString()
        try:
            async with asyncio.timeout(timeout):
                async with self._lock:
                    return await self._lookup(frame_body)
        except ServiceError:
            raise
        except TimeoutError:  # mid-frame, _lookup dropped the connection; waiting, none of ours
            raise _deadline(self.address, timeout) from None

    async def _lookup(self, frame_body: bytes) -> lookup_pb2.LookupResponse:
        for attempt in (1, 2):
            if self._closed:
                raise _closed(self.address)
            reused = self._streams is not None
            request_id = next(self._ids)
            try:
                reader, writer = self._streams or await self._connect()
                writer.write(encode_request(request_id, frame_body))
                kind, payload = await _read_frame(reader)
                return _answer(kind, payload, request_id)
            except ServiceError:  # the server's answer (some are OSError subclasses)
                raise
            except _BrokenError as broken:
                await self._drop()
                if not reused or attempt == 2:
                    raise broken.error from None
            except (OSError, EOFError, asyncio.IncompleteReadError) as exc:
                await self._drop()
                if not reused or attempt == 2:
                    raise _unavailable(self.address, exc) from exc
            except BaseException:  # cancelled mid-frame: the stream is out of step
                self._forget()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(
            self._host,
            self._port,
            ssl=self._context,
            server_hostname=self._host if self._context is not None else None,
        )
        try:
            writer.write(self._hello)
            kind, payload = await _read_frame(reader)
            if kind is not FrameKind.HELLO:
                _answer(kind, payload, NO_REQUEST_ID - 1)  # raises the server's refusal
        except BaseException:
            writer.close()
            raise
        if self._closed:  # close() came while this one opened: it must not outlive it
            writer.close()
            raise _closed(self.address)
        self._streams = reader, writer
        return reader, writer

    def _forget(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

    async def _drop(self) -> None:
        if self._streams is not None:
            writer = self._streams[1]
            self._streams = None
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def close(self) -> None:
        """Close the connection for good (a lookup in flight, or a later one, raises
        ``UnavailableError``; nothing opens it again)."""
        self._closed = True
        await self._drop()


def _checked_header(header: bytes) -> tuple[FrameKind, int]:
    """A server frame's kind and payload length; a bad or oversized header breaks the
    connection."""
    try:
        kind, length = decode_header(header)
    except FrameError as exc:
        raise _BrokenError(_internal(str(exc))) from None
    if length > _ANSWER_LIMIT:
        raise _BrokenError(_internal(f"a frame of {length} bytes"))
    return kind, length


async def _read_frame(reader: asyncio.StreamReader) -> tuple[FrameKind, bytes]:
    kind, length = _checked_header(await reader.readexactly(HEADER.size))
    return kind, await reader.readexactly(length)
