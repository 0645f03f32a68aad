"""An asynchronous KV consumer beside Mamba layers: vLLM 0.33's deferred frees on kvcm.

vLLM's scheduler defers block frees (``defer_block_free``) on a KV-consumer engine with
several batches in flight (async scheduling or pipeline parallelism: the P/D decode engine
of vLLM's NIXL connector), because a load into a freed block is not ordered against the step
still writing it. A request finished while a step that scheduled it is in flight is popped
(``pop_blocks_for_free``) and its blocks go back in one ``block_pool.free_blocks`` call once
that step is processed; the copy retentions of sub-block hits (both ends of each copy) go
back one step after their drain, oldest drain first. kvcm records those as FINISH_DEFERRED,
TAKE_BLOCK_COPIES_RETAINED and RELEASE_BLOCK_COPIES (docs/mamba.md).

Each case builds two P/D clusters of hybrid full attention + align-mode Mamba EngineCores
(tests/compat/test_mamba_pd_nixl.py's engines, vLLM's ``NixlConnector``, the decode engine
scheduling asynchronously), one on vLLM's schedulers, one on kvcm's: without a server, shipping
to one (mirror mode) and answered by one (remote mode). Every turn is compared (block tables,
copies, boundary-state hand-offs, connector metadata, outputs, events); the server's pools end
equal to the mirrors, every answer verified. The run must defer request frees and copy
retentions on the decode engine.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from _engine_core import VOCAB
from _program_replay import pool_state
from test_mamba_pd_nixl import LEASE_S, LEASE_TURNS, _build, _close, _scheduler_cls, _setup
from test_pd_nixl import (
    Conversation,
    PdCluster,
    TransferFabric,
    _server_state,
    assert_same_pd_runs,
    server,
)

from kvcm.server.embedded import EmbeddedServer

__all__ = ["server"]  # the kvcm server fixture (test_pd_nixl's)

# Conversations per case: a CI run keeps each case near 3 s; KVCM_LONG=1 runs the long variant.
NUM_CONVERSATIONS = 48 if os.environ.get("KVCM_LONG") == "1" else 14


def _cluster(kvcm: bool, config: dict[str, Any] | None = None) -> PdCluster:
    # Both engines schedule asynchronously: the decode engine defers its frees.
    fabric = TransferFabric(pull_turns=1, seconds_per_turn=LEASE_S / LEASE_TURNS)
    config = config or {}
    prefill = _build(
        _setup("prefill", fabric, True), _scheduler_cls(True, kvcm), config.get("prefill")
    )
    decode = _build(
        _setup("decode", fabric, True), _scheduler_cls(True, kvcm), config.get("decode")
    )
    return PdCluster(prefill, decode, fabric)


def _conversations(seed: int) -> list[Conversation]:
    # Shared system prompts whose hits end inside Mamba blocks (sub-block hits on the decode
    # engine: copies), multi-turn histories, and requests aborted while decoding (a finish
    # while a step that scheduled them is in flight: a deferred request free), failed pulls.
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    systems = [tokens(n) for n in (200, 330, 520)]
    faults: list[dict[int, str | int]] = [
        {0: "abort-while-decoding"},
        {},
        {1: "abort-while-decoding"},
        {0: "fail"},
        {},
        {1: "abort-while-decoding", 2: "abort-while-decoding"},
    ]
    convs = []
    for i in range(NUM_CONVERSATIONS):
        system = systems[i % len(systems)] if i % 5 else ()
        turns = [system + tokens(rng.randrange(20, 300))]
        turns += [tokens(rng.randrange(10, 200)) for _ in range(rng.randrange(1, 3))]
        fault = faults[i % len(faults)]
        aborts = "abort-while-decoding" in fault.values()
        max_tokens = 30 if aborts else rng.choice((4, 12, 30))
        convs.append(Conversation(f"c{i}", i * 2, turns, max_tokens, faults=dict(fault)))
    return convs


def _count_deferrals(scheduler: Any, counts: dict[str, int]) -> None:
    # vLLM's scheduler's deferred frees as the decode engine makes them.
    manager = scheduler.kv_cache_manager
    pop = manager.pop_blocks_for_free
    take = manager.take_kv_cache_block_copies

    def counted_pop(request: Any) -> list[Any]:
        blocks = pop(request)
        counts["request-frees"] += bool(blocks)
        return blocks

    def counted_take() -> tuple[list[Any], list[Any]]:
        copies, retained = take()
        counts["copy-drains"] += bool(retained)
        counts["copies"] += len(copies)
        return copies, retained

    manager.pop_blocks_for_free = counted_pop
    manager.take_kv_cache_block_copies = counted_take


@pytest.mark.parametrize("mode", ["none", "mirror", "remote"])
def test_async_consumer_with_mamba_turns_equal_vllm(mode: str, server: EmbeddedServer) -> None:
    """kvcm's schedulers answer a P/D pair of hybrid Mamba engines, the decode engine an
    asynchronous KV consumer deferring its frees, exactly as vLLM's."""
    pools = {role: f"mamba-async-consumer-{role}-{mode}" for role in ("prefill", "decode")}
    config = (
        None
        if mode == "none"
        else {
            role: {"kvcm": {"address": server.grpc_address, "pool_id": pool, "mode": mode}}
            for role, pool in pools.items()
        }
    )
    reference = _cluster(kvcm=False)
    mirrored = _cluster(kvcm=True, config=config)
    counts = dict.fromkeys(("request-frees", "copy-drains", "copies"), 0)
    try:
        decode = mirrored.decode.scheduler
        assert decode.defer_block_free
        assert reference.decode.scheduler.defer_block_free
        assert not mirrored.prefill.scheduler.defer_block_free
        _count_deferrals(decode, counts)
        tally = assert_same_pd_runs(reference, mirrored, _conversations(1))
        for role, engine in zip(("prefill", "decode"), mirrored.engines(), strict=True):
            manager = engine.scheduler.kv_cache_manager
            assert not engine.scheduler.requests
            assert not manager.core.retained_copy_batches
            assert all(b.ref_cnt == 0 for b in manager.core.block_pool.blocks[1:])
            if mode == "none":
                continue
            assert manager.flush(30.0)
            stats = manager.recorder.sink.stats
            assert stats.mismatches == 0, stats
            assert _server_state(server, pools[role]) == pool_state(manager.core, [])
    finally:
        for cluster in (mirrored, reference):
            for engine in cluster.engines():
                _close(engine)
    print(
        f"{mode}: {tally.turns} turns, {tally.prefill_batches}+{tally.decode_batches} "
        f"batches, {tally.pulls} pulls, {tally.events} events, decode engine {counts}"
    )
    assert tally.pulls > 5
    assert counts["request-frees"]
    assert counts["copy-drains"]
