"""vLLM 0.33's P/D flow (``NixlConnector``, pull mode) for a hybrid full attention + Mamba
model in align mode, on kvcm's schedulers against vLLM's.

vLLM 0.33 serves hybrid Mamba models with its NIXL connector: the connector declares
``supports_divergent_local_hybrid_hits``, so vLLM's scheduler looks a request up with
``get_computed_blocks_for_connector`` (each group alone, full attention's hit reported; a
lagging Mamba group is completed by the pull, or the hit is looked up again when nothing is
pulled), drops a local sub-block tail a longer pull covers (``truncate_computed_blocks``),
drains the Mamba boundary states every step (``take_boundary_state_offloads``, handed to the
connector in ``SchedulerOutput.kv_connector_block_state``), a producer hands a finished
request's partial tail off (``finalize_partial_tail_offloads``), and the decode engine's
asynchronous loads skip zeroing the blocks they fill (``skip_zeroing_group_ids``).

Each case builds two P/D clusters (tests/compat/test_pd_nixl.py's proxy and simulated NIXL
workers) whose engines are vLLM's EngineCore over workers reporting the hybrid model's specs
(test_mamba_engine_core.py: attention and Mamba blocks of 256 tokens, hash block 64): one
cluster on vLLM's schedulers, one on kvcm's (mirror mode). Every turn's ``SchedulerOutput``
(block tables, copies, boundary-state hand-offs, blocks to zero), connector metadata, engine
outputs and events are compared. A CI run drives 8 conversations per case; ``KVCM_LONG=1``
drives 28.
"""

from __future__ import annotations

import gc
import os
import random
from typing import Any

import pytest
from _engine_core import VOCAB, Engine, Setup, TransferFabric, executor_class, vllm_config
from _program_replay import pool_state
from test_mamba_engine_core import HASH_BLOCK, MAMBA_BLOCK, _HybridMambaWorker
from test_pd_nixl import (
    LEASE_S,
    LEASE_TURNS,
    Conversation,
    PdCluster,
    _server_state,
    assert_same_pd_runs,
    server,
)

from kvcm.server.embedded import EmbeddedServer

__all__ = ["server"]  # the kvcm server fixture (test_pd_nixl's)

# Conversations per case: a CI run keeps each case near 5 s; KVCM_LONG=1 runs the long variant.
NUM_CONVERSATIONS = 28 if os.environ.get("KVCM_LONG") == "1" else 8


def _setup(role: str, fabric: TransferFabric, engine_async: bool) -> Setup:
    return Setup(
        block_size=MAMBA_BLOCK,
        num_blocks=40,
        max_model_len=2048,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        async_scheduling=engine_async,
        kv_transfer={
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "engine_id": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kv_lease_duration": LEASE_S},
        },
        fabric=fabric,
    )


def _build(setup: Setup, scheduler_cls: Any, additional_config: Any = None) -> Engine:
    from vllm.v1.engine.core import EngineCore

    base = executor_class(setup)

    def init_executor(self: Any) -> None:
        base._init_executor(self)
        world = self.vllm_config.parallel_config.world_size
        # Each rank reports the hybrid model (the last one moves KV over the fabric).
        self.workers = [_HybridMambaWorker(self.vllm_config, r, setup) for r in range(world)]
        for worker in self.workers:
            if worker.nixl is not None:
                worker.nixl.hma_required = True

    executor = type("HybridMambaNixlExecutor", (base,), {"_init_executor": init_executor})
    config = vllm_config(setup, scheduler_cls, additional_config)
    config.cache_config.mamba_cache_mode = "align"
    config.cache_config.mamba_block_size = MAMBA_BLOCK
    config.cache_config.prefix_match_unit = HASH_BLOCK
    config.parallel_config.distributed_executor_backend = executor
    core = EngineCore(config, executor, setup.log_stats)
    return Engine(core, setup)


def _close(engine: Engine) -> None:
    # EngineCore.shutdown less its distributed cleanup, which these simulated engines never
    # set up and whose full garbage collection costs ~1 s per engine on a 2-core VM.
    core = engine.core
    core.structured_output_manager.clear_backend()
    core.model_executor.shutdown()
    core.scheduler.shutdown()
    gc.unfreeze()


def _scheduler_cls(engine_async: bool, kvcm: bool) -> Any:
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    if not kvcm:
        return None
    return KvcmAsyncScheduler if engine_async else KvcmScheduler


def _cluster(prefill_async: bool, kvcm: bool, config: dict[str, Any] | None = None) -> PdCluster:
    # The decode engine (the KV consumer) schedules synchronously (an asynchronous one defers
    # its frees: test_mamba_async_consumer.py). ``config``: additional_config per role.
    fabric = TransferFabric(pull_turns=1, seconds_per_turn=LEASE_S / LEASE_TURNS)
    config = config or {}
    prefill = _build(
        _setup("prefill", fabric, prefill_async),
        _scheduler_cls(prefill_async, kvcm),
        config.get("prefill"),
    )
    decode = _build(
        _setup("decode", fabric, False), _scheduler_cls(False, kvcm), config.get("decode")
    )
    return PdCluster(prefill, decode, fabric)


