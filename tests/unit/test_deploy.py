"""deploy/ and the Dockerfile agree with the code: ports, probe paths, metric names, syntax.

Every file under deploy/ is parsed. Prometheus files also go through promtool (``check rules``,
``test rules``, ``check config``) where it is installed (``scripts/install-prometheus.sh``).
There is no Docker engine or Kubernetes cluster here: the Dockerfile and the manifests are
checked by reading them, not by building or applying them. That every metric they use appears in
a real scrape is checked in tests/integration/test_http.py, against a running server.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcm.core.pool import PoolRegistry
from kvcm.server.cli import _build_parser
from kvcm.server.http import METRICS, build_app
from kvcm.server.settings import (
    DEFAULT_GRPC_ADDRESS,
    DEFAULT_HTTP_ADDRESS,
    ServerSettings,
    load_settings,
    split_address,
)
from kvcm.server.telemetry import RpcStats

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "kvcm-dashboard.json"

# The server's defaults (kvcm serve): loopback on these ports; containers bind 0.0.0.0.
GRPC_PORT = split_address(DEFAULT_GRPC_ADDRESS)[1]
HTTP_PORT = split_address(DEFAULT_HTTP_ADDRESS)[1]

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_NAME = re.compile(r"\bkvcm_[a-z0-9_]+\b")


# --------------------------------------------------------------------------- helpers


def _yaml_documents(path: Path) -> list[Any]:
    # Only the tests that read YAML skip without PyYAML; the Dockerfile and JSON checks run.
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (the dev extra pins it)")
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def _k8s_objects() -> dict[str, dict[str, Any]]:
    """Every manifest under deploy/k8s except the kustomization, by kind.

    The dashboard's ConfigMap (the one Grafana's sidecar loads) is keyed ``GrafanaDashboard``
    so that ``ConfigMap`` stays the server's configuration.
    """
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _yaml_documents(path):
            kind = doc["kind"]
            if "grafana_dashboard" in doc["metadata"].get("labels", {}):
                kind = "GrafanaDashboard"
            assert kind not in objects, f"two {kind} manifests"
            objects[kind] = doc
    return objects


def _exported_series_names() -> set[str]:
    """Names a scrape can contain: every declared family, histograms with their suffixes."""
    names = set()
    for spec in METRICS:
        names.add(spec.name)
        if spec.kind == "histogram":
            names.update(spec.name + suffix for suffix in HISTOGRAM_SUFFIXES)
    return names


def dashboard_exprs() -> list[str]:
    """Every PromQL expression in the Grafana dashboard: panel targets and variable queries."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    """Every rule in deploy/prometheus/alerts.yml."""
    (doc,) = _yaml_documents(PROMETHEUS / "alerts.yml")
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _dockerfile_instructions() -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical = ""
    for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        instruction, _, arguments = logical.partition(" ")
        yield instruction.upper(), arguments.strip()
        logical = ""


def _dockerfile() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for instruction, arguments in _dockerfile_instructions():
        out.setdefault(instruction, []).append(arguments)
    return out


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (bash scripts/install-prometheus.sh installs it)")
    return path


# --------------------------------------------------------------------------- every file parses


def test_every_deploy_file_parses() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.is_file())
    assert files
    for path in files:
        if path.suffix in {".yml", ".yaml"}:
            assert _yaml_documents(path), path
        elif path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        else:
            pytest.fail(f"{path.relative_to(ROOT)}: no test reads this kind of file")


# --------------------------------------------------------------------------- Prometheus


def test_alert_rules_pass_promtool_check() -> None:
    subprocess.run(
        [_promtool(), "check", "rules", "alerts.yml"],
        cwd=PROMETHEUS,
        check=True,
        capture_output=True,
    )


def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    result = subprocess.run(
        [_promtool(), "test", "rules", "alerts_test.yml"],
        cwd=PROMETHEUS,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_scrape_config_passes_promtool_check() -> None:
    result = subprocess.run(
        [_promtool(), "check", "config", "prometheus.yml"],
        cwd=PROMETHEUS,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_scrape_config_scrapes_the_metrics_route_on_the_http_port() -> None:
    (config,) = _yaml_documents(PROMETHEUS / "prometheus.yml")
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "kvcm"
    assert job["metrics_path"] == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert targets
    assert all(t.rsplit(":", 1)[1] == str(HTTP_PORT) for t in targets)


def test_every_alert_has_a_severity_summary_and_description() -> None:
    rules = alert_rules()
    assert {rule["alert"] for rule in rules} >= {
        "KvcmDown",
        "KvcmKVCacheUsageHigh",
        "KvcmPrefixCacheHitRateDropping",
        "KvcmAllocationsNotFitRising",
        "KvcmPoolWithoutStandby",
        "KvcmReplicationLagSecondsHigh",
        "KvcmReplicationLagRecordsHigh",
        "KvcmEtcdSessionDown",
        "KvcmPoolFailedOver",
    }
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["annotations"]["description"], rule["alert"]


def _markdown_anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (lower case, spaces to dashes)."""
    anchors = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return anchors


