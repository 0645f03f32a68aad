"""The README's demo: a shared-prefix workload through the core, deterministic per seed."""

from __future__ import annotations

import io

from demo import DemoOptions, run_demo, simulate


def test_demo_finishes_every_request_and_hits_the_shared_prefixes() -> None:
    options = DemoOptions(num_requests=60, num_blocks=256, seed=3)
    report = simulate(options)
    assert report.finished == 60
    assert 0 < report.hit_tokens <= report.queried_tokens
    # Shared system prompts make most prompt tokens hits once the cache is warm.
    assert report.hit_rate > 0.3
    assert 0.0 < report.peak_usage <= 1.0


def test_demo_is_deterministic_and_memory_pressure_evicts() -> None:
    small = DemoOptions(num_requests=80, num_blocks=96, seed=1)
    first, second = simulate(small), simulate(small)
    assert (first.hit_tokens, first.blocks_evicted, first.steps) == (
        second.hit_tokens,
        second.blocks_evicted,
        second.steps,
    )
    assert first.blocks_evicted > 0
    assert first.finished + first.rejected == 80


def test_demo_rejects_a_request_larger_than_the_pool_instead_of_looping() -> None:
    report = simulate(DemoOptions(num_requests=10, num_blocks=8, seed=2))
    assert report.rejected > 0
    assert report.finished + report.rejected == 10


def test_run_demo_prints_a_summary() -> None:
    out = io.StringIO()
    run_demo(DemoOptions(num_requests=20, num_blocks=128), out)
    text = out.getvalue()
    assert "hit rate" in text
    assert "20 finished" in text