def _conversations(seed: int) -> list[Conversation]:
    # Shared system prompts of several lengths (local hits on both engines that end inside
    # Mamba blocks), multi-turn histories, failed pulls, aborts and a never-pulled turn.
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    systems = [tokens(n) for n in (200, 330, 520)]
    # A failed pull is reported as NIXL reports it for a hybrid model: the request only.
    faults: list[dict[int, str | int]] = [{}, {}, {0: "fail"}, {1: "abort-while-decoding"}]
    faults += [{0: "never-pull"}, {0: "abort-before-schedule"}, {1: "fail"}]
    convs = []
    for i in range(NUM_CONVERSATIONS):
        system = systems[i % len(systems)] if i % 4 else ()
        turns = [system + tokens(rng.randrange(20, 300))]
        turns += [tokens(rng.randrange(10, 200)) for _ in range(rng.randrange(0, 3))]
        convs.append(
            Conversation(
                f"c{i}",
                i * 2,
                turns,
                max_tokens=rng.choice((4, 12, 30)),
                faults=dict(faults[i % len(faults)]) if len(turns) > 1 or i % 8 < 7 else {},
            )
        )
    return convs


def _count_calls(manager: Any, counts: dict[str, int]) -> None:
    # Wrap the mirror's connector paths to count what the run exercised.
    lookup = manager.get_computed_blocks_for_connector
    take = manager.take_boundary_state_offloads
    allocate = manager.allocate_slots

    def counted_lookup(request: Any, max_len: int | None = None) -> Any:
        found = lookup(request, max_len)
        counts["lookups"] += 1
        counts["local-hits"] += found[1] > 0
        counts["diverged"] += found[3]
        return found

    def counted_take() -> dict[str, Any]:
        found = take()
        counts["offloads"] += sum(map(len, found.values()))
        return found

    def counted_allocate(*args: Any, **kwargs: Any) -> Any:
        counts["zero-skips"] += bool(kwargs.get("skip_zeroing_group_ids"))
        return allocate(*args, **kwargs)

    manager.get_computed_blocks_for_connector = counted_lookup
    manager.take_boundary_state_offloads = counted_take
    manager.allocate_slots = counted_allocate


@pytest.mark.parametrize(
    ("prefill_async", "mode"),
    [(False, "mirror"), (True, "remote")],
    ids=["sync-mirror", "async-prefill-remote"],
)
def test_hybrid_mamba_pd_turns_equal_vllm(
    prefill_async: bool, mode: str, server: EmbeddedServer
) -> None:
    """kvcm's schedulers answer a P/D pair of hybrid Mamba engines exactly as vLLM's,
    shipping to a kvcm server (mirror mode) or answered by it (remote mode); the server's
    pools end equal to the mirrors."""
    engine_async = prefill_async
    suffix = f"{mode}-{'async' if prefill_async else 'sync'}"
    pools = {role: f"mamba-pd-{role}-{suffix}" for role in ("prefill", "decode")}
    config = {
        role: {"kvcm": {"address": server.grpc_address, "pool_id": pool, "mode": mode}}
        for role, pool in pools.items()
    }
    reference = _cluster(prefill_async, kvcm=False)
    mirrored = _cluster(prefill_async, kvcm=True, config=config)
    counts = dict.fromkeys(("lookups", "local-hits", "diverged", "offloads", "zero-skips"), 0)
    try:
        for engine in mirrored.engines():
            manager = engine.scheduler.kv_cache_manager
            assert engine.scheduler.connector.supports_divergent_local_hybrid_hits
            assert manager.coordinator.enable_partial_hash_hits
            _count_calls(manager, counts)
        tally = assert_same_pd_runs(reference, mirrored, _conversations(int(engine_async)))
        for role, engine in zip(("prefill", "decode"), mirrored.engines(), strict=True):
            manager = engine.scheduler.kv_cache_manager
            assert not engine.scheduler.requests
            assert all(b.ref_cnt == 0 for b in manager.core.block_pool.blocks[1:])
            assert manager.flush(30.0)
            stats = manager.recorder.sink.stats
            assert stats.mismatches == 0, stats
            assert _server_state(server, pools[role]) == pool_state(manager.core, [])
    finally:
        for cluster in (mirrored, reference):
            for engine in cluster.engines():
                _close(engine)
    print(
        f"{suffix}: {tally.turns} turns, "
        f"{tally.prefill_batches}+{tally.decode_batches} batches, {tally.pulls} pulls, "
        f"{tally.events} events, {counts}, "
        f"fabric {tally.fabric}, finished {tally.finished}"
    )
    assert tally.pulls > 5
    assert tally.fabric.get("pull-failed", 0) >= 2
    assert counts["offloads"]
    assert counts["local-hits"]
    assert counts["diverged"]
    assert counts["zero-skips"]
