"""TLS and mutual TLS with real certificates generated here (a CA, a server, a client).

Plaintext is refused when TLS is on; a client that trusts the CA connects, over gRPC and
HTTP; with a client CA configured, a client without a certificate is refused; a certificate
rotated on disk is served to new connections without a restart.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _pki import Pki

from kvcm.client import SchedulerClient, TlsConfig, UnavailableError
from kvcm.common.errors import ConfigError
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path, "kvcm-test")


def _start(pki: Pki, *, client_ca: bool) -> tuple[EmbeddedServer, Path, Path]:
    cert, key = pki.issue("kvcm-server")
    cert_path = pki.write("server.pem", cert)
    key_path = pki.write("server.key", key)
    ca_path = pki.write("ca.pem", pki.ca_pem)
    server = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            tls_cert=str(cert_path),
            tls_key=str(key_path),
            tls_client_ca=str(ca_path) if client_ca else "",
        )
    )
    return server, cert_path, key_path


@pytest.fixture
def tls_server(pki: Pki) -> Iterator[EmbeddedServer]:
    server, _, _ = _start(pki, client_ca=False)
    try:
        yield server
    finally:
        server.stop()


def test_tls_is_required_and_works(tls_server: EmbeddedServer, pki: Pki) -> None:
    with (
        SchedulerClient(tls_server.grpc_address, timeout=2.0) as plain,
        pytest.raises(UnavailableError),
    ):
        plain.list_pools()
    tls = TlsConfig(root_certificates=pki.ca_pem)
    with SchedulerClient(tls_server.grpc_address, tls=tls) as client:
        assert client.list_pools() == []
    ca_file = pki.write("ca.pem", pki.ca_pem)
    url = f"https://{tls_server.http_address}/healthz"
    assert httpx.get(url, verify=ssl.create_default_context(cafile=ca_file)).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{tls_server.http_address}/healthz", timeout=2.0)


def test_mutual_tls_refuses_a_client_without_a_certificate(pki: Pki) -> None:
    server, _, _ = _start(pki, client_ca=True)
    try:
        anonymous = TlsConfig(root_certificates=pki.ca_pem)
        with (
            SchedulerClient(server.grpc_address, tls=anonymous, timeout=2.0) as client,
            pytest.raises(UnavailableError),
        ):
            client.list_pools()
        cert, key = pki.issue("scheduler-0")
        known = TlsConfig(root_certificates=pki.ca_pem, certificate_chain=cert, private_key=key)
        with SchedulerClient(server.grpc_address, tls=known) as client:
            assert client.list_pools() == []
        stranger_pki = Pki(pki.directory, "stranger")
        cert, key = stranger_pki.issue("intruder")
        stranger = TlsConfig(root_certificates=pki.ca_pem, certificate_chain=cert, private_key=key)
        with (
            SchedulerClient(server.grpc_address, tls=stranger, timeout=2.0) as client,
            pytest.raises(UnavailableError),
        ):
            client.list_pools()
    finally:
        server.stop()


def test_a_rotated_certificate_is_served_without_a_restart(pki: Pki, tmp_path: Path) -> None:
    server, cert_path, key_path = _start(pki, client_ca=False)
    try:
        rotated_pki = Pki(tmp_path, "rotated")
        cert, key = rotated_pki.issue("kvcm-server")
        key_path.write_bytes(key)
        cert_path.write_bytes(cert)
        new_roots = TlsConfig(root_certificates=rotated_pki.ca_pem)
        with SchedulerClient(server.grpc_address, tls=new_roots) as client:
            assert client.list_pools() == []
        # The HTTP side picks the new certificate up within its check interval.
        new_ca = rotated_pki.write("rotated-ca.pem", rotated_pki.ca_pem)
        context = ssl.create_default_context(cafile=new_ca)
        url = f"https://{server.http_address}/healthz"
        give_up_at = time.monotonic() + 10
        while True:
            try:
                assert httpx.get(url, verify=context, timeout=2.0).status_code == 200
                break
            except httpx.HTTPError:
                assert time.monotonic() < give_up_at, "HTTP kept the old certificate"
                time.sleep(0.2)
        old_roots = TlsConfig(root_certificates=pki.ca_pem)
        with (
            SchedulerClient(server.grpc_address, tls=old_roots, timeout=2.0) as client,
            pytest.raises(UnavailableError),
        ):
            client.list_pools()
    finally:
        server.stop()


def test_incomplete_tls_settings_are_refused(pki: Pki) -> None:
    from kvcm.server.app import KVCMServer

    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        KVCMServer(ServerSettings(tls_cert=str(pki.write("only.pem", pki.ca_pem))))
    with pytest.raises(ConfigError, match="tls_key: cannot read"):
        KVCMServer(ServerSettings(tls_cert=str(pki.write("c.pem", pki.ca_pem)), tls_key="/nope"))
