"""A router on vLLM's ZMQ wire follows a pool across an etcd-driven failover (docs/kv-events.md,
"KV events in a cluster").

Three ``kvcm serve --data-dir`` replicas (each pool has a ``sync`` standby), each publishing on
its own ZMQ sockets, one per pool: the pools carry a ``zmq_port_offset`` label unique in the
cluster (``--kv-events-port-label``), so a pool has a socket of its own on whichever replica
serves it. The router is a real router's kind: topic-blind, it drops sequence numbers it has
seen, replays a gap through the replay socket, and finds its pool's sockets with DescribePool
through the seed list, reading it again after a silence. Under Step load the pool's primary is
killed with SIGKILL; its standby takes it over once the lease expires; the router moves there
by itself. In the end the batches it applied are exactly the new primary's (each number once,
byte for byte), and the blocks it holds (BlockStored minus BlockRemoved) equal those of the
pool's own event log read over gRPC from the new primary.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import aetcd
import msgspec
import pytest
import zmq
from _cluster import Etcd, Replica, wait_for_members

from kvcm.client import ItemStatus, SchedulerClient, ServiceError, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.common.hashing import external_block_hash
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.cluster import Placement

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=64,  # small: the load evicts, so BlockRemoved batches come too
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)
LEASE_TTL_S = 2
PREFIX = "/kvcm-test-zmq-router"
POOLS = {"zr-a": "1", "zr-b": "2", "zr-c": "3"}  # pool id -> its cluster-wide socket offset
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _config(offset: str) -> PoolConfig:
    return PoolConfig(
        max_model_len=1024,
        explicit_layout=LAYOUT,
        enable_kv_cache_events=True,
        labels={"zmq_port_offset": offset},
    )


@pytest.fixture
def cluster(etcd: Etcd, tmp_path: Path) -> Iterator[list[Replica]]:
    started = [
        Replica(etcd, PREFIX, lease_ttl_s=LEASE_TTL_S, data_dir=tmp_path / f"r{i}")
        for i in range(3)
    ]
    try:
        for i, replica in enumerate(started):
            wiring = {
                "KVCM_KV_EVENTS_ENDPOINT": f"ipc://{tmp_path}/r{i}-pub",
                "KVCM_KV_EVENTS_REPLAY_ENDPOINT": f"ipc://{tmp_path}/r{i}-replay",
                "KVCM_KV_EVENTS_PORT_LABEL": "zmq_port_offset",
            }
            with mock.patch.dict(os.environ, wiring):  # read when the process is spawned
                replica.spawn()
        for replica in started:
            replica.wait_serving()
        wait_for_members(started, 3)
        yield started
    finally:
        for replica in started:
            replica.stop(signal.SIGKILL)


class Router:
    """One pool's indexer, as a topic-blind router keeps it (its own thread)."""

    def __init__(self, seeds: str, pool_id: str) -> None:
        self.seeds = seeds
        self.pool_id = pool_id
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.decoder = msgspec.msgpack.Decoder()
        self.sub: zmq.Socket[bytes] | None = None
        self.endpoint = ""
        self.replay_endpoint = ""
        self.last_seq = -1
        self.applied: list[tuple[int, bytes]] = []
        self.blocks: set[int] = set()
        self.moves = 0  # times DescribePool named other sockets
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._guarded, daemon=True)
        self._thread.start()

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # surfaced by close()
            self.failure = exc

    def _locate(self) -> None:
        """Read the pool's sockets with DescribePool through the seeds; move if they changed."""
        try:
            with SchedulerClient(self.seeds, timeout=2.0) as client:
                wiring = client.describe_pool(self.pool_id).zmq_events
        except ServiceError:
            return  # no primary answers yet (a failover): asked again after the next silence
        if wiring is None or not wiring.dedicated:
            raise AssertionError(f"{self.pool_id} has no socket of its own: {wiring}")
        if wiring.endpoint != self.endpoint:
            if self.sub is not None:
                self.sub.close(linger=0)
                self.moves += 1
            self.sub = self.ctx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")  # topic-blind
            self.sub.connect(wiring.endpoint)
            self.endpoint, self.replay_endpoint = wiring.endpoint, wiring.replay_endpoint
        if wiring.last_seq > self.last_seq:  # what went out while it was not listening
            self._replay(self.last_seq + 1)

    def _run(self) -> None:
        self._locate()
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            if self.sub is not None and self.sub.poll(50):
                _topic, seq_bytes, payload = self.sub.recv_multipart()
                quiet_since = time.monotonic()
                seq = int.from_bytes(seq_bytes, "big")
                if seq <= self.last_seq:
                    continue  # seen
                if seq > self.last_seq + 1:
                    self._replay(self.last_seq + 1)
                    if seq <= self.last_seq:
                        continue
                self._apply(seq, payload)
            elif time.monotonic() - quiet_since > 0.5:  # silence: is it served elsewhere now?
                self._locate()
                quiet_since = time.monotonic()
            elif self.sub is None:
                time.sleep(0.05)

    def _replay(self, start: int) -> None:
        """vLLM's replay request; applies what is newer than what it has (none if the replica
        does not answer: it is asked again after the next silence)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not dealer.poll(1000):
                    return
                _, _topic, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_SEQ:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.last_seq:
                    assert seq == self.last_seq + 1, "a replay skipped batches"
                    self._apply(seq, payload)
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        _ts, events, _rank = self.decoder.decode(payload)
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                assert not self.blocks & set(event["block_hashes"]), "a block stored twice"
                self.blocks.update(event["block_hashes"])
            elif kind == "BlockRemoved":
                assert set(event["block_hashes"]) <= self.blocks, "removed a block not held"
                self.blocks.difference_update(event["block_hashes"])
            else:
                assert kind == "AllBlocksCleared", kind
                self.blocks.clear()
        self.last_seq = seq
        self.applied.append((seq, payload))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self.sub is not None:
            self.sub.close(linger=0)
        self.ctx.destroy(linger=0)
        if self.failure is not None:
            raise self.failure


def _replay_all(endpoint: str) -> list[tuple[int, bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)
        ctx.destroy(linger=0)


def _blocks_of_event_log(client: SchedulerClient, pool: str, until: int) -> set[int]:
    """The blocks the pool's gRPC event log leaves stored (router-side hashes)."""
    blocks: set[int] = set()
    stream = client.subscribe_events(pool, start_sequence=1, timeout=20.0)
    try:
        for batch in stream:
            for offset, event in enumerate(batch.events):
                if isinstance(event, BlockStored):
                    blocks.update(external_block_hash(h) for h in event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    blocks.difference_update(external_block_hash(h) for h in event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    blocks.clear()
                if batch.first_sequence + offset >= until:
                    return blocks
    finally:
        stream.close()
    return blocks


def _step(client: SchedulerClient, pool: str, seq: int, deadline: float) -> None:
    """Step ``seq`` (exactly once): admit a fresh 3-block prompt, cache it, finish the request
    admitted two steps earlier (its blocks stay cached; evicted as the pool fills)."""
    prompt = [seq * 1000 + i for i in range(48)]
    while True:
        try:
            # The hasher's DescribePool is a call too: during a failover it may fail as the
            # Step may (UnavailableError once its reroutes ran out), and is retried with it.
            step = StepBuilder()
            step.step_seq = seq
            step.add_request(seq, prompt, client.block_hasher(pool).hash_token_ids(prompt))
            step.allocate(seq, len(prompt), 0, lookup=True)
            step.cache_blocks(seq, len(prompt))
            if seq > 2:
                step.finish(seq - 2)
            result = client.step(pool, step, timeout=5.0)
            assert result.statuses[0] is ItemStatus.OK, result.statuses
            return
        except ServiceError:
            assert time.monotonic() < deadline, f"step {seq} never acknowledged"
            time.sleep(0.1)


def test_a_topic_blind_router_follows_its_pool_across_a_kill_9(
    etcd: Etcd, cluster: list[Replica]
) -> None:
    seeds = ",".join(replica.address for replica in cluster)
    with SchedulerClient(seeds, timeout=10.0) as client:
        for pool, offset in POOLS.items():
            client.create_pool(pool, _config(offset))
        pool = "zr-a"
        described = client.describe_pool(pool)
        assert described.zmq_events is not None
        assert described.zmq_events.dedicated
        router = Router(seeds, pool)
        try:
            time.sleep(0.3)  # the SUB socket's subscription reaches the publisher
            # The other pools publish too, on their own sockets (a router of zr-a never sees them).
            for other in ("zr-b", "zr-c"):
                for seq in range(1, 4):
                    _step(client, other, seq, time.monotonic() + 20)
            for seq in range(1, 16):
                _step(client, pool, seq, time.monotonic() + 20)
            primary = client.describe_pool(pool).zmq_events
            address = _primary_of(etcd, pool)
            victim = next(r for r in cluster if r.address == address)
            load_stop = threading.Event()
            # Under load: Steps keep coming from a second thread while the primary dies.
            seqs = iter(range(16, 10_000))
            done: list[int] = []

            def load() -> None:
                with SchedulerClient(seeds, timeout=10.0) as driver:
                    while not load_stop.is_set():
                        seq = next(seqs)
                        _step(driver, pool, seq, time.monotonic() + LEASE_TTL_S + 20)
                        done.append(seq)

            driver = threading.Thread(target=load, daemon=True)
            driver.start()
            time.sleep(0.5)
            victim.stop(signal.SIGKILL)
            killed_at = time.monotonic()
            at_kill = len(done)
            while len(done) < at_kill + 10:  # acknowledged by the new primary
                assert driver.is_alive(), "the load stopped"
                assert time.monotonic() - killed_at < LEASE_TTL_S + 25, "no failover"
                time.sleep(0.1)
            load_stop.set()
            driver.join(30)
            assert not driver.is_alive()
            after = client.describe_pool(pool)
            wiring = after.zmq_events
            assert wiring is not None
            assert primary is not None
            assert wiring.endpoint != primary.endpoint  # served by another replica now
            deadline = time.monotonic() + 15
            while router.last_seq < wiring.last_seq:
                assert router.failure is None, router.failure
                assert time.monotonic() < deadline, (router.last_seq, wiring.last_seq)
                time.sleep(0.05)
        finally:
            router.close()
        assert router.moves >= 1
        # Every batch once, in order, byte for byte the new primary's.
        theirs = _replay_all(wiring.replay_endpoint)
        assert [seq for seq, _ in router.applied] == list(range(wiring.last_seq + 1))
        assert router.applied == theirs, "the router's batches differ from the new primary's"
        # The blocks it holds are the pool's own, by its event log over gRPC.
        expected = _blocks_of_event_log(client, pool, after.last_event_sequence)
        assert router.blocks == expected
        assert len(router.blocks) > 0
        print(
            f"router: {len(router.applied)} batches, {len(router.blocks)} blocks, moved "
            f"{router.moves}x; steps acknowledged {len(done) + 15} ({at_kill + 15} at the kill)"
        )


def _primary_of(etcd: Etcd, pool: str) -> str:
    """The pool's primary, from its placement in etcd."""

    async def read() -> str:
        host, _, port = etcd.endpoint.removeprefix("http://").rpartition(":")
        async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
            got = await client.get(f"{PREFIX}/placement/{pool}".encode())
            assert got is not None, f"no placement for {pool}"
            return Placement.decode(got.value).primary

    return asyncio.run(read())
