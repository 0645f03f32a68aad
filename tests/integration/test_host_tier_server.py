"""A pool with a host tier on a real server: created over gRPC, driven through the SDK, read
back over HTTP (``/v1/pools``, ``/metrics``) and through the SDK's Lookup.

The pool is small, so the requests evict each other's cached blocks; on the server those
blocks demote to the pool's host tier (docs/host-tier.md). The host tier's counters must agree
between the JSON summary and the exposition, and a Lookup of an evicted prompt must report the
tokens the tier holds (``tier_hit_tokens["CPU"]``) through the wire's tier columns.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvcm.client import SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.lookup import LookupQuery
from kvcm.core.pool import PoolConfig

BLOCK_SIZE = 16
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
POOL = "host-tier-pool"


def _admit_and_finish(client: SchedulerClient, key: int, prompt: list[int]) -> None:
    hashes = client.block_hasher(POOL).hash_token_ids(prompt)
    client.add_request(POOL, key, prompt, hashes, request_id=f"req-{key}")
    hit = client.get_computed_blocks(POOL, key)
    blocks = client.allocate_slots(
        POOL, key, len(prompt) - hit.num_computed_tokens, hit.num_computed_tokens, hit=hit
    )
    assert blocks is not None
    client.free(POOL, key)


def test_a_server_pool_demotes_evicted_blocks_and_reports_them(
    client: SchedulerClient, kvcm_http_address: str
) -> None:
    layout = KVCacheConfig(
        num_blocks=17,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=SPEC),),
    )
    client.create_pool(
        POOL,
        PoolConfig(
            max_model_len=1024,
            explicit_layout=layout,
            host_tier_bytes=64 * SPEC.page_size_bytes,
        ),
    )
    try:
        first = [1000 + i for i in range(4 * BLOCK_SIZE)]
        _admit_and_finish(client, 1, first)
        for key in range(2, 6):  # 4 x 4 blocks of fresh tokens: the first prompt is evicted
            _admit_and_finish(client, key, [key * 10_000 + i for i in range(4 * BLOCK_SIZE)])
        answer = client.lookup(LookupQuery(token_ids=[*first, 7], pool_ids=[POOL]))
        (hit,) = answer.pools
        assert hit.num_hit_tokens == 0
        assert dict(hit.tier_hit_tokens) == {"GPU": 0, "CPU": 4 * BLOCK_SIZE}

        with httpx.Client(base_url=f"http://{kvcm_http_address}", timeout=5.0) as http:
            summary = http.get(f"/v1/pools/{POOL}").json()
            text = http.get("/metrics").text
        tier = summary["host_tier"]
        assert tier["blocks"] == 64
        assert tier["demoted_blocks"] >= 4
        assert tier["used_blocks"] == tier["demoted_blocks"]  # nothing evicted from the tier
        assert tier["loaded_blocks"] == 0
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.labels.get("pool") == POOL and s.name.startswith("kvcm_host_tier")
        }
        assert samples["kvcm_host_tier_blocks"] == 64
        assert samples["kvcm_host_tier_used_blocks"] == tier["used_blocks"]
        assert samples["kvcm_host_tier_demoted_blocks_total"] == tier["demoted_blocks"]
        assert samples["kvcm_host_tier_evicted_blocks_total"] == 0
    finally:
        client.delete_pool(POOL)
