"""``kvcm data-dir check|recover``: verify a data directory offline, and cut a damaged journal.

``check`` reads the checkpoint (frame, CRC, pool table, and every pool's config and snapshot
decoded as a start decodes them), the journal (every record's frame and CRC, in order) and a
cluster replica's ``replication.json`` (its pools' roles and placement epochs, read as a start
reads them), and says whether a server would start on it: ``ok``, ``torn_tail`` (the last
record was left incomplete by a crash; a start trims it) or ``damaged`` (a start is refused;
nothing is changed). ``recover --drop-after-damage`` cuts the journal at its damage, after
saving the bytes it drops beside it, and says exactly what it dropped: records, sequence range,
bytes. It never runs unasked, and never touches a damaged checkpoint (only a backup can replace
that) nor ``replication.json``.

Run both on a stopped server's directory. See docs/durability.md.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcm.common.errors import KVCMError
from kvcm.server.journal import (
    CHECKPOINT_FILE,
    JOURNAL_FILE,
    Checkpoint,
    JournalScan,
    iter_voided,
    read_checkpoint,
    scan_journal,
)

__all__ = ["DataDirReport", "check_data_dir", "recover_data_dir"]

# A cluster replica's pools' roles and placement epochs (kvcm.server.cluster.replication's
# STATE_FILE; named here so that reading a directory's report imports no cluster code).
STATE_FILE = "replication.json"

OK = "ok"
TORN_TAIL = "torn_tail"
DAMAGED = "damaged"


@dataclass(slots=True)
class DataDirReport:
    """What :func:`check_data_dir` found.

    Attributes:
        data_dir: The directory.
        status: ``ok``, ``torn_tail`` (a start trims the last record) or ``damaged`` (a start
            is refused).
        checkpoint: The checkpoint's findings (``present``, ``error``, ``seq``, ``pools``).
        journal: The journal's findings (``records``, sequence range, ``damage``).
        replication: ``replication.json``'s findings (``present``, ``error``, ``pools``: each
            pool's role and placement epoch); a lone server has none.
        leftovers: Temporary files an interrupted write left (ignored by a start).
    """

    data_dir: str
    status: str = OK
    checkpoint: dict[str, Any] = field(default_factory=dict)
    journal: dict[str, Any] = field(default_factory=dict)
    replication: dict[str, Any] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON values."""
        return {
            "data_dir": self.data_dir,
            "status": self.status,
            "checkpoint": self.checkpoint,
            "journal": self.journal,
            "replication": self.replication,
            "leftovers": self.leftovers,
        }

    def lines(self) -> list[str]:
        """The report as lines of text."""
        out = [f"data directory {self.data_dir}: {self.status}"]
        cp = self.checkpoint
        if not cp["present"]:
            out.append(f"  {CHECKPOINT_FILE}: none")
        elif cp["error"]:
            out.append(f"  {CHECKPOINT_FILE}: DAMAGED: {cp['error']}")
        else:
            out.append(
                f"  {CHECKPOINT_FILE}: ok, seq {cp['seq']}, {len(cp['pools'])} pools, "
                f"{cp['bytes']} bytes"
            )
        for pool in cp.get("pools", []):
            state = f"DAMAGED: {pool['error']}" if pool["error"] else "ok"
            out.append(
                f"    pool {pool['pool_id']!r} epoch {pool['epoch']}: snapshot "
                f"{pool['snapshot_bytes']} bytes, {state}"
            )
        jr = self.journal
        if not jr["present"]:
            out.append(f"  {JOURNAL_FILE}: none")
        else:
            span = f"seq {jr['first_seq']}..{jr['last_seq']}" if jr["records"] else "empty"
            out.append(
                f"  {JOURNAL_FILE}: {jr['records']} intact records ({span}), "
                f"{jr['intact_bytes']} of {jr['bytes']} bytes; {jr['voided']} voided, "
                f"{jr['in_checkpoint']} already in the checkpoint"
            )
        damage = jr.get("damage")
        if damage:
            kind = "torn tail (a start trims it)" if damage["torn"] else "DAMAGE (start refused)"
            out.append(
                f"  {kind} at byte {damage['offset']}: {damage['reason']}; "
                f"{damage['bytes_dropped']} bytes from there on"
            )
            if damage["records_after"]:
                first, last = damage["seq_after"]
                out.append(
                    f"  {damage['records_after']} intact records after it (seq {first}..{last}) "
                    "would be lost by cutting there"
                )
        rp = self.replication
        if not rp["present"]:
            out.append(f"  {STATE_FILE}: none (no cluster roles)")
        elif rp["error"]:
            out.append(f"  {STATE_FILE}: DAMAGED: {rp['error']}")
        else:
            roles = collections.Counter(pool["role"] for pool in rp["pools"])
            counts = ", ".join(f"{count} {role}" for role, count in sorted(roles.items()))
            out.append(f"  {STATE_FILE}: ok, {len(rp['pools'])} pools ({counts or 'none'})")
        for name in self.leftovers:
            out.append(f"  leftover {name} (an interrupted write; ignored, may be removed)")
        return out


