"""kvcm's ZMQ KV-event stream read as vLLM 0.33's own consumers read an engine's.

A real server publishes on ZMQ while the test drives it through the SDK and drives vLLM's
in-process ``KVCacheManager`` with the same calls (the same requests, hashes from vLLM's own
hasher). Every batch kvcm sends must be, byte for byte, what vLLM's encoder writes for vLLM's
own events of that call (``KVEventBatch`` at kvcm's timestamp, data-parallel rank 0), and must
decode with vLLM's ``KVEventBatch`` decoder to vLLM's events. Replay through the ROUTER socket
(vLLM's request and end marker) fills a subscriber's gap, also after the server restarted on
its data directory.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest
import zmq
from _drivers import FULL, SWA, GroupDesc, KvcmSide, Layout, RequestSpec, VllmSide

from kvcm.client import PoolConfig, SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

LAYOUT = Layout(
    groups=(GroupDesc(FULL, 16), GroupDesc(SWA, 16, window=32)),
    num_blocks=48,
    max_model_len=4096,
)
POOL = "engine-a"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _kvcm_layout() -> KVCacheConfig:
    groups = tuple(
        KVCacheGroupSpec(layer_names=(f"layer.{i}",), kv_cache_spec=KvcmSide._spec(g))
        for i, g in enumerate(LAYOUT.groups)
    )
    return KVCacheConfig(num_blocks=LAYOUT.num_blocks, kv_cache_tensors=(), kv_cache_groups=groups)


def _server(endpoint: str, replay: str, data_dir: Path | None, int_hashes: int) -> EmbeddedServer:
    return start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="",
            kv_events_endpoint=endpoint,
            kv_events_replay_endpoint=replay,
            kv_events_use_int_block_hashes=int_hashes,
            data_dir=str(data_dir) if data_dir is not None else "",
        )
    )


class Lockstep:
    """The same manager calls on kvcm (over gRPC) and on vLLM's KVCacheManager; records
    vLLM's events of every call that produced some (each is one batch kvcm publishes)."""

    def __init__(self, client: SchedulerClient, seed: int) -> None:
        self.client = client
        self.vllm = VllmSide(LAYOUT)
        self.rng = random.Random(seed)
        self.expected: list[list[Any]] = []
        self.live: dict[str, int] = {}
        self.next_key = 0
        self.prefixes = [
            [self.rng.randrange(1, 30_000) for _ in range(self.rng.choice((32, 48, 64)))]
            for _ in range(4)
        ]

    def _record(self) -> None:
        events = self.vllm.manager.take_events()
        if events:
            self.expected.append(list(events))

    def admit(self) -> None:
        """A new request sharing a prefix: look up, allocate its prompt, cached at once."""
        rng = self.rng
        key = self.next_key
        self.next_key += 1
        prompt = [*rng.choice(self.prefixes), *(rng.randrange(1, 30_000) for _ in range(40))]
        lora = ("adapter-a", 7, "/adapters/a") if rng.random() < 0.25 else None
        salt = "tenant-1" if rng.random() < 0.25 else None
        spec = RequestSpec(f"r{key}", prompt, lora=lora, cache_salt=salt)
        self.vllm.add_request(spec)
        hashes = self.vllm.block_hashes(spec.request_id)
        self.client.add_request(
            POOL,
            key,
            prompt,
            hashes,
            lora_id=None if lora is None else lora[1],
            lora_name=None if lora is None else lora[0],
            cache_salt=salt,
        )
        _, num_hit, _ = self.vllm.get_computed_blocks(spec.request_id, None)
        hit = self.client.get_computed_blocks(POOL, key)
        assert hit.num_computed_tokens == num_hit
        self._record()  # a lookup publishes nothing; this keeps both sides drained alike
        theirs = self.vllm.allocate_slots(spec.request_id, len(prompt) - num_hit, True)
        ours = self.client.allocate_slots(
            POOL, key, len(prompt) - num_hit, 0, hit=hit if num_hit else None
        )
        assert (theirs is None) == (ours is None)
        self._record()
        if theirs is None:
            self.vllm.drop_request(spec.request_id)
            self.client.free(POOL, key)
            self._record()
            return
        self.live[spec.request_id] = key

    def finish(self) -> None:
        """Free a random live request (its cached blocks become evictable)."""
        request_id = self.rng.choice(sorted(self.live))
        key = self.live.pop(request_id)
        self.vllm.free(request_id)
        self.vllm.drop_request(request_id)
        self.client.free(POOL, key)
        self._record()

    def reset(self) -> None:
        """reset_prefix_cache: AllBlocksCleared when nothing is running."""
        assert self.vllm.reset_prefix_cache() == self.client.reset_prefix_cache(POOL)
        self._record()

    def run(self, num_ops: int) -> None:
        """``num_ops`` random calls: admissions and finishes; every 50th drains and resets."""
        for index in range(num_ops):
            if index % 50 == 49:
                while self.live:
                    self.finish()
                self.reset()
            elif self.live and (self.rng.random() < 0.35 or len(self.live) > 4):
                self.finish()
            else:
                self.admit()


