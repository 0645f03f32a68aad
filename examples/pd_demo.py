"""The P/D demo: ``kvcm pd-proxy`` against round robin on a multi-turn shared-prefix workload.

``python examples/demo.py --pd`` (or ``python examples/pd_demo.py``) starts a kvcm server
(``transfer_lease_s`` set), then, once per policy (kvcm's ``RoutePd``, then vLLM's round
robin), on fresh pools:

1. one prefill and two decode simulated engines (``pd_engine.SimEngine``: OpenAI-compatible
   HTTP servers, no vLLM, whose KV caches are kvcm pools driven through the plain SDK; the
   decode side allocates what it pulls with ``delay_cache_blocks``);
2. ``kvcm pd-proxy`` in front of them (the same app ``kvcm pd-proxy`` serves);
3. conversations that share a few system prompts, each turn's prompt repeating the whole
   history (completions with token-id prompts; every third one streamed);
4. faults: decode-1 never pulls one transfer in ``--never-pull-every`` (the proxy fails over;
   the server's transfer lease reclaims the abandoned allocation; the prefill engine's lease
   frees a source nobody pulled), and decode-1 dies after ``--die-after`` of the requests;
5. after the leases, every pool is checked for blocks still held: leaked blocks.

It prints, per policy, prompt tokens, decode tokens pulled and saved (the decode engine's own
hits), prefill tokens computed, transfers, failed requests, the routing call's p50/p99, and
leaked blocks. Not a library module.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any, TextIO

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_engine import SimEngine

from kvcm.cli._connect import Connection
from kvcm.cli.pd_proxy import Engine, ProxyConfig, build_proxy_app
from kvcm.client import PoolConfig, SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec

__all__ = ["PdDemoOptions", "PdReport", "main", "run_pd_demo"]

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class PdDemoOptions:
    """The workload, the faults and the pools.

    Attributes:
        conversations: Conversations (each ``turns`` requests).
        turns: Turns per conversation.
        system_prompts: Distinct system prompts the conversations share.
        system_tokens: Tokens per system prompt.
        max_tokens: Tokens each answer generates.
        decode_blocks: Blocks per decode pool (small enough to evict).
        prefill_blocks: Blocks of the prefill pool.
        never_pull_every: decode-1 abandons one transfer in this many (0: never).
        die_after: decode-1 dies before this fraction of the turns (1: never).
        transfer_lease_s: The server's transfer lease.
        kv_lease_s: The prefill engine's lease on a source nobody pulled.
        decoder_ttl_s: Bidirectional: how long a decode engine holds a finished request's
            blocks (vLLM's ``decoder_kv_blocks_ttl``, 480 s by default; short here so the leak
            check need not wait).
        concurrency: Requests in flight at once (the turns of different conversations).
        seed: The workload's seed.
    """

    conversations: int = 15
    turns: int = 4
    system_prompts: int = 3
    system_tokens: int = 256
    max_tokens: int = 16
    decode_blocks: int = 400
    prefill_blocks: int = 192
    never_pull_every: int = 7
    die_after: float = 0.75
    transfer_lease_s: float = 3.0
    kv_lease_s: float = 5.0
    decoder_ttl_s: float = 10.0
    concurrency: int = 4
    seed: int = 0


@dataclass
class PdReport:
    """One policy's run."""

    policy: str
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    pulled_tokens: int = 0
    prefill_pulled_tokens: int = 0
    decode_hit_tokens: int = 0
    prefill_computed_tokens: int = 0
    transfers: int = 0
    sources_expired: int = 0
    abandoned: int = 0
    load_failures: int = 0
    decode_retries: int = 0
    route_p50_ms: float = 0.0
    route_p99_ms: float = 0.0
    leaked_blocks: int = 0
    leaked_requests: int = 0
    by_engine: dict[str, int] = field(default_factory=dict)


def _pool(num_blocks: int, role: str) -> PoolConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16
    )
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )
    return PoolConfig(
        max_model_len=16384,
        explicit_layout=layout,
        labels={"role": role},
        scheduler_lease_s=1.0,  # a dead engine's requests are reclaimed within ~2 s
    )


