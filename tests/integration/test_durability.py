"""The data directory: pools come back exactly, after a crash (replay) and a graceful stop.

A second server opened on the directory of a running one sees exactly what a restart after
``kill -9`` would (every answered call is on disk); pools are compared by their complete state
fingerprint. The SIGKILL test under load is tests/integration/test_crash_recovery.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcm.client import SchedulerClient, StepBuilder, WorkerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError
from kvcm.common.specs import FullAttentionSpec, SlidingWindowSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.app import KVCMServer
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.journal import CHECKPOINT_FILE, JOURNAL_FILE
from kvcm.server.settings import ServerSettings

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
WINDOW = SlidingWindowSpec(
    block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16, sliding_window=32
)
EXPLICIT = PoolConfig(
    max_model_len=512,
    enable_kv_cache_events=True,
    explicit_layout=KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)


def _start(data_dir: Path) -> EmbeddedServer:
    return start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", data_dir=str(data_dir))
    )


def _fingerprints(server: EmbeddedServer) -> dict[str, bytes]:
    async def read() -> dict[str, bytes]:
        return {pool.name: pool.state_fingerprint() for pool in server.server.state.registry.list()}

    return server.call(read())


def _drive(client: SchedulerClient, pool_id: str, first_seq: int, steps: int) -> None:
    hasher = client.block_hasher(pool_id)
    for seq in range(first_seq, first_seq + steps):
        step = StepBuilder()
        step.step_seq = seq
        prompt = [seq % 3] * 32 + list(range(seq * 100, seq * 100 + 9))
        step.add_request(seq, prompt, hasher.hash_token_ids(prompt))
        step.allocate(seq, len(prompt), 0, lookup=True)
        step.cache_blocks(seq, len(prompt))
        if seq % 2:
            step.finish(seq)
        client.step(pool_id, step)
    client.take_prefix_cache_stats(pool_id)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[EmbeddedServer]:
    server = _start(tmp_path / "data")
    try:
        yield server
    finally:
        server.stop()


def test_a_crash_loses_nothing_answered(running: EmbeddedServer, tmp_path: Path) -> None:
    """Explicit and worker-planned pools, Steps, unary calls, a deleted pool: replayed exactly."""
    address = running.grpc_address
    with SchedulerClient(address) as client:
        client.create_pool("explicit", EXPLICIT)
        client.create_pool("gone", EXPLICIT)
        client.create_pool("planned", PoolConfig(max_model_len=512, world_size=2))
        specs = {"full": SPEC, "window": WINDOW}
        answers: list[object] = []

        def register(rank: int) -> None:
            with WorkerClient(address) as worker:
                answers.append(worker.register("planned", rank, 2, specs, 64 << 20))

        ranks = [threading.Thread(target=register, args=(rank,)) for rank in (0, 1)]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join(timeout=30)
        assert len(answers) == 2
        _drive(client, "explicit", 1, 12)
        _drive(client, "planned", 1, 12)
        client.delete_pool("gone")
    before = _fingerprints(running)
    assert set(before) == {"explicit", "planned"}
    # A second server on the same directory: what a restart after kill -9 finds.
    replayed = _start(tmp_path / "data")
    try:
        assert _fingerprints(replayed) == before
    finally:
        replayed.stop()


def test_a_graceful_stop_checkpoints_and_a_restart_continues(tmp_path: Path) -> None:
    server = _start(tmp_path / "data")
    with SchedulerClient(server.grpc_address) as client:
        client.create_pool("p", EXPLICIT)
        _drive(client, "p", 1, 8)
    before = _fingerprints(server)
    server.stop()
    assert (tmp_path / "data" / CHECKPOINT_FILE).stat().st_size > 0
    assert (tmp_path / "data" / JOURNAL_FILE).stat().st_size == 0
    again = _start(tmp_path / "data")
    try:
        assert _fingerprints(again) == before
        with SchedulerClient(again.grpc_address) as client:
            _drive(client, "p", 9, 4)  # step_seq continues
            assert client.describe_pool("p").num_requests > 0
    finally:
        again.stop()


def test_a_torn_record_is_dropped_and_a_damaged_checkpoint_refused(
    running: EmbeddedServer, tmp_path: Path
) -> None:
    with SchedulerClient(running.grpc_address) as client:
        client.create_pool("p", EXPLICIT)
        _drive(client, "p", 1, 3)
    before = _fingerprints(running)
    journal = tmp_path / "data" / JOURNAL_FILE
    with journal.open("ab") as out:  # half a record: a crash in the middle of a write
        out.write(b"\x40\x00\x00\x00\x01\x02")
    replayed = _start(tmp_path / "data")
    try:
        assert _fingerprints(replayed) == before
    finally:
        replayed.stop()
    checkpoint = tmp_path / "data" / CHECKPOINT_FILE
    data = bytearray(checkpoint.read_bytes())
    data[-1] ^= 0xFF
    checkpoint.write_bytes(bytes(data))
    server = KVCMServer(ServerSettings(grpc_address="127.0.0.1:0", data_dir=str(tmp_path / "data")))
    with pytest.raises(ConfigError, match="damaged"):
        running.call(server.start())


def test_checkpoints_while_serving_bound_the_journal(tmp_path: Path) -> None:
    server = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="",
            data_dir=str(tmp_path / "data"),
            checkpoint_every_records=5,
        )
    )
    try:
        with SchedulerClient(server.grpc_address) as client:
            client.create_pool("p", EXPLICIT)
            client.create_pool("q", EXPLICIT)
            for first in (1, 7, 13):
                _drive(client, "p", first, 6)
                _drive(client, "q", first, 6)
        journal = server.server.journal
        assert journal is not None
        _wait_for(lambda: journal.records_since_checkpoint < 5 + 2)
        assert (tmp_path / "data" / CHECKPOINT_FILE).stat().st_size > 0
        before = _fingerprints(server)
        replayed = _start(tmp_path / "data")  # the checkpoint plus the journal's tail
        try:
            assert _fingerprints(replayed) == before
        finally:
            replayed.stop()
    finally:
        server.stop()


def _wait_for(predicate: object) -> None:
    import time

    give_up_at = time.monotonic() + 10
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < give_up_at
        time.sleep(0.02)


def _metric(base: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


def test_the_journal_is_measured_and_a_refused_write_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvcm_journal_*: records, fsyncs, failures; a refused write changes nothing."""
    from kvcm.client import ServiceNotFoundError, UnavailableError
    from kvcm.server.journal import FAULT_ENV

    switch = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, str(switch))
    server = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", data_dir=str(tmp_path / "d")
        )
    )
    try:
        base = f"http://{server.http_address}"
        with SchedulerClient(server.grpc_address) as client:
            client.create_pool("p", EXPLICIT)
            _drive(client, "p", 1, 4)
            assert _metric(base, "kvcm_journal_records_total") == 1 + 4 + 1
            assert 1 <= _metric(base, "kvcm_journal_fsyncs_total") <= 6
            assert _metric(base, "kvcm_journal_failures_total") == 0
            assert _metric(base, "kvcm_journal_records_since_checkpoint") == 6
            with pytest.raises(ServiceNotFoundError):  # no pool: refused at once, unwritten
                _drive(client, "missing", 1, 1)
            assert _metric(base, "kvcm_journal_records_total") == 6
            before = _fingerprints(server)
            switch.write_text("write ENOSPC")
            with pytest.raises(UnavailableError, match="No space left on device"):
                _drive(client, "p", 5, 1)
            assert _fingerprints(server) == before
            assert _metric(base, "kvcm_journal_failures_total") >= 1
            assert _metric(base, "kvcm_journal_records_total") == 6
            switch.unlink()
            _drive(client, "p", 5, 1)
            assert _metric(base, "kvcm_journal_pending_changes") == 0
    finally:
        server.stop()
