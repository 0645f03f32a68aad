"""An explicit layout whose worker tensor would not fit a uint64 is refused when the pool is
created (CreatePool or ResyncPool), so RegisterWorker never meets one.

Found by the issue 24 review: a pool created with a huge spec answered RegisterWorker with
INTERNAL (the tensor's byte size overflowed the wire's uint64) and kept the rank registered.
The server is a real one on loopback; the hostile configs are sent as raw protobuf, past the
SDK's own check of the same rule.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvcm.client import SchedulerClient, WorkerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.specs import UINT64_MAX, FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings
from kvcm.v1 import admin_pb2, scheduler_pb2, service_pb2_grpc
from kvcm.wire import pool_config_to_proto

# A page of 2**46 bytes: 2**17 blocks of it fit a uint64 (2**63), 2**18 do not (2**64).
HUGE = FullAttentionSpec(block_size=16, num_kv_heads=2**20, head_size=2**20, dtype=DType.BFLOAT16)
FITTING_BLOCKS = 2**17


def _config(num_blocks: int) -> PoolConfig:
    return PoolConfig(
        max_model_len=256,
        explicit_layout=KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=(),
            kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=HUGE),),
        ),
    )


def _overflowing_proto() -> admin_pb2.PoolConfig:
    """The fitting config on the wire, then given twice the blocks (past the SDK's check)."""
    message = pool_config_to_proto(_config(FITTING_BLOCKS))
    message.explicit_layout.num_blocks = 2 * FITTING_BLOCKS
    return message


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", log_level="WARNING")
    )
    try:
        yield running
    finally:
        running.stop()


def test_the_sdk_refuses_the_layout_naming_the_field() -> None:
    assert (
        HUGE.page_size_bytes * FITTING_BLOCKS
        <= UINT64_MAX
        < HUGE.page_size_bytes * (2 * FITTING_BLOCKS)
    )
    with pytest.raises(InvalidArgumentError, match="more than a uint64") as caught:
        _config(2 * FITTING_BLOCKS)
    assert caught.value.field == "config.explicit_layout.num_blocks"


def test_create_pool_refuses_a_layout_past_a_uint64(server: EmbeddedServer) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel:
        admin = service_pb2_grpc.AdminServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            admin.CreatePool(
                admin_pb2.CreatePoolRequest(pool_id="huge", config=_overflowing_proto()),
                timeout=5,
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "config.explicit_layout" in (caught.value.details() or "")
        assert "uint64" in (caught.value.details() or "")
        listed = admin.ListPools(admin_pb2.ListPoolsRequest(), timeout=5)
        assert "huge" not in [pool.pool_id for pool in listed.pools]


def test_resync_pool_refuses_a_layout_past_a_uint64(server: EmbeddedServer) -> None:
    with grpc.insecure_channel(server.grpc_address) as channel:
        scheduler = service_pb2_grpc.SchedulerServiceStub(channel)
        chunk = scheduler_pb2.ResyncPoolRequest(
            pool_id="huge-resync", config=_overflowing_proto(), step_seq=1, data=b""
        )
        with pytest.raises(grpc.RpcError) as caught:
            scheduler.ResyncPool(iter([chunk]), timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "uint64" in (caught.value.details() or "")
        admin = service_pb2_grpc.AdminServiceStub(channel)
        listed = admin.ListPools(admin_pb2.ListPoolsRequest(), timeout=5)
        assert "huge-resync" not in [pool.pool_id for pool in listed.pools]


def test_a_layout_at_the_limit_registers_its_worker(server: EmbeddedServer) -> None:
    with SchedulerClient(server.grpc_address, timeout=30) as client:
        client.create_pool("at-limit", _config(FITTING_BLOCKS))
        try:
            with WorkerClient(server.grpc_address, timeout=10) as worker:
                registration = worker.register("at-limit", 0, 1, {"l0": HUGE}, 0)
            (tensor,) = registration.kv_cache_config.kv_cache_tensors
            assert tensor.size == HUGE.page_size_bytes * FITTING_BLOCKS
            assert client.describe_pool("at-limit").registered_ranks == (0,)
        finally:
            client.delete_pool("at-limit")
