"""The cluster's settings (docs/cluster.md): the three spellings, and bad values refused at
load, one message naming the setting, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvcm.common.errors import ConfigError
from kvcm.server.settings import load_settings, parse_etcd_endpoints


def test_the_flag_the_variable_and_the_file_spell_the_same_settings(tmp_path: Path) -> None:
    config = tmp_path / "kvcm.toml"
    config.write_text(
        '[server]\netcd_endpoints = "http://10.0.0.1:2379,10.0.0.2:2379"\n'
        'etcd_prefix = "/prod"\netcd_lease_ttl_s = 7\n',
        encoding="utf-8",
    )
    environ = {"KVCM_ADVERTISE_ADDRESS": "10.0.0.9:50051", "KVCM_ETCD_TIMEOUT_S": "0.5"}
    settings = load_settings(config, environ=environ, cluster_fanout_timeout_s="3")
    assert settings.etcd_endpoints == "http://10.0.0.1:2379,10.0.0.2:2379"
    assert parse_etcd_endpoints(settings.etcd_endpoints) == (
        ("10.0.0.1", 2379),
        ("10.0.0.2", 2379),
    )
    assert (settings.etcd_prefix, settings.etcd_lease_ttl_s) == ("/prod", 7)
    assert (settings.advertise_address, settings.etcd_timeout_s) == ("10.0.0.9:50051", 0.5)
    assert settings.cluster_fanout_timeout_s == 3.0


def test_tls_settings_of_a_cluster_have_the_three_spellings(tmp_path: Path) -> None:
    config = tmp_path / "kvcm.toml"
    config.write_text(
        '[server]\netcd_endpoints = "https://10.0.0.1:2379,https://10.0.0.2:2379"\n'
        'etcd_ca = "/etc/kvcm/etcd-ca.pem"\n',
        encoding="utf-8",
    )
    environ = {"KVCM_ETCD_CERT": "/etc/kvcm/etcd.pem", "KVCM_ETCD_KEY": "/etc/kvcm/etcd.key"}
    settings = load_settings(
        config,
        environ=environ,
        tls_cert="/etc/kvcm/tls.crt",
        tls_key="/etc/kvcm/tls.key",
        tls_peer_ca="/etc/kvcm/ca.crt",
    )
    assert parse_etcd_endpoints(settings.etcd_endpoints) == (
        ("10.0.0.1", 2379),
        ("10.0.0.2", 2379),
    )
    assert (settings.etcd_ca, settings.etcd_cert, settings.etcd_key) == (
        "/etc/kvcm/etcd-ca.pem",
        "/etc/kvcm/etcd.pem",
        "/etc/kvcm/etcd.key",
    )
    assert settings.tls_peer_ca == "/etc/kvcm/ca.crt"
    # tls_client_ca stands in for tls_peer_ca (one CA signs replicas and clients).
    load_settings(
        environ={},
        etcd_endpoints="a:2379",
        tls_cert="c.pem",
        tls_key="k.pem",
        tls_client_ca="ca.pem",
    )


def test_without_etcd_endpoints_the_server_is_alone() -> None:
    settings = load_settings(environ={})
    assert settings.etcd_endpoints == ""


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"etcd_endpoints": "etcd:x"}, "etcd_endpoints: each endpoint must be"),
        ({"etcd_endpoints": "http://a:2379,,http://b:2379"}, "etcd_endpoints: each endpoint"),
        ({"etcd_endpoints": "https://a:2379,http://b:2379"}, "etcd_endpoints: mixes https://"),
        (
            {"etcd_endpoints": "http://a:2379", "etcd_ca": "ca.pem"},
            "etcd_endpoints: TLS to etcd is set .* not https://",
        ),
        ({"etcd_ca": "ca.pem"}, "need etcd_endpoints"),
        (
            {"etcd_endpoints": "https://a:2379", "etcd_cert": "c.pem"},
            "etcd_cert and etcd_key go together",
        ),
        ({"tls_peer_ca": "ca.pem"}, "tls_peer_ca needs tls_cert"),
        ({"etcd_endpoints": "a:99999"}, "etcd_endpoints: each endpoint must be"),
        ({"advertise_address": "nowhere"}, "advertise_address"),
        ({"etcd_prefix": "kvcm"}, "etcd_prefix must start with '/'"),
        ({"etcd_prefix": "/kvcm/"}, "etcd_prefix must start with '/' and not end"),
        ({"etcd_lease_ttl_s": "1"}, "etcd_lease_ttl_s must be >= 2"),
        ({"etcd_timeout_s": "0"}, "etcd_timeout_s must be > 0"),
        ({"cluster_fanout_timeout_s": "-1"}, "cluster_fanout_timeout_s must be > 0"),
        (
            {"etcd_endpoints": "a:2379", "tls_cert": "c.pem", "tls_key": "k.pem"},
            "tls_peer_ca: a replica with tls_cert in a cluster",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_setting(flags: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(environ={}, **flags)


def test_kvcm_serve_refuses_a_bad_endpoint_with_one_line_and_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvcm.server.cli", "serve", "--etcd-endpoints", "etcd:x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "etcd_endpoints" in result.stderr
