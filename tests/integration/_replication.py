"""Two ``kvcm serve --data-dir`` replicas with a static placement set through ReplicaService
(shared by the replication tests and bench/replication.py)."""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from _data_dir_server import CLI, CONFIG, Server, _free_port, program, reference
from prometheus_client.parser import text_string_to_metric_families

from kvcm.client import SchedulerClient, StepBuilder
from kvcm.core.pool import Pool
from kvcm.core.program import StepProgram
from kvcm.v1 import replica_pb2, replica_pb2_grpc, service_pb2_grpc

__all__ = [
    "CONFIG",
    "HttpServer",
    "Scheduler",
    "Server",
    "assert_pool_matches",
    "digest_checks",
    "event_log",
    "place",
    "replica_state",
    "start_pair",
    "step_epoch",
]


def _stub(address: str) -> tuple[grpc.Channel, replica_pb2_grpc.ReplicaServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, replica_pb2_grpc.ReplicaServiceStub(channel)  # type: ignore[no-untyped-call]


def place(
    address: str,
    pool_id: str,
    primary: str,
    standby: str | None,
    epoch: int,
    *,
    sync: bool = True,
) -> str:
    """Tell the replica at ``address`` the pool's placement; returns its role."""
    channel, stub = _stub(address)
    with channel:
        mode = replica_pb2.REPLICATION_MODE_SYNC if sync else replica_pb2.REPLICATION_MODE_ASYNC
        answer = stub.SetPlacement(
            replica_pb2.SetPlacementRequest(
                pool_id=pool_id,
                primary=primary,
                standby=standby or "",
                placement_epoch=epoch,
                mode=mode,
            ),
            timeout=30,
        )
        return str(answer.role)


def replica_state(address: str, pool_id: str) -> replica_pb2.GetReplicaStateResponse:
    channel, stub = _stub(address)
    with channel:
        answer: replica_pb2.GetReplicaStateResponse = stub.GetReplicaState(
            replica_pb2.GetReplicaStateRequest(pool_id=pool_id), timeout=10
        )
        return answer


class HttpServer(Server):
    """``kvcm serve --data-dir`` with its HTTP side on (``/metrics``)."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(data_dir, env)
        self.http = f"127.0.0.1:{_free_port()}"

    def spawn(self) -> subprocess.Popen[bytes]:
        self.process = subprocess.Popen(
            [*CLI, "serve", "--grpc-address", self.address, "--http-address", self.http,
             "--data-dir", str(self.data_dir), "--log-level", "ERROR"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env,
        )  # fmt: skip
        return self.process

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of one ``/metrics`` sample (``None``: no such series)."""
        with urllib.request.urlopen(f"http://{self.http}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return None


def step_epoch(address: str, pool_id: str, program: StepProgram) -> str:
    """Run ``program`` with a raw gRPC call; the answer's ``kvcm-epoch`` trailing metadata."""
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.SchedulerServiceStub(channel)  # type: ignore[no-untyped-call]
        request = StepBuilder.from_program(program).to_proto(pool_id)
        _, call = stub.Step.with_call(request, timeout=10)
        return dict(call.trailing_metadata() or ()).get("kvcm-epoch", "")


def digest_checks(address: str, pool_id: str, at_least: int) -> replica_pb2.GetReplicaStateResponse:
    """The standby's state once it has passed ``at_least`` digest checks (a periodic digest is
    sent once the primary's outbox is empty, covering every record due since: how many there
    are depends on timing, that one comes is certain)."""
    deadline = time.monotonic() + 20
    while True:
        state = replica_state(address, pool_id)
        if state.digest_checks >= at_least or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def start_pair(tmp_path: Path, digest_every: int = 4) -> tuple[Server, Server]:
    """Two replicas; the primary sends its pool's digest every ``digest_every`` records."""
    env = {"KVCM_REPLICA_DIGEST_EVERY": str(digest_every)}
    a = Server(tmp_path / "a", env)
    b = Server(tmp_path / "b", env)
    a.start()
    b.start()
    return a, b


def event_log(address: str, pool_id: str, until: int) -> list[tuple[int, str]]:
    """The pool's events 1..until from its gRPC stream: (sequence, event) pairs."""
    seen: list[tuple[int, str]] = []
    with SchedulerClient(address, timeout=10.0) as client:
        stream = client.subscribe_events(pool_id, start_sequence=1, timeout=20.0)
        try:
            for batch in stream:
                for offset, event in enumerate(batch.events):
                    seen.append((batch.first_sequence + offset, repr(event)))
                if seen and seen[-1][0] >= until:
                    break
        finally:
            stream.close()
    return seen


def assert_pool_matches(address: str, pool_id: str, expected: Pool) -> None:
    """The pool at ``address`` equals the in-process ``expected``: describe (free blocks,
    requests, prefix-cache totals), usage, every request's block ids, and every event in order
    with its sequence number."""
    with SchedulerClient(address, timeout=10.0) as client:
        info = client.describe_pool(pool_id)
        manager = expected.ready_manager()
        assert info.num_free_blocks == manager.num_free_blocks
        assert info.num_requests == len(expected.requests)
        assert info.last_event_sequence == expected.last_event_sequence
        snapshot = expected.snapshot()
        totals = info.prefix_cache
        assert (totals.requests, totals.queries, totals.hits) == (
            snapshot.requests,
            snapshot.queries,
            snapshot.hits,
        )
        usage = client.get_usage(pool_id)
        assert (usage.num_blocks, usage.num_free_blocks, usage.num_requests) == (
            snapshot.num_blocks,
            snapshot.num_free_blocks,
            snapshot.num_requests,
        )
        assert usage.usage == snapshot.usage
        for key, request in expected.requests.items():
            got = client.get_block_ids(pool_id, key)
            want = manager.get_block_ids(request.request_id)
            assert [list(g) for g in got] == [list(g) for g in want], key
    last = expected.last_event_sequence
    events = event_log(address, pool_id, last)
    want_events = [
        (index + 1, repr(event)) for index, (event, _) in enumerate(expected.event_log_contents())
    ]
    assert [seq for seq, _ in events] == list(range(1, last + 1))  # none lost, none repeated
    assert events == want_events


@dataclass
class Scheduler:
    """A thread driving one pool with ``program(1..)`` through the SDK; it records each
    acknowledged program and, when its replica dies, waits for ``address`` to be re-pointed
    and retries the same program (same step_seq) there."""

    pool_id: str
    address: str
    stop_at: int
    acked: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    pause_at: int = 0  # stop sending after this many acknowledgements (0: never)
    thread: threading.Thread | None = None
    repointed: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 60.0) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.pool_id}: scheduler stuck at {self.acked[-1:]}"

    def repoint(self, address: str) -> None:
        self.address = address
        self.repointed.set()

    def _run(self) -> None:
        seq = (self.acked[-1] if self.acked else 0) + 1
        while seq <= self.stop_at and not (self.pause_at and len(self.acked) >= self.pause_at):
            address = self.address
            try:
                with SchedulerClient(address, timeout=3.0) as client:
                    while seq <= self.stop_at:
                        if self.pause_at and len(self.acked) >= self.pause_at:
                            return
                        started = time.perf_counter()
                        client.step(self.pool_id, program(seq))
                        self.latencies.append(time.perf_counter() - started)
                        self.acked.append(seq)
                        seq += 1
            except Exception as exc:  # the replica died: wait to be re-pointed, then retry
                self.errors.append(f"{seq}: {type(exc).__name__}")
                if not self.repointed.wait(60) or self.address == address:
                    self.repointed.clear()
                    if self.address == address:
                        time.sleep(0.1)
                        continue
                self.repointed.clear()


def expected_pool(steps: int) -> Pool:
    """An in-process pool that ran ``program(1..steps)``."""
    return reference(steps)