def test_every_alert_links_its_runbook_section() -> None:
    runbook = ROOT / "docs" / "runbook.md"
    anchors = _markdown_anchors(runbook)
    for rule in alert_rules():
        url = rule["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/runbook.md", rule["alert"]
        assert anchor == rule["alert"].lower(), rule["alert"]
        assert anchor in anchors, f"docs/runbook.md has no section {rule['alert']}"


def test_every_alert_is_unit_tested_firing_and_silent() -> None:
    """Each rule has a promtool case where it fires and one where it must stay silent."""
    (tests,) = _yaml_documents(PROMETHEUS / "alerts_test.yml")
    firing: set[str] = set()
    silent: set[str] = set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else silent).add(check["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert firing == names
    assert silent == names


def test_rpc_error_alert_ignores_cancelled_calls_and_down_alert_sees_absent_targets() -> None:
    rules = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    assert 'code!~"OK|CANCELLED"' in rules["KvcmRpcErrorsHigh"]
    assert "absent(up{" in rules["KvcmDown"]


def test_generated_manifests_are_up_to_date() -> None:
    pytest.importorskip("yaml", reason="PyYAML is not installed (the dev extra pins it)")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-deploy.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_rule_holds_the_rules_file() -> None:
    (alerts,) = _yaml_documents(PROMETHEUS / "alerts.yml")
    rule = _k8s_objects()["PrometheusRule"]
    assert rule["spec"] == alerts
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_dashboard_config_map_is_for_grafanas_sidecar() -> None:
    config_map = _k8s_objects()["GrafanaDashboard"]
    assert config_map["kind"] == "ConfigMap"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = config_map["data"].values()
    assert json.loads(text) == json.loads(DASHBOARD.read_text(encoding="utf-8"))


def test_the_down_alert_watches_the_scrape_job() -> None:
    (config,) = _yaml_documents(PROMETHEUS / "prometheus.yml")
    job = config["scrape_configs"][0]["job_name"]
    (down,) = [rule for rule in alert_rules() if rule["alert"] == "KvcmDown"]
    assert f'up{{job="{job}"}}' in down["expr"]


@pytest.mark.parametrize(
    ("source", "exprs"),
    [
        ("alerts.yml", lambda: [rule["expr"] for rule in alert_rules()]),
        ("alerts_test.yml", lambda: [(PROMETHEUS / "alerts_test.yml").read_text("utf-8")]),
        ("kvcm-dashboard.json", dashboard_exprs),
    ],
)
def test_metric_names_used_in_deploy_are_declared(source: str, exprs: Any) -> None:
    used = {name for expr in exprs() for name in METRIC_NAME.findall(expr)}
    assert used, source
    assert used <= _exported_series_names(), f"{source}: {sorted(used - _exported_series_names())}"


# --------------------------------------------------------------------------- Grafana


def test_dashboard_has_the_panels_operators_need() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs = " ".join(dashboard_exprs())
    for needed in (
        "kvcm_prefix_cache_hits_total",
        "kvcm_prefix_cache_queries_total",
        "kvcm_kv_cache_usage_ratio",
        "kvcm_free_blocks",
        "kvcm_lookup_port_duration_seconds_bucket",
        "kvcm_evicted_blocks_total",
        "histogram_quantile(0.5,",
        "histogram_quantile(0.99,",
        'code!~"OK|CANCELLED"',
        "process_resident_memory_bytes",
        "kvcm_event_loop_lag_seconds_bucket",
        # The cluster row: role per pool and replica, lag, failovers, redirects, etcd session.
        "kvcm_replication_role",
        "kvcm_replication_lag_seconds",
        "kvcm_replication_lag_records",
        "kvcm_replication_promotions_total",
        "kvcm_cluster_redirects_total",
        "kvcm_cluster_etcd_session_up",
    ):
        assert needed in exprs, needed
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "instance", "pool"}


# --------------------------------------------------------------------------- Kubernetes


def test_kustomization_lists_every_manifest() -> None:
    (kustomization,) = _yaml_documents(K8S / "kustomization.yaml")
    manifests = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == manifests


def test_manifests_have_the_kinds_a_deployment_needs() -> None:
    assert set(_k8s_objects()) == {
        "ConfigMap",
        "GrafanaDashboard",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "PrometheusRule",
        "Service",
        "ServiceMonitor",
        "StatefulSet",
    }


def _container() -> dict[str, Any]:
    statefulset = _k8s_objects()["StatefulSet"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return container


def test_container_ports_are_the_server_ports() -> None:
    ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    assert ports == {"grpc": GRPC_PORT, "http": HTTP_PORT}


def test_probes_use_the_server_routes() -> None:
    container = _container()
    routes = {
        route.path  # type: ignore[attr-defined]
        for route in build_app(PoolRegistry(), RpcStats(), lambda: True).routes
    }
    probes = {
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
        "startupProbe": "/healthz",
    }
    for probe, path in probes.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert get["port"] == "http", probe
        assert path in routes
    assert "/metrics" in routes


def test_statefulset_is_single_replica_non_root_with_resources_and_a_data_volume() -> None:
    objects = _k8s_objects()
    spec = objects["StatefulSet"]["spec"]
    # Pools live in one process: two replicas would split them. The StatefulSet's update
    # replaces the one pod (terminated before the new one starts) and keeps its volume.
    assert spec["replicas"] == 1
    assert spec["serviceName"] == objects["Service"]["metadata"]["name"]
    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}
    assert claim["metadata"]["name"] in mounts
    config = objects["ConfigMap"]["data"]["kvcm.toml"]
    assert f'data_dir = "{mounts[claim["metadata"]["name"]]}"' in config
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    container = _container()
    assert container["resources"]["requests"]["cpu"]
    assert container["resources"]["requests"]["memory"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()


def test_service_exposes_both_ports_to_the_pods() -> None:
    objects = _k8s_objects()
    service = objects["Service"]
    pod_labels = objects["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"grpc": (GRPC_PORT, "grpc"), "http": (HTTP_PORT, "http")}


def test_service_monitor_scrapes_the_service_http_port() -> None:
    objects = _k8s_objects()
    monitor = objects["ServiceMonitor"]
    service_labels = objects["Service"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service_labels.items()
    # kube-prometheus-stack's Prometheus selects ServiceMonitors by release=<helm release>.
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http"
    assert endpoint["path"] == "/metrics"


def test_config_map_is_mounted_where_the_container_reads_it(tmp_path: Path) -> None:
    objects = _k8s_objects()
    config_map = objects["ConfigMap"]
    (file_name,) = config_map["data"]
    config_file = tmp_path / file_name
    config_file.write_text(config_map["data"][file_name], encoding="utf-8")
    # The server's own loader reads it (unknown keys or bad values would raise ConfigError).
    settings = load_settings(config_file)
    assert settings.grpc_address == f"0.0.0.0:{GRPC_PORT}"
    assert settings.http_address == f"0.0.0.0:{HTTP_PORT}"
    pod = objects["StatefulSet"]["spec"]["template"]["spec"]
    # Kubernetes kills the pod after its grace period: the server's own must end first.
    drain = settings.shutdown_delay_s + settings.shutdown_grace_s
    assert drain < pod["terminationGracePeriodSeconds"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (mount,) = [m for m in _container()["volumeMounts"] if m["name"] == volume["name"]]
    args = _container()["args"]
    assert args[args.index("--config") + 1] == f"{mount['mountPath']}/{file_name}"


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile_runs_kvcm_serve_on_all_interfaces_and_the_default_ports() -> None:
    docker = _dockerfile()
    assert json.loads(docker["ENTRYPOINT"][-1]) == ["kvcm", "serve"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "kvcm" in pyproject["project"]["scripts"]
    cmd = json.loads(docker["CMD"][-1])
    # The real command line parses the image's arguments into the real settings.
    args = _build_parser().parse_args(["serve", *cmd])
    settings = load_settings(
        args.config, grpc_address=args.grpc_address, http_address=args.http_address
    )
    defaults = ServerSettings()
    assert settings.grpc_address == f"0.0.0.0:{split_address(defaults.grpc_address)[1]}"
    assert settings.http_address == f"0.0.0.0:{split_address(defaults.http_address)[1]}"
    exposed = {int(port) for line in docker["EXPOSE"] for port in line.split()}
    assert exposed == {GRPC_PORT, HTTP_PORT}


def test_dockerfile_is_slim_non_root_with_a_healthcheck_on_healthz() -> None:
    docker = _dockerfile()
    assert all(base.split()[0] == "python:3.11-slim" for base in docker["FROM"])
    (user,) = docker["USER"]
    assert user.split(":")[0] not in {"0", "root"}
    (healthcheck,) = docker["HEALTHCHECK"]
    assert f"http://127.0.0.1:{HTTP_PORT}/healthz" in healthcheck


def test_dockerfile_builds_the_compiled_lookup_index_with_gcc_in_the_build_stage_only() -> None:
    stages: list[list[tuple[str, str]]] = []
    for instruction, arguments in _dockerfile_instructions():
        if instruction == "FROM":
            stages.append([])
        stages[-1].append((instruction, arguments))
    build, final = stages[0], stages[-1]
    build_runs = " ".join(arguments for instruction, arguments in build if instruction == "RUN")
    assert "install -y --no-install-recommends gcc" in build_runs
    # The build fails where pip built no extension (the pure-Python fallback would be slower).
    assert 'python -c "import kvcm.core._lookup_index"' in build_runs
    assert not any("gcc" in arguments for instruction, arguments in final if instruction == "RUN")


def test_dockerfile_copies_only_what_the_context_keeps() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    for arguments in _dockerfile()["COPY"]:
        if arguments.startswith("--from="):
            continue
        *sources, _destination = shlex.split(arguments)
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source.rstrip("/") not in ignored, source


def test_network_policy_and_disruption_budget_select_the_pod() -> None:
    objects = _k8s_objects()
    pod_labels = objects["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    policy = objects["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
    assert ports == {"grpc", "http"}
    budget = objects["PodDisruptionBudget"]["spec"]
    assert budget["selector"]["matchLabels"].items() <= pod_labels.items()
    assert budget["minAvailable"] == 1


def test_secrets_are_optional_mounts() -> None:
    pod = _k8s_objects()["StatefulSet"]["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    assert {s["secretName"] for s in secrets.values()} == {"kvcm-tls", "kvcm-auth"}
    assert all(s["optional"] for s in secrets.values())


# --------------------------------------------------------------------------- Kubernetes: cluster

CLUSTER = K8S / "cluster"


def _cluster_objects() -> dict[tuple[str, str], dict[str, Any]]:
    """Every manifest under deploy/k8s/cluster except the kustomization, by (kind, name)."""
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(CLUSTER.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _yaml_documents(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"two {key} manifests"
            objects[key] = doc
    return objects


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in a container's command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def test_cluster_kustomization_lists_every_manifest() -> None:
    (kustomization,) = _yaml_documents(CLUSTER / "kustomization.yaml")
    manifests = sorted(p.name for p in CLUSTER.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == manifests


def test_cluster_replicas_advertise_their_stable_dns_name_and_reach_etcd(tmp_path: Path) -> None:
    """Three replicas, each advertising <pod>.<headless Service>.<namespace>:<grpc port>, with
    --etcd-endpoints naming each member of the etcd StatefulSet on its client port; the real
    command line parses the arguments and the real settings loader takes them."""
    objects = _cluster_objects()
    kvcm = objects[("StatefulSet", "kvcm")]
    etcd = objects[("StatefulSet", "kvcm-etcd")]
    assert kvcm["spec"]["replicas"] == 3
    assert etcd["spec"]["replicas"] == 3
    peers = objects[("Service", kvcm["spec"]["serviceName"])]
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True
    pod = kvcm["spec"]["template"]
    assert peers["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "http": HTTP_PORT}
    env_from_fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env_from_fields == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    (config_map,) = [o for (kind, _), o in objects.items() if kind == "ConfigMap"]
    (file_name,) = config_map["data"]
    (config_file := tmp_path / file_name).write_text(config_map["data"][file_name], "utf-8")
    etcd_pod = etcd["spec"]["template"]["spec"]
    (etcd_container,) = etcd_pod["containers"]
    etcd_ports = {p["name"]: p["containerPort"] for p in etcd_container["ports"]}
    etcd_service = objects[("Service", etcd["spec"]["serviceName"])]
    assert etcd_service["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in etcd_service["spec"]["ports"]} == etcd_ports
    for ordinal in range(kvcm["spec"]["replicas"]):
        pod_name = f"{kvcm['metadata']['name']}-{ordinal}"
        env = {"POD_NAME": pod_name, "POD_NAMESPACE": "ns"}
        args = [_expand(arg, env) for arg in container["args"]]
        parsed = _build_parser().parse_args(["serve", *args])
        settings = load_settings(
            config_file,
            advertise_address=parsed.advertise_address,
            etcd_endpoints=parsed.etcd_endpoints,
        )
        mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["config"]
        assert parsed.config == f"{mount}/{file_name}"
        assert settings.advertise_address == (
            f"{pod_name}.{peers['metadata']['name']}.ns.svc.cluster.local:{GRPC_PORT}"
        )
        assert settings.grpc_address == f"0.0.0.0:{GRPC_PORT}"
        members = [
            f"http://{etcd['metadata']['name']}-{n}.{etcd_service['metadata']['name']}"
            f".ns.svc.cluster.local:{etcd_ports['client']}"
            for n in range(etcd["spec"]["replicas"])
        ]
        assert settings.etcd_endpoints.split(",") == members
    assert load_settings(config_file).data_dir == "/var/lib/kvcm"
    # etcd's own members: names, peer URLs and the initial cluster agree with its StatefulSet.
    env = {"POD_NAME": "kvcm-etcd-1", "POD_NAMESPACE": "ns"}
    flags = dict(
        _expand(arg, env).removeprefix("--").split("=", 1) for arg in etcd_container["command"][1:]
    )
    assert flags["name"] == "kvcm-etcd-1"
    peer = f"http://kvcm-etcd-1.kvcm-etcd.ns.svc.cluster.local:{etcd_ports['peer']}"
    assert flags["initial-advertise-peer-urls"] == peer
    assert f"kvcm-etcd-1={peer}" in flags["initial-cluster"].split(",")
    assert len(flags["initial-cluster"].split(",")) == etcd["spec"]["replicas"]
    assert flags["listen-client-urls"].endswith(f":{etcd_ports['client']}")
    mounts = {m["name"]: m["mountPath"] for m in etcd_container["volumeMounts"]}
    (claim,) = etcd["spec"]["volumeClaimTemplates"]
    assert flags["data-dir"] == mounts[claim["metadata"]["name"]]


def test_cluster_replicas_keep_data_on_a_volume_spread_over_nodes_and_are_probed() -> None:
    objects = _cluster_objects()
    for name in ("kvcm", "kvcm-etcd"):
        spec = objects[("StatefulSet", name)]["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"].items() <= labels.items()
        (claim,) = spec["volumeClaimTemplates"]
        (container,) = spec["template"]["spec"]["containers"]
        assert claim["metadata"]["name"] in {m["name"] for m in container["volumeMounts"]}
        assert spec["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        budget = objects[("PodDisruptionBudget", name)]["spec"]
        assert budget["maxUnavailable"] == 1
        assert budget["selector"]["matchLabels"].items() <= labels.items()
    spec = objects[("StatefulSet", "kvcm")]["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    routes = {
        route.path  # type: ignore[attr-defined]
        for route in build_app(PoolRegistry(), RpcStats(), lambda: True).routes
    }
    for probe, path in {
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
        "startupProbe": "/healthz",
    }.items():
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}, probe
        assert path in routes


def test_cluster_services_network_policy_and_monitor_agree() -> None:
    objects = _cluster_objects()
    pod_labels = objects[("StatefulSet", "kvcm")]["spec"]["template"]["metadata"]["labels"]
    seed = objects[("Service", "kvcm")]
    assert seed["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in seed["spec"]["ports"]}
    assert ports == {"grpc": (GRPC_PORT, "grpc"), "http": (HTTP_PORT, "http")}
    # The ServiceMonitor selects the seed Service and not the headless one: one scrape per pod.
    selector = objects[("ServiceMonitor", "kvcm")]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= seed["metadata"]["labels"].items()
    assert not selector.items() <= objects[("Service", "kvcm-peers")]["metadata"]["labels"].items()
    # Replicas reach each other's gRPC port (fan-out, replication) and etcd's client port.
    policy = objects[("NetworkPolicy", "kvcm")]["spec"]
    grpc_from = [
        peer["podSelector"]["matchLabels"]
        for rule in policy["ingress"]
        if {p["port"] for p in rule["ports"]} == {"grpc"}
        for peer in rule["from"]
    ]
    assert any(labels.items() <= pod_labels.items() for labels in grpc_from)
    etcd_policy = objects[("NetworkPolicy", "kvcm-etcd")]["spec"]
    client_from = [
        peer["podSelector"]["matchLabels"]
        for rule in etcd_policy["ingress"]
        if "client" in {p["port"] for p in rule["ports"]}
        for peer in rule["from"]
    ]
    assert any(labels.items() <= pod_labels.items() for labels in client_from)
