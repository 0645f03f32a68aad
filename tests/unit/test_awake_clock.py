"""The awake clock leases read: a stall of the server moves every lease deadline later."""

from __future__ import annotations

import pytest

from kvcm.core.pool import PoolRegistry
from kvcm.server.rpc import ServerState
from kvcm.server.rpc._state import AwakeClock
from kvcm.server.telemetry import RpcStats


class _FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_beats_on_time_are_no_stall_and_a_gap_is_one() -> None:
    fake = _FakeClock()
    clock = AwakeClock(fake, beat_s=0.1, tolerance_s=0.05)
    for _ in range(50):
        fake.t += 0.14  # late beats within the tolerance
        clock.now()
    assert clock.stalls == 0
    assert clock.awake() == pytest.approx(fake.t)
    fake.t += 5.0  # paused
    clock.now()
    assert clock.stalls == 1
    assert clock.stalled_s == pytest.approx(4.9)
    assert clock.awake() == pytest.approx(fake.t - 4.9)


def test_a_stall_extends_scheduler_and_transfer_leases_never_past_now() -> None:
    fake = _FakeClock()
    state = ServerState(
        registry=PoolRegistry(), rpc_stats=RpcStats(), clock=AwakeClock(fake, beat_s=0.1)
    )
    state.activity.update({"old": 90.0, "recent": 100.0})
    request = object()
    state.transfers[("old", 1)] = (95.0, request)
    fake.t += 0.05
    state.clock.now()
    fake.t += 3.0  # the loop was blocked: a 2.9 s stall (3 s less one beat)
    state.activity["called-after"] = state.clock.now()  # the call that saw the stall
    assert state.activity["old"] == pytest.approx(92.9)
    assert state.activity["recent"] == pytest.approx(102.9)
    assert state.activity["called-after"] == pytest.approx(103.05)
    assert state.transfers[("old", 1)] == (pytest.approx(97.9), request)
    fake.t += 0.1
    state.clock.now()  # an ordinary beat moves nothing
    assert state.activity["old"] == pytest.approx(92.9)
