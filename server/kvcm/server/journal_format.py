"""The data directory's files: journal records, their damage, and checkpoints.

Record framing (little-endian)::

    u32 body length | u32 CRC-32 of body | body
    body = u64 seq | f64 time | u16 len + method | u16 len + pool id | request bytes

``seq`` is server-wide, increasing and never reused (a checkpoint carries the last one), so
the journal can be shipped to a standby replica and applied in order there. A ``Void``
record's request bytes are the u64 sequence numbers it voids.

Damage (see :func:`scan_journal`): only a *torn tail*, the last record left incomplete by a
crash while it was written (never acknowledged), is trimmed at start-up. Any other damage
stops the start with :class:`JournalDamagedError` naming the file and byte offset, and
nothing is changed; ``kvcm data-dir check|recover`` (:mod:`kvcm.server.datadir`) inspect it and,
only when asked, cut the journal at the damage.

Checkpoint file: ``KVCMCKPT`` magic, u32 version (2; 1 is still read), u32 CRC-32 of the
rest, u64 last seq, u64 registry epoch, u32 pool count, then per pool: u16 + id, u32 + config
(``kvcm.v1.PoolConfig`` bytes), u64 epoch, u64 + snapshot bytes (empty for a pool still
waiting for its workers); version 2 ends with u64 + the KV-event numbering table, version 3
then with u64 + the transfer records (``kvcm.v1.ListTransfersResponse`` bytes).

Test hook (off unless set): ``KVCM_JOURNAL_FAULT_FILE=PATH``. While ``PATH`` exists, its
content (``"write ENOSPC"``, ``"fsync EIO"``, ``"any ENOSPC"``, ...) makes every journal and
checkpoint write, fsync or both raise that ``OSError``, as a full or failing disk does.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from kvcm.common.errors import ConfigError

__all__ = [
    "CHECKPOINT_FILE",
    "FAULT_ENV",
    "JOURNAL_FILE",
    "PLAN_POOL",
    "RECORD_METHODS",
    "VOID",
    "Checkpoint",
    "CheckpointPool",
    "JournalDamagedError",
    "JournalRecord",
    "JournalScan",
    "damage_message",
    "iter_voided",
    "read_checkpoint",
    "read_journal",
    "read_records",
    "scan_journal",
    "write_checkpoint",
]

_FRAME: Final = struct.Struct("<II")
_HEAD: Final = struct.Struct("<Qd")
_U16: Final = struct.Struct("<H")
_SEQ: Final = struct.Struct("<Q")
_CHECKPOINT_MAGIC: Final = b"KVCMCKPT"
_CHECKPOINT_VERSION: Final = 3
JOURNAL_FILE: Final = "journal.log"
CHECKPOINT_FILE: Final = "checkpoint.bin"
VOID: Final = "Void"
PLAN_POOL: Final = "PlanPool"
FAULT_ENV: Final = "KVCM_JOURNAL_FAULT_FILE"
# Every method a record may carry: a damaged journal is searched for intact records by them.
RECORD_METHODS: Final = frozenset(
    {
        "CreatePool",
        "DeletePool",
        "Step",
        "ResyncPool",
        "AddRequest",
        "AppendTokens",
        "Free",
        "GetComputedBlocks",
        "AllocateSlots",
        "CacheBlocks",
        "RemoveSkippedBlocks",
        "EvictBlocks",
        "ResetPrefixCache",
        "TakeNewBlockIds",
        "NewStepStarts",
        "TakePrefixCacheStats",
        "HoldSource",
        "PlanTransfer",
        "CommitTransfer",
        "ReleaseTransfer",
        "ExpireTransfer",
        PLAN_POOL,
        VOID,
    }
)
# A record body's smallest size: seq, time and two empty length-prefixed strings.
_MIN_BODY: Final = _HEAD.size + 2 * _U16.size
_METHOD_AT: Final = _FRAME.size + _HEAD.size  # where a frame's method length is


class JournalDamagedError(ConfigError):
    """Raised at start-up when the journal is damaged other than by a torn tail (see
    :func:`scan_journal`): the server refuses to start and changes nothing."""


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One journaled mutation.

    Attributes:
        seq: Server-wide sequence number (1, 2, ...; increasing, never reused).
        time: The wall-clock time the call stamped its events with.
        method: The RPC (``"Step"``, ``"CreatePool"``, ...), ``"PlanPool"`` or ``"Void"``.
        pool_id: The pool it changed.
        request: The request message's bytes.
    """

    seq: int
    time: float
    method: str
    pool_id: str
    request: bytes

    def voided(self) -> list[int]:
        """The sequence numbers a ``Void`` record voids."""
        data = self.request
        return [_SEQ.unpack_from(data, at)[0] for at in range(0, len(data) - 7, _SEQ.size)]


