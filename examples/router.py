"""A reference KV-aware router over kvcm: exact lookup against round-robin and an event index.

An example program, not a product. It starts a kvcm server (embedded, with vLLM-wire ZMQ KV
events on), creates ``--engines`` simulated engines for each of three routers, and replays
one shared-prefix chat workload (``workload.make_workload``: shared system prompts,
multi-turn follow-ups) through each router:

- ``round-robin``: engines in turn;
- ``event-index``: what KV-aware routers do today: an approximate index of every engine's
  blocks, built from the ZMQ KV-event stream (vLLM's wire format, as llm-d's indexer or Dynamo
  read it); it routes to the longest prefix match it believes, fewest outstanding requests on
  ties;
- ``event-lossy``: the same, missing ``--event-loss`` of the batches (default 2%), as a
  subscriber does without replay across reconnects or when ZMQ's high-water mark drops;
- ``kvcm-lookup``: kvcm's ``Lookup``: each engine's exact hit now, with load in the score.

A simulated engine serves a request by looking it up in its pool (the hit it really gets),
allocating its prompt, and finishing it a few arrivals later; an engine holds at most
``--max-running`` requests (the oldest finishes first). It prints, per router, the prompt
tokens served from cache (hit rate), the prefill tokens computed, the tokens saved against
round-robin and against the lossless event index, and how often the hit a router predicted
differed from the one the engine got.

    python examples/router.py [--engines 4] [--requests 400] [--blocks 384]
    python examples/router.py --address HOST:PORT [--token T] [--pool-prefix demo-]

With ``--address`` it drives a running server instead (its pools are ``PREFIX<router>-<i>``,
deleted at the end); the event routers then read the pools' ZMQ stream where the server
publishes one (DescribePool names its endpoint) and are left out where it does not.
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from workload import WorkloadOptions, make_workload

from kvcm.client import LookupQuery, SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher, external_block_hash
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig

BLOCK_SIZE = 16
ROUTERS = ("round-robin", "event-index", "event-lossy", "kvcm-lookup")


@dataclass(slots=True)
class Tally:
    """What one router achieved."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    mispredicted: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class Engine:
    """A simulated engine: its pool and the requests it runs (key, finishing arrival)."""

    pool_id: str
    running: deque[tuple[int, int]] = field(default_factory=deque)


class EventIndex:
    """An approximate index fed by kvcm's ZMQ KV events, as routers build one from vLLM's.

    Block hashes arrive as vLLM's 64-bit ints; the index maps each to the engines that stored
    it and forgets it on BlockRemoved / AllBlocksCleared.
    """

    def __init__(
        self,
        topic_prefix: bytes,
        lossy_prefix: str,
        loss: float,
        seed: int,
        connect: str | None = None,
    ) -> None:
        """Bind a SUB socket on a free 127.0.0.1 port (``endpoint``): a server given a
        non-wildcard endpoint connects to it (vLLM's rule), as engines connect to indexers.
        With ``connect``, connect to a server's bound PUB endpoint instead."""
        import msgspec
        import zmq

        self._decode = msgspec.msgpack.Decoder().decode
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.SUB)
        if connect:
            self.socket.connect(connect.replace("*", "127.0.0.1"))
            self.endpoint = connect
        else:
            port = self.socket.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self.socket.setsockopt(zmq.SUBSCRIBE, topic_prefix)
        self.blocks: dict[str, set[int]] = {}
        self.batches = 0
        self.lost = 0
        self._lossy_prefix = lossy_prefix
        self._loss = loss
        self._rng = random.Random(seed)

    def wait_connected(self, publish: Any) -> None:
        """Publish (via ``publish()``) until the stream delivers: PUB drops before connect."""
        deadline = time.monotonic() + 10.0
        while not self.socket.poll(200):
            if time.monotonic() > deadline:
                raise RuntimeError("the ZMQ event stream did not connect")
            publish()
        self.drain()

    def drain(self) -> None:
        """Apply every batch received so far (the index lags by what is in flight)."""
        while self.socket.poll(0):
            topic, _seq, payload = self.socket.recv_multipart()
            pool_id = topic.decode().split("@")[1]
            if pool_id.startswith(self._lossy_prefix) and self._rng.random() < self._loss:
                self.lost += 1
                continue
            _ts, events, *_ = self._decode(payload)
            held = self.blocks.setdefault(pool_id, set())
            for event in events:  # maps tagged with vLLM's class name under "type"
                kind = event["type"]
                if kind == "BlockStored":
                    held.update(event["block_hashes"])
                elif kind == "BlockRemoved":
                    held.difference_update(event["block_hashes"])
                elif kind == "AllBlocksCleared":
                    held.clear()
            self.batches += 1

    def match(self, pool_id: str, hashes: Sequence[int]) -> int:
        """Blocks of the prompt's prefix the index believes ``pool_id`` holds."""
        held = self.blocks.get(pool_id, set())
        count = 0
        for value in hashes:
            if value not in held:
                break
            count += 1
        return count

    def close(self) -> None:
        self.socket.close(linger=0)
        self._context.term()


