"""The data directory's journal: each mutation written ahead, run once durable.

With ``--data-dir DIR`` every call that may change a pool is appended to ``DIR/journal.log``
*before* it runs, and runs only once its record is on disk (fsync; calls waiting at the same
time share one fsync: group commit). A record that cannot be written or made durable (disk
full, I/O error) fails its call with :class:`JournalUnavailableError` before anything changed,
and the file is cut back to what is durable. The core is deterministic, so replaying the
records in order, each with the time its events were stamped with, rebuilds every pool
exactly, event log and sequence numbers included. A call the core refused after its record
was written is marked by a ``Void`` record naming its sequence number (replay skips it; were
the mark lost, the replay refuses the call again as it was refused live). A checkpoint
(``DIR/checkpoint.bin``: every pool's config, epoch and :mod:`kvcm.core.snapshot`) is written
at start-up after the replay, while serving, and at a graceful stop; the journal then keeps
only the records after it.

The file formats, the damage rules and the test hook are in :mod:`kvcm.server.journal_format`
(re-exported here).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from kvcm.common.errors import ConfigError
from kvcm.server.journal_format import (
    _SEQ,
    CHECKPOINT_FILE,
    FAULT_ENV,
    JOURNAL_FILE,
    PLAN_POOL,
    RECORD_METHODS,
    VOID,
    Checkpoint,
    CheckpointPool,
    JournalDamagedError,
    JournalRecord,
    JournalScan,
    _encode_record,
    _fault,
    _fsync_directory,
    _os_reason,
    damage_message,
    iter_voided,
    read_checkpoint,
    read_journal,
    read_records,
    scan_journal,
    write_checkpoint,
)

__all__ = [
    "CHECKPOINT_FILE",
    "FAULT_ENV",
    "JOURNAL_FILE",
    "PLAN_POOL",
    "RECORD_METHODS",
    "RETRY_S",
    "VOID",
    "Checkpoint",
    "CheckpointPool",
    "Journal",
    "JournalDamagedError",
    "JournalRecord",
    "JournalScan",
    "JournalUnavailableError",
    "Ticket",
    "damage_message",
    "iter_voided",
    "open_data_dir",
    "read_checkpoint",
    "read_journal",
    "read_records",
    "scan_journal",
    "write_checkpoint",
]

_LOG = logging.getLogger("kvcm.server.journal")
_REGISTRY_KEY: Final = "\x00registry"
RETRY_S: Final = 0.5
"""How often a record the disk refused is tried again while something waits for it."""


class JournalUnavailableError(Exception):
    """Raised when a record cannot be written or made durable (disk full, I/O error). The
    call it was for has not run: nothing changed. The message says why."""


# --- the journal -------------------------------------------------------------------------------


class Ticket:
    """A record written ahead of its call (:meth:`Journal.write_ahead`).

    Attributes:
        seq: The record's sequence number.
        pool_id: The pool the call is on.
        waits: Earlier calls on the same pool (and, for calls that add or remove pools,
            earlier such calls) that must finish first: calls run in journal order.
        done: Set when the call has finished, whichever way.
        started: The call began running (from then on only the call itself decides).
        void_reason: Why the call must not run after all (``None``: it may).
    """

    __slots__ = ("done", "pool_id", "seq", "started", "void_reason", "waits")

    def __init__(self, seq: int, pool_id: str, done: asyncio.Future[None]) -> None:
        """A ticket for record ``seq`` on ``pool_id``."""
        self.seq = seq
        self.pool_id = pool_id
        self.done = done
        self.waits: list[asyncio.Future[None]] = []
        self.started = False
        self.void_reason: str | None = None


class Journal:
    """The append-only journal with group commit (see the module docstring).

    Attributes:
        directory: The data directory.
        last_seq: The last sequence number written.
        durable_seq: The last sequence number known to be on disk.
        num_records: Records appended since the journal was opened.
        num_fsyncs: fsyncs made (each commits every record appended before it).
        num_failures: Writes and fsyncs that failed (each failed the calls waiting on it).
        records_since_checkpoint: Records the journal holds after the last checkpoint.
    """

    def __init__(self, directory: Path, last_seq: int) -> None:
        """Open ``directory/journal.log`` (intact: see :func:`open_data_dir`) after
        ``last_seq``."""
        self.directory = directory
        self.path = directory / JOURNAL_FILE
        self.last_seq = last_seq
        self.durable_seq = last_seq
        self.num_records = 0
        self.num_fsyncs = 0
        self.num_failures = 0
        self.records_since_checkpoint = 0
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size  # bytes of whole records written
        self._durable_size = self._size
        self._dirty = False  # bytes past _size may be in the file (a failed write)
        self._written_seq = last_seq  # the last record in the file
        # Records of changes already made (append) that are not durable yet, by their last
        # sequence number; those not in the file yet are in _pending, written before any
        # later record.
        self._changes: dict[int, bytes] = {}
        self._pending: dict[int, bytes] = {}
        self._generation = 0  # files this journal replaced (reset, truncate_through)
        self._syncing: asyncio.Task[None] | None = None
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._futures: dict[int, asyncio.Future[None]] = {}
        self._retired: list[int] = []  # descriptors to close once no fsync uses them
        self._tails: dict[str, Ticket] = {}
        self._open_tickets: dict[str, list[Ticket]] = {}
        self._in_flight = 0
        self._drained: asyncio.Event | None = None
        self.gate: asyncio.Event | None = None  # set while calls may write; None: open
        # Told of each change :meth:`append` records (method, pool, request, time), right
        # after the change was made: replication ships it to the pool's standby.
        self.on_change: Callable[[str, str, bytes, float], object] | None = None
        # Told of each call a servicer journals itself (TransferService), right after it was
        # applied: replication ships it; the call's answer first awaits what it returns (a
        # ``sync`` pool's standby acknowledgement), if anything.
        self.on_call: Callable[[str, str, bytes, float], Awaitable[None] | None] | None = None
        # Asked (method, pool) before such a call is written: raises to refuse a call on a
        # pool this replica does not serve now (a standby's, one being promoted).
        self.admit: Callable[[str, str], None] | None = None

    @property
    def pending_changes(self) -> int:
        """Records of changes already made that the disk has not taken yet (:meth:`append`)."""
        return len(self._pending)

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    # -- writing --

    def _cut(self) -> None:
        """Cut the file back to its whole records (after a failed write or fsync)."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as exc:
            self._dirty = True
            reason = _os_reason("cut a failed write from", self.path, exc)
            raise JournalUnavailableError(reason) from None
        self._dirty = False

    def _write(self, data: bytes, last: int) -> None:
        """Write the pending changes, then ``data`` (whole records up to seq ``last``) at the
        end of the file, or raise leaving it as it was."""
        if self._dirty:
            self._cut()
        if self._pending:
            data = b"".join(self._pending.values()) + data
            last = max(last, *self._pending)
        view = memoryview(data)
        written = 0
        try:
            _fault("write")
            while written < len(data):
                count = os.write(self._fd, view[written:])
                if count <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += count
        except OSError as exc:
            self.num_failures += 1
            if written:
                self._dirty = True
                with contextlib.suppress(JournalUnavailableError):
                    self._cut()  # else _dirty: cut again before the next write
            raise JournalUnavailableError(_os_reason("write to", self.path, exc)) from None
        self._size += len(data)
        self._written_seq = max(self._written_seq, last)
        self._pending.clear()

    def _records(self, entries: list[tuple[str, str, bytes, float]]) -> tuple[bytes, int]:
        """Encode ``entries`` (method, pool, request, time) after ``last_seq``."""
        seq = self.last_seq
        parts = []
        for method, pool_id, request, when in entries:
            seq += 1
            parts.append(_encode_record(JournalRecord(seq, when, method, pool_id, request)))
        return b"".join(parts), seq

    def _wrote(self, last: int, count: int, durable: bool) -> None:
        self.last_seq = last
        self.num_records += count
        self.records_since_checkpoint += count
        if durable:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._futures[last] = future
            self._waiting.append((last, future))
            if self._syncing is None:
                self._syncing = asyncio.create_task(self._sync_loop(), name="kvcm-journal")

    def write_ahead(self, method: str, pool_id: str, request: bytes, when: float) -> Ticket:
        """Write a call's record before it runs (await :meth:`commit`, then run it after the
        ticket's ``waits``, then :meth:`finish`).

        ``CreatePool``, ``DeletePool`` and ``ResyncPool`` also wait for every earlier call of
        those three (they hand out pool epochs and share the registry's budget).

        Raises:
            JournalUnavailableError: It could not be written; the call must not run.
        """
        data, seq = self._records([(method, pool_id, request, when)])
        self._write(data, seq)
        self._wrote(seq, 1, durable=True)
        loop = asyncio.get_running_loop()
        ticket = Ticket(seq, pool_id, loop.create_future())
        keys: tuple[str, ...] = (pool_id,)
        if method in ("CreatePool", "DeletePool", "ResyncPool"):
            keys = (pool_id, _REGISTRY_KEY)
        for key in keys:
            previous = self._tails.get(key)
            if previous is not None and not previous.done.done():
                ticket.waits.append(previous.done)
            self._tails[key] = ticket
        self._open_tickets.setdefault(pool_id, []).append(ticket)
        self._in_flight += 1
        return ticket

    def has_calls_on(self, pool_id: str) -> bool:
        """Whether a call on ``pool_id`` is written and not released yet."""
        return pool_id in self._tails

    def finish(self, ticket: Ticket) -> None:
        """The ticket's call has finished (run, refused or failed): later calls may run once
        the calls it waited for have finished too (a call that failed early must not let
        the next one overtake a call still running before it)."""
        tickets = self._open_tickets.get(ticket.pool_id)
        if tickets is not None and ticket in tickets:
            tickets.remove(ticket)
            if not tickets:
                del self._open_tickets[ticket.pool_id]
            self._in_flight -= 1
            if not self._in_flight and self._drained is not None:
                self._drained.set()
        pending = [earlier for earlier in ticket.waits if not earlier.done()]
        if pending:
            asyncio.gather(*pending).add_done_callback(lambda _: self._release(ticket))
        else:
            self._release(ticket)

    def _release(self, ticket: Ticket) -> None:
        if not ticket.done.done():
            ticket.done.set_result(None)
        for key in (ticket.pool_id, _REGISTRY_KEY):
            if self._tails.get(key) is ticket:
                del self._tails[key]

    def void(self, ticket: Ticket) -> None:
        """Mark a written call that the core refused as not run (best effort: were the mark
        lost, a replay refuses the call again)."""
        data, seq = self._records([(VOID, ticket.pool_id, _SEQ.pack(ticket.seq), 0.0)])
        try:
            self._write(data, seq)
        except JournalUnavailableError:
            return
        self._wrote(seq, 1, durable=False)

    def append(self, method: str, pool_id: str, request: bytes, when: float) -> int:
        """Append the record of a change already made (a lease reclaim, a registration round
        that planned a pool); returns its sequence number (await :meth:`commit`).

        Calls on the pool written ahead but not started yet were written before this change
        though they would run after it: they are voided in the same write (and answer
        UNAVAILABLE), so the journal's order stays the order things happened in.

        The change is made, so its record is never dropped: when the disk refuses it (or the
        fsync that covered it fails), it is kept and written before any later record, tried
        again every ``RETRY_S``; :meth:`commit` returns once it is durable.
        """
        stale = [
            ticket
            for ticket in self._open_tickets.get(pool_id, ())
            if not ticket.started and ticket.void_reason is None
        ]
        entries = []
        if stale:
            voided = b"".join(_SEQ.pack(ticket.seq) for ticket in stale)
            entries.append((VOID, pool_id, voided, when))
        entries.append((method, pool_id, request, when))
        data, seq = self._records(entries)
        try:
            self._write(data, seq)
        except JournalUnavailableError as exc:
            self._pending[seq] = data
            _LOG.error(
                "journal: %s; the record of %s on pool %r (already made) is kept and written "
                "before any later record",
                exc,
                method,
                pool_id,
            )
        self._changes[seq] = data
        for ticket in stale:
            ticket.void_reason = (
                f"pool {pool_id!r} changed while this call waited for its journal record "
                f"({method}): nothing was done, retry"
            )
        self._wrote(seq, len(entries), durable=True)
        if self.on_change is not None:
            self.on_change(method, pool_id, request, when)
        return seq

    async def commit(self, seq: int) -> None:
        """Return once record ``seq`` is on disk (sharing fsyncs with concurrent callers).

        Raises:
            JournalUnavailableError: The fsync failed: the record was cut from the file (a
                change's record is kept instead, see :meth:`append`); or the journal closed.
        """
        future = self._futures.pop(seq, None)
        if future is None:
            return  # durable already (or not written by append/write_ahead)
        await future

    async def _sync_loop(self) -> None:
        try:
            while self._waiting:
                if self._pending:
                    with contextlib.suppress(JournalUnavailableError):
                        self._write(b"", 0)
                target, size, generation = self._written_seq, self._size, self._generation
                if self._waiting[0][0] > target:  # only pending records are waited for
                    await asyncio.sleep(RETRY_S)
                    continue
                try:
                    await asyncio.to_thread(self._fsync, self._fd)
                except OSError as exc:
                    if generation == self._generation:
                        self._lose(exc)
                        if self._waiting:  # changes' records: try again in a while
                            await asyncio.sleep(RETRY_S)
                    continue  # else a new file replaced this one, durable already
                self.num_fsyncs += 1
                if generation != self._generation:
                    continue  # the new file's records were made durable when it was made
                self._synced(target, size)
        finally:
            self._syncing = None
            for descriptor in self._retired:
                os.close(descriptor)
            self._retired.clear()

    def _synced(self, target: int, size: int) -> None:
        """Records up to ``target`` (``size`` bytes) are durable."""
        self.durable_seq = max(self.durable_seq, target)
        self._durable_size = max(self._durable_size, size)
        while self._waiting and self._waiting[0][0] <= target:
            _, future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
        for seq in [seq for seq in self._changes if seq <= target]:
            del self._changes[seq]

    @staticmethod
    def _fsync(descriptor: int) -> None:
        _fault("fsync")
        os.fsync(descriptor)

    def _lose(self, exc: OSError) -> None:
        """An fsync failed: what it covered may or may not be on disk. Cut the file back to
        what is known durable (the next good fsync makes the cut durable too) and fail every
        call waiting on a record after it; none of them has run."""
        self.num_failures += 1
        reason = _os_reason("make durable", self.path, exc)
        _LOG.error("journal: %s; the calls waiting on it answer UNAVAILABLE", reason)
        self._size = self._durable_size
        self._written_seq = self.durable_seq
        with contextlib.suppress(JournalUnavailableError):
            self._cut()  # else _dirty: cut again before the next write
        self._pending = dict(self._changes)  # changes made are written again, in order
        self._fail_waiting(reason, keep=self._changes)

    def _fail_waiting(self, reason: str, keep: dict[int, bytes] | None = None) -> None:
        """Fail the futures waiting for records (but those in ``keep``)."""
        kept: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        while self._waiting:
            seq, future = self._waiting.popleft()
            if keep is not None and seq in keep:
                kept.append((seq, future))
            elif not future.done():
                future.set_exception(JournalUnavailableError(reason))
                future.exception()  # retrieved here: a caller may have gone
        self._waiting = kept

    # -- checkpoints --

    async def pause(self, timeout_s: float) -> bool:
        """Hold new calls at :attr:`gate` and wait until every call written ahead has
        finished; ``False`` (gate open again) when that takes longer than ``timeout_s``."""
        self.gate = asyncio.Event()
        if not self._in_flight:
            return True
        self._drained = asyncio.Event()
        try:
            await asyncio.wait_for(self._drained.wait(), timeout_s)
        except TimeoutError:
            self.resume()
            return False
        finally:
            self._drained = None
        return True

    def resume(self) -> None:
        """Let calls write again (after :meth:`pause`)."""
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.set()

    def _void_all(self, reason: str) -> None:
        for tickets in self._open_tickets.values():
            for ticket in tickets:
                if not ticket.started and ticket.void_reason is None:
                    ticket.void_reason = reason

    def _swap(self, descriptor: int) -> None:
        old, self._fd = self._fd, descriptor
        self._generation += 1
        if self._syncing is not None:
            self._retired.append(old)  # an fsync in a worker thread may still use it
        else:
            os.close(old)

    def reset(self, checkpoint: Checkpoint, *, quiet: bool = False) -> OSError | None:
        """Write ``checkpoint`` and start an empty journal after it.

        Calls written ahead and not started are dropped with the old journal (they answer
        UNAVAILABLE).

        Returns:
            ``None``, or the error that kept the checkpoint from being written (a full or
            failing disk; logged as one line unless ``quiet``): the journal is then left as
            it was, holding every answered call.
        """
        try:
            write_checkpoint(self.directory, checkpoint)
        except OSError as exc:
            if quiet:
                return exc
            _LOG.error(
                "journal: no checkpoint written: %s; %s keeps every answered call",
                _os_reason("write a checkpoint to", self.directory, exc),
                self.path,
            )
            return exc
        self._void_all("the server compacted its journal while this call waited: retry")
        with self.path.open("wb") as out:
            os.fsync(out.fileno())
        self._swap(self._open())
        self._size = self._durable_size = 0
        self._dirty = False
        self.durable_seq = self.last_seq = max(self.last_seq, checkpoint.seq)
        self._written_seq = self.last_seq
        self._pending.clear()  # the checkpoint holds the changes made
        self._changes.clear()
        self.records_since_checkpoint = 0
        while self._waiting:  # every record written is in the checkpoint or voided
            _, future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
        return None

    def truncate_through(self, seq: int) -> None:
        """Drop the records up to ``seq`` (a checkpoint written for ``seq`` holds them).

        For a checkpoint taken while the server runs: records appended meanwhile have larger
        sequence numbers and stay. The new journal is written beside the old one, fsynced and
        renamed over it; every record written so far is then durable.

        Raises:
            OSError: The new journal could not be written (the old one stays).
        """
        if self._dirty:
            self._cut()
        os.fsync(self._fd)
        records, _ = read_records(self.path)
        temporary = self.directory / (JOURNAL_FILE + ".tmp")
        kept = b"".join(_encode_record(record) for record in records if record.seq > seq)
        try:
            with temporary.open("wb") as out:
                _fault("write")
                out.write(kept)
                out.flush()
                _fault("fsync")
                os.fsync(out.fileno())
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        temporary.replace(self.path)
        _fsync_directory(self.directory)
        self._swap(self._open())
        for covered in [covered for covered in self._pending if covered <= seq]:
            del self._pending[covered]  # the checkpoint holds these changes
        self._size = self._durable_size = len(kept)
        self.records_since_checkpoint = sum(1 for record in records if record.seq > seq)
        self._synced(self._written_seq, len(kept))
        self._synced(seq, len(kept))
        self._durable_size = len(kept)

    def close(self) -> None:
        """fsync and close; calls still waiting answer UNAVAILABLE (an fsync that fails is
        logged: what it covered was never answered)."""
        self._void_all("the server is stopping")
        self._fail_waiting("the server is stopping")
        try:
            os.fsync(self._fd)
        except OSError as exc:
            _LOG.error("journal: %s", _os_reason("make durable", self.path, exc))
        finally:
            self._swap(-1)