def _check_checkpoint(directory: Path) -> tuple[dict[str, Any], Checkpoint | None]:
    from kvcm.core.limits import DEFAULT_LIMITS
    from kvcm.core.snapshot import decode_pool
    from kvcm.v1 import admin_pb2
    from kvcm.wire import pool_config_from_proto

    path = directory / CHECKPOINT_FILE
    found: dict[str, Any] = {"file": str(path), "present": path.exists(), "error": None}
    if not found["present"]:
        return found, None
    found["bytes"] = path.stat().st_size
    try:
        checkpoint = read_checkpoint(directory)
    except KVCMError as exc:
        found["error"] = str(exc)
        return found, None
    assert checkpoint is not None
    found["seq"] = checkpoint.seq
    pools = []
    for saved in checkpoint.pools:
        error = None
        try:
            options = pool_config_from_proto(admin_pb2.PoolConfig.FromString(saved.config))
            if saved.snapshot:
                decode_pool(saved.snapshot, saved.pool_id, options, limits=DEFAULT_LIMITS)
        except Exception as exc:  # every way a snapshot can be refused is reported
            error = f"{type(exc).__name__}: {exc}"
        pools.append(
            {
                "pool_id": saved.pool_id,
                "epoch": saved.epoch,
                "snapshot_bytes": len(saved.snapshot),
                "error": error,
            }
        )
    found["pools"] = pools
    if any(pool["error"] for pool in pools):
        found["error"] = "pools that do not decode: " + ", ".join(
            repr(pool["pool_id"]) for pool in pools if pool["error"]
        )
    return found, checkpoint


def _check_replication(directory: Path) -> dict[str, Any]:
    from kvcm.common.errors import ConfigError
    from kvcm.server.cluster.replication import read_state

    path = directory / STATE_FILE
    found: dict[str, Any] = {"file": str(path), "present": path.exists(), "error": None}
    if not found["present"]:
        return found
    try:
        entries = read_state(path.read_bytes(), path)
    except ConfigError as exc:
        found["error"] = str(exc).removeprefix("data_dir: ")
        return found
    except OSError as exc:
        found["error"] = f"cannot read {path}: {exc.strerror or exc}"
        return found
    found["pools"] = [
        {"pool_id": entry.pool_id, "role": entry.role.value, "epoch": entry.epoch}
        for entry in sorted(entries, key=lambda entry: entry.pool_id)
    ]
    return found


