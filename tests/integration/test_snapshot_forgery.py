"""Forged snapshots against a real server: a snapshot is checked like a Step.

A tenant with a scheduler token can upload any bytes to ``ResyncPool``. Hypothesis forges
snapshots from a real pool's (``_fuzz.snapshots``: every field of the format edited with a
hostile value, or a damaged encoding, behind a recomputed CRC) and uploads them through the
real SDK to a server on 127.0.0.1. Each upload must be either

* refused with INVALID_ARGUMENT (never INTERNAL), leaving every pool byte-identical, or
* accepted, and then the served pool is the in-process ``decode_pool`` of the same bytes, and
  every later Step program answers exactly as that in-process replay does (same outcome or
  same error class, same state after it);

and in both cases a bystander pool is untouched and ``GET /metrics`` and ``GET /v1/pools``
answer 200 with every pool in them. ``KVCM_FORGERY_EXAMPLES`` sets the budget (CI: small).
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from _fuzz.snapshots import NAMED_FORGERIES, draw_forgery
from _fuzz.state import registry_state, untimed_fingerprint
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcm.client import (
    SchedulerClient,
    ServiceError,
    ServiceInvalidArgumentError,
    StepBuilder,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCMError,
    NotFoundError,
    ResourceExhaustedError,
)
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec, SlidingWindowSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.core.snapshot import decode_pool, encode_pool
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

_EXAMPLES = int(os.environ.get("KVCM_FORGERY_EXAMPLES", "40"))
_FULL = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
_WINDOW = SlidingWindowSpec(
    block_size=4, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16, sliding_window=8
)
CONFIG = PoolConfig(
    max_model_len=64,
    hash_seed="forge",
    enable_kv_cache_events=True,
    explicit_layout=KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=(),
        kv_cache_groups=(
            KVCacheGroupSpec(layer_names=("full",), kv_cache_spec=_FULL),
            KVCacheGroupSpec(layer_names=("window",), kv_cache_spec=_WINDOW),
        ),
    ),
)
HASHER = BlockHasher(4, CONFIG.hash_algorithm, "forge")
_FAMILIES = (
    InvalidArgumentError,
    NotFoundError,
    AlreadyExistsError,
    FailedPreconditionError,
    ResourceExhaustedError,
)
_counter = iter(range(10**9))


def _family(error: BaseException) -> type | None:
    return next((cls for cls in _FAMILIES if isinstance(error, cls)), None)


def _warm_up() -> list[StepBuilder]:
    """Programs that leave requests running, cached blocks free and events published."""
    first = StepBuilder()
    first.add_request(1, list(range(13)), HASHER.hash_token_ids(list(range(13))))
    first.allocate(1, 13, 0)
    first.add_request(2, [5] * 9, HASHER.hash_token_ids([5] * 9))
    first.allocate(2, 9, 0)
    second = StepBuilder()
    second.cache_blocks(1, 12)
    second.finish(2)
    second.add_request(3, [1, 2, 3, 4, 5], HASHER.hash_token_ids([1, 2, 3, 4, 5]))
    return [first, second]


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    """A server of this module's own (every pool of it is read directly)."""
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", log_level="CRITICAL")
    )
    try:
        yield running
    finally:
        running.stop(grace_s=0.5)


@pytest.fixture(scope="module")
def client(server: EmbeddedServer) -> Iterator[SchedulerClient]:
    """The real SDK over gRPC, with a bystander pool that has state of its own."""
    with SchedulerClient(server.grpc_address) as sdk:
        sdk.create_pool("bystander", CONFIG)
        for program in _warm_up():
            sdk.step("bystander", program)
        yield sdk


def _states(server: EmbeddedServer) -> dict[str, bytes]:
    registry = server.server.state.registry

    async def read() -> dict[str, bytes]:
        return registry_state(registry)

    return server.call(read())


def _served(server: EmbeddedServer, pool_id: str) -> bytes:
    pool = server.server.state.registry.get(pool_id)

    async def read() -> bytes:
        return untimed_fingerprint(pool)

    return server.call(read())


def _get(server: EmbeddedServer, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://{server.http_address}{path}", timeout=10) as answer:
        return answer.status, answer.read()


def _check_http(server: EmbeddedServer, pools: set[str]) -> None:
    """/metrics and /v1/pools answer 200 and show every pool."""
    status, body = _get(server, "/metrics")
    assert status == 200
    for pool_id in pools:
        assert f'kvcm_blocks{{pool="{pool_id}"}}'.encode() in body
    status, body = _get(server, "/v1/pools")
    assert status == 200
    assert pools <= {summary["name"] for summary in json.loads(body)["pools"]}


def _draw_program(data: st.DataObject, pool: Pool, step_seq: int) -> StepBuilder:
    """One to three ops on the pool's requests (most valid, some out of range)."""
    program = StepBuilder()
    program.step_seq = step_seq
    keys = sorted(pool.requests) or [0]
    for _ in range(data.draw(st.integers(1, 3), label="ops")):
        key = data.draw(st.sampled_from([*keys, 4, 2**64 - 1]), label="key")
        request = pool.requests.get(key)
        num_tokens = 0 if request is None else request.num_tokens
        op = data.draw(
            st.sampled_from(
                ["allocate", "append", "cache", "skip", "preempt", "finish", "add", "evict",
                 "reset", "new_step", "record"]
            ),
            label="op",
        )  # fmt: skip
        count = data.draw(st.integers(-1, num_tokens + 6), label="count")
        if op == "allocate":
            program.allocate(key, max(count, 1), min(max(num_tokens - 1, 0), 60))
        elif op == "append":
            tokens = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=6), label="t")
            hashes: list[bytes] = []
            if request is not None and len(request.block_hashes) == num_tokens // 4:
                every = HASHER.hash_token_ids(request.all_token_ids + tokens)
                hashes = list(every[len(request.block_hashes) :])
            program.append_tokens(key, tokens, hashes)
        elif op == "cache":
            program.cache_blocks(key, max(count, 0))
        elif op == "skip":
            program.remove_skipped_blocks(key, max(count, 0))
        elif op == "preempt":
            program.preempt(key)
        elif op == "finish":
            program.finish(key)
        elif op == "add":
            tokens = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=20), label="p")
            key = max(keys) + data.draw(st.integers(0, 2), label="new key")  # maybe live
            program.add_request(key, tokens, HASHER.hash_token_ids(tokens))
        elif op == "evict":
            program.evict_blocks(data.draw(st.lists(st.integers(1, 15), max_size=3), label="e"))
        elif op == "reset":
            program.reset_prefix_cache()
        elif op == "new_step":
            program.new_step_starts()
        else:
            program.record_prefix_stats(key, max(count, 0))
    return program


