"""The rpc front door over a real server: undecodable bytes and oversized input get real statuses.

Raw channels send bytes that are not the request message; raw stubs and the SDK send pool ids
of 1 MB and of 6 KB of non-ASCII text. Each call must end with INVALID_ARGUMENT naming the
fault (never UNKNOWN, never the client's own RESOURCE_EXHAUSTED on an oversized status), be
counted in ``kvcm_rpc_requests_total``, and log nothing at WARNING or above.
"""

from __future__ import annotations

import logging
import re
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from kvcm.client import (
    PoolConfig,
    SchedulerClient,
    ServiceInvalidArgumentError,
    ServiceNotFoundError,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.server.rpc import status_details
from kvcm.server.rpc._status import MAX_DETAILS_CHARS
from kvcm.v1 import admin_pb2, events_pb2, service_pb2_grpc
from kvcm.wire import pool_config_to_proto

GARBAGE = b"\xff\xff\xff\xff"  # field 31, wire type 7: no such wire type
HUGE_ID = "p" * (1 << 20)
NON_ASCII_ID = "\u00e9" * 3072  # 6 KiB of UTF-8, far more once percent-encoded


def _config() -> PoolConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
    layout = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=spec),),
    )
    return PoolConfig(max_model_len=64, explicit_layout=layout)


@pytest.fixture
def channel(kvcm_address: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(kvcm_address) as channel:
        yield channel


def _count(http_address: str, method: str, code: str) -> float:
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("kvcm_rpc_requests_total{"):
            continue
        if f'method="{method}"' in line and f'code="{code}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize(
    ("path", "type_name"),
    [
        ("/kvcm.v1.AdminService/DescribePool", "kvcm.v1.DescribePoolRequest"),
        ("/kvcm.v1.SchedulerService/Step", "kvcm.v1.StepRequest"),
    ],
)
def test_undecodable_unary_request_is_invalid_argument_and_counted(
    channel: grpc.Channel,
    kvcm_http_address: str,
    caplog: pytest.LogCaptureFixture,
    path: str,
    type_name: str,
) -> None:
    method = path.rsplit("/", 1)[1]
    before = _count(kvcm_http_address, method, "INVALID_ARGUMENT")
    call = channel.unary_unary(path)
    with caplog.at_level(logging.DEBUG), pytest.raises(grpc.RpcError) as caught:
        call(GARBAGE, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == f"request is not a valid {type_name}"
    assert _count(kvcm_http_address, method, "INVALID_ARGUMENT") == before + 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_undecodable_stream_request_is_invalid_argument(channel: grpc.Channel) -> None:
    call = channel.unary_stream("/kvcm.v1.EventService/SubscribeEvents")
    with pytest.raises(grpc.RpcError) as caught:
        list(call(GARBAGE, timeout=5))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kvcm.v1.SubscribeEventsRequest" in (caught.value.details() or "")


def test_valid_request_after_garbage_still_answers(channel: grpc.Channel) -> None:
    # The marker never reaches a servicer: the same method then serves a real request.
    with pytest.raises(grpc.RpcError):
        channel.unary_unary("/kvcm.v1.AdminService/ListPools")(GARBAGE, timeout=5)
    stub = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
    assert isinstance(stub.ListPools(admin_pb2.ListPoolsRequest(), timeout=5).pools, object)


@pytest.mark.parametrize("pool_id", [HUGE_ID, NON_ASCII_ID], ids=["1MB", "6KB-non-ascii"])
def test_oversized_pool_id_gets_the_real_status_on_a_raw_stub(
    channel: grpc.Channel, pool_id: str
) -> None:
    stub = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]
    request = admin_pb2.CreatePoolRequest(pool_id=pool_id, config=pool_config_to_proto(_config()))
    with pytest.raises(grpc.RpcError) as caught:
        stub.CreatePool(request, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert details.startswith("pool_id")
    assert len(details) <= MAX_DETAILS_CHARS
    assert details.isascii()
    assert f"({len(pool_id)} characters)" in details


@pytest.mark.parametrize("pool_id", [HUGE_ID, NON_ASCII_ID], ids=["1MB", "6KB-non-ascii"])
def test_oversized_pool_id_gets_the_real_status_through_the_sdk(
    kvcm_address: str, pool_id: str
) -> None:
    with SchedulerClient(kvcm_address, timeout=5.0) as client:
        with pytest.raises(ServiceInvalidArgumentError, match="pool_id"):
            client.create_pool(pool_id, _config())
        # An unknown id is NOT_FOUND (not a RESOURCE_EXHAUSTED the client made up), and the
        # message quoting it stays within the cap.
        with pytest.raises(ServiceNotFoundError) as caught:
            client.describe_pool(pool_id)
        assert len(str(caught.value)) <= MAX_DETAILS_CHARS + 100


def test_oversized_pool_id_on_a_stream_gets_the_real_status(channel: grpc.Channel) -> None:
    stub = service_pb2_grpc.EventServiceStub(channel)  # type: ignore[no-untyped-call]
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.SubscribeEvents(events_pb2.SubscribeEventsRequest(pool_id=NON_ASCII_ID)))
    assert caught.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert len(caught.value.details() or "") <= MAX_DETAILS_CHARS


def test_status_details_keeps_short_ascii_and_escapes_the_rest() -> None:
    assert status_details("pool_id 'a' is unknown") == "pool_id 'a' is unknown"
    assert status_details("x\u00e9\n") == "x\\xe9\\n"
    capped = status_details("pool_id: " + "\u4e2d" * 10_000)
    assert len(capped) <= MAX_DETAILS_CHARS
    assert capped.startswith("pool_id: \\u4e2d")
    assert re.search(r"\(10009 characters in all\)$", capped)
