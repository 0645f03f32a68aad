"""Where the operator's commands find the server: address, TLS and token.

Each comes from its flag, else its ``KVCM_*`` variable, else the server's own settings where
they make sense (the ``[server]`` table of ``--config`` / ``KVCM_CONFIG``: the gRPC address,
and its ``tls_cert`` as the root a self-signed server is trusted by), else the default::

    --grpc-address       KVCM_GRPC_ADDRESS      [server] grpc_address   127.0.0.1:50051
    --tls-ca             KVCM_TLS_CA            [server] tls_cert        (plaintext)
    --tls-client-cert    KVCM_TLS_CLIENT_CERT                            (no client certificate)
    --tls-client-key     KVCM_TLS_CLIENT_KEY
    --tls-server-name    KVCM_TLS_SERVER_NAME                            (the address's host)
    --token              KVCM_TOKEN                                      (no token)
    --token-file         KVCM_TOKEN_FILE

A server bound to a wildcard host (``0.0.0.0``, ``[::]``) is reached on loopback.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvcm.client import SchedulerClient, TlsConfig

__all__ = ["DEFAULT_ADDRESS", "Connection", "UsageError", "add_connection_flags", "connect"]

DEFAULT_ADDRESS: Final = "127.0.0.1:50051"
_WILDCARDS: Final = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}


class UsageError(Exception):
    """A flag, variable or file the command cannot use; the message says which and the fix."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Connection:
    """How to reach the server.

    Attributes:
        address: ``host:port`` of its gRPC side.
        tls: TLS settings (``None``: plaintext).
        token: The bearer token (``None``: none).
        timeout_s: Deadline of each call.
        server_name: The name the server's certificate is checked against (``""``: the host).
    """

    address: str
    tls: TlsConfig | None
    token: str | None
    timeout_s: float
    server_name: str = ""

    def client(self) -> SchedulerClient:
        """A client over this connection."""
        options = (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()
        return SchedulerClient(
            self.address,
            timeout=self.timeout_s,
            tls=self.tls,
            token=self.token,
            channel_options=options,
        )


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that talks to a server."""
    group = parser.add_argument_group("connection (flag > KVCM_* variable > --config > default)")
    group.add_argument(
        "--grpc-address",
        metavar="HOST:PORT",
        help=f"the server's gRPC address (env KVCM_GRPC_ADDRESS; default {DEFAULT_ADDRESS})",
    )
    group.add_argument(
        "--config",
        metavar="FILE",
        help="the server's TOML file: its [server] grpc_address and tls_cert (env KVCM_CONFIG)",
    )
    group.add_argument(
        "--tls-ca", metavar="FILE", help="PEM roots the server's certificate is checked against"
    )
    group.add_argument("--tls-client-cert", metavar="FILE", help="PEM client certificate (mTLS)")
    group.add_argument("--tls-client-key", metavar="FILE", help="PEM key of --tls-client-cert")
    group.add_argument(
        "--tls-server-name", metavar="NAME", help="the name the certificate must carry"
    )
    group.add_argument("--token", help="bearer token (env KVCM_TOKEN)")
    group.add_argument("--token-file", metavar="FILE", help="file holding the bearer token")
    group.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="deadline of each call (10)"
    )


def _pick(flag: str | None, environ: Mapping[str, str], name: str) -> str:
    if flag:
        return flag
    return environ.get(name, "")


def _server_table(config_file: str) -> dict[str, Any]:
    try:
        with open(config_file, "rb") as handle:
            document = tomllib.load(handle)
    except OSError as exc:
        raise UsageError(
            f"config file {config_file!r}: {exc.strerror} (fix --config or KVCM_CONFIG)"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {config_file!r}: not TOML: {exc}") from None
    table = document.get("server", {})
    return table if isinstance(table, dict) else {}


def _reachable(address: str, source: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"{source}: {address!r} is not HOST:PORT (e.g. {DEFAULT_ADDRESS})")
    if int(port) == 0:
        raise UsageError(
            f"{source}: {address!r} has port 0 (the server picked a free port): "
            "give the port it bound with --grpc-address"
        )
    return f"{_WILDCARDS.get(host, host)}:{port}"


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError as exc:
        raise UsageError(f"{what} {path!r}: {exc.strerror}") from None


def connect(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Connection:
    """The connection the flags, variables and config file describe.

    Raises:
        UsageError: A file cannot be read, an address is malformed or names port 0.
    """
    config_file = _pick(args.config, environ, "KVCM_CONFIG")
    server = _server_table(config_file) if config_file else {}
    if args.grpc_address:
        address, source = args.grpc_address, "--grpc-address"
    elif environ.get("KVCM_GRPC_ADDRESS"):
        address, source = environ["KVCM_GRPC_ADDRESS"], "KVCM_GRPC_ADDRESS"
    elif isinstance(server.get("grpc_address"), str):
        address, source = server["grpc_address"], f"{config_file} [server] grpc_address"
    else:
        address, source = DEFAULT_ADDRESS, "the default address"
    ca = _pick(args.tls_ca, environ, "KVCM_TLS_CA") or environ.get("KVCM_TLS_CERT", "")
    if not ca and isinstance(server.get("tls_cert"), str):
        ca = server["tls_cert"]
    cert = _pick(args.tls_client_cert, environ, "KVCM_TLS_CLIENT_CERT")
    key = _pick(args.tls_client_key, environ, "KVCM_TLS_CLIENT_KEY")
    tls = None
    if ca or cert or key:
        if bool(cert) != bool(key):
            raise UsageError("--tls-client-cert and --tls-client-key go together (mutual TLS)")
        tls = TlsConfig.from_files(ca=ca or None, cert=cert or None, key=key or None)
    token = _pick(args.token, environ, "KVCM_TOKEN")
    token_file = _pick(args.token_file, environ, "KVCM_TOKEN_FILE")
    if not token and token_file:
        token = _read(token_file, "token file")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")
    return Connection(
        address=_reachable(address, source),
        tls=tls,
        token=token or None,
        timeout_s=args.timeout,
        server_name=_pick(args.tls_server_name, environ, "KVCM_TLS_SERVER_NAME"),
    )
