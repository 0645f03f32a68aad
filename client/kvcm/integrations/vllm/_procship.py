"""Shipping the mirror's Step programs from a child process (``shipper: process``).

With the shipping thread (:class:`~kvcm.integrations.vllm._shipper.GrpcStepShipper` in the
engine's process) building, encoding and sending each program runs in the engine's process,
under its interpreter lock: with a model that takes no time, inside the engine's turns.
:class:`ProcessStepShipper` moves all of it into a child process (started with
``subprocess``, never forked from the engine): per step the engine thread turns the step's
notes into compact tuples (new tokens and hashes only, views replaced by request ids),
``marshal``\\ s them and writes them to a pipe, without waiting (one copy per step); the child
rebuilds the notes against request views of its own and hands them to the same
:class:`~kvcm.integrations.vllm._recorder.StepRecorder` and
:class:`~kvcm.integrations.vllm._shipper.GrpcStepShipper` the thread uses (coalescing,
``step_seq``, verification, resync, lease keep-alives: one implementation). The child reports
its counters and lag back on a second pipe (a few hundred bytes, at most every
:data:`REPORT_INTERVAL_S` while anything changes), which the engine reads without blocking at
its step boundaries, so :meth:`ProcessStepShipper.lag`, ``stats`` and the engine metrics
(:mod:`kvcm.integrations.vllm._metrics`) read as the thread's do.

The engine keeps what the programs told the pool about each request (its key, tokens and
hashes sent: the recorder's ``tracked()``), so a snapshot of the mirror is taken in the
engine, as with the thread. A snapshot always goes with that request state (a **reseed**): the
child starts a fresh recorder from it and uploads the snapshot with ``ResyncPool`` before the
steps after it.

Failures: the child asks for a snapshot whenever the thread would (pool gone, divergence,
server at another step, backlog overflow). When the child dies (killed, crashed), stops
reading (its pipe stays full for :data:`MAX_PENDING_BYTES`), or cannot be started, the engine
notices at a step boundary (end of file on the report pipe, a broken pipe, its exit status),
logs it, and from then on only keeps its request state (the steps are not queued: the snapshot
covers them); at the next step boundary, after a backoff, it starts a new child and reseeds
it with a snapshot of the mirror. Steps the server acknowledged stay acknowledged; the ones the
dead child held are replaced by the snapshot. The engine never waits for the child except in
``flush()`` and ``close()``.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import marshal
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from array import array
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Final, cast

from kvcm.core.program import OpKind
from kvcm.integrations.vllm import _metrics
from kvcm.integrations.vllm._recorder import SYNCED_KINDS, answer_groups
from kvcm.integrations.vllm._shipper import ShipperStats, ShippingLag

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvcm.core.pool_types import PoolConfig
    from kvcm.integrations.vllm._recorder import RecordedStep

__all__ = ["MAX_PENDING_BYTES", "READ_INTERVAL_S", "REPORT_INTERVAL_S", "ProcessStepShipper"]

_LOG = logging.getLogger("kvcm.integrations.vllm")

REPORT_INTERVAL_S: Final = 0.005
"""How often the child reports its counters and lag while they change."""
READ_INTERVAL_S: Final = 0.002
"""How long the child sleeps when the engine's pipe is empty (it never waits on the pipe:
see :class:`_Reader`)."""
MAX_PENDING_BYTES: Final = 64 << 20
"""Bytes the engine keeps for a child that does not read its pipe; beyond, the child is
killed and replaced (the pool is resynchronised from the mirror)."""
# The engine's thread reads the child's reports at most this often (each read costs it a
# system call or two: ~25-75 us on the loaded 2-core VM); flush() and lag() read them too.
_POLL_S = 0.02
# Bytes read from the report pipe at once.
_REPORT_READ_BYTES = 1 << 16
# Backoff between starts of a child that keeps dying.
_RESTART_MIN_S = 0.05
_RESTART_MAX_S = 5.0
# The pipe size asked for (Linux caps it at /proc/sys/fs/pipe-max-size, 1 MiB by default).
_PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031

# Messages, engine to child: a 5-byte header (payload length, type), then the payload.
_HEADER: Final = struct.Struct("<IB")
_CONFIG: Final = 1  # pickle: the child's settings
_STEP: Final = 2  # marshal: (step_seq, closed_at, wire notes)
_RESEED: Final = 3  # pickle: (step_seq, snapshot, next_key, requests)
_FLUSH: Final = 4  # no payload: ship what is queued without waiting for the window
_CLOSE: Final = 5  # marshal: timeout_s
# marshal's format 2: no reference table (versions 3+ look every object up in one), the
# fastest to write for a step's small tuples and flat int lists.
_MARSHAL_VERSION: Final = 2
# Child to engine: the same header, type _REPORT, marshal payload.
_REPORT: Final = 6

# Note kinds (the recorder's OpKind members; the wire carries their ints).
_ALLOCATE: Final = OpKind.ALLOCATE
_SYNCED: Final = SYNCED_KINDS  # the recorder's: the notes this encoder carries alike
_FORGETS: Final = frozenset({OpKind.FINISH, OpKind.FINISH_DEFERRED})
_PREEMPT: Final = OpKind.PREEMPT
_KINDS: Final = {int(kind): kind for kind in OpKind}
_ALLOCATE_INT: Final = int(OpKind.ALLOCATE)
_NO_TOKENS: Final[list[int]] = []
_STATS_FIELDS: Final = tuple(field.name for field in fields(ShipperStats))
_HIGH_WATER: Final = frozenset({"backlog_high_water", "max_steps_per_rpc"})


def _meta(key: int, view: Any) -> tuple[Any, ...]:
    # What the child's view of a request keeps from its first note: the key, fixed fields.
    return (
        key,
        view.num_first_prompt_tokens,
        view.lora_id,
        view.lora_name,
        view.cache_salt,
        view.skip_reading_prefix_cache,
        view.report_cached_blocks,
    )


class _Wire:
    """What the engine has told the child about its requests, and the encoding of notes.

    Mirrors the recorder's key numbering: a request gets the next key on its first note
    that carries its view, and loses it on FINISH; so the child's recorder, building the
    same notes in the same order, keys every request as this does.
    """

    __slots__ = ("next_key", "requests", "send_hashes")

    def __init__(self, send_hashes: bool) -> None:
        self.send_hashes = send_hashes
        self.next_key = 1
        # request id -> [key, tokens sent, hashes sent, the engine's view]
        self.requests: dict[str, list[Any]] = {}

    def encode(self, notes: list[tuple[Any, ...]], no_blocks: object) -> tuple[Any, ...]:
        """One step's notes as ``(items, numbers, tokens)`` for ``marshal``.

        A decode step's allocation (a known request, no hit, no options, no new block, no
        new block hash) is its key alone in ``items``, with four ints in ``numbers`` (new
        tokens, num_new_tokens, num_computed_tokens, in-flight tokens) and its new token ids
        in ``tokens``: flat lists, which the engine builds and marshals fastest. Every other
        note is a tuple in ``items`` (its kind first; a request's first note carries its key
        and fixed fields).
        """
        items: list[Any] = []
        numbers: list[int] = []
        tokens: list[int] = []
        add = items.append
        more_numbers = numbers.extend
        more_tokens = tokens.extend
        requests = self.requests
        send_hashes = self.send_hashes
        for note in notes:
            kind = note[0]
            if kind is _ALLOCATE:
                (
                    _,
                    view,
                    all_tokens,
                    num_tokens,
                    _,
                    num_hashes,
                    num_new,
                    num_computed,
                    in_flight,
                    hit,
                    slot_options,
                    result,
                ) = note
                entry = requests.get(view.request_id)
                if (
                    entry is not None
                    and result is no_blocks
                    and hit is None
                    and slot_options is None
                    and (num_hashes == entry[2] or not send_hashes)
                ):
                    sent = entry[1]
                    add(entry[0])
                    more_numbers((num_tokens - sent, num_new, num_computed, in_flight))
                    if num_tokens != sent:
                        more_tokens(all_tokens[sent:num_tokens])
                        entry[1] = num_tokens
                    continue
                new_tokens, new_hashes, meta = self._delta(note, entry)
                if result is no_blocks:
                    answer: Any = 0
                elif result is None:
                    answer = None
                elif isinstance(result, array):  # the recorder's ids (_recorder.answer_groups)
                    answer = answer_groups(result)
                else:
                    answer = tuple(tuple(ids) for ids in result)
                add(
                    (
                        _ALLOCATE_INT,
                        view.request_id,
                        new_tokens,
                        new_hashes,
                        num_tokens,
                        note[5] if send_hashes else 0,
                        num_new,
                        num_computed,
                        in_flight,
                        None if hit is None else pickle.dumps(hit),
                        None if slot_options is None else pickle.dumps(slot_options),
                        answer,
                        meta,
                    )
                )
            elif kind in _SYNCED:
                view = note[1]
                new_tokens, new_hashes, meta = self._delta(note, requests.get(view.request_id))
                add(
                    (
                        int(kind),
                        view.request_id,
                        new_tokens,
                        new_hashes,
                        note[3],
                        note[5] if send_hashes else 0,
                        note[6],
                        meta,
                    )
                )
            elif kind in _FORGETS:
                requests.pop(note[1], None)
                add((int(kind), note[1]))
            elif kind is _PREEMPT:
                add((int(kind), note[1]))
            elif kind is OpKind.HOST_SYNC:
                add((int(kind), int(note[1]), tuple(bytes(k) for k in note[2])))
            elif kind is OpKind.TAKE_BLOCK_COPIES or kind is OpKind.TAKE_BLOCK_COPIES_RETAINED:
                add((int(kind), tuple(tuple(pair) for pair in note[1])))
            elif kind is OpKind.EVICT_BLOCKS:
                add((int(kind), list(note[1])))
            elif kind is OpKind.RESET_PREFIX_CACHE:
                add((int(kind), bool(note[1])))
            else:  # NEW_STEP_STARTS, RELEASE_BLOCK_COPIES: the kind alone
                add((int(kind),))
        return items, numbers, tokens

    def _delta(
        self, note: tuple[Any, ...], entry: list[Any] | None
    ) -> tuple[list[Any], list[Any], tuple[Any, ...] | None]:
        # A note's new tokens and hashes since the last note of its request (all of them,
        # with the request's key and fixed fields, on its first note).
        view = note[1]
        num_tokens = note[3]
        num_hashes = note[5] if self.send_hashes else 0
        if entry is None:
            key = self.next_key
            self.next_key += 1
            self.requests[view.request_id] = [key, num_tokens, num_hashes, view]
            return list(note[2][:num_tokens]), list(note[4][:num_hashes]), _meta(key, view)
        sent, sent_hashes = entry[1], entry[2]
        entry[1] = num_tokens
        entry[2] = num_hashes
        entry[3] = view
        return (
            list(note[2][sent:num_tokens]),
            list(note[4][sent_hashes:num_hashes]),
            None,
        )

    def tracked(self) -> dict[str, tuple[int, int, int]]:
        return {rid: (entry[0], entry[1], entry[2]) for rid, entry in self.requests.items()}

    def seed(self) -> list[tuple[Any, ...]]:
        # Every tracked request as the child must know it: its key, what was sent, its view.
        seeded = []
        for request_id, (key, num_tokens, num_hashes, view) in self.requests.items():
            seeded.append(
                (
                    request_id,
                    _meta(key, view),
                    list(view.all_token_ids[:num_tokens]),
                    list(view.block_hashes[:num_hashes]),
                )
            )
        return seeded


class ProcessStepShipper:
    """The mirror's sink that ships from a child process (see the module docstring).

    Attributes:
        pool_id: The pool on the server.
        stats: The child's counters (every child's, summed over restarts) as a
            :class:`~kvcm.integrations.vllm._shipper.ShipperStats`; ``steps_submitted`` and,
            for steps a dead child held, ``steps_dropped`` are counted here.
        child_restarts: Children started after the first (each after a death or a hang).
        builds_elsewhere: Always ``True``: the recorder hands each step's notes over and
            asks this sink for ``tracked()``.
        acknowledges_each_answer: Always ``False`` (mirror mode only).
    """

    builds_elsewhere = True
    acknowledges_each_answer = False

    def __init__(
        self,
        *,
        address: str,
        pool_id: str,
        pool_config: Callable[[], PoolConfig],
        recorder_options: dict[str, Any],
        no_blocks: object,
        step_timeout_s: float = 10.0,
        max_backlog: int = 4096,
        lease_s: float = 0.0,
        tls_files: tuple[str | None, str | None, str | None] | None = None,
        token: str | None = None,
        coalesce_window_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Start the child (it connects once the first step comes).

        Args:
            address: The kvcm server (``host:port``).
            pool_id: The pool the engine owns there (created when missing).
            pool_config: How to create it (asked for at the first step, in the engine).
            recorder_options: The engine's recorder's ``options()`` (the child's recorder
                is made with them).
            no_blocks: The mirror's shared empty allocation answer.
            step_timeout_s: Deadline of one call to the server (the child's).
            max_backlog: Steps the child keeps while the server lags.
            lease_s: The pool's scheduler lease (0: none).
            tls_files: ``(ca, cert, key)`` PEM paths (``None``: plaintext).
            token: Bearer token (handed to the child over its pipe, never its command line).
            coalesce_window_s: The least time between two Step calls (``None``: the
                thread's default).
            clock: Monotonic clock, shared with the child (``time.monotonic``).
        """
        self.pool_id = pool_id
        self._submitted = 0
        self.child_restarts = 0
        self._no_blocks = no_blocks
        self._config_source = pool_config
        self._settings: dict[str, Any] = {
            "address": address,
            "pool_id": pool_id,
            "recorder_options": recorder_options,
            "step_timeout_s": step_timeout_s,
            "max_backlog": max_backlog,
            "lease_s": lease_s,
            "tls_files": tls_files,
            "token": token,
            "coalesce_window_s": coalesce_window_s,
            "log_level": logging.getLogger("kvcm").getEffectiveLevel(),
        }
        self._clock = clock
        self._wire = _Wire(bool(recorder_options["send_hashes"]))
        self._lock = threading.Lock()  # the child, its pipes and the reports
        self._proc: subprocess.Popen[bytes] | None = None
        self._out = -1  # the write end of the child's stdin
        self._in = -1  # the read end of its reports
        self._pending: collections.deque[bytes] = collections.deque()
        self._pending_bytes = 0
        self._report_buf = b""
        self._configured = False
        # The engine's last closed step, and (step_seq, closed_at) of steps not acknowledged.
        self._last_seq = 0
        # (Bounded: a child that acknowledges nothing for this long has asked for a snapshot.)
        self._unacked: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=4 * max_backlog
        )
        self._report: dict[str, Any] | None = None
        self._base = ShipperStats()  # dead children's counts
        self._dropped_here = 0
        self._answered = 0  # the child's snapshot requests answered
        self._wants = False  # the child asks for a snapshot
        self._need_reseed = False  # a new child (or one that lost steps) needs one
        self._restart_at = 0.0
        self._restart_backoff = _RESTART_MIN_S
        self._last_poll = -_POLL_S
        self._closed = False
        self._last_error = ""
        with self._lock:
            self._start()
        _metrics.track(cast("Any", self))

    # ------------------------------------------------------------------ the child
    def _start(self) -> None:
        # A fresh child, with its settings once the pool config is known (lock held).
        # The roots of kvcm's namespace package (one per distribution: core, client, ...).
        paths = [os.path.dirname(path) for path in sys.modules["kvcm"].__path__]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvcm.integrations.vllm._procship"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            self._child_lost(f"the shipper process could not start: {exc}")
            return
        assert proc.stdin is not None
        assert proc.stdout is not None
        self._proc = proc
        self._out = proc.stdin.fileno()
        self._in = proc.stdout.fileno()
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._out, _F_SETPIPE_SZ, _PIPE_BYTES)
        os.set_blocking(self._out, False)
        os.set_blocking(self._in, False)
        self._pending.clear()
        self._pending_bytes = 0
        self._report_buf = b""
        self._configured = False
        self._report = None
        self._answered = 0
        self._wants = False

    def _configure(self) -> None:
        # The settings message, once: the pool config is read when the first step comes.
        settings = dict(self._settings)
        settings["pool_config"] = self._config_source()
        self._configured = True
        self._send(_CONFIG, pickle.dumps(settings))

    def _send(self, kind: int, payload: bytes) -> None:
        # Queue one message and write what the pipe takes now (lock held).
        if self._proc is None:
            return
        frame = _HEADER.pack(len(payload), kind) + payload
        pending = self._pending
        if pending:
            pending.append(frame)
            self._pending_bytes += len(frame)
            self._drain()
            return
        try:
            written = os.write(self._out, frame)
        except BlockingIOError:
            written = 0
        except OSError as exc:  # BrokenPipeError: the child is gone
            self._child_lost(f"the shipper process's pipe broke: {exc}")
            return
        if written < len(frame):
            rest = frame[written:]
            pending.append(rest)
            self._pending_bytes += len(rest)
            if self._pending_bytes > MAX_PENDING_BYTES:
                self._hung()

    def _drain(self) -> None:
        pending = self._pending
        while pending:
            head = pending[0]
            try:
                written = os.write(self._out, head)
            except BlockingIOError:
                break
            except OSError as exc:
                self._child_lost(f"the shipper process's pipe broke: {exc}")
                return
            self._pending_bytes -= written
            if written < len(head):
                pending[0] = head[written:]
                break
            pending.popleft()
        if self._pending_bytes > MAX_PENDING_BYTES:
            self._hung()

    def _hung(self) -> None:
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
        self._child_lost(f"the shipper process did not read {self._pending_bytes} bytes; killed")

    def _child_lost(self, why: str) -> None:
        # The child is gone (or killed): keep its counts, forget its pipes, ask for a new one
        # and a snapshot at a step boundary after the backoff (lock held).
        proc = self._proc
        code: int | None = None
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=1.0)
            self._fold_report()
        self._proc = None
        self._out = self._in = -1
        self._pending.clear()
        self._pending_bytes = 0
        if self._closed:
            return
        self._need_reseed = True
        self._wants = False
        self._last_error = why if code is None else f"{why} (exit status {code})"
        self._restart_at = self._clock() + self._restart_backoff
        _LOG.warning(
            "kvcm: pool %r: %s; a new one resynchronises the pool from the mirror in %.2f s",
            self.pool_id,
            self._last_error,
            self._restart_backoff,
        )
        self._restart_backoff = min(self._restart_backoff * 2, _RESTART_MAX_S)

    def _fold_report(self) -> None:
        # A dead child's last counts join the base (its steps in flight are dropped here).
        report = self._report
        if report is None:
            return
        for name, value in zip(_STATS_FIELDS, report["stats"], strict=True):
            if name in _HIGH_WATER:
                setattr(self._base, name, max(getattr(self._base, name), value))
            elif name != "steps_submitted":
                setattr(self._base, name, getattr(self._base, name) + value)
        self._report = None

    def _poll(self) -> None:
        # Read every report the child wrote (lock held); notice its death.
        self._last_poll = self._clock()
        if self._proc is None:
            return
        if self._pending:
            self._drain()
            if self._in < 0:  # the drain found the child gone
                return
        chunks: list[bytes] = []
        while True:  # one read, mostly: the reports of a poll interval are a few hundred bytes
            try:
                chunk = os.read(self._in, _REPORT_READ_BYTES)
            except BlockingIOError:
                break
            except OSError as exc:
                self._child_lost(f"the shipper process's report pipe failed: {exc}")
                return
            if not chunk:
                self._take_reports(b"".join(chunks))
                self._child_lost("the shipper process exited")
                return
            chunks.append(chunk)
            if len(chunk) < _REPORT_READ_BYTES:
                break
        if chunks:
            self._take_reports(b"".join(chunks))

    def _take_reports(self, data: bytes) -> None:
        buf = self._report_buf + data
        offset = 0
        last = None
        size = _HEADER.size
        while len(buf) - offset >= size:
            length, _ = _HEADER.unpack_from(buf, offset)
            if len(buf) - offset - size < length:
                break
            last = buf[offset + size : offset + size + length]
            offset += size + length
        self._report_buf = buf[offset:]
        if last is None:
            return
        report: dict[str, Any] = marshal.loads(last)
        self._report = report
        self._wants = report["wants"] > self._answered
        acked = report["last_acked"]
        unacked = self._unacked
        while unacked and unacked[0][0] <= acked:
            unacked.popleft()
        if report["stats"][_STATS_FIELDS.index("steps_shipped")]:
            self._restart_backoff = _RESTART_MIN_S

    @property
    def stats(self) -> ShipperStats:
        """The counters now (see the class docstring): a new object at each read, summed
        from the reports when read (the engine's thread never does it)."""
        with self._lock:
            base, report, dropped = self._base, self._report, self._dropped_here
            stats = ShipperStats(steps_submitted=self._submitted)
        values = report["stats"] if report is not None else (0,) * len(_STATS_FIELDS)
        for name, value in zip(_STATS_FIELDS, values, strict=True):
            if name in _HIGH_WATER:
                setattr(stats, name, max(getattr(base, name), value))
            elif name == "steps_dropped":
                stats.steps_dropped = base.steps_dropped + value + dropped
            elif name != "steps_submitted":
                setattr(stats, name, getattr(base, name) + value)
        return stats

    # ------------------------------------------------------------------ the sink
    def submit(self, step: RecordedStep) -> None:
        """Hand one closed step to the child (never blocks: a full pipe queues it here)."""
        notes = step._notes
        step._notes = []
        wire = self._wire.encode(notes, self._no_blocks)
        seq = step.step_seq
        assert seq is not None
        self._last_seq = seq
        self._submitted += 1
        with self._lock:
            if self._proc is None or self._need_reseed:
                # No child to take it (or one waiting for its snapshot): the snapshot covers it.
                self._dropped_here += 1
                self._unacked.append((seq, step.closed_at))
                return
            if not self._configured:
                self._configure()
            self._unacked.append((seq, step.closed_at))
            self._send(_STEP, marshal.dumps((seq, step.closed_at, *wire), _MARSHAL_VERSION))
            if self._clock() - self._last_poll >= _POLL_S:
                self._poll()

    @property
    def wants_snapshot(self) -> bool:
        """Whether a snapshot of the mirror is needed now: the child asked for one, or a
        new child is due (after a death or a hang, once the restart backoff passed)."""
        return self._wants or (self._need_reseed and self._clock() >= self._restart_at)

    def submit_snapshot(self, step_seq: int, data: bytes) -> None:
        """Reseed the child (a new one if it died) with the mirror's snapshot after step
        ``step_seq`` and the request state that goes with it."""
        with self._lock:
            if self._closed:
                return
            if self._proc is None:
                self.child_restarts += 1
                self._start()
                if self._proc is None:
                    return
            if not self._configured:
                self._configure()
            self._answered = self._report["wants"] if self._report is not None else 0
            self._wants = False
            self._need_reseed = False
            seed = (step_seq, data, self._wire.next_key, self._wire.seed())
            self._send(_RESEED, pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL))

    def tracked(self) -> dict[str, tuple[int, int, int]]:
        """What the programs told the pool about each live request: id -> (key, tokens
        sent, block hashes sent) (the recorder's ``tracked()``)."""
        return self._wire.tracked()

    def lag(self) -> ShippingLag:
        """How far the server's copy is behind the mirror now (any thread)."""
        with self._lock:
            if self._clock() - self._last_poll >= _POLL_S:
                self._poll()
            report = self._report
            oldest = self._unacked[0][1] if self._unacked else 0.0
            acked = report["last_acked"] if report is not None else 0
            backlog = len(self._unacked)
            alive = self._proc is not None
        if report is not None:
            lag_p50, lag_p99, reachable = report["lag_p50"], report["lag_p99"], report["reachable"]
        else:
            lag_p50 = lag_p99 = 0.0
            reachable = True
        return ShippingLag(
            backlog_steps=backlog,
            oldest_unshipped_age_s=max(0.0, self._clock() - oldest) if oldest else 0.0,
            last_closed_step_seq=self._last_seq,
            last_acked_step_seq=acked,
            lag_p50_s=lag_p50,
            lag_p99_s=lag_p99,
            reachable=bool(reachable) and alive,
        )

    def _settled(self) -> bool:
        report = self._report
        if not self._configured and not self._need_reseed and not self._last_seq:
            return True  # nothing submitted yet
        return (
            self._proc is not None
            and not self._pending
            and not self._need_reseed
            and not self._wants
            and report is not None
            and report["last_acked"] >= self._last_seq
            and report["backlog"] == 0
            and not report["need_snapshot"]
        )

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted step was shipped (or a snapshot covers it); ``False``
        on timeout (a snapshot the child asks for meanwhile is the caller's to take)."""
        deadline = self._clock() + timeout_s
        with self._lock:
            if not self._closed and self._proc is not None:
                self._send(_FLUSH, b"")
        while True:
            with self._lock:
                self._poll()
                if self._settled():
                    return True
                if self._wants or (self._need_reseed and self._clock() >= self._restart_at):
                    return False  # the caller takes the snapshot, then flushes again
            left = deadline - self._clock()
            if left <= 0:
                return False
            in_fd = self._in
            if in_fd >= 0:
                with contextlib.suppress(OSError, ValueError):
                    select.select([in_fd], [], [], min(left, 0.01))
            else:
                time.sleep(min(left, 0.01))

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the child to ship what is pending (up to ``timeout_s``) and stop; then wait
        for it (a child that does not stop is killed)."""
        with self._lock:
            proc = self._proc
            if proc is not None and not self._closed:
                self._send(_CLOSE, marshal.dumps(float(timeout_s)))
                # What the pipe did not take yet, blocking now (the child reads until close).
                if self._proc is not None:
                    os.set_blocking(self._out, True)
                    with contextlib.suppress(OSError):
                        while self._pending:
                            os.write(self._out, self._pending.popleft())
            self._closed = True
        if proc is not None:
            try:
                proc.wait(timeout=timeout_s + 2.0)
            except subprocess.TimeoutExpired:
                _LOG.warning(
                    "kvcm: pool %r: the shipper process did not stop; killed", self.pool_id
                )
                proc.kill()
                proc.wait()
            with self._lock:
                if self._in >= 0:
                    os.set_blocking(self._in, True)
                    with contextlib.suppress(OSError):
                        self._take_reports(os.read(self._in, 1 << 20))
                for stream in (proc.stdin, proc.stdout):
                    if stream is not None:
                        with contextlib.suppress(OSError):
                            stream.close()
                self._proc = None
                self._out = self._in = -1
        _metrics.untrack(cast("Any", self))

    @property
    def pid(self) -> int | None:
        """The child's process id (``None`` while there is none)."""
        proc = self._proc
        return None if proc is None else proc.pid


# ---------------------------------------------------------------------- the child process
class _ChildView:
    # A request as the child's recorder reads it (the engine's view, rebuilt from deltas).
    __slots__ = (
        "all_token_ids",
        "block_hashes",
        "cache_salt",
        "key",
        "lora_id",
        "lora_name",
        "num_first_prompt_tokens",
        "report_cached_blocks",
        "request_id",
        "skip_reading_prefix_cache",
    )

    def __init__(self, request_id: str, meta: tuple[Any, ...]) -> None:
        self.request_id = request_id
        (
            self.key,
            self.num_first_prompt_tokens,
            self.lora_id,
            self.lora_name,
            self.cache_salt,
            self.skip_reading_prefix_cache,
            self.report_cached_blocks,
        ) = meta
        self.all_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []


class _Child:
    """The shipper process: reads the engine's pipe, rebuilds notes, ships with the
    thread's shipper, reports back."""

    def __init__(self, reports: int) -> None:
        self._reports = reports
        self._report_lock = threading.Lock()
        self._views: dict[str, _ChildView] = {}
        self._by_key: dict[int, _ChildView] = {}
        self._no_blocks = object()
        self._closed_at = 0.0
        self._wants = 0
        self._asked = False
        self._recorder: Any = None
        self._shipper: Any = None
        self._settings: dict[str, Any] = {}
        self._stop = threading.Event()
        self._last_sent: Any = None
        self._flusher: threading.Thread | None = None

    def _make_recorder(self) -> Any:
        from kvcm.integrations.vllm._recorder import StepRecorder

        settings = self._settings
        return StepRecorder(
            self._shipper,
            **settings["recorder_options"],
            clock=lambda: self._closed_at,
            no_blocks=self._no_blocks,
        )

    def configure(self, settings: dict[str, Any]) -> None:
        from kvcm.client import TlsConfig
        from kvcm.integrations.vllm._shipper import COALESCE_WINDOW_S, GrpcStepShipper

        self._settings = settings
        logging.getLogger("kvcm").setLevel(settings["log_level"])
        tls_files = settings["tls_files"]
        pool_config = settings["pool_config"]
        window = settings["coalesce_window_s"]
        self._shipper = GrpcStepShipper(
            address=settings["address"],
            pool_id=settings["pool_id"],
            pool_config=lambda: pool_config,
            step_timeout_s=settings["step_timeout_s"],
            max_backlog=settings["max_backlog"],
            lease_s=settings["lease_s"],
            tls=None if tls_files is None else TlsConfig.from_files(*tls_files),
            token=settings["token"],
            coalesce_window_s=COALESCE_WINDOW_S if window is None else window,
        )
        self._recorder = self._make_recorder()
        threading.Thread(target=self._report_loop, name="kvcm-ship-report", daemon=True).start()

    def step(self, payload: bytes) -> None:
        seq, closed_at, items, numbers, new_tokens = marshal.loads(payload)
        views = self._views
        by_key = self._by_key
        notes: list[tuple[Any, ...]] = []
        add = notes.append
        kinds = _KINDS
        no_blocks = self._no_blocks
        at = 0  # the next decode allocation's numbers
        token_at = 0
        for item in items:
            if item.__class__ is int:  # a decode step's allocation: the request's key
                view = by_key[item]
                count, num_new, computed, in_flight = numbers[at : at + 4]
                at += 4
                tokens = view.all_token_ids
                if count:
                    tokens += new_tokens[token_at : token_at + count]
                    token_at += count
                hashes = view.block_hashes
                add(
                    (
                        _ALLOCATE,
                        view,
                        tokens,
                        len(tokens),
                        hashes,
                        len(hashes),
                        num_new,
                        computed,
                        in_flight,
                        None,
                        None,
                        no_blocks,
                    )
                )
                continue
            kind = kinds[item[0]]
            if kind is _ALLOCATE or kind in _SYNCED:
                request_id = item[1]
                meta = item[-1]
                if meta is not None:
                    view = views[request_id] = _ChildView(request_id, meta)
                    by_key[view.key] = view
                else:
                    view = views[request_id]
                tokens = view.all_token_ids
                hashes = view.block_hashes
                if item[2]:
                    tokens += item[2]
                if item[3]:
                    hashes += item[3]
                if kind is _ALLOCATE:
                    _, _, _, _, num_tokens, num_hashes, num_new, computed, in_flight = item[:9]
                    hit, slot_options, answer = item[9], item[10], item[11]
                    add(
                        (
                            kind,
                            view,
                            tokens,
                            num_tokens,
                            hashes,
                            num_hashes,
                            num_new,
                            computed,
                            in_flight,
                            None if hit is None else pickle.loads(hit),
                            None if slot_options is None else pickle.loads(slot_options),
                            no_blocks if answer == 0 else answer,
                        )
                    )
                else:
                    add((kind, view, tokens, item[4], hashes, item[5], item[6]))
            elif kind in _FORGETS:
                gone = views.pop(item[1], None)
                if gone is not None:
                    by_key.pop(gone.key, None)
                add((kind, item[1]))
            elif kind is _PREEMPT:
                add((kind, item[1]))
            else:
                add((kind, *item[1:]))
        recorder = self._recorder
        if recorder.num_steps + 1 != seq:  # never: the pipe is ordered and lossless
            _LOG.error("kvcm: shipper process: step %d after %d", seq, recorder.num_steps)
            recorder.num_steps = seq - 1
        recorder.extend_notes(notes)
        self._closed_at = closed_at
        recorder.close_step()

    def reseed(self, payload: bytes) -> None:
        step_seq, data, next_key, requests = pickle.loads(payload)
        views: dict[str, _ChildView] = {}
        tracked: dict[str, tuple[int, int, int]] = {}
        for request_id, meta, tokens, hashes in requests:
            view = views[request_id] = _ChildView(request_id, meta)
            view.all_token_ids = tokens
            view.block_hashes = hashes
            tracked[request_id] = (view.key, len(tokens), len(hashes))
        self._views = views
        self._by_key = {view.key: view for view in views.values()}
        self._recorder = self._make_recorder()
        self._recorder.restore(tracked, next_key=next_key, num_steps=step_seq)
        self._asked = False
        self._shipper.resync_from(step_seq, data)

    def _report_now(self) -> None:
        shipper = self._shipper
        if shipper.wants_snapshot and not self._asked:
            self._asked = True
            self._wants += 1
        lag = shipper.lag()
        stats = shipper.stats
        with shipper._cond:
            backlog = len(shipper._backlog)
            need_snapshot = shipper._need_snapshot
        report = {
            "stats": tuple(getattr(stats, name) for name in _STATS_FIELDS),
            "last_acked": lag.last_acked_step_seq,
            "lag_p50": lag.lag_p50_s,
            "lag_p99": lag.lag_p99_s,
            "reachable": lag.reachable,
            "backlog": backlog,
            "need_snapshot": need_snapshot,
            "wants": self._wants,
        }
        key = (report["stats"], backlog, need_snapshot, self._wants, lag.reachable)
        if key == self._last_sent:
            return
        self._last_sent = key
        payload = marshal.dumps(report)
        with self._report_lock:
            os.write(self._reports, _HEADER.pack(len(payload), _REPORT) + payload)

    def _report_loop(self) -> None:
        while not self._stop.wait(REPORT_INTERVAL_S):
            try:
                self._report_now()
            except BrokenPipeError:
                return  # the engine is gone; the reader sees its end of file
            except Exception:
                _LOG.exception("kvcm: shipper process: reporting failed")

    def flush(self) -> None:
        # The engine's flush() repeats the message while it waits: one flusher at a time.
        shipper = self._shipper
        flusher = self._flusher
        if shipper is not None and (flusher is None or not flusher.is_alive()):
            self._flusher = threading.Thread(
                target=shipper.flush, args=(60.0,), name="kvcm-ship-flush", daemon=True
            )
            self._flusher.start()

    def close(self, timeout_s: float) -> None:
        self._stop.set()
        shipper = self._shipper
        if shipper is None:
            return
        shipper.close(timeout_s)
        with contextlib.suppress(OSError):
            self._last_sent = None
            self._report_now()


class _Reader:
    """The engine's pipe, read without ever waiting on it: an empty pipe is looked at again
    after :data:`READ_INTERVAL_S` asleep. A reader blocked on the pipe would make every
    write of the engine wake it, which costs the engine's thread 15-50 us of CPU per step
    (measured on the 2-core VM) against ~3 us for a write nobody waits for."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd
        self._buf = bytearray()
        self._pos = 0

    def read(self, size: int) -> bytes | None:
        """``size`` bytes, or ``None`` at the end of the pipe (the engine is gone)."""
        buf = self._buf
        while len(buf) - self._pos < size:
            try:
                chunk = os.read(self._fd, 1 << 20)
            except BlockingIOError:
                time.sleep(READ_INTERVAL_S)
                continue
            if not chunk:
                return None
            if self._pos:
                del buf[: self._pos]
                self._pos = 0
            buf += chunk
        start = self._pos
        self._pos = start + size
        return bytes(buf[start : start + size])


def main() -> None:
    """The shipper process: ``python -m kvcm.integrations.vllm._procship`` (the engine
    starts it with its pipes as stdin and stdout)."""
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's Ctrl-C is the engine's to handle
    reports = os.dup(1)
    os.dup2(2, 1)  # a stray print must not reach the report pipe
    child = _Child(reports)
    source = _Reader(0)
    while True:
        header = source.read(_HEADER.size)
        if header is None:  # the engine is gone: ship what is queued, briefly
            child.close(2.0)
            return
        length, kind = _HEADER.unpack(header)
        payload = source.read(length) if length else b""
        if payload is None:
            child.close(2.0)
            return
        if kind == _STEP:
            child.step(payload)
        elif kind == _RESEED:
            child.reseed(payload)
        elif kind == _CONFIG:
            child.configure(pickle.loads(payload))
        elif kind == _FLUSH:
            child.flush()
        elif kind == _CLOSE:
            child.close(float(marshal.loads(payload)))
            return


if __name__ == "__main__":
    main()
