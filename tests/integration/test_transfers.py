"""P/D transfer records on a real server (TransferService through the SDK).

A prefill pool holds a request's blocks for a decode pool that already caches part of the
prompt: kvcm plans the exact hit and pull, a commit gives the source back. Faults: a transfer
never committed expires and its source goes back to its pool; every call retried answers the
same record and acts once; bad input is refused naming the field with nothing changed; a
server restarted (after a crash, and gracefully) mid-transfer keeps every acknowledged record
and the pools. Record-only transfers (an engine's own protocol keeps its blocks) change no pool,
not even when they expire.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcm.cli import main as cli_main
from kvcm.client import (
    AsyncSchedulerClient,
    RetryPolicy,
    SchedulerClient,
    ServiceAlreadyExistsError,
    ServiceError,
    ServiceFailedPreconditionError,
    ServiceInvalidArgumentError,
    ServiceNotFoundError,
    StepBuilder,
    Transfer,
    TransferState,
    UnavailableError,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.journal import FAULT_ENV
from kvcm.server.rpc import TransferView
from kvcm.server.settings import ServerSettings

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=512,
    hash_seed="pd",
    explicit_layout=KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)
PROMPT = list(range(1000, 1100))  # 6 full blocks and 4 tokens


def _start(data_dir: Path | None = None) -> EmbeddedServer:
    return start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="",
            data_dir=str(data_dir) if data_dir is not None else None,
        )
    )


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    running = _start()
    try:
        yield running
    finally:
        running.stop()


def _computed(client: SchedulerClient, pool_id: str, key: int, prompt: list[int]) -> None:
    """Request ``key`` computed and cached in ``pool_id`` (holding its blocks)."""
    hasher = client.block_hasher(pool_id)
    step = StepBuilder()
    step.add_request(key, prompt, hasher.hash_token_ids(prompt))
    step.allocate(key, len(prompt), 0, lookup=True)
    step.cache_blocks(key, len(prompt))
    client.step(pool_id, step)


def _pools(client: SchedulerClient, *, decode_hit: int = 48) -> None:
    """prefill holds PROMPT as request 1; decode caches its first ``decode_hit`` tokens."""
    client.create_pool("prefill", CONFIG)
    client.create_pool("decode", CONFIG)
    _computed(client, "prefill", 1, PROMPT)
    _computed(client, "decode", 9, [*PROMPT[:decode_hit], 7])
    client.free("decode", 9)


def _same(a: Transfer, b: Transfer) -> bool:
    """Equal but for the lease left (it runs)."""
    return dataclasses.replace(a, lease_remaining_s=0.0) == dataclasses.replace(
        b, lease_remaining_s=0.0
    )


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.02)
    return time.monotonic() - started


def test_hold_plan_commit_gives_the_source_back(server: EmbeddedServer) -> None:
    with SchedulerClient(server.grpc_address) as client:
        _pools(client)
        blocks = client.get_block_ids("prefill", 1)
        held = client.hold_source("prefill", "t1", 1, lease_s=30.0)
        assert held.state is TransferState.HELD
        assert (held.request_key, held.num_tokens, held.block_size) == (1, 100, 16)
        assert held.source_blocks == tuple(tuple(ids) for ids in blocks)
        assert 29.0 < held.lease_remaining_s <= 30.0
        planned = client.plan_transfer("prefill", "t1", "decode")
        assert planned.state is TransferState.PLANNED
        # decode caches 3 whole blocks of the prompt: it pulls the other 52 tokens (4 blocks).
        assert (planned.hit_tokens, planned.pull_tokens) == (48, 52)
        assert (planned.hit_blocks, planned.pull_blocks) == (3, 4)
        assert client.describe_pool("prefill").num_requests == 1  # still held
        done = client.commit_transfer("prefill", "t1")
        assert done.state is TransferState.COMPLETED
        assert done.blocks_pulled == 4
        assert done.ended_at >= done.started_at > 0
        assert done.lease_remaining_s == 0.0
        # The source went back: finished, its blocks in the prefix cache (a new request hits).
        assert client.describe_pool("prefill").num_requests == 0
        assert client.get_usage("prefill").usage == 0.0
        assert _same(client.describe_transfer("prefill", "t1"), done)
        assert [t.transfer_id for t in client.list_transfers()] == ["t1"]


def test_every_call_retried_answers_the_same_record_and_acts_once(
    server: EmbeddedServer,
) -> None:
    with SchedulerClient(server.grpc_address) as client:
        _pools(client)
        client.create_pool("other", CONFIG)
        _computed(client, "prefill", 2, PROMPT[:40])
        first = client.hold_source("prefill", "t1", 1, lease_s=30.0)
        assert _same(client.hold_source("prefill", "t1", 1, lease_s=30.0), first)
        planned = client.plan_transfer("prefill", "t1", "decode")
        assert _same(client.plan_transfer("prefill", "t1", "decode"), planned)
        # The destination's cache changes; a retried plan still answers the recorded plan.
        _computed(client, "decode", 10, PROMPT)
        assert _same(client.plan_transfer("prefill", "t1", "decode"), planned)
        done = client.commit_transfer("prefill", "t1")
        assert _same(client.commit_transfer("prefill", "t1"), done)
        assert _same(client.hold_source("prefill", "t1", 1, lease_s=30.0), done)  # late retry
        assert _same(client.release_transfer("prefill", "t1", "late"), done)
        assert _same(client.expire_transfer("prefill", "t1"), done)
        # Released: one give-back, however often retried.
        client.hold_source("prefill", "t2", 2, lease_s=30.0)
        released = client.release_transfer("prefill", "t2", "decode engine died")
        assert (released.state, released.reason) == (TransferState.RELEASED, "decode engine died")
        assert _same(client.release_transfer("prefill", "t2", "again"), released)
        assert client.describe_pool("prefill").num_requests == 0
        with pytest.raises(ServiceFailedPreconditionError, match="RELEASED"):
            client.plan_transfer("prefill", "t2", "decode")
        with pytest.raises(ServiceFailedPreconditionError, match="PlanTransfer first"):
            client.commit_transfer("prefill", "t2")
        assert [t.transfer_id for t in client.list_transfers("prefill")] == ["t2", "t1"]
        assert [t.transfer_id for t in client.list_transfers(states=[TransferState.RELEASED])] == [
            "t2"
        ]


def test_a_transfer_never_committed_expires_and_its_source_goes_back(
    server: EmbeddedServer,
) -> None:
    with SchedulerClient(server.grpc_address) as client:
        _pools(client)
        client.hold_source("prefill", "lost", 1, lease_s=0.4)
        client.plan_transfer("prefill", "lost", "decode")  # renews the lease
        planned_at = time.monotonic()

        def expired() -> bool:
            return client.describe_transfer("prefill", "lost").state is TransferState.EXPIRED

        _wait_until(expired, 5.0)
        took = time.monotonic() - planned_at
        assert 0.4 <= took < 3.0, took  # a lease, a check interval (1 s), polling, a busy CI
        print(f"a 0.4 s transfer lease gave its source back {took:.2f} s after the plan")
        record = client.describe_transfer("prefill", "lost")
        assert "lease of 0.4 s ran out" in record.reason
        assert client.describe_pool("prefill").num_requests == 0  # back to its pool
        assert client.get_usage("prefill").usage == 0.0
        with pytest.raises(ServiceFailedPreconditionError, match="EXPIRED"):
            client.commit_transfer("prefill", "lost")
        # A source freed by its own scheduler meanwhile: the transfer is released, not freed twice.
        _computed(client, "prefill", 3, PROMPT)
        client.hold_source("prefill", "freed", 3, lease_s=30.0)
        client.free("prefill", 3)
        _wait_until(
            lambda: client.describe_transfer("prefill", "freed").state is TransferState.RELEASED,
            5.0,
        )
        assert "freed outside" in client.describe_transfer("prefill", "freed").reason


def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
    server: EmbeddedServer,
) -> None:
    with SchedulerClient(server.grpc_address) as client:
        _pools(client)
        _computed(client, "prefill", 2, PROMPT[:20])
        client.hold_source("prefill", "t1", 1, lease_s=30.0)
        before = (_records(client), client.get_usage("prefill"))
        hold = functools.partial(client.hold_source, "prefill")
        plan = functools.partial(client.plan_transfer, "prefill")
        commit = functools.partial(client.commit_transfer, "prefill")
        release = functools.partial(client.release_transfer, "prefill")
        invalid, missing = ServiceInvalidArgumentError, ServiceNotFoundError
        taken, refused = ServiceAlreadyExistsError, ServiceFailedPreconditionError
        cases: list[tuple[type[ServiceError], str, Callable[[], object]]] = [
            (invalid, "lease_s", lambda: hold("x", 2, lease_s=0)),
            (invalid, "lease_s", lambda: hold("x", 2, lease_s=float("nan"))),
            (invalid, "lease_s", lambda: hold("x", 2, lease_s=1e9)),
            (invalid, "transfer_id", lambda: hold("", 2, lease_s=1)),
            (invalid, "transfer_id", lambda: hold("x" * 257, 2, lease_s=1)),
            (invalid, "request_id", lambda: hold("x", 2, lease_s=1, num_tokens=5)),
            (invalid, "request_id", lambda: hold("x", lease_s=1, record_only=True)),
            (missing, "pool", lambda: client.hold_source("nope", "x", 2, lease_s=1)),
            (missing, "request_key", lambda: hold("x", 77, lease_s=1)),
            (taken, "transfer_id", lambda: hold("t1", 2, lease_s=1)),
            (taken, "request_key", lambda: hold("t9", 1, lease_s=1)),
            (missing, "transfer_id", lambda: plan("zz", "decode")),
            (missing, "destination_pool_id", lambda: plan("t1", "nope")),
            (invalid, "destination_pool_id", lambda: plan("t1", "")),
            (invalid, "hit_tokens", lambda: plan("t1", "decode", hit_tokens=1, pull_tokens=2)),
            (refused, "PlanTransfer first", lambda: commit("t1")),
            (invalid, "blocks_pulled", lambda: commit("t1", blocks_pulled=99)),
            (invalid, "reason", lambda: release("t1", "r" * 300)),
            (missing, "transfer_id", lambda: release("zz")),
            (missing, "pool_id", lambda: client.list_transfers("nope")),
        ]
        for error, field, call in cases:
            with pytest.raises(error, match=field):
                call()
        assert (_records(client), client.get_usage("prefill")) == before
        client.create_pool("other-hash", dataclasses.replace(CONFIG, hash_seed="other"))
        with pytest.raises(ServiceFailedPreconditionError, match="hashes blocks differently"):
            client.plan_transfer("prefill", "t1", "other-hash")
        assert client.describe_transfer("prefill", "t1").state is TransferState.HELD


def test_record_only_transfers_change_no_pool_even_when_they_expire(
    server: EmbeddedServer,
) -> None:
    with SchedulerClient(server.grpc_address) as client:
        _pools(client)
        usage = client.get_usage("prefill")
        held = client.hold_source(
            "prefill",
            "vllm-req-1",
            lease_s=0.3,
            record_only=True,
            request_id="req-1",
            num_tokens=100,
            source_blocks=[[1, 2, 3, 4, 5, 6, 7]],
        )
        assert held.record_only
        assert held.source_blocks == ((1, 2, 3, 4, 5, 6, 7),)
        with pytest.raises(ServiceInvalidArgumentError, match="pull_tokens"):
            client.plan_transfer("prefill", "vllm-req-1", "decode", hit_tokens=48)
        planned = client.plan_transfer(
            "prefill", "vllm-req-1", "decode", hit_tokens=48, pull_tokens=52
        )
        assert (planned.hit_blocks, planned.pull_blocks) == (3, 4)
        _wait_until(
            lambda: (
                client.describe_transfer("prefill", "vllm-req-1").state is TransferState.EXPIRED
            ),
            5.0,
        )
        # kvcm only marked it: the engine's request keeps its blocks.
        assert client.get_usage("prefill") == usage
        assert client.describe_pool("prefill").num_requests == 1
        # The engine's protocol keeps authority: its late completion is recorded.
        done = client.commit_transfer("prefill", "vllm-req-1", blocks_pulled=4)
        assert (done.state, done.blocks_pulled) == (TransferState.COMPLETED, 4)
        assert client.get_usage("prefill") == usage


def _records(client: SchedulerClient) -> list[Transfer]:
    return [dataclasses.replace(t, lease_remaining_s=0.0) for t in client.list_transfers()]


def _pools_state(client: SchedulerClient) -> dict[str, object]:
    """Each pool's usage and the blocks of each request it holds."""
    state: dict[str, object] = {}
    for pool_id in ("prefill", "decode"):
        blocks = {}
        for key in range(1, 11):
            try:
                blocks[key] = client.get_block_ids(pool_id, key)
            except ServiceNotFoundError:
                continue
        state[pool_id] = (client.get_usage(pool_id), blocks)
    return state


