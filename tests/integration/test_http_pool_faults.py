"""One pool's broken state cannot break ``/metrics`` or ``/v1/pools`` for the others.

Snapshots are checked against the core's invariants before a pool is built on them, so no
client can put a pool in such a state; this test breaks a real pool of a real server in
memory (as a bug would) and reads the HTTP routes over real HTTP: the pool is left out of the
scrape and the listing, counted in ``kvcm_pool_read_errors_total``, its own route answers 500,
and every other pool is answered as before.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvcm.client import SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

_SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=256,
    explicit_layout=KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=_SPEC),),
    ),
)


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", log_level="CRITICAL")
    )
    try:
        with SchedulerClient(running.grpc_address) as client:
            for pool_id in ("healthy", "broken"):
                client.create_pool(pool_id, CONFIG)
        yield running
    finally:
        running.stop(grace_s=0.5)


def _get(server: EmbeddedServer, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{server.http_address}{path}", timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _break(server: EmbeddedServer, attribute: str, value: object) -> None:
    pool = server.server.state.registry.get("broken")

    async def corrupt() -> None:
        setattr(pool, attribute, value)

    server.call(corrupt())


@pytest.mark.parametrize(
    ("attribute", "value"),
    [("_stats_total", "garbage"), ("allocations_not_fit_total", math.nan)],
    ids=["snapshot raises", "a number that is not one"],
)
def test_a_broken_pool_is_left_out_and_counted(
    server: EmbeddedServer, attribute: str, value: object
) -> None:
    _break(server, attribute, value)
    for _ in range(2):
        status, body = _get(server, "/metrics")
        assert status == 200
        assert b'kvcm_blocks{pool="healthy"} 8.0' in body
        assert b'kvcm_blocks{pool="broken"}' not in body
        status, body = _get(server, "/v1/pools")
        assert status == 200
        assert [summary["name"] for summary in json.loads(body)["pools"]] == ["healthy"]
        assert _get(server, "/v1/pools/healthy")[0] == 200
        status, body = _get(server, "/v1/pools/broken")
        assert status == 500
        assert json.loads(body)["error"]["code"] == "INTERNAL"
    _, body = _get(server, "/metrics")
    # Two scrapes, two listings and two single reads before this scrape, which adds one.
    assert b'kvcm_pool_read_errors_total{pool="broken"} 7.0' in body
