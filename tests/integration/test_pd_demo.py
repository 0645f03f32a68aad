"""``python examples/demo.py --pd``: both policies over real engines, faults, no leak."""

from __future__ import annotations

import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from pd_demo import PdDemoOptions, run_pd_demo

from kvcm.server.embedded import start_embedded_server
from kvcm.server.settings import ServerSettings


def test_the_pd_demo_pulls_less_with_kvcm_and_leaks_nothing() -> None:
    options = PdDemoOptions(
        conversations=5,
        turns=3,
        system_tokens=128,
        max_tokens=8,
        never_pull_every=4,
        die_after=0.67,
        transfer_lease_s=2.0,
        kv_lease_s=3.0,  # generous: a loaded CI machine must not expire sources mid-run
        decoder_ttl_s=6.0,  # longer than a turn takes on a loaded machine
        prefill_blocks=48,  # the prefill engine forgets histories the decode engines hold
        concurrency=1,  # arrivals in a fixed order: the comparison is deterministic
    )
    settings = ServerSettings(
        grpc_address="127.0.0.1:0",
        http_address="",
        log_level="WARNING",
        transfer_lease_s=options.transfer_lease_s,
    )
    out = io.StringIO()
    with start_embedded_server(settings) as server:
        kvcm, bidirectional, round_robin = run_pd_demo(server.grpc_address, options, out)
    for report in (kvcm, bidirectional, round_robin):
        assert report.requests == 15
        assert report.failed == 0  # abandoned pulls and the dead engine are failed over
        assert report.leaked_blocks == 0
        assert report.leaked_requests == 0
        assert report.pulled_tokens + report.decode_hit_tokens <= report.prompt_tokens
    assert kvcm.abandoned + round_robin.abandoned >= 1
    assert kvcm.pulled_tokens < round_robin.pulled_tokens
    # Bidirectional: the prefill engine pulls histories the decode engines hold instead of
    # computing them.
    assert bidirectional.prefill_pulled_tokens > 0
    assert bidirectional.prefill_computed_tokens < kvcm.prefill_computed_tokens
    assert kvcm.route_p50_ms > 0
    assert "leaked blocks" in out.getvalue()
