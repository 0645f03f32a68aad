"""The data directory: a write-ahead journal of acknowledged mutations, and checkpoints.

With ``--data-dir DIR`` every call that changed a pool is appended to ``DIR/journal.log``
before its answer leaves the server, and its answer waits until the record is on disk (fsync;
calls waiting at the same time share one fsync: group commit). The core is deterministic, so
replaying the records in order, each with the time its events were stamped with, rebuilds
every pool exactly, event log and sequence numbers included. A checkpoint
(``DIR/checkpoint.bin``: every pool's config, epoch and :mod:`kvcm.core.snapshot`) is written at
start-up after the replay and at a graceful stop, after which the journal starts empty.

Record framing (little-endian; a record a crash tore is detected and dropped: it was never
acknowledged)::

    u32 body length | u32 CRC-32 of body | body
    body = u64 seq | f64 time | u16 len + method | u16 len + pool id | request bytes

``seq`` is server-wide and never reused (a checkpoint carries the last one), so the journal can
be shipped to a standby replica and applied in order there.

Checkpoint file: ``KVCMCKPT`` magic, u32 version, u32 CRC-32 of the rest, u64 last seq, u64
registry epoch, u32 pool count, then per pool: u16 + id, u32 + config (``kvcm.v1.PoolConfig``
bytes), u64 epoch, u64 + snapshot bytes (empty for a pool still waiting for its workers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final

from kvcm.common.errors import ConfigError

__all__ = ["Checkpoint", "CheckpointPool", "Journal", "JournalRecord", "read_checkpoint"]

_LOG = logging.getLogger("kvcm.server.journal")
_FRAME: Final = struct.Struct("<II")
_HEAD: Final = struct.Struct("<Qd")
_CHECKPOINT_MAGIC: Final = b"KVCMCKPT"
_CHECKPOINT_VERSION: Final = 1
JOURNAL_FILE: Final = "journal.log"
CHECKPOINT_FILE: Final = "checkpoint.bin"


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One acknowledged mutation.

    Attributes:
        seq: Server-wide sequence number (1, 2, ...; never reused).
        time: The wall-clock time the call stamped its events with.
        method: The RPC (``"Step"``, ``"CreatePool"``, ...).
        pool_id: The pool it changed.
        request: The request message's bytes.
    """

    seq: int
    time: float
    method: str
    pool_id: str
    request: bytes


@dataclass(frozen=True, slots=True)
class CheckpointPool:
    """One pool in a checkpoint."""

    pool_id: str
    config: bytes
    epoch: int
    snapshot: bytes


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Every pool as of journal sequence ``seq``."""

    seq: int
    registry_epoch: int
    pools: tuple[CheckpointPool, ...]


def _encode_record(record: JournalRecord) -> bytes:
    method = record.method.encode()
    pool = record.pool_id.encode()
    body = b"".join(
        (
            _HEAD.pack(record.seq, record.time),
            struct.pack("<H", len(method)),
            method,
            struct.pack("<H", len(pool)),
            pool,
            record.request,
        )
    )
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def _decode_body(body: bytes) -> JournalRecord:
    seq, when = _HEAD.unpack_from(body)
    at = _HEAD.size
    (size,) = struct.unpack_from("<H", body, at)
    method = body[at + 2 : at + 2 + size].decode()
    at += 2 + size
    (size,) = struct.unpack_from("<H", body, at)
    pool_id = body[at + 2 : at + 2 + size].decode()
    at += 2 + size
    return JournalRecord(seq, when, method, pool_id, body[at:])


def read_records(path: Path) -> tuple[list[JournalRecord], int]:
    """The intact records of a journal file and the byte length they span (a torn or
    damaged tail after them is ignored: it was never acknowledged)."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    records: list[JournalRecord] = []
    at = 0
    while at + _FRAME.size <= len(data):
        size, crc = _FRAME.unpack_from(data, at)
        start = at + _FRAME.size
        body = data[start : start + size]
        if len(body) != size or zlib.crc32(body) != crc:
            break
        records.append(_decode_body(body))
        at = start + size
    if at != len(data):
        _LOG.warning(
            "journal: dropped a torn record at byte %d of %s (never acknowledged)", at, path
        )
    return records, at


