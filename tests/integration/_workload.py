"""A shared-prefix workload driven through the real SDK, for the HTTP and Prometheus tests.

Requests share a few long prompt prefixes (so the prefix cache hits), the pool is small (so
cached blocks get evicted and an oversized request does not fit), and one call names a pool
that does not exist (so an RPC fails with NOT_FOUND). Every figure the tests compare comes from
the server; this module only produces traffic.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from kvcm.client import PoolConfig, SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import NotFoundError
from kvcm.common.specs import FullAttentionSpec

BLOCK_SIZE = 16
MISSING_POOL = "no-such-pool"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadReport:
    """What the driver did (not what the server counted).

    Attributes:
        admitted: Requests whose prompt got slots.
        not_fit: Allocations answered "does not fit".
    """

    admitted: int
    not_fit: int


def create_pool(client: SchedulerClient, pool_id: str, *, num_blocks: int = 48) -> None:
    """Create a one-group full-attention pool planned at once (no workers needed)."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16
    )
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )
    client.create_pool(
        pool_id,
        PoolConfig(max_model_len=4096, explicit_layout=layout, hash_algorithm="sha256_cbor"),
    )


def run_shared_prefix_workload(
    client: SchedulerClient,
    pool_id: str,
    *,
    num_requests: int = 60,
    num_prefixes: int = 3,
    prefix_blocks: int = 4,
    suffix_tokens: int = 24,
    max_running: int = 3,
    first_key: int = 0,
    seed: int = 0,
) -> WorkloadReport:
    """Admit requests that share prompt prefixes, the way a scheduler admits waiting ones.

    Each request is added, looked up in the prefix cache, and given slots for the rest of its
    prompt; at most ``max_running`` hold blocks at once (the oldest finishes first). At the end
    one oversized request does not fit, every request is finished, and one call names a pool
    that does not exist.

    Returns:
        How many requests got slots and how many allocations did not fit.
    """
    rng = random.Random(seed)
    hasher = client.block_hasher(pool_id)
    prefixes = [
        [rng.randrange(1, 32_000) for _ in range(prefix_blocks * BLOCK_SIZE)]
        for _ in range(num_prefixes)
    ]
    running: deque[int] = deque()
    admitted = not_fit = 0
    for key in range(first_key, first_key + num_requests):
        prompt = prefixes[key % num_prefixes] + [
            rng.randrange(1, 32_000) for _ in range(suffix_tokens)
        ]
        if not _admit(client, pool_id, key, prompt, hasher.hash_token_ids(prompt)):
            not_fit += 1
            continue
        admitted += 1
        running.append(key)
        if len(running) > max_running:
            client.free(pool_id, running.popleft())
    # Larger than the whole pool: answered "does not fit", counted by the server.
    huge_key = first_key + num_requests
    huge = [rng.randrange(1, 32_000) for _ in range(BLOCK_SIZE * 64)]
    if not _admit(client, pool_id, huge_key, huge, hasher.hash_token_ids(huge)):
        not_fit += 1
    else:
        running.append(huge_key)
    while running:
        client.free(pool_id, running.popleft())
    try:
        client.get_usage(MISSING_POOL)
    except NotFoundError:
        pass
    else:  # pragma: no cover - the server would be wrong
        raise AssertionError(f"pool {MISSING_POOL!r} exists")
    return WorkloadReport(admitted=admitted, not_fit=not_fit)


def _admit(
    client: SchedulerClient, pool_id: str, key: int, prompt: list[int], hashes: list[bytes]
) -> bool:
    """Add, look up and allocate one waiting request; finish it again if it does not fit."""
    client.add_request(pool_id, key, prompt, hashes, request_id=f"req-{key}")
    hit = client.get_computed_blocks(pool_id, key)
    blocks = client.allocate_slots(
        pool_id, key, len(prompt) - hit.num_computed_tokens, hit.num_computed_tokens, hit=hit
    )
    if blocks is None:
        client.free(pool_id, key)
        return False
    return True