def _create_pool(client: SchedulerClient) -> None:
    client.create_pool(
        POOL,
        PoolConfig(
            max_model_len=LAYOUT.max_model_len,
            explicit_layout=_kvcm_layout(),
            hash_algorithm=LAYOUT.hash_algorithm,
            enable_kv_cache_events=True,
        ),
    )


def _wait_connected(server: EmbeddedServer, sub: zmq.Socket[bytes]) -> None:
    """Until the PUB socket has a peer, and its subscription had time to arrive (a subscriber
    that joins late misses what was sent before: ZMQ's slow joiner). The subscriber's socket
    is polled meanwhile: libzmq sends a subscription only once its owner uses the socket."""
    stream = server.server.kv_events
    assert stream is not None
    deadline = time.monotonic() + 10
    while stream.counters.peers == 0:
        assert time.monotonic() < deadline, "the PUB socket never connected"
        sub.poll(10)
    for _ in range(30):
        sub.poll(10)


def _receive(sub: zmq.Socket[bytes], count: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    messages: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(messages) < count and time.monotonic() < deadline:
        if sub.poll(100):
            messages.append(sub.recv_multipart())
    return messages


def _replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[list[bytes]]:
    """vLLM's replay request (empty frame, 8-byte start) on a DEALER; frames until the end."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[list[bytes]] = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert topic == b""
                assert payload == b""
                return out
            out.append([topic, seq, payload])
    finally:
        dealer.close(linger=0)


def _check_batches(
    messages: list[list[bytes]], expected: list[list[Any]], first_seq: int, kv_events: ModuleType
) -> None:
    """Each message is vLLM's encoding of vLLM's events of the same call."""
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    assert len(messages) == len(expected)
    for index, ((topic, seq, payload), events) in enumerate(zip(messages, expected, strict=True)):
        assert topic == f"kv@{POOL}@".encode()
        assert int.from_bytes(seq, "big") == first_seq + index
        batch = decoder.decode(payload)
        theirs = kv_events.KVEventBatch(ts=batch.ts, events=events, data_parallel_rank=0)
        assert payload == encoder.encode(theirs), f"batch {first_seq + index} differs"
        assert batch.events == decoder.decode(encoder.encode(theirs)).events


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.mark.parametrize("int_hashes", [1, 0], ids=["int-hashes", "bytes-hashes"])
def test_every_batch_is_vllms_encoding_of_vllms_events(
    kv_events: ModuleType,
    zmq_context: zmq.Context[zmq.Socket[bytes]],
    monkeypatch: pytest.MonkeyPatch,
    int_hashes: int,
) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", str(int_hashes))
    sub = zmq_context.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    # A tcp endpoint without a wildcard is connected to (vLLM's rule): the subscriber binds.
    server = _server(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:0", None, int_hashes)
    try:
        with SchedulerClient(server.grpc_address, timeout=10.0) as client:
            _create_pool(client)
            # Wait for the connection: events published before it would be lost (slow joiner).
            _wait_connected(server, sub)
            steps = Lockstep(client, seed=int_hashes)
            steps.run(120)
            messages = _receive(sub, len(steps.expected))
        kinds = {type(e).__name__ for events in steps.expected for e in events}
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds
        assert any(e.extra_keys for events in steps.expected for e in events
                   if isinstance(e, kv_events.BlockStored))  # fmt: skip
        hash_type = int if int_hashes else bytes
        assert all(isinstance(h, hash_type) for events in steps.expected for e in events
                   for h in getattr(e, "block_hashes", ()))  # fmt: skip
        _check_batches(messages, steps.expected, 0, kv_events)
    finally:
        server.stop()
        sub.close(linger=0)


def test_replay_fills_a_gap_and_survives_a_restart(
    kv_events: ModuleType,
    zmq_context: zmq.Context[zmq.Socket[bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    probe = zmq_context.socket(zmq.SUB)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)  # nobody listens yet: what is published now is lost to subscribers
    server = _server(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:0", tmp_path, 1)
    sub = zmq_context.socket(zmq.SUB)
    try:
        with SchedulerClient(server.grpc_address, timeout=10.0) as client:
            _create_pool(client)
            steps = Lockstep(client, seed=7)
            steps.run(40)
            missed = len(steps.expected)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.bind(f"tcp://127.0.0.1:{port}")
            _wait_connected(server, sub)
            steps.run(40)
            live = _receive(sub, len(steps.expected) - missed)
        assert missed > 0
        assert live
        first_live = int.from_bytes(live[0][1], "big")
        assert first_live == missed  # the subscriber sees the gap in seq
        # vLLM's consumer asks for the gap from seq 0: the replay sends every batch from 0.
        replayed = _replay(zmq_context, server.server.kv_events.replay_endpoint, 0)  # type: ignore[union-attr]
        _check_batches(replayed, steps.expected, 0, kv_events)
        assert replayed[first_live:] == live
        before_restart = replayed
        replay_endpoint = server.server.kv_events.replay_endpoint  # type: ignore[union-attr]
        server.stop()
        # The same data directory and endpoints: the batches come back, numbered alike.
        server = _server(f"tcp://127.0.0.1:{port}", replay_endpoint, tmp_path, 1)
        assert _replay(zmq_context, replay_endpoint, 0) == before_restart
        assert _replay(zmq_context, replay_endpoint, 5) == before_restart[5:]
        # Publishing goes on from the next seq; the pool's state is the one vLLM has.
        with SchedulerClient(server.grpc_address, timeout=10.0) as client:
            _wait_connected(server, sub)
            done = len(steps.expected)
            steps.client = client
            steps.run(30)
            after = _receive(sub, len(steps.expected) - done)
        _check_batches(after, steps.expected[done:], done, kv_events)
    finally:
        server.stop()
        sub.close(linger=0)


@pytest.mark.parametrize("ending", ["DeletePool", "ResyncPool"])
def test_an_ended_incarnation_publishes_all_blocks_cleared_last(
    ending: str, kv_events: ModuleType, zmq_context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A deleted pool, or one an engine restart resynchronises (ResyncPool over the existing
    pool, from an empty snapshot): the old incarnation's last batch is AllBlocksCleared, and
    the new one's batches go on after it (a consumer that drops batches numbered at or below
    the last it saw follows it); a replay across the boundary sends that AllBlocksCleared,
    then the new incarnation's batches."""
    from kvcm.core.pool import Pool
    from kvcm.core.snapshot import encode_pool

    sub = zmq_context.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    server = _server(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:0", None, 1)
    config = PoolConfig(
        max_model_len=LAYOUT.max_model_len,
        explicit_layout=_kvcm_layout(),
        hash_algorithm=LAYOUT.hash_algorithm,
        enable_kv_cache_events=True,
    )
    try:
        with SchedulerClient(server.grpc_address, timeout=10.0) as client:
            client.create_pool(POOL, config)
            _wait_connected(server, sub)
            steps = Lockstep(client, seed=3)
            steps.run(10)
            if ending == "DeletePool":
                client.delete_pool(POOL)
                client.create_pool(POOL, config)
            else:
                client.resync_pool(POOL, encode_pool(Pool(POOL, config)), config, step_seq=0)
            steps.vllm = VllmSide(LAYOUT)
            steps.live.clear()
            steps.expected.append([kv_events.AllBlocksCleared()])
            cleared_at = len(steps.expected)
            steps.run(5)
            messages = _receive(sub, len(steps.expected))
            replay_endpoint = server.server.kv_events.replay_endpoint  # type: ignore[union-attr]
            replayed = _replay(zmq_context, replay_endpoint, 0)
        _check_batches(messages[:cleared_at], steps.expected[:cleared_at], 0, kv_events)
        _check_batches(messages[cleared_at:], steps.expected[cleared_at:], cleared_at, kv_events)
        # The old incarnation's log went with it; its AllBlocksCleared is kept.
        assert replayed == messages[cleared_at - 1 :]
    finally:
        server.stop()
        sub.close(linger=0)
