"""The ``kvcm`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from typing import Any, NoReturn

from kvcm.server.settings import CONFIG_ENV, SETTINGS, ServerSettings

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvcm serve: error: ...`` on stderr, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _version() -> str:
    try:
        return metadata.version("kvcm")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree without install
        return "unknown"


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvcm", description="kvcm: a standalone KV-cache manager for LLM serving clusters."
    )
    parser.add_argument("--version", action="version", version=f"kvcm {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the kvcm server (gRPC and HTTP)",
        description=(
            "Run the kvcm server. Each setting comes from its flag, else its KVCM_* environment "
            "variable, else the --config TOML file ([server] and [limits] tables), else its "
            "default (docs/server.md lists them)."
        ),
    )
    serve.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help=f"TOML file with [server] and [limits] tables (env {CONFIG_ENV})",
    )
    for spec in SETTINGS:
        serve.add_argument(
            spec.flag,
            dest=spec.name,
            default=None,
            metavar=spec.kind.__name__.upper(),
            help=f"{spec.help} (env {spec.env}; default {spec.default!r})",
        )
    _add_data_dir_commands(commands)
    _add_cluster_commands(commands)
    return parser


def _add_cluster_commands(commands: Any) -> None:
    """``kvcm cluster move|drain`` (docs/cluster.md, runbook)."""
    cluster = commands.add_parser(
        "cluster",
        help="move a pool to another replica, or drain a replica (etcd placement)",
        description=(
            "Change where pools live in a kvcm cluster, live: the target replica is made the "
            "pool's standby, seeded, and promoted by an etcd transaction raising the pool's "
            "epoch; the old primary steps down (docs/cluster.md)."
        ),
    )
    cluster.add_argument(
        "--etcd-endpoints",
        default=None,
        metavar="URLS",
        help="etcd's client endpoints, comma-separated (env KVCM_ETCD_ENDPOINTS)",
    )
    cluster.add_argument(
        "--etcd-prefix", default=None, help="the cluster's key prefix (env KVCM_ETCD_PREFIX)"
    )
    cluster.add_argument(
        "--timeout", type=float, default=60.0, help="seconds a move may take (default 60)"
    )
    for flag, env, what in (
        ("--etcd-ca", "KVCM_ETCD_CA", "PEM CA of etcd's certificates (https:// endpoints)"),
        ("--etcd-cert", "KVCM_ETCD_CERT", "PEM client certificate for etcd"),
        ("--etcd-key", "KVCM_ETCD_KEY", "PEM key of --etcd-cert"),
        ("--tls-ca", "KVCM_TLS_CA", "PEM CA of the replicas' certificates (TLS to replicas)"),
        ("--tls-client-cert", "KVCM_TLS_CLIENT_CERT", "PEM client certificate (mutual TLS)"),
        ("--tls-client-key", "KVCM_TLS_CLIENT_KEY", "PEM key of --tls-client-cert"),
    ):
        cluster.add_argument(flag, default=None, metavar="FILE", help=f"{what} (env {env})")
    actions = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")
    move = actions.add_parser("move", help="make ADDRESS the primary of POOL")
    move.add_argument("pool", metavar="POOL")
    move.add_argument("--to", required=True, metavar="ADDRESS", help="a live replica's address")
    drain = actions.add_parser(
        "drain", help="move every pool whose primary is ADDRESS to other replicas"
    )
    drain.add_argument("address", metavar="ADDRESS")


def _cluster(args: argparse.Namespace) -> int:
    import asyncio
    import os

    import grpc

    from kvcm.common.errors import ConfigError
    from kvcm.server.cluster import EtcdUnavailableError, MoveError, drain_replica, move_pool
    from kvcm.server.settings import parse_etcd_endpoints

    prog = f"kvcm cluster {args.action}"
    endpoints = args.etcd_endpoints or os.environ.get("KVCM_ETCD_ENDPOINTS", "")
    prefix = args.etcd_prefix or os.environ.get("KVCM_ETCD_PREFIX", "") or "/kvcm"
    if not endpoints:
        print(f"{prog}: --etcd-endpoints (or KVCM_ETCD_ENDPOINTS) is required", file=sys.stderr)
        return 2
    try:
        parsed = parse_etcd_endpoints(endpoints)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    token = os.environ.get("KVCM_TOKEN", "")
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        etcd_tls, replica_tls = _cluster_tls(args, endpoints)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    tls = {"etcd_credentials": etcd_tls, "replica_credentials": replica_tls}

    async def run() -> int:
        try:
            if args.action == "move":
                placement = await move_pool(
                    parsed,
                    prefix,
                    args.pool,
                    args.to,
                    metadata=metadata,
                    timeout_s=args.timeout,
                    **tls,
                )
                print(f"{placement.pool_id}: primary {placement.primary}, standby "
                      f"{placement.standby}, epoch {placement.epoch}")  # fmt: skip
            else:
                moved = await drain_replica(
                    parsed, prefix, args.address, metadata=metadata, timeout_s=args.timeout, **tls
                )
                for placement in moved:
                    print(f"{placement.pool_id}: primary {placement.primary}, standby "
                          f"{placement.standby}, epoch {placement.epoch}")  # fmt: skip
                print(f"{args.address}: primary of no pool ({len(moved)} moved)")
            return 0
        except (MoveError, EtcdUnavailableError) as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 1
        except grpc.RpcError as exc:  # a replica's GetReplicaState refused or unreachable
            print(f"{prog}: a replica answered {exc.code().name}: {exc.details()} (an admin "
                  "token is needed where auth is on: KVCM_TOKEN)", file=sys.stderr)  # fmt: skip
            return 1

    return asyncio.run(run())


def _cluster_tls(args: argparse.Namespace, endpoints: str) -> tuple[Any, Any]:
    """``kvcm cluster``'s TLS to etcd (a credentials factory) and to the replicas
    (``grpc.ChannelCredentials``), each ``None`` for plaintext.

    Raises:
        ConfigError: A file cannot be read, or a certificate without its key (named).
    """
    import os
    from pathlib import Path

    import grpc

    from kvcm.common.errors import ConfigError
    from kvcm.server.tls import etcd_credentials

    def pick(flag: str | None, env: str) -> str:
        return flag or os.environ.get(env, "")

    etcd = etcd_credentials(
        ServerSettings(
            etcd_endpoints=endpoints,
            etcd_ca=pick(args.etcd_ca, "KVCM_ETCD_CA"),
            etcd_cert=pick(args.etcd_cert, "KVCM_ETCD_CERT"),
            etcd_key=pick(args.etcd_key, "KVCM_ETCD_KEY"),
        )
    )
    files = {
        "tls_ca": pick(args.tls_ca, "KVCM_TLS_CA"),
        "tls_client_cert": pick(args.tls_client_cert, "KVCM_TLS_CLIENT_CERT"),
        "tls_client_key": pick(args.tls_client_key, "KVCM_TLS_CLIENT_KEY"),
    }
    if not any(files.values()):
        return etcd, None
    if bool(files["tls_client_cert"]) != bool(files["tls_client_key"]):
        raise ConfigError("--tls-client-cert and --tls-client-key go together (mutual TLS)")
    read: dict[str, bytes | None] = {}
    for name, path in files.items():
        try:
            read[name] = Path(path).read_bytes() if path else None
        except OSError as exc:
            raise ConfigError(f"{name}: cannot read {path!r}: {exc.strerror}") from None
    replica = grpc.ssl_channel_credentials(
        read["tls_ca"], read["tls_client_key"], read["tls_client_cert"]
    )
    return etcd, replica


def _add_data_dir_commands(commands: Any) -> None:
    """``kvcm data-dir check|recover`` (docs/durability.md)."""
    data_dir = commands.add_parser(
        "data-dir",
        help="verify a data directory offline, or cut its journal at damage",
        description="Inspect a stopped server's data directory (docs/durability.md).",
    )
    actions = data_dir.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check",
        help="verify the checkpoint and the journal; change nothing",
        description=(
            "Verify DIR's checkpoint (every pool's snapshot decoded) and journal (every "
            "record's frame and CRC). Exit code 0: a server starts on it (a torn last record "
            "is trimmed at start); 1: a start would be refused (damage); 2: not a directory."
        ),
    )
    check.add_argument("dir", metavar="DIR")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    recover = actions.add_parser(
        "recover",
        help="cut the journal at its damage (only with --drop-after-damage)",
        description=(
            "Cut DIR's journal at its first damage, dropping every record from there on "
            "(saved to journal.log.dropped-OFFSET first), and say exactly what was dropped. "
            "Without --drop-after-damage it only says what it would drop (exit code 2)."
        ),
    )
    recover.add_argument("dir", metavar="DIR")
    recover.add_argument(
        "--drop-after-damage",
        action="store_true",
        help="really drop the damaged part of the journal and every record after it",
    )
    recover.add_argument("--json", action="store_true", help="print the report as JSON")


def _data_dir(args: argparse.Namespace) -> int:
    import json

    from kvcm.server.datadir import DAMAGED, check_data_dir, recover_data_dir

    prog = f"kvcm data-dir {args.action}"
    try:
        if args.action == "check":
            report, _ = check_data_dir(args.dir)
            lines: list[str] = []
        else:
            report, lines = recover_data_dir(args.dir, drop_after_damage=args.drop_after_damage)
    except FileNotFoundError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except PermissionError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**report.as_dict(), "actions": lines}, indent=2))
    else:
        print("\n".join([*report.lines(), *lines]))
    if args.action == "check":
        return 1 if report.status == DAMAGED else 0
    return 1 if report.checkpoint["error"] else 0


def _log_configuration(config_file: str | None, settings: ServerSettings) -> None:
    """INFO ``configuration loaded``: the file it came from and every resulting setting."""
    logging.getLogger("kvcm.server").info(
        "configuration loaded",
        extra={"event": "config_loaded", "config_file": config_file, **asdict(settings)},
    )


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from kvcm.common.errors import ConfigError
    from kvcm.server.app import KVCMServer, run_until_signalled
    from kvcm.server.logs import configure_logging
    from kvcm.server.settings import load_settings

    try:
        settings = load_settings(
            args.config, **{spec.name: getattr(args, spec.name) for spec in SETTINGS}
        )
    except ConfigError as exc:
        print(f"kvcm serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)

    async def main() -> int:
        server = KVCMServer(settings)
        try:
            await server.start()
        except ConfigError as exc:
            print(f"kvcm serve: {exc}", file=sys.stderr)
            return 2
        # Logged once the addresses are known to work: a start that fails stays one line.
        _log_configuration(args.config or os.environ.get(CONFIG_ENV) or None, settings)

        def reload() -> ServerSettings:
            return load_settings(
                args.config, **{spec.name: getattr(args, spec.name) for spec in SETTINGS}
            )

        await run_until_signalled(server, reload)
        return 0

    return asyncio.run(main())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvcm`` command line; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "data-dir":
        return _data_dir(args)
    if args.command == "cluster":
        return _cluster(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse guards this


if __name__ == "__main__":
    raise SystemExit(main())
