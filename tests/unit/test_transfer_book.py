"""The transfer book (kvcm.server.transfers): the state machine, retries, counters, limits."""

from __future__ import annotations

import dataclasses

import pytest

from kvcm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    NotFoundError,
    ResourceExhaustedError,
)
from kvcm.server import transfers
from kvcm.server.transfers import TransferBook, TransferRecord, TransferState


def _record(transfer_id: str, key: int = 1, *, record_only: bool = False) -> TransferRecord:
    return TransferRecord(
        pool_id="p",
        transfer_id=transfer_id,
        record_only=record_only,
        request_key=key,
        request_id=str(key),
        num_tokens=100,
        source_blocks=((1, 2, 3, 4, 5, 6, 7),),
        lease_s=10.0,
        block_size=16,
    )


def test_a_managed_transfer_runs_hold_plan_commit_once_whatever_the_retries() -> None:
    book = TransferBook()
    assert book.hold(_record("t"), now=0.0, wall=100.0).changed
    assert not book.hold(_record("t"), now=1.0, wall=101.0).changed  # the retry
    planned = book.plan("p", "t", destination_pool_id="d", hit_tokens=48, pull_tokens=52, now=2.0)
    assert planned.changed
    assert (planned.record.hit_blocks, planned.record.pull_blocks) == (3, 4)
    assert planned.record.deadline() == 12.0  # renewed by the plan
    again = book.plan("p", "t", destination_pool_id="d", hit_tokens=0, pull_tokens=100, now=3.0)
    assert not again.changed
    assert (again.record.hit_tokens, again.record.pull_tokens) == (48, 52)  # the first plan
    done = book.commit("p", "t", None, wall=105.0)
    assert (done.changed, done.give_back) == (True, True)
    assert done.record.blocks_pulled == 4
    retried = book.commit("p", "t", 1, wall=106.0)
    assert (retried.changed, retried.give_back) == (False, False)
    assert retried.record.blocks_pulled == 4
    for ended in (
        book.release("p", "t", "late", wall=107.0),
        book.expire("p", "t", "late", wall=107.0, source_freed=False),
    ):
        assert (ended.changed, ended.give_back, ended.record.state) == (
            False,
            False,
            TransferState.COMPLETED,
        )
    assert book.counters["p"] == {
        "started": 1,
        "completed": 1,
        "expired": 0,
        "failed": 0,
        "blocks_pulled": 4,
        "blocks_saved": 3,
    }


def test_refusals_name_what_is_wrong_and_change_nothing() -> None:
    book = TransferBook()
    book.hold(_record("t", key=1), now=0.0, wall=0.0)
    with pytest.raises(AlreadyExistsError, match="transfer_id"):
        book.hold(_record("t", key=2), now=0.0, wall=0.0)
    with pytest.raises(AlreadyExistsError, match="request_key: 1 is held"):
        book.hold(_record("u", key=1), now=0.0, wall=0.0)
    with pytest.raises(NotFoundError, match="transfer_id"):
        book.plan("p", "zz", destination_pool_id="d", hit_tokens=0, pull_tokens=1, now=0.0)
    with pytest.raises(FailedPreconditionError, match="PlanTransfer first"):
        book.commit("p", "t", None, wall=0.0)
    book.plan("p", "t", destination_pool_id="d", hit_tokens=0, pull_tokens=100, now=0.0)
    with pytest.raises(FailedPreconditionError, match="planned against pool 'd'"):
        book.plan("p", "t", destination_pool_id="e", hit_tokens=0, pull_tokens=100, now=0.0)
    book.release("p", "t", "gone", wall=1.0)
    with pytest.raises(FailedPreconditionError, match="RELEASED"):
        book.commit("p", "t", None, wall=2.0)
    # Released: the request may be held again by a new transfer.
    assert book.hold(_record("u", key=1), now=3.0, wall=3.0).changed
    assert book.counters["p"]["failed"] == 1


