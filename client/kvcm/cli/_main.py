"""``kvcm COMMAND``: the parser, the operator's commands, and one-line errors.

``serve`` and ``data-dir`` are handed to ``kvcm.server.cli`` whole (their flags are the
server's); the rest talk to a running server through the SDK. Every failure is one line on
stderr that says what to do, never a traceback: exit code 1 for a server's refusal or an
unreachable server, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from typing import Any, NoReturn

from kvcm.cli._connect import Connection, UsageError, add_connection_flags, connect
from kvcm.cli._show import (
    describe_lines,
    event_batch_lines,
    jsonable,
    labels_text,
    lookup_lines,
    percent,
    table,
    zmq_batch_lines,
)
from kvcm.client import (
    LookupQuery,
    PermissionDeniedError,
    PoolInfo,
    SchedulerClient,
    ServiceError,
    ServiceFailedPreconditionError,
    ServiceNotFoundError,
    StatusCode,
    TransferState,
)
from kvcm.common.errors import KVCMError

__all__ = ["main"]

_SERVER_COMMANDS = ("serve", "data-dir", "cluster")
# What `kvcm[server]` adds to the base install.
_SERVER_DEPENDENCIES = frozenset(
    {"fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client", "grpc_health",
     "grpc_reflection", "zmq", "msgspec"}
)  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvcm lookup: error: ...`` on stderr, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _version() -> str:
    try:
        return metadata.version("kvcm")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree without install
        return "unknown"


# ------------------------------------------------------------------------------ parser
def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvcm",
        description=(
            "kvcm: a standalone KV-cache manager for LLM serving clusters. `kvcm serve` runs "
            "the server; the other commands inspect one (docs/server.md)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kvcm {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Listed for --help; their arguments are parsed by kvcm.server.cli.
    commands.add_parser("serve", help="run the kvcm server (gRPC and HTTP)", add_help=False)
    commands.add_parser(
        "data-dir", help="check or recover a stopped server's data directory", add_help=False
    )
    commands.add_parser(
        "cluster", help="move a pool to another replica, or drain a replica", add_help=False
    )

    pools = commands.add_parser("pools", help="list the pools: usage, hit rate, events, lag")
    describe = commands.add_parser("describe", help="everything about one pool")
    describe.add_argument("pool", metavar="POOL")
    lookup = commands.add_parser("lookup", help="which pools hold a prompt, ranked")
    _add_lookup_flags(lookup)
    events = commands.add_parser(
        "events", help="follow a pool's KV events (gRPC stream, or --zmq: vLLM's ZMQ wire)"
    )
    _add_events_flags(events)
    transfers = commands.add_parser(
        "transfers", help="list P/D transfer records: sources held, leases, pulls (docs/pd.md)"
    )
    transfers.add_argument("--pool", default="", help="only this source pool's transfers")
    transfers.add_argument(
        "--state",
        action="append",
        default=[],
        choices=[state.name for state in TransferState],
        help="only transfers in this state (repeat)",
    )
    for command in (pools, describe, lookup, events, transfers):
        add_connection_flags(command)
        command.add_argument("--json", action="store_true", help="print JSON, for scripts")
    pd_proxy = commands.add_parser(
        "pd-proxy",
        help="OpenAI-compatible P/D proxy: prefill and decode engines picked by kvcm (docs/pd.md)",
    )
    _add_pd_proxy_flags(pd_proxy)
    add_connection_flags(pd_proxy)
    return parser


# What `kvcm[proxy]` adds to the base install.
_PROXY_DEPENDENCIES = frozenset({"fastapi", "starlette", "uvicorn", "httpx", "httpcore"})


def _add_pd_proxy_flags(parser: argparse.ArgumentParser) -> None:
    try:
        from kvcm.cli.pd_proxy import add_pd_proxy_flags
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _PROXY_DEPENDENCIES:
            raise
        parser.set_defaults(proxy_missing=exc.name)
        return
    add_pd_proxy_flags(parser)


def _pd_proxy(args: argparse.Namespace, connection: Connection) -> int:
    missing = getattr(args, "proxy_missing", None)
    if missing:
        raise UsageError(
            f"the proxy's dependencies are not installed ({missing} is missing): "
            "pip install 'kvcm[proxy]'"
        )
    from kvcm.cli.pd_proxy import run_pd_proxy

    return run_pd_proxy(args, connection)


def _add_lookup_flags(lookup: argparse.ArgumentParser) -> None:
    prompt = lookup.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", metavar="IDS", help="token ids: '1,2,3' or '1 2 3'")
    prompt.add_argument(
        "--tokens-file", metavar="FILE", help="a file of token ids (whitespace or commas; -: stdin)"
    )
    prompt.add_argument(
        "--hashes",
        metavar="HEX",
        action="append",
        help="block hashes in hex, concatenated or one per flag (the scope's hash length)",
    )
    lookup.add_argument(
        "--num-tokens", type=int, default=0, help="with --hashes: the prompt's length in tokens"
    )
    lookup.add_argument("--cache-salt", help="vLLM's cache_salt, as the engine hashes it")
    lookup.add_argument("--lora-name", help="the LoRA adapter's name, as the engine hashes it")
    lookup.add_argument(
        "--pool", action="append", default=[], metavar="POOL", help="scope: this pool (repeat)"
    )
    lookup.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="scope: pools with this label (repeat: all of them)",
    )
    lookup.add_argument(
        "--max-results", type=int, default=0, help="answer at most this many pools (0: all)"
    )
    lookup.add_argument(
        "--load-weight", type=float, default=None, help="weight of usage in the score (0.5)"
    )


def _add_events_flags(events: argparse.ArgumentParser) -> None:
    events.add_argument("pool", metavar="POOL", nargs="?", help="the pool (optional with --zmq)")
    events.add_argument(
        "--zmq",
        nargs="?",
        const="",
        default=None,
        metavar="ENDPOINT",
        help="read vLLM's ZMQ wire instead: ENDPOINT, or without one the pool's own "
        "(DescribePool); needs pyzmq and msgspec",
    )
    events.add_argument(
        "--topic", default=None, help="with --zmq: topic prefix (default: the pool's topic)"
    )
    events.add_argument(
        "--from",
        dest="start",
        type=int,
        default=None,
        metavar="SEQ",
        help="gRPC: resume at this event sequence (default: from now on)",
    )
    events.add_argument("--count", type=int, default=0, help="stop after N batches (0: Ctrl-C)")


# ----------------------------------------------------------------------------- helpers
def _emit(args: argparse.Namespace, document: Any, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(document, indent=2, sort_keys=False))
    else:
        print("\n".join(lines))


def _hit_rate(info: PoolInfo) -> float:
    return info.prefix_cache.hit_rate


def _describe_all(client: SchedulerClient) -> Iterator[PoolInfo]:
    for summary in client.list_pools():
        try:
            yield client.describe_pool(summary.pool_id)
        except ServiceNotFoundError:
            continue  # deleted since the listing


# ---------------------------------------------------------------------------- commands
def _pools(args: argparse.Namespace, connection: Connection) -> int:
    with connection.client() as client:
        infos = list(_describe_all(client))
    records = []
    rows = []
    for info in infos:
        planned = info.kv_cache_config
        num_blocks = planned.num_blocks if planned is not None else 0
        zmq = info.zmq_events
        progress = info.step_progress
        hit_rate = _hit_rate(info)
        record = {
            "pool_id": info.pool_id,
            "state": info.state.name,
            "labels": dict(info.config.labels),
            "num_blocks": num_blocks,
            "num_free_blocks": info.num_free_blocks,
            "usage": info.usage,
            "num_requests": info.num_requests,
            "hit_rate": hit_rate,
            "epoch": info.epoch,
            "last_event_sequence": info.last_event_sequence,
            "zmq_last_seq": None if zmq is None else zmq.last_seq,
            "steps_behind": None if progress is None else progress.steps_behind,
        }
        records.append(record)
        rows.append(
            (
                info.pool_id,
                info.state.name,
                labels_text(info.config.labels),
                num_blocks,
                info.num_free_blocks,
                percent(info.usage),
                info.num_requests,
                percent(hit_rate),
                info.epoch,
                info.last_event_sequence if info.config.enable_kv_cache_events else "-",
                "-" if progress is None else progress.steps_behind,
            )
        )
    headers = ["POOL", "STATE", "LABELS", "BLOCKS", "FREE", "USAGE", "REQUESTS", "HIT_RATE"]
    lines = table([*headers, "EPOCH", "EVENT_SEQ", "LAG_STEPS"], rows) if rows else ["no pools"]
    _emit(args, {"pools": records}, lines)
    return 0


def _describe(args: argparse.Namespace, connection: Connection) -> int:
    with connection.client() as client:
        info = client.describe_pool(args.pool)
    document = jsonable(info)
    document["hit_rate"] = _hit_rate(info)
    _emit(args, document, describe_lines(info, _hit_rate(info)))
    return 0


def _token_ids(text: str, source: str) -> list[int]:
    ids = []
    for index, item in enumerate(text.replace(",", " ").split()):
        if not (item.isascii() and item.isdigit()):
            raise UsageError(f"{source}: item {index} is {item[:20]!r}, not a token id")
        ids.append(int(item))
    if not ids:
        raise UsageError(f"{source}: no token ids")
    return ids


def _lookup_query(args: argparse.Namespace) -> LookupQuery:
    labels = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--label {item!r}: write KEY=VALUE")
        labels[key] = value
    scope: dict[str, Any] = {"pool_ids": tuple(args.pool), "labels": labels}
    scope["max_results"] = args.max_results
    if args.load_weight is not None:
        scope["load_weight"] = args.load_weight
    if args.hashes:
        try:
            hashes = b"".join(bytes.fromhex(h.replace(",", "")) for h in args.hashes)
        except ValueError:
            raise UsageError("--hashes: not hex (write the block hashes in hex)") from None
        return LookupQuery(block_hashes=hashes, num_tokens=args.num_tokens, **scope)
    if args.tokens is not None:
        ids = _token_ids(args.tokens, "--tokens")
    else:
        path = args.tokens_file
        try:
            if path == "-":
                text = sys.stdin.read()
            else:
                with open(path, encoding="utf-8") as handle:
                    text = handle.read()
        except OSError as exc:
            raise UsageError(f"--tokens-file {path!r}: {exc.strerror}") from None
        ids = _token_ids(text, f"--tokens-file {path!r}")
    return LookupQuery(token_ids=ids, cache_salt=args.cache_salt, lora_name=args.lora_name, **scope)


def _lookup(args: argparse.Namespace, connection: Connection) -> int:
    from kvcm.wire.lookup import lookup_result_to_json

    query = _lookup_query(args)
    with connection.client() as client:
        answer = client.lookup(query)
    _emit(args, lookup_result_to_json(answer), lookup_lines(answer))
    return 0


def _events(args: argparse.Namespace, connection: Connection) -> int:
    if args.count < 0:
        raise UsageError(f"--count must be >= 0, got {args.count}")
    if args.zmq is not None:
        return _zmq_events(args, connection)
    if not args.pool:
        raise UsageError("name the POOL to follow (or --zmq ENDPOINT for vLLM's wire)")
    seen = 0
    with connection.client() as client:
        stream = client.subscribe_events(args.pool, start_sequence=args.start)
        try:
            for batch in stream:
                if not batch.events:
                    continue  # the stream's opening message: where it stands, no events
                if args.json:
                    print(json.dumps({"pool_id": args.pool, **jsonable(batch)}), flush=True)
                else:
                    print("\n".join(event_batch_lines(args.pool, batch)), flush=True)
                seen += 1
                if args.count and seen >= args.count:
                    break
        finally:
            stream.close()
    return 0


def _zmq_events(args: argparse.Namespace, connection: Connection) -> int:
    try:
        import msgspec
        import zmq
    except ImportError:
        raise UsageError(
            "--zmq needs pyzmq and msgspec: pip install 'kvcm[server]' (or pyzmq msgspec)"
        ) from None
    endpoint, topic = args.zmq, args.topic
    if args.pool and (not endpoint or topic is None):
        with connection.client() as client:
            stream = client.describe_pool(args.pool).zmq_events
        if stream is None:
            raise UsageError(
                f"pool {args.pool!r} has no ZMQ stream (the server runs without "
                "--kv-events-endpoint, or the pool without enable_kv_cache_events)"
            )
        endpoint = endpoint or stream.endpoint
        topic = stream.topic if topic is None else topic
    if not endpoint:
        raise UsageError("--zmq: give an ENDPOINT, or a POOL whose endpoint to read")
    decode = msgspec.msgpack.Decoder().decode
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    seen = 0
    try:
        socket.connect(endpoint.replace("*", "127.0.0.1"))
        socket.setsockopt(zmq.SUBSCRIBE, (topic or "").encode())
        while True:
            topic_bytes, seq, payload = socket.recv_multipart()
            batch = decode(payload)
            seq_no = int.from_bytes(seq, "big", signed=True)
            name = topic_bytes.decode("utf-8", "replace")
            if args.json:
                print(json.dumps({"topic": name, "seq": seq_no, "batch": jsonable(batch)}))
            else:
                print("\n".join(zmq_batch_lines(name, seq_no, batch)))
            sys.stdout.flush()
            seen += 1
            if args.count and seen >= args.count:
                return 0
    except zmq.ZMQError as exc:
        raise UsageError(f"--zmq {endpoint!r}: {exc}") from None
    finally:
        socket.close(linger=0)
        context.term()


def _transfers(args: argparse.Namespace, connection: Connection) -> int:
    states = [TransferState[name] for name in args.state]
    with connection.client() as client:
        found = client.list_transfers(args.pool, states=states)
    records = [jsonable(transfer) for transfer in found]
    headers = ("POOL", "TRANSFER", "STATE", "REQUEST", "BLOCKS", "DEST", "HIT", "PULL", "LEASE")
    rows = [
        (
            t.pool_id,
            t.transfer_id,
            t.state.name + (" (record)" if t.record_only else ""),
            t.request_id,
            max((len(ids) for ids in t.source_blocks), default=0),
            t.destination_pool_id or "-",
            t.hit_tokens,
            t.pull_tokens,
            f"{t.lease_remaining_s:.1f}s" if t.lease_remaining_s else "-",
        )
        for t in found
    ]
    _emit(args, {"transfers": records}, table(headers, rows))
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace, Connection], int]] = {
    "pools": _pools,
    "transfers": _transfers,
    "describe": _describe,
    "lookup": _lookup,
    "events": _events,
    "pd-proxy": _pd_proxy,
}


# ------------------------------------------------------------------------------ errors
def _fix(exc: ServiceError, args: argparse.Namespace, connection: Connection) -> str:
    """What to do about a server's refusal."""
    code = exc.code
    if code is StatusCode.UNAVAILABLE:
        return (
            f"cannot reach kvcm at {connection.address} ({exc.details}): is `kvcm serve` "
            "running there? Name it with --grpc-address or KVCM_GRPC_ADDRESS; a TLS server "
            "needs --tls-ca"
        )
    if code is StatusCode.UNAUTHENTICATED:
        return f"{exc.details}: pass a token with --token, KVCM_TOKEN or --token-file"
    if isinstance(exc, PermissionDeniedError):
        return f"{exc.details}: use a token with the reader (or admin) role on the pool"
    if isinstance(exc, ServiceNotFoundError):
        return f"{exc.details} (`kvcm pools` lists the pools)"
    if isinstance(exc, ServiceFailedPreconditionError) and args.command == "events":
        return f"{exc.details} (events are published for pools created with enable_kv_cache_events)"
    if code is StatusCode.OUT_OF_RANGE:
        return f"{exc.details} (resume from a later --from, or leave it out for the live edge)"
    if code is StatusCode.DEADLINE_EXCEEDED:
        return f"no answer within {connection.timeout_s:g}s (raise --timeout)"
    return f"{code.name}: {exc.details}"


def _run_server_command(argv: Sequence[str]) -> int:
    try:
        from kvcm.server.cli import main as server_main

        return server_main(argv)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _SERVER_DEPENDENCIES:
            raise
        print(
            f"kvcm {argv[0]}: the server's dependencies are not installed ({exc.name} is "
            "missing): pip install 'kvcm[server]'",
            file=sys.stderr,
        )
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvcm`` command line; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _SERVER_COMMANDS:
        return _run_server_command(argv)
    args = _build_parser().parse_args(argv)
    prog = f"kvcm {args.command}"
    connection: Connection | None = None
    try:
        connection = connect(args, os.environ)
        return _COMMANDS[args.command](args, connection)
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except ServiceError as exc:
        assert connection is not None
        print(f"{prog}: {_fix(exc, args, connection)}", file=sys.stderr)
        return 1
    except KVCMError as exc:  # the SDK's own checks of what the flags built
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0  # Ctrl-C ends `kvcm events`; what was printed stands
    except BrokenPipeError:
        sys.stderr.close()  # `kvcm events | head`: the reader left
        return 0
