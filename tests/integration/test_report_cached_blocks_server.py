"""report_cached_blocks (vLLM's kv_cache_report_mode="full") through a real server and the SDK.

The Step program's ADD_REQUEST and the unary AddRequest carry the flag; the server's pool then
publishes the hits of such requests as BlockStored events, equal to an in-process core's for
the same calls (the unary GetComputedBlocks publishes them too). RemoteKVCacheManager sends
each request's mode (vLLM's attribute, else kvcm's flag). A flag that is not a bool is refused
by the SDK, naming the field, before anything travels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _data_dir_server import CONFIG as DATA_DIR_CONFIG
from _data_dir_server import HASHER as DATA_DIR_HASHER
from _data_dir_server import Server

from kvcm.client import PoolConfig, RemoteKVCacheManager, SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.events import BlockStored, KVCacheEvent
from kvcm.common.specs import FullAttentionSpec
from kvcm.core import KVCacheManager, KVCacheManagerConfig, Request
from kvcm.core.program import NewRequestSpec, OpKind, StepProgram
from kvcm.wire import program_from_proto, program_to_proto

BS = 16
LAYOUT = KVCacheConfig(
    num_blocks=24,
    kv_cache_tensors=(),
    kv_cache_groups=(
        KVCacheGroupSpec(
            layer_names=("layer.0",),
            kv_cache_spec=FullAttentionSpec(
                block_size=BS, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16
            ),
        ),
    ),
)
PROMPT = list(range(100, 150))  # three full blocks and a partial one


def _view(event: KVCacheEvent) -> tuple[object, ...]:
    if isinstance(event, BlockStored):
        return ("stored", tuple(event.block_hashes), event.parent_block_hash,
                tuple(event.token_ids), event.block_size, event.group_idx)  # fmt: skip
    return (type(event).__name__,)


def _events(client: SchedulerClient, pool_id: str, after: int) -> list[KVCacheEvent]:
    last = client.describe_pool(pool_id).last_event_sequence
    events: list[KVCacheEvent] = []
    if last <= after:
        return events
    with client.subscribe_events(pool_id, start_sequence=after + 1) as stream:
        for batch in stream:
            events.extend(batch.events)
            if len(events) >= last - after:
                break
    return events


def _create_pool(client: SchedulerClient, pool_id: str) -> None:
    """A pool of LAYOUT whose events are on (reports need them)."""
    client.create_pool(
        pool_id,
        PoolConfig(
            max_model_len=1024,
            explicit_layout=LAYOUT,
            hash_algorithm="sha256_cbor",
            enable_kv_cache_events=True,
        ),
    )


def test_step_and_unary_adds_report_hits_as_the_core_does(client: SchedulerClient) -> None:
    pool_id = "report-cached"
    _create_pool(client, pool_id)
    hasher = client.block_hasher(pool_id)
    hashes = hasher.hash_token_ids(PROMPT)
    # Key 0 computes the prompt and finishes (its full blocks stay cached); keys 1 and 2 (a
    # Step add, reported and not) and 3 (a unary add, reported) look it up.
    warm = StepBuilder()
    warm.add_request(0, PROMPT, hashes)
    warm.allocate(0, len(PROMPT), 0, lookup=True)
    warm.finish(0)
    client.step(pool_id, warm)
    start = client.describe_pool(pool_id).last_event_sequence
    step = StepBuilder()
    step.add_request(1, PROMPT, hashes, report_cached_blocks=True)
    step.allocate(1, len(PROMPT), 0, lookup=True)
    step.add_request(2, PROMPT, hashes)
    step.allocate(2, len(PROMPT), 0, lookup=True)
    client.step(pool_id, step)
    client.add_request(pool_id, 3, PROMPT, hashes, report_cached_blocks=True)
    assert client.get_computed_blocks(pool_id, 3).num_computed_tokens == 3 * BS
    served = _events(client, pool_id, start)

    manager = KVCacheManager(
        KVCacheManagerConfig(
            kv_cache_config=LAYOUT, max_model_len=1024, enable_kv_cache_events=True
        )
    )
    first = Request("0", PROMPT, block_hasher=hasher)
    hit = manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, len(PROMPT), hit) is not None
    manager.free(first)
    manager.take_events()
    for key, report in ((1, True), (2, False)):
        request = Request(str(key), PROMPT, block_hasher=hasher, report_cached_blocks=report)
        hit = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, len(PROMPT) - 48, hit) is not None
    manager.get_computed_blocks(
        Request("3", PROMPT, block_hasher=hasher, report_cached_blocks=True)
    )
    expected = manager.take_events()
    assert [_view(e) for e in served] == [_view(e) for e in expected]
    stored = ("stored", tuple(hashes[:3]), None, tuple(PROMPT[: 3 * BS]), BS, 0)
    assert [_view(e) for e in served] == [stored, stored]  # keys 1 and 3; key 2 is not reported
    client.delete_pool(pool_id)


def test_a_flag_that_is_not_a_bool_is_refused_before_it_travels(client: SchedulerClient) -> None:
    with pytest.raises(InvalidArgumentError, match="report_cached_blocks must be a bool") as e:
        StepBuilder().add_request(1, PROMPT, report_cached_blocks=1)  # type: ignore[arg-type]
    assert e.value.field == "report_cached_blocks"
    with pytest.raises(InvalidArgumentError, match="report_cached_blocks must be a bool") as e:
        client.add_request("no-such-pool", 1, PROMPT, report_cached_blocks="full")  # type: ignore[arg-type]
    assert e.value.field == "report_cached_blocks"


@pytest.mark.parametrize("report", [False, True])
def test_the_flag_round_trips_through_the_wire(report: bool) -> None:
    program = StepProgram(
        ops=[OpKind.ADD_REQUEST],
        new_requests=[
            NewRequestSpec(
                key=7, request_id="r7", prompt_token_ids=[1, 2, 3], report_cached_blocks=report
            )
        ],
    )
    message = program_to_proto(program, "p")
    assert message.new_requests[0].report_cached_blocks is report
    assert program_from_proto(message).new_requests[0].report_cached_blocks is report


class _VllmLikeRequest(Request):
    """A request as vLLM's carries the mode: ``kv_cache_report_mode`` from extra_args."""

    __slots__ = ("kv_cache_report_mode",)


