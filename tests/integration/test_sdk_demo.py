"""The remote demo runs end to end against a real server and cleans up after itself."""

from __future__ import annotations

import io

import pytest
from demo import RemoteDemoOptions, main, run_remote_demo

from kvcm.client import SchedulerClient, ServiceInvalidArgumentError


def test_remote_demo_replays_the_workload(kvcm_address: str) -> None:
    out = io.StringIO()
    report = run_remote_demo(
        RemoteDemoOptions(address=kvcm_address, pool_id="demo-test", num_requests=120), out=out
    )
    assert report.finished == 120
    assert report.rpcs >= report.steps > 0
    assert 0.5 < report.hit_rate <= 1.0  # shared system prompts and follow-ups hit
    assert report.blocks_stored > 0
    assert report.step_p50_ms > 0
    text = out.getvalue()
    assert "worker rank 1:" in text
    assert "hit rate" in text
    assert "summary" in text
    with SchedulerClient(kvcm_address) as client:
        assert "demo-test" not in {pool.pool_id for pool in client.list_pools()}


def test_failed_registration_still_removes_the_pool(kvcm_address: str) -> None:
    with pytest.raises(ServiceInvalidArgumentError, match="KV cache"):
        run_remote_demo(
            RemoteDemoOptions(address=kvcm_address, pool_id="demo-small", memory_mib=40),
            out=io.StringIO(),
        )
    with SchedulerClient(kvcm_address) as client:
        assert "demo-small" not in {pool.pool_id for pool in client.list_pools()}


def test_command_line(kvcm_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--remote", kvcm_address, "--pool", "demo-cli", "--requests", "20"]) == 0
    assert "requests finished   20" in capsys.readouterr().out
