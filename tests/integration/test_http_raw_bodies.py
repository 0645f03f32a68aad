"""Raw bytes at every HTTP route of a real server: a 4xx that names the problem, never a 500.

Found by the issue 24 review: ``POST /v1/lookup`` with a body that is not UTF-8 answered 500.
The routes are taken from the app itself, so a route added later is swept too.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import httpx
import pytest

from kvcm.core.pool import PoolRegistry
from kvcm.server.access import RULES, PoolFrom
from kvcm.server.embedded import start_embedded_server
from kvcm.server.http import build_app
from kvcm.server.rpc import lookup_as
from kvcm.server.settings import ServerSettings
from kvcm.server.telemetry import RpcStats

# Bodies no JSON decoder should take, and JSON that is hostile in its content.
RAW_BODIES: dict[str, bytes] = {
    "latin-1": b'{"tokens": {"tokenIds": [1]}, "scope": {"poolIds": ["\xe9t\xe9"]}}',
    "invalid-utf8": b"\xff\xfe\xfd",
    "utf-16": '{"tokens": {"tokenIds": [1]}}'.encode("utf-16"),
    "utf-8-bom": b'\xef\xbb\xbf{"tokens": {"tokenIds": [1]}}',
    "empty": b"",
    "nul": b"\x00" * 64,
    "truncated": b'{"tokens": {"tokenIds": [1',
    "not-an-object": b"[1, 2, 3]",
    "null": b"null",
    "deep-array": b"[" * 100_000 + b"]" * 100_000,
    "deep-object": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "5000-digit-int": b'{"maxResults": ' + b"9" * 5000 + b"}",
    "nan-literal": b'{"loadWeight": NaN}',
    "unpaired-surrogate": b'{"tokens": {"tokenIds": [1], "loraName": "\\ud800"}}',
    "surrogate-pool-id": b'{"tokens": {"tokenIds": [1]}, "scope": {"poolIds": ["\\udfff"]}}',
    "uint32-overflow": b'{"tokens": {"tokenIds": [4294967296]}}',
    "duplicate-key": b'{"tokens": {"tokenIds": [1]}, "tokens": {"tokenIds": [2]}}',
    "bad-base64": b'{"hashes": {"blockHashes": "!!!", "numTokens": 16}}',
    "long-unknown-field": b'{"' + b"x" * 100_000 + b'": 1}',
}


def _routes() -> list[tuple[str, str]]:
    """(method, path) of every route the server's app declares, path parameters filled in."""
    app = build_app(
        PoolRegistry(),
        RpcStats(),
        lambda: True,
        lookup=functools.partial(lookup_as, PoolRegistry()),
    )
    routes = []
    for route in app.routes:
        path = getattr(route, "path", "")
        for method in sorted(getattr(route, "methods", None) or ()):
            routes.append((method, path.replace("{pool}", "no-such-pool")))
    assert ("POST", "/v1/lookup") in routes
    return routes


ROUTES = _routes()
# The routes the one authorization table leaves open (health, readiness, the static pages).
OPEN_ROUTES = frozenset(
    tuple(key.split(" ", 1)) for key, rule in RULES.items() if rule.pool is PoolFrom.OPEN
)


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_answers_raw_bytes_without_a_5xx(
    kvcm_http_address: str, method: str, path: str
) -> None:
    with httpx.Client(base_url=f"http://{kvcm_http_address}", timeout=10.0) as http:
        for name, body in RAW_BODIES.items():
            for verb in {method, "POST", "PUT"}:
                answer = http.request(verb, path, content=body)
                assert answer.status_code < 500, (verb, path, name, answer.text[:200])


@pytest.mark.parametrize("name", sorted(RAW_BODIES))
def test_lookup_names_what_is_wrong_with_the_body(kvcm_http_address: str, name: str) -> None:
    answer = httpx.post(
        f"http://{kvcm_http_address}/v1/lookup", content=RAW_BODIES[name], timeout=10.0
    )
    assert answer.status_code == 400, answer.text[:200]
    error = answer.json()["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert len(error["message"]) < 1000  # the body is not echoed whole
    if name in ("latin-1", "invalid-utf8", "utf-16"):
        assert "not UTF-8" in error["message"]


RAW_AUTHORIZATIONS: tuple[bytes, ...] = (
    b"Bearer \xff\xfe",
    b"Bearer " + b"\xe9" * 10_000,
    b"bearer",
    b"Bearer \t x",
    b"Basic dXNlcjpwYXNz",
    b"\x80\xff \xff",
)


def test_raw_authorization_headers_and_bodies_with_tokens_on(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    digest = hashlib.sha256(b"reader-token").hexdigest()
    tokens.write_text(
        f'[[tokens]]\nname = "router"\nsha256 = "{digest}"\nroles = ["reader:*"]\n',
        encoding="utf-8",
    )
    running = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            auth_tokens=str(tokens),
            log_level="ERROR",
        )
    )
    try:
        with httpx.Client(base_url=f"http://{running.http_address}", timeout=10.0) as http:
            for method, path in ROUTES:
                for header in RAW_AUTHORIZATIONS:
                    answer = http.request(
                        method, path, headers={"authorization": header}, content=b"\xff"
                    )
                    open_route = (method, path) in OPEN_ROUTES
                    assert answer.status_code == (200 if open_route else 401), (method, path)
            for name, body in RAW_BODIES.items():
                answer = http.post(
                    "/v1/lookup", headers={"authorization": "Bearer reader-token"}, content=body
                )
                assert answer.status_code == 400, (name, answer.text[:200])
    finally:
        running.stop()
