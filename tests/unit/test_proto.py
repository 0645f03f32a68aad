"""The kvcm.v1 contract: generated modules, API rules, and the compactness of the Step message."""

from __future__ import annotations

import importlib
import random

import pytest
from google.protobuf import descriptor

from kvcm.v1 import common_pb2, scheduler_pb2, service_pb2

MODULES = ["admin", "common", "events", "lookup", "pd", "scheduler", "service", "worker"]

EXPECTED_RPCS = {
    "AdminService": {"CreatePool", "ListPools", "DescribePool", "DeletePool"},
    "WorkerService": {"RegisterWorker"},
    "SchedulerService": {
        "Step",
        "ResyncPool",
        "KeepAlive",
        "AddRequest",
        "AppendTokens",
        "Free",
        "GetComputedBlocks",
        "AllocateSlots",
        "CacheBlocks",
        "RemoveSkippedBlocks",
        "EvictBlocks",
        "ResetPrefixCache",
        "GetBlocks",
        "GetBlockIds",
        "GetNumCommonPrefixBlocks",
        "TakeNewBlockIds",
        "NewStepStarts",
        "GetUsage",
        "TakePrefixCacheStats",
    },
    "EventService": {"SubscribeEvents"},
    "LookupService": {"Lookup", "RoutePd"},
    "TransferService": {
        "HoldSource",
        "PlanTransfer",
        "CommitTransfer",
        "ReleaseTransfer",
        "ExpireTransfer",
        "DescribeTransfer",
        "ListTransfers",
    },
}

# A 1-token decode step item (APPEND_TOKENS + ALLOCATE) must stay below this many bytes on the
# wire. Measured: ~15 bytes with sha256 hashes; a sub-message per item would cost ~25.
DECODE_ITEM_BUDGET_BYTES = 20
SHA256_HASH_BYTES = 32


def _methods() -> list[descriptor.MethodDescriptor]:
    return [
        method
        for service in service_pb2.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


def _enums() -> list[descriptor.EnumDescriptor]:
    found: list[descriptor.EnumDescriptor] = []

    def walk(message: descriptor.Descriptor) -> None:
        found.extend(message.enum_types)
        for nested in message.nested_types:
            walk(nested)

    for name in MODULES:
        file = importlib.import_module(f"kvcm.v1.{name}_pb2").DESCRIPTOR
        found.extend(file.enum_types_by_name.values())
        for message in file.message_types_by_name.values():
            walk(message)
    return found


@pytest.mark.parametrize("name", MODULES)
def test_generated_modules_import(name: str) -> None:
    module = importlib.import_module(f"kvcm.v1.{name}_pb2")
    assert module.DESCRIPTOR.package == "kvcm.v1"
    assert module.DESCRIPTOR.name == f"kvcm/v1/{name}.proto"
    importlib.import_module(f"kvcm.v1.{name}_pb2_grpc")


def test_services_list_the_expected_rpcs() -> None:
    services = service_pb2.DESCRIPTOR.services_by_name
    assert {name: {m.name for m in s.methods} for name, s in services.items()} == EXPECTED_RPCS


def test_every_rpc_has_its_own_request_and_response() -> None:
    seen: set[str] = set()
    for method in _methods():
        request, response = method.input_type, method.output_type
        assert request.full_name == f"kvcm.v1.{method.name}Request"
        assert response.full_name == f"kvcm.v1.{method.name}Response"
        assert request.full_name not in seen
        assert response.full_name not in seen
        seen.update((request.full_name, response.full_name))


def test_every_enum_starts_with_unspecified() -> None:
    enums = _enums()
    assert len(enums) >= 8
    for enum in enums:
        zero = enum.values_by_number[0].name
        assert zero.endswith("_UNSPECIFIED"), enum.full_name
        prefix = zero.removesuffix("UNSPECIFIED")
        assert all(v.name.startswith(prefix) for v in enum.values), enum.full_name


def test_only_events_stream_out_and_only_snapshots_stream_in() -> None:
    assert {m.name for m in _methods() if m.server_streaming} == {"SubscribeEvents"}
    assert {m.name for m in _methods() if m.client_streaming} == {"ResyncPool"}


def _decode_step(num_items: int, rng: random.Random) -> scheduler_pb2.StepRequest:
    """One decode step: every running request appends 1 token and allocates 1 slot."""
    step = scheduler_pb2.StepRequest(pool_id="engine-0", step_seq=123_456)
    block_size = 16
    for key in range(num_items):
        num_computed_tokens = rng.randrange(512, 8192)
        fills_block = (num_computed_tokens + 1) % block_size == 0
        step.ops.append(scheduler_pb2.STEP_OP_KIND_APPEND_TOKENS)
        step.request_keys.append(key)
        step.append_num_tokens.append(1)
        step.append_token_ids.append(rng.randrange(150_000))
        step.append_num_block_hashes.append(1 if fills_block else 0)
        if fills_block:
            step.append_block_hashes += rng.randbytes(SHA256_HASH_BYTES)
        step.ops.append(scheduler_pb2.STEP_OP_KIND_ALLOCATE)
        step.request_keys.append(key)
        step.alloc_num_new_tokens.append(1)
        step.alloc_num_computed_tokens.append(num_computed_tokens)
    return step


def test_decode_step_is_compact() -> None:
    num_items = 256
    step = _decode_step(num_items, random.Random(0))
    wire = step.SerializeToString()
    assert len(wire) / num_items < DECODE_ITEM_BUDGET_BYTES
    assert scheduler_pb2.StepRequest.FromString(wire) == step


def test_decode_step_response_is_compact() -> None:
    num_items = 256
    response = scheduler_pb2.StepResponse(num_ops_executed=2 * num_items, step_seq=123_456)
    for i in range(num_items):
        response.alloc_statuses.append(common_pb2.ITEM_STATUS_OK)
        new_block = i % 16 == 0
        response.alloc_num_block_ids.append(1 if new_block else 0)
        if new_block:
            response.alloc_block_ids.append(40_000 + i)
    assert len(response.SerializeToString()) / num_items < 4


def test_step_hot_columns_are_packed_and_flat() -> None:
    fields = scheduler_pb2.StepRequest.DESCRIPTOR.fields_by_name
    for name in (
        "ops",
        "request_keys",
        "alloc_num_new_tokens",
        "alloc_num_computed_tokens",
        "append_num_tokens",
        "append_token_ids",
        "append_num_block_hashes",
    ):
        field = fields[name]
        assert field.is_repeated, name
        assert field.is_packed, name
        assert field.number <= 15, f"{name} needs a 1-byte tag"
    assert fields["append_block_hashes"].type == descriptor.FieldDescriptor.TYPE_BYTES
