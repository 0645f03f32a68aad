"""The ``kvcm`` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcm", description="kvcm: a standalone KV-cache manager for LLM serving clusters."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="drive the allocation core through a shared-prefix workload and report what happened",
    )
    demo.add_argument("--requests", type=int, default=400, help="requests to serve (default 400)")
    demo.add_argument("--num-blocks", type=int, default=2048, help="KV-cache blocks in the pool")
    demo.add_argument("--block-size", type=int, default=16, help="tokens per block")
    demo.add_argument("--seed", type=int, default=0, help="workload seed")
    demo.add_argument(
        "--hash-algorithm",
        default="sha256_cbor",
        choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
        help="block hash algorithm (default sha256_cbor)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvcm`` command line; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
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
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse guards this
