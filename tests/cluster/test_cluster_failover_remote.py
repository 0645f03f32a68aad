"""A vLLM engine in remote mode rides a ``kill -9`` of its pool's primary (review 31-7).

Real etcd and three ``kvcm serve --data-dir`` replicas (lease TTL 2 s); one vLLM 0.33
``EngineCore`` (tests/compat/_engine_core.py) whose ``KvcmScheduler`` runs in remote mode, with
the seed list as its address: every step's program is acknowledged by the server before vLLM
sees the step's result. Its pool's primary is killed while the engine schedules; the engine
is not restarted: its next steps wait (the shipper retries the same step_seq within
``step_timeout_s``) and are acknowledged by the promoted standby. Then the pool on its new
primary equals an in-process replay (``Pool.run_step``) of every program the server
acknowledged, and the engine's own core.
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aetcd
import pytest
from _cluster import Etcd, Replica, durable_replicas, running
from _load import assert_pool_matches

from _replication import replica_state  # isort: skip  (tests/integration, put on sys.path by _load)

from kvcm.client import SchedulerClient
from kvcm.core.pool import Pool
from kvcm.core.pool_types import PoolConfig
from kvcm.server.cluster import Placement

_TESTS = Path(__file__).resolve().parent.parent
LEASE_TTL_S = 2
PREFIX = "/kvcm-test-failover-remote"
POOL = "remote-engine"


def _import_vllm() -> None:
    """vLLM from the reference, as tests/compat does, or a skip naming why not."""
    spec = importlib.util.spec_from_file_location("_compat_conftest", _TESTS / "compat/conftest.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reason = module.import_vllm()
    if reason is not None:
        pytest.skip(f"the vLLM remote-mode scheduler needs vLLM: {reason}")


def _placements(etcd: Etcd) -> dict[str, Placement]:
    async def read() -> dict[str, Placement]:
        host, _, port = etcd.endpoint.removeprefix("http://").rpartition(":")
        async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
            listing = await client.get_prefix(f"{PREFIX}/placement/".encode())
            return {p.pool_id: p for p in (Placement.decode(kv.value) for kv in listing)}

    return asyncio.run(read())


def _wait(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def cluster(etcd: Etcd, tmp_path: Path) -> Iterator[list[Replica]]:
    with running(durable_replicas(etcd, PREFIX, tmp_path, lease_ttl_s=LEASE_TTL_S)) as started:
        yield started


def _replay(core: Any, programs: list[Any]) -> Pool:
    """A fresh in-process pool (the engine's layout) that ran ``programs`` in order."""
    config = core.config
    pool = Pool(
        POOL,
        PoolConfig(
            max_model_len=config.max_model_len,
            explicit_layout=config.kv_cache_config,
            scheduler_block_size=config.scheduler_block_size,
            hash_block_size=config.hash_block_size,
            max_in_flight_tokens=config.max_in_flight_tokens,
            enable_caching=config.enable_caching,
            enable_kv_cache_events=config.enable_kv_cache_events,
            log_stats=True,  # the pool the shipper creates counts prefix-cache stats
            watermark=config.watermark,
            prefix_cache_retention_interval=config.prefix_cache_retention_interval,
            decode_context_parallel_size=config.dcp_world_size,
        ),
    )
    for program in programs:
        pool.run_step(program)
        pool.publish_events(0.0)  # each Step's events as one batch, as the server does
    return pool


def test_remote_mode_engine_rides_a_kill_9_and_its_pool_equals_the_replay(
    etcd: Etcd, cluster: list[Replica]
) -> None:
    _import_vllm()
    from _engine_core import Setup, build_engine, plan_workload

    from kvcm.integrations.vllm import KvcmScheduler

    seeds = ",".join(replica.address for replica in cluster)
    setup = Setup(num_blocks=120, max_model_len=512)
    engine = build_engine(
        setup, KvcmScheduler, {"kvcm": {"address": seeds, "pool_id": POOL, "mode": "remote"}}
    )
    manager = engine.scheduler.kv_cache_manager
    shipper = manager.recorder.sink
    assert shipper.acknowledges_each_answer
    # Every program the server acknowledged (the shipper's Step call returned; coalesced
    # steps are one program), with when it was.
    acknowledged: list[tuple[Any, float]] = []
    client = shipper._client
    send = client.step

    def recorded(pool_id: str, program: Any, **kwargs: Any) -> Any:
        result = send(pool_id, program, **kwargs)
        acknowledged.append((program, time.monotonic()))
        return result

    client.step = recorded
    try:
        plans = plan_workload(37, 100_000, setup, mean_prompt=60)
        arrivals: dict[int, list[Any]] = {}
        for plan in plans:
            arrivals.setdefault(plan.arrival_step, []).append(plan)
        turn = 0

        def engine_turns(seconds: float) -> None:
            nonlocal turn
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                for plan in arrivals.get(turn, ()):
                    engine.add(plan)
                engine.step()
                turn += 1
                time.sleep(0.01)

        engine_turns(1.0)  # the engine's pool is created (placed) by its first step
        _wait(lambda: POOL in _placements(etcd), "the engine's pool placed")
        before = _placements(etcd)[POOL]
        assert before.standby is not None
        _wait(lambda: replica_state(before.standby, POOL).has_copy, "the standby's copy")
        engine_turns(1.0)
        shipped = len(acknowledged)
        assert shipped > 20

        victim = next(r for r in cluster if r.address == before.primary)
        killed = time.monotonic()
        victim.stop(signal.SIGKILL)
        engine_turns(LEASE_TTL_S + 3.0)  # the engine goes on; its steps wait for the standby
        after = _placements(etcd)[POOL]
        assert (after.primary, after.epoch) == (before.standby, before.epoch + 1)
        resumed = next(at for _, at in acknowledged[shipped:] if at > killed)
        print(f"remote engine: acknowledged again {resumed - killed:.2f} s after the kill")
        # The TTL plus one second is test_cluster_failover_load's bound; this one only keeps
        # the engine from waiting for anything but the failover (measured 1.7-4.1 s on a
        # 2-core VM at load average 10+).
        assert resumed - killed < LEASE_TTL_S + 4.0
        assert len(acknowledged) > shipped + 20
        engine_turns(0.5)
    finally:
        engine.shutdown()

    stats = shipper.stats
    print(f"remote engine: {turn} turns, {len(acknowledged)} programs acknowledged, {stats}")
    assert stats.mismatches == 0
    assert stats.resyncs == 0
    assert stats.steps_verified == stats.steps_submitted
    # Nothing acknowledged lost, nothing unacknowledged applied: the pool on the new primary is
    # exactly the replay of the acknowledged programs (blocks, requests, their block ids,
    # prefix-cache totals, every event in order), and the engine's own core.
    expected = _replay(manager.core, [program for program, _ in acknowledged])
    assert_pool_matches(after.primary, POOL, expected)
    with SchedulerClient(seeds, timeout=10.0) as client:
        info = client.describe_pool(POOL)
    assert info.num_free_blocks == manager.core.num_free_blocks
    assert expected.last_event_sequence > 0
