"""Simulated P/D engines: OpenAI-compatible HTTP servers whose KV caches are kvcm pools.

No model and no GPU: each engine is a FastAPI app (served by uvicorn on 127.0.0.1) that speaks
the part of vLLM's OpenAI API a P/D proxy uses (``POST /v1/completions``, ``POST
/v1/chat/completions`` with streaming, ``POST /tokenize``, ``GET /health``) and drives its pool
through the plain SDK the way vLLM's NIXL connector drives its KV-cache manager:

- **prefill** (``kv_transfer_params.do_remote_decode``): looks the prompt up in its pool,
  allocates and "computes" the rest, answers one token and the params a decode engine pulls
  with (``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``,
  ``remote_host``, ``remote_port``); the request keeps its blocks until the decode engine says it
  pulled them (``POST /kv/pulled``, NIXL's notification) or its ``kv_lease_s`` runs out
  (vLLM's ``kv_lease_duration``);
- **decode** (``do_remote_prefill``): looks the prompt up in its own pool (its local hit is not
  pulled), allocates the rest as external tokens with ``delay_cache_blocks`` (the server's
  ``transfer_lease_s`` reclaims it if the pull never completes), "pulls" (tells the prefill
  engine), caches, generates ``max_tokens`` tokens and frees (the conversation stays cached).

Faults, for the demo and the tests: ``never_pull_every`` (every n-th transfer the decode engine
allocates and then abandons the request: no pull, no cache, no free; answers 500), and
:meth:`SimEngine.die` (the server stops; its pool's scheduler lease reclaims what it held).

Tokens are counted in :class:`EngineStats`. The tokenizer is a stand-in (one id per word,
``crc32``), so prompts may be text or token ids. Not a library module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvcm.client import AsyncSchedulerClient, CacheHit, SlotOptions

__all__ = ["EngineStats", "SimEngine", "tokenize_text"]

VOCAB = 50_000


def tokenize_text(text: str) -> list[int]:
    """The stand-in tokenizer: one id per whitespace-separated word."""
    return [zlib.crc32(word.encode()) % VOCAB for word in text.split()]


def _chat_text(messages: Sequence[dict[str, Any]]) -> str:
    return " ".join(f"<{m.get('role', 'user')}> {m.get('content', '')}" for m in messages)


def _next_token(context: Sequence[int]) -> int:
    """A deterministic "model": the next token of a context (its last 8 tokens' crc)."""
    tail = ",".join(map(str, context[-8:])).encode()
    return zlib.crc32(tail) % VOCAB


@dataclass
class EngineStats:
    """What one engine did.

    Attributes:
        requests: Requests answered (200).
        prompt_tokens: Their prompt tokens.
        hit_tokens: Prompt tokens found in the engine's own pool (not computed or pulled).
        computed_tokens: Prompt tokens computed (decode engines: after a failed pull).
        pulled_tokens: Decode engines: prompt tokens pulled from a prefill engine.
        load_failures: Decode engines: pulls whose source was gone (recomputed instead).
        transfers: Decode engines: transfers started (pulls from a prefill engine).
        sources_released: Sources (held requests) freed once their puller said it read them.
        expired: Sources freed by their lease (``kv_lease_s``, ``decoder_ttl_s``): nobody
            pulled them.
        abandoned: Decode engines: transfers abandoned by the ``never_pull_every`` fault.
        failed: Requests answered with an error.
    """

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    pulled_tokens: int = 0
    load_failures: int = 0
    transfers: int = 0
    sources_released: int = 0
    expired: int = 0
    abandoned: int = 0
    failed: int = 0


@dataclass
class _Held:
    key: int
    deadline: float


@dataclass
class SimEngine:
    """One simulated engine over one kvcm pool (the pool must exist).

    Attributes:
        name: The engine's id (``remote_engine_id``).
        role: ``"prefill"`` or ``"decode"`` (an engine answers both kinds of request anyway).
        pool_id: Its kvcm pool.
        kvcm_address: The kvcm server's gRPC address.
        kv_lease_s: Prefill: how long a source waits for its pull.
        never_pull_every: Decode fault: abandon every n-th transfer (0: never).
        bidirectional: vLLM's ``bidirectional_kv_xfer``: a decode engine holds a finished
            request's blocks for ``decoder_ttl_s`` and answers the params to pull them with;
            a prefill engine given such params pulls what it lacks (at least
            ``kv_recompute_threshold`` tokens) before computing the rest.
        decoder_ttl_s: vLLM's ``decoder_kv_blocks_ttl``.
        kv_recompute_threshold: vLLM's ``kv_recompute_threshold``.
        token: kvcm bearer token.
        stats: What it did.
        received: The ``kv_transfer_params`` of every completion it got, in order.
        url: Its base URL once started.
    """

    name: str
    role: str
    pool_id: str
    kvcm_address: str
    kv_lease_s: float = 5.0
    never_pull_every: int = 0
    bidirectional: bool = False
    decoder_ttl_s: float = 480.0
    kv_recompute_threshold: int = 64
    token: str | None = None
    stats: EngineStats = field(default_factory=EngineStats)
    received: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    _held: dict[str, _Held] = field(default_factory=dict)
    _next_key: int = 1

    # ------------------------------------------------------------------- lifecycle
    def start(self) -> str:
        """Serve on 127.0.0.1 (a free port) in a thread; returns the base URL."""
        config = uvicorn.Config(
            self._app(), host="127.0.0.1", port=0, log_level="warning", lifespan="on"
        )
        self._server = server = uvicorn.Server(config)
        self._thread = threading.Thread(target=server.run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"engine {self.name} did not start")
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def die(self) -> None:
        """Stop serving (a crash as the pool sees it: what the engine held stays in the pool
        until its scheduler lease reclaims it)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    stop = die

    # ------------------------------------------------------------------------ app
    def _app(self) -> FastAPI:
        engine = self
        state: dict[str, Any] = {}

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            state["client"] = AsyncSchedulerClient(engine.kvcm_address, token=engine.token)
            state["hasher"] = await state["client"].block_hasher(engine.pool_id)
            state["lock"] = asyncio.Lock()
            reaper = asyncio.create_task(engine._reap(state))
            try:
                yield
            finally:
                reaper.cancel()
                await state["client"].close()

        app = FastAPI(lifespan=lifespan)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict[str, Any]:
            body = await request.json()
            tokens = engine._prompt_tokens(body)
            return {"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20}

        @app.post("/kv/pulled")
        async def pulled(request: Request) -> dict[str, bool]:
            body = await request.json()
            held = engine._held.pop(str(body.get("remote_request_id")), None)
            if held is not None:
                # NOTE: not under the engine's lock: the puller may hold its own engine's lock
                # while it waits for this answer (a prefill pulling from a decode engine that
                # is itself pulling from it would wait on each other). One free is atomic.
                await state["client"].free(engine.pool_id, held.key)
                engine.stats.sources_released += 1
            return {"released": held is not None}

        async def complete(request: Request, chat: bool) -> Response:
            body = await request.json()
            try:
                return await engine._complete(state, body, chat)
            except _EngineFaultError as exc:
                engine.stats.failed += 1
                return JSONResponse({"error": {"message": str(exc)}}, status_code=500)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await complete(request, chat=True)

        return app

    def _prompt_tokens(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            return tokenize_text(_chat_text(body["messages"]))
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return tokenize_text(str(prompt))

    async def _reap(self, state: dict[str, Any]) -> None:
        """Free sources nobody pulled within their lease; keep the pool's scheduler lease.

        A live engine renews its pool's scheduler lease (``KeepAlive`` every 0.25 s) as a vLLM
        engine does by stepping, so only a dead engine's requests are reclaimed by the server.
        """
        client: AsyncSchedulerClient = state["client"]
        renewed = 0.0
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            if now - renewed >= 0.25:
                await client.keep_alive(self.pool_id)
                renewed = now
            for request_id, held in list(self._held.items()):
                if held.deadline <= now and self._held.pop(request_id, None) is not None:
                    async with state["lock"]:
                        await client.free(self.pool_id, held.key)
                    self.stats.expired += 1

    async def _admit(self, state: dict[str, Any], tokens: list[int]) -> tuple[int, CacheHit]:
        """Add the request and look it up: (key, its local hit)."""
        client: AsyncSchedulerClient = state["client"]
        key = self._next_key
        self._next_key += 1
        hashes = state["hasher"].hash_token_ids(tokens)
        await client.add_request(self.pool_id, key, tokens, hashes, request_id=f"{self.name}-{key}")
        return key, await client.get_computed_blocks(self.pool_id, key)

    async def _complete(self, state: dict[str, Any], body: dict[str, Any], chat: bool) -> Response:
        tokens = self._prompt_tokens(body)
        params = body.get("kv_transfer_params") or {}
        self.received.append(dict(params))
        result: tuple[list[int], dict[str, Any] | None]
        async with state["lock"]:  # one "scheduler step" at a time, as an engine core
            if params.get("do_remote_decode"):
                result = await self._prefill(state, tokens, params)
            else:
                result = await self._decode(state, tokens, params, body)
        output, kv_params = result
        self.stats.requests += 1
        self.stats.prompt_tokens += len(tokens)
        return self._answer(body, chat, tokens, output, kv_params)

    async def _prefill(
        self, state: dict[str, Any], tokens: list[int], params: dict[str, Any]
    ) -> tuple[list[int], dict[str, Any]]:
        client: AsyncSchedulerClient = state["client"]
        key, found = await self._admit(state, tokens)
        hit = found.num_computed_tokens
        start = hit
        pending: CacheHit | None = found  # the hit goes with the request's first allocation
        remote = bool(params.get("remote_block_ids"))  # bidirectional: a decode engine's blocks
        count = min(int(params.get("remote_num_tokens") or 0), len(tokens)) - hit
        if remote and count >= self.kv_recompute_threshold:
            # vLLM's prefill side of a bidirectional transfer: the decode engine's tokens as
            # external tokens, caching delayed until they are read.
            options = SlotOptions(num_external_computed_tokens=count, delay_cache_blocks=True)
            blocks = await client.allocate_slots(
                self.pool_id, key, 0, hit, hit=found, options=options
            )
            if blocks is None:
                await client.free(self.pool_id, key)
                raise _EngineFaultError(f"{self.name}: the prompt does not fit")
            pending = None
            if await self._pull(params):
                self.stats.pulled_tokens += count
                start = hit + count
                await client.cache_blocks(self.pool_id, key, start)
            else:  # the source is gone: recompute from the local hit
                self.stats.load_failures += 1
        elif remote:  # too little to pull: tell the decode engine to let its blocks go
            await self._pull(params)
        blocks = await client.allocate_slots(
            self.pool_id, key, len(tokens) - start, start, hit=pending
        )
        if blocks is None:
            await client.free(self.pool_id, key)
            raise _EngineFaultError(f"{self.name}: the prompt does not fit")
        self.stats.hit_tokens += hit
        self.stats.computed_tokens += len(tokens) - start
        request_id = f"{self.name}-{key}"
        self._held[request_id] = _Held(key, time.monotonic() + self.kv_lease_s)
        return [_next_token(tokens)], await self._source_params(
            client, key, request_id, len(tokens), for_decode=True
        )

    async def _source_params(
        self,
        client: AsyncSchedulerClient,
        key: int,
        request_id: str,
        num_tokens: int,
        *,
        for_decode: bool,
    ) -> dict[str, Any]:
        """The kv_transfer_params another engine pulls this request's blocks with."""
        block_ids = await client.get_block_ids(self.pool_id, key)
        host, _, port = self.url.removeprefix("http://").partition(":")
        return {
            "do_remote_prefill": for_decode,
            "do_remote_decode": not for_decode,
            "remote_block_ids": [list(group) for group in block_ids],
            "remote_engine_id": self.name,
            "remote_request_id": request_id,
            "remote_host": host,
            "remote_port": int(port),
            "remote_num_tokens": num_tokens,
        }

    async def _decode(
        self, state: dict[str, Any], tokens: list[int], params: dict[str, Any], body: dict[str, Any]
    ) -> tuple[list[int], dict[str, Any] | None]:
        client: AsyncSchedulerClient = state["client"]
        key, found = await self._admit(state, tokens)
        hit = found.num_computed_tokens
        remote = bool(params.get("do_remote_prefill"))
        if remote:  # vLLM's load_kv_async: no new tokens, the rest external, caching delayed
            external = len(tokens) - hit
            options = SlotOptions(num_external_computed_tokens=external, delay_cache_blocks=True)
            blocks = await client.allocate_slots(
                self.pool_id, key, 0, hit, hit=found, options=options
            )
        else:
            external = 0
            blocks = await client.allocate_slots(
                self.pool_id, key, len(tokens) - hit, hit, hit=found
            )
        if blocks is None:
            await client.free(self.pool_id, key)
            raise _EngineFaultError(f"{self.name}: the prompt does not fit")
        computed = len(tokens)
        if remote:
            self.stats.transfers += 1
            if self.never_pull_every and self.stats.transfers % self.never_pull_every == 0:
                self.stats.abandoned += 1  # no pull, no cache, no free: the lease's to clean
                raise _EngineFaultError(f"{self.name}: the KV pull never completed")
            if await self._pull(params):
                self.stats.pulled_tokens += external
            else:  # the source is gone (its lease ran out, its engine died): recompute
                self.stats.load_failures += 1
                self.stats.computed_tokens += external
            computed = len(tokens) - 1  # vLLM recomputes the last prompt token
            await client.cache_blocks(self.pool_id, key, computed)
        else:
            self.stats.computed_tokens += len(tokens) - hit
        self.stats.hit_tokens += hit
        output: list[int] = []
        context = list(tokens)
        max_tokens = max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or 1))
        while True:
            if computed < len(context):
                fits = await client.allocate_slots(
                    self.pool_id, key, len(context) - computed, computed
                )
                if fits is None:
                    break  # out of blocks: stop here (a real engine would preempt)
                computed = len(context)
            token = _next_token(context)
            output.append(token)
            context.append(token)
            await client.append_tokens(self.pool_id, key, [token])
            if len(output) >= max_tokens:
                break
        if not self.bidirectional:
            await client.free(self.pool_id, key)
            return output, None
        # vLLM's decode side with bidirectional_kv_xfer: the finished request keeps its blocks
        # for decoder_kv_blocks_ttl, for the next turn's prefill engine to pull.
        request_id = f"{self.name}-{key}"
        self._held[request_id] = _Held(key, time.monotonic() + self.decoder_ttl_s)
        params = await self._source_params(client, key, request_id, computed, for_decode=False)
        return output, params

    async def _pull(self, params: dict[str, Any]) -> bool:
        """Read the source blocks, then tell the prefill engine (NIXL's notification);
        whether the source was still there."""
        import httpx

        url = f"http://{params['remote_host']}:{params['remote_port']}/kv/pulled"
        async with httpx.AsyncClient(timeout=5.0) as http:
            try:
                answer = await http.post(
                    url, json={"remote_request_id": params["remote_request_id"]}
                )
            except httpx.HTTPError:  # a dead source: its lease frees it
                return False
        return answer.status_code == 200 and bool(answer.json().get("released"))

    def _answer(
        self,
        body: dict[str, Any],
        chat: bool,
        tokens: list[int],
        output: list[int],
        kv_params: dict[str, Any] | None,
    ) -> Response:
        created = int(time.time())
        model = body.get("model", "sim")
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": len(output),
            "total_tokens": len(tokens) + len(output),
        }
        text = " ".join(f"t{t}" for t in output)
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(finish_reason="length", token_ids=output)
        document = {
            "id": f"cmpl-{self.name}",
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage,
            "kv_transfer_params": kv_params,
        }
        if not body.get("stream"):
            return JSONResponse(document)

        async def events() -> AsyncIterator[bytes]:
            for token in output:
                if chat:
                    delta: dict[str, Any] = {"index": 0, "delta": {"content": f"t{token} "}}
                else:
                    delta = {"index": 0, "text": f"t{token} "}
                delta["token_ids"] = [token]
                chunk = {"id": document["id"], "model": model, "choices": [delta]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                await asyncio.sleep(0)
            if kv_params is not None:  # the last chunk carries the params, as the body does
                final = {"id": document["id"], "model": model, "choices": []}
                final["kv_transfer_params"] = kv_params
                yield f"data: {json.dumps(final)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


class _EngineFaultError(Exception):
    """A request the engine answers with an error."""
