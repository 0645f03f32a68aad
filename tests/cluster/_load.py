"""Load for the cluster tests: SDK scheduler threads driving ``program(1..)`` exactly once
through a seed list, and KV-event readers that follow a pool's stream across failovers and
moves (tests/integration's data-directory programs and replay)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvcm.client import RetryPolicy, SchedulerClient

_TESTS = Path(__file__).resolve().parent.parent
for _folder in ("integration", "compat"):
    if str(_TESTS / _folder) not in sys.path:
        sys.path.insert(0, str(_TESTS / _folder))

from _data_dir_server import CONFIG, program  # noqa: E402
from _replication import assert_pool_matches, expected_pool  # noqa: E402

__all__ = ["CONFIG", "Driver", "Reader", "assert_pool_matches", "expected_pool"]


class Driver:
    """One SDK scheduler thread: ``program(1..)`` on its pool through the seed list, each
    program resent (same ``step_seq``) until acknowledged; ``acks[seq]`` is when the call that
    was acknowledged had been sent and when its answer came."""

    def __init__(self, seeds: str, pool_id: str) -> None:
        self.seeds = seeds
        self.pool_id = pool_id
        self.acks: dict[int, tuple[float, float]] = {}
        self.errors = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        seq = 1
        # A scheduler that wants a fast failover retries its idempotent Steps with short
        # backoffs (the default's randomized bound grows to 1 s): the measured failover is then
        # the cluster's (lease expiry, etcd transaction, promotion), not the client's sleep.
        fast = RetryPolicy(max_attempts=5, initial_backoff_s=0.02, max_backoff_s=0.05)
        with SchedulerClient(self.seeds, timeout=3.0, retry_policy=fast) as client:
            while not self.stopping.is_set():
                sent = time.monotonic()
                try:
                    client.step(self.pool_id, program(seq))
                except Exception:  # a dead replica, a promotion under way: the same program again
                    self.errors += 1
                    time.sleep(0.05)
                    continue
                self.acks[seq] = (sent, time.monotonic())
                seq += 1
                time.sleep(0.01)  # an engine's step cadence, about

    def served_after(self, moment: float) -> float | None:
        """When the first program sent after ``moment`` was acknowledged."""
        # A copy first (one C call under the GIL): the scheduler thread adds to ``acks``
        # meanwhile, and iterating the dict itself failed once in a 30-kill run.
        times = [acked for sent, acked in list(self.acks.values()) if sent > moment]
        return min(times) if times else None


class Reader:
    """One KV-event reader thread: the pool's stream from sequence 1 through the seed list,
    reopened from the last sequence seen plus one whenever it breaks (a dead replica)."""

    def __init__(self, seeds: str, pool_id: str) -> None:
        self.seeds = seeds
        self.pool_id = pool_id
        self.seen: list[tuple[int, str]] = []
        self.reopened = 0
        self.last_error = ""
        self.stopping = threading.Event()
        self.stream: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with SchedulerClient(self.seeds, timeout=3.0) as client:
            while not self.stopping.is_set():
                try:
                    self.stream = client.subscribe_events(
                        self.pool_id, start_sequence=len(self.seen) + 1
                    )
                    if self.stopping.is_set():
                        self.stream.close()
                    for batch in self.stream:
                        for offset, event in enumerate(batch.events):
                            self.seen.append((batch.first_sequence + offset, repr(event)))
                except Exception as exc:
                    self.reopened += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    time.sleep(0.05)

    def stop(self, last: int) -> None:
        deadline = time.monotonic() + 20
        while len(self.seen) < last and time.monotonic() < deadline:
            time.sleep(0.02)
        self.stopping.set()
        while self.thread.is_alive() and time.monotonic() < deadline + 5:
            if self.stream is not None:
                self.stream.close()
            self.thread.join(0.2)
