"""The engine side's shipping lag in the metrics vLLM 0.33's ``/metrics`` serves.

vLLM's own ``EngineCore`` runs ``KvcmScheduler`` in mirror mode against a ``kvcm serve``
process. The server is SIGSTOPped while the engine keeps stepping; the metrics are read from
the registry vLLM's ``/metrics`` serves (``vllm.v1.metrics.prometheus.get_prometheus_registry``):
``prometheus_client.REGISTRY`` when the engine core runs in the API server's process, a
``MultiProcessCollector`` over ``PROMETHEUS_MULTIPROC_DIR`` when it runs in a process of its
own (here a child process, as vLLM's ``EngineCoreProc``). While the server is stalled the
backlog is above 0 and the age of the oldest unshipped step grows between two scrapes with no
step in between; once it resumes and the backlog is shipped, both are 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _engine_core import Setup, build_engine, plan_workload, run

from kvcm.client import SchedulerClient

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGSTOP")

_HERE = Path(__file__).resolve().parent
_SETUP = Setup(num_blocks=100, max_model_len=512)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    give_up_at = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up_at, "timed out"
        time.sleep(0.05)


def _answers(client: SchedulerClient) -> bool:
    try:
        client.list_pools()
    except Exception:
        return False
    return True


@pytest.fixture
def server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``kvcm serve`` in its own process (gRPC on loopback), so it can be SIGSTOPped."""
    address = f"127.0.0.1:{_free_port()}"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvcm.server.cli", "serve"),
            *("--grpc-address", address, "--http-address", ""),
            *("--log-level", "WARNING"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with SchedulerClient(address, timeout=1.0) as client:
            _wait_until(lambda: _answers(client), 30.0)
        yield address, process
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.wait(10)


def _scrape(pool_id: str) -> dict[str, float]:
    """The pool's kvcm_engine_* samples, as vLLM's /metrics would serve them now."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    text = generate_latest(get_prometheus_registry()).decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kvcm_engine_") and sample.labels.get("pool_id") == pool_id
    }


def _config(address: str, pool_id: str) -> dict[str, Any]:
    return {"kvcm": {"address": address, "pool_id": pool_id, "step_timeout_s": 1}}


def _check_stall(
    pool_id: str, stall: Callable[[], None], resume: Callable[[], None], wait_s: float
) -> dict[str, float]:
    """Stalled: backlog > 0 and the age grows between scrapes; resumed: both 0."""
    stall()
    first = _scrape(pool_id)
    assert first["kvcm_engine_shipping_backlog_steps"] > 0, first
    time.sleep(wait_s)
    second = _scrape(pool_id)
    print(f"stalled: {first} then {second}")
    assert (
        second["kvcm_engine_shipping_backlog_steps"] >= first["kvcm_engine_shipping_backlog_steps"]
    )
    age = "kvcm_engine_oldest_unshipped_step_age_seconds"
    assert second[age] >= first[age] + wait_s / 2, (first, second)
    resume()
    done = _scrape(pool_id)
    print(f"resumed: {done}")
    assert done["kvcm_engine_shipping_backlog_steps"] == 0
    assert done[age] == 0
    assert done["kvcm_engine_shipped_steps_total"] > first["kvcm_engine_shipped_steps_total"]
    return done


@pytest.mark.parametrize("shipper", ["thread", "process"])
def test_in_process_engine_lag_is_in_vllm_default_registry(
    shipper: str,
    server: tuple[str, subprocess.Popen[bytes]],
    vllm: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With either shipper (``process``: the figures come from the child's reports)."""
    from kvcm.integrations.vllm import KvcmScheduler

    del vllm
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    address, process = server
    pool_id = f"engine-metrics-inproc-{shipper}"
    config = _config(address, pool_id)
    config["kvcm"]["shipper"] = shipper
    engine = build_engine(_SETUP, KvcmScheduler, config)
    manager = engine.scheduler.kv_cache_manager
    turns = run(engine, plan_workload(51, 30, _SETUP), record=False, max_steps=2000)
    try:
        for _ in range(10):
            next(turns)
        assert manager.flush(10.0)
        before = _scrape(pool_id)
        assert before["kvcm_engine_shipping_backlog_steps"] == 0
        assert before["kvcm_engine_shipped_steps_total"] > 0

        def stall() -> None:
            os.kill(process.pid, signal.SIGSTOP)
            for _ in range(10):
                next(turns)

        def resume() -> None:
            os.kill(process.pid, signal.SIGCONT)
            assert manager.flush(20.0)

        done = _check_stall(pool_id, stall, resume, 0.6)
        assert done["kvcm_engine_server_reachable"] == 1
    finally:
        os.kill(process.pid, signal.SIGCONT)
        engine.shutdown()
    # A closed shipper is no longer exported.
    assert "kvcm_engine_shipping_backlog_steps" not in _scrape(pool_id)


_CHILD = """
import sys
sys.path[:0] = [{here!r}]
sys.path.append({site!r})
from _engine_core import Setup, build_engine, plan_workload, run
from kvcm.integrations.vllm import KvcmScheduler
setup = Setup(num_blocks=100, max_model_len=512)
engine = build_engine(setup, KvcmScheduler, {config!r})
turns = run(engine, plan_workload(51, 30, setup), record=False, max_steps=2000)
manager = engine.scheduler.kv_cache_manager
def say(word):
    print(word, flush=True)
    sys.stdin.readline()
for _ in range(10):
    next(turns)
assert manager.flush(10.0)
say("shipped")
for _ in range(10):
    next(turns)
say("stepped")
assert manager.flush(20.0)
import time; time.sleep(1.5)  # the publisher writes once a second
say("flushed")
engine.shutdown()
"""


def test_engine_core_process_lag_reaches_the_multiprocess_dir(
    server: tuple[str, subprocess.Popen[bytes]],
    vllm: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    site = str(Path(vllm.__file__).resolve().parent.parent)
    address, process = server
    pool_id = "engine-metrics-mp"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    script = _CHILD.format(here=str(_HERE), site=site, config=_config(address, pool_id))
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
    )
    assert child.stdin is not None
    assert child.stdout is not None

    def expect(word: str) -> None:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == word

    def go() -> None:
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.flush()

    try:
        expect("shipped")
        time.sleep(1.5)
        before = _scrape(pool_id)
        assert before["kvcm_engine_shipping_backlog_steps"] == 0, before
        assert before["kvcm_engine_shipped_steps_total"] > 0

        def stall() -> None:
            os.kill(process.pid, signal.SIGSTOP)
            go()
            expect("stepped")
            time.sleep(1.2)

        def resume() -> None:
            os.kill(process.pid, signal.SIGCONT)
            go()
            expect("flushed")

        _check_stall(pool_id, stall, resume, 2.2)
        go()
        assert child.wait(60) == 0
    finally:
        os.kill(process.pid, signal.SIGCONT)
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_every_engine_metric_is_documented() -> None:
    from kvcm.integrations.vllm import _metrics

    doc = (_HERE.parents[1] / "docs" / "metrics.md").read_text(encoding="utf-8")
    names = [name for name, _ in _metrics._GAUGES]
    names += [f"{name}_total" for name, _, _ in _metrics._COUNTERS]
    for name in names:
        assert f"| `{name}` | " in doc, name
