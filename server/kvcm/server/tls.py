"""TLS and mutual TLS for the server's gRPC and HTTP sides.

``--tls-cert`` and ``--tls-key`` (PEM files) turn TLS on for both sides: plaintext is then
refused. ``--tls-client-ca`` additionally requires every client to present a certificate
signed by that CA (mutual TLS). The gRPC side re-reads the three files whenever one of them
changes on disk, at the next handshake (gRPC's dynamic server credentials): rotating a
certificate needs no restart and drops no connection (established connections keep their
session). The HTTP side (metrics, probes) checks the files every couple of seconds and loads
changed ones into a new TLS context that new connections use likewise (a client CA removed
from ``tls_client_ca`` is no longer trusted); so does the lookup port (``lookup_address``),
which serves the same certificate and client-certificate policy.

A cluster's replicas (docs/cluster.md) are each other's clients: with ``tls_cert`` their
channels to each other (replication, fan-out) speak TLS, verify the peer's certificate
against ``tls_peer_ca`` (else ``tls_client_ca``) and its advertised address, and present the
replica's own certificate (:func:`peer_credentials`). ``etcd_ca``, ``etcd_cert`` and
``etcd_key`` do the same for the channels to etcd (:func:`etcd_credentials`). Both read their
files each time a channel is opened, so a rotated file is used by the next new channel.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from kvcm.common.errors import ConfigError
from kvcm.server.settings import etcd_uses_tls

if TYPE_CHECKING:
    from kvcm.server.settings import ServerSettings

__all__ = [
    "ChannelCredentials",
    "TlsFiles",
    "etcd_credentials",
    "grpc_server_credentials",
    "peer_credentials",
    "reload_ssl_context",
    "server_ssl_context",
    "tls_files",
    "uvicorn_ssl_options",
]

_LOG = logging.getLogger("kvcm.server.tls")

ChannelCredentials = Callable[[], grpc.ChannelCredentials]
"""Makes a client channel's credentials, reading their files (called per channel opened)."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The server's certificate chain, key and (for mutual TLS) client CA, as paths."""

    cert: Path
    key: Path
    client_ca: Path | None

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """The files' contents.

        Raises:
            ConfigError: A file cannot be read (the message names the setting).
        """
        values = []
        for setting, path in (("tls_cert", self.cert), ("tls_key", self.key)):
            try:
                values.append(path.read_bytes())
            except OSError as exc:
                raise ConfigError(f"{setting}: cannot read {str(path)!r}: {exc.strerror}") from exc
        ca = None
        if self.client_ca is not None:
            try:
                ca = self.client_ca.read_bytes()
            except OSError as exc:
                raise ConfigError(
                    f"tls_client_ca: cannot read {str(self.client_ca)!r}: {exc.strerror}"
                ) from exc
        return values[0], values[1], ca

    def stamp(self) -> tuple[float, ...]:
        """The files' modification times (a change means: read them again)."""
        paths = [self.cert, self.key, *([self.client_ca] if self.client_ca else [])]
        stamps = []
        for path in paths:
            try:
                stamps.append(os.stat(path).st_mtime_ns)
            except OSError:
                stamps.append(-1)
        return tuple(float(s) for s in stamps)


def tls_files(settings: ServerSettings) -> TlsFiles | None:
    """The TLS files of ``settings``, or ``None`` when TLS is off.

    Raises:
        ConfigError: Only one of tls_cert and tls_key is set, or a client CA without them.
    """
    cert, key, ca = settings.tls_cert, settings.tls_key, settings.tls_client_ca
    if not cert and not key:
        if ca:
            raise ConfigError("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS)")
        return None
    if not cert or not key:
        raise ConfigError("tls_cert and tls_key go together: set both or neither")
    files = TlsFiles(Path(cert), Path(key), Path(ca) if ca else None)
    files.read()  # fail at start, naming the file, rather than at the first handshake
    return files


