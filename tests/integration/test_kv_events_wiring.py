"""What DescribePool and ``GET /v1/pools`` tell a router operator about a pool's ZMQ stream.

A real server (gRPC and HTTP on loopback, the ZMQ stream on ipc sockets) in each of the two
layouts: every pool on one socket (told apart by topic), and one socket per pool
(``kv_events_port_label``). The answers must name the socket a consumer connects to, the
topic, the last wire ``seq`` (which a re-created pool continues), the rank, whether the socket
carries the pool alone, and the hashing parameters, the seed never over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from kvcm.client import SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=16,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)


def _config(events: bool = True, **labels: str) -> PoolConfig:
    return PoolConfig(
        max_model_len=256,
        explicit_layout=LAYOUT,
        enable_kv_cache_events=events,
        hash_seed="secret-seed",
        labels={"model": "m", **labels},
    )


def _server(tmp_path: Path, port_label: str) -> EmbeddedServer:
    return start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            log_level="WARNING",
            kv_events_endpoint=f"ipc://{tmp_path}/pub",
            kv_events_replay_endpoint=f"ipc://{tmp_path}/replay",
            kv_events_port_label=port_label,
        )
    )


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[EmbeddedServer]:
    server = _server(tmp_path, "")
    yield server
    server.stop()


@pytest.fixture
def per_rank(tmp_path: Path) -> Iterator[EmbeddedServer]:
    server = _server(tmp_path, "data_parallel_rank")
    yield server
    server.stop()


def _cache_one_prompt(client: SchedulerClient, pool: str, key: int) -> None:
    prompt = list(range(100 + key, 164 + key))
    client.add_request(pool, key, prompt, client.block_hasher(pool).hash_token_ids(prompt))
    assert client.allocate_slots(pool, key, len(prompt), 0) is not None


def test_shared_socket_pools_differ_by_topic_and_are_not_dedicated(
    shared: EmbeddedServer, tmp_path: Path
) -> None:
    with SchedulerClient(shared.grpc_address, timeout=10.0) as client:
        client.create_pool("a", _config(data_parallel_rank="3"))
        client.create_pool("b", _config())
        client.create_pool("quiet", _config(events=False))
        a = client.describe_pool("a").zmq_events
        b = client.describe_pool("b").zmq_events
        assert a is not None
        assert b is not None
        assert client.describe_pool("quiet").zmq_events is None
        assert (a.endpoint, a.replay_endpoint) == (
            f"ipc://{tmp_path}/pub",
            f"ipc://{tmp_path}/replay",
        )
        assert (b.endpoint, b.replay_endpoint) == (a.endpoint, a.replay_endpoint)
        assert (a.topic, b.topic) == ("kv@a@m", "kv@b@m")
        assert (a.data_parallel_rank, b.data_parallel_rank) == (3, 0)
        assert not a.dedicated
        assert not b.dedicated
        assert a.last_seq == -1  # nothing published yet
        _cache_one_prompt(client, "a", 1)
        first = client.describe_pool("a").zmq_events
        assert first is not None
        assert first.last_seq == 0
        # Deleted and created again: it goes on after its AllBlocksCleared (wire seq 1).
        client.delete_pool("a")
        client.create_pool("a", _config(data_parallel_rank="3"))
        again = client.describe_pool("a").zmq_events
        assert again is not None
        assert again.last_seq == 1
        _cache_one_prompt(client, "a", 1)
        last = client.describe_pool("a").zmq_events
        assert last is not None
        assert last.last_seq == 2
        client.delete_pool("b")
        alone = client.describe_pool("a").zmq_events
        assert alone is not None
        assert alone.dedicated  # the only publishing pool left on the socket


def test_per_rank_sockets_follow_vllms_rule_and_http_shows_the_same(
    per_rank: EmbeddedServer, tmp_path: Path
) -> None:
    with SchedulerClient(per_rank.grpc_address, timeout=10.0) as client:
        for rank in range(3):
            client.create_pool(f"engine-{rank}", _config(data_parallel_rank=str(rank)))
        client.create_pool("unlabelled", _config())  # shares rank 0's socket
        described = {
            name: client.describe_pool(name).zmq_events
            for name in ("engine-0", "engine-1", "engine-2", "unlabelled")
        }
        _cache_one_prompt(client, "engine-2", 7)
        engine2 = client.describe_pool("engine-2")
    e1 = described["engine-1"]
    e2 = described["engine-2"]
    assert e1 is not None
    assert e2 is not None
    assert e1.endpoint == f"ipc://{tmp_path}/pub_dp1"
    assert e1.replay_endpoint == f"ipc://{tmp_path}/replay_dp1"
    assert e2.endpoint == f"ipc://{tmp_path}/pub_dp2"
    assert e1.dedicated
    assert e2.dedicated
    assert not described["engine-0"].dedicated  # type: ignore[union-attr]
    assert described["unlabelled"].endpoint == f"ipc://{tmp_path}/pub"  # type: ignore[union-attr]

    # Over HTTP: the same stream, the labels, the epoch and the hashing without its seed.
    with httpx.Client(base_url=f"http://{per_rank.http_address}", timeout=5.0) as http:
        summary = http.get("/v1/pools/engine-2").json()
        listed = {p["name"]: p for p in http.get("/v1/pools").json()["pools"]}
    assert summary == listed["engine-2"]
    assert summary["labels"] == {"model": "m", "data_parallel_rank": "2"}
    assert summary["epoch"] == engine2.epoch
    assert summary["hashing"] == {
        "algorithm": str(engine2.hashing.algorithm),
        "hash_block_size": 16,
        "hash_length_bytes": engine2.hashing.hash_length_bytes,
    }
    assert "secret-seed" not in http_text(summary)
    assert summary["zmq_events"] == {
        "endpoint": f"ipc://{tmp_path}/pub_dp2",
        "replay_endpoint": f"ipc://{tmp_path}/replay_dp2",
        "topic": "kv@engine-2@m",
        "last_seq": 0,
        "data_parallel_rank": 2,
        "dedicated": True,
    }
    # The replay socket named there answers vLLM's request with that pool's batch alone.
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(summary["zmq_events"]["replay_endpoint"])
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        assert dealer.poll(10_000)
        _, topic, seq, payload = dealer.recv_multipart()
        assert (topic, int.from_bytes(seq, "big")) == (b"kv@engine-2@m", 0)
        assert msgspec.msgpack.decode(payload)[2] == 2  # its data_parallel_rank
        assert dealer.poll(10_000)
        assert dealer.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True)
    finally:
        dealer.close(linger=0)
        ctx.destroy(linger=0)


def http_text(value: object) -> str:
    return msgspec.json.encode(value).decode()
