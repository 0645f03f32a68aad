"""Benchmark: exact lookup across pools against asking every engine's vLLM manager.

Setup (untimed): ``--pools`` pools (default 1,000) of ``--blocks-per-pool`` blocks (default
10,000: 10M cached blocks in all), each full of cached blocks: a prefix of one of 20 shared
8,192-block documents (a random length from 256 blocks up: the shared system prompts and
documents of a real fleet) and unique blocks for the rest. vLLM 0.33.0 gets the same pools, one
``KVCacheManager`` per engine, filled by the same calls.

Rows (median and p99; ratio = vLLM / kvcm, above 1 means kvcm is faster):

1. lookup of a 1k-block and an 8k-block prompt (a random document's prefix plus one token),
   already hashed (``HashPrompt``): kvcm's ``PoolRegistry.lookup`` over every pool (every
   pool answered, and ``max_results=5`` as a router asks; on the server's event loop, as the
   servicer runs it), then the same as a ``Lookup`` RPC through the SDK to that server, twice:
   from a router's process ("Lookup RPC from router": the SDK in a process of its own, as a
   router calls it; wall time and the CPU of both processes) and with the client in the
   server's process ("Lookup RPC in-process": client, server loop and gRPC's threads share one
   interpreter lock; the SDK asks for the packed answer in both), then from the same router
   process over the server's lookup port ("Lookup over the lookup port from router": a client
   with ``lookup_address``, the same messages without grpcio's thread hops), against
   vLLM's ``get_computed_blocks`` called on each of the managers (what a router would have to
   do with vLLM's own code; the request is hashed once, outside the timing); "cold": best 5
   for a prompt made of one pool's own unique blocks (a prompt no other lookup asks for, so its
   keys are not in the CPU's caches, unlike the 20 shared documents' keys);
2. the same prompts as token ids: kvcm hashes them itself (sha256, once for all pools);
   every row again as CPU time ("(CPU)": the lookup thread's; for an RPC with the client
   in-process the process's, client and server together; for an RPC from a router process the
   router's process CPU plus the server process's), since on a shared machine wall time holds
   other processes' time too; then the issue's p99 targets against both;
3. the index's cost on the allocation path: admitting and freeing 64-block requests in a pool
   whose cache is full (each admission evicts and caches 64 blocks), index attached or not;
4. the KV events routers read instead: events per second on vLLM's ZMQ wire and the stream's
   cost on the Step RPC (``bench/kv_events.py``'s measurement; ``--no-events`` skips it).

Every timed kvcm answer is checked against vLLM's per-manager answers of the same sample.

    python bench/lookup.py [--pools N] [--blocks-per-pool N] [--repeats N] [--no-vllm]
                           [--no-events] [--profile]

``--profile`` then prints where a lookup's CPU time goes (cProfile over the same kinds of
lookup: hashed best 5 and all pools, hashing excluded; token ids best 5, hashing included).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import random
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from _common import (
    Row,
    Sample,
    Timing,
    frozen_gc,
    import_vllm,
    init_vllm_none_hash,
    measure,
    print_table,
)

from kvcm.client import SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher, HashAlgorithm
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.limits import Limits
from kvcm.core.lookup import LookupAnswer, LookupQuery
from kvcm.core.pool import Pool, PoolConfig, PoolRegistry
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

BLOCK_SIZE = 16
HASH_SEED = "kvcm-bench"
NUM_DOCUMENTS = 20
DOCUMENT_BLOCKS = 8192
MAX_MODEL_LEN = DOCUMENT_BLOCKS * BLOCK_SIZE + 1024
FILL_BLOCKS = 1000  # blocks per filling request
VLLM_MODULES = (
    "vllm.utils.hashing",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.request",
    "vllm.sampling_params",
)


class Fleet:
    """What every pool caches: (document, prefix blocks, filler hash chunks) per pool."""

    def __init__(self, num_pools: int, blocks_per_pool: int, seed: int) -> None:
        rng = random.Random(seed)
        self.hasher = BlockHasher(BLOCK_SIZE, HashAlgorithm.SHA256, HASH_SEED)
        self.documents = [
            [rng.randrange(32_000) for _ in range(DOCUMENT_BLOCKS * BLOCK_SIZE)]
            for _ in range(NUM_DOCUMENTS)
        ]
        self.document_hashes = [self.hasher.hash_token_ids(doc) for doc in self.documents]
        self.filler_tokens = [0] * (FILL_BLOCKS * BLOCK_SIZE)
        self.pools: list[tuple[int, int, list[bytes]]] = []
        for index in range(num_pools):
            prefix = rng.randint(256, min(DOCUMENT_BLOCKS, blocks_per_pool))
            rest = blocks_per_pool - prefix
            fillers = []
            while rest > 0:
                size = min(FILL_BLOCKS, rest)
                fillers.append(os.urandom(32 * size))
                rest -= size
            self.pools.append((index % NUM_DOCUMENTS, prefix, fillers))
        self.num_blocks = blocks_per_pool + 1

    def requests(self, index: int) -> list[tuple[list[int], list[bytes]]]:
        """The (tokens, hashes) of the requests that fill pool ``index``, in order."""
        document, prefix, fillers = self.pools[index]
        out = [
            (
                self.documents[document][: prefix * BLOCK_SIZE],
                self.document_hashes[document][:prefix],
            )
        ]
        for chunk in fillers:
            size = len(chunk) // 32
            hashes = [chunk[i * 32 : (i + 1) * 32] for i in range(size)]
            out.append((self.filler_tokens[: size * BLOCK_SIZE], hashes))
        return out


# --------------------------------------------------------------------------------- kvcm
def _layout(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )


def _fill(pool: Pool, requests: Sequence[tuple[list[int], list[bytes]]], first_key: int) -> None:
    for key, (tokens, hashes) in enumerate(requests, start=first_key):
        pool.add_request(key, str(key), tokens, b"".join(hashes))
        if pool.allocate(key, len(tokens), 0) is None:
            raise RuntimeError(f"pool {pool.name}: filling request {key} did not fit")
        pool.free(key, preempt=False)


def build_kvcm(fleet: Fleet, registry: PoolRegistry) -> PoolRegistry:
    config = PoolConfig(
        max_model_len=MAX_MODEL_LEN,
        explicit_layout=_layout(fleet.num_blocks),
        hash_seed=HASH_SEED,
        log_stats=False,
    )
    for index in range(len(fleet.pools)):
        pool = registry.create(f"engine-{index:04d}", config)
        _fill(pool, fleet.requests(index), 0)
    return registry


# --------------------------------------------------------------------------------- vLLM
class VllmFleet:
    """One vLLM 0.33.0 KVCacheManager per engine, filled like kvcm's pools."""

    def __init__(self, ref: dict[str, ModuleType], fleet: Fleet) -> None:
        import torch

        kci = ref["vllm.v1.kv_cache_interface"]
        kcu = ref["vllm.v1.core.kv_cache_utils"]
        init_vllm_none_hash(kcu, ref["vllm.utils.hashing"].get_hash_fn_by_name("sha256"), HASH_SEED)
        self._request_cls = ref["vllm.v1.request"].Request
        self._params = ref["vllm.sampling_params"].SamplingParams(max_tokens=1)
        spec = kci.FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
        )
        config = kci.KVCacheConfig(
            num_blocks=fleet.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[kci.KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
        )
        manager_cls = ref["vllm.v1.core.kv_cache_manager"].KVCacheManager
        self.managers = []
        for index in range(len(fleet.pools)):
            manager = manager_cls(
                kv_cache_config=config,
                max_model_len=MAX_MODEL_LEN,
                scheduler_block_size=BLOCK_SIZE,
                hash_block_size=BLOCK_SIZE,
                enable_caching=True,
                log_stats=False,
            )
            for key, (tokens, hashes) in enumerate(fleet.requests(index)):
                request = self.request(f"{index}-{key}", tokens, hashes)
                if manager.allocate_slots(request, len(tokens)) is None:
                    raise RuntimeError(f"vLLM engine {index}: request {key} did not fit")
                manager.free(request)
            self.managers.append(manager)

    def request(self, request_id: str, tokens: list[int], hashes: list[bytes]) -> Any:
        request = self._request_cls(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling_params=self._params,
            pooling_params=None,
        )
        request.block_hashes = list(hashes)
        return request

    def hits(self, request: Any) -> list[int]:
        return [manager.get_computed_blocks(request)[1] for manager in self.managers]


# ------------------------------------------------------------------------------ timing
def _prompt(fleet: Fleet, rng: random.Random, num_blocks: int) -> tuple[list[int], list[bytes]]:
    document = rng.randrange(NUM_DOCUMENTS)
    tokens = [*fleet.documents[document][: num_blocks * BLOCK_SIZE], 7]
    return tokens, fleet.document_hashes[document][:num_blocks]


RouterAnswer = tuple[float, float, list[tuple[str, int]]]


def _router_process(address: str, lookup_address: str, conn: Connection) -> None:
    """A router: the SDK in a process of its own, calling Lookup for each query the bench sends
    (``(block_hashes, num_tokens, max_results, via_port)``, ``None`` to stop) over gRPC, or
    with ``via_port`` over the server's lookup port (a second client with ``lookup_address``),
    and sending back the call's wall time, this process's CPU time and the answer's
    ``(pool_id, num_hit_tokens)``."""
    perf, cpu = time.perf_counter, time.process_time
    with (
        SchedulerClient(address, timeout=60) as client,
        SchedulerClient(address, timeout=60, lookup_address=lookup_address) as port_client,
    ):
        while (message := conn.recv()) is not None:
            block_hashes, num_tokens, max_results, via_port = message
            query = LookupQuery(
                block_hashes=block_hashes, num_tokens=num_tokens, max_results=max_results
            )
            start, start_cpu = perf(), cpu()
            answer = (port_client if via_port else client).lookup(query)
            wall, used = perf() - start, cpu() - start_cpu
            conn.send((wall, used, [(hit.pool_id, hit.num_hit_tokens) for hit in answer.pools]))


class Router:
    """A router process (:func:`_router_process`) driven over a pipe."""

    def __init__(self, address: str, lookup_address: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_router_process, args=(address, lookup_address, child)
        )
        self._process.start()
        child.close()

    def lookup(self, query: LookupQuery, *, via_port: bool = False) -> tuple[RouterAnswer, float]:
        """The router's answer (over gRPC, or the lookup port), and this (the server's)
        process's CPU time meanwhile: this thread only waits on the pipe, so that is the
        server's."""
        start_cpu = time.process_time()
        self._conn.send((query.block_hashes, query.num_tokens, query.max_results, via_port))
        answer: RouterAnswer = self._conn.recv()
        return answer, time.process_time() - start_cpu

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(30)


def bench_lookups(
    fleet: Fleet,
    server: EmbeddedServer,
    vllm: VllmFleet | None,
    num_blocks: int,
    repeats: int,
    seed: int,
) -> list[Row]:
    """Core lookups (run on the server's loop, between calls, as the servicer runs them), the
    same over gRPC through the SDK, and vLLM's per-manager loop; every answer cross-checked."""
    registry: PoolRegistry = server.server.state.registry
    rng = random.Random(seed)
    perf = time.perf_counter
    names = [f"engine-{index:04d}" for index in range(len(fleet.pools))]
    cpu = time.thread_time
    keys = (
        "hashed",
        "best5",
        "cold5",
        "tokens",
        "tokens5",
        "grpc",
        "grpc5",
        "router",
        "router5",
        "port",
        "port5",
        "vllm",
    )
    timings: dict[str, list[float]] = {key: [] for key in keys}
    cpu_timings: dict[str, list[float]] = {key: [] for key in keys}

    def timed(key: str, query: LookupQuery) -> LookupAnswer:
        # Wall time, and the CPU time of the thread running the lookup (the loop's thread):
        # on a shared machine the wall time also holds the time other processes ran.
        start, start_cpu = perf(), cpu()
        answer = registry.lookup(query)
        cpu_timings[key].append(cpu() - start_cpu)
        timings[key].append(perf() - start)
        return answer

    async def core(
        hash_query: LookupQuery, token_query: LookupQuery, cold_query: LookupQuery
    ) -> list[LookupAnswer]:
        return [
            timed("hashed", hash_query),
            timed("best5", dataclasses.replace(hash_query, max_results=5)),
            timed("cold5", cold_query),
            timed("tokens", token_query),
            timed("tokens5", dataclasses.replace(token_query, max_results=5)),
        ]

    warm = LookupQuery(token_ids=[1, 2, 3])
    # Indexes every pool (O(10M keys) on a 2-core VM).
    server.call(core(warm, warm, warm), timeout=3600)
    for values in (*timings.values(), *cpu_timings.values()):
        values.clear()
    router = Router(server.grpc_address, server.lookup_address)
    for _ in range(3):  # the router's channel, connection and first calls, untimed
        router.lookup(LookupQuery(block_hashes=bytes(32), max_results=5))
        router.lookup(LookupQuery(block_hashes=bytes(32), max_results=5), via_port=True)
    with SchedulerClient(server.grpc_address, timeout=60) as client, frozen_gc():
        for _ in range(repeats):
            tokens, hashes = _prompt(fleet, rng, num_blocks)
            hash_query = LookupQuery(block_hashes=b"".join(hashes), num_tokens=len(tokens))
            owner, cold = _cold_prompt(fleet, rng, num_blocks)
            cold_query = LookupQuery(block_hashes=cold, max_results=5)
            answer, best, cold5, again, again5 = server.call(
                core(hash_query, LookupQuery(token_ids=tokens), cold_query)
            )
            if owner is not None:  # only the pool whose own blocks these are hits them
                top = cold5.pools[0]
                assert (top.pool_id, top.num_hit_tokens) == (names[owner], len(cold) // 2)
                assert all(hit.num_hit_tokens == 0 for hit in cold5.pools[1:])
            got = {hit.pool_id: hit.num_hit_tokens for hit in answer.pools}
            assert got == {hit.pool_id: hit.num_hit_tokens for hit in again.pools}
            assert best.pools == answer.pools[:5]
            assert [hit.pool_id for hit in again5.pools] == [hit.pool_id for hit in best.pools]
            # The RPC's CPU time is the process's: the client's and the server's threads.
            start, start_cpu = perf(), time.process_time()
            remote = client.lookup(hash_query)
            timings["grpc"].append(perf() - start)
            cpu_timings["grpc"].append(time.process_time() - start_cpu)
            start, start_cpu = perf(), time.process_time()
            remote5 = client.lookup(dataclasses.replace(hash_query, max_results=5))
            timings["grpc5"].append(perf() - start)
            cpu_timings["grpc5"].append(time.process_time() - start_cpu)
            assert {hit.pool_id: hit.num_hit_tokens for hit in remote.pools} == got
            assert remote5.pools == best.pools
            # From a router's own process: its wall time, and both processes' CPU time.
            # The same over the lookup port (bypassing grpcio), from the same router process.
            for key, routed, via_port in (
                ("router", hash_query, False),
                ("router5", dataclasses.replace(hash_query, max_results=5), False),
                ("port", hash_query, True),
                ("port5", dataclasses.replace(hash_query, max_results=5), True),
            ):
                (wall, router_cpu, hits), server_cpu = router.lookup(routed, via_port=via_port)
                timings[key].append(wall)
                cpu_timings[key].append(router_cpu + server_cpu)
                expected_hits = remote.pools if key in ("router", "port") else remote5.pools
                assert hits == [(hit.pool_id, hit.num_hit_tokens) for hit in expected_hits]
            if vllm is not None:
                request = vllm.request("probe", tokens, hashes)
                start = perf()
                expected = vllm.hits(request)
                timings["vllm"].append(perf() - start)
                assert got == dict(zip(names, expected, strict=True)), "answers differ"
    router.close()
    base = Timing.of(timings["vllm"]) if timings["vllm"] else None
    label = f"{num_blocks // 1024}k-block prompt"
    rows = [
        ("hashed", f"lookup, {label}, hashed, all pools"),
        ("best5", f"lookup, {label}, hashed, best 5"),
        ("cold5", f"lookup, {label}, hashed, best 5, cold"),
        ("tokens", f"lookup, {label}, token ids, all pools"),
        ("tokens5", f"lookup, {label}, token ids, best 5"),
        ("grpc", f"Lookup RPC in-process, {label}, hashed, all pools"),
        ("grpc5", f"Lookup RPC in-process, {label}, hashed, best 5"),
        ("router", f"Lookup RPC from router, {label}, hashed, all pools"),
        ("router5", f"Lookup RPC from router, {label}, hashed, best 5"),
        ("port", f"Lookup over the lookup port from router, {label}, hashed, all pools"),
        ("port5", f"Lookup over the lookup port from router, {label}, hashed, best 5"),
    ]
    out = [Row.of_timings(name, Timing.of(timings[key]), base) for key, name in rows]
    out += [
        Row.of_timings(f"{name} (CPU)", Timing.of(cpu_timings[key]), None) for key, name in rows
    ]
    return out


def _cold_prompt(fleet: Fleet, rng: random.Random, num_blocks: int) -> tuple[int | None, bytes]:
    """A pool's index and up to ``num_blocks`` of its own filler blocks' hashes (cached by it
    alone); ``(None, b"\0" * 32)`` where no pool has filler blocks."""
    owners = [index for index, (_, _, fillers) in enumerate(fleet.pools) if fillers]
    if not owners:
        return None, bytes(32)
    owner = rng.choice(owners)
    hashes = b"".join(fleet.pools[owner][2])
    return owner, hashes[: num_blocks * 32]


def profile_lookups(fleet: Fleet, registry: PoolRegistry, repeats: int, seed: int) -> None:
    """Where a lookup's CPU time goes: cProfile over ``repeats`` lookups of each kind (1k-block
    prompts), the functions with the most own time. cProfile's per-call cost inflates
    functions that make many small calls; the walk's reads run in C within ``_walk``."""
    import cProfile
    import pstats

    rng = random.Random(seed)
    prompts = [_prompt(fleet, rng, 1024) for _ in range(repeats)]
    kinds = {
        "hashed, best 5 (hashing excluded)": [
            LookupQuery(block_hashes=b"".join(h), num_tokens=len(t), max_results=5)
            for t, h in prompts
        ],
        "hashed, all pools (hashing excluded)": [
            LookupQuery(block_hashes=b"".join(h), num_tokens=len(t)) for t, h in prompts
        ],
        "token ids, best 5 (hashing included)": [
            LookupQuery(token_ids=t, max_results=5) for t, _ in prompts
        ],
    }
    for kind, queries in kinds.items():
        profiler = cProfile.Profile(time.thread_time)
        with frozen_gc():
            profiler.enable()
            for query in queries:
                registry.lookup(query)
            profiler.disable()
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])  # type: ignore[attr-defined]
        total = sum(item[1][2] for item in rows)
        each_ms = total / len(queries) * 1e3
        print(f"\nprofile: {kind}, {len(queries)} lookups, {each_ms:.3f} ms CPU each")
        print(f"{'function':<58} {'calls':>8} {'own us':>9} {'share':>6}")
        for (path, line, name), (_, calls, own, _, _) in rows[:10]:
            where = f"{Path(path).name}:{line}({name})" if line else name
            print(
                f"{where[:58]:<58} {calls / len(queries):>8.1f} "
                f"{own / len(queries) * 1e6:>9.1f} {own / total:>6.1%}"
            )


