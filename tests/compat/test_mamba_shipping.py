"""Sub-block prefix hits of a hybrid Mamba model with a kvcm server: vLLM's real EngineCore on
kvcm's schedulers in shipping-mirror and remote mode, turn for turn equal to vLLM's scheduler.

The engine is the one of ``test_mamba_engine_core`` (a full-attention and an align-mode Mamba
layer, 256-token blocks, ``--prefix-match-unit 64``: hits on 64-token boundaries inside Mamba
blocks, served through block copies). The mirror records a TAKE_BLOCK_COPIES op where vLLM's
scheduler drains the copies; a real kvcm server on 127.0.0.1 runs the shipped programs and
answers the copies each drain took, which the shipper checks against the mirror's with the
rest of the answer. Mirror mode ships in the background (coalescing what queued, drains kept
in order with one count each); remote mode waits for the server's answer to every allocation
and drain. The server's pool equals the engine's after every turn (remote mode) and at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _engine_core import Setup, assert_same_runs, workload_scale
from test_mamba_engine_core import CASES, HASH_BLOCK, _build, _plans
from test_vllm_shipping import mirror_state, server_pool_state

from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A kvcm server on 127.0.0.1 (gRPC only)."""
    embedded = start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    try:
        yield embedded
    finally:
        embedded.stop()


@pytest.mark.parametrize("mode", ["mirror", "remote"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sub_block_hits_with_a_kvcm_server_equal_vllm(
    case: str, mode: str, server: EmbeddedServer, vllm: Any
) -> None:
    """Every turn equals vLLM's (copies included); every shipped answer, drained copies
    included, equals the mirror's; the server's pool ends equal to the engine's (remote mode:
    after every turn)."""
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    del vllm
    setup: Setup = CASES[case]
    plans = _plans(len(case) + len(mode), 12 * workload_scale(), setup.max_model_len)
    pool_id = f"mamba-{case}-{mode}"
    config = {"kvcm": {"address": server.grpc_address, "pool_id": pool_id, "mode": mode}}
    kvcm_cls = KvcmAsyncScheduler if setup.async_scheduling else KvcmScheduler
    reference = _build(setup)
    mirrored = _build(setup, kvcm_cls, additional_config=config)
    copies = {"n": 0, "drains": 0, "turns_compared": 0}
    try:
        assert reference.scheduler.kv_cache_config.cache_hit_alignment_tokens == HASH_BLOCK
        manager = mirrored.scheduler.kv_cache_manager
        assert manager.coordinator.enable_partial_hash_hits
        assert manager.sink.acknowledges_each_answer == (mode == "remote")
        original = manager.take_kv_cache_block_copies

        def counting() -> tuple[list[Any], list[Any]]:
            found = original()
            if found[0]:
                copies["n"] += len(found[0])
                copies["drains"] += 1
                if mode == "remote":  # the server ran the drain before vLLM sees it
                    assert not manager.recorder.pending
            return found

        manager.take_kv_cache_block_copies = counting

        def after_turn(turns: int, engine: Any) -> None:
            if mode != "remote" or not manager.sink.stats.step_rpcs:
                return  # (nothing allocated yet: the server has no pool)
            # update_from_output()'s changes ship with the next step: flush them too.
            assert manager.flush(10.0), manager.sink.stats
            assert server_pool_state(server, pool_id) == mirror_state(engine), turns
            copies["turns_compared"] += 1

        tally = assert_same_runs(reference, mirrored, plans, after_turn=after_turn)
        shipper = manager.sink
        assert manager.flush(30.0), shipper.stats
        stats = shipper.stats
        print(
            f"{case} {mode}: {tally.turns} turns, {tally.batches} batches, {tally.hits} hits, "
            f"{copies['n']} copies in {copies['drains']} drains, {tally.preempted} "
            f"preemptions, {copies['turns_compared']} turns with the server's pool compared; "
            f"{stats}"
        )
        assert stats.mismatches == 0
        assert stats.resyncs == 0
        assert stats.steps_verified == stats.steps_submitted == stats.steps_shipped
        if mode == "remote":
            assert stats.step_rpcs == stats.steps_submitted
            assert copies["turns_compared"] > 30
        assert server_pool_state(server, pool_id) == mirror_state(mirrored)
    finally:
        mirrored.shutdown()
        reference.shutdown()
    assert tally.batches > 30
    assert tally.hits > 0
    assert copies["drains"] > 0
    assert tally.finished == len(plans)
