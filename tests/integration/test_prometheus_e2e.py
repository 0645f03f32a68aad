"""A real Prometheus server scrapes a real kvcm server: the hit rate PromQL computes is kvcm's.

Prometheus (Debian's ``prometheus`` package; ``scripts/install-prometheus.sh``) runs on a free
loopback port, scrapes the kvcm server every second and loads deploy/prometheus/alerts.yml.
The test drives a shared-prefix workload through the SDK, waits until Prometheus has scraped the
final counters, and checks that ``hits_total / queries_total`` evaluated by Prometheus equals
the hit rate the server reports in ``/v1/pools/{pool}``. It also evaluates every dashboard query
and every alert rule on that server, so none of them is broken PromQL or reads a missing series.
Skipped, with the reason, where the ``prometheus`` binary is missing.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from workload import create_pool, run_shared_prefix_workload

from kvcm.client import SchedulerClient, StepBuilder
from kvcm.core.lookup import LookupQuery
from kvcm.core.pd_route import PdRouteQuery, PdScope
from kvcm.server.embedded import EmbeddedServer

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvcm-dashboard.json"
SCRAPE_INTERVAL_S = 1

pytestmark = pytest.mark.slow


CLUSTER_ROW = "Cluster"  # its series exist only on replicas of a cluster (docs/cluster.md)


def dashboard_panels() -> list[tuple[str, dict[str, Any]]]:
    """Every panel with targets, and the title of the row it sits under."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    row = ""
    panels = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        elif panel.get("targets"):
            panels.append((row, panel))
    return panels


def dashboard_exprs(*, cluster: bool = False) -> list[str]:
    """The PromQL of the dashboard's panels: outside the cluster row, or only in it."""
    return [
        target["expr"]
        for row, panel in dashboard_panels()
        if (row == CLUSTER_ROW) == cluster
        for target in panel["targets"]
    ]


SUBSTITUTIONS = {"$__rate_interval": "1m", "$__range": "5m", "$pool": ".*", "$instance": ".*"}


