"""KV events on vLLM's ZMQ wire continue across a failover (docs/replication.md).

Two ``kvcm serve --data-dir`` replicas, each publishing on its own ZMQ endpoints (PUB and
replay ROUTER); pool ``z`` has primary A and standby B (sync). A router reads A's wire live;
B publishes nothing while it follows. After ``kill -9`` of A and B's promotion, the router
connects to B, asks B's replay socket for the batches after the last ``seq`` it saw (vLLM's
protocol after any gap), then reads B live, dropping numbers it already has: it ends with
every batch exactly once, numbered 0, 1, 2... with no gap, and each batch A had sent is byte
for byte the one B's replay holds (same events, same timestamps, same numbering).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from pathlib import Path

import grpc
import msgspec
import zmq
from _data_dir_server import HASHER
from _replication import CONFIG, Server, place

from kvcm.client import SchedulerClient, StepBuilder
from kvcm.core.pool_types import LeaseExpiry
from kvcm.core.program import StepProgram
from kvcm.v1 import service_pb2_grpc

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def program(seq: int, *, sequenced: bool = True) -> StepProgram:
    """Step ``seq``: admit and cache a fresh 2-block prompt (a BlockStored batch), finish it."""
    prompt = list(range(seq * 1000, seq * 1000 + 40))
    step = StepBuilder()
    step.step_seq = seq if sequenced else None
    step.add_request(seq, prompt, HASHER.hash_token_ids(prompt))
    step.allocate(seq, len(prompt), 0, lookup=True)
    step.cache_blocks(seq, len(prompt))
    step.finish(seq)
    return step.build()


class Router:
    """A SUB socket read by its own thread: (seq, payload) of every batch, in arrival order."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.batches: list[tuple[int, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(20):
                _, seq, payload = self.sub.recv_multipart()
                self.batches.append((int.from_bytes(seq, "big"), payload))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sub.close(linger=0)


def _replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int
) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def _server(tmp_path: Path, name: str, sync_timeout_s: str = "5") -> Server:
    env = {
        "KVCM_KV_EVENTS_ENDPOINT": f"ipc://{tmp_path}/{name}-pub",
        "KVCM_KV_EVENTS_REPLAY_ENDPOINT": f"ipc://{tmp_path}/{name}-replay",
        "KVCM_REPLICA_DIGEST_EVERY": "4",
        "KVCM_REPLICA_SYNC_TIMEOUT_S": sync_timeout_s,
    }
    server = Server(tmp_path / name, env)
    server.start()
    return server


def _last_seq(address: str) -> int:
    with SchedulerClient(address, timeout=10.0) as client:
        zmq_events = client.describe_pool("z").zmq_events
        assert zmq_events is not None
        return zmq_events.last_seq


