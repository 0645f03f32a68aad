"""The ``kvcm`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvcm.server.settings import DEFAULT_GRPC_ADDRESS, DEFAULT_HTTP_ADDRESS

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcm", description="kvcm: a standalone KV-cache manager for LLM serving clusters."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the kvcm server (gRPC and HTTP)")
    serve.add_argument(
        "--grpc-address",
        default=None,
        help=f"gRPC host:port (default {DEFAULT_GRPC_ADDRESS})",
    )
    serve.add_argument(
        "--http-address",
        default=None,
        help=f"HTTP host:port for /metrics, /healthz, /readyz, /v1/pools "
        f"(default {DEFAULT_HTTP_ADDRESS})",
    )
    serve.add_argument("--config", default=None, help="TOML file with a [server] table")
    serve.add_argument(
        "--log-level",
        default=None,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level (default INFO)",
    )
    return parser


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from kvcm.common.errors import ConfigError
    from kvcm.server.app import serve
    from kvcm.server.settings import load_settings

    try:
        settings = load_settings(
            args.config,
            grpc_address=args.grpc_address,
            http_address=args.http_address,
            log_level=args.log_level,
        )
    except ConfigError as exc:
        print(f"kvcm serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    asyncio.run(serve(settings))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvcm`` command line; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse guards this


if __name__ == "__main__":
    raise SystemExit(main())