def _layout(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )


class Fleet:
    """One router's engines on the server, and the simulated serving."""

    def __init__(
        self, client: SchedulerClient, router: str, num_engines: int, args: argparse.Namespace
    ) -> None:
        self.client = client
        self.router = router
        self.max_running = args.max_running
        self.engines = [Engine(f"{args.pool_prefix}{router}-{i}") for i in range(num_engines)]
        config = PoolConfig(
            max_model_len=args.max_model_len,
            explicit_layout=_layout(args.blocks),
            hash_seed="router-example",
            enable_kv_cache_events=True,
            labels={"router": router},
        )
        for engine in self.engines:
            client.create_pool(engine.pool_id, config)
        self.hasher: BlockHasher = client.block_hasher(self.engines[0].pool_id)
        self.tally = Tally()
        self._next = 0
        self._key = 0

    def finish_due(self, now: int) -> None:
        for engine in self.engines:
            while engine.running and engine.running[0][1] <= now:
                key, _ = engine.running.popleft()
                self.client.free(engine.pool_id, key)

    def serve(self, engine: Engine, prompt: list[int], now: int, lifetime: int) -> int:
        """Serve one request on ``engine``; returns the prompt tokens its cache served."""
        client = self.client
        if len(engine.running) >= self.max_running:
            key, _ = engine.running.popleft()
            client.free(engine.pool_id, key)
        self._key += 1
        key = self._key
        hashes = self.hasher.hash_token_ids(prompt)
        client.add_request(engine.pool_id, key, prompt, hashes)
        hit = client.get_computed_blocks(engine.pool_id, key)
        num_hit = hit.num_computed_tokens
        while (
            client.allocate_slots(engine.pool_id, key, len(prompt) - num_hit, num_hit, hit=hit)
            is None
        ):
            if not engine.running:
                raise RuntimeError(f"{engine.pool_id}: a {len(prompt)}-token prompt never fits")
            oldest, _ = engine.running.popleft()
            client.free(engine.pool_id, oldest)
            hit = client.get_computed_blocks(engine.pool_id, key)
            num_hit = hit.num_computed_tokens
        engine.running.append((key, now + lifetime))
        tally = self.tally
        tally.requests += 1
        tally.prompt_tokens += len(prompt)
        tally.hit_tokens += num_hit
        return num_hit

    def round_robin(self) -> Engine:
        engine = self.engines[self._next % len(self.engines)]
        self._next += 1
        return engine


def _route(
    fleet: Fleet, index: EventIndex | None, prompt: list[int], load_weight: float
) -> tuple[Engine, int | None]:
    """The engine a router picks, and the hit (tokens) it expects (``None``: no guess)."""
    if fleet.router == "round-robin":
        return fleet.round_robin(), None
    if fleet.router == "kvcm-lookup":
        answer = fleet.client.lookup(
            LookupQuery(
                token_ids=prompt,
                labels={"router": fleet.router},
                load_weight=load_weight,
                max_results=1,
            )
        )
        best = answer.pools[0]
        engine = next(e for e in fleet.engines if e.pool_id == best.pool_id)
        return engine, best.num_hit_tokens
    assert index is not None
    index.drain()
    hashes = [external_block_hash(h) for h in fleet.hasher.hash_token_ids(prompt)]
    cap = (len(prompt) - 1) // BLOCK_SIZE  # vLLM never hits the last token
    scored = [
        (min(index.match(engine.pool_id, hashes), cap), -len(engine.running), -position, engine)
        for position, engine in enumerate(fleet.engines)
    ]
    blocks, _, _, engine = max(scored, key=lambda item: item[:3])
    return engine, blocks * BLOCK_SIZE


EventSource = Callable[[SchedulerClient, str], "EventIndex | None"]


