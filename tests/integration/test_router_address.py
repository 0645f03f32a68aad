"""examples/router.py pointed at a running server (``--address``), with and without its ZMQ
stream: the routers run on that server's pools, read the stream DescribePool names, and leave
no pool behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from router import main

from kvcm.client import SchedulerClient
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

ARGS = ["--requests", "60", "--engines", "2", "--blocks", "256", "--pool-prefix", "ext-"]


@pytest.fixture(params=["zmq", "no-zmq"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[EmbeddedServer, bool]]:
    settings = ServerSettings(
        grpc_address="127.0.0.1:0",
        http_address="",
        log_level="WARNING",
        kv_events_endpoint="tcp://*:0" if request.param == "zmq" else "",
    )
    running = start_embedded_server(settings)
    try:
        yield running, request.param == "zmq"
    finally:
        running.stop()


def test_the_router_runs_against_a_running_server(
    server: tuple[EmbeddedServer, bool], capsys: pytest.CaptureFixture[str]
) -> None:
    running, publishes = server
    results = main(["--address", running.grpc_address, *ARGS])
    out = capsys.readouterr().out
    exact, round_robin = results["kvcm-lookup"], results["round-robin"]
    assert exact.requests == round_robin.requests == 60
    assert exact.mispredicted == 0
    assert exact.hit_tokens > round_robin.hit_tokens
    if publishes:
        assert results["event-index"].requests == 60
        assert "event-lossy missed" in out
    else:
        assert "event-index" not in results
        assert "the event routers were left out" in out
    with SchedulerClient(running.grpc_address) as client:
        assert client.list_pools() == []
