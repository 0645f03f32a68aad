"""An HTTP fuzzer: raw bytes at every route of a real server with tokens on.

Hypothesis draws a route the app declares (or a path none serves), a verb, a pool id, an
``Authorization`` header (a valid token, an unknown one, raw bytes) and a body (JSON shaped like
a lookup, JSON mangled at the byte level, or raw bytes), and checks each answer: never a 5xx,
a refusal only as the tokens say (401 without a valid token on a route that needs one), and
the pools unchanged by any request (the HTTP side only reads). CI runs a small budget;
``KVCM_FUZZ_EXAMPLES=5000 python -m pytest tests/integration/test_http_fuzz.py`` runs more
(about 45 ms an example).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm.client import SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig, PoolRegistry
from kvcm.server.access import RULES, PoolFrom
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.http import build_app
from kvcm.server.rpc import lookup_as
from kvcm.server.settings import ServerSettings
from kvcm.server.telemetry import RpcStats

_EXAMPLES = int(os.environ.get("KVCM_FUZZ_EXAMPLES", "60"))
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=256,
    explicit_layout=KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)
POOLS = ("a-0", "b-0")
TOKENS = {"admin-token": ["admin:*"], "reader-a-token": ["reader:a-*"]}


def _routes() -> list[str]:
    registry = PoolRegistry()
    app = build_app(
        registry, RpcStats(), lambda: True, lookup=functools.partial(lookup_as, registry)
    )
    return [
        f"{verb} {route.path}"  # type: ignore[attr-defined]
        for route in app.routes
        for verb in sorted(getattr(route, "methods", None) or ())
    ]


ROUTES = _routes()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    path: Path = tmp_path_factory.mktemp("http-fuzz") / "tokens.toml"
    path.write_text(
        "\n".join(
            f'[[tokens]]\nname = "{token}"\n'
            f'sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
            f"roles = {json.dumps(roles)}\n"
            for token, roles in TOKENS.items()
        ),
        encoding="utf-8",
    )
    running = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            auth_tokens=str(path),
            log_level="CRITICAL",
        )
    )
    try:
        with SchedulerClient(running.grpc_address, token="admin-token", timeout=5) as admin:
            for pool_id in POOLS:
                admin.create_pool(pool_id, CONFIG)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def http(server: EmbeddedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{server.http_address}", timeout=10.0) as client:
        yield client


def _state(server: EmbeddedServer) -> list[Any]:
    """Every pool's observable state (counters included), read on the server's loop."""

    async def read() -> list[Any]:
        return [pool.snapshot() for pool in server.server.state.registry.list()]

    return server.call(read())


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)
_lookup_like = st.fixed_dictionaries(
    {},
    optional={
        "tokens": st.fixed_dictionaries(
            {}, optional={"token_ids": st.lists(st.integers(-5, 2**33), max_size=40)}
        ),
        "hashes": st.dictionaries(st.sampled_from(["blockHashes", "numTokens"]), _json_values),
        "scope": st.fixed_dictionaries(
            {},
            optional={
                "pool_ids": st.lists(st.sampled_from([*POOLS, "", "zz", "\ud800"]), max_size=3)
            },
        ),
        "load_weight": _json_values,
        "max_results": _json_values,
    },
)


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["lookup", "json", "mangled", "raw"]))
    if kind == "raw":
        return draw(st.binary(max_size=300))
    value = draw(_lookup_like) if kind == "lookup" else draw(_json_values)
    encoded = json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")
    if kind == "mangled" and encoded:
        cut = draw(st.integers(0, len(encoded) - 1))
        encoded = encoded[:cut] + draw(st.binary(min_size=1, max_size=8)) + encoded[cut + 1 :]
    return encoded


_AUTHORIZATIONS = st.one_of(
    st.sampled_from([None, "Bearer admin-token", "Bearer reader-a-token", "Bearer nope"]),
    st.binary(min_size=1, max_size=40).map(
        lambda raw: bytes(b for b in raw if b >= 0x20 and b != 0x7F).strip() or b"x"
    ),
)


@settings(
    max_examples=_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    route=st.sampled_from([*ROUTES, "GET /no/such/route", "DELETE /v1/pools/{pool}"]),
    verb=st.sampled_from([None, "POST", "PUT", "PATCH"]),
    pool_id=st.sampled_from([*POOLS, "missing", "x" * 300, "%00", "p%C3%B6"]),
    authorization=_AUTHORIZATIONS,
    body=_bodies(),
)
def test_http_requests_never_fail_the_server(
    server: EmbeddedServer,
    http: httpx.Client,
    route: str,
    verb: str | None,
    pool_id: str,
    authorization: str | bytes | None,
    body: bytes,
) -> None:
    method, path = route.split(" ", 1)
    method = verb or method
    headers = {} if authorization is None else {"authorization": authorization}
    before = _state(server)
    answer = http.request(method, path.replace("{pool}", pool_id), headers=headers, content=body)
    assert answer.status_code < 500, (method, path, answer.text[:300])
    assert _state(server) == before, (method, path)
    rule = RULES.get(f"{method} {path}")  # None: no route takes this verb there
    valid = authorization in ("Bearer admin-token", "Bearer reader-a-token")
    if rule is not None and rule.pool is PoolFrom.OPEN:
        assert answer.status_code not in (401, 403)
    elif not valid:
        assert answer.status_code == 401, (method, path, answer.status_code)