# The targets (p99, ms): best 5 of a hashed 1k-block prompt in-process and over the
# RPC (as a router calls it, from its own process; the in-process client shown beside it),
# every pool answered in-process.
TARGETS = (
    ("lookup, 1k-block prompt, hashed, best 5", 1.0),
    ("Lookup RPC from router, 1k-block prompt, hashed, best 5", 2.0),
    ("Lookup over the lookup port from router, 1k-block prompt, hashed, best 5", 2.0),
    ("Lookup RPC in-process, 1k-block prompt, hashed, best 5", 2.0),
    ("lookup, 1k-block prompt, hashed, all pools", 3.0),
)


def print_targets(rows: Sequence[Row]) -> None:
    """Each target's p99 against the measured p99, wall clock and CPU time."""
    by_name = {row.name: row for row in rows}
    width = max(len(name) for name, _ in TARGETS)
    print(f"\n{'targets (p99, ms)':<{width}} {'target':>7} {'wall':>9} {'CPU':>9}")
    for name, target in TARGETS:
        wall, cpu = by_name.get(name), by_name.get(f"{name} (CPU)")
        if wall is None or cpu is None or wall.kvcm_p99 is None or cpu.kvcm_p99 is None:
            continue
        verdict = "met" if wall.kvcm_p99 <= target else "missed (wall)"
        if wall.kvcm_p99 > target and cpu.kvcm_p99 <= target:
            verdict += ", met in CPU time"
        figures = f"{target:>7.1f} {wall.kvcm_p99:>9.3f} {cpu.kvcm_p99:>9.3f}"
        print(f"{name:<{width}} {figures}  {verdict}")


