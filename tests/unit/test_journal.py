"""The journal file on its own: which damage is a torn tail, and what a failed write leaves.

Real files in a temporary directory; failures come from the journal's documented test hook
(``KVCM_JOURNAL_FAULT_FILE``), the integration tests add a real full filesystem.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from kvcm.server.journal import (
    FAULT_ENV,
    JOURNAL_FILE,
    Journal,
    JournalRecord,
    JournalUnavailableError,
    _encode_record,
    scan_journal,
)


def _journal(count: int) -> tuple[bytes, list[int]]:
    """``count`` Step records and the offset of each."""
    data = b""
    offsets = []
    for seq in range(1, count + 1):
        offsets.append(len(data))
        data += _encode_record(JournalRecord(seq, 1.5, "Step", "p", bytes([seq]) * (seq * 7)))
    return data, offsets


def test_an_intact_journal() -> None:
    data, _ = _journal(5)
    scan = scan_journal(data)
    assert [r.seq for r in scan.records] == [1, 2, 3, 4, 5]
    assert (scan.intact, scan.damage, scan.torn, scan.damaged) == (len(data), None, False, False)


@pytest.mark.parametrize(
    "tail",
    [b"\x01\x02\x03", _encode_record(JournalRecord(6, 0.0, "Step", "p", b"x" * 40))[:-9]],
    ids=["partial header", "partial frame"],
)
def test_an_incomplete_last_frame_is_a_torn_tail(tail: bytes) -> None:
    data, _ = _journal(5)
    scan = scan_journal(data + tail)
    assert scan.torn
    assert not scan.damaged
    assert scan.intact == len(data)
    assert len(scan.records) == 5


def test_a_last_record_that_fails_its_crc_is_a_torn_tail() -> None:
    data, offsets = _journal(5)
    broken = bytearray(data)
    broken[-1] ^= 0xFF
    scan = scan_journal(bytes(broken))
    assert scan.torn
    assert scan.intact == offsets[4]
    assert scan.damage == "a CRC-32 mismatch"


def test_a_bad_crc_in_the_middle_is_damage_with_the_records_after_it() -> None:
    data, offsets = _journal(10)
    broken = bytearray(data)
    broken[offsets[3] + 12] ^= 0x01  # record 4's body
    scan = scan_journal(bytes(broken))
    assert scan.damaged
    assert scan.intact == offsets[3]
    assert [r.seq for r in scan.records] == [1, 2, 3]
    assert [r.seq for r in scan.after] == [5, 6, 7, 8, 9, 10]


def test_a_length_that_runs_past_the_end_hides_no_record() -> None:
    data, offsets = _journal(10)
    broken = bytearray(data)
    struct.pack_into("<I", broken, offsets[6], 1 << 30)
    scan = scan_journal(bytes(broken))
    assert scan.damaged
    assert [r.seq for r in scan.after] == [8, 9, 10]


def test_sequence_numbers_out_of_order_are_damage() -> None:
    data, _ = _journal(3)
    again = _encode_record(JournalRecord(2, 0.0, "Step", "p", b"dup"))
    scan = scan_journal(data + again)
    assert scan.damaged
    assert scan.damage == "sequence number 2 after 3"


def test_zeros_after_the_records_are_damage_unless_they_are_the_last_frame() -> None:
    data, _ = _journal(3)
    assert scan_journal(data + b"\0" * 8).torn  # one empty frame, at the end
    assert scan_journal(data + b"\0" * 64).damaged


def _run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_a_refused_write_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, str(switch))

    async def scenario() -> None:
        journal = Journal(tmp_path, 0)
        first = journal.write_ahead("Step", "p", b"one", 1.0)
        await journal.commit(first.seq)
        journal.finish(first)
        size = (tmp_path / JOURNAL_FILE).stat().st_size
        switch.write_text("write ENOSPC")
        with pytest.raises(JournalUnavailableError, match="No space left on device"):
            journal.write_ahead("Step", "p", b"two", 2.0)
        assert (tmp_path / JOURNAL_FILE).stat().st_size == size
        assert journal.last_seq == 1
        switch.unlink()
        second = journal.write_ahead("Step", "p", b"two", 2.0)
        await journal.commit(second.seq)
        journal.finish(second)
        journal.close()

    _run(scenario())
    scan = scan_journal((tmp_path / JOURNAL_FILE).read_bytes())
    assert [(r.seq, r.request) for r in scan.records] == [(1, b"one"), (2, b"two")]


def test_a_failed_fsync_cuts_every_record_it_covered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, str(switch))

    async def scenario() -> None:
        journal = Journal(tmp_path, 0)
        kept = journal.write_ahead("Step", "p", b"kept", 1.0)
        await journal.commit(kept.seq)
        journal.finish(kept)
        switch.write_text("fsync EIO")
        lost = [journal.write_ahead("Step", pool, b"lost", 2.0) for pool in ("p", "q")]
        for ticket in lost:
            with pytest.raises(JournalUnavailableError, match="Input/output error"):
                await journal.commit(ticket.seq)
            journal.finish(ticket)
        switch.unlink()
        after = journal.write_ahead("Step", "p", b"after", 3.0)
        await journal.commit(after.seq)
        journal.finish(after)
        journal.close()

    _run(scenario())
    scan = scan_journal((tmp_path / JOURNAL_FILE).read_bytes())
    assert not scan.damage
    assert [(r.seq, r.request) for r in scan.records] == [(1, b"kept"), (4, b"after")]


def test_calls_on_a_pool_wait_for_the_earlier_ones(tmp_path: Path) -> None:
    async def scenario() -> None:
        journal = Journal(tmp_path, 0)
        first = journal.write_ahead("Step", "p", b"1", 1.0)
        other = journal.write_ahead("Step", "q", b"2", 1.0)
        second = journal.write_ahead("Step", "p", b"3", 1.0)
        create = journal.write_ahead("CreatePool", "r", b"4", 1.0)
        delete = journal.write_ahead("DeletePool", "s", b"5", 1.0)
        assert second.waits == [first.done]
        assert other.waits == []
        assert delete.waits == [create.done]  # pools come and go in journal order
        stale = journal.write_ahead("Step", "p", b"6", 1.0)
        for ticket in (first, other, second, create, delete):
            await journal.commit(ticket.seq)
            ticket.started = True
            journal.finish(ticket)
        journal.append("Step", "p", b"lease reclaim", 2.0)  # a change made without a call
        assert stale.void_reason is not None
        journal.finish(stale)
        journal.close()

    _run(scenario())
    records = scan_journal((tmp_path / JOURNAL_FILE).read_bytes()).records
    assert [(r.method, r.voided() if r.method == "Void" else r.seq) for r in records[-2:]] == [
        ("Void", [6]),
        ("Step", 8),
    ]


@pytest.mark.parametrize("fault", ["write ENOSPC", "fsync EIO"])
def test_the_record_of_a_change_already_made_is_never_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """A lease reclaim (or a planning round) changed a pool before its record was written:
    while the disk refuses the record it is kept, written before any later record, and its
    commit returns once it is durable; calls written meanwhile fail and change nothing."""
    switch = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, str(switch))

    async def scenario() -> None:
        journal = Journal(tmp_path, 0)
        switch.write_text(fault)
        change = journal.append("Step", "p", b"reclaim", 1.0)
        committed = asyncio.ensure_future(journal.commit(change))
        await asyncio.sleep(0.05)

        async def call() -> None:
            ticket = journal.write_ahead("Step", "q", b"refused", 2.0)
            await journal.commit(ticket.seq)

        with pytest.raises(JournalUnavailableError):
            await call()
        assert not committed.done()
        switch.unlink()
        await asyncio.wait_for(committed, 5)
        later = journal.write_ahead("Step", "q", b"later", 3.0)
        await journal.commit(later.seq)
        journal.finish(later)
        journal.close()

    _run(scenario())
    records = scan_journal((tmp_path / JOURNAL_FILE).read_bytes()).records
    assert [r.request for r in records] == [b"reclaim", b"later"]


def test_a_call_that_failed_early_lets_no_later_call_overtake_a_running_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, str(switch))

    async def scenario() -> None:
        journal = Journal(tmp_path, 0)
        running = journal.write_ahead("ResyncPool", "p", b"long", 1.0)
        await journal.commit(running.seq)
        running.started = True  # its handler is still at work (decoding, in a lane)
        switch.write_text("fsync EIO")
        failed = journal.write_ahead("Step", "p", b"failed", 2.0)
        with pytest.raises(JournalUnavailableError):
            await journal.commit(failed.seq)
        journal.finish(failed)
        switch.unlink()
        later = journal.write_ahead("Step", "p", b"later", 3.0)
        await journal.commit(later.seq)
        turn = asyncio.gather(*later.waits)
        await asyncio.sleep(0.05)
        assert not turn.done()  # it waits for the call still running
        journal.finish(running)
        await asyncio.wait_for(turn, 1)
        journal.finish(later)
        journal.close()

    _run(scenario())
