"""The ``kvcm`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from importlib import metadata
from typing import NoReturn

from kvcm.server.settings import CONFIG_ENV, DEFAULT_GRPC_ADDRESS, DEFAULT_HTTP_ADDRESS, SETTINGS

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

    demo = commands.add_parser(
        "demo",
        help="start a server and drive it over gRPC with simulated workers and a scheduler",
        description=(
            "By default: start a kvcm server with its embedded defaults, register simulated "
            "workers, replay a shared-prefix chat workload through the Step RPC with a live hit "
            "rate, print a summary and stop. --remote drives a running server instead; "
            "--in-process drives the allocation core without the network."
        ),
    )
    where = demo.add_mutually_exclusive_group()
    where.add_argument(
        "--remote", metavar="ADDRESS", default=None, help="drive the server at host:port"
    )
    where.add_argument(
        "--in-process", action="store_true", help="drive the allocation core in this process"
    )
    demo.add_argument(
        "--grpc-address",
        default=DEFAULT_GRPC_ADDRESS,
        help=f"gRPC host:port of the embedded server (default {DEFAULT_GRPC_ADDRESS})",
    )
    demo.add_argument(
        "--http-address",
        default=DEFAULT_HTTP_ADDRESS,
        help=f"HTTP host:port of the embedded server (default {DEFAULT_HTTP_ADDRESS})",
    )
    demo.add_argument("--requests", type=int, default=300, help="requests to serve (default 300)")
    demo.add_argument("--world-size", type=int, default=2, help="simulated worker ranks")
    demo.add_argument(
        "--num-blocks", type=int, default=2048, help="pool blocks (--in-process only)"
    )
    demo.add_argument(
        "--block-size", type=int, default=16, help="tokens per block (--in-process only)"
    )
    demo.add_argument("--seed", type=int, default=0, help="workload seed")
    demo.add_argument(
        "--hash-algorithm",
        default="sha256_cbor",
        choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
        help="block hash algorithm (default sha256_cbor)",
    )
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
    return parser


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from kvcm.common.errors import ConfigError
    from kvcm.server.app import KVCMServer, run_until_signalled
    from kvcm.server.settings import load_settings

    try:
        settings = load_settings(
            args.config, **{spec.name: getattr(args, spec.name) for spec in SETTINGS}
        )
    except ConfigError as exc:
        print(f"kvcm serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )

    async def main() -> int:
        server = KVCMServer(settings)
        try:
            await server.start()
        except ConfigError as exc:
            print(f"kvcm serve: {exc}", file=sys.stderr)
            return 2
        await run_until_signalled(server)
        return 0

    return asyncio.run(main())


def _demo(args: argparse.Namespace) -> int:
    if args.in_process:
        from kvcm.server.demo import DemoOptions, run_demo

        return run_demo(
            DemoOptions(
                num_requests=args.requests,
                num_blocks=args.num_blocks,
                block_size=args.block_size,
                seed=args.seed,
                hash_algorithm=args.hash_algorithm,
            )
        )
    from kvcm.client.demo import RemoteDemoOptions, run_remote_demo

    options = RemoteDemoOptions(
        address=args.remote or args.grpc_address,
        world_size=args.world_size,
        num_requests=args.requests,
        hash_algorithm=args.hash_algorithm,
        seed=args.seed,
    )
    if args.remote:
        run_remote_demo(options)
        return 0
    from kvcm.server.embedded import start_embedded_server
    from kvcm.server.settings import ServerSettings

    settings = ServerSettings(
        grpc_address=args.grpc_address, http_address=args.http_address, log_level="WARNING"
    )
    try:
        server = start_embedded_server(settings)
    except RuntimeError as exc:
        print(
            f"kvcm demo: {exc}\n  (another server on these ports? pass --grpc-address and "
            "--http-address, e.g. 127.0.0.1:0 for any free port)",
            file=sys.stderr,
        )
        return 1
    with server:
        http = f", HTTP on http://{server.http_address}/metrics" if server.http_address else ""
        print(f"kvcm server: gRPC on {server.grpc_address}{http}")
        run_remote_demo(replace(options, address=server.grpc_address))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvcm`` command line; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "serve":
        return _serve(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse guards this


if __name__ == "__main__":
    raise SystemExit(main())