def _workload(options: PdDemoOptions) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The system prompts and, per conversation, its user turns (token ids)."""
    rng = random.Random(options.seed)
    systems = [
        [rng.randrange(1, 50_000) for _ in range(options.system_tokens)]
        for _ in range(options.system_prompts)
    ]
    users = [
        [
            [rng.randrange(1, 50_000) for _ in range(rng.randrange(24, 96))]
            for _ in range(options.turns)
        ]
        for _ in range(options.conversations)
    ]
    return systems, users


def _serve_proxy(app: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="pd-proxy", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10.0
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the proxy did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


def _complete(
    http: httpx.Client, prompt: list[int], max_tokens: int, stream: bool
) -> list[int] | None:
    """One completion through the proxy: its token ids, ``None`` when it failed."""
    body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if not stream:
        answer = http.post("/v1/completions", json=body)
        if answer.status_code != 200:
            return None
        tokens: list[int] = answer.json()["choices"][0]["token_ids"]
        return tokens
    out: list[int] = []
    import json

    with http.stream("POST", "/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            return None
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    out += choice["token_ids"]
    return out


def run_policy(
    address: str, policy: str, options: PdDemoOptions, prefix: str, *, bidirectional: bool = False
) -> PdReport:
    """Run the workload once, behind a proxy with ``policy``, on fresh pools (with
    ``bidirectional``: engines and proxy do vLLM's bidirectional transfers)."""
    report = PdReport(policy=f"{policy}+bidir" if bidirectional else policy)
    client = SchedulerClient(address)
    prefill = SimEngine(
        name=f"{prefix}prefill-0",
        role="prefill",
        pool_id=f"{prefix}prefill-0",
        kvcm_address=address,
        kv_lease_s=options.kv_lease_s,
        bidirectional=bidirectional,
    )
    decode = [
        SimEngine(
            name=f"{prefix}decode-{i}",
            role="decode",
            pool_id=f"{prefix}decode-{i}",
            kvcm_address=address,
            never_pull_every=options.never_pull_every if i == 1 else 0,
            bidirectional=bidirectional,
            decoder_ttl_s=options.decoder_ttl_s,
        )
        for i in range(2)
    ]
    engines = [prefill, *decode]
    client.create_pool(prefill.pool_id, _pool(options.prefill_blocks, "prefill"))
    for engine in decode:
        client.create_pool(engine.pool_id, _pool(options.decode_blocks, "decode"))
    for engine in engines:
        engine.start()
    config = ProxyConfig(
        prefill=(Engine(url=prefill.url, pool_id=prefill.pool_id, role="prefill"),),
        decode=tuple(Engine(url=e.url, pool_id=e.pool_id, role="decode") for e in decode),
        policy=policy,
        bidirectional=bidirectional,
    )
    connection = Connection(address=address, tls=None, token=None, timeout_s=10.0)
    proxy, thread, url = _serve_proxy(build_proxy_app(config, connection))
    systems, users = _workload(options)
    histories = [list(systems[i % len(systems)]) for i in range(options.conversations)]
    die_before_turn = int(options.turns * options.die_after)

    def one(http: httpx.Client, conversation: int, turn: int) -> bool:
        prompt = histories[conversation] + users[conversation][turn]
        stream = (conversation + turn) % 3 == 0
        output = _complete(http, prompt, options.max_tokens, stream=stream)
        histories[conversation] = prompt if output is None else prompt + output
        return output is not None

    try:
        with (
            httpx.Client(base_url=url, timeout=60.0) as http,
            ThreadPoolExecutor(options.concurrency) as pool,
        ):
            for turn in range(options.turns):
                if turn == die_before_turn and options.die_after < 1:
                    decode[1].die()
                conversations = range(options.conversations)
                done = list(pool.map(one, repeat(http), conversations, repeat(turn)))
                report.requests += len(done)
                report.failed += done.count(False)
            stats = http.get("/v1/pd/stats").json()
    finally:
        proxy.should_exit = True
        thread.join(timeout=10.0)
    report.decode_retries = stats["decode_retries"]
    report.route_p50_ms = stats.get("route_p50_ms", 0.0)
    report.route_p99_ms = stats.get("route_p99_ms", 0.0)
    report.by_engine = stats["by_engine"]
    # Whatever is still held must go within the leases (transfer, prefill source, a decode
    # engine's held blocks, a dead engine's scheduler lease); what is left after that leaked.
    # The grace covers timers stretched on a loaded machine (the reapers' 50 ms ticks, the
    # server's lease checks, about once a second). GetUsage is a read: polling a dead
    # engine's pool does not renew its scheduler lease.
    leases = max(options.transfer_lease_s, options.kv_lease_s, options.decoder_ttl_s, 1.0)
    deadline = time.monotonic() + leases + 5.0
    while True:
        held = [client.get_usage(engine.pool_id) for engine in engines]
        if all(usage.num_requests == 0 for usage in held) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    report.leaked_requests = sum(usage.num_requests for usage in held)
    report.leaked_blocks = sum(usage.num_blocks - 1 - usage.num_free_blocks for usage in held)
    for engine in engines:
        stats_ = engine.stats
        report.prompt_tokens += stats_.prompt_tokens if engine.role == "decode" else 0
        if engine.role == "decode":
            report.pulled_tokens += stats_.pulled_tokens
        else:
            report.prefill_pulled_tokens += stats_.pulled_tokens
        report.decode_hit_tokens += stats_.hit_tokens if engine.role == "decode" else 0
        report.prefill_computed_tokens += stats_.computed_tokens if engine.role == "prefill" else 0
        report.transfers += stats_.sources_released if engine.role == "prefill" else 0
        report.sources_expired += stats_.expired
        report.abandoned += stats_.abandoned
        report.load_failures += stats_.load_failures
    for engine in engines:
        engine.stop()
    for engine in engines:
        client.delete_pool(engine.pool_id)
    client.close()
    return report


def print_reports(reports: Sequence[PdReport], out: TextIO) -> None:
    """The comparison table."""
    rows: list[tuple[str, Callable[[PdReport], str]]] = [
        ("requests (failed)", lambda r: f"{r.requests} ({r.failed})"),
        ("decode prompt tokens", lambda r: str(r.prompt_tokens)),
        ("decode tokens pulled", lambda r: str(r.pulled_tokens)),
        ("decode tokens saved (own hit)", lambda r: str(r.decode_hit_tokens)),
        ("prefill tokens computed", lambda r: str(r.prefill_computed_tokens)),
        ("prefill tokens pulled from decode", lambda r: str(r.prefill_pulled_tokens)),
        ("transfers completed", lambda r: str(r.transfers)),
        ("sources expired (lease)", lambda r: str(r.sources_expired)),
        ("transfers abandoned (fault)", lambda r: str(r.abandoned)),
        ("pulls failed, recomputed", lambda r: str(r.load_failures)),
        ("decode fail-overs", lambda r: str(r.decode_retries)),
        ("RoutePd p50 / p99 ms", lambda r: f"{r.route_p50_ms:.2f} / {r.route_p99_ms:.2f}"),
        ("leaked blocks (requests)", lambda r: f"{r.leaked_blocks} ({r.leaked_requests})"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'':{width}}  " + "  ".join(f"{r.policy:>16}" for r in reports), file=out)
    for name, cell in rows:
        print(f"{name:{width}}  " + "  ".join(f"{cell(r):>16}" for r in reports), file=out)
    baseline = reports[-1]
    for report in reports[:-1]:
        if baseline.pulled_tokens and baseline.prefill_computed_tokens:
            print(
                f"{report.policy} / {baseline.policy}: decode tokens pulled "
                f"{report.pulled_tokens / baseline.pulled_tokens:.2f}, prefill tokens computed "
                f"{report.prefill_computed_tokens / baseline.prefill_computed_tokens:.2f}",
                file=out,
            )


def run_pd_demo(address: str, options: PdDemoOptions, out: TextIO = sys.stdout) -> list[PdReport]:
    """kvcm, kvcm with bidirectional transfers, and round robin on ``address``'s server,
    printed; returns the reports (in that order)."""
    reports = []
    runs = (("kvcm", False), ("kvcm", True), ("round-robin", False))
    for index, (policy, bidirectional) in enumerate(runs):
        print(f"running {policy}{' +bidir' if bidirectional else ''} ...", file=out, flush=True)
        reports.append(
            run_policy(address, policy, options, f"pd{index}-", bidirectional=bidirectional)
        )
    print_reports(reports, out)
    return reports


def parser() -> argparse.ArgumentParser:
    """The demo's flags."""
    p = argparse.ArgumentParser(
        prog="examples/demo.py --pd",
        description="kvcm pd-proxy against round robin: one prefill, two decode simulated "
        "engines, a multi-turn shared-prefix workload, faults, leaked blocks.",
    )
    p.add_argument("--remote", metavar="ADDRESS", help="use the kvcm server at host:port")
    p.add_argument("--conversations", type=int, default=15)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--never-pull-every", type=int, default=7)
    p.add_argument("--die-after", type=float, default=0.75)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python examples/pd_demo.py [--remote ADDRESS] ...``; the exit code (1: a leak)."""
    args = parser().parse_args(argv)
    options = PdDemoOptions(
        conversations=args.conversations,
        turns=args.turns,
        never_pull_every=args.never_pull_every,
        die_after=args.die_after,
        concurrency=args.concurrency,
        seed=args.seed,
    )
    if args.remote:
        print("(the server's transfer_lease_s must be set for abandoned pulls to be reclaimed)")
        reports = run_pd_demo(args.remote, options)
    else:
        from kvcm.server.embedded import start_embedded_server
        from kvcm.server.settings import ServerSettings

        settings = ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="",
            log_level="WARNING",
            transfer_lease_s=options.transfer_lease_s,
        )
        with start_embedded_server(settings) as server:
            print(f"kvcm server: gRPC on {server.grpc_address}")
            reports = run_pd_demo(server.grpc_address, options)
    return 1 if any(r.leaked_blocks or r.leaked_requests for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