def write_checkpoint(directory: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` atomically (temporary file, fsync, rename, fsync the directory)."""
    parts = [struct.pack("<QQI", checkpoint.seq, checkpoint.registry_epoch, len(checkpoint.pools))]
    for pool in checkpoint.pools:
        name = pool.pool_id.encode()
        parts.append(struct.pack("<H", len(name)) + name)
        parts.append(struct.pack("<I", len(pool.config)) + pool.config)
        parts.append(struct.pack("<QQ", pool.epoch, len(pool.snapshot)) + pool.snapshot)
    body = b"".join(parts)
    header = _CHECKPOINT_MAGIC + struct.pack("<II", _CHECKPOINT_VERSION, zlib.crc32(body))
    temporary = directory / (CHECKPOINT_FILE + ".tmp")
    with temporary.open("wb") as out:
        out.write(header)
        out.write(body)
        out.flush()
        os.fsync(out.fileno())
    temporary.replace(directory / CHECKPOINT_FILE)
    _fsync_directory(directory)


def read_checkpoint(directory: Path) -> Checkpoint | None:
    """The directory's checkpoint, or ``None`` when there is none.

    Raises:
        ConfigError: The checkpoint is damaged or of another version (refuse to start rather
            than serve without acknowledged state).
    """
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        return None
    data = path.read_bytes()
    if len(data) < 16 or data[:8] != _CHECKPOINT_MAGIC:
        raise ConfigError(f"data_dir: {path} is not a kvcm checkpoint")
    version, crc = struct.unpack_from("<II", data, 8)
    body = data[16:]
    if version != _CHECKPOINT_VERSION or zlib.crc32(body) != crc:
        raise ConfigError(f"data_dir: {path} is damaged or of version {version}")
    seq, registry_epoch, count = struct.unpack_from("<QQI", body)
    at = 20
    pools = []
    for _ in range(count):
        (size,) = struct.unpack_from("<H", body, at)
        pool_id = body[at + 2 : at + 2 + size].decode()
        at += 2 + size
        (size,) = struct.unpack_from("<I", body, at)
        config = body[at + 4 : at + 4 + size]
        at += 4 + size
        epoch, size = struct.unpack_from("<QQ", body, at)
        snapshot = body[at + 16 : at + 16 + size]
        at += 16 + size
        pools.append(CheckpointPool(pool_id, config, epoch, snapshot))
    return Checkpoint(seq, registry_epoch, tuple(pools))


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class Journal:
    """The append-only journal with group commit (see the module docstring).

    Attributes:
        directory: The data directory.
        last_seq: The last sequence number handed out.
        durable_seq: The last sequence number known to be on disk.
        num_records: Records appended since the journal was opened.
        num_fsyncs: fsyncs made (each commits every record appended before it).
        records_since_checkpoint: Records the journal holds after the last checkpoint.
    """

    def __init__(self, directory: Path, last_seq: int) -> None:
        """Open ``directory/journal.log`` for appending after ``last_seq``."""
        self.directory = directory
        self.last_seq = last_seq
        self.durable_seq = last_seq
        self.num_records = 0
        self.num_fsyncs = 0
        self.records_since_checkpoint = 0
        self._file: BinaryIO = (directory / JOURNAL_FILE).open("ab")
        self._syncing: asyncio.Task[None] | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def append(self, method: str, pool_id: str, request: bytes, when: float) -> int:
        """Append one record (buffered, not yet durable); returns its sequence number."""
        self.last_seq += 1
        self._file.write(
            _encode_record(JournalRecord(self.last_seq, when, method, pool_id, request))
        )
        self.num_records += 1
        self.records_since_checkpoint += 1
        return self.last_seq

    async def commit(self, seq: int) -> None:
        """Return once record ``seq`` is on disk (sharing fsyncs with concurrent callers)."""
        if seq <= self.durable_seq:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, future))
        if self._syncing is None:
            self._syncing = asyncio.create_task(self._sync_loop())
        await future

    async def _sync_loop(self) -> None:
        try:
            while self._waiters:
                target = self.last_seq
                self._file.flush()
                await asyncio.to_thread(os.fsync, self._file.fileno())
                self.num_fsyncs += 1
                self.durable_seq = target
                waiting, self._waiters = self._waiters, []
                for seq, future in waiting:
                    if seq <= target:
                        if not future.done():
                            future.set_result(None)
                    else:
                        self._waiters.append((seq, future))
        except BaseException as exc:
            for _, future in self._waiters:
                if not future.done():
                    future.set_exception(exc)
            self._waiters = []
            raise
        finally:
            self._syncing = None

    def records(self) -> Iterator[JournalRecord]:
        """The records on disk (for replay, before any append)."""
        records, _ = read_records(self.directory / JOURNAL_FILE)
        yield from records

    def reset(self, checkpoint: Checkpoint) -> None:
        """Write ``checkpoint`` and start an empty journal after it."""
        self._file.flush()
        write_checkpoint(self.directory, checkpoint)
        self._file.close()
        path = self.directory / JOURNAL_FILE
        with path.open("wb") as out:
            os.fsync(out.fileno())
        self._file = path.open("ab")
        self.durable_seq = self.last_seq = checkpoint.seq
        self.records_since_checkpoint = 0

    def truncate_through(self, seq: int) -> None:
        """Drop the records up to ``seq`` (a checkpoint written for ``seq`` holds them).

        For a checkpoint taken while the server runs: records appended meanwhile (calls on
        pools the checkpoint does not hold) have larger sequence numbers and stay. The new
        journal is written beside the old one, fsynced and renamed over it.
        """
        self._file.flush()
        os.fsync(self._file.fileno())
        path = self.directory / JOURNAL_FILE
        records, _ = read_records(path)
        temporary = self.directory / (JOURNAL_FILE + ".tmp")
        with temporary.open("wb") as out:
            for record in records:
                if record.seq > seq:
                    out.write(_encode_record(record))
            out.flush()
            os.fsync(out.fileno())
        self._file.close()
        temporary.replace(path)
        _fsync_directory(self.directory)
        self._file = path.open("ab")
        self.records_since_checkpoint = self.last_seq - seq

    def close(self) -> None:
        """Flush, fsync and close."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def open_data_dir(path: str) -> tuple[Path, Checkpoint | None, list[JournalRecord], int]:
    """Create or open a data directory: its checkpoint, the journal records after it, and
    the byte length of the intact journal (a torn tail is cut off here).

    Raises:
        ConfigError: Not a usable directory, or a damaged checkpoint.
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
    records, intact = read_records(journal_path)
    if journal_path.exists() and intact != journal_path.stat().st_size:
        with journal_path.open("r+b") as out:
            out.truncate(intact)
            os.fsync(out.fileno())
    after = 0 if checkpoint is None else checkpoint.seq
    return directory, checkpoint, [r for r in records if r.seq > after], intact
