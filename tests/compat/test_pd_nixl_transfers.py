"""``KvcmNixlConnector`` records vLLM 0.33's P/D handoffs in kvcm and changes nothing of them.

The clusters are tests/compat/test_pd_nixl.py's (two vLLM ``EngineCore`` s, simulated NIXL
workers on a deterministic fabric, a proxy playing vLLM's example proxy). The reference runs
vLLM's schedulers with vLLM's ``NixlConnector``; the other runs kvcm's schedulers with
``KvcmNixlConnector`` (loaded by vLLM's connector factory from ``kvcm.integrations.vllm``), each
engine on its own pool of one kvcm server on 127.0.0.1. Every turn of both engines is compared
(scheduler outputs, what the connector hands the workers, engine outputs, KV events) and must
be equal but for the ``kvcm_pool`` key the source engine adds to the ``kv_transfer_params`` it
answers; the pools end equal to vLLM's and the server's copies equal the mirrors (kvcm freed
no block an engine held: a record-only transfer never touches a pool).

Then the records: one per handoff the prefill engine offered, each in the state the flow gave
it: COMPLETED for pulls that finished (blocks pulled, the decode engine's own hit as tokens
saved), RELEASED for failed or partly invalid loads and for decode requests aborted before
their pull, EXPIRED (source freed by the engine) for transfers nobody pulled before the prefill
engine's lease ran out; and the transfer metrics add up. With ``KVCM_LONG=1`` also the
bidirectional flow: the decode engine's kept blocks are sources the next turn's prefill engine
pulls (or whose TTL runs out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from _engine_core import TransferFabric, build_engine, workload_scale
from _program_replay import pool_state
from test_pd_nixl import (
    LEASE_S,
    LEASE_TURNS,
    PdCluster,
    _free_state,
    _server_state,
    _setup,
    scenario,
    server,
)

from kvcm.client import SchedulerClient, TransferState
from kvcm.server.embedded import EmbeddedServer
from kvcm.server.rpc import TransferView

__all__ = ["server"]  # the module's kvcm server fixture


def _build(
    engine_async: bool,
    scheduler: tuple[type, type] | None,
    config: dict[str, Any] | None,
    *,
    bidirectional: bool = False,
) -> PdCluster:
    """test_pd_nixl's cluster; with ``config`` (kvcm's), on ``KvcmNixlConnector``."""
    fabric = TransferFabric(pull_turns=1, seconds_per_turn=LEASE_S / LEASE_TURNS)
    extra: dict[str, Any] = {}
    if bidirectional:  # as test_pd_nixl's build_cluster
        extra = {
            "bidirectional_kv_xfer": True,
            "decoder_kv_blocks_ttl": LEASE_S * 2,  # 16 turns
            "kv_recompute_threshold": 8,
        }
    engines = []
    for role in ("prefill", "decode"):
        setup = _setup(role, fabric, engine_async, extra)
        if config is not None:
            transfer = {
                **(setup.kv_transfer or {}),
                "kv_connector": "KvcmNixlConnector",
                "kv_connector_module_path": "kvcm.integrations.vllm",
            }
            setup = dataclasses.replace(setup, kv_transfer=transfer)
        cls = None if scheduler is None else scheduler[1 if engine_async else 0]
        additional = None if config is None else config[role]
        engines.append(build_engine(setup, cls, additional))
    return PdCluster(engines[0], engines[1], fabric, bidirectional)


def _run_compared(
    reference: PdCluster, kvcm: PdCluster, conversations: list[Any], connectors: list[Any]
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """Both clusters turn by turn, every record equal but for ``kvcm_pool``; yields the
    reference's (turn, [prefill record, decode record])."""
    for expected, actual in zip(reference.run(conversations), kvcm.run(conversations), strict=True):
        turn, *want = expected
        _, *got = actual
        for role, wanted, seen in zip(("prefill", "decode"), want, got, strict=True):
            seen["outputs"] = _without_kvcm_keys(seen["outputs"])
            for key in ("scheduled", "connector", "outputs", "executed", "events"):
                assert seen[key] == wanted[key], f"turn {turn}: the {role} engine's {key}"
        # Ship each turn's records before the next turn: the two engines' calls travel on
        # their own threads, and this keeps them in the engines' order.
        for connector in connectors:
            assert connector.transfer_log is not None
            assert connector.transfer_log.flush(30.0)
        yield turn, want
    assert reference.fabric.log == kvcm.fabric.log


