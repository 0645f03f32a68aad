"""``kvcm pd-proxy``: an OpenAI-compatible P/D proxy that picks both engines with kvcm.

In the role of vLLM's P/D example proxies (``toy_proxy_server.py``,
``disagg_proxy_demo.py``): each completion goes first to a prefill engine with
``kv_transfer_params = {"do_remote_decode": true, ...}``, ``max_tokens`` 1 and no streaming;
the ``kv_transfer_params`` the prefill engine answers (``do_remote_prefill``,
``remote_block_ids``, ``remote_engine_id``, ...) go with the request to a decode engine, whose
answer (streamed or not) is the client's. Where vLLM's proxies pick both engines round robin,
this one asks kvcm (``RoutePd``): the decode engine that holds the longest exact prefix of the
prompt (it pulls only the rest) and the prefill engine that computes the least, both weighed by
load. ``--policy round-robin`` is vLLM's policy, for comparison.

Engines are registered with their kvcm pool ids (``--prefill URL=POOL``, ``--decode
URL=POOL``, or ``--engines FILE``). The prompt is routed on token ids: a completion's
``prompt`` when it is a list of ids, else the prefill engine's ``POST /tokenize`` (vLLM's
route) of the prompt or the chat messages. If kvcm cannot answer, the proxy routes round robin
and counts it (``GET /v1/pd/stats``). A decode engine that cannot be reached or answers 5xx
before anything was streamed is replaced by the next one of the ranking (the prefill engine's
blocks are held until pulled or until their lease).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import statistics
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvcm.cli._connect import Connection, UsageError
from kvcm.client import (
    AsyncSchedulerClient,
    HeldRequest,
    LookupQuery,
    PdRoute,
    PdRouteQuery,
    PdScope,
)
from kvcm.common.errors import KVCMError

__all__ = [
    "POLICIES",
    "Engine",
    "PdProxy",
    "ProxyConfig",
    "add_pd_proxy_flags",
    "build_proxy_app",
    "load_config",
    "run_pd_proxy",
]

_log = logging.getLogger("kvcm.pd_proxy")
MAX_HELD_REQUESTS: Final = 1024
POLICIES: Final = ("kvcm", "round-robin")
_PREFILL_PARAMS: Final = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_HOP_HEADERS: Final = frozenset(
    {"content-length", "transfer-encoding", "connection", "host", "content-encoding"}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Engine:
    """One engine behind the proxy.

    Attributes:
        url: Its OpenAI-compatible base URL (``http://host:port``).
        pool_id: Its kvcm pool.
        role: ``"prefill"`` or ``"decode"``.
    """

    url: str
    pool_id: str
    role: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    """What the proxy routes over and how.

    Attributes:
        prefill: The prefill engines.
        decode: The decode engines.
        policy: ``"kvcm"`` (RoutePd) or ``"round-robin"`` (vLLM's example proxies).
        load_weight: RoutePd's weight of usage against the hit fraction.
        timeout_s: Deadline of each engine call.
        down_s: An engine that could not be reached is left out of the routing this long.
        decode_attempts: Decode engines tried per request (the next one of the ranking after
            an unreachable one or a 5xx before streaming).
        bidirectional: The engines run vLLM's NIXL connector with ``bidirectional_kv_xfer``:
            the proxy keeps the params decode engines answer (blocks they hold), routes with
            them (``RoutePd`` ``held``) and gives the prefill engine the held request that
            matches the prompt, with kvcm's exact ``remote_num_tokens``.
        decoder_kv_ttl_s: How long a decode engine holds a finished request's blocks (vLLM's
            ``decoder_kv_blocks_ttl``): older params are dropped.
    """

    prefill: tuple[Engine, ...]
    decode: tuple[Engine, ...]
    policy: str = "kvcm"
    load_weight: float = 0.5
    timeout_s: float = 300.0
    down_s: float = 10.0
    decode_attempts: int = 2
    bidirectional: bool = False
    decoder_kv_ttl_s: float = 480.0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise UsageError("register at least one prefill and one decode engine")
        if self.policy not in POLICIES:
            raise UsageError(f"--policy must be one of {', '.join(POLICIES)}")
        for role, engines in (("prefill", self.prefill), ("decode", self.decode)):
            seen = [engine.pool_id for engine in engines]
            if len(set(seen)) != len(seen):
                raise UsageError(f"two {role} engines share a pool id: {sorted(seen)}")
        if not 0.0 <= self.load_weight <= 1e6:
            raise UsageError(f"--load-weight must be in [0, 1e6], got {self.load_weight}")
        if self.bidirectional and self.policy != "kvcm":
            raise UsageError("--bidirectional needs --policy kvcm (the exact remote_num_tokens)")
        if self.decode_attempts < 1:
            raise UsageError("--decode-attempts must be >= 1")


@dataclass
class ProxyStats:
    """What the proxy did (``GET /v1/pd/stats``)."""

    requests: int = 0
    failed: int = 0
    routed_by_kvcm: int = 0
    routed_round_robin: int = 0
    kvcm_unavailable: int = 0
    decode_retries: int = 0
    prompt_tokens: int = 0
    expected_decode_hit_tokens: int = 0
    by_engine: dict[str, int] = field(default_factory=dict)
    route_latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))

    def summary(self) -> dict[str, Any]:
        """The counters, and the routing call's latency (median and p99, milliseconds, over
        the last 100,000 calls)."""
        document = {k: v for k, v in vars(self).items() if k != "route_latencies_s"}
        latencies = sorted(self.route_latencies_s)
        if latencies:
            document["route_p50_ms"] = statistics.median(latencies) * 1e3
            document["route_p99_ms"] = (
                latencies[min(len(latencies) - 1, len(latencies) * 99 // 100)] * 1e3
            )
        return document


class _UpstreamError(Exception):
    """An engine could not be reached or answered an error."""

    def __init__(
        self, engine: Engine, status: int, body: bytes, *, unreachable: bool = False
    ) -> None:
        what = "could not be reached" if unreachable else f"answered {status}"
        super().__init__(f"{engine.role} engine {engine.url} {what}")
        self.engine = engine
        self.status = status
        self.body = body
        self.unreachable = unreachable


class PdProxy:
    """The proxy's routing and forwarding (the HTTP app is :func:`build_proxy_app`)."""

    def __init__(
        self, config: ProxyConfig, kvcm: AsyncSchedulerClient | None, http: httpx.AsyncClient
    ) -> None:
        """Route over ``config``'s engines, asking ``kvcm`` (``None``: round robin only)."""
        self.config = config
        self.stats = ProxyStats()
        self._kvcm = kvcm
        self._http = http
        self._prefill_cycle: Iterator[int] = itertools.cycle(range(len(config.prefill)))
        self._decode_cycle: Iterator[int] = itertools.cycle(range(len(config.decode)))
        self._prefill_by_pool = {engine.pool_id: engine for engine in config.prefill}
        self._decode_by_pool = {engine.pool_id: engine for engine in config.decode}
        self._down_until: dict[str, float] = {}
        # (decode pool, request id) -> (the params it answered, when its blocks expire).
        self._held: OrderedDict[tuple[str, str], tuple[dict[str, Any], float]] = OrderedDict()

    def remember(self, engine: Engine, params: Mapping[str, Any]) -> None:
        """Keep the params a decode engine answered for blocks it holds (bidirectional)."""
        request_id = params.get("remote_request_id")
        if not (params.get("do_remote_decode") and params.get("remote_block_ids")) or not (
            isinstance(request_id, str) and request_id
        ):
            return
        key = (engine.pool_id, request_id)
        self._held[key] = (dict(params), time.monotonic() + self.config.decoder_kv_ttl_s)
        self._held.move_to_end(key)
        while len(self._held) > MAX_HELD_REQUESTS:
            self._held.popitem(last=False)

    def held(self) -> list[HeldRequest]:
        """The decode engines' held requests whose blocks have not expired."""
        now = time.monotonic()
        for key in [key for key, (_, expiry) in self._held.items() if expiry <= now]:
            del self._held[key]
        return [HeldRequest(pool_id, request_id) for pool_id, request_id in self._held]

    def take_held(self, route: PdRoute | None) -> dict[str, Any] | None:
        """The params of the held request ``route`` chose, with its exact
        ``remote_num_tokens`` (``None``: none)."""
        if route is None or not route.held_request_id or not route.decode:
            return None
        entry = self._held.pop((route.decode[0].pool_id, route.held_request_id), None)
        if entry is None:
            return None
        params = dict(entry[0])
        params["remote_num_tokens"] = route.remote_num_tokens
        return params

    def _up(self, engines: Sequence[Engine]) -> list[Engine]:
        """``engines`` less those found unreachable within ``down_s`` (all if none is up)."""
        now = time.monotonic()
        up = [e for e in engines if self._down_until.get(e.pool_id, 0.0) <= now]
        return up or list(engines)

    def mark_down(self, engine: Engine) -> None:
        """Leave ``engine`` out of the routing for ``down_s`` (it could not be reached)."""
        self._down_until[engine.pool_id] = time.monotonic() + self.config.down_s

    # ------------------------------------------------------------------- routing
    def _round_robin(self) -> tuple[list[Engine], list[Engine]]:
        """vLLM's example policy: the next engine of each role (then the others, in order, as
        fail-overs)."""

        def rotated(engines: tuple[Engine, ...], first: int) -> list[Engine]:
            return [engines[(first + i) % len(engines)] for i in range(len(engines))]

        prefill = rotated(self.config.prefill, next(self._prefill_cycle))
        decode = rotated(self.config.decode, next(self._decode_cycle))
        return self._up(prefill), self._up(decode)

    async def pick(
        self, token_ids: Sequence[int], body: Mapping[str, Any]
    ) -> tuple[list[Engine], list[Engine], PdRoute | None]:
        """The prefill and the decode engines to try, best first, and kvcm's answer."""
        if self.config.policy != "kvcm" or self._kvcm is None:
            self.stats.routed_round_robin += 1
            return (*self._round_robin(), None)
        salt = body.get("cache_salt")
        started = time.perf_counter()
        try:
            query = PdRouteQuery(
                prompt=LookupQuery(
                    token_ids=list(token_ids),
                    cache_salt=salt if isinstance(salt, str) else None,
                    load_weight=self.config.load_weight,
                    # The engines tried per request, and one more in case one is down.
                    max_results=self.config.decode_attempts + 1,
                ),
                prefill=PdScope(pool_ids=tuple(self._prefill_by_pool)),
                decode=PdScope(pool_ids=tuple(self._decode_by_pool)),
                bidirectional=self.config.bidirectional,
                held=self.held() if self.config.bidirectional else (),
            )
            route = await self._kvcm.route_pd(query)
            self.stats.route_latencies_s.append(time.perf_counter() - started)
        except KVCMError as exc:  # kvcm down or refusing (an empty prompt): the engines judge
            _log.warning("kvcm could not route (%s); routing round robin", exc)
            self.stats.kvcm_unavailable += 1
            self.stats.routed_round_robin += 1
            return (*self._round_robin(), None)
        prefill = self._up([self._prefill_by_pool[hit.pool_id] for hit in route.prefill])
        decode = self._up([self._decode_by_pool[hit.pool_id] for hit in route.decode])
        if not prefill or not decode:  # every pool of a role skipped (not ready, too long)
            self.stats.routed_round_robin += 1
            rr_prefill, rr_decode = self._round_robin()
            return prefill or rr_prefill, decode or rr_decode, route
        self.stats.routed_by_kvcm += 1
        self.stats.expected_decode_hit_tokens += route.decode_hit_tokens
        return prefill, decode, route

    async def prompt_tokens(self, body: Mapping[str, Any], chat: bool, engine: Engine) -> list[int]:
        """The prompt's token ids: the request's own, else the engine's ``/tokenize``."""
        prompt = body.get("prompt")
        if (
            not chat
            and isinstance(prompt, list)
            and prompt
            and all(isinstance(token, int) and not isinstance(token, bool) for token in prompt)
        ):
            return list(prompt)
        if chat:
            request = {"model": body.get("model"), "messages": body.get("messages", [])}
        else:
            request = {"model": body.get("model"), "prompt": prompt}
        answer = await self._post(engine, "/tokenize", request, {})
        try:
            tokens = json.loads(answer)["tokens"]
            return [int(token) for token in tokens]
        except (ValueError, TypeError, KeyError):
            raise _UpstreamError(engine, 502, b"/tokenize answered no token list") from None

    # ---------------------------------------------------------------- forwarding
    async def _post(
        self, engine: Engine, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> bytes:
        try:
            answer = await self._http.post(
                engine.url + path, json=body, headers=dict(headers), timeout=self.config.timeout_s
            )
        except httpx.HTTPError as exc:
            raise _UpstreamError(
                engine, 502, f"unreachable: {exc}".encode(), unreachable=True
            ) from exc
        if answer.status_code >= 400:
            raise _UpstreamError(engine, answer.status_code, answer.content)
        return answer.content

    async def prefill(
        self,
        engine: Engine,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        source: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Run the prompt on the prefill engine (``source``: a decode engine's held blocks to
        pull from, bidirectional); returns its ``kv_transfer_params``."""
        request = dict(body)
        request["kv_transfer_params"] = dict(source) if source else dict(_PREFILL_PARAMS)
        request["stream"] = False
        request["max_tokens"] = 1
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        request.pop("stream_options", None)
        request.pop("min_tokens", None)
        content = await self._post(engine, path, request, headers)
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            raise _UpstreamError(engine, 502, b"the prefill engine answered no kv_transfer_params")
        return params

    async def _prefill_first(
        self,
        engines: Sequence[Engine],
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        source: Mapping[str, Any] | None,
    ) -> tuple[Engine, dict[str, Any]]:
        """Prefill on the first engine of ``engines`` that can be reached."""
        for engine in engines[:-1]:
            try:
                params = await self.prefill(engine, path, body, headers, source)
            except _UpstreamError as exc:
                if not exc.unreachable:
                    raise
                self.mark_down(engine)
                continue
            self._count(engine)
            return engine, params
        params = await self.prefill(engines[-1], path, body, headers, source)
        self._count(engines[-1])
        return engines[-1], params

    async def decode(
        self,
        engines: Sequence[Engine],
        path: str,
        body: Mapping[str, Any],
        params: Mapping[str, Any],
        headers: Mapping[str, str],
    ) -> Response:
        """Send the request with the prefill's params to the first decode engine that
        answers; a stream is relayed as it comes."""
        request = dict(body)
        request["kv_transfer_params"] = dict(params)
        last: _UpstreamError | None = None
        for attempt, engine in enumerate(engines[: self.config.decode_attempts]):
            if attempt:
                self.stats.decode_retries += 1
            try:
                response = await self._open(engine, path, request, headers)
            except _UpstreamError as exc:
                last = exc
                if exc.unreachable:
                    self.mark_down(engine)
                if exc.status < 500:
                    break
                continue
            self._count(engine)
            return response
        assert last is not None
        raise last

    async def _open(
        self, engine: Engine, path: str, request: Mapping[str, Any], headers: Mapping[str, str]
    ) -> Response:
        try:
            upstream = await self._http.send(
                self._http.build_request(
                    "POST",
                    engine.url + path,
                    json=request,
                    headers=dict(headers),
                    timeout=self.config.timeout_s,
                ),
                stream=True,
            )
        except httpx.HTTPError as exc:
            raise _UpstreamError(
                engine, 502, f"unreachable: {exc}".encode(), unreachable=True
            ) from exc
        if upstream.status_code >= 400:
            content = await upstream.aread()
            await upstream.aclose()
            raise _UpstreamError(engine, upstream.status_code, content)
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        kept["x-kvcm-decode"] = engine.pool_id

        watch = _ParamsWatch() if self.config.bidirectional else None

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    if watch is not None:
                        watch.feed(chunk)
                    yield chunk
            finally:
                await upstream.aclose()
                params = watch.params() if watch is not None else None
                if params is not None:
                    self.remember(engine, params)

        return StreamingResponse(
            relay(),
            status_code=upstream.status_code,
            headers=kept,
            media_type=upstream.headers.get("content-type"),
        )

    def _count(self, engine: Engine) -> None:
        key = f"{engine.role}:{engine.pool_id}"
        self.stats.by_engine[key] = self.stats.by_engine.get(key, 0) + 1

    async def handle(self, request: Request, path: str, chat: bool) -> Response:
        """One completion: pick, prefill, decode."""
        self.stats.requests += 1
        try:
            body = await request.json()
        except ValueError:
            self.stats.failed += 1
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            self.stats.failed += 1
            return _error(400, "the body must be a JSON object")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        auth = request.headers.get("authorization")
        if auth:
            headers["authorization"] = auth
        try:
            tokens = await self.prompt_tokens(body, chat, self._up(self.config.prefill)[0])
            self.stats.prompt_tokens += len(tokens)
            prefill, decode, route = await self.pick(tokens, body)
            source = self.take_held(route)
            chosen, params = await self._prefill_first(prefill, path, body, headers, source)
            response = await self.decode(decode, path, body, params, headers)
        except _UpstreamError as exc:
            self.stats.failed += 1
            _log.warning("%s: %s", request_id, exc)
            return _error(502 if exc.status < 400 or exc.status >= 500 else exc.status, str(exc))
        response.headers["x-kvcm-prefill"] = chosen.pool_id
        if route is not None:
            response.headers["x-kvcm-decode-hit-tokens"] = str(route.decode_hit_tokens)
        return response


class _ParamsWatch:
    """Finds ``kv_transfer_params`` in a relayed answer: a JSON body, or the data lines of a
    server-sent event stream (the last chunk carries them); at most 8 MiB are kept."""

    _LIMIT: Final = 8 * 1024 * 1024

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> None:
        if len(self._buffer) + len(chunk) <= self._LIMIT:
            self._buffer += chunk

    def params(self) -> dict[str, Any] | None:
        text = self._buffer.decode("utf-8", "replace")
        documents = [text]
        if text.lstrip().startswith("data:"):
            documents = [
                line[5:].strip()
                for line in text.splitlines()
                if line.startswith("data:") and "kv_transfer_params" in line
            ]
        for document in reversed(documents):
            try:
                parsed = json.loads(document)
            except ValueError:
                continue
            params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
            if isinstance(params, dict):
                return params
        return None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def build_proxy_app(
    config: ProxyConfig,
    connection: Connection | None,
) -> FastAPI:
    """The proxy's HTTP app: ``POST /v1/completions``, ``POST /v1/chat/completions``,
    ``GET /v1/models`` (the first decode engine's), ``GET /healthcheck``, ``GET
    /v1/pd/stats``.

    Args:
        config: The engines and the policy.
        connection: How to reach kvcm (``None``: round robin whatever the policy).
    """
    holder: dict[str, PdProxy] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        kvcm = None
        if connection is not None:
            options = (
                (("grpc.ssl_target_name_override", connection.server_name),)
                if connection.server_name
                else ()
            )
            kvcm = AsyncSchedulerClient(
                connection.address,
                timeout=connection.timeout_s,
                tls=connection.tls,
                token=connection.token,
                channel_options=options,
            )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits) as http:
            holder["proxy"] = PdProxy(config, kvcm, http)
            try:
                yield
            finally:
                if kvcm is not None:
                    await kvcm.close()

    app = FastAPI(title="kvcm pd-proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.holder = holder

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await holder["proxy"].handle(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await holder["proxy"].handle(request, "/v1/chat/completions", chat=True)

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, Any]:
        return {"status": "ok", "prefill": len(config.prefill), "decode": len(config.decode)}

    @app.get("/v1/models")
    async def models() -> Response:
        engine = config.decode[0]
        try:
            answer = await holder["proxy"]._http.get(engine.url + "/v1/models", timeout=10.0)
        except httpx.HTTPError as exc:
            return _error(502, f"decode engine {engine.url} unreachable: {exc}")
        return Response(
            answer.content, status_code=answer.status_code, media_type="application/json"
        )

    @app.get("/v1/pd/stats")
    async def stats() -> dict[str, Any]:
        return {"policy": config.policy, **holder["proxy"].stats.summary()}

    return app


# ------------------------------------------------------------------------ configuration
def _engine(spec: str, role: str) -> Engine:
    url, sep, pool = spec.rpartition("=")
    if not sep or not url or not pool:
        raise UsageError(f"--{role} {spec!r}: expected URL=POOL (http://10.0.0.1:8100=prefill-0)")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--{role} {spec!r}: the URL must start with http:// or https://")
    return Engine(url=url.rstrip("/"), pool_id=pool, role=role)


def load_config(args: argparse.Namespace) -> ProxyConfig:
    """The proxy's configuration from its flags and ``--engines`` file.

    The file is JSON: ``{"prefill": [{"url": ..., "pool": ...}], "decode": [...]}``; flags add
    to it.

    Raises:
        UsageError: A malformed engine, file, or policy.
    """
    prefill = [_engine(spec, "prefill") for spec in args.prefill]
    decode = [_engine(spec, "decode") for spec in args.decode]
    if args.engines:
        try:
            document = json.loads(Path(args.engines).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--engines {args.engines}: {exc}") from None
        for role, target in (("prefill", prefill), ("decode", decode)):
            for index, item in enumerate(document.get(role, [])):
                if not isinstance(item, dict) or not {"url", "pool"} <= item.keys():
                    raise UsageError(f"--engines: {role}[{index}] needs url and pool")
                target.append(_engine(f"{item['url']}={item['pool']}", role))
    return ProxyConfig(
        prefill=tuple(prefill),
        decode=tuple(decode),
        policy=args.policy,
        load_weight=args.load_weight,
        decode_attempts=args.decode_attempts,
        bidirectional=args.bidirectional,
        decoder_kv_ttl_s=args.decoder_kv_ttl,
    )


def add_pd_proxy_flags(parser: argparse.ArgumentParser) -> None:
    """``kvcm pd-proxy``'s own flags (the connection flags are added beside them)."""
    parser.add_argument(
        "--prefill", action="append", default=[], metavar="URL=POOL", help="a prefill engine"
    )
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL=POOL", help="a decode engine"
    )
    parser.add_argument("--engines", metavar="FILE", help="JSON file of engines (see docs/pd.md)")
    parser.add_argument("--policy", choices=POLICIES, default="kvcm", help="default kvcm")
    parser.add_argument(
        "--load-weight", type=float, default=0.5, help="RoutePd's load weight (default 0.5)"
    )
    parser.add_argument(
        "--decode-attempts", type=int, default=2, help="decode engines tried per request"
    )
    parser.add_argument(
        "--bidirectional",
        action="store_true",
        help="engines run vLLM's bidirectional_kv_xfer: prefill engines pull what the decode "
        "engine holds, with kvcm's exact remote_num_tokens",
    )
    parser.add_argument(
        "--decoder-kv-ttl", type=float, default=480.0, help="vLLM's decoder_kv_blocks_ttl (s)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")


def run_pd_proxy(args: argparse.Namespace, connection: Connection) -> int:
    """Serve the proxy until interrupted."""
    config = load_config(args)
    app = build_proxy_app(config, connection)
    print(
        f"kvcm pd-proxy: http://{args.host}:{args.port} ({config.policy}; "
        f"{len(config.prefill)} prefill, {len(config.decode)} decode engines; kvcm at "
        f"{connection.address})",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