@dataclass(frozen=True, slots=True)
class CheckpointPool:
    """One pool in a checkpoint."""

    pool_id: str
    config: bytes
    epoch: int
    snapshot: bytes


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Every pool as of journal sequence ``seq``.

    Attributes:
        kv_event_numbering: The ZMQ KV-event stream's numbering per pool id
            (``KvEventNumbering.encode``; empty in a version-1 checkpoint).
        transfers: The P/D transfer records (empty before version 3).
    """

    seq: int
    registry_epoch: int
    pools: tuple[CheckpointPool, ...]
    kv_event_numbering: bytes = b""
    transfers: bytes = b""


def _encode_record(record: JournalRecord) -> bytes:
    method = record.method.encode()
    pool = record.pool_id.encode()
    body = b"".join(
        (
            _HEAD.pack(record.seq, record.time),
            _U16.pack(len(method)),
            method,
            _U16.pack(len(pool)),
            pool,
            record.request,
        )
    )
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def _decode_body(body: bytes) -> JournalRecord:
    """Raises ValueError or struct.error on a body that is no record."""
    if len(body) < _MIN_BODY:
        raise ValueError("too short")
    seq, when = _HEAD.unpack_from(body)
    at = _HEAD.size
    (size,) = _U16.unpack_from(body, at)
    method = body[at + 2 : at + 2 + size].decode()
    at += 2 + size
    (size,) = _U16.unpack_from(body, at)
    if at + 2 + size > len(body):
        raise ValueError("pool id past the body")
    pool_id = body[at + 2 : at + 2 + size].decode()
    at += 2 + size
    return JournalRecord(seq, when, method, pool_id, body[at:])


# --- reading and checking a journal ------------------------------------------------------------


@dataclass(slots=True)
class JournalScan:
    """What :func:`scan_journal` found in a journal file.

    Attributes:
        records: The intact records before any damage, in order.
        intact: Byte length of those records (the offset of the damage, if any).
        size: The file's size.
        damage: Why the bytes from ``intact`` on are no record (``None``: no damage).
        torn: Whether that damage is a torn tail (trimmed at start-up) rather than damage
            that stops the start.
        after: Intact records found after the damage (what cutting there would drop).
    """

    records: list[JournalRecord] = field(default_factory=list)
    intact: int = 0
    size: int = 0
    damage: str | None = None
    torn: bool = False
    after: list[JournalRecord] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        """Damage other than a torn tail: a start is refused."""
        return self.damage is not None and not self.torn


def _frame_at(data: bytes, at: int, previous_seq: int) -> JournalRecord | str:
    """The record whose frame starts at ``at``, or why there is none."""
    left = len(data) - at
    if left < _FRAME.size:
        return f"a partial frame header ({left} bytes)"
    size, crc = _FRAME.unpack_from(data, at)
    if size > left - _FRAME.size:
        return f"a frame of {size} bytes with {left - _FRAME.size} bytes left in the file"
    body = data[at + _FRAME.size : at + _FRAME.size + size]
    if zlib.crc32(body) != crc:
        return "a CRC-32 mismatch"
    try:
        record = _decode_body(body)
    except (ValueError, struct.error):
        return "a record body that does not decode"
    if record.seq <= previous_seq:
        return f"sequence number {record.seq} after {previous_seq}"
    return record


def _next_intact(data: bytes, start: int, previous_seq: int) -> int:
    """The offset of the first intact frame after ``start`` (-1: none).

    Every record names its method right after its fixed header, so the candidates are the
    places a known method name appears: this costs a few ``bytes.find`` passes, not a CRC at
    every byte offset.
    """
    best = -1
    for method in RECORD_METHODS:
        name = method.encode()
        tag = _U16.pack(len(name)) + name
        found = data.find(tag, start + 1 + _METHOD_AT)
        while found != -1 and (best == -1 or found - _METHOD_AT < best):
            frame = found - _METHOD_AT
            if isinstance(_frame_at(data, frame, previous_seq), JournalRecord):
                best = frame
                break
            found = data.find(tag, found + 1)
    return best


def _records_after(data: bytes, start: int, previous_seq: int) -> list[JournalRecord]:
    """Every intact record found after a damaged frame at ``start``."""
    found: list[JournalRecord] = []
    at = _next_intact(data, start, previous_seq)
    while at != -1:
        record = _frame_at(data, at, previous_seq)
        if isinstance(record, JournalRecord):
            found.append(record)
            previous_seq = record.seq
            at += _FRAME.size + _FRAME.unpack_from(data, at)[0]
            if at == len(data):
                break
        else:
            at = _next_intact(data, at, previous_seq)
    return found


def scan_journal(data: bytes) -> JournalScan:
    """Read a journal's bytes: its intact records and the first damage, classified.

    A *torn tail* is the last record left incomplete by a crash while it was written; its
    call was never answered (an answer waits for the fsync of the whole record). Precisely,
    the first frame that is not an intact record, at offset ``intact``, is a torn tail when

    * fewer than 8 bytes (a frame header) are left, or
    * its header's body length reaches past the end of the file, and no intact record
      starts anywhere after it (a damaged length field in the middle would otherwise hide
      every record after it), or
    * its body ends exactly at the end of the file (it is the last frame) and fails its
      CRC-32 or does not decode.

    Anything else (a bad CRC or a broken body with bytes after it, sequence numbers out of
    order, garbage) is damage that must not be dropped silently: ``scan.damaged`` is true and
    ``scan.after`` lists the intact records found after it.
    """
    scan = JournalScan(size=len(data))
    at = 0
    previous = 0
    while at < len(data):
        record = _frame_at(data, at, previous)
        if isinstance(record, str):
            scan.damage = record
            break
        scan.records.append(record)
        previous = record.seq
        at += _FRAME.size + _FRAME.unpack_from(data, at)[0]
    scan.intact = at
    if scan.damage is None:
        return scan
    left = len(data) - at
    if left < _FRAME.size:
        scan.torn = True
        return scan
    size, _ = _FRAME.unpack_from(data, at)
    end = at + _FRAME.size + size
    scan.after = _records_after(data, at, previous)
    if end > len(data):
        scan.torn = not scan.after
    elif end == len(data):
        scan.torn = not scan.after and scan.damage in (
            "a CRC-32 mismatch",
            "a record body that does not decode",
        )
    return scan


def read_journal(path: Path) -> JournalScan:
    """:func:`scan_journal` of the file at ``path`` (an empty scan when there is none)."""
    if not path.exists():
        return JournalScan()
    return scan_journal(path.read_bytes())


def damage_message(path: Path, scan: JournalScan) -> str:
    """One line saying where and how ``path`` is damaged and what a start would lose."""
    last = scan.records[-1].seq if scan.records else 0
    after = scan.after
    lost = (
        f"{len(after)} intact records (seq {after[0].seq}..{after[-1].seq}) follow it"
        if after
        else "no intact record follows it"
    )
    return (
        f"data_dir: {path} is damaged at byte {scan.intact} of {scan.size} ({scan.damage}, "
        f"after record seq {last}); {lost}. Nothing was changed: inspect it with "
        f"'kvcm data-dir check {path.parent}', and only to drop everything from byte "
        f"{scan.intact} on run 'kvcm data-dir recover {path.parent} --drop-after-damage'"
    )


def read_records(path: Path) -> tuple[list[JournalRecord], int]:
    """The intact records of a journal file and the byte length they span.

    Raises:
        JournalDamagedError: Damage other than a torn tail.
    """
    scan = read_journal(path)
    if scan.damaged:
        raise JournalDamagedError(damage_message(path, scan))
    return scan.records, scan.intact


# --- checkpoints -------------------------------------------------------------------------------


def _fault(operation: str) -> None:
    """The test hook (module docstring): raise the configured error for ``operation``."""
    path = os.environ.get(FAULT_ENV)
    if not path:
        return
    try:
        with open(path) as spec:
            words = spec.read().split()
    except OSError:
        return  # no fault file: the disk is fine
    if len(words) != 2 or words[0] not in (operation, "any"):
        return
    code = getattr(errno, words[1], errno.EIO)
    raise OSError(code, f"{os.strerror(code)} (injected by {FAULT_ENV})")


def write_checkpoint(directory: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` atomically (temporary file, fsync, rename, fsync the directory).

    Raises:
        OSError: It could not be written (the previous checkpoint is left as it was).
    """
    parts = [struct.pack("<QQI", checkpoint.seq, checkpoint.registry_epoch, len(checkpoint.pools))]
    for pool in checkpoint.pools:
        name = pool.pool_id.encode()
        parts.append(struct.pack("<H", len(name)) + name)
        parts.append(struct.pack("<I", len(pool.config)) + pool.config)
        parts.append(struct.pack("<QQ", pool.epoch, len(pool.snapshot)) + pool.snapshot)
    numbering = checkpoint.kv_event_numbering
    parts.append(struct.pack("<Q", len(numbering)) + numbering)
    parts.append(struct.pack("<Q", len(checkpoint.transfers)) + checkpoint.transfers)
    body = b"".join(parts)
    header = _CHECKPOINT_MAGIC + struct.pack("<II", _CHECKPOINT_VERSION, zlib.crc32(body))
    temporary = directory / (CHECKPOINT_FILE + ".tmp")
    try:
        with temporary.open("wb") as out:
            _fault("write")
            out.write(header)
            out.write(body)
            out.flush()
            _fault("fsync")
            os.fsync(out.fileno())
    except OSError:
        temporary.unlink(missing_ok=True)  # a partial file would only take space
        raise
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
    if version not in (1, 2, _CHECKPOINT_VERSION) or zlib.crc32(body) != crc:
        raise ConfigError(f"data_dir: {path} is damaged or of version {version}")
    try:
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
        numbering = b""
        if version >= 2:
            (size,) = struct.unpack_from("<Q", body, at)
            numbering = body[at + 8 : at + 8 + size]
            at += 8 + size
        transfers = b""
        if version >= 3:
            (size,) = struct.unpack_from("<Q", body, at)
            transfers = body[at + 8 : at + 8 + size]
            at += 8 + size
    except (struct.error, UnicodeDecodeError) as exc:
        raise ConfigError(f"data_dir: {path} is damaged (its pool table: {exc})") from None
    if at != len(body):
        raise ConfigError(f"data_dir: {path} is damaged ({len(body) - at} bytes after its pools)")
    return Checkpoint(seq, registry_epoch, tuple(pools), numbering, transfers)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _os_reason(action: str, path: Path, exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "error")
    return f"the journal cannot {action} {path}: {exc.strerror or exc} ({name})"


def iter_voided(records: list[JournalRecord]) -> Iterator[int]:
    """The sequence numbers the ``Void`` records among ``records`` void."""
    for record in records:
        if record.method == VOID:
            yield from record.voided()
