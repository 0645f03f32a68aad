"""A mirrored pool's event stream on the server, read as a router reads an engine's.

vLLM 0.33's own ``EngineCore`` runs on ``KvcmScheduler`` / ``KvcmAsyncScheduler`` (mirror mode,
shipping thread) beside the same engine on vLLM's own scheduler. The server publishes the
pool's KV events on ZMQ; a subscriber bound as a router binds (vLLM's ``KVEventBatch``
decoder, topic-blind, the sequence numbers checked for gaps) collects them. Every event the
server published, in order, must equal vLLM's engine's events of the same run, requests with
``kv_cache_report_mode="full"`` included: vLLM reports their prefix hits again at each lookup
that hits, and so does the server's copy (the mirror sends a REPORT_HIT where its lookup
reported). Cases: full attention (also in remote mode), a hybrid sliding-window model (sync
and async scheduling; thread and process shipper), LoRA adapters with cache salts in a pool
small enough to preempt, EAGLE drafting whose hits drop their last block, a hybrid Mamba model
with sub-block hits (incremental reports), and two prefix-cache resets per run (one refused,
one publishing AllBlocksCleared).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import msgspec
import pytest
import zmq
from _engine_core import Engine, Setup, build_engine, plan_workload, run
from test_kv_events_zmq import _wait_connected

from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

_SMALL = {"max_model_len": 512}
CASES = {
    # name: (setup, seed, number of requests)
    "full-report-half": (Setup(num_blocks=60, report_full=0.5, **_SMALL), 31, 60),
    "hybrid-swa-report-all-async": (
        Setup(
            sliding_window=64,
            num_blocks=80,
            retention_interval=None,
            async_scheduling=True,
            report_full=1.0,
            **_SMALL,
        ),
        32,
        60,
    ),
    "full-incremental": (Setup(num_blocks=50, async_scheduling=True, **_SMALL), 33, 60),
    # LoRA adapters and cache salts (extra keys, lora names), preemptions in a small pool,
    # and prefix-cache resets (one refused while requests hold blocks, one that preempts
    # every running request and publishes AllBlocksCleared).
    "lora-salts-resets": (Setup(lora=True, num_blocks=40, report_full=0.3, **_SMALL), 34, 60),
    # EAGLE drafting with lookahead hashes off: every hit drops its last matched block, and
    # the report covers the hit after the drop (the blocks the lookup answers).
    "eagle-drop-report-half": (
        Setup(
            num_blocks=60,
            num_speculative_tokens=2,
            speculative_method="eagle",
            disable_lookahead_block_hashes=True,
            report_full=0.5,
            **_SMALL,
        ),
        35,
        60,
    ),
}
RESETS = {40: False, 120: True}
# The shipper process carries the notes too (its own encoding of the engine's notes), and
# remote mode (the server acknowledges every allocation before vLLM sees it) ships them alike.
PARAMS = [(case, "thread") for case in sorted(CASES)] + [
    ("hybrid-swa-report-all-async", "process"),
    ("full-report-half", "remote"),
]


@pytest.fixture
def subscriber() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A router's SUB socket, bound on 127.0.0.1 (the server's PUB connects to it)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        yield sub, f"tcp://127.0.0.1:{port}"
    finally:
        ctx.destroy(linger=0)


def _drain(sub: zmq.Socket[bytes], kv_events: ModuleType) -> tuple[list[Any], int]:
    """Every batch that arrives until the socket is quiet for 0.5 s: their events in order,
    and how many batches; sequence numbers must have no gap."""
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    events: list[Any] = []
    seqs: list[int] = []
    while sub.poll(500):
        _topic, seq, payload = sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        events.extend(decoder.decode(payload).events)
    assert all(b == a + 1 for a, b in itertools.pairwise(seqs)), f"a gap in {seqs}"
    return events, len(seqs)


def _encoded(events: list[Any]) -> list[bytes]:
    encoder = msgspec.msgpack.Encoder()
    return [encoder.encode(event) for event in events]


def _count_reports(events: list[Any], kv_events: ModuleType) -> int:
    """BlockStored events of blocks all cached already (a lookup's report, not a store)."""
    cached: set[Any] = set()
    reports = 0
    for event in events:
        if isinstance(event, kv_events.BlockStored):
            hashes = {(event.group_idx, h) for h in event.block_hashes}
            reports += hashes <= cached
            cached |= hashes
        elif isinstance(event, kv_events.BlockRemoved):
            cached -= {(event.group_idx, h) for h in event.block_hashes}
        else:
            cached.clear()
    return reports


@pytest.fixture
def events_server(
    subscriber: tuple[zmq.Socket[bytes], str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[EmbeddedServer]:
    """A kvcm server publishing to the subscriber, full block hashes on both sides (its
    setting and vLLM's publisher's)."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    server = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="",
            kv_events_endpoint=subscriber[1],
            kv_events_use_int_block_hashes=0,
        )
    )
    try:
        yield server
    finally:
        server.stop()


def _compare_streams(
    label: str,
    reference: Engine,
    mirrored: Engine,
    plans: list[Any],
    server: EmbeddedServer,
    sub: zmq.Socket[bytes],
    kv_events: ModuleType,
) -> tuple[int, int]:
    """Both engines turn for turn (so the mirror ships while the run goes on, as a live
    engine does), then the server's stream: every event vLLM's engine published, in order.
    Returns the events' lookup reports and AllBlocksCleared count."""
    try:
        _wait_connected(server, sub)
        theirs: list[Any] = []
        mine: list[Any] = []
        for ref, ours in zip(
            run(reference, plans, record=False, resets=RESETS),
            run(mirrored, plans, record=False, resets=RESETS),
            strict=True,
        ):
            # (A reset's answer rides with its turn's events: not an event of the stream.)
            theirs += [e for e in ref.events if not isinstance(e, tuple)]
            mine += [e for e in ours.events if not isinstance(e, tuple)]
        manager = mirrored.scheduler.kv_cache_manager
        assert manager.flush(30.0), manager.recorder.sink.stats
        published, batches = _drain(sub, kv_events)
        stats = manager.recorder.sink.stats
        reports = _count_reports(theirs, kv_events)
        cleared = sum(isinstance(e, kv_events.AllBlocksCleared) for e in theirs)
        print(
            f"{label}: {len(theirs)} vLLM events ({reports} lookup reports, {cleared} cleared), "
            f"{len(published)} published in {batches} batches; {stats}"
        )
        assert stats.mismatches == 0
        assert stats.resyncs == 0
        assert len(theirs) > 100
        # The engine's own stream (the mirror's events) is vLLM's, and so is the server's.
        assert _encoded(mine) == _encoded(theirs)
        assert _encoded(published) == _encoded(theirs)
        return reports, cleared
    finally:
        mirrored.shutdown()
        reference.shutdown()


@pytest.mark.parametrize(("case", "shipper"), PARAMS)
def test_the_server_stream_of_a_mirrored_pool_equals_vllms_events(
    case: str,
    shipper: str,
    kv_events: ModuleType,
    subscriber: tuple[zmq.Socket[bytes], str],
    events_server: EmbeddedServer,
) -> None:
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    setup, seed, num_requests = CASES[case]
    plans = plan_workload(seed, num_requests, setup)
    scheduler_cls = KvcmAsyncScheduler if setup.async_scheduling else KvcmScheduler
    settings = {"address": events_server.grpc_address, "pool_id": case}
    if shipper == "remote":
        settings["mode"] = "remote"
    else:
        settings["shipper"] = shipper
    config = {"kvcm": settings}
    reference = build_engine(setup)
    mirrored = build_engine(setup, scheduler_cls, config)
    reports, cleared = _compare_streams(
        f"{case}/{shipper}", reference, mirrored, plans, events_server, subscriber[0], kv_events
    )
    assert (reports > 10) if setup.report_full else (reports == 0)
    assert cleared == 1  # the second reset's


def test_the_server_stream_of_a_mirrored_mamba_pool_equals_vllms_events(
    kv_events: ModuleType,
    subscriber: tuple[zmq.Socket[bytes], str],
    events_server: EmbeddedServer,
) -> None:
    """A hybrid Mamba model (align mode, sub-block hits served through block copies; the
    engine of test_mamba_engine_core) under async scheduling and block pressure. Incremental
    reports only: where a Mamba hit ends in a block the request's tokens do not fill, vLLM's
    full-mode report raises IndexError (docs/core-api.md)."""
    from test_mamba_engine_core import CASES as MAMBA_CASES
    from test_mamba_engine_core import _build, _plans

    from kvcm.integrations.vllm import KvcmAsyncScheduler

    setup = MAMBA_CASES["async-pressure"]
    plans = _plans(36, 24, setup.max_model_len)
    config = {"kvcm": {"address": events_server.grpc_address, "pool_id": "mamba"}}
    reference = _build(setup)
    mirrored = _build(setup, KvcmAsyncScheduler, additional_config=config)
    _compare_streams(
        "mamba/thread", reference, mirrored, plans, events_server, subscriber[0], kv_events
    )
