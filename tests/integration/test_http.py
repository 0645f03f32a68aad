"""The HTTP side of a real server: probes, /metrics scraped over HTTP, /v1/pools.

A real kvcm server (the ``kvcm_address`` / ``kvcm_http_address`` fixtures) is driven through the
SDK and read back over HTTP with httpx; the exposition is parsed with prometheus_client's own
parser. Nothing of the core is mocked.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from workload import MISSING_POOL, create_pool, run_shared_prefix_workload

from kvcm.client import SchedulerClient
from kvcm.core.pool import PoolRegistry
from kvcm.server.http import METRICS, build_app
from kvcm.server.telemetry import RpcStats

ROOT = Path(__file__).resolve().parents[2]
METRIC_NAME = re.compile(r"\bkvcm_[a-z0-9_]+\b")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def http(kvcm_http_address: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{kvcm_http_address}", timeout=5.0) as client:
        yield client


def _scrape(http: httpx.Client) -> tuple[set[str], Samples]:
    """Family names and every sample of one real scrape."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = set()
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        families.add(family.name)
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return families, samples


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


# --------------------------------------------------------------------------- probes


def test_healthz_answers_ok(http: httpx.Client) -> None:
    response = http.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_answers_ready_once_the_grpc_side_serves(
    http: httpx.Client, client: SchedulerClient
) -> None:
    client.list_pools()  # the gRPC side answers
    response = http.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ready"}


