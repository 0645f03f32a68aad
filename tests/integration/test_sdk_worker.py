"""Workers register concurrently through the real SDK, receive one unified config, allocate CPU
tensors from it, and re-registering behaves as the contract says."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping

import grpc
import pytest
import torch

from kvcm.client import (
    DeadlineExceededError,
    PoolConfig,
    PoolState,
    SchedulerClient,
    ServiceAlreadyExistsError,
    ServiceInvalidArgumentError,
    ServiceResourceExhaustedError,
    WorkerClient,
    WorkerRegistration,
)
from kvcm.common.dtypes import DType
from kvcm.common.errors import AlreadyExistsError, InvalidArgumentError
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from kvcm.core.limits import Limits
from kvcm.server.embedded import start_embedded_server
from kvcm.server.settings import ServerSettings
from kvcm.v1 import service_pb2_grpc, worker_pb2
from kvcm.wire import layer_specs_to_proto

MIB = 1024 * 1024
ATTENTION = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": DType.BFLOAT16}


def _full_attention_specs() -> dict[str, KVCacheSpec]:
    spec = FullAttentionSpec(**ATTENTION)  # type: ignore[arg-type]
    return {f"model.layers.{i}.attn": spec for i in range(4)}


def _hybrid_specs() -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(**ATTENTION)  # type: ignore[arg-type]
    window = SlidingWindowSpec(**ATTENTION, sliding_window=128)  # type: ignore[arg-type]
    return {f"model.layers.{i}.attn": full if i % 2 else window for i in range(4)}


def _register_concurrently(
    address: str, pool_id: str, specs: Mapping[str, KVCacheSpec], memory: list[int]
) -> list[WorkerRegistration]:
    results: dict[int, WorkerRegistration] = {}
    failures: list[BaseException] = []
    barrier = threading.Barrier(len(memory))

    def rank(index: int) -> None:
        try:
            with WorkerClient(address, timeout=30.0) as worker:
                barrier.wait()
                results[index] = worker.register(pool_id, index, len(memory), specs, memory[index])
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(memory))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures, failures
    return [results[index] for index in range(len(memory))]


@pytest.mark.parametrize(
    "specs", [_full_attention_specs(), _hybrid_specs()], ids=["full-attention", "hybrid"]
)
def test_two_ranks_get_one_config_and_allocate_cpu_tensors(
    client: SchedulerClient, kvcm_address: str, specs: dict[str, KVCacheSpec]
) -> None:
    pool_id = f"workers-{len(set(map(type, specs.values())))}"
    client.create_pool(pool_id, PoolConfig(max_model_len=2048, world_size=2))
    assert client.describe_pool(pool_id).state is PoolState.PENDING_WORKERS
    memory = [64 * MIB, 48 * MIB]
    first, second = _register_concurrently(kvcm_address, pool_id, specs, memory)

    # One unified config: same groups, same block count, and (same specs) the same tensors.
    assert first.kv_cache_config == second.kv_cache_config
    assert first.hashing == second.hashing
    assert first.max_model_len == second.max_model_len == 2048
    config = first.kv_cache_config
    layers = {name for group in config.kv_cache_groups for name in group.layer_names}
    assert layers == set(specs)
    # The smaller rank decides: its memory holds every block of every layer of its tensors.
    buffer_bytes = max(tensor.size for tensor in config.kv_cache_tensors)
    assert buffer_bytes <= memory[1]
    bytes_per_block = buffer_bytes // config.num_blocks
    assert config.num_blocks > (memory[1] // bytes_per_block) * 0.9

    info = client.describe_pool(pool_id)
    assert info.state is PoolState.READY
    assert info.registered_ranks == (0, 1)
    assert info.hashing == first.hashing
    assert info.kv_cache_config is not None
    assert info.kv_cache_config.num_blocks == config.num_blocks
    assert info.kv_cache_config.kv_cache_groups == config.kv_cache_groups

    with WorkerClient(kvcm_address) as worker:
        for registration in (first, second):
            tensors = worker.allocate(registration, device="cpu")
            assert set(tensors) == set(specs)
            storages = {tensor.untyped_storage().data_ptr() for tensor in tensors.values()}
            assert len(storages) == 1  # one backing allocation per rank
            for name, tensor in tensors.items():
                spec = specs[name]
                assert tensor.device.type == "cpu"
                assert tensor.dtype == torch.bfloat16
                assert tensor.shape[0] == config.num_blocks
                assert tensor.numel() * tensor.element_size() == (
                    config.num_blocks * spec.page_size_bytes
                )
                tensor[1].fill_(1.0)  # every block is addressable
        # Same rank, same specs and memory again: the same answer, at once.
        again = worker.register(pool_id, 1, 2, specs, memory[1], timeout=5.0)
        assert again == second
        # Same rank, other memory: a different registration.
        with pytest.raises(ServiceAlreadyExistsError) as caught:
            worker.register(pool_id, 1, 2, specs, memory[1] // 2, timeout=5.0)
        assert isinstance(caught.value, AlreadyExistsError)
    client.delete_pool(pool_id)


# ----------------------------------------------------------------------------- layer order
def test_the_server_plans_in_the_callers_layer_order(
    client: SchedulerClient, kvcm_address: str
) -> None:
    """model.layers.2 comes before model.layers.10, as in the model runner (never sorted)."""
    full = FullAttentionSpec(**ATTENTION)  # type: ignore[arg-type]
    window = SlidingWindowSpec(**ATTENTION, sliding_window=128)  # type: ignore[arg-type]
    # Gemma-3's pattern: 5 local layers, then 1 global.
    specs: dict[str, KVCacheSpec] = {
        f"model.layers.{i}.self_attn.attn": full if i % 6 == 5 else window for i in range(12)
    }
    client.create_pool("ordered", PoolConfig(max_model_len=1024, world_size=1))
    with WorkerClient(kvcm_address, timeout=10.0) as worker:
        registration = worker.register("ordered", 0, 1, specs, 64 * MIB)
    config = registration.kv_cache_config
    order = list(specs)
    for group in config.kv_cache_groups:
        assert list(group.layer_names) == sorted(group.layer_names, key=order.index)
    placed = [name for tensor in config.kv_cache_tensors for name in tensor.layers]
    assert config.kv_cache_groups[0].layer_names[:2] == (order[0], order[6])
    assert sorted(placed, key=order.index) != sorted(placed)  # the check would see a sort
    client.delete_pool("ordered")


# ----------------------------------------------------------------------------- failures
def _start(
    register: Callable[[], WorkerRegistration], failures: list[BaseException]
) -> Callable[[], None]:
    def run() -> None:
        try:
            register()
        except BaseException as exc:  # collected for the asserts
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return lambda: thread.join(timeout=20)


def _wait_registered(client: SchedulerClient, pool_id: str, count: int) -> None:
    give_up_at = time.monotonic() + 10
    while len(client.describe_pool(pool_id).registered_ranks) < count:
        assert time.monotonic() < give_up_at, "the ranks did not register"
        time.sleep(0.02)


def test_a_failed_plan_reaches_every_waiting_rank_and_the_ranks_register_again(
    client: SchedulerClient, kvcm_address: str
) -> None:
    specs = _full_attention_specs()
    page = sum(spec.page_size_bytes for spec in specs.values())
    client.create_pool("fails", PoolConfig(max_model_len=64, world_size=3))
    failures: list[BaseException] = []
    with WorkerClient(kvcm_address, timeout=60.0) as worker:
        joins = [
            _start(lambda r=rank: worker.register("fails", r, 3, specs, 100 * page), failures)
            for rank in (0, 1)
        ]
        _wait_registered(client, "fails", 2)
        started = time.monotonic()
        with pytest.raises(ServiceInvalidArgumentError, match="No available memory"):
            worker.register("fails", 2, 3, specs, page)  # holds the null block only
        for join in joins:
            join()
        # Both waiting ranks got the same failure at once, not at their 60 s deadline.
        assert time.monotonic() - started < 10
        assert len(failures) == 2
        assert all(isinstance(f, ServiceInvalidArgumentError) for f in failures), failures
        assert all("No available memory" in str(f) for f in failures)
        # The round is dropped: the pool waits for every rank again, and they can register.
        info = client.describe_pool("fails")
        assert info.state is PoolState.PENDING_WORKERS
        assert info.registered_ranks == ()
    registrations = _register_concurrently(kvcm_address, "fails", specs, [100 * page] * 3)
    assert registrations[0].kv_cache_config.num_blocks == 100
    client.delete_pool("fails")


def _raw_register_error(
    address: str, pool_id: str, specs: Mapping[str, KVCacheSpec], memory: int
) -> str:
    """Register rank 0 of 1 past the SDK's checks; return the INVALID_ARGUMENT details."""
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as caught:
            stub.RegisterWorker(
                worker_pb2.RegisterWorkerRequest(
                    pool_id=pool_id,
                    rank=0,
                    world_size=1,
                    layer_specs=layer_specs_to_proto(specs),
                    available_memory_bytes=memory,
                ),
                timeout=10,
            )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(caught.value.details())


