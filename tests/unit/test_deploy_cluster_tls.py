"""deploy/k8s/cluster/tls: the cluster overlay with TLS everywhere (docs/security.md).

There is no Kubernetes cluster nor kustomize here, so the overlay is checked by reading it:
each patch names an object of the base; the replicas' patched arguments and configuration go
through the real command line parser and settings loader (so ``tls_peer_ca``, the etcd TLS
settings and ``https://`` endpoints are accepted as kvcm reads them); every file a setting
names lies in a mounted Secret under the key the kustomization says it holds; etcd's patched
flags serve TLS with client certificates on the ports the replicas dial; the probes speak
HTTPS; the replicas' token comes from a Secret.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvcm.server.cli import _build_parser
from kvcm.server.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s" / "cluster"
OVERLAY = BASE / "tls"
FILE_SETTINGS = (
    "tls_cert",
    "tls_key",
    "tls_peer_ca",
    "auth_tokens",
    "etcd_ca",
    "etcd_cert",
    "etcd_key",
)


def _documents(path: Path) -> list[Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (the dev extra pins it)")
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def _objects(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (doc["kind"], doc["metadata"]["name"]): doc
        for path in sorted(directory.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in _documents(path)
    }


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def _by(items: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    return {item[key]: item for item in items}


def _merged(base: dict[str, Any], patch: dict[str, Any], field: str) -> list[dict[str, Any]]:
    """``field`` (a list of objects keyed by ``name``) of ``base`` with ``patch``'s merged in,
    as a strategic merge does (env, volumeMounts, volumes, ports)."""
    merged = _by(base.get(field, []), "name")
    for item in patch.get(field, []):
        merged[item["name"]] = {**merged.get(item["name"], {}), **item}
    return list(merged.values())


def test_the_overlay_patches_objects_of_the_base() -> None:
    (kustomization,) = _documents(OVERLAY / "kustomization.yaml")
    assert kustomization["resources"] == ["../"]
    patches = sorted(patch["path"] for patch in kustomization["patches"])
    assert patches == sorted(
        p.name for p in OVERLAY.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    base = _objects(BASE)
    for key in _objects(OVERLAY):
        assert key in base, f"the overlay patches {key}, which the base does not have"


def test_the_replicas_read_tls_settings_from_mounted_secrets_and_dial_etcd_over_tls(
    tmp_path: Path,
) -> None:
    base, overlay = _objects(BASE), _objects(OVERLAY)
    header = (OVERLAY / "kustomization.yaml").read_text(encoding="utf-8")
    pod = base[("StatefulSet", "kvcm")]["spec"]["template"]["spec"]
    patch = overlay[("StatefulSet", "kvcm")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (patched,) = patch["containers"]
    assert patched["name"] == container["name"]
    mounts = _merged(container, patched, "volumeMounts")
    volumes = _by(_merged(pod, patch, "volumes"), "name")
    secret_dirs = {
        mount["mountPath"]: volumes[mount["name"]]["secret"]["secretName"]
        for mount in mounts
        if "secret" in volumes.get(mount["name"], {})  # (data: the volume claim)
    }
    config = overlay[("ConfigMap", "kvcm-config")]["data"]
    (file_name,) = config
    (config_file := tmp_path / file_name).write_text(config[file_name], encoding="utf-8")
    etcd = base[("StatefulSet", "kvcm-etcd")]
    for ordinal in range(3):
        env = {"POD_NAME": f"kvcm-{ordinal}", "POD_NAMESPACE": "ns"}
        args = [_expand(arg, env) for arg in patched["args"]]
        parsed = _build_parser().parse_args(["serve", *args])
        settings = load_settings(  # the real checks: tls_peer_ca present, https:// endpoints
            config_file,
            environ={},
            advertise_address=parsed.advertise_address,
            etcd_endpoints=parsed.etcd_endpoints,
        )
        assert settings.etcd_endpoints.split(",") == [
            f"https://{etcd['metadata']['name']}-{n}.kvcm-etcd.ns.svc.cluster.local:2379"
            for n in range(etcd["spec"]["replicas"])
        ]
    assert not settings.tls_client_ca  # the kubelet's HTTPS probes present no certificate
    for name in FILE_SETTINGS:
        path = Path(getattr(settings, name))
        secret = secret_dirs.get(str(path.parent))
        assert secret is not None, f"{name} {path} is in no mounted Secret"
        assert f"- {secret}: " in header, f"the kustomization does not describe Secret {secret}"
        assert path.name in header.split(f"- {secret}: ", 1)[1].split("\n# - ", 1)[0], (
            f"{secret} is not said to hold {path.name}"
        )
    (token,) = [e for e in patched["env"] if e["name"] == "KVCM_REPLICA_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "kvcm-replica-token", "key": "token"}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        merged = {**container[probe]["httpGet"], **patched[probe]["httpGet"]}
        assert merged == {**container[probe]["httpGet"], "scheme": "HTTPS"}, probe


def test_etcd_serves_tls_with_client_certificates_and_a_plaintext_health_port() -> None:
    base, overlay = _objects(BASE), _objects(OVERLAY)
    pod = base[("StatefulSet", "kvcm-etcd")]["spec"]["template"]["spec"]
    patch = overlay[("StatefulSet", "kvcm-etcd")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (patched,) = patch["containers"]
    env = {"POD_NAME": "kvcm-etcd-1", "POD_NAMESPACE": "ns"}
    flags = dict(
        _expand(arg, env).removeprefix("--").split("=", 1) for arg in patched["command"][1:]
    )
    ports = {p["name"]: p["containerPort"] for p in _merged(container, patched, "ports")}
    assert flags["listen-client-urls"] == f"https://0.0.0.0:{ports['client']}"
    assert flags["advertise-client-urls"] == (
        f"https://kvcm-etcd-1.kvcm-etcd.ns.svc.cluster.local:{ports['client']}"
    )
    peer = f"https://kvcm-etcd-1.kvcm-etcd.ns.svc.cluster.local:{ports['peer']}"
    assert flags["initial-advertise-peer-urls"] == peer
    assert f"kvcm-etcd-1={peer}" in flags["initial-cluster"].split(",")
    assert all(
        url.split("=", 1)[1].startswith("https://") for url in flags["initial-cluster"].split(",")
    )
    assert flags["client-cert-auth"] == flags["peer-client-cert-auth"] == "true"
    (mount,) = [m for m in patched["volumeMounts"] if m["name"] == "tls"]
    (volume,) = [v for v in patch["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "kvcm-etcd-tls"
    for flag in ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file", "peer-key-file"):
        assert Path(flags[flag]).parent == Path(mount["mountPath"]), flag
    # The kubelet's probe reads /health on the plaintext metrics port.
    assert flags["listen-metrics-urls"] == f"http://0.0.0.0:{ports['metrics']}"
    assert patched["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    # The base's data directory and the rest of its flags are kept.
    base_flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["command"][1:])
    for name, value in base_flags.items():
        if "url" not in name and name != "initial-cluster":
            assert flags[name] == _expand(value, env), name


def test_prometheus_scrapes_over_https_with_a_scrape_token() -> None:
    overlay = _objects(OVERLAY)
    (endpoint,) = overlay[("ServiceMonitor", "kvcm")]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "kvcm-tls", "key": "ca.crt"}
    assert endpoint["authorization"]["credentials"] == {"name": "kvcm-scrape-token", "key": "token"}
    base = _objects(BASE)
    (base_endpoint,) = base[("ServiceMonitor", "kvcm")]["spec"]["endpoints"]
    assert {k: endpoint[k] for k in base_endpoint} == base_endpoint
