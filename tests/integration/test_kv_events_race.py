"""The ZMQ publisher's hand-off between the event loop and its thread cannot lose a batch.

The publisher once kept a "woken" flag beside a deque and cleared it before draining its
wake-up messages: a publish landing between the two left the flag set with no message in
flight, and nothing woke the thread again (batches stopped for good, shutdown timed out,
metrics looked healthy). These tests race publishes against the drain thousands of times in
every rhythm (bursts, single batches right as the thread goes idle, pauses around its wake-up
latency) from real core pools, and check on a real SUB socket that every batch arrives, in
order per pool, and that the threads stop within the close timeout with nothing left queued.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.server.kv_events import KvEventNumbering, KvEventStream
from kvcm.server.settings import ServerSettings

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=8,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)
NUM_POOLS = 4


def _no_replay(start: int, topic: str | None, offset: int) -> concurrent.futures.Future[list]:  # type: ignore[type-arg]
    del start, topic, offset
    done: concurrent.futures.Future[list] = concurrent.futures.Future()  # type: ignore[type-arg]
    done.set_result([])
    return done


class Receiver:
    """A SUB socket (bound; the publisher connects, vLLM's rule for a plain tcp endpoint) read
    by its own thread into ``messages``."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # keep everything: the test counts every batch
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.messages: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(20):
                while True:
                    try:
                        self.messages.append(self.sub.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break

    def wait_for(self, count: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.messages) < count and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sub.close(linger=0)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    receiving = Receiver(ctx)
    yield receiving
    receiving.close()
    ctx.destroy(linger=0)


def _stream(port: int) -> KvEventStream:
    settings = ServerSettings(kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_hwm=1_000_000)
    return KvEventStream(settings, collect=_no_replay, numbering=KvEventNumbering())


def _connected(stream: KvEventStream) -> None:
    """Until the PUB socket has its peer and the subscription had time to arrive (a
    subscriber that is not connected yet misses what is sent: ZMQ's slow joiner)."""
    deadline = time.monotonic() + 10
    while stream.counters.peers == 0:
        assert time.monotonic() < deadline, "the PUB socket never connected"
        time.sleep(0.01)
    time.sleep(0.3)


def _pools() -> list[Pool]:
    return [
        Pool(
            f"pool-{i}",
            PoolConfig(max_model_len=64, explicit_layout=LAYOUT, enable_kv_cache_events=True),
        )
        for i in range(NUM_POOLS)
    ]


def _publish(stream: KvEventStream, pool: Pool) -> None:
    """What the server does after a call changed ``pool``'s cache: the core appends one batch
    to the pool's log and the publisher is handed it (here AllBlocksCleared, the cheapest)."""
    assert pool.publish_cleared(time.time()) == 1
    stream.publish(pool, f"kv@{pool.name}@")


def _check_every_batch_arrived(messages: list[list[bytes]], pools: list[Pool]) -> None:
    decoder = msgspec.msgpack.Decoder()
    seen: dict[bytes, list[int]] = {}
    for topic, seq, payload in messages:
        seen.setdefault(topic, []).append(int.from_bytes(seq, "big"))
        ts, events, rank = decoder.decode(payload)
        assert events == [{"type": "AllBlocksCleared"}]
        assert rank == 0
        assert ts > 0
    for pool in pools:
        published = pool.event_batches()[0]
        assert seen.pop(f"kv@{pool.name}@".encode()) == list(range(published))
    assert not seen


def test_publishes_racing_the_drain_all_arrive(receiver: Receiver) -> None:
    stream = _stream(receiver.port)
    pools = _pools()
    rng = random.Random(23)
    # Bursts, and single batches right as the thread goes back to waiting: pauses of 0 (the
    # thread is still draining), a GIL switch, and around its wake-up latency.
    pauses = (0.0, 0.0, 0.0, 1e-6, 2e-5, 5e-5, 1e-4, 3e-4)
    try:
        _connected(stream)
        total = 0
        while total < 20_000:
            for _ in range(rng.choice((1, 1, 1, 2, 3, 8, 40))):
                _publish(stream, pools[rng.randrange(NUM_POOLS)])
                total += 1
            pause = rng.choice(pauses)
            if pause:
                time.sleep(pause)
        receiver.wait_for(total)
        assert len(receiver.messages) == total
        assert stream.counters.batches == total
        assert stream.counters.dropped == 0
        assert stream.counters.errors == 0
        assert stream.counters.queue_depth() == 0
        assert stream.counters.oldest_unsent_age_s() == 0.0
        assert stream.counters.last_sent == {
            pool.name: pool.event_batches()[0] - 1 for pool in pools
        }
        _check_every_batch_arrived(receiver.messages, pools)
    finally:
        started = time.monotonic()
        stream.close(timeout=2.0)
        assert time.monotonic() - started < 2.5
    assert not stream._publisher.is_alive()
    assert not stream._service.is_alive()


def test_close_sends_everything_queued_and_stops(receiver: Receiver) -> None:
    """Many short lives: publish a burst, close at once; every batch is on the wire and both
    threads are gone within the close timeout, each time."""
    for round_index in range(15):
        stream = _stream(receiver.port)
        pools = _pools()
        first = len(receiver.messages)
        try:
            _connected(stream)
            for index in range(200 + 50 * round_index):
                _publish(stream, pools[index % NUM_POOLS])
        finally:
            started = time.monotonic()
            stream.close(timeout=2.0)
            assert time.monotonic() - started < 2.5
        assert not stream._publisher.is_alive()
        assert not stream._service.is_alive()
        published = sum(pool.event_batches()[0] for pool in pools)
        receiver.wait_for(first + published)
        assert len(receiver.messages) - first == published
        _check_every_batch_arrived(receiver.messages[first:], pools)


def test_a_full_queue_drops_and_counts_and_the_publisher_goes_on(receiver: Receiver) -> None:
    """Batches beyond ``kv_events_max_queue_size`` are dropped and counted, never blocking
    the caller; the publisher keeps sending what it has and everything after."""
    settings = ServerSettings(
        kv_events_endpoint=f"tcp://127.0.0.1:{receiver.port}",
        kv_events_hwm=1_000_000,
        kv_events_max_queue_size=4,
    )
    stream = KvEventStream(settings, collect=_no_replay, numbering=KvEventNumbering())
    pool = _pools()[0]
    try:
        _connected(stream)
        for _ in range(2_000):
            _publish(stream, pool)
        dropped = stream.counters.dropped
        assert 0 < dropped < 2_000
        receiver.wait_for(2_000 - dropped)
        assert len(receiver.messages) == 2_000 - dropped
        seqs = [int.from_bytes(seq, "big") for _, seq, _ in receiver.messages]
        assert seqs == sorted(seqs)
        assert len(set(seqs)) == len(seqs)
        time.sleep(0.3)  # idle: the thread waits on the queue again
        _publish(stream, pool)
        receiver.wait_for(2_001 - dropped)
        assert int.from_bytes(receiver.messages[-1][1], "big") == 2_000
    finally:
        stream.close(timeout=2.0)
    assert not stream._publisher.is_alive()