def _run_both(
    client: SchedulerClient, pool_id: str, replay: Pool, program: StepBuilder
) -> tuple[Any, Any]:
    """The served answer and the in-process one (an outcome or an error)."""
    try:
        served: Any = client.step(pool_id, program).outcome
    except ServiceError as exc:
        served = exc
    try:
        expected: Any = replay.run_step(program.program)
    except KVCMError as exc:
        expected = exc
    replay.publish_events(0.0)
    return served, expected


@settings(
    max_examples=_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
@given(data=st.data())
def test_a_forged_snapshot_is_refused_or_behaves_as_its_replay(
    server: EmbeddedServer, client: SchedulerClient, data: st.DataObject
) -> None:
    pool_id = f"victim{next(_counter)}"
    local = Pool(pool_id, CONFIG)
    client.create_pool(pool_id, CONFIG)
    for program in _warm_up():
        client.step(pool_id, program)
        local.run_step(program.program)
        local.publish_events(0.0)
    try:
        forged, how = draw_forgery(data, encode_pool(local))
        step_seq = data.draw(st.integers(0, 5), label="step_seq")
        before = _states(server)
        refusal: ServiceError | None = None
        try:
            client.resync_pool(pool_id, forged, CONFIG, step_seq=step_seq)
        except ServiceError as exc:
            refusal = exc
        if refusal is not None:
            event("refused")
            assert isinstance(refusal, ServiceInvalidArgumentError), (how, refusal)
            assert _states(server) == before, f"a refused upload changed a pool ({how})"
            with pytest.raises(InvalidArgumentError):
                decode_pool(forged, pool_id, CONFIG)
            _check_http(server, {"bystander", pool_id})
            return
        event("accepted")
        after = _states(server)
        assert {k: v for k, v in after.items() if k != pool_id} == {
            k: v for k, v in before.items() if k != pool_id
        }, f"an accepted upload changed another pool ({how})"
        replay = decode_pool(forged, pool_id, CONFIG)
        replay.last_step_seq, replay.last_step_outcome = step_seq, None
        assert _served(server, pool_id) == untimed_fingerprint(replay), how
        _check_http(server, {"bystander", pool_id})
        replay.snapshot()  # the scrapes drained the served pool's statistics
        for index in range(data.draw(st.integers(1, 4), label="programs")):
            program = _draw_program(data, replay, replay.last_step_seq + 1)
            served, expected = _run_both(client, pool_id, replay, program)
            if isinstance(expected, KVCMError):
                assert isinstance(served, ServiceError), (how, index, expected, served)
                assert _family(served) is _family(expected), (how, index, served, expected)
            else:
                assert not isinstance(served, ServiceError), (how, index, served)
                assert served == expected, (how, index)
            assert _served(server, pool_id) == untimed_fingerprint(replay), (how, index)
        assert _states(server)["bystander"] == before["bystander"]
        _check_http(server, {"bystander", pool_id})
    finally:
        client.delete_pool(pool_id)


def test_the_issue_s_forgeries_are_refused_and_leave_every_pool(
    server: EmbeddedServer, client: SchedulerClient
) -> None:
    """The reported ones, by name: each is INVALID_ARGUMENT naming where, nothing changes."""
    pool_id = "named-victim"
    local = Pool(pool_id, CONFIG)
    client.create_pool(pool_id, CONFIG)
    for program in _warm_up():
        client.step(pool_id, program)
        local.run_step(program.program)
        local.publish_events(0.0)
    try:
        snapshot = encode_pool(local)
        for name, (forge, where) in NAMED_FORGERIES.items():
            before = _states(server)
            with pytest.raises(ServiceInvalidArgumentError) as caught:
                client.resync_pool(pool_id, forge(snapshot), CONFIG, step_seq=2)
            assert where in str(caught.value), (name, str(caught.value))
            assert _states(server) == before, name
        _check_http(server, {"bystander", pool_id})
        # The pool still answers its scheduler as before.
        program = StepBuilder()
        program.allocate(1, 1, 12)
        served, expected = _run_both(client, pool_id, local, program)
        assert served == expected
    finally:
        client.delete_pool(pool_id)