def open_data_dir(path: str) -> tuple[Path, Checkpoint | None, list[JournalRecord], int]:
    """Create or open a data directory: its checkpoint, the journal records after it, and
    the byte length of the intact journal (a torn tail is cut off here, and only that).

    Raises:
        ConfigError: Not a usable directory, or a damaged checkpoint.
        JournalDamagedError: The journal is damaged other than by a torn tail (nothing was
            changed).
    """
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data_dir: cannot create {path!r}: {exc.strerror or exc}") from exc
    if not os.access(directory, os.W_OK):
        raise ConfigError(f"data_dir: {path!r} is not writable")
    checkpoint = read_checkpoint(directory)
    journal_path = directory / JOURNAL_FILE
    scan = read_journal(journal_path)
    if scan.damaged:
        raise JournalDamagedError(damage_message(journal_path, scan))
    if scan.torn:
        _LOG.warning(
            "journal: trimmed a torn last record at byte %d of %s (%s; %d bytes; its call "
            "was never answered)",
            scan.intact,
            journal_path,
            scan.damage,
            scan.size - scan.intact,
        )
        with journal_path.open("r+b") as out:
            out.truncate(scan.intact)
            os.fsync(out.fileno())
    after = 0 if checkpoint is None else checkpoint.seq
    records = [r for r in scan.records if r.seq > after]
    return directory, checkpoint, records, scan.intact
