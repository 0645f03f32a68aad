"""The authorization table's decisions, the refusal audit's rate limit and the HTTP guard's
edges, without a server.

(tests/integration/test_auth.py checks the same table through a real server, call by call.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from fastapi.routing import APIRoute

from kvcm.core.pool import PoolRegistry
from kvcm.server.access import RULES, PoolFrom, RefusalLog, bearer_token, may_read, refusal
from kvcm.server.http import build_app
from kvcm.server.http._guard import check_routes
from kvcm.server.rpc import Principal
from kvcm.server.telemetry import RpcStats

RESYNC = RULES["/kvcm.v1.SchedulerService/ResyncPool"]
METRICS = RULES["GET /metrics"]


def test_resync_needs_admin_only_to_create() -> None:
    scheduler = Principal("engine-a", (("scheduler", "a-*"),))
    pool_admin = Principal("ops-a", (("admin", "a-*"),))
    assert refusal(scheduler, RESYNC, "a-0") is None
    reason = refusal(scheduler, RESYNC, "a-0", exists=False)
    assert reason is not None
    assert "admin" in reason
    assert "does not exist" in reason
    assert refusal(pool_admin, RESYNC, "a-0", exists=False) is None
    assert refusal(pool_admin, RESYNC, "b-0", exists=False) is not None


def test_metrics_need_a_server_wide_role() -> None:
    assert refusal(Principal("p", (("scrape", "*"),)), METRICS, "") is None
    assert refusal(Principal("ops", (("admin", "*"),)), METRICS, "") is None
    assert refusal(Principal("ops-a", (("admin", "a-*"),)), METRICS, "") is not None
    assert refusal(Principal("r", (("reader", "*"),)), METRICS, "") is not None


def test_every_rule_is_well_formed() -> None:
    for key, rule in RULES.items():
        assert key.startswith(("/kvcm.v1.", "GET ", "POST ", "HEAD ")), key
        if rule.pool is PoolFrom.PATH:
            assert "{pool}" in key, key
        if rule.pool is PoolFrom.REQUEST:
            assert key.startswith("/kvcm.v1."), key
        if rule.pool in (PoolFrom.REQUEST, PoolFrom.PATH, PoolFrom.SERVER):
            assert rule.roles, key


def test_reading_and_bearer_parsing() -> None:
    reader = Principal("r", (("reader", "a-*"), ("scrape", "*")))
    assert may_read(reader, "a-1")
    assert not may_read(reader, "b-1")
    assert may_read(None, "b-1")  # authentication off
    assert bearer_token("Bearer  abc ") == "abc"
    assert bearer_token("bearer abc") == "abc"
    assert bearer_token("Basic abc") == ""
    assert bearer_token("") == ""


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _refuse(log: RefusalLog, count: int) -> None:
    for index in range(count):
        log.refused(
            principal="",
            peer="127.0.0.1:1",
            method="GET /v1/pools",
            pool=f"p\n{index}",
            code="401",
            reason="no token",
        )


def test_refusals_are_rate_limited_and_the_rest_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvcm.audit")
    clock = _Clock()
    log = RefusalLog(rate_per_s=2.0, burst=3, clock=clock)
    _refuse(log, 10)  # 3 logged, 7 held back
    assert log.suppressed == 7
    clock.now += 1.0  # 2 tokens back: the count, then one line
    _refuse(log, 1)
    clock.now += 10.0
    _refuse(log, 1)
    events = [(vars(r)["event"], vars(r).get("suppressed")) for r in caplog.records]
    assert events == [
        *[("auth_refused", None)] * 3,
        ("auth_refusals_suppressed", 7),
        ("auth_refused", None),
        ("auth_refused", None),
    ]
    assert log.suppressed == 0
    for record in caplog.records:
        assert "\n" not in record.getMessage()  # a caller's newline cannot forge a line
        if vars(record)["event"] == "auth_refused":
            assert vars(record)["pool"].startswith("'p\\n")


def test_the_http_guard_closes_websockets_and_serves_probes() -> None:
    registry = PoolRegistry()
    app = build_app(registry, RpcStats(), lambda: True, authenticate=lambda token: None)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/metrics", "headers": [], "query_string": b""}
    asyncio.run(app(scope, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}]


def test_an_app_with_a_route_without_a_row_is_not_built() -> None:
    routes = [APIRoute("/v1/secret", endpoint=lambda: None, methods=["GET"])]
    with pytest.raises(RuntimeError, match="GET /v1/secret"):
        check_routes(routes)