def _substitute(template: str) -> str:
    for variable, value in SUBSTITUTIONS.items():
        template = template.replace(variable, value)
    return template


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for(what: str, check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` otherwise."""
    give_up_at = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < give_up_at:
        try:
            last = check()
        except httpx.HTTPError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}; last answer: {last!r}")


class PrometheusServer:
    """A Prometheus server process and an HTTP client for its query API."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=5.0)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Evaluate an instant query; the result vector (fails on a query error)."""
        response = self.http.get("/api/v1/query", params={"query": expr})
        body = response.json()
        assert body["status"] == "success", f"{expr!r}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def query_range(self, expr: str, seconds: int) -> list[dict[str, Any]]:
        """Evaluate a range query over the last ``seconds``, one step per scrape interval."""
        end = time.time()
        response = self.http.get(
            "/api/v1/query_range",
            params={"query": expr, "start": end - seconds, "end": end, "step": SCRAPE_INTERVAL_S},
        )
        body = response.json()
        assert body["status"] == "success", f"{expr!r}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def scalar(self, expr: str) -> float | None:
        """The value of a one-series instant query, or None when it has no series."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, f"{expr!r}: {result}"
        return float(result[0]["value"][1])


@contextmanager
def _prometheus_server(tmp_path: Path, targets: list[str]) -> Iterator[PrometheusServer]:
    """Prometheus scraping ``targets`` (kvcm HTTP addresses) every second, with alerts.yml."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "the prometheus server binary is not installed "
            "(bash scripts/install-prometheus.sh installs Debian's package)"
        )
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"""
global:
  scrape_interval: {SCRAPE_INTERVAL_S}s
  scrape_timeout: {SCRAPE_INTERVAL_S}s
  evaluation_interval: {SCRAPE_INTERVAL_S}s
rule_files:
  - {ALERTS}
scrape_configs:
  - job_name: kvcm
    metrics_path: /metrics
    static_configs:
      - targets: {json.dumps(targets)}
""",
        encoding="utf-8",
    )
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = PrometheusServer(f"http://127.0.0.1:{port}")
    try:

        def ready() -> bool:
            if process.poll() is not None:
                log.flush()
                pytest.fail(
                    "prometheus exited: " + (tmp_path / "prometheus.log").read_text("utf-8")
                )
            return server.http.get("/-/ready").status_code == 200

        _wait_for("Prometheus to be ready", ready)
        yield server
    finally:
        server.http.close()
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture
def prometheus(tmp_path: Path, kvcm_http_address: str) -> Iterator[PrometheusServer]:
    with _prometheus_server(tmp_path, [kvcm_http_address]) as server:
        yield server


def _target_up(prometheus: PrometheusServer) -> bool:
    targets = prometheus.http.get("/api/v1/targets").json()["data"]["activeTargets"]
    return any(t["labels"]["job"] == "kvcm" and t["health"] == "up" for t in targets)


def test_prometheus_hit_rate_equals_the_servers_figure(
    prometheus: PrometheusServer, kvcm_address: str, kvcm_http_address: str
) -> None:
    _wait_for("Prometheus to scrape kvcm successfully", lambda: _target_up(prometheus))
    pool = "e2e-hit-rate"
    with SchedulerClient(kvcm_address) as client:
        create_pool(client, pool)
        report = run_shared_prefix_workload(client, pool)
    assert report.admitted > 0

    with httpx.Client(base_url=f"http://{kvcm_http_address}", timeout=5.0) as http:
        summary = http.get(f"/v1/pools/{pool}").json()
    cache = summary["prefix_cache"]
    assert cache["queries"] > 0
    assert 0 < cache["hits"] < cache["queries"]

    # The workload is over, so the counters are final: wait until Prometheus has scraped them.
    selector = f'{{job="kvcm", pool="{pool}"}}'
    _wait_for(
        "Prometheus to scrape the final counters",
        lambda: (
            prometheus.scalar(f"kvcm_prefix_cache_queries_total{selector}") == cache["queries"]
            and prometheus.scalar(f"kvcm_prefix_cache_hits_total{selector}") == cache["hits"]
        ),
    )
    promql = prometheus.scalar(
        f"kvcm_prefix_cache_hits_total{selector} / kvcm_prefix_cache_queries_total{selector}"
    )
    assert promql is not None
    assert math.isclose(promql, cache["hit_rate"], rel_tol=1e-12)
    # Fewer requests than the recent-requests window, none preempted, no reset: the server's
    # recent hit rate covers the whole run and must agree too.
    assert cache["requests"] < 1000
    assert cache["preempted_requests"] == 0
    assert math.isclose(promql, cache["recent_hit_rate"], rel_tol=1e-12)
    gauge = prometheus.scalar(f"kvcm_prefix_cache_recent_hit_rate{selector}")
    assert gauge is not None
    assert math.isclose(gauge, cache["recent_hit_rate"], rel_tol=1e-12)


def test_dashboard_queries_and_alert_rules_evaluate_on_real_data(
    prometheus: PrometheusServer, kvcm_address: str, kvcm_server: EmbeddedServer
) -> None:
    _wait_for("Prometheus to scrape kvcm successfully", lambda: _target_up(prometheus))
    with (
        SchedulerClient(kvcm_address) as client,
        SchedulerClient(kvcm_address, lookup_address=kvcm_server.lookup_address) as port,
    ):
        create_pool(client, "e2e-dashboard")
        run_shared_prefix_workload(client, "e2e-dashboard")
        # The RPC row's Lookup panel reads the lookup port's latency and gRPC's.
        for start in range(5):
            query = LookupQuery(token_ids=tuple(range(start, start + 64)))
            client.lookup(query)
            port.lookup(query)
        # The P/D routing row reads RoutePd's own counters and latency: route a few prompts
        # (the one pool plays both roles).
        scope = PdScope(pool_ids=("e2e-dashboard",))
        for start in range(5):
            prompt = LookupQuery(token_ids=tuple(range(start, start + 64)))
            client.route_pd(PdRouteQuery(prompt=prompt, prefill=scope, decode=scope))
        # The P/D transfers row reads the transfer counters: hand a request over (the pool is
        # its own destination), and hold another one for a while.
        hasher = client.block_hasher("e2e-dashboard")
        step = StepBuilder()
        for key in (900_001, 900_002):
            tokens = list(range(key, key + 40))
            step.add_request(key, tokens, hasher.hash_token_ids(tokens))
            step.allocate(key, len(tokens), 0)
        client.step("e2e-dashboard", step)
        client.hold_source("e2e-dashboard", "e2e-done", 900_001, lease_s=600.0)
        client.plan_transfer("e2e-dashboard", "e2e-done", "e2e-dashboard")
        client.commit_transfer("e2e-dashboard", "e2e-done")
        client.hold_source("e2e-dashboard", "e2e-held", 900_002, lease_s=600.0)
    # A few scrapes after the workload, so rate() over the dashboard's interval has two points.
    _wait_for(
        "the RPC histogram to reach Prometheus",
        lambda: prometheus.query('kvcm_rpc_duration_seconds_count{method="AllocateSlots"}'),
    )
    time.sleep(3 * SCRAPE_INTERVAL_S)

    for template in dashboard_exprs():
        expr = _substitute(template)
        result = prometheus.query_range(expr, seconds=30)
        assert result, f"dashboard query returned no series: {expr}"
    # The cluster row's queries are valid PromQL here too, and empty: a lone server exports no
    # cluster series (test_cluster_dashboard_row_has_data_on_three_replicas covers them).
    for template in dashboard_exprs(cluster=True):
        expr = _substitute(template)
        assert prometheus.query_range(expr, seconds=30) == [], expr

    def rules_evaluated() -> list[dict[str, Any]]:
        groups = prometheus.http.get("/api/v1/rules").json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        # A rule not evaluated yet reads Go's zero time, year 0001.
        evaluated = all(not rule["lastEvaluation"].startswith("0001") for rule in rules)
        return rules if rules and evaluated else []

    rules = _wait_for("every alert rule to be evaluated", rules_evaluated)
    for rule in rules:
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
    # A healthy, lightly loaded server fires nothing (pending would do for the 'for' clauses).
    firing = prometheus.http.get("/api/v1/alerts").json()["data"]["alerts"]
    assert [a["labels"]["alertname"] for a in firing if a["state"] == "firing"] == []


@contextmanager
def _etcd(tmp_path: Path) -> Iterator[str]:
    """A one-member etcd on free loopback ports (Debian's etcd-server); its client endpoint."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (bash scripts/install-etcd.sh installs it)")
    client, peer = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    process = subprocess.Popen(
        [binary, "--name", "e2e", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", client, "--advertise-client-urls", client,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"e2e={peer}", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield client
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextmanager
def _replicas(tmp_path: Path, endpoint: str, count: int) -> Iterator[list[tuple[str, str]]]:
    """``count`` ``kvcm serve --data-dir --etcd-endpoints`` replicas: (gRPC, HTTP) addresses."""
    addresses = [(f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}") for _ in range(count)]
    processes = []
    for index, (grpc_address, http_address) in enumerate(addresses):
        command = [sys.executable, "-m", "kvcm.server.cli", "serve",
                   "--grpc-address", grpc_address, "--http-address", http_address,
                   "--etcd-endpoints", endpoint, "--data-dir", str(tmp_path / f"replica-{index}"),
                   "--log-level", "WARNING"]  # fmt: skip
        processes.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    try:

        def all_see_each_other() -> bool:
            for process, (_, http_address) in zip(processes, addresses, strict=True):
                assert process.poll() is None, "a kvcm replica exited at start"
                text = httpx.get(f"http://{http_address}/metrics", timeout=2).text
                if f"kvcm_cluster_replicas {float(count)}" not in text:
                    return False
            return True

        _wait_for("the replicas to register in etcd and see each other", all_see_each_other, 60)
        yield addresses
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def test_cluster_dashboard_row_has_data_on_three_replicas(tmp_path: Path) -> None:
    """Every panel of the dashboard's cluster row shows real series scraped from three
    replicas sharing pools through a real etcd, with standbys (--data-dir); every target is
    valid PromQL; the alert rules evaluate there and none fires."""
    with (
        _etcd(tmp_path) as endpoint,
        _replicas(tmp_path, endpoint, 3) as replicas,
        _prometheus_server(tmp_path, [http for _, http in replicas]) as prometheus,
    ):
        seeds = ",".join(grpc_address for grpc_address, _ in replicas)
        pools = [f"e2e-cluster-{index}" for index in range(3)]
        for pool in pools:
            # A fresh client per pool starts at the first seed: the pools placed on the other
            # replicas are created through a redirect (kvcm_cluster_redirects_total).
            with SchedulerClient(seeds) as client:
                create_pool(client, pool)
                run_shared_prefix_workload(client, pool, num_requests=12)
        _wait_for("Prometheus to scrape the three replicas", lambda: len(
            prometheus.query('up{job="kvcm"} == 1')) == 3)  # fmt: skip

        def roles() -> set[tuple[str, str]]:
            result = prometheus.query("kvcm_replication_role == 1")
            return {(r["metric"]["pool"], r["metric"]["state"]) for r in result}

        expected = {(pool, state) for pool in pools for state in ("primary", "standby")}
        _wait_for(
            "every pool's primary and standby role in Prometheus", lambda: roles() >= expected
        )
        _wait_for("a redirect counted", lambda: prometheus.query("kvcm_cluster_redirects_total"))
        time.sleep(3 * SCRAPE_INTERVAL_S)  # two points for rate() and increase()
        for _, panel in (item for item in dashboard_panels() if item[0] == CLUSTER_ROW):
            answers = []
            for target in panel["targets"]:
                expr = _substitute(target["expr"])
                answers.append(prometheus.query_range(expr, seconds=30))
            # A target may be empty (no fan-out has missed a peer): the panel as a whole is not.
            assert any(answers), f"cluster panel {panel['title']!r} has no series"
        session = prometheus.query("kvcm_cluster_etcd_session_up")
        assert sorted(float(r["value"][1]) for r in session) == [1.0, 1.0, 1.0]

        def rules_evaluated() -> list[dict[str, Any]]:
            groups = prometheus.http.get("/api/v1/rules").json()["data"]["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            fresh = all(not rule["lastEvaluation"].startswith("0001") for rule in rules)
            return rules if rules and fresh else []

        for rule in _wait_for("every alert rule to be evaluated", rules_evaluated):
            assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
        firing = prometheus.http.get("/api/v1/alerts").json()["data"]["alerts"]
        assert [a["labels"]["alertname"] for a in firing if a["state"] == "firing"] == []