def test_a_restart_mid_transfer_keeps_every_record(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = _start(data)
    try:
        with SchedulerClient(first.grpc_address) as client:
            _pools(client)
            for key in (2, 3, 4):
                _computed(client, "prefill", key, [key] * 40)
            client.hold_source("prefill", "held", 2, lease_s=60.0)
            client.hold_source("prefill", "planned", 3, lease_s=60.0)
            client.plan_transfer("prefill", "planned", "decode")
            client.hold_source("prefill", "done", 4, lease_s=60.0)
            client.plan_transfer("prefill", "done", "decode")
            client.commit_transfer("prefill", "done")
            client.hold_source("prefill", "t1", 1, lease_s=60.0)
            planned = client.plan_transfer("prefill", "t1", "decode")
            # The destination changes after the plan: a replay keeps the plan's numbers.
            _computed(client, "decode", 10, PROMPT)
            before = _records(client)
            pools = _pools_state(client)
        # A second server on the same directory: what a restart after kill -9 finds.
        crashed = _start(data)
        try:
            with SchedulerClient(crashed.grpc_address) as client:
                assert _records(client) == before
                assert _pools_state(client) == pools
                again = client.plan_transfer("prefill", "t1", "decode")
                assert (again.hit_tokens, again.pull_tokens) == (
                    planned.hit_tokens,
                    planned.pull_tokens,
                )
                assert client.describe_transfer("prefill", "held").lease_remaining_s > 59.0
                client.commit_transfer("prefill", "t1")
                after = _records(client)
                pools = _pools_state(client)
        finally:
            crashed.stop()  # graceful: a checkpoint holds the records, the journal is empty
        restarted = _start(data)
        try:
            with SchedulerClient(restarted.grpc_address) as client:
                assert _records(client) == after
                assert _pools_state(client) == pools
                assert client.describe_pool("prefill").num_requests == 2  # held, planned
                client.release_transfer("prefill", "held")
                client.commit_transfer("prefill", "planned")
                assert client.describe_pool("prefill").num_requests == 0
        finally:
            restarted.stop()
    finally:
        first.stop()


def _samples(text: str) -> dict[tuple[str, str], float]:
    """``(sample name, pool)`` -> value of the ``kvcm_transfer*`` samples of a scrape."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvcm_transfer"):
                found[(sample.name, sample.labels.get("pool", ""))] = sample.value
    return found


def test_transfers_over_http_and_in_metrics() -> None:
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0")
    )
    try:
        base = f"http://{running.http_address}"
        with SchedulerClient(running.grpc_address) as client, httpx.Client(base_url=base) as http:
            _pools(client)
            _computed(client, "prefill", 2, PROMPT[:40])
            _computed(client, "prefill", 3, PROMPT[:40])
            client.hold_source("prefill", "done", 1, lease_s=30.0)
            client.plan_transfer("prefill", "done", "decode")  # 3 blocks saved, 4 to pull
            client.commit_transfer("prefill", "done", blocks_pulled=4)
            client.hold_source("prefill", "failed", 2, lease_s=30.0)
            client.release_transfer("prefill", "failed", "pull failed")
            client.hold_source("prefill", "held", 3, lease_s=0.3)
            listed = http.get("/v1/transfers", params={"pool": "prefill"}).json()["transfers"]
            # In flight (or the latest ended) first, then the ended ones, latest first.
            assert [t["transfer_id"] for t in listed] == ["held", "failed", "done"]
            one = http.get("/v1/transfers/prefill/done").json()
            assert one["state"] == "TRANSFER_STATE_COMPLETED"
            assert (one["hit_tokens"], one["pull_tokens"], one["blocks_pulled"]) == (48, 52, 4)
            assert one["source_blocks"]["block_ids"] == list(
                client.describe_transfer("prefill", "done").source_blocks[0]
            )
            states = http.get("/v1/transfers", params={"state": ["released", "COMPLETED"]})
            assert sorted(t["transfer_id"] for t in states.json()["transfers"]) == [
                "done",
                "failed",
            ]
            bad = http.get("/v1/transfers", params={"state": "LOST"})
            assert bad.status_code == 400
            assert bad.json()["error"]["message"].startswith("state:")
            assert http.get("/v1/transfers", params={"pool": "nope"}).status_code == 404
            assert http.get("/v1/transfers/prefill/nope").status_code == 404
            _wait_until(
                lambda: client.describe_transfer("prefill", "held").state is TransferState.EXPIRED,
                5.0,
            )
            samples = _samples(http.get("/metrics").text)
        assert samples[("kvcm_transfers_started_total", "prefill")] == 3
        assert samples[("kvcm_transfers_completed_total", "prefill")] == 1
        assert samples[("kvcm_transfers_failed_total", "prefill")] == 1
        assert samples[("kvcm_transfers_expired_total", "prefill")] == 1
        assert samples[("kvcm_transfer_blocks_pulled_total", "prefill")] == 4
        assert samples[("kvcm_transfer_blocks_saved_total", "prefill")] == 3
        assert samples[("kvcm_transfers_in_flight", "prefill")] == 0
        assert samples[("kvcm_transfers_past_lease", "prefill")] == 0
        assert samples[("kvcm_transfer_oldest_source_age_seconds", "prefill")] == 0
    finally:
        running.stop()


def test_record_only_sources_past_their_lease_are_counted_until_their_engine_ends_them(
    server: EmbeddedServer,
) -> None:
    """The alert's gauge: kvcm marks a record-only transfer EXPIRED but the engine may still
    hold the blocks, so it stays past its lease until the engine releases it."""
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("prefill", CONFIG)
        client.hold_source(
            "prefill", "r1", lease_s=0.2, record_only=True, request_id="r1", num_tokens=40
        )
        _wait_until(
            lambda: client.describe_transfer("prefill", "r1").state is TransferState.EXPIRED, 5.0
        )

        def gauges() -> tuple[float, float, float]:
            view = TransferView(server.server.state)
            samples = server.call(_read_samples(view))
            return (
                samples["kvcm_transfers_in_flight"][0][1],
                samples["kvcm_transfers_past_lease"][0][1],
                samples["kvcm_transfer_oldest_source_age_seconds"][0][1],
            )

        in_flight, past, age = gauges()
        assert (in_flight, past) == (0, 1)
        assert age >= 0.2
        # The engine reports the source freed (its own lease): nothing is held any more.
        ended = client.expire_transfer("prefill", "r1", "finished_sending", source_freed=True)
        assert (ended.state, ended.source_freed) == (TransferState.EXPIRED, True)
        assert gauges() == (0, 0, 0.0)
        # A planned one freed by its source keeps its state: its destination reports the pull.
        client.hold_source(
            "prefill", "r2", lease_s=30.0, record_only=True, request_id="r2", num_tokens=40
        )
        client.plan_transfer("prefill", "r2", "prefill", hit_tokens=0, pull_tokens=40)
        freed = client.expire_transfer("prefill", "r2", source_freed=True)
        assert (freed.state, freed.source_freed) == (TransferState.PLANNED, True)
        assert gauges() == (1, 0, 0.0)
        done = client.commit_transfer("prefill", "r2", blocks_pulled=0)
        assert done.state is TransferState.COMPLETED
        # A hold nobody plans, freed by its engine: EXPIRED.
        client.hold_source(
            "prefill", "r3", lease_s=30.0, record_only=True, request_id="r3", num_tokens=40
        )
        never = client.expire_transfer("prefill", "r3", "never pulled", source_freed=True)
        assert (never.state, never.reason) == (TransferState.EXPIRED, "never pulled")
        client.create_pool("managed", CONFIG)
        _computed(client, "managed", 1, PROMPT)
        client.hold_source("managed", "m1", 1, lease_s=30.0)
        with pytest.raises(ServiceInvalidArgumentError, match="source_freed"):
            client.expire_transfer("managed", "m1", source_freed=True)
        assert client.describe_transfer("managed", "m1").state is TransferState.HELD


async def _read_samples(view: TransferView) -> dict[str, list[tuple[list[str], float]]]:
    return view.samples()


def test_kvcm_transfers_lists_the_records(
    server: EmbeddedServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVCM_CONFIG", "KVCM_TOKEN", "KVCM_TOKEN_FILE", "KVCM_TLS_CA", "KVCM_TLS_CERT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVCM_GRPC_ADDRESS", server.grpc_address)
    with SchedulerClient(server.grpc_address) as client:
        _pools(client)
        client.hold_source("prefill", "t1", 1, lease_s=30.0)
        client.plan_transfer("prefill", "t1", "decode")
    assert cli_main(["transfers", "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)["transfers"]
    assert (record["transfer_id"], record["state"]) == ("t1", "PLANNED")
    assert (record["hit_tokens"], record["pull_tokens"]) == (48, 52)
    assert cli_main(["transfers", "--pool", "prefill", "--state", "COMPLETED"]) == 0
    assert capsys.readouterr().out.split() == [
        "POOL", "TRANSFER", "STATE", "REQUEST", "BLOCKS", "DEST", "HIT", "PULL", "LEASE"
    ]  # fmt: skip
    assert cli_main(["transfers"]) == 0
    _header, line = capsys.readouterr().out.splitlines()
    assert line.split()[:8] == ["prefill", "t1", "PLANNED", "1", "7", "decode", "48", "52"]


def test_a_disk_that_refuses_the_record_changes_nothing_and_the_retry_acts_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transfer call whose journal record the disk refuses (ENOSPC) answers UNAVAILABLE
    having changed nothing; the same call once the disk takes writes again acts once."""
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, str(fault))
    running = _start(tmp_path / "data")
    quick = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02)
    try:
        with SchedulerClient(running.grpc_address, retry_policy=quick) as client:
            _pools(client)
            fault.write_text("any ENOSPC")
            with pytest.raises(UnavailableError, match="nothing was changed"):
                client.hold_source("prefill", "t1", 1, lease_s=30.0)
            fault.unlink()
            assert client.list_transfers() == []
            client.hold_source("prefill", "t1", 1, lease_s=30.0)
            client.plan_transfer("prefill", "t1", "decode")
            fault.write_text("any ENOSPC")
            with pytest.raises(UnavailableError, match="nothing was changed"):
                client.commit_transfer("prefill", "t1")
            fault.unlink()
            assert client.describe_transfer("prefill", "t1").state is TransferState.PLANNED
            assert client.describe_pool("prefill").num_requests == 1  # still held
            done = client.commit_transfer("prefill", "t1")
            assert done.state is TransferState.COMPLETED
            assert _same(client.commit_transfer("prefill", "t1"), done)
            assert client.describe_pool("prefill").num_requests == 0
            before = _records(client)
        again = _start(tmp_path / "data")  # what a crash now leaves: every answered call
        try:
            with SchedulerClient(again.grpc_address) as client:
                assert _records(client) == before
                assert client.describe_pool("prefill").num_requests == 0
        finally:
            again.stop()
    finally:
        running.stop()