def run(args: argparse.Namespace, address: str, events_for: EventSource) -> dict[str, Tally]:
    trace = make_workload(
        WorkloadOptions(
            num_requests=args.requests,
            num_system_prompts=args.system_prompts,
            system_prompt_tokens=(args.system_prompt_tokens // 2, args.system_prompt_tokens),
            user_tokens=(32, 256),
            output_tokens=(16, 128),
            follow_up_probability=0.5,
            seed=args.seed,
        )
    )
    prompts = [list(r.prompt_token_ids)[: args.max_model_len - 1] for r in trace]
    rng = random.Random(args.seed)
    lifetimes = [rng.randint(2, 4 * args.engines) for _ in trace]
    results: dict[str, Tally] = {}
    fleets: list[Fleet] = []
    with SchedulerClient(address, token=args.token) as client:
        for router in ROUTERS:
            fleet = Fleet(client, router, args.engines, args)
            fleets.append(fleet)
            index = None
            if router.startswith("event-"):
                index = events_for(client, fleet.engines[0].pool_id)
                if index is None:
                    continue  # the server publishes no ZMQ stream for its pools
                probe = fleet.engines[0]
                index.wait_connected(functools.partial(client.reset_prefix_cache, probe.pool_id))
            for now, (prompt, lifetime) in enumerate(zip(prompts, lifetimes, strict=True)):
                fleet.finish_due(now)
                engine, expected = _route(fleet, index, prompt, args.load_weight)
                got = fleet.serve(engine, prompt, now, lifetime)
                if expected is not None and expected != got:
                    fleet.tally.mispredicted += 1
            results[router] = fleet.tally
        if args.address:  # a running server's pools are not ours to keep
            for fleet in fleets:
                for engine in fleet.engines:
                    client.delete_pool(engine.pool_id)
    return results


def report(results: dict[str, Tally]) -> str:
    baseline = results["round-robin"]
    events = results.get("event-index")
    lines = [
        f"{'router':<12} {'requests':>8} {'prompt tok':>11} {'hit tok':>9} {'hit rate':>8} "
        f"{'prefilled':>10} {'saved vs RR':>11} {'vs events':>9} {'mispredicted':>12}"
    ]
    for router, tally in results.items():
        prefilled = tally.prompt_tokens - tally.hit_tokens
        saved = tally.hit_tokens - baseline.hit_tokens
        versus = "-" if events is None else str(tally.hit_tokens - events.hit_tokens)
        mispredicted = "-" if router == "round-robin" else str(tally.mispredicted)
        lines.append(
            f"{router:<12} {tally.requests:>8} {tally.prompt_tokens:>11} {tally.hit_tokens:>9} "
            f"{tally.hit_rate:>8.1%} {prefilled:>10} {saved:>11} {versus:>9} {mispredicted:>12}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--engines", type=int, default=4, help="engines per router")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=384, help="KV-cache blocks per engine")
    parser.add_argument("--max-running", type=int, default=4, help="requests per engine")
    parser.add_argument("--system-prompts", type=int, default=12)
    parser.add_argument("--system-prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--load-weight", type=float, default=0.5, help="Lookup's load_weight")
    parser.add_argument("--event-loss", type=float, default=0.02, help="batches event-lossy misses")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--address", default="", help="a running server's gRPC HOST:PORT (default: start one)"
    )
    parser.add_argument("--token", default=None, help="bearer token for --address")
    parser.add_argument("--pool-prefix", default="", help="prefix of the pools it creates")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Tally]:
    from kvcm.server.embedded import start_embedded_server
    from kvcm.server.settings import ServerSettings

    args = _parser().parse_args(argv)
    topics = f"kv@{args.pool_prefix}event-".encode()
    lossy = f"{args.pool_prefix}event-lossy-"
    opened: list[EventIndex] = []

    def connect_to_pool(client: SchedulerClient, pool_id: str) -> EventIndex | None:
        """The running server's ZMQ stream, as DescribePool names it (one index for both)."""
        if not opened:
            stream = client.describe_pool(pool_id).zmq_events
            if stream is None:
                return None
            opened.append(EventIndex(topics, lossy, args.event_loss, args.seed, stream.endpoint))
        return opened[0]

    started = time.perf_counter()
    try:
        if args.address:
            results = run(args, args.address, connect_to_pool)
        else:
            opened.append(EventIndex(topics, lossy, args.event_loss, args.seed))
            settings = ServerSettings(
                grpc_address="127.0.0.1:0",
                http_address="",
                log_level="WARNING",
                kv_events_endpoint=opened[0].endpoint,
            )
            with start_embedded_server(settings) as server:
                started = time.perf_counter()
                results = run(args, server.grpc_address, lambda _c, _p: opened[0])
    finally:
        for index in opened:
            index.close()
    print(
        f"{args.requests} requests, {args.engines} engines per router, {args.blocks} blocks "
        f"of {BLOCK_SIZE} tokens each ({time.perf_counter() - started:.1f} s)"
    )
    print(report(results))
    if opened:
        print(f"event-lossy missed {opened[0].lost} of the event batches it was sent")
    else:
        print("the server publishes no ZMQ KV events: the event routers were left out")
    return results


if __name__ == "__main__":
    main()
