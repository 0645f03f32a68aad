"""A router's indexer follows kvcm's ZMQ KV events exactly, through deletes, re-creations and
a ``kill -9`` restart.

The consumer here is written as deployed routers' indexers are (Dynamo's in particular): one
per endpoint, it ignores the ZMQ topic, applies batches in order, drops a batch numbered at or
below the last one it applied, and asks the replay socket (vLLM's request: an empty frame and
the first missing ``seq``) when it sees a gap. Its index is the set of block hashes it was told
are stored (vLLM's int form), and its answer for a prompt is the number of leading block
hashes it holds.

``kvcm serve --data-dir`` runs as a subprocess with ``--kv-events-port-label
data_parallel_rank``: four pools, ranks 0..3, each on its own PUB and replay socket (vLLM's
endpoint + rank rule), wired from what DescribePool says. A second run puts every pool on the
shared socket and gives each pool a consumer that reads topics instead (llm-d's way: it
subscribes to its pool's topic and replays that topic alone). Through a workload that stores and
evicts blocks, a pool deleted and created again under the same id, another deleted before a
``kill -9`` and re-created after the restart, and a consumer that joins late, each consumer's
answer equals the pool's own (the Lookup RPC's ``num_hit_tokens``) on every probe, and the
numbers it saw never went backwards.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from kvcm.client import LookupQuery, SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher, external_block_hash
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig

BLOCK_SIZE = 16
END_SEQ = (-1).to_bytes(8, "big", signed=True)
POOLS = ("p0", "p1", "p2", "p3")
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)


def _config(rank: int) -> PoolConfig:
    return PoolConfig(
        max_model_len=1024,
        hash_seed="routers",
        enable_kv_cache_events=True,
        labels={"model": "m", "data_parallel_rank": str(rank)},
        explicit_layout=KVCacheConfig(
            num_blocks=24,  # small: the workload evicts, so BlockRemoved flows too
            kv_cache_tensors=(),
            kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
        ),
    )


HASHER = BlockHasher(BLOCK_SIZE, _config(0).hash_algorithm, "routers")


# ------------------------------------------------------------------------- the consumer
class Indexer:
    """One engine's index, as a router keeps it (see the module docstring). Topic-blind
    (Dynamo's way): it takes everything on its socket. With ``topic`` (llm-d's way, on the
    shared socket): it subscribes to that topic and replays that topic alone."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        replay: str,
        topic: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.replay_endpoint = replay
        self.topic = topic
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        # Topic-blind: every topic. (ZMQ matches prefixes; the test's topics are not
        # prefixes of one another.)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"" if topic is None else topic.encode())
        self.sub.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder()
        self.last_seq = -1
        self.blocks: set[int] = set()
        self.applied: list[int] = []
        self.replays = 0
        self.stale = 0

    def on_message(self, frames: list[bytes]) -> None:
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if seq <= self.last_seq:
            self.stale += 1
            return
        if seq > self.last_seq + 1:
            self._replay(self.last_seq + 1)
            if seq <= self.last_seq:
                return
        self._apply(seq, payload)

    def _replay(self, start: int) -> None:
        """vLLM's replay request; applies what it gets that is newer than what it has."""
        self.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            request = [b"", start.to_bytes(8, "big")]
            if self.topic is not None:
                request.append(self.topic.encode())  # kvcm's optional 4th frame: one pool
            dealer.send_multipart(request)
            while True:
                assert dealer.poll(10_000), "no replay answer"
                _, _topic, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_SEQ:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.last_seq:
                    assert seq == self.last_seq + 1, "the replay skipped batches"
                    self._apply(seq, payload)
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        _ts, events, _rank = self.decoder.decode(payload)
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                self.blocks.update(event["block_hashes"])
            elif kind == "BlockRemoved":
                self.blocks.difference_update(event["block_hashes"])
            else:
                assert kind == "AllBlocksCleared", kind
                self.blocks.clear()
        self.last_seq = seq
        self.applied.append(seq)

    def hit_tokens(self, prompt: list[int]) -> int:
        """Its answer: the leading blocks of ``prompt`` it holds (at most len - 1 tokens)."""
        count = 0
        for block_hash in HASHER.hash_token_ids(prompt):
            if external_block_hash(block_hash) not in self.blocks:
                break
            count += 1
        return min(count, (len(prompt) - 1) // BLOCK_SIZE) * BLOCK_SIZE


class Router:
    """The indexers of one router, read by one thread (a poller over their SUB sockets)."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.indexers: dict[str, Indexer] = {}
        self.lock = threading.Lock()
        self._added: list[Indexer] = []
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def follow(self, name: str, endpoint: str, replay: str, topic: str | None = None) -> None:
        with self.lock:
            indexer = Indexer(self.ctx, endpoint, replay, topic)
            self.indexers[name] = indexer
            self._added.append(indexer)

    def _run(self) -> None:
        try:
            self._follow()
        except BaseException as exc:  # surfaced by wait_until
            self.failure = exc
            raise

    def _follow(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[zmq.Socket[bytes], Indexer] = {}
        while not self._stop.is_set():
            with self.lock:
                for indexer in self._added:
                    poller.register(indexer.sub, zmq.POLLIN)
                    by_socket[indexer.sub] = indexer
                self._added.clear()
            for sock, _ in poller.poll(20):
                with self.lock:
                    by_socket[sock].on_message(sock.recv_multipart())

    def wait_until(self, name: str, last_seq: int, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.failure is not None:
                raise AssertionError("the router's thread failed") from self.failure
            with self.lock:
                seen = self.indexers[name].last_seq
            if seen >= last_seq:
                assert seen == last_seq, f"{name}: saw {seen}, the server says {last_seq}"
                return
            assert time.monotonic() < deadline, f"{name}: stuck at {seen}, server at {last_seq}"
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.destroy(linger=0)


# ------------------------------------------------------------------------- the server
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """``kvcm serve --data-dir`` in a subprocess, on fixed addresses across restarts."""

    def __init__(self, tmp_path: Path, port_label: str) -> None:
        self.port_label = port_label
        self.address = f"127.0.0.1:{_free_port()}"
        self.http = f"127.0.0.1:{_free_port()}"
        self.data_dir = tmp_path / "data"
        self.endpoint = f"ipc://{tmp_path}/pub"
        self.replay = f"ipc://{tmp_path}/replay"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvcm.server.cli", "serve", "--grpc-address", self.address,
             "--http-address", self.http, "--data-dir", str(self.data_dir),
             "--log-level", "WARNING", "--checkpoint-every-records", "40",
             "--kv-events-endpoint", self.endpoint, "--kv-events-replay-endpoint", self.replay,
             "--kv-events-port-label", self.port_label],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        with SchedulerClient(self.address, timeout=2.0) as client:
            while True:
                try:
                    client.list_pools()
                    return
                except Exception:
                    assert self.process.poll() is None, "kvcm serve exited"
                    assert time.monotonic() - started < 60, "kvcm serve did not start"
                    time.sleep(0.05)

    def peers(self) -> float:
        text = httpx.get(f"http://{self.http}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("kvcm_zmq_event_peers "):
                return float(line.split()[1])
        return 0.0

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=15)


@pytest.fixture(params=["data_parallel_rank", ""], ids=["socket-per-pool", "shared-socket"])
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    running = Server(tmp_path, request.param)
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def router() -> Iterator[Router]:
    following = Router()
    try:
        yield following
    finally:
        following.close()


# ------------------------------------------------------------------------- the workload
class Workload:
    """Engines' calls on the pools: admissions sharing prefixes (looked up, allocated, cached
    at once) and finishes; with 24 blocks per pool, cached blocks are evicted."""

    def __init__(self, client: SchedulerClient, seed: int) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.prefixes = [
            [self.rng.randrange(1, 30_000) for _ in range(self.rng.choice((32, 48, 64)))]
            for _ in range(6)
        ]
        self.live: dict[str, list[int]] = {pool: [] for pool in POOLS}
        self.next_key = 0

    def probes(self) -> list[list[int]]:
        return [[*prefix, 7, 7, 7] for prefix in self.prefixes] + [
            [*self.prefixes[0], *self.prefixes[1], 9]
        ]

    def step(self, pool: str) -> None:
        client, rng = self.client, self.rng
        if self.live[pool] and (rng.random() < 0.4 or len(self.live[pool]) > 2):
            client.free(pool, self.live[pool].pop(rng.randrange(len(self.live[pool]))))
            return
        key = self.next_key
        self.next_key += 1
        prompt = [*rng.choice(self.prefixes), *(rng.randrange(1, 30_000) for _ in range(20))]
        client.add_request(pool, key, prompt, HASHER.hash_token_ids(prompt))
        hit = client.get_computed_blocks(pool, key)
        num_hit = hit.num_computed_tokens
        blocks = client.allocate_slots(
            pool, key, len(prompt) - num_hit, 0, hit=hit if num_hit else None
        )
        if blocks is None:
            client.free(pool, key)
        else:
            self.live[pool].append(key)

    def forget(self, pool: str) -> None:
        """The pool was deleted: its requests went with it."""
        self.live[pool] = []


def _wire(server: Server, router: Router, client: SchedulerClient, pools: list[str]) -> None:
    """Open each pool's stream (DescribePool opens it) and wait until the router's sockets
    for them are connected (a subscriber that is not connected misses what is sent)."""
    for pool in pools:
        events = client.describe_pool(pool).zmq_events
        assert events is not None
        assert events.dedicated == bool(server.port_label)
        assert events.data_parallel_rank == POOLS.index(pool)
        if pool not in router.indexers:
            # On the shared socket only a consumer that reads topics can tell pools apart.
            topic = None if server.port_label else events.topic
            router.follow(pool, events.endpoint, events.replay_endpoint, topic)
    deadline = time.monotonic() + 15
    while server.peers() < len(router.indexers):
        assert time.monotonic() < deadline, "the router's sockets did not connect"
        time.sleep(0.05)
    time.sleep(0.3)  # the subscriptions travel after the connection


def _probe(router: Router, client: SchedulerClient, workload: Workload, pools: list[str]) -> int:
    """Each live pool's view in the router equals the pool's own answer, for every probe."""
    checked = 0
    for pool in pools:
        events = client.describe_pool(pool).zmq_events
        assert events is not None
        router.wait_until(pool, events.last_seq)
        for prompt in workload.probes():
            answer = client.lookup(LookupQuery(token_ids=prompt, pool_ids=[pool]))
            theirs = answer.pools[0].num_hit_tokens
            with router.lock:
                ours = router.indexers[pool].hit_tokens(prompt)
            assert ours == theirs, f"{pool}: the router says {ours} tokens, the pool {theirs}"
            checked += 1
    return checked


def _run(workload: Workload, pools: list[str], steps: int) -> None:
    for _ in range(steps):
        workload.step(workload.rng.choice(pools))


def test_a_router_follows_every_pool_through_deletes_and_kill_9(
    server: Server, router: Router
) -> None:
    with SchedulerClient(server.address, timeout=10.0) as client:
        for rank, pool in enumerate(POOLS):
            client.create_pool(pool, _config(rank))
        _wire(server, router, client, list(POOLS))
        workload = Workload(client, seed=23)
        checked = 0
        for _ in range(3):
            _run(workload, list(POOLS), 40)
            checked += _probe(router, client, workload, list(POOLS))
        hits = sum(router.indexers[p].hit_tokens(q) for p in POOLS for q in workload.probes())
        assert hits > 0, "the workload left nothing cached: the probes compare nothing"

        # p1 deleted and created again under the same id: its numbering goes on.
        before = client.describe_pool("p1").zmq_events
        assert before is not None
        client.delete_pool("p1")
        workload.forget("p1")
        client.create_pool("p1", _config(1))
        after = client.describe_pool("p1").zmq_events
        assert after is not None
        assert after.last_seq == before.last_seq + 1  # its AllBlocksCleared
        _run(workload, list(POOLS), 40)
        checked += _probe(router, client, workload, list(POOLS))

        # p2 deleted, then the server killed before it is created again.
        p2_before = client.describe_pool("p2").zmq_events
        assert p2_before is not None
        client.delete_pool("p2")
        workload.forget("p2")
        cleared_at = p2_before.last_seq + 1  # its AllBlocksCleared
        _run(workload, ["p0", "p1", "p3"], 30)
        live = ["p0", "p1", "p3"]
        checked += _probe(router, client, workload, live)
        router.wait_until("p2", cleared_at)
        assert router.indexers["p2"].blocks == set()  # it saw AllBlocksCleared
        _run(workload, live, 15)  # batches the router may not have seen yet: replayed later
        last_before_kill = {p: client.describe_pool(p).zmq_events.last_seq for p in live}  # type: ignore[union-attr]
    server.kill()
    server.start()
    with SchedulerClient(server.address, timeout=10.0) as client:
        workload.client = client
        for pool in live:  # the numbering survived: recovered from the data directory
            events = client.describe_pool(pool).zmq_events
            assert events is not None
            assert events.last_seq == last_before_kill[pool]
        client.create_pool("p2", _config(2))
        pools = list(POOLS)
        _wire(server, router, client, pools)
        p2 = client.describe_pool("p2").zmq_events
        assert p2 is not None
        assert p2.last_seq == cleared_at  # re-created after the restart: goes on after it
        # A consumer of p0 that joins now: its first batch is a gap; it replays from 0.
        late = client.describe_pool("p0").zmq_events
        assert late is not None
        late_topic = None if server.port_label else late.topic
        router.follow("late-p0", late.endpoint, late.replay_endpoint, late_topic)
        _wire(server, router, client, [])
        for _ in range(3):
            _run(workload, pools, 40)
            checked += _probe(router, client, workload, pools)
        router.wait_until("late-p0", client.describe_pool("p0").zmq_events.last_seq)  # type: ignore[union-attr]
        with router.lock:
            assert router.indexers["late-p0"].blocks == router.indexers["p0"].blocks
            assert router.indexers["late-p0"].replays >= 1
    for name, indexer in router.indexers.items():
        # In order, each number once, never backwards.
        assert indexer.applied == sorted(set(indexer.applied)), name
    assert sum(indexer.replays for indexer in router.indexers.values()) >= 1
    print(f"{checked} probes agreed")
