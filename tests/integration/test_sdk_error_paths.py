"""Failures through the real SDK: mapped exceptions (never grpc.RpcError), no state change,
deadlines, retries and exactly-once Steps."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvcm.client import (
    AsyncSchedulerClient,
    DeadlineExceededError,
    FreeMode,
    PoolConfig,
    RetryPolicy,
    SchedulerClient,
    ServiceAlreadyExistsError,
    ServiceError,
    ServiceFailedPreconditionError,
    ServiceInvalidArgumentError,
    ServiceNotFoundError,
    StatusCode,
    StepBuilder,
    UnavailableError,
    WorkerClient,
)
from kvcm.common import errors
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

BLOCK_SIZE = 16


def _spec() -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16
    )


def _config(num_blocks: int = 64) -> PoolConfig:
    layout = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=_spec()),),
    )
    return PoolConfig(max_model_len=1024, explicit_layout=layout)


@pytest.fixture
def client(kvcm_address: str) -> Iterator[SchedulerClient]:
    with SchedulerClient(kvcm_address, timeout=5.0) as client:
        yield client


@pytest.fixture
def pool(client: SchedulerClient, request: pytest.FixtureRequest) -> Iterator[str]:
    pool_id = f"errors-{request.node.name}".replace("[", "-").replace("]", "")[:100]
    client.create_pool(pool_id, _config())
    yield pool_id
    client.delete_pool(pool_id)


def _snapshot(client: SchedulerClient, pool_id: str, keys: list[int]) -> object:
    usage = client.get_usage(pool_id)
    return (
        usage.num_free_blocks,
        usage.num_requests,
        [client.get_block_ids(pool_id, key) for key in keys],
    )


def _admitted(client: SchedulerClient, pool_id: str, key: int, num_tokens: int = 40) -> list[int]:
    prompt = [key * 10_000 + i for i in range(num_tokens)]
    client.add_request(pool_id, key, prompt, client.block_hasher(pool_id).hash_token_ids(prompt))
    blocks = client.allocate_slots(pool_id, key, num_tokens, 0)
    assert blocks is not None
    return prompt


def test_unknown_pool_is_not_found_and_the_core_class(client: SchedulerClient) -> None:
    with pytest.raises(ServiceNotFoundError) as caught:
        client.get_usage("no-such-pool")
    error = caught.value
    assert isinstance(error, errors.NotFoundError)
    assert not isinstance(error, grpc.RpcError)
    assert isinstance(error.__cause__, grpc.RpcError)
    assert error.code is StatusCode.NOT_FOUND
    assert error.method == "GetUsage"
    assert "no-such-pool" in error.details


def test_taken_ids_are_already_exists(client: SchedulerClient, pool: str) -> None:
    with pytest.raises(ServiceAlreadyExistsError):
        client.create_pool(pool, _config())
    _admitted(client, pool, 1)
    before = _snapshot(client, pool, [1])
    with pytest.raises(errors.AlreadyExistsError):
        client.add_request(pool, 1, [1, 2, 3])
    assert _snapshot(client, pool, [1]) == before


def test_bad_arguments_are_invalid_argument_and_change_nothing(
    client: SchedulerClient, pool: str
) -> None:
    _admitted(client, pool, 1)
    before = _snapshot(client, pool, [1])
    with pytest.raises(ServiceInvalidArgumentError):
        client.add_request(pool, 2, [])  # empty prompt
    with pytest.raises(errors.InvalidArgumentError):
        client.allocate_slots(pool, 1, 1, 41)  # beyond the request's 40 tokens
    with pytest.raises(ServiceInvalidArgumentError):
        client.append_tokens(pool, 1, [])  # no tokens
    with pytest.raises(ServiceNotFoundError):
        client.allocate_slots(pool, 99, 1, 0)  # unknown key
    assert _snapshot(client, pool, [1]) == before


def test_rejected_step_names_the_op_and_changes_nothing(client: SchedulerClient, pool: str) -> None:
    _admitted(client, pool, 1)
    before = _snapshot(client, pool, [1])
    step = StepBuilder()
    step.append_tokens(1, [7])
    step.allocate(1, 1, 40)
    step.add_request(2, list(range(20)))
    step.allocate(2, 20, 0)
    step.allocate(1, 1, 99)  # op 4: beyond the request's 41 tokens
    with pytest.raises(ServiceInvalidArgumentError) as caught:
        client.step(pool, step)
    rejection = caught.value.rejection
    assert rejection is not None
    assert rejection.op_index == 4
    assert "alloc_num_computed_tokens" in rejection.field
    # The KVCMError attributes say the same, as an in-process core's rejection does.
    assert (caught.value.op_index, caught.value.field) == (4, rejection.field)
    assert _snapshot(client, pool, [1]) == before
    with pytest.raises(ServiceNotFoundError):
        client.get_block_ids(pool, 2)  # the ADD_REQUEST did not run either


def test_step_seq_makes_steps_exactly_once(client: SchedulerClient, pool: str) -> None:
    _admitted(client, pool, 1)
    step = StepBuilder(step_seq=1)
    step.append_tokens(1, list(range(100, 124)))
    step.allocate(1, 24, 40)
    first = client.step(pool, step)
    after_first = _snapshot(client, pool, [1])
    again = client.step(pool, step)  # a retry after a lost reply: answered, not run again
    assert again.blocks(0) == first.blocks(0)
    assert _snapshot(client, pool, [1]) == after_first
    with pytest.raises(ServiceFailedPreconditionError) as caught:
        client.step(pool, StepBuilder(step_seq=5))
    assert caught.value.code is StatusCode.FAILED_PRECONDITION


def test_free_of_an_unknown_key_is_not_found(client: SchedulerClient, pool: str) -> None:
    with pytest.raises(ServiceNotFoundError):
        client.free(pool, 1234, FreeMode.PREEMPTED)


def test_register_waits_until_its_deadline(client: SchedulerClient, kvcm_address: str) -> None:
    client.create_pool("errors-two-ranks", PoolConfig(max_model_len=1024, world_size=2))
    with WorkerClient(kvcm_address) as worker:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError) as caught:
            worker.register("errors-two-ranks", 0, 2, {"layer.0": _spec()}, 1 << 24, timeout=0.5)
        assert 0.4 < time.monotonic() - started < 5
        assert isinstance(caught.value, TimeoutError)
        assert caught.value.code is StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(ServiceFailedPreconditionError):
        client.get_usage("errors-two-ranks")  # not READY: one rank is missing
    client.delete_pool("errors-two-ranks")


def test_no_server_is_unavailable_after_retries() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with SchedulerClient(f"127.0.0.1:{port}", timeout=3.0) as client:
        started = time.monotonic()
        with pytest.raises(UnavailableError) as caught:
            client.list_pools()  # idempotent: retried by the channel first
        assert time.monotonic() - started < 3
        assert isinstance(caught.value, ConnectionError)
        with pytest.raises(ServiceError) as caught_step:
            client.step("p", StepBuilder(step_seq=1))  # retried by the SDK
        assert caught_step.value.code in {StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED}


def _unbound_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Dead replicas are redialled within tens of milliseconds (gRPC's default reconnect backoff
# starts at 1 s and grows), so that the test measures the SDK's retries, not the channel's.
_QUICK_REDIAL = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 100),
)


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("call", ["describe_pool", "step"])
def test_a_cluster_call_waits_within_its_deadline_for_a_replica(flavour: str, call: str) -> None:
    """A seed list whose every replica is down (a failover, a restart under way): an
    idempotent call (a read; a Step with a step_seq) backs off and starts over from the
    seeds until its deadline, instead of raising after its four reroutes; it is answered
    once a replica serves the pool, on the second seed (each new attempt moves through the
    seeds again). A non-idempotent call still raises at once (it may have run)."""
    first, second = _unbound_port(), _unbound_port()
    seeds = f"127.0.0.1:{first},127.0.0.1:{second}"
    policy = RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.1)
    options = {"timeout": 8.0, "retry_policy": policy, "channel_options": _QUICK_REDIAL}
    settings = ServerSettings(
        grpc_address=f"127.0.0.1:{second}", http_address="", log_level="ERROR"
    )
    started: list[EmbeddedServer] = []

    def replica_comes_up() -> None:
        time.sleep(1.0)
        server = start_embedded_server(settings)
        started.append(server)
        with SchedulerClient(server.grpc_address, timeout=5.0) as lone:
            lone.create_pool("waited", _config())

    def answered(client: SchedulerClient) -> object:
        if call == "step":
            return client.step("waited", StepBuilder(step_seq=1)).step_seq
        return client.describe_pool("waited").pool_id

    async def answered_async(client: AsyncSchedulerClient) -> object:
        if call == "step":
            return (await client.step("waited", StepBuilder(step_seq=1))).step_seq
        return (await client.describe_pool("waited")).pool_id

    with SchedulerClient(seeds, timeout=0.5) as hasty, pytest.raises(UnavailableError):
        hasty.create_pool("never", _config())  # not idempotent: no retry of its own
    thread = threading.Thread(target=replica_comes_up)
    begun = time.monotonic()
    thread.start()
    try:
        if flavour == "sync":
            with SchedulerClient(seeds, **options) as client:
                answer = answered(client)
        else:

            async def run() -> object:
                async with AsyncSchedulerClient(seeds, **options) as client:
                    return await answered_async(client)

            answer = asyncio.run(run())
        waited = time.monotonic() - begun
    finally:
        thread.join()
        for server in started:
            server.stop()
    assert answer == (1 if call == "step" else "waited")
    assert 1.0 <= waited < 8.0
    # Before, the call raised UnavailableError after four hops, in milliseconds.
    with SchedulerClient(seeds, timeout=1.0, retry_policy=policy) as client:
        begun = time.monotonic()
        # The replica is gone again: the deadline bounds the call (its last attempt may be
        # the one that runs out of it).
        with pytest.raises((UnavailableError, DeadlineExceededError)):
            client.describe_pool("waited")
        assert 0.5 < time.monotonic() - begun < 3.0


def test_every_call_has_a_deadline(client: SchedulerClient) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="timeout"):
        client.get_usage("any", timeout=0)
    with pytest.raises(errors.InvalidArgumentError, match="timeout"):
        SchedulerClient("127.0.0.1:1", timeout=-1.0)
    # A call the server holds open (a stream on a quiet pool) ends at its deadline.
    config = _config()
    client.create_pool(
        "errors-quiet",
        PoolConfig(
            max_model_len=config.max_model_len,
            explicit_layout=config.explicit_layout,
            enable_kv_cache_events=True,
        ),
    )
    started = time.monotonic()
    with (
        pytest.raises(DeadlineExceededError),
        client.subscribe_events("errors-quiet", timeout=0.5) as stream,
    ):
        for _ in stream:
            pass
    assert 0.4 < time.monotonic() - started < 5
    client.delete_pool("errors-quiet")


def test_async_client_maps_the_same_exceptions(kvcm_address: str, pool: str) -> None:
    async def scenario() -> None:
        async with AsyncSchedulerClient(kvcm_address) as client:
            with pytest.raises(ServiceNotFoundError):
                await client.get_usage("no-such-pool")
            with pytest.raises(ServiceAlreadyExistsError):
                await client.create_pool(pool, _config())
            step = StepBuilder()
            step.allocate(77, 1, 0)
            with pytest.raises(ServiceNotFoundError) as caught:
                await client.step(pool, step)
            assert caught.value.rejection is not None
            assert caught.value.rejection.op_index == 0
            with pytest.raises(errors.InvalidArgumentError, match="timeout"):
                await client.get_usage(pool, timeout=-1)
            config = _config()
            await client.create_pool(
                "errors-quiet-async",
                PoolConfig(
                    max_model_len=config.max_model_len,
                    explicit_layout=config.explicit_layout,
                    enable_kv_cache_events=True,
                ),
            )
            with pytest.raises(DeadlineExceededError):
                async for _ in client.subscribe_events("errors-quiet-async", timeout=0.5):
                    pass
            await client.delete_pool("errors-quiet-async")

    asyncio.run(scenario())


def test_threads_sharing_a_cluster_client_move_the_seed_once(kvcm_address: str) -> None:
    """Calls from 16 threads sharing one client, whose first seed is down, fail there at
    once: the seed moves once (to the one that answers, not back and forth between the two),
    each seed's channel is opened once, and the client's seed and stubs agree."""
    dead = f"127.0.0.1:{_unbound_port()}"
    with SchedulerClient(kvcm_address, timeout=5.0) as lone:
        lone.create_pool("shared-seeds", _config())
    opened: list[str] = []
    try:
        with SchedulerClient(f"{dead},{kvcm_address}", timeout=5.0) as client:
            open_channel = client._open_channel

            def counted(target: str, metadata: object) -> object:
                opened.append(target)
                return open_channel(target, metadata)  # type: ignore[arg-type]

            client._open_channel = counted  # type: ignore[method-assign]
            rerouted = client._rerouted
            moves: list[tuple[int, int]] = []

            def recorded(*args: object) -> bool:
                before = client._seed
                again = rerouted(*args)  # type: ignore[arg-type]
                moves.append((before, client._seed))
                return again

            client._rerouted = recorded  # type: ignore[method-assign]
            barrier = threading.Barrier(16)
            answers: list[str] = []

            def call() -> None:
                barrier.wait()
                answers.append(client.describe_pool("shared-seeds").pool_id)

            threads = [threading.Thread(target=call) for _ in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert answers == ["shared-seeds"] * 16
            # Each call failed once on the dead seed; the first failure moved the seed, the
            # other 15 found it moved (before, each moved it again: 0 -> 1 -> 0 ..., 31 hops).
            assert len(moves) == 16
            assert [move for move in moves if move[0] != move[1]] == [(0, 1)]
            assert opened == [kvcm_address]  # the first seed's channel was opened up front
            assert client._seeds[client._seed] == kvcm_address
            assert client._stubs is client._replicas[kvcm_address][1]
    finally:
        with SchedulerClient(kvcm_address, timeout=5.0) as lone:
            lone.delete_pool("shared-seeds")