def _wait(predicate, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_zmq_numbering_continues_across_a_failover(tmp_path: Path) -> None:
    a, b = _server(tmp_path, "a"), _server(tmp_path, "b")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    on_a = Router(ctx, f"ipc://{tmp_path}/a-pub")
    on_b = Router(ctx, f"ipc://{tmp_path}/b-pub")  # connected all along: B must stay silent
    try:
        place(b.address, "z", a.address, b.address, 1)
        place(a.address, "z", a.address, b.address, 1)
        time.sleep(0.3)  # the SUB sockets' subscriptions reach the publishers
        with SchedulerClient(a.address, timeout=10.0) as client:
            client.create_pool("z", CONFIG)
            for seq in range(1, 13):
                client.step("z", program(seq))
        last_on_a = _last_seq(a.address)
        assert last_on_a >= 11  # a batch per Step
        _wait(lambda: on_a.batches and on_a.batches[-1][0] == last_on_a, "A's last batch")
        live = dict(on_a.batches)
        if len(live) <= last_on_a:  # a SUB socket joins late: the router asks for the rest
            for seq, payload in _replay(ctx, f"ipc://{tmp_path}/a-replay", 0):
                live.setdefault(seq, payload)
        seen = sorted(live.items())
        assert [seq for seq, _ in seen] == list(range(last_on_a + 1))
        a.kill()
        place(b.address, "z", b.address, None, 2)  # promoted
        assert on_b.batches == []  # a standby publishes nothing
        assert _last_seq(b.address) == last_on_a  # the same numbering
        with SchedulerClient(b.address, timeout=10.0) as client:
            for seq in range(13, 25):
                client.step("z", program(seq))
        last_on_b = _last_seq(b.address)
        assert last_on_b > last_on_a
        # The router catches up from B's replay after the last seq it saw, then reads live.
        caught_up = _replay(ctx, f"ipc://{tmp_path}/b-replay", seen[-1][0] + 1)
        _wait(lambda: on_b.batches and on_b.batches[-1][0] == last_on_b, "B's last batch")
        have = {seq for seq, _ in seen}
        for seq, payload in [*caught_up, *on_b.batches]:
            if seq not in have:  # a router drops numbers it already has
                seen.append((seq, payload))
                have.add(seq)
        assert [seq for seq, _ in seen] == list(range(last_on_b + 1))  # none lost or repeated
        # What A published is, byte for byte, what B holds for those numbers.
        from_b = dict(_replay(ctx, f"ipc://{tmp_path}/b-replay", 0))
        assert all(from_b[seq] == payload for seq, payload in seen), "B's batches differ"
        assert sorted(from_b) == list(range(last_on_b + 1))
    finally:
        on_a.close()
        on_b.close()
        ctx.destroy(linger=0)
        a.stop()
        b.stop()


def _events_seen(address: str, pool_id: str, seen: list[int], stop: threading.Event) -> None:
    """A gRPC reader of the pool from sequence 1: appends each event's sequence to ``seen``."""
    with SchedulerClient(address, timeout=10.0) as client:
        stream = client.subscribe_events(pool_id, start_sequence=1, timeout=60.0)
        try:
            for batch in stream:
                seen.extend(batch.first_sequence + i for i in range(len(batch.events)))
                if stop.is_set():
                    return
        except Exception:  # the server was killed: the reader ends
            return
        finally:
            stream.close()


def test_events_wait_for_the_standby(tmp_path: Path) -> None:
    """A sync pool's batch goes out (ZMQ live and replay, gRPC, DescribePool's last_seq) only
    once its standby acknowledged the record: while the standby is stopped, a Step's batch is
    held; it goes out when the standby has it. A primary killed with a batch held never sent
    it, so the router, moved to the promoted standby, holds exactly the standby's batches."""
    a = _server(tmp_path, "a", sync_timeout_s="1")
    b = _server(tmp_path, "b", sync_timeout_s="1")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    on_a = Router(ctx, f"ipc://{tmp_path}/a-pub")
    grpc_seen: list[int] = []
    stop = threading.Event()
    reader = threading.Thread(target=_events_seen, args=(a.address, "z", grpc_seen, stop))
    try:
        place(b.address, "z", a.address, b.address, 1)
        place(a.address, "z", a.address, b.address, 1)
        time.sleep(0.3)  # the SUB socket's subscription reaches the publisher
        with SchedulerClient(a.address, timeout=10.0) as client:
            client.create_pool("z", CONFIG)
            reader.start()
            for seq in range(1, 5):
                client.step("z", program(seq))
            out = _last_seq(a.address)
            events_out = client.describe_pool("z").last_event_sequence
        _wait(lambda: on_a.batches and on_a.batches[-1][0] == out, "A's batches")
        _wait(lambda: grpc_seen and grpc_seen[-1] == events_out, "A's events")
        assert b.process is not None
        b.process.send_signal(signal.SIGSTOP)
        try:
            refused = _step_raw(a.address, program(5))  # applied and journaled on A
            assert refused is grpc.StatusCode.UNAVAILABLE, refused  # but not acknowledged
            time.sleep(0.3)
            assert on_a.batches[-1][0] == out, "a batch went out before the standby had it"
            assert grpc_seen[-1] == events_out, "events went out before the standby had them"
            assert max(seq for seq, _ in _replay(ctx, f"ipc://{tmp_path}/a-replay", 0)) == out
            assert _last_seq(a.address) == out
        finally:
            b.process.send_signal(signal.SIGCONT)
        # The standby acknowledges it: the batch goes out, the same as its retry's answer.
        _wait(lambda: on_a.batches[-1][0] == out + 1, "the held batch")
        _wait(lambda: grpc_seen[-1] > events_out, "the held events")
        with SchedulerClient(a.address, timeout=10.0) as client:
            client.step("z", program(5))  # the retry (same step_seq) is answered
            assert client.describe_pool("z").zmq_events.last_seq == out + 1  # type: ignore[union-attr]
        # A batch held when the primary dies: never out.
        b.process.send_signal(signal.SIGSTOP)
        try:
            assert _step_raw(a.address, program(6)) is grpc.StatusCode.UNAVAILABLE
            time.sleep(0.3)
            a.kill()
        finally:
            b.process.send_signal(signal.SIGCONT)
        place(b.address, "z", b.address, None, 2)  # promoted
        with SchedulerClient(b.address, timeout=10.0) as client:
            # New prompts (whether B had Step 6 or not): new blocks, new batches.
            for seq in range(7, 10):
                client.step("z", program(seq, sequenced=False))
        last_on_b = _last_seq(b.address)
        # The router: what it read from A, then B's replay after the last seq it saw.
        seen = dict(on_a.batches)
        assert sorted(seen) == list(range(out + 2))
        for seq, payload in _replay(ctx, f"ipc://{tmp_path}/b-replay", out + 2):
            assert seq not in seen
            seen[seq] = payload
        from_b = dict(_replay(ctx, f"ipc://{tmp_path}/b-replay", 0))
        assert sorted(from_b) == list(range(last_on_b + 1))
        assert seen == from_b, "the router's batches differ from the new primary's"
    finally:
        stop.set()
        on_a.close()
        ctx.destroy(linger=0)
        a.stop()
        b.stop()
        reader.join(10)


def _step_raw(address: str, step: StepProgram) -> grpc.StatusCode | None:
    """One Step attempt (no SDK retry): its status code (``None``: acknowledged)."""
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.SchedulerServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            stub.Step(StepBuilder.from_program(step).to_proto("z"), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        return None


def test_a_lease_reclaims_events_wait_for_the_standby(tmp_path: Path) -> None:
    """A change the server makes itself (an expired scheduler lease clearing the pool) is
    shipped with nobody waiting, and its batch still goes out only once the standby has it."""
    a, b = _server(tmp_path, "a"), _server(tmp_path, "b")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    on_a = Router(ctx, f"ipc://{tmp_path}/a-pub")
    try:
        place(b.address, "z", a.address, b.address, 1)
        place(a.address, "z", a.address, b.address, 1)
        time.sleep(0.3)  # the SUB socket's subscription reaches the publisher
        config = dataclasses.replace(CONFIG, scheduler_lease_s=2.0, lease_expiry=LeaseExpiry.CLEAR)
        with SchedulerClient(a.address, timeout=10.0) as client:
            client.create_pool("z", config)
            prompt = list(range(40))
            step = StepBuilder()
            step.add_request(1, prompt, HASHER.hash_token_ids(prompt))
            step.allocate(1, len(prompt), 0, lookup=True)
            step.cache_blocks(1, len(prompt))  # request 1 stays: the lease reclaims it
            client.step("z", step)  # acknowledged: the standby has it
            assert b.process is not None
            b.process.send_signal(signal.SIGSTOP)
            try:
                out = _last_seq(a.address)
                _wait(lambda: on_a.batches and on_a.batches[-1][0] == out, "the Step's batch")
                # The lease expires (2 s) and the pool is cleared on A, its batch held.
                _wait(lambda: client.describe_pool("z").num_requests == 0, "the reclaim", 15)
                time.sleep(0.3)
                assert on_a.batches[-1][0] == out, "the reclaim's batch went out first"
                assert _last_seq(a.address) == out
            finally:
                b.process.send_signal(signal.SIGCONT)
        _wait(lambda: on_a.batches[-1][0] > out, "the reclaim's batch")
        assert "AllBlocksCleared" in repr(msgspec.msgpack.decode(on_a.batches[-1][1]))
    finally:
        on_a.close()
        ctx.destroy(linger=0)
        a.stop()
        b.stop()
