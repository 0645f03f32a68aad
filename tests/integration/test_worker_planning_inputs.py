"""A pool's planning inputs through ``kvcm serve`` and WorkerClient ranks registering.

``kvcm serve --data-dir`` runs as a subprocess; pools are created with the planning inputs an
engine resolved (the hybrid manager's switch, the encoder budget, ``kv_cache_memory_bytes``),
the server restarts (the journal must keep every input), then every rank registers from its
own thread through the SDK's ``WorkerClient``. Each rank must receive the config kvcm's core
plans for the same inputs (tests/compat/test_worker_planning_compat.py checks that plan
against vLLM 0.33.0's), with the block counts the page arithmetic gives: Llama-4-Scout TP2 at
2 GiB holds 2 GiB / (12 layers x 32 KiB) = 5,461 blocks with the hybrid manager on (vLLM's
default) and 2 GiB / (48 x 32 KiB) = 1,365 with it off. Whisper without an encoder budget
is refused naming the input, and registers once the pool has one.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcm.client import (
    PoolConfig,
    SchedulerClient,
    ServiceInvalidArgumentError,
    WorkerClient,
    WorkerRegistration,
)
from kvcm.common.dtypes import DType
from kvcm.common.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
)
from kvcm.core.planning import plan_kv_cache

GIB = 1 << 30
SCOUT_ATTENTION = {"block_size": 16, "num_kv_heads": 4, "head_size": 128, "dtype": DType.BFLOAT16}
SCOUT_FULL = FullAttentionSpec(**SCOUT_ATTENTION)  # type: ignore[arg-type]
SCOUT_CHUNKED = ChunkedLocalAttentionSpec(attention_chunk_size=8192, **SCOUT_ATTENTION)  # type: ignore[arg-type]
SCOUT: dict[str, KVCacheSpec] = {
    f"language_model.model.layers.{i}.self_attn.attn": SCOUT_FULL if i % 4 == 3 else SCOUT_CHUNKED
    for i in range(48)
}
WHISPER_ATTENTION = {"block_size": 16, "num_kv_heads": 20, "head_size": 64, "dtype": DType.FLOAT16}
WHISPER: dict[str, KVCacheSpec] = {}
for _i in range(32):
    WHISPER[f"model.decoder.layers.{_i}.self_attn.attn"] = FullAttentionSpec(**WHISPER_ATTENTION)  # type: ignore[arg-type]
    WHISPER[f"model.decoder.layers.{_i}.encoder_attn.attn"] = CrossAttentionSpec(
        **WHISPER_ATTENTION  # type: ignore[arg-type]
    )

POOLS = {
    "scout": PoolConfig(max_model_len=8192, world_size=2),
    "scout-hybrid-off": PoolConfig(
        max_model_len=8192, world_size=2, disable_hybrid_kv_cache_manager=True
    ),
    # Ranks offer different memory; the engine fixed it at 1 GiB each.
    "scout-fixed-memory": PoolConfig(
        max_model_len=1 << 20, world_size=2, kv_cache_memory_bytes=GIB, auto_fit_max_model_len=True
    ),
    "whisper": PoolConfig(max_model_len=448, world_size=1, enable_caching=False),
    "whisper-budget": PoolConfig(
        max_model_len=448, world_size=1, enable_caching=False, max_num_batched_tokens=8192
    ),
}


class Server:
    """``kvcm serve --data-dir`` in a subprocess, on a free loopback port."""

    def __init__(self, data_dir: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.address = f"127.0.0.1:{sock.getsockname()[1]}"
        self.data_dir = data_dir
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Spawn ``kvcm serve`` and wait until it answers."""
        process = subprocess.Popen(
            [sys.executable, "-m", "kvcm.server.cli", "serve", "--grpc-address", self.address,
             "--http-address", "", "--data-dir", str(self.data_dir), "--log-level", "ERROR"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        self.process = process
        deadline = time.monotonic() + 60
        with SchedulerClient(self.address, timeout=2.0) as client:
            while True:
                try:
                    client.list_pools()
                    return
                except Exception:
                    if process.poll() is not None:
                        assert process.stderr is not None
                        raise AssertionError(process.stderr.read().decode()) from None
                    assert time.monotonic() < deadline, "kvcm serve did not come up"
                    time.sleep(0.05)

    def stop(self) -> None:
        """Terminate (SIGTERM: a graceful shutdown) and wait."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=15)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``kvcm serve`` holding the pools above, restarted once after they were created."""
    running = Server(tmp_path_factory.mktemp("planning-inputs") / "data")
    running.start()
    try:
        with SchedulerClient(running.address) as client:
            for name, config in POOLS.items():
                client.create_pool(name, config)
        running.stop()
        running.start()
        yield running
    finally:
        running.stop()


def _register(
    address: str, pool: str, specs: dict[str, KVCacheSpec], memory: list[int]
) -> list[WorkerRegistration | BaseException]:
    """Every rank registers from its own thread; what each was answered, in rank order."""
    answers: dict[int, WorkerRegistration | BaseException] = {}

    def rank(index: int) -> None:
        try:
            with WorkerClient(address, timeout=60.0) as worker:
                answers[index] = worker.register(pool, index, len(memory), specs, memory[index])
        except BaseException as exc:  # the answer under test
            answers[index] = exc

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(memory))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    return [answers[i] for i in range(len(memory))]


def test_the_restarted_server_keeps_every_input(server: Server) -> None:
    with SchedulerClient(server.address) as client:
        for name, config in POOLS.items():
            assert client.describe_pool(name).config == config, name


@pytest.mark.parametrize(
    ("pool", "memory", "layers_per_block"),
    [
        ("scout", [2 * GIB, 2 * GIB], 12),  # 5,461 blocks
        ("scout-hybrid-off", [2 * GIB, 2 * GIB], 48),  # 1,365 blocks
        ("scout-fixed-memory", [3 * GIB, GIB // 2], 12),  # 1 GiB each: 2,730 blocks
    ],
)
def test_scout_ranks_receive_the_plan_of_the_pools_inputs(
    server: Server, pool: str, memory: list[int], layers_per_block: int
) -> None:
    registrations = _register(server.address, pool, SCOUT, memory)
    expected = plan_kv_cache([SCOUT, SCOUT], memory, POOLS[pool].planning_options())
    planned_memory = POOLS[pool].kv_cache_memory_bytes or min(memory)
    blocks = planned_memory // (layers_per_block * SCOUT_FULL.page_size_bytes)
    for rank, registration in enumerate(registrations):
        assert isinstance(registration, WorkerRegistration), registration
        assert registration.kv_cache_config == expected.kv_cache_config(rank)
        assert registration.kv_cache_config.num_blocks == blocks
        assert registration.max_model_len == expected.max_model_len
    if POOLS[pool].auto_fit_max_model_len:
        # One request takes ceil(L / 16) blocks in each of the 4 groups; 2,729 usable
        # blocks hold 4 x 682: L = 682 x 16 = 10,912 (of the 1M asked).
        assert expected.max_model_len == 10912


def test_whisper_needs_an_encoder_budget(server: Server) -> None:
    (refused,) = _register(server.address, "whisper", WHISPER, [2 * GIB])
    assert isinstance(refused, ServiceInvalidArgumentError), refused
    assert "model.decoder.layers.0.encoder_attn.attn" in str(refused)
    assert "max_num_encoder_input_tokens" in str(refused)
    with SchedulerClient(server.address) as client:
        assert client.describe_pool("whisper").registered_ranks == ()
    (registration,) = _register(server.address, "whisper-budget", WHISPER, [2 * GIB])
    assert isinstance(registration, WorkerRegistration), registration
    expected = plan_kv_cache([WHISPER], [2 * GIB], POOLS["whisper-budget"].planning_options())
    assert registration.kv_cache_config == expected.kv_cache_config(0)
    assert expected.capacity.max_concurrency > 1  # a request holds 8,192 encoder tokens too
