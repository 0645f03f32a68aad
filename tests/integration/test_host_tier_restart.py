"""A host-tier pool across a restart: the restored pool goes on as the one that never stopped.

Steps on a small pool evict each other's cached blocks, which demote to the pool's host tier.
One server is stopped after the first Steps (a checkpoint) and restarted on its data
directory; another, identical, runs the same calls without stopping. After the restart both
must answer the next Steps and Lookups identically (host hits included, which depend on the
tier's keys and recency order) and hold the same complete state, host tier included.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvcm.client import SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.lookup import LookupQuery
from kvcm.core.pool import PoolConfig
from kvcm.core.snapshot import decode_sections, encode_pool
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.journal import CHECKPOINT_FILE
from kvcm.server.settings import ServerSettings

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
POOL = "tiered"
CONFIG = PoolConfig(
    max_model_len=512,
    enable_kv_cache_events=True,
    host_tier_bytes=64 * SPEC.page_size_bytes,  # 64 host blocks: the tier evicts too
    explicit_layout=KVCacheConfig(
        num_blocks=17,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)


def _start(data_dir: Path) -> EmbeddedServer:
    return start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", data_dir=str(data_dir))
    )


def _prompt(seq: int) -> list[int]:
    # Seven prefixes of three blocks in turn, each with a tail of six blocks of its own: a
    # pool of 16 usable blocks keeps about two requests' blocks, so prefixes leave the device
    # (to the host tier) and come back.
    return [(seq % 7) * 1000 + i for i in range(48)] + [seq * 10_000 + i for i in range(100)]


def _drive(
    client: SchedulerClient, first_seq: int, steps: int, *, lookups: bool = True
) -> list[object]:
    """Steps that admit and finish one request each, and (``lookups``) a Lookup of a later
    prompt after each: their answers. (A Lookup skips a pool that a checkpoint holds.)"""
    hasher = client.block_hasher(POOL)
    answers: list[object] = []
    for seq in range(first_seq, first_seq + steps):
        step = StepBuilder()
        step.step_seq = seq
        prompt = _prompt(seq)
        step.add_request(seq, prompt, hasher.hash_token_ids(prompt))
        step.allocate(seq, len(prompt), 0, lookup=True)
        step.cache_blocks(seq, len(prompt))
        step.finish(seq)
        answers.append(client.step(POOL, step).outcome)
        if not lookups:
            continue
        (hit,) = client.lookup(LookupQuery(token_ids=_prompt(seq + 2), pool_ids=[POOL])).pools
        answers.append((hit.num_hit_tokens, dict(hit.tier_hit_tokens)))
    return answers


def _state(server: EmbeddedServer) -> tuple[object, int]:
    """The pool's complete state (its snapshot's sections, host tier included) without the
    wall-clock times of its events (two servers publish at different instants), and the host
    blocks in use."""

    async def read() -> tuple[object, int]:
        pool = server.server.state.registry.get(POOL)
        assert pool.host_tier is not None
        sections = decode_sections(encode_pool(pool))
        extras = sections[3]
        extras["events"] = [[event, 0.0] for event, _ in extras["events"]]
        extras["event_batches"][1] = [[*r[:3], 0.0] for r in extras["event_batches"][1]]
        return sections, pool.host_tier.stats().num_used

    return server.call(read())


def _fingerprint(server: EmbeddedServer) -> bytes:
    async def read() -> bytes:
        return server.server.state.registry.get(POOL).state_fingerprint()

    return server.call(read())


def _evictions(server: EmbeddedServer) -> int:
    async def read() -> int:
        host = server.server.state.registry.get(POOL).host_tier
        assert host is not None
        return host.stats().evictions

    return server.call(read())


def test_a_restart_from_a_checkpoint_keeps_the_host_tier(tmp_path: Path) -> None:
    steady = _start(tmp_path / "steady")
    restarted = _start(tmp_path / "restarted")
    running = [steady, restarted]
    try:
        with (
            SchedulerClient(steady.grpc_address) as a,
            SchedulerClient(restarted.grpc_address) as b,
        ):
            a.create_pool(POOL, CONFIG)
            b.create_pool(POOL, CONFIG)
            assert _drive(b, 1, 8) == _drive(a, 1, 8)
        before, used = _state(restarted)
        fingerprint = _fingerprint(restarted)
        assert used > 0  # blocks were demoted
        running.remove(restarted)
        restarted.stop()  # a graceful stop: the pools go to the checkpoint
        assert (tmp_path / "restarted" / CHECKPOINT_FILE).stat().st_size > 0
        restarted = _start(tmp_path / "restarted")
        running.append(restarted)
        assert _state(restarted)[0] == before
        assert _fingerprint(restarted) == fingerprint
        with (
            SchedulerClient(steady.grpc_address) as a,
            SchedulerClient(restarted.grpc_address) as b,
        ):
            expected = _drive(a, 9, 8)
            assert _drive(b, 9, 8) == expected
        cpu_hits = [answer[1].get("CPU", 0) for answer in expected[1::2]]  # type: ignore[index]
        assert any(cpu_hits), expected[1::2]  # the answers compared include host hits
        evictions = _evictions(steady)
        assert evictions > 0  # and the tier's own evictions
        assert _state(restarted) == _state(steady)
    finally:
        for server in running:
            server.stop()


def test_a_checkpoint_while_serving_plus_the_journal_tail_restore_the_tier(tmp_path: Path) -> None:
    """What a restart after a crash finds: the last checkpoint (taken while serving, with a
    demoting tier) and the journal's records after it, replayed on the restored tier."""
    server = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="",
            data_dir=str(tmp_path / "data"),
            checkpoint_every_records=10,
        )
    )
    try:
        with SchedulerClient(server.grpc_address) as client:
            client.create_pool(POOL, CONFIG)
            _drive(client, 1, 13, lookups=False)  # 14 records: a checkpoint is taken after the 10th
            journal = server.server.journal
            assert journal is not None
            give_up_at = time.monotonic() + 10
            while journal.records_since_checkpoint >= 10:
                assert time.monotonic() < give_up_at
                time.sleep(0.02)
            if journal.records_since_checkpoint == 0:  # the checkpoint saw every record
                # One record more: a tail, and no new checkpoint.
                _drive(client, 14, 1, lookups=False)
        assert journal.records_since_checkpoint > 0  # a tail to replay on the restored tier
        assert (tmp_path / "data" / CHECKPOINT_FILE).stat().st_size > 0
        before = _fingerprint(server)
        assert _evictions(server) > 0
        replayed = _start(tmp_path / "data")
        try:
            assert _fingerprint(replayed) == before
        finally:
            replayed.stop()
    finally:
        server.stop()