def _journal_findings(path: Path, scan: JournalScan, checkpoint_seq: int) -> dict[str, Any]:
    records = scan.records
    found: dict[str, Any] = {
        "file": str(path),
        "present": path.exists(),
        "bytes": scan.size,
        "intact_bytes": scan.intact,
        "records": len(records),
        "first_seq": records[0].seq if records else None,
        "last_seq": records[-1].seq if records else None,
        "voided": len(set(iter_voided(records))),
        "in_checkpoint": sum(1 for record in records if record.seq <= checkpoint_seq),
        "damage": None,
    }
    if scan.damage is not None:
        after = scan.after
        found["damage"] = {
            "offset": scan.intact,
            "reason": scan.damage,
            "torn": scan.torn,
            "bytes_dropped": scan.size - scan.intact,
            "records_after": len(after),
            "seq_after": [after[0].seq, after[-1].seq] if after else None,
        }
    return found


def check_data_dir(path: str) -> tuple[DataDirReport, JournalScan]:
    """Verify the data directory at ``path`` without changing it.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"{path}: not a directory")
    report = DataDirReport(data_dir=str(directory))
    report.checkpoint, checkpoint = _check_checkpoint(directory)
    journal_path = directory / JOURNAL_FILE
    scan = scan_journal(journal_path.read_bytes()) if journal_path.exists() else JournalScan()
    seq = checkpoint.seq if checkpoint is not None else 0
    report.journal = _journal_findings(journal_path, scan, seq)
    report.replication = _check_replication(directory)
    report.leftovers = sorted(
        name
        for name in (CHECKPOINT_FILE + ".tmp", JOURNAL_FILE + ".tmp", STATE_FILE + ".tmp")
        if (directory / name).exists()
    )
    if report.checkpoint["error"] or scan.damaged or report.replication["error"]:
        report.status = DAMAGED
    elif scan.torn:
        report.status = TORN_TAIL
    return report, scan


def recover_data_dir(path: str, *, drop_after_damage: bool) -> tuple[DataDirReport, list[str]]:
    """Cut the journal at its damage (only with ``drop_after_damage``).

    Returns the report of the directory as it was and lines saying what was done. The bytes
    dropped are first saved to ``journal.log.dropped-<offset>`` and fsynced.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        PermissionError: Asked to drop nothing (``drop_after_damage`` false) while there is
            damage: the lines say what would be dropped.
    """
    report, scan = check_data_dir(path)
    directory = Path(report.data_dir)
    if report.checkpoint["error"]:
        return report, [
            f"cannot recover: {CHECKPOINT_FILE} is damaged ({report.checkpoint['error']}); "
            "only a backup can replace it. Nothing was changed."
        ]
    note = ""
    if report.replication["error"]:
        note = (
            f"{STATE_FILE} is damaged ({report.replication['error']}): recover never changes "
            "it; a start stays refused until it is replaced (docs/cluster.md)."
        )
        if scan.damage is None:
            return report, [note + " Nothing was changed."]
    if scan.damage is None:
        return report, ["nothing to recover: the journal is intact. Nothing was changed."]
    damage = report.journal["damage"]
    journal_path = directory / JOURNAL_FILE
    what = (
        f"{damage['records_after']} intact records"
        + (
            f" (seq {damage['seq_after'][0]}..{damage['seq_after'][1]})"
            if damage["seq_after"]
            else ""
        )
        + f" and {damage['bytes_dropped']} bytes from byte {damage['offset']} of {journal_path}"
    )
    if not drop_after_damage:
        raise PermissionError(
            f"would drop {what}; pass --drop-after-damage to drop them. Nothing was changed."
        )
    saved = directory / f"{JOURNAL_FILE}.dropped-{damage['offset']}"
    data = journal_path.read_bytes()
    with saved.open("wb") as out:
        out.write(data[scan.intact :])
        out.flush()
        os.fsync(out.fileno())
    with journal_path.open("r+b") as out:
        out.truncate(scan.intact)
        os.fsync(out.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    kept = report.journal["records"]
    return report, [
        f"dropped {what} ({damage['reason']}); saved them to {saved}",
        f"kept {kept} records"
        + (f" (seq {report.journal['first_seq']}..{report.journal['last_seq']})" if kept else "")
        + ": a start now replays those",
        *([note] if note else []),
    ]