def _check_pools(
    reference: PdCluster, kvcm: PdCluster, server: EmbeddedServer, pools: dict[str, str]
) -> None:
    """Both pools end equal to vLLM's, holding nothing; the server's copies equal the mirrors
    (a record-only transfer never touched a pool)."""
    for role, ref_engine, kvcm_engine in zip(
        ("prefill", "decode"), reference.engines(), kvcm.engines(), strict=True
    ):
        manager = kvcm_engine.scheduler.kv_cache_manager
        assert not kvcm_engine.scheduler.requests
        assert all(b.ref_cnt == 0 for b in manager.core.block_pool.blocks[1:])
        assert _free_state(manager.core.block_pool) == _free_state(
            ref_engine.scheduler.kv_cache_manager.block_pool
        ), f"the {role} pools differ"
        assert manager.flush(30.0)
        assert manager.recorder.sink.stats.mismatches == 0
        assert manager.recorder.sink.stats.resyncs == 0
        assert _server_state(server, pools[role]) == pool_state(manager.core, [])


def _without_kvcm_keys(outputs: Any) -> Any:
    """Engine outputs less the ``kvcm_pool`` key of the ``kv_transfer_params``."""
    for client_outputs in (outputs or {}).values():
        for output in client_outputs["outputs"]:
            params = output.get("kv_transfer_params")
            if params is not None:
                params.pop("kvcm_pool", None)
    return outputs


def _expected_state(fault: str | int | None) -> tuple[TransferState, str]:
    """The record a conversation turn's fault gives (state, reason's start)."""
    if fault is None or fault == "abort-while-decoding":
        return TransferState.COMPLETED, ""
    if fault == "fail":
        return TransferState.RELEASED, "load failed"
    if isinstance(fault, int):
        return TransferState.RELEASED, ""  # "<n> of <m> blocks invalid: recomputed ..."
    if fault == "abort-before-schedule":
        return TransferState.RELEASED, "aborted before its pull"
    assert fault == "never-pull"
    return TransferState.EXPIRED, "the engine freed the source"


@pytest.mark.parametrize("engine_async", [False])
def test_kvcm_nixl_connector_records_every_handoff_and_changes_nothing(
    engine_async: bool, server: EmbeddedServer
) -> None:
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmNixlConnector, KvcmScheduler

    conversations = scenario("all", seed=11)
    pools = {role: f"pd-{role}-recorded" for role in ("prefill", "decode")}
    config = {
        role: {"kvcm": {"address": server.grpc_address, "pool_id": pool, "mode": "mirror"}}
        for role, pool in pools.items()
    }
    reference = _build(engine_async, None, None)
    kvcm = _build(engine_async, (KvcmScheduler, KvcmAsyncScheduler), config)
    offered: dict[str, dict[str, Any]] = {}  # prefill request -> the params it answered
    pulled: dict[str, tuple[int, int]] = {}  # decode request -> (local hit, pulled blocks)
    try:
        connectors = [engine.scheduler.connector for engine in kvcm.engines()]
        assert all(type(c) is KvcmNixlConnector for c in connectors)
        for _turn, want in _run_compared(reference, kvcm, conversations, connectors):
            for outputs in (want[0]["outputs"] or {}).values():
                for output in outputs["outputs"]:
                    if output["finish_reason"] is not None:
                        offered[output["request_id"]] = output["kv_transfer_params"]
            for meta in want[1]["connector"]:
                for req_id, (local, computed, awaiting, *_rest) in (
                    (meta or {}).get("recv", {}).items()
                ):
                    if awaiting:
                        pulled[req_id] = (computed[0] if computed else 0, len(local[0]))
        _check_pools(reference, kvcm, server, pools)
        logs = [c.transfer_log for c in connectors]
        assert all(log is not None and log.flush(30.0) for log in logs)
        assert sum(log.failures for log in logs if log is not None) == 0
    finally:
        for engine in (*kvcm.engines(), *reference.engines()):
            engine.shutdown()

    with SchedulerClient(server.grpc_address) as client:
        records = {t.transfer_id: t for t in client.list_transfers(pools["prefill"])}
        assert not client.list_transfers(pools["decode"])  # no bidirectional sources
    faults = {
        f"{conv.conv_id}-{turn}": conv.faults.get(turn)
        for conv in conversations
        for turn in range(len(conv.user_turns))
    }
    # Every handoff the prefill engine offered has its record, and nothing else does.
    assert set(records) == set(offered)
    counts: dict[TransferState, int] = {}
    for request_id, record in records.items():
        params = offered[request_id]
        state, reason = _expected_state(faults[request_id])
        assert (record.state, record.reason.startswith(reason)) == (state, True), request_id
        counts[state] = counts.get(state, 0) + 1
        assert record.record_only
        assert (record.pool_id, record.request_id) == (pools["prefill"], request_id)
        assert record.source_blocks == tuple(tuple(g) for g in params["remote_block_ids"])
        assert record.num_tokens == params["remote_num_tokens"]
        assert record.lease_s == LEASE_S
        if state is TransferState.EXPIRED:
            assert record.source_freed
            assert not record.destination_pool_id  # nobody planned a pull
            continue
        if faults[request_id] == "abort-before-schedule":
            assert not record.destination_pool_id
            continue
        assert record.destination_pool_id == pools["decode"]
        # The decode engine's own hit is the transfer saved; it pulls the rest.
        assert record.hit_tokens + record.pull_tokens == record.num_tokens
        if request_id in pulled:
            hit_blocks, pull_blocks = pulled[request_id]
            assert (record.hit_blocks, record.pull_blocks) == (hit_blocks, pull_blocks)
            if state is TransferState.COMPLETED:
                assert record.blocks_pulled == pull_blocks
        else:  # a full local hit: nothing to pull, completed at once
            assert (record.pull_tokens, record.blocks_pulled) == (0, 0)
    assert counts[TransferState.COMPLETED] > 0
    assert counts[TransferState.RELEASED] >= 4  # 2 failed, 1 partly invalid, aborted ones
    assert counts[TransferState.EXPIRED] >= 2  # never pulled
    samples = server.call(_samples(TransferView(server.server.state)))

    def sample(name: str) -> float:
        return {labels[0]: value for labels, value in samples[name]}[pools["prefill"]]

    assert sample("kvcm_transfers_started_total") == len(records)
    assert sample("kvcm_transfers_completed_total") == counts[TransferState.COMPLETED]
    assert sample("kvcm_transfers_failed_total") == counts[TransferState.RELEASED]
    assert sample("kvcm_transfers_expired_total") == counts[TransferState.EXPIRED]
    assert sample("kvcm_transfer_blocks_pulled_total") == sum(
        r.blocks_pulled for r in records.values()
    )
    assert sample("kvcm_transfer_blocks_saved_total") == sum(r.hit_blocks for r in records.values())
    assert sample("kvcm_transfers_in_flight") == 0
    assert sample("kvcm_transfers_past_lease") == 0
    print(
        f"{len(records)} handoffs recorded: "
        + ", ".join(f"{state.name} {n}" for state, n in sorted(counts.items()))
    )