def test_a_tensor_overflowing_uint64_is_invalid_argument_and_nothing_is_recorded(
    client: SchedulerClient, kvcm_address: str
) -> None:
    huge = FullAttentionSpec(
        block_size=1 << 22, num_kv_heads=1 << 20, head_size=1 << 20, dtype=DType.FLOAT32
    )
    specs: dict[str, KVCacheSpec] = {"model.layers.0.attn": huge}
    client.create_pool("overflow", PoolConfig(max_model_len=64, world_size=1))
    # The page alone: the SDK refuses it before sending, the server before recording.
    with WorkerClient(kvcm_address, timeout=10.0) as worker:
        with pytest.raises(InvalidArgumentError, match=r"'model.layers.0.attn'.*uint64"):
            worker.register("overflow", 0, 1, specs, (1 << 64) - 1)
        details = _raw_register_error(kvcm_address, "overflow", specs, (1 << 64) - 1)
        assert "'model.layers.0.attn'" in details
        assert "uint64" in details
        assert client.describe_pool("overflow").registered_ranks == ()
        # A page that fits, planned with a block-count override past the uint64: refused too.
        client.create_pool(
            "override", PoolConfig(max_model_len=64, world_size=1, num_blocks_override=1 << 20)
        )
        big = FullAttentionSpec(
            block_size=1 << 10, num_kv_heads=1 << 16, head_size=1 << 16, dtype=DType.FLOAT32
        )
        with pytest.raises(ServiceInvalidArgumentError, match="uint64"):
            worker.register("override", 0, 1, {"layer.0": big}, (1 << 64) - 1)
        info = client.describe_pool("override")
        assert info.state is PoolState.PENDING_WORKERS
        assert info.registered_ranks == ()
    client.delete_pool("overflow")
    client.delete_pool("override")