def grpc_server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that re-read ``files`` when they change."""
    cert, key, ca = files.read()
    state: dict[str, Any] = {"stamp": files.stamp()}

    def configuration(cert: bytes, key: bytes, ca: bytes | None) -> Any:
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch() -> Any:
        stamp = files.stamp()
        if stamp == state["stamp"]:
            return None  # unchanged: gRPC keeps the current configuration
        try:
            new_cert, new_key, new_ca = files.read()
            fresh = configuration(new_cert, new_key, new_ca)
        except Exception as exc:  # a half-written file: keep serving with the old one
            _LOG.warning("TLS files changed but could not be loaded: %s", exc)
            return None
        state["stamp"] = stamp
        _LOG.info("TLS certificates reloaded", extra={"event": "tls_reloaded"})
        return fresh

    return grpc.dynamic_ssl_server_credentials(
        configuration(cert, key, ca),
        fetch,
        require_client_authentication=files.client_ca is not None,
    )


def uvicorn_ssl_options(files: TlsFiles) -> dict[str, Any]:
    """uvicorn's ``Config`` keyword arguments for ``files``."""
    options: dict[str, Any] = {"ssl_certfile": str(files.cert), "ssl_keyfile": str(files.key)}
    if files.client_ca is not None:
        options["ssl_ca_certs"] = str(files.client_ca)
        options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return options


def server_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """A server-side TLS context of ``files`` (the lookup port's): the server's certificate,
    and with ``tls_client_ca`` a client certificate required, as on the gRPC side.

    Raises:
        ConfigError: The files do not load (the message names the setting).
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(files.cert), str(files.key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert, tls_key: cannot load {str(files.cert)!r}: {exc}") from exc
    if files.client_ca is not None:
        try:
            context.load_verify_locations(str(files.client_ca))
        except (OSError, ssl.SSLError) as exc:
            where = str(files.client_ca)
            raise ConfigError(f"tls_client_ca: cannot load {where!r}: {exc}") from exc
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def reload_ssl_context(context: ssl.SSLContext, files: TlsFiles) -> bool:
    """Make the new handshakes of a server listening with ``context`` (the HTTP side's, the
    lookup port's) use ``files`` as they are now: a NEW context is built from them and swapped
    in at each handshake (``sni_callback``, called for every ClientHello, with or without a
    server name), so a CA removed from ``tls_client_ca`` is no longer trusted (loading the
    files into ``context`` itself would only add CAs). ``False`` (and a warning) when they do
    not load, keeping the last ones."""
    try:
        fresh = server_ssl_context(files)
    except ConfigError as exc:
        _LOG.warning("TLS files changed but could not be loaded (HTTP, lookup port): %s", exc)
        return False

    def use_fresh(sslobj: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: object) -> None:
        sslobj.context = fresh

    context.sni_callback = use_fresh
    _LOG.info("TLS certificates reloaded (HTTP, lookup port)", extra={"event": "tls_reloaded_http"})
    return True


def _read_setting(setting: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path!r}: {exc.strerror}") from exc


def peer_credentials(settings: ServerSettings) -> ChannelCredentials | None:
    """How this replica's channels to other replicas authenticate (``None``: plaintext, no
    ``tls_cert``): TLS verifying the peer against ``tls_peer_ca`` (else ``tls_client_ca``,
    else the system's roots) and the address dialed, presenting ``tls_cert`` (for peers that
    require client certificates: the certificate needs the clientAuth usage where it lists
    usages).

    Raises:
        ConfigError: A file cannot be read (checked now, naming the setting).
    """
    files = tls_files(settings)
    if files is None:
        return None
    setting = "tls_peer_ca" if settings.tls_peer_ca else "tls_client_ca"
    ca_path = settings.tls_peer_ca or settings.tls_client_ca

    def make() -> grpc.ChannelCredentials:
        root = _read_setting(setting, ca_path) if ca_path else None
        cert, key, _ = files.read()
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=cert
        )

    make()
    return make


def etcd_credentials(settings: ServerSettings) -> ChannelCredentials | None:
    """How channels to etcd authenticate (``None``: plaintext, ``http://`` endpoints): TLS
    verifying etcd against ``etcd_ca`` (else the system's roots) and the endpoint's host,
    presenting ``etcd_cert`` when set (etcd's ``--client-cert-auth``).

    Raises:
        ConfigError: A file cannot be read (checked now, naming the setting).
    """
    if not settings.etcd_endpoints or not etcd_uses_tls(settings.etcd_endpoints):
        return None

    def make() -> grpc.ChannelCredentials:
        root = _read_setting("etcd_ca", settings.etcd_ca) if settings.etcd_ca else None
        cert = key = None
        if settings.etcd_cert:
            cert = _read_setting("etcd_cert", settings.etcd_cert)
            key = _read_setting("etcd_key", settings.etcd_key)
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=cert
        )

    make()
    return make
