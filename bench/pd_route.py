"""The P/D routing call's latency (``RoutePd``), against one ``Lookup`` over the decode pools.

A ``kvcm serve`` process on 127.0.0.1 holds ``--prefill`` prefill and ``--decode`` decode pools
(full attention, 16-token blocks), warmed with multi-turn conversations spread over them (each
conversation's history cached on one decode pool, its system prompt on the prefill pools). Each
sample routes the next turn of a random conversation through the SDK (``SchedulerClient``,
one gRPC call), as ``kvcm pd-proxy`` does per request. Rows: token prompts, hashed prompts,
bidirectional, and, for scale, a single ``Lookup`` over the decode scope (RoutePd is two
lookups and a ranking). Prints the median and the p99 of each row, in milliseconds.

    python bench/pd_route.py                    # 2 prefill + 8 decode pools, 2k-token prompts
    python bench/pd_route.py --decode 64 --samples 400
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import frozen_gc, kvcm_server, p99

from kvcm.client import (
    HeldRequest,
    LookupQuery,
    PdRouteQuery,
    PdScope,
    PoolConfig,
    SchedulerClient,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec

BLOCK = 16


def _config(num_blocks: int, role: str) -> PoolConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16)
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )
    return PoolConfig(max_model_len=32768, explicit_layout=layout, labels={"role": role})


def _cache(
    client: SchedulerClient, pool_id: str, key: int, prompt: list[int], *, hold: bool = False
) -> None:
    """Serve ``prompt`` on the pool; ``hold``: keep its blocks (a decode engine's held
    request, id ``h<key>``), else free them (cached)."""
    hashes = client.block_hasher(pool_id).hash_token_ids(prompt)
    client.add_request(pool_id, key, prompt, hashes, request_id=f"h{key}")
    hit = client.get_computed_blocks(pool_id, key)
    client.allocate_slots(
        pool_id, key, len(prompt) - hit.num_computed_tokens, hit.num_computed_tokens, hit=hit
    )
    if not hold:
        client.free(pool_id, key)


def _rows(rows: Sequence[tuple[str, Callable[[], object]]], samples: int) -> None:
    """Time every row, samples interleaved (row 1, row 2, ..., row 1, ...) so that the
    machine's drift hits them alike; print each row's median and p99."""
    for _, run in rows:
        for _ in range(5):
            run()
    times: list[list[float]] = [[] for _ in rows]
    with frozen_gc():
        for _ in range(samples):
            for index, (_, run) in enumerate(rows):
                started = time.perf_counter()
                run()
                times[index].append(time.perf_counter() - started)
    for (name, _), taken in zip(rows, times, strict=True):
        taken.sort()
        median, tail = statistics.median(taken) * 1e3, p99(taken) * 1e3
        print(f"{name:<52} median {median:7.2f} ms   p99 {tail:7.2f} ms", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, default=2, help="prefill pools (default 2)")
    parser.add_argument("--decode", type=int, default=8, help="decode pools (default 8)")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prefill = [f"bench-p{i}" for i in range(args.prefill)]
    decode = [f"bench-d{i}" for i in range(args.decode)]
    system = [rng.randrange(1, 50_000) for _ in range(512)]
    histories = [
        system + [rng.randrange(1, 50_000) for _ in range(args.prompt_tokens - 512)]
        for _ in range(args.conversations)
    ]
    blocks = max(4096, 2 * args.conversations * args.prompt_tokens // BLOCK // args.decode)
    with kvcm_server() as address, SchedulerClient(address, timeout=30.0) as client:
        for pool_id in prefill:
            client.create_pool(pool_id, _config(blocks, "prefill"))
            _cache(client, pool_id, 1, system)
        for pool_id in decode:
            client.create_pool(pool_id, _config(blocks, "decode"))
        held = []
        for index, history in enumerate(histories):
            pool_id = decode[index % len(decode)]
            hold = index % 4 == 0  # a quarter of the conversations still held for a pull
            _cache(client, pool_id, index + 2, history, hold=hold)
            if hold:
                held.append(HeldRequest(pool_id, f"h{index + 2}"))
        print(
            f"{args.prefill} prefill + {args.decode} decode pools of {blocks} blocks; "
            f"{args.conversations} conversations of {args.prompt_tokens} tokens cached; "
            f"{args.samples} samples per row",
            flush=True,
        )

        turns = [history + [rng.randrange(1, 50_000) for _ in range(32)] for history in histories]
        hasher = client.block_hasher(decode[0])
        hashed_turns = [b"".join(hasher.hash_token_ids(turn)) for turn in turns]

        def next_turn() -> list[int]:
            return rng.choice(turns)

        def route(
            bidirectional: bool, hashed: bool, with_held: bool = False, best: int = 0
        ) -> Callable[[], object]:
            def run() -> object:
                index = rng.randrange(len(turns))
                if hashed:
                    query = LookupQuery(
                        block_hashes=hashed_turns[index], num_tokens=len(turns[index])
                    )
                else:
                    query = LookupQuery(token_ids=turns[index], max_results=best)
                answer = client.route_pd(
                    PdRouteQuery(
                        prompt=query,
                        prefill=PdScope(labels={"role": "prefill"}),
                        decode=PdScope(labels={"role": "decode"}),
                        bidirectional=bidirectional,
                        held=held if with_held else (),
                    )
                )
                assert answer.decode_hit_tokens >= args.prompt_tokens - BLOCK
                return answer

            return run

        def lookup() -> object:
            return client.lookup(LookupQuery(token_ids=next_turn(), labels={"role": "decode"}))

        _rows(
            [
                ("RoutePd, token prompt", route(False, False)),
                ("RoutePd, token prompt, bidirectional", route(True, False)),
                (
                    f"RoutePd, token prompt, bidirectional, {len(held)} held",
                    route(True, False, with_held=True),
                ),
                ("RoutePd, hashed prompt", route(False, True)),
                ("RoutePd, token prompt, best 3 per role", route(False, False, best=3)),
                ("Lookup over the decode pools, token prompt", lookup),
            ],
            args.samples,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