async def _samples(view: TransferView) -> dict[str, list[tuple[list[str], float]]]:
    return view.samples()


@pytest.mark.skipif(
    workload_scale() == 1, reason="KVCM_LONG=1 only (keeps this file within CI's time budget)"
)
def test_bidirectional_handoffs_are_recorded_both_ways(server: EmbeddedServer) -> None:
    """With ``bidirectional_kv_xfer`` the decode engine's kept blocks are sources too: the next
    turn's prefill engine pulls them (COMPLETED on the decode pool's records) or their TTL runs
    out (EXPIRED, freed by the engine); every turn still equals vLLM's."""
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    conversations = scenario("bidirectional", seed=len("bidirectional"))
    pools = {role: f"pd-{role}-recorded-bidi" for role in ("prefill", "decode")}
    config = {
        role: {"kvcm": {"address": server.grpc_address, "pool_id": pool, "mode": "mirror"}}
        for role, pool in pools.items()
    }
    reference = _build(False, None, None, bidirectional=True)
    kvcm = _build(False, (KvcmScheduler, KvcmAsyncScheduler), config, bidirectional=True)
    prefill_pulls = 0
    try:
        connectors = [engine.scheduler.connector for engine in kvcm.engines()]
        for _turn, want in _run_compared(reference, kvcm, conversations, connectors):
            for meta in want[0]["connector"]:
                prefill_pulls += sum(v[2] for v in (meta or {}).get("recv", {}).values())
        _check_pools(reference, kvcm, server, pools)
        assert sum(c.transfer_log.failures for c in connectors) == 0
    finally:
        for engine in (*kvcm.engines(), *reference.engines()):
            engine.shutdown()
    with SchedulerClient(server.grpc_address) as client:
        kept = client.list_transfers(pools["decode"])
        prefilled = client.list_transfers(pools["prefill"])
    # Every turn's prefill offered its blocks to the decode engine (one pull failed).
    assert {t.state for t in prefilled} == {TransferState.COMPLETED, TransferState.RELEASED}
    assert sum(t.state is TransferState.RELEASED for t in prefilled) == 1
    # What the decode engine kept: pulled by the next turn's prefill, or expired at its TTL.
    completed = [t for t in kept if t.state is TransferState.COMPLETED]
    expired = [t for t in kept if t.state is TransferState.EXPIRED]
    assert len(completed) + len(expired) == len(kept)
    assert len(completed) == prefill_pulls > 0
    assert all(t.destination_pool_id == pools["prefill"] for t in completed)
    assert all(t.lease_s == LEASE_S * 2 for t in kept)  # decoder_kv_blocks_ttl
    assert expired
    assert all(t.source_freed and not t.destination_pool_id for t in expired)