def test_the_remote_manager_sends_the_mode_of_each_request(client: SchedulerClient) -> None:
    pool_id = "report-cached-remote"
    _create_pool(client, pool_id)
    with RemoteKVCacheManager(client, pool_id) as remote:
        hasher = remote.block_hasher
        warm = Request("warm", PROMPT, block_hasher=hasher)
        hit = remote.get_computed_blocks(warm)
        assert remote.allocate_slots(warm, len(PROMPT), hit) is not None
        remote.free(warm)
        remote.take_events()
        mode_full = _VllmLikeRequest("vllm-full", PROMPT, block_hasher=hasher)
        mode_full.kv_cache_report_mode = "full"
        mode_other = _VllmLikeRequest("vllm-other", PROMPT, block_hasher=hasher)
        mode_other.kv_cache_report_mode = "incremental"
        flagged = Request("kvcm", PROMPT, block_hasher=hasher, report_cached_blocks=True)
        for request in (mode_full, mode_other, flagged):
            assert remote.get_computed_blocks(request).num_computed_tokens == 3 * BS
        stored = ("stored", tuple(hasher.hash_token_ids(PROMPT)[:3]), None,
                  tuple(PROMPT[: 3 * BS]), BS, 0)  # fmt: skip
        assert [_view(e) for e in remote.take_events()] == [stored, stored]
    client.delete_pool(pool_id)


def test_reported_hits_come_back_alike_after_a_crash(tmp_path: Path) -> None:
    """The journal replays the calls that reported hits: the event log after a kill -9 and a
    restart is the one the clients saw (same events, same sequence numbers)."""
    server = Server(tmp_path / "data")
    server.start()
    try:
        with SchedulerClient(server.address, timeout=10.0) as client:
            client.create_pool("p", DATA_DIR_CONFIG)
            hashes = DATA_DIR_HASHER.hash_token_ids(PROMPT)
            warm = StepBuilder()
            warm.add_request(0, PROMPT, hashes)
            warm.allocate(0, len(PROMPT), 0, lookup=True)
            warm.finish(0)
            client.step("p", warm)
            step = StepBuilder()
            step.add_request(1, PROMPT, hashes, report_cached_blocks=True)
            step.allocate(1, len(PROMPT), 0, lookup=True)
            client.step("p", step)
            client.add_request("p", 2, PROMPT, hashes, report_cached_blocks=True)
            client.get_computed_blocks("p", 2)
            before = [_view(e) for e in _events(client, "p", 0)]
        assert [v[0] for v in before].count("stored") == 3  # the warm store, two reports
        server.kill()
        server.start()
        with SchedulerClient(server.address, timeout=10.0) as client:
            assert [_view(e) for e in _events(client, "p", 0)] == before
    finally:
        server.stop()


def test_a_report_hit_step_publishes_the_lookups_report_and_a_bad_one_names_its_entry(
    client: SchedulerClient,
) -> None:
    """REPORT_HIT over gRPC (what a mirrored vLLM engine sends where its own lookup reported)
    publishes what the pool's own lookup of the request publishes; a count list that is not
    one per group is INVALID_ARGUMENT naming the entry, and nothing is published."""
    pool_id = "report-hit-op"
    _create_pool(client, pool_id)
    hashes = client.block_hasher(pool_id).hash_token_ids(PROMPT)
    warm = StepBuilder()
    warm.add_request(0, PROMPT, hashes)
    warm.allocate(0, len(PROMPT), 0, lookup=True)
    warm.finish(0)
    client.step(pool_id, warm)
    client.add_request(pool_id, 1, PROMPT, hashes, report_cached_blocks=True)
    start = client.describe_pool(pool_id).last_event_sequence
    assert client.get_computed_blocks(pool_id, 1).num_computed_tokens == 3 * BS
    looked_up = _events(client, pool_id, start)
    assert len(looked_up) == 1
    start = client.describe_pool(pool_id).last_event_sequence
    report = StepProgram(
        ops=[OpKind.REPORT_HIT],
        request_keys=[1],
        report_hit_num_groups=[1],
        report_hit_num_blocks=[3],
    )
    client.step(pool_id, report)
    assert [_view(e) for e in _events(client, pool_id, start)] == [_view(e) for e in looked_up]
    start = client.describe_pool(pool_id).last_event_sequence
    bad = StepProgram(
        ops=[OpKind.REPORT_HIT],
        request_keys=[1],
        report_hit_num_groups=[2],
        report_hit_num_blocks=[3, 3],
    )
    with pytest.raises(InvalidArgumentError, match=r"report_hit_num_groups\[0\]") as refused:
        client.step(pool_id, bad)
    assert refused.value.field == "report_hit_num_groups[0]"
    assert client.describe_pool(pool_id).last_event_sequence == start
    client.delete_pool(pool_id)
