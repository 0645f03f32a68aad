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

import threading
import time
from pathlib import Path

import zmq
from _data_dir_server import HASHER
from _replication import CONFIG, Server, place

from kvcm.client import SchedulerClient, StepBuilder
from kvcm.core.program import StepProgram

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def program(seq: int) -> StepProgram:
    """Step ``seq``: admit and cache a fresh 2-block prompt (a BlockStored batch), finish it."""
    prompt = list(range(seq * 1000, seq * 1000 + 40))
    step = StepBuilder()
    step.step_seq = seq
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


def _server(tmp_path: Path, name: str) -> Server:
    env = {
        "KVCM_KV_EVENTS_ENDPOINT": f"ipc://{tmp_path}/{name}-pub",
        "KVCM_KV_EVENTS_REPLAY_ENDPOINT": f"ipc://{tmp_path}/{name}-replay",
        "KVCM_REPLICA_DIGEST_EVERY": "4",
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