@contextmanager
def _serve(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port, in a thread."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        give_up_at = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive(), "uvicorn stopped"
            assert time.monotonic() < give_up_at, "uvicorn did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_readyz_is_503_until_ready_and_healthz_is_200_throughout() -> None:
    ready = False
    app = build_app(PoolRegistry(), RpcStats(), lambda: ready)
    with _serve(app) as address, httpx.Client(base_url=f"http://{address}") as http:
        response = http.get("/readyz")
        assert response.status_code == 503
        assert response.json() == {"status": "not ready"}
        assert http.get("/healthz").status_code == 200
        ready = True
        assert http.get("/readyz").status_code == 200
        ready = False  # shutting down
        assert http.get("/readyz").status_code == 503


# --------------------------------------------------------------------------- /metrics


def test_metrics_exposes_every_declared_family(http: httpx.Client) -> None:
    families, _ = _scrape(http)
    # The text parser names counters without their _total suffix.
    declared = {spec.name.removesuffix("_total") for spec in METRICS}
    assert {name for name in families if name.startswith("kvcm_")} == declared


def test_metrics_include_process_and_runtime_collectors(http: httpx.Client) -> None:
    families, samples = _scrape(http)
    assert {"process_resident_memory_bytes", "process_open_fds", "python_gc_collections"} <= (
        families
    )
    assert {name for name in families if not name.startswith("kvcm_")} <= {
        "process_cpu_seconds",
        "process_max_fds",
        "process_open_fds",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_virtual_memory_bytes",
        "python_gc_collections",
        "python_gc_objects_collected",
        "python_gc_objects_uncollectable",
        "python_info",
    }
    assert _value(samples, "process_resident_memory_bytes") > 0


def test_event_loop_lag_is_measured_on_the_running_server(http: httpx.Client) -> None:
    # The timer ticks every 100 ms from the server's start; wait for a few ticks.
    deadline = time.monotonic() + 5.0
    count = 0.0
    while time.monotonic() < deadline:
        _, samples = _scrape(http)
        count = _value(samples, "kvcm_event_loop_lag_seconds_count")
        if count >= 2:
            break
        time.sleep(0.1)
    assert count >= 2
    assert _value(samples, "kvcm_event_loop_lag_seconds_bucket", le="+Inf") == count


def test_metrics_speaks_openmetrics_when_asked(http: httpx.Client) -> None:
    response = http.get(
        "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    assert "# TYPE kvcm_prefix_cache_hits counter" in response.text


def test_metrics_follow_a_workload(http: httpx.Client, client: SchedulerClient) -> None:
    pool = "http-workload"
    create_pool(client, pool, num_blocks=48)
    _, before = _scrape(http)
    assert _value(before, "kvcm_blocks", pool=pool) == 48
    assert _value(before, "kvcm_prefix_cache_queries_total", pool=pool) == 0
    assert _value(before, "kvcm_pool_info", pool=pool, state="READY") == 1

    report = run_shared_prefix_workload(client, pool)
    _, after = _scrape(http)

    assert _value(after, "kvcm_prefix_cache_requests_total", pool=pool) == report.admitted + (
        report.not_fit
    )
    queries = _value(after, "kvcm_prefix_cache_queries_total", pool=pool)
    hits = _value(after, "kvcm_prefix_cache_hits_total", pool=pool)
    assert 0 < hits < queries
    assert _value(after, "kvcm_evicted_blocks_total", pool=pool) > 0
    assert _value(after, "kvcm_allocations_not_fit_total", pool=pool) == report.not_fit >= 1
    # Every request finished: nothing in use.
    assert _value(after, "kvcm_kv_cache_usage_ratio", pool=pool) == 0
    assert _value(after, "kvcm_running_requests", pool=pool) == 0
    assert _value(after, "kvcm_cached_blocks", pool=pool) > 0

    # RPC statistics: one histogram observation per finished call, failures by code.
    calls = _value(after, "kvcm_rpc_requests_total", method="AllocateSlots", code="OK")
    calls_before = _value(before, "kvcm_rpc_requests_total", method="AllocateSlots", code="OK")
    assert calls - calls_before == report.admitted + report.not_fit
    assert _value(after, "kvcm_rpc_requests_total", method="GetUsage", code="NOT_FOUND") >= 1
    for method in ("AddRequest", "GetComputedBlocks", "AllocateSlots", "Free"):
        count = _value(after, "kvcm_rpc_duration_seconds_count", method=method)
        by_code = sum(
            value
            for (name, labels), value in after.items()
            if name == "kvcm_rpc_requests_total" and ("method", method) in labels
        )
        assert count == by_code > 0, method
        assert _value(after, "kvcm_rpc_duration_seconds_bucket", method=method, le="+Inf") == count
        assert _value(after, "kvcm_rpc_duration_seconds_sum", method=method) > 0


def test_metrics_agree_with_the_pool_summary(http: httpx.Client, client: SchedulerClient) -> None:
    pool = "http-agree"
    create_pool(client, pool)
    run_shared_prefix_workload(client, pool)
    summary = http.get(f"/v1/pools/{pool}").json()
    _, samples = _scrape(http)
    cache = summary["prefix_cache"]
    expected = {
        "kvcm_prefix_cache_requests_total": cache["requests"],
        "kvcm_prefix_cache_queries_total": cache["queries"],
        "kvcm_prefix_cache_hits_total": cache["hits"],
        "kvcm_prefix_cache_preempted_requests_total": cache["preempted_requests"],
        "kvcm_prefix_cache_preempted_queries_total": cache["preempted_queries"],
        "kvcm_prefix_cache_preempted_hits_total": cache["preempted_hits"],
        "kvcm_prefix_cache_recent_hit_rate": cache["recent_hit_rate"],
        "kvcm_kv_cache_usage_ratio": summary["usage"],
        "kvcm_blocks": summary["num_blocks"],
        "kvcm_free_blocks": summary["num_free_blocks"],
        "kvcm_cached_blocks": summary["num_cached_blocks"],
        "kvcm_running_requests": summary["num_requests"],
        "kvcm_evicted_blocks_total": summary["evicted_blocks_total"],
        "kvcm_kv_events_emitted_total": summary["events_emitted_total"],
        "kvcm_allocations_not_fit_total": summary["allocations_not_fit_total"],
        "kvcm_registered_workers": summary["registered_workers"],
        "kvcm_pool_world_size": summary["world_size"],
    }
    for name, value in expected.items():
        assert _value(samples, name, pool=pool) == value, name
    assert cache["hit_rate"] == cache["hits"] / cache["queries"]


def test_metric_names_used_in_deploy_exist_in_a_real_scrape(
    http: httpx.Client, client: SchedulerClient
) -> None:
    pool = "http-deploy-names"
    create_pool(client, pool)
    run_shared_prefix_workload(client, pool)
    _, samples = _scrape(http)
    scraped = {name for name, _ in samples}
    # A family the server declares but has no sample for here (the journal's counters on a
    # server without a data directory) exists all the same: an alert on it is not misspelt.
    for family in text_string_to_metric_families(http.get("/metrics").text):
        scraped.add(f"{family.name}_total" if family.type == "counter" else family.name)
    alerts = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text(encoding="utf-8")
    dashboard = json.loads(
        (ROOT / "deploy" / "grafana" / "kvcm-dashboard.json").read_text(encoding="utf-8")
    )
    dashboard_text = json.dumps(
        [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        + [v.get("definition", "") for v in dashboard["templating"]["list"]]
    )
    for source, text in (("alerts.yml", alerts), ("kvcm-dashboard.json", dashboard_text)):
        used = set(METRIC_NAME.findall(text))
        assert used, source
        assert used <= scraped, f"{source}: {sorted(used - scraped)} are not in /metrics"


# --------------------------------------------------------------------------- /v1/pools


def test_v1_pools_lists_and_describes_pools(http: httpx.Client, client: SchedulerClient) -> None:
    pool = "http-describe"
    create_pool(client, pool, num_blocks=32)
    listed = http.get("/v1/pools")
    assert listed.status_code == 200
    names = [p["name"] for p in listed.json()["pools"]]
    assert pool in names

    summary = http.get(f"/v1/pools/{pool}").json()
    assert summary["name"] == pool
    assert summary["state"] == "READY"
    assert summary["num_blocks"] == 32
    assert summary["usage"] == 0
    assert summary["groups"] == [
        {"group_id": 0, "kind": summary["groups"][0]["kind"], "block_size": 16, "num_layers": 1}
    ]
    assert summary["prefix_cache"]["hit_rate"] == 0
    (listed_summary,) = [p for p in listed.json()["pools"] if p["name"] == pool]
    assert listed_summary == summary


def test_v1_pool_unknown_is_a_404_json_error(http: httpx.Client) -> None:
    response = http.get(f"/v1/pools/{MISSING_POOL}")
    assert response.status_code == 404
    body = response.json()
    assert body["error"]["code"] == "NOT_FOUND"
    assert MISSING_POOL in body["error"]["message"]


def test_openapi_schema_lists_the_routes(http: httpx.Client) -> None:
    paths = set(http.get("/openapi.json").json()["paths"])
    assert paths == {
        "/metrics",
        "/healthz",
        "/readyz",
        "/v1/pools",
        "/v1/pools/{pool}",
        "/v1/pools/{pool}/events",
        "/v1/lookup",
        "/v1/pd/route",
        "/v1/transfers",
        "/v1/transfers/{pool}/{transfer_id}",
    }