def test_many_faulty_transfers_leak_no_block(server: EmbeddedServer) -> None:
    """Hundreds of managed transfers (1,000 with ``KVCM_LONG=1``), most of them faulty: never
    committed (the lease gives the source back), released, expired by hand, freed by their own
    scheduler meanwhile, every call sent twice. Afterwards the source pool holds no block and
    no request, and every record ended as its fault says."""
    num_transfers = 1000 if os.environ.get("KVCM_LONG") == "1" else 200
    big = dataclasses.replace(
        CONFIG,
        explicit_layout=dataclasses.replace(CONFIG.explicit_layout, num_blocks=1024),
    )
    rng = random.Random(7)
    kinds = ("commit", "release", "never", "expire", "freed")
    expected: dict[str, TransferState] = {}
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("src", big)
        client.create_pool("dst", big)
        hasher = client.block_hasher("src")
        for first in range(0, num_transfers, 50):
            keys = range(first, min(first + 50, num_transfers))
            step = StepBuilder()
            for key in keys:
                tokens = [key % 7] * 16 + list(range(key * 40, key * 40 + 24))  # shared block
                step.add_request(key, tokens, hasher.hash_token_ids(tokens))
                step.allocate(key, len(tokens), 0, lookup=True)
                step.cache_blocks(key, len(tokens))
            client.step("src", step)
            for key in keys:
                tid = f"t{key}"
                kind = rng.choice(kinds)
                twice = rng.random() < 0.3
                calls: list[Callable[[], Transfer]] = [
                    lambda t=tid, k=key: client.hold_source("src", t, k, lease_s=0.5)
                ]
                if kind != "freed":
                    calls.append(lambda t=tid: client.plan_transfer("src", t, "dst"))
                if kind == "commit":
                    calls.append(lambda t=tid: client.commit_transfer("src", t))
                elif kind == "release":
                    calls.append(lambda t=tid: client.release_transfer("src", t, "fault"))
                elif kind == "expire":
                    calls.append(lambda t=tid: client.expire_transfer("src", t, "by hand"))
                for call in calls:
                    answer = call()
                    if twice:
                        assert _same(call(), answer)
                if kind == "freed":
                    client.free("src", key)
                expected[tid] = {
                    "commit": TransferState.COMPLETED,
                    "release": TransferState.RELEASED,
                    "never": TransferState.EXPIRED,
                    "expire": TransferState.EXPIRED,
                    "freed": TransferState.RELEASED,
                }[kind]

        def all_ended() -> bool:
            return not client.list_transfers(
                "src", states=[TransferState.HELD, TransferState.PLANNED]
            )

        _wait_until(all_ended, 10.0)
        records = {t.transfer_id: t for t in client.list_transfers("src")}
        assert {tid: record.state for tid, record in records.items()} == expected
        assert client.describe_pool("src").num_requests == 0
        usage = client.get_usage("src")
        assert (usage.usage, usage.num_requests) == (0.0, 0)
        assert client.get_usage("dst").num_requests == 0
    faulty = sum(state is not TransferState.COMPLETED for state in expected.values())
    print(f"{num_transfers} transfers, {faulty} faulty: 0 blocks leaked")


