"""The lookup port: ``Lookup`` on the server's own event loop, without gRPC (docs/lookup.md).

A router asks Lookup once per request it places, so the call's latency is added to every
time-to-first-token. The answer itself takes a fraction of a millisecond, but a gRPC call in
Python crosses several threads (gRPC's poller, its completion queue, the event loop's wakeup),
each paying a wakeup on an idle machine: about 2 ms a call on a 2-core VM whatever the method.
This port serves exactly one method, Lookup, as an :class:`asyncio.Protocol` on the server's
loop: one loop wakeup per query and no thread. Its frames (:mod:`kvcm.wire.lookup_port`) carry
the gRPC method's own messages, and each request is answered as the gRPC Lookup answers it:
:func:`lookup_as` with the connection's principal, the same errors as the same status codes
and messages, counted in the same ``RpcStats`` (method ``Lookup``), refusals audited alike.

A connection's first frame is a HELLO with the bearer token (checked by the tokens file when
authentication is on, and again for every request, so that a reload revokes it); its requests
are answered in order, one at a time (a client may pipeline them). A frame that breaks the
protocol, a frame over the size limit or a refused hello gets an ERROR frame (request id
``NO_REQUEST_ID``) after the answers already due, and the connection is closed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Final

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from kvcm.common.errors import KVCMError, ResourceExhaustedError
from kvcm.core.lookup import LookupAnswer, LookupQuery
from kvcm.server.access import RefusalLog
from kvcm.server.rpc._handlers import UndecodableRequest
from kvcm.server.rpc._log import log_call_rejected
from kvcm.server.rpc._lookup import LookupDeniedError, lookup_as, lookup_now
from kvcm.server.rpc._state import Principal, ServerState
from kvcm.server.rpc._status import status_details, status_of
from kvcm.server.telemetry import RpcStats
from kvcm.v1 import lookup_pb2
from kvcm.wire.lookup import lookup_query_from_proto, lookup_result_to_proto
from kvcm.wire.lookup_port import (
    HEADER,
    HELLO_MAX_BYTES,
    NO_REQUEST_ID,
    FrameError,
    FrameKind,
    decode_header,
    encode_answer,
    encode_error,
    encode_frame,
    split_id,
)

__all__ = ["DEFAULT_MAX_CONNECTIONS", "HELLO_TIMEOUT_S", "IDLE_TIMEOUT_S", "LookupPort"]

_LOG = logging.getLogger("kvcm.server.lookup_port")
_METHOD: Final = "Lookup"
FULL_METHOD: Final = "/kvcm.v1.LookupService/Lookup"
DEFAULT_MAX_CONNECTIONS: Final = 1024
"""Connections the port holds at once; one more is answered RESOURCE_EXHAUSTED and closed. At
most half of them may be waiting for their HELLO (so that peers without a token cannot take
every slot from the routers)."""
STOP_WAIT_S: Final = 1.0
"""Seconds :meth:`LookupPort.stop` waits, after aborting every connection, for the listener to
report them closed."""
HELLO_TIMEOUT_S: Final = 10.0
"""Seconds a new connection has to send its HELLO before it is closed."""
IDLE_TIMEOUT_S: Final = 300.0
"""Seconds a greeted connection may go without a whole frame from its client or an answer
leaving for it (a router that crashed half-open, a frame never completed, a client that stopped
reading) before it is closed with DEADLINE_EXCEEDED."""
_MAX_QUEUED: Final = 64
"""Requests waiting on one connection before the port stops reading it (a client pipelining
more waits in its socket)."""
QUEUE_BYTES: Final = 1 << 20
"""Bytes of waiting requests (and of what was read past them) at which the port stops reading a
connection until its answers catch up (half of it). A request larger than this (up to
``max_message_bytes``) is still read, alone: a connection holds at most
``max(QUEUE_BYTES, max_message_bytes + 17)`` bytes of requests plus one read (256 KiB)."""
_HELLO_ACCEPTED: Final = encode_frame(FrameKind.HELLO, b"")
_CODES: Final = {code.name: code.value[0] for code in grpc.StatusCode}
_DECODE: Final = lookup_pb2.LookupRequest.FromString
_REVOKED: Final = "Lookup: the connection's token is no longer in the tokens file"
_UNDECODABLE: Final = UndecodableRequest(lookup_pb2.LookupRequest.DESCRIPTOR.full_name)


class LookupPort:
    """The port's listener and its connections, on the server's event loop.

    Attributes:
        connections: The open connections.
        port: The bound port (after :meth:`start`).
    """

    def __init__(
        self,
        state: ServerState,
        *,
        max_message_bytes: int,
        authenticate: Callable[[str], Principal | None] | None = None,
        refusals: RefusalLog | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        """A port serving ``state``'s registry (nothing bound until :meth:`start`).

        Args:
            state: The server's state (its registry, its RPC statistics).
            max_message_bytes: The longest ``LookupRequest`` read and ``LookupResponse``
                sent (the server's gRPC message limit).
            authenticate: The principal of a bearer token, ``None`` for an unknown one
                (``None``: authentication is off).
            refusals: Where refused hellos and denied lookups are audited.
            ssl_context: TLS for every connection (``None``: plaintext).
            max_connections: Connections held at once.
        """
        self.state = state
        self.max_message_bytes = max_message_bytes
        self.authenticate = authenticate
        self.refusals = refusals if refusals is not None else RefusalLog()
        self.ssl_context = ssl_context
        self.max_connections = max_connections
        self.connections: set[_Connection] = set()
        self.unhelloed: dict[_Connection, None] = {}  # no HELLO accepted yet, oldest first
        self.closed: collections.Counter[str] = collections.Counter()  # by the error's code
        self.answered: collections.Counter[str] = collections.Counter()  # requests, by code
        # The port's own latencies (also in the server's RpcStats with gRPC's Lookup calls).
        self.latency = RpcStats(state.rpc_stats.buckets)
        self.port = 0
        self._server: asyncio.Server | None = None

    def samples(self) -> dict[str, list[tuple[list[str], float]]]:
        """The ``kvcm_lookup_port_*`` metrics' samples (docs/metrics.md)."""
        waiting = len(self.unhelloed)
        return {
            "kvcm_lookup_port_connections": [
                (["greeted"], float(len(self.connections) - waiting)),
                (["hello"], float(waiting)),
            ],
            "kvcm_lookup_port_closed_total": [
                ([code], float(count)) for code, count in sorted(self.closed.items())
            ],
            "kvcm_lookup_port_requests_total": [
                ([code], float(count)) for code, count in sorted(self.answered.items())
            ],
        }

    async def start(self, sock: socket.socket) -> int:
        """Listen on ``sock`` (bound, not yet listening); returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), sock=sock, ssl=self.ssl_context, backlog=1024
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Stop listening; every connection answers what it already read (up to ``grace_s``),
        gets an UNAVAILABLE error frame and is closed."""
        server, self._server = self._server, None
        if server is None:
            return
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + grace_s
        server.close()
        for connection in list(self.connections):
            connection.fail(grpc.StatusCode.UNAVAILABLE, "Lookup: the server is shutting down")
        workers = [c.worker for c in self.connections if c.worker is not None]
        if workers:
            await asyncio.wait(workers, timeout=grace_s)
        flushing = [loop.create_task(c.lost.wait()) for c in self.connections]
        if flushing:  # their last frames leave (a client that reads them) within the grace
            await asyncio.wait(flushing, timeout=max(give_up_at - loop.time(), 0.0))
            for task in flushing:
                task.cancel()
        for connection in list(self.connections):
            connection.abort()  # still answering, or still flushing to a client not reading
        # Since Python 3.12.1 wait_closed also waits for every connection to be lost: bounded,
        # so that a transport that does not report its loss cannot wedge the server's stop.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), STOP_WAIT_S)


class _Connection(asyncio.Protocol):
    """One client connection: its frames parsed as they come, its requests answered in order."""

    def __init__(self, port: LookupPort) -> None:
        self._port = port
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._principal: Principal | None = None
        self._token = ""  # the HELLO's, checked again for every request (a reload revokes)
        self._greeted = False
        self._queue: collections.deque[tuple[int, bytes]] = collections.deque()
        self._queued_bytes = 0  # the queued requests' messages
        self.worker: asyncio.Task[None] | None = None
        self._closing = False  # no frame is read any more; closed once the queue is answered
        self._fatal: bytes | None = None  # the error frame written before closing
        self._paused = False
        self._writable = asyncio.Event()
        self._writable.set()
        self._timer: asyncio.TimerHandle | None = None  # the HELLO's deadline, then idleness
        self._active_at = 0.0  # loop time of the last whole frame read or answer written
        self.peer = ""
        self.lost = asyncio.Event()  # set once the transport is gone

    # ----------------------------------------------------------------- transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self.peer = _peer(transport.get_extra_info("peername"))
        port = self._port
        if len(port.connections) >= port.max_connections:
            transport.write(
                encode_error(
                    NO_REQUEST_ID,
                    _CODES["RESOURCE_EXHAUSTED"],
                    f"Lookup: the lookup port holds {port.max_connections} connections already",
                )
            )
            transport.close()
            self._closing = True
            port.closed["RESOURCE_EXHAUSTED"] += 1
            return
        if len(port.unhelloed) >= max(port.max_connections // 2, 1):
            # Half the slots at most wait for a HELLO: the oldest such makes room (a router
            # sends its HELLO at once; peers without a token cannot hold every slot).
            oldest = next(iter(port.unhelloed))
            del port.unhelloed[oldest]
            oldest.fail(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Lookup: closed for a newer connection: half of the lookup port's "
                f"{port.max_connections} connections are waiting for their HELLO",
            )
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a peer that vanished (a crashed host) is found out by TCP
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        port.connections.add(self)
        port.unhelloed[self] = None
        self._timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self._no_hello)

    def connection_lost(self, exc: Exception | None) -> None:
        self._port.connections.discard(self)
        self._port.unhelloed.pop(self, None)
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        if self.worker is not None:  # the client is gone: its answers have nowhere to go
            self.worker.cancel()
        self._writable.set()
        self.lost.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._buffer += data
        if not self._paused:  # paused: parsed when the answers catch up (_serve)
            self._parse()

    def _over_budget(self, rest: int, share: int = 1) -> bool:
        """Whether the queue (and ``rest`` bytes read past it) is over ``1 / share`` of its
        budget: reading stops there; an empty queue never is (its next frame is read)."""
        return bool(self._queue) and (
            len(self._queue) >= _MAX_QUEUED // share
            or self._queued_bytes + rest >= QUEUE_BYTES // share
        )

    def _parse(self) -> None:
        """Queue the whole frames of the buffer, until the queue is over its budget (then
        stop reading the connection; :meth:`_serve` parses on once it catches up)."""
        buffer = self._buffer
        start = 0
        try:
            while (
                len(buffer) - start >= HEADER.size
                and not self._closing
                and not self._over_budget(len(buffer) - start)
            ):
                kind, length = decode_header(buffer, start)
                if not self._header_ok(kind, length):
                    break  # refused on its header alone: nothing of its payload is kept
                end = start + HEADER.size + length
                if len(buffer) < end:
                    break
                payload = bytes(buffer[start + HEADER.size : end])
                start = end
                self._frame(kind, payload)
        except FrameError as exc:
            self.fail(grpc.StatusCode.INVALID_ARGUMENT, f"Lookup: {exc}")
        del buffer[:start]  # fail() emptied it: nothing more is read
        if not self._closing and not self._paused and self._over_budget(len(buffer)):
            assert self._transport is not None
            self._transport.pause_reading()
            self._paused = True

    # ------------------------------------------------------------------------- frames
    def _header_ok(self, kind: FrameKind, length: int) -> bool:
        """Whether a frame with this header may be read; if not, the connection is failed
        before any of its payload is buffered (a peer without a HELLO may make the server
        hold at most a HELLO's 64 KiB)."""
        if not self._greeted:
            if kind is not FrameKind.HELLO:
                message = f"Lookup: the first frame must be a HELLO, got {kind.name}"
                self.fail(grpc.StatusCode.INVALID_ARGUMENT, message)
                return False
            if length > HELLO_MAX_BYTES:
                self.fail(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Lookup: a HELLO frame of {length} bytes is over the limit "
                    f"({HELLO_MAX_BYTES} bytes)",
                )
                return False
            return True
        if kind is not FrameKind.REQUEST:
            self.fail(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Lookup: a client sends REQUEST frames after its HELLO, got {kind.name}",
            )
            return False
        limit = self._port.max_message_bytes
        if length > limit + 8:
            self.fail(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Lookup: a REQUEST frame of {length} bytes is over the limit "
                f"({limit} bytes plus the id)",
            )
            return False
        return True

    def _frame(self, kind: FrameKind, payload: bytes) -> None:
        """A whole frame whose header :meth:`_header_ok` accepted."""
        if not self._greeted:
            self._hello(payload)
            return
        request_id, body = split_id(payload)
        if request_id == NO_REQUEST_ID:  # its error would read as one about the connection
            self.fail(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Lookup: request id 0xFFFFFFFFFFFFFFFF is reserved for errors about the connection",
            )
            return
        self._active_at = asyncio.get_running_loop().time()
        if self.worker is None and self._writable.is_set():
            # Nothing before it and the client reads: answered here, in this loop iteration,
            # unless the lookup must wait (then it is queued like the rest).
            answer = self._answer_now(request_id, body)
            if answer is not None:
                assert self._transport is not None
                self._transport.write(answer)
                return
        self._queue.append((request_id, body))
        self._queued_bytes += len(body)
        if self.worker is None:
            self.worker = asyncio.get_running_loop().create_task(self._serve())

    def _hello(self, payload: bytes) -> None:
        """Authenticate the connection (when auth is on) and accept it."""
        port = self._port
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if port.authenticate is not None:
            token = payload.decode("utf-8", "replace")
            principal = port.authenticate(token) if token else None
            if principal is None:
                self._refused(
                    "UNAUTHENTICATED", "no token" if not token else "a token not in the tokens file"
                )
                port.state.rpc_stats.observe(_METHOD, "UNAUTHENTICATED", 0.0)
                self.fail(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "Lookup: a valid bearer token is required in the HELLO frame",
                )
                return
            # Lookup's rule (access.RULES) takes any valid token; lookup_as answers about the
            # pools the principal may read only, and refuses a named pool it may not.
            self._principal = principal
            self._token = token
        self._greeted = True
        port.unhelloed.pop(self, None)
        assert self._transport is not None
        self._transport.write(_HELLO_ACCEPTED)
        loop = asyncio.get_running_loop()
        self._active_at = loop.time()
        self._timer = loop.call_later(IDLE_TIMEOUT_S, self._check_idle)

    def _no_hello(self) -> None:
        self._timer = None
        if not self._greeted:
            self.fail(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"Lookup: no HELLO frame within {HELLO_TIMEOUT_S:g} s",
            )

    def _check_idle(self) -> None:
        """Close the connection if nothing came from or left for its client for
        IDLE_TIMEOUT_S; else check again when that much time will have passed."""
        self._timer = None
        if self._closing:
            return
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._active_at
        if idle < IDLE_TIMEOUT_S:
            self._timer = loop.call_later(IDLE_TIMEOUT_S - idle, self._check_idle)
            return
        self.fail(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"Lookup: no whole frame from the client and no answer taken by it "
            f"within {IDLE_TIMEOUT_S:g} s",
        )
        if self.worker is not None:  # its answers do not leave: the client does not read
            self.abort()

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Read no more frames; once the requests already read are answered, send an error
        frame (``code``, ``message``) about the connection and close it."""
        if self._closing:
            return
        self._closing = True
        self._buffer.clear()
        self._port.closed[code.name] += 1
        self._fatal = encode_error(NO_REQUEST_ID, code.value[0], status_details(message))
        _LOG.debug(
            "lookup port connection refused: %s",
            message,
            extra={"event": "lookup_port_refused", "peer": self.peer, "code": code.name},
        )
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()
        if self.worker is None:
            self._finish()

    def abort(self) -> None:
        """Close now, unsent frames dropped (shutdown after its grace): a connection still
        answering, or closed and still flushing to a client that does not read."""
        if self.worker is not None:
            self.worker.cancel()
        if self._transport is not None:
            self._transport.abort()

    def _finish(self) -> None:
        """After the last answer of a closing connection: its error frame, then close."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._fatal is not None:
            transport.write(self._fatal)
        transport.close()

    # ------------------------------------------------------------------------ answers
    async def _serve(self) -> None:
        """Answer the queued requests in order, then finish a closing connection."""
        queue = self._queue
        try:
            while queue:
                # A client that does not read holds one answer and the transport's buffer
                # (64 KiB): the next answer is made once the last has left.
                if not self._writable.is_set():
                    await self._writable.wait()
                request_id, body = queue.popleft()
                self._queued_bytes -= len(body)
                frame = await self._answer(request_id, body)
                transport = self._transport
                if transport is None or transport.is_closing():
                    return
                transport.write(frame)
                self._active_at = asyncio.get_running_loop().time()
                if (
                    self._paused
                    and not self._closing
                    and not self._over_budget(len(self._buffer), 2)
                ):
                    self._paused = False
                    self._parse()  # what was read past the budget; may pause again
                    if not self._paused and not self._closing:
                        transport.resume_reading()
            if self._closing:
                self._finish()
        finally:
            self.worker = None

    def _refused(self, code: str, reason: str) -> None:
        """Audit a refusal of this connection's Lookup as the gRPC side audits one."""
        principal = self._principal
        self._port.refusals.refused(
            principal=principal.name if principal is not None else "",
            peer=self.peer,
            method=FULL_METHOD,
            pool="",
            code=code,
            reason=reason,
        )

    def _still_valid(self) -> bool:
        """Whether the HELLO's token still names a principal (the tokens file may have been
        reloaded since: a revoked token is refused on its open connections too, as the gRPC
        port refuses its next call); the principal follows a changed entry's roles."""
        assert self._port.authenticate is not None
        principal = self._port.authenticate(self._token)
        if principal is None:
            self._refused("UNAUTHENTICATED", "a token no longer in the tokens file")
            return False
        self._principal = principal
        return True

    def _answer_now(self, request_id: int, body: bytes) -> bytes | None:
        """The ANSWER or ERROR frame of a request answered without waiting, or ``None``:
        its lookup must wait (:func:`lookup_now`), or the connection's token was revoked
        (whose error frames :meth:`_answer` sends in their order); nothing is observed then."""
        port = self._port
        if port.authenticate is not None:
            principal = port.authenticate(self._token)
            if principal is None:
                return None
            self._principal = principal
        started = time.perf_counter()
        try:
            request, query = _decoded(body)
            answer = lookup_now(port.state.registry, query, self._principal)
            if answer is None:
                return None
            return self._answered(request_id, request, answer, started)
        except Exception as exc:
            return self._failed(request_id, exc, started)

    async def _answer(self, request_id: int, body: bytes) -> bytes:
        """The ANSWER or ERROR frame of one request, observed as a gRPC Lookup call is."""
        port = self._port
        state = port.state
        started = time.perf_counter()
        try:
            if port.authenticate is not None and not self._still_valid():
                # This request's error, then the connection's: the requests still queued get
                # none of their own (one refusal audited, not one per pipelined request).
                self._queue.clear()
                self._queued_bytes = 0
                self.fail(grpc.StatusCode.UNAUTHENTICATED, _REVOKED)
                self._observe("UNAUTHENTICATED", started)
                return encode_error(request_id, _CODES["UNAUTHENTICATED"], status_details(_REVOKED))
            request, query = _decoded(body)
            answer = await lookup_as(state.registry, query, self._principal, state=state)
            return self._answered(request_id, request, answer, started)
        except asyncio.CancelledError:
            self._observe("CANCELLED", started)
            raise
        except Exception as exc:
            return self._failed(request_id, exc, started)

    def _answered(
        self,
        request_id: int,
        request: lookup_pb2.LookupRequest,
        answer: LookupAnswer,
        started: float,
    ) -> bytes:
        """The ANSWER frame of ``answer`` (observed OK), or its ERROR frame when too large."""
        port = self._port
        data = lookup_result_to_proto(answer, packed=request.packed).SerializeToString()
        if len(data) > port.max_message_bytes:
            return self._failed(
                request_id,
                ResourceExhaustedError(
                    f"Lookup: the answer is {len(data)} bytes, over max_message_bytes "
                    f"({port.max_message_bytes}): narrow the scope or set max_results"
                ),
                started,
            )
        self._observe("OK", started)
        return encode_answer(request_id, data)

    def _failed(self, request_id: int, exc: Exception, started: float) -> bytes:
        """The ERROR frame of a request that raised ``exc`` (observed, logged, audited as the
        gRPC servicer does)."""
        if isinstance(exc, LookupDeniedError):
            code, details = "PERMISSION_DENIED", f"Lookup: {exc}"
            self._refused(code, details)
            log_call_rejected(_METHOD, code, exc)
        elif isinstance(exc, KVCMError):
            code, details = status_of(exc).name, str(exc)
            log_call_rejected(_METHOD, code, exc)
        else:
            _LOG.error("internal error", exc_info=exc)
            code, details = "INTERNAL", f"internal error: {exc!r}"
        self._observe(code, started)
        return encode_error(request_id, _CODES[code], status_details(details))

    def _observe(self, code: str, started: float) -> None:
        port = self._port
        seconds = time.perf_counter() - started
        port.state.rpc_stats.observe(_METHOD, code, seconds)
        port.latency.observe(_METHOD, code, seconds)
        port.answered[code] += 1


def _decoded(body: bytes) -> tuple[lookup_pb2.LookupRequest, LookupQuery]:
    """A request's message and its query.

    Raises:
        KVCMError: Undecodable (INVALID_ARGUMENT), or a field out of its domain.
    """
    try:
        request = _DECODE(body)
    except DecodeError:
        raise _UNDECODABLE.error() from None
    return request, lookup_query_from_proto(request)


def _peer(address: object) -> str:
    """A connection's peer as gRPC names it (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``)."""
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
    return str(address or "")