def bench_index_cost(repeats: int, seed: int) -> Row:
    """Admit + free 64-block requests in a full pool, with and without the index (two pools,
    samples interleaved)."""
    rng = random.Random(seed)
    tokens = [0] * (64 * BLOCK_SIZE)
    config = PoolConfig(
        max_model_len=MAX_MODEL_LEN,
        explicit_layout=_layout(4097),
        hash_seed=HASH_SEED,
        log_stats=False,
    )
    registry = PoolRegistry()
    pools = [registry.create(name, config) for name in ("indexed", "plain")]
    for pool in pools:
        _fill(pool, [(tokens, [os.urandom(32) for _ in range(64)]) for _ in range(64)], 0)
    assert registry.index.slot(pools[0]) is not None
    keys = iter(range(1000, 1000 + 4 * repeats))

    def churn(pool: Pool) -> Sample:
        manager = pool.ready_manager()

        def sample() -> float:
            key = next(keys)
            hashes = b"".join(rng.randbytes(32) for _ in range(64))
            start = time.perf_counter()
            request = pool.add_request(key, "r", tokens, hashes)
            manager.allocate_slots(request, len(tokens))
            pool.free(key, preempt=False)
            return time.perf_counter() - start

        return sample

    with_index, without = measure([churn(pools[0]), churn(pools[1])], repeats)
    # The "vLLM" column is kvcm without the index here: the ratio is the index's overhead.
    return Row(
        "admit+free 64 blocks (evicting 64), index on (vs off)",
        "ms",
        with_index.median_ms,
        with_index.p99_ms,
        without.median_ms,
        without.p99_ms,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--pools", type=int, default=1000)
    parser.add_argument("--blocks-per-pool", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=100, help="timed lookups per prompt size")
    parser.add_argument("--no-vllm", action="store_true", help="kvcm figures only")
    parser.add_argument("--no-events", action="store_true", help="skip the ZMQ stream rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile", action="store_true", help="then print where a lookup's CPU time goes"
    )
    args = parser.parse_args(argv)

    started = time.perf_counter()
    fleet = Fleet(args.pools, args.blocks_per_pool, args.seed)
    settings = ServerSettings(
        grpc_address="127.0.0.1:0",
        http_address="",
        lookup_address="127.0.0.1:0",
        log_level="WARNING",
        limits=Limits(max_pools=max(1024, args.pools), max_total_blocks=1 << 40),
    )
    server = start_embedded_server(settings)
    registry: PoolRegistry = server.server.state.registry

    async def build() -> None:
        build_kvcm(fleet, registry)

    server.call(build(), timeout=3600)
    total = sum(pool.snapshot().num_cached_blocks for pool in registry.list())
    print(
        f"kvcm: {len(registry)} pools, {total:,} cached blocks "
        f"({time.perf_counter() - started:.0f} s to build)",
        file=sys.stderr,
    )
    ref = None if args.no_vllm else import_vllm(*VLLM_MODULES)
    vllm = None
    if ref is not None:
        started = time.perf_counter()
        vllm = VllmFleet(ref, fleet)
        print(
            f"vLLM: {len(vllm.managers)} managers ({time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
        )
    rows = []
    try:
        for num_blocks in (1024, 8192):
            rows += bench_lookups(fleet, server, vllm, num_blocks, args.repeats, args.seed)
    finally:
        server.stop()
    if args.profile:
        profile_lookups(fleet, registry, args.repeats, args.seed)
    print(
        f"index: {len(registry.index):,} distinct keys over {registry.index.num_pools} pools",
        file=sys.stderr,
    )
    rows.append(bench_index_cost(max(200, args.repeats * 10), args.seed))
    print_table(
        rows,
        f"lookup across {len(registry)} pools holding {total:,} cached blocks "
        "(vLLM: get_computed_blocks on every engine's manager; last row: vLLM column = "
        "kvcm with the index off)",
    )
    print_targets(rows)
    if not args.no_events:
        from kv_events import bench_step_path

        print()
        bench_step_path(300)


if __name__ == "__main__":
    main()