def test_a_replaced_source_pool_is_not_touched(server: EmbeddedServer) -> None:
    """A source pool deleted and created again under its id (a new incarnation) while its
    transfer is held: the new pool's request under the same key is not the source, so ending
    the transfer frees nothing there, and the stale record is released by the monitor; a
    deleted pool's transfers are released too."""
    with SchedulerClient(server.grpc_address) as client:
        _pools(client)
        client.hold_source("prefill", "t1", 1, lease_s=30.0)
        client.plan_transfer("prefill", "t1", "decode")
        client.delete_pool("prefill")
        client.create_pool("prefill", CONFIG)
        _computed(client, "prefill", 1, PROMPT)  # same key, same request id, another pool
        blocks = client.get_block_ids("prefill", 1)
        _wait_until(
            lambda: client.describe_transfer("prefill", "t1").state is TransferState.RELEASED,
            5.0,
        )
        # Released as freed outside it, or (the monitor ran before the pool came back) as
        # its pool deleted; either way nothing of the new pool was touched.
        reason = client.describe_transfer("prefill", "t1").reason
        assert reason in ("the source request was freed outside it", "the source pool was deleted")
        assert client.get_block_ids("prefill", 1) == blocks  # untouched
        assert client.describe_pool("prefill").num_requests == 1
        client.hold_source("prefill", "t2", 1, lease_s=30.0)
        client.delete_pool("prefill")
        _wait_until(lambda: client.list_transfers(states=[TransferState.HELD]) == [], 5.0)
        (gone,) = [t for t in client.list_transfers() if t.transfer_id == "t2"]
        assert (gone.state, gone.reason) == (
            TransferState.RELEASED,
            "the source pool was deleted",
        )


def test_the_async_client_drives_transfers_too(server: EmbeddedServer) -> None:
    with SchedulerClient(server.grpc_address) as client:
        _pools(client)

    async def drive() -> list[Transfer]:
        async with AsyncSchedulerClient(server.grpc_address) as client:
            await client.hold_source("prefill", "a1", 1, lease_s=30.0)
            planned = await client.plan_transfer("prefill", "a1", "decode")
            assert (planned.hit_tokens, planned.pull_tokens) == (48, 52)
            done = await client.commit_transfer("prefill", "a1")
            assert _same(await client.describe_transfer("prefill", "a1"), done)
            assert (await client.get_usage("prefill")).num_requests == 0
            return await client.list_transfers("prefill", states=[TransferState.COMPLETED])

    (record,) = asyncio.run(drive())
    assert (record.transfer_id, record.blocks_pulled) == ("a1", 4)