def test_an_unknown_mamba_cache_mode_is_refused_by_the_sdk_and_the_wire(
    client: SchedulerClient, kvcm_address: str
) -> None:
    # "none" and "align" plan (vLLM 0.33's modes); anything else is refused before anything
    # is sent, and the server refuses it the same way, recording nothing.
    bogus = MambaSpec(
        block_size=16, shapes=((4, 64), (2, 96)), dtypes=("bfloat16", "float32"),
        mamba_cache_mode="all",
    )  # fmt: skip
    specs: dict[str, KVCacheSpec] = {"model.layers.0.mixer": bogus}
    client.create_pool("bogus", PoolConfig(max_model_len=64, world_size=1))
    with (
        WorkerClient(kvcm_address, timeout=10.0) as worker,
        pytest.raises(InvalidArgumentError, match=r"'model.layers.0.mixer'.*'none' or 'align'"),
    ):
        worker.register("bogus", 0, 1, specs, 64 * MIB)
    details = _raw_register_error(kvcm_address, "bogus", specs, 64 * MIB)
    assert "'none' or 'align'" in details
    assert "model.layers.0.mixer" in details
    assert client.describe_pool("bogus").registered_ranks == ()
    client.delete_pool("bogus")


# ----------------------------------------------------------------------------- limits
@pytest.fixture
def limited_address() -> Iterator[str]:
    """A server of its own whose limits are small: 2 pending ranks, a 0.5 s barrier."""
    settings = ServerSettings(
        grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", log_level="WARNING"
    )
    running = start_embedded_server(settings)
    running.server.state.limits = Limits(max_pending_registrations=2, registration_timeout_s=0.5)
    try:
        yield running.grpc_address
    finally:
        running.stop(grace_s=1.0)


def test_pending_registrations_are_bounded_and_stale_ranks_dropped(limited_address: str) -> None:
    specs = _full_attention_specs()
    with SchedulerClient(limited_address) as client:
        client.create_pool("bounded", PoolConfig(max_model_len=64, world_size=2))
        client.create_pool("wide", PoolConfig(max_model_len=64, world_size=3))
        with WorkerClient(limited_address, timeout=30.0) as worker:
            # A world larger than the bound could never be planned.
            with pytest.raises(ServiceResourceExhaustedError, match="max_pending_registrations"):
                worker.register("wide", 0, 3, specs, 64 * MIB)
            # A rank alone waits the server's 0.5 s (not its own 30 s), then is dropped.
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError, match="dropped"):
                worker.register("bounded", 0, 2, specs, 64 * MIB)
            assert time.monotonic() - started < 5
            assert client.describe_pool("bounded").registered_ranks == ()
            # The client's deadline, when first, ends the wait too, and drops the rank.
            with pytest.raises(DeadlineExceededError):
                worker.register("bounded", 1, 2, specs, 64 * MIB, timeout=0.2)
            assert client.describe_pool("bounded").registered_ranks == ()
            # Nothing stale is left: the two ranks plan as usual.
        registrations = _register_concurrently(limited_address, "bounded", specs, [64 * MIB] * 2)
        assert registrations[0].kv_cache_config == registrations[1].kv_cache_config
