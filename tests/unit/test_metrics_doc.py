"""docs/metrics.md documents exactly the metrics the collector declares."""

from __future__ import annotations

import re
from pathlib import Path

from kvcm.server.http import METRICS

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(kvcm_\w+)` \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$")


def _documented() -> dict[str, tuple[str, tuple[str, ...], str]]:
    rows: dict[str, tuple[str, tuple[str, ...], str]] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match is None:
            continue
        name, kind, labels, vllm, _meaning = (g.strip() for g in match.groups())
        assert name not in rows, f"{name} documented twice"
        kind = kind.split(" ")[0]  # "gauge (1)" for info series
        names = () if labels == "(none)" else tuple(label.strip() for label in labels.split(","))
        rows[name] = (kind, names, vllm)
    return rows


def test_every_declared_metric_is_documented_with_its_type_and_labels() -> None:
    documented = _documented()
    declared = {spec.name: (spec.kind, spec.labels) for spec in METRICS}
    assert set(documented) == set(declared)
    for name, (kind, labels) in declared.items():
        assert documented[name][:2] == (kind, labels), name


def test_the_vllm_prometheus_metrics_kvcm_mirrors_are_named() -> None:
    counterparts = {name: row[2] for name, row in _documented().items()}
    assert "`vllm:prefix_cache_queries`" in counterparts["kvcm_prefix_cache_queries_total"]
    assert "`vllm:prefix_cache_hits`" in counterparts["kvcm_prefix_cache_hits_total"]
    assert "`vllm:kv_cache_usage_perc`" in counterparts["kvcm_kv_cache_usage_ratio"]
    assert "`vllm:num_requests_running`" in counterparts["kvcm_running_requests"]


def test_names_follow_the_house_conventions() -> None:
    for spec in METRICS:
        assert spec.name.startswith("kvcm_"), spec.name
        assert ":" not in spec.name, spec.name
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        assert set(spec.labels) <= {
            "pool",
            "group",
            "method",
            "code",
            "state",
            "kind",
            "block_size",
            "num_layers",
            "version",
            "python_version",
        }, spec.name
        if spec.name.endswith(("_ratio", "_rate")):
            assert spec.kind == "gauge", spec.name


def test_the_runtime_collectors_families_are_documented() -> None:
    """Every family /metrics serves, kvcm's own or prometheus_client's, is named in the doc."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvcm.core.pool import PoolRegistry
    from kvcm.server.http import build_app
    from kvcm.server.telemetry import RpcStats

    app = build_app(PoolRegistry(), RpcStats(), lambda: True)
    text = generate_latest(app.state.prometheus_registry).decode()
    runtime = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in text_string_to_metric_families(text)
        if not family.name.startswith("kvcm_")
    }
    assert {"process_resident_memory_bytes", "python_gc_collections_total"} <= runtime
    doc = DOC.read_text(encoding="utf-8")
    missing = sorted(name for name in runtime if f"`{name}`" not in doc)
    assert not missing
