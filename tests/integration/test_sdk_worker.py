"""Workers register concurrently through the real SDK, receive one unified config, allocate CPU
tensors from it, and re-registering behaves as the contract says."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import pytest
import torch

from kvcm.client import (
    PoolConfig,
    PoolState,
    SchedulerClient,
    ServiceAlreadyExistsError,
    WorkerClient,
    WorkerRegistration,
)
from kvcm.common.dtypes import DType
from kvcm.common.errors import AlreadyExistsError
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

MIB = 1024 * 1024
ATTENTION = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": DType.BFLOAT16}


def _full_attention_specs() -> dict[str, KVCacheSpec]:
    spec = FullAttentionSpec(**ATTENTION)  # type: ignore[arg-type]
    return {f"model.layers.{i}.attn": spec for i in range(4)}


def _hybrid_specs() -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(**ATTENTION)  # type: ignore[arg-type]
    window = SlidingWindowSpec(**ATTENTION, sliding_window=128)  # type: ignore[arg-type]
    return {f"model.layers.{i}.attn": full if i % 2 else window for i in range(4)}


@pytest.fixture
def client(kvcm_address: str) -> Iterator[SchedulerClient]:
    with SchedulerClient(kvcm_address) as client:
        yield client


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
