"""examples/router.py: the reference router runs against a real server and its ZMQ stream.

The simulation is deterministic for the exact router (one client, sequential calls), so its
figures are checked: lookup predicts every hit it routes on exactly, and routing by it serves
far more prompt tokens from cache than round-robin.
"""

from __future__ import annotations

import pytest
from router import main


def test_router_example_routes_by_exact_hits(capsys: pytest.CaptureFixture[str]) -> None:
    results = main(["--requests", "160", "--engines", "3", "--blocks", "256"])
    out = capsys.readouterr().out
    assert "kvcm-lookup" in out
    assert "event-index" in out
    exact = results["kvcm-lookup"]
    round_robin = results["round-robin"]
    assert exact.requests == round_robin.requests == 160
    assert exact.prompt_tokens == round_robin.prompt_tokens
    assert exact.mispredicted == 0  # the hit Lookup promised is the hit the engine got
    assert exact.hit_tokens > 1.3 * round_robin.hit_tokens
    # The event-fed index saw the stream (vLLM's wire) and routed on it.
    assert results["event-index"].hit_tokens > round_robin.hit_tokens