def test_record_only_expiry_only_marks_and_the_engine_keeps_authority() -> None:
    book = TransferBook()
    book.hold(_record("r", record_only=True), now=0.0, wall=0.0)
    expired = book.expire("p", "r", "lease", wall=11.0, source_freed=False)
    assert (expired.record.state, expired.give_back) == (TransferState.EXPIRED, False)
    assert expired.record.holds_source  # kvcm only marked it: the engine may still hold it
    # The engine's late plan and completion still move it on, and never give anything back.
    book.plan("p", "r", destination_pool_id="d", hit_tokens=16, pull_tokens=84, now=12.0)
    done = book.commit("p", "r", 6, wall=13.0)
    assert (done.record.state, done.give_back) == (TransferState.COMPLETED, False)
    assert not done.record.holds_source
    # A hold the engine freed itself before anyone planned it: EXPIRED, held no more.
    book.hold(_record("s", key=2, record_only=True), now=0.0, wall=0.0)
    freed = book.expire("p", "s", "freed", wall=1.0, source_freed=True)
    assert (freed.record.state, freed.record.holds_source) == (TransferState.EXPIRED, False)
    counters = book.counters["p"]
    assert (counters["expired"], counters["completed"], counters["failed"]) == (2, 1, 0)


def test_samples_by_pool_and_leases_moved_by_a_stall() -> None:
    book = TransferBook()
    book.hold(_record("a", key=1), now=0.0, wall=1000.0)
    book.hold(_record("b", key=2), now=5.0, wall=1005.0)
    samples = book.samples(now=12.0, wall=1012.0)
    assert samples["kvcm_transfers_in_flight"] == [(["p"], 2)]
    assert samples["kvcm_transfers_past_lease"] == [(["p"], 1)]  # a's deadline was 10
    assert samples["kvcm_transfer_oldest_source_age_seconds"] == [(["p"], 12.0)]
    book.extend(stall_s=4.0, now=12.0)  # the server stalled: nobody could call
    assert book.samples(now=12.0, wall=1012.0)["kvcm_transfers_past_lease"] == [(["p"], 0)]


def test_in_flight_and_ended_records_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "MAX_TRANSFERS_IN_FLIGHT", 3)
    monkeypatch.setattr(transfers, "MAX_ENDED_TRANSFERS", 2)
    book = TransferBook()
    for key in range(3):
        book.hold(_record(f"t{key}", key=key), now=0.0, wall=0.0)
    with pytest.raises(ResourceExhaustedError, match="3 transfers are in flight"):
        book.hold(_record("t9", key=9), now=0.0, wall=0.0)
    for key in range(3):
        book.release("p", f"t{key}", "", wall=float(key))
    assert sorted(t for _, t in book.records) == ["t1", "t2"]  # the oldest ended one dropped
    book.hold(_record("t9", key=9), now=0.0, wall=0.0)
    restored = TransferBook()
    for record in book.records.values():
        restored.restore(dataclasses.replace(record), now=50.0)
    assert restored.holder_of("p", 9) is not None
    assert restored.records[("p", "t9")].deadline() == 60.0  # a whole lease after a restart


def test_dropping_a_pool_forgets_its_records_in_flight_and_ended_and_no_other() -> None:
    """A standby's copy replaced by a seed: the pool's records go, the seed's come back."""
    book = TransferBook()
    book.hold(_record("held", 1), now=0.0, wall=100.0)
    book.hold(_record("ended", 2), now=0.0, wall=100.0)
    book.release("p", "ended", "gone", wall=101.0)
    other = dataclasses.replace(_record("kept", 1), pool_id="q")
    book.hold(other, now=0.0, wall=100.0)
    book.drop_pool("p")
    assert list(book.records) == [("q", "kept")]
    assert book.holder_of("p", 1) is None
    assert book.holder_of("q", 1) is other
    assert [r.transfer_id for r in book.in_flight()] == ["kept"]
    with pytest.raises(NotFoundError, match="'held'"):
        book.get("p", "held")
    # The seed's records restored in their place: the same ids, as the primary has them.
    restored = _record("held", 1)
    book.restore(restored, now=5.0)
    assert book.holder_of("p", 1) is restored
    assert book.hold(_record("ended", 2), now=6.0, wall=106.0).changed  # a new transfer
