"""The SDK's status table: every gRPC code maps to one SDK exception that keeps the details."""

from __future__ import annotations

import grpc
import pytest

from kvcm.client import (
    CallCancelledError,
    DeadlineExceededError,
    InternalError,
    PermissionDeniedError,
    RetryPolicy,
    ServiceAlreadyExistsError,
    ServiceError,
    ServiceFailedPreconditionError,
    ServiceInvalidArgumentError,
    ServiceNotFoundError,
    ServiceOutOfRangeError,
    ServiceResourceExhaustedError,
    StatusCode,
    UnavailableError,
    UnimplementedError,
)
from kvcm.client._errors import error_from_rpc
from kvcm.common import errors
from kvcm.common.errors import InvalidArgumentError
from kvcm.v1 import scheduler_pb2
from kvcm.wire import STEP_REJECTION_TRAILER


class _FakeRpcError(grpc.RpcError):
    def __init__(
        self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, object], ...] = ()
    ) -> None:
        super().__init__()
        self._code = code
        self._details = details
        self._trailers = trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, object], ...]:
        return self._trailers


EXPECTED = {
    grpc.StatusCode.CANCELLED: CallCancelledError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.INVALID_ARGUMENT: ServiceInvalidArgumentError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.NOT_FOUND: ServiceNotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: ServiceAlreadyExistsError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ServiceResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: ServiceFailedPreconditionError,
    grpc.StatusCode.ABORTED: InternalError,
    grpc.StatusCode.OUT_OF_RANGE: ServiceOutOfRangeError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DATA_LOSS: InternalError,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDeniedError,
}


def test_every_non_ok_code_has_an_entry() -> None:
    assert set(EXPECTED) == set(grpc.StatusCode) - {grpc.StatusCode.OK}


@pytest.mark.parametrize("code", list(EXPECTED))
def test_code_maps_to_its_class_with_the_mirrored_code(code: grpc.StatusCode) -> None:
    error = error_from_rpc(_FakeRpcError(code, "pool 'x' is unknown"), "DescribePool")
    assert type(error) is EXPECTED[code]
    assert isinstance(error, ServiceError)
    assert isinstance(error, errors.KVCMError)
    assert error.code is StatusCode[code.name]
    assert error.code.value == code.value[0]
    assert error.details == "pool 'x' is unknown"
    assert error.method == "DescribePool"
    assert "pool 'x' is unknown" in str(error)
    assert code.name in str(error)


@pytest.mark.parametrize(
    ("code", "core_class"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgumentError),
        (grpc.StatusCode.NOT_FOUND, errors.NotFoundError),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExistsError),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPreconditionError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhaustedError),
        (grpc.StatusCode.OUT_OF_RANGE, errors.OutOfRangeError),
    ],
)
def test_domain_codes_are_the_core_classes(
    code: grpc.StatusCode, core_class: type[errors.KVCMError]
) -> None:
    # Code written against the in-process core catches the same classes remotely.
    assert isinstance(error_from_rpc(_FakeRpcError(code, "x"), "M"), core_class)


def test_transport_errors_are_the_builtin_ones_too() -> None:
    assert isinstance(
        error_from_rpc(_FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "x"), "M"), TimeoutError
    )
    assert isinstance(
        error_from_rpc(_FakeRpcError(grpc.StatusCode.UNAVAILABLE, "x"), "M"), ConnectionError
    )


def test_step_rejection_trailer_is_decoded() -> None:
    rejection = scheduler_pb2.StepRejection(
        op_index=17, field="alloc_num_computed_tokens[5]", reason="exceeds the request's 33 tokens"
    )
    trailers = (("other", "x"), (STEP_REJECTION_TRAILER, rejection.SerializeToString()))
    error = error_from_rpc(
        _FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "ops[17] ALLOCATE: ...", trailers), "Step"
    )
    assert error.rejection is not None
    assert error.rejection.op_index == 17
    assert error.rejection.field == "alloc_num_computed_tokens[5]"
    assert error.rejection.reason == "exceeds the request's 33 tokens"
    # The attributes every KVCMError has say the same, as the in-process core's error would.
    assert (error.op_index, error.field) == (17, "alloc_num_computed_tokens[5]")


def test_whole_step_rejection_has_no_op_index_and_garbage_is_ignored() -> None:
    whole = scheduler_pb2.StepRejection(field="step_seq", reason="out of sequence")
    error = error_from_rpc(
        _FakeRpcError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "x",
            ((STEP_REJECTION_TRAILER, whole.SerializeToString()),),
        ),
        "Step",
    )
    assert error.rejection is not None
    assert error.rejection.op_index is None
    assert (error.op_index, error.field) == (None, "step_seq")
    garbage = error_from_rpc(
        _FakeRpcError(
            grpc.StatusCode.INVALID_ARGUMENT, "x", ((STEP_REJECTION_TRAILER, b"\xff\xff"),)
        ),
        "Step",
    )
    assert garbage.rejection is None
    assert (garbage.op_index, garbage.field) == (None, None)


def test_not_found_reads_like_the_others() -> None:
    error = error_from_rpc(_FakeRpcError(grpc.StatusCode.NOT_FOUND, "no pool 'p'"), "GetUsage")
    assert str(error) == "GetUsage: NOT_FOUND: no pool 'p'"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_attempts", 1),
        ("max_attempts", 2.5),
        ("initial_backoff_s", 0),
        ("max_backoff_s", -1.0),
        ("backoff_multiplier", 0.5),
        ("attempt_timeout_s", True),
    ],
)
def test_a_retry_policy_that_would_spin_or_that_grpc_refuses_names_its_field(
    field: str, value: object
) -> None:
    with pytest.raises(InvalidArgumentError, match=field) as caught:
        RetryPolicy(**{field: value})  # type: ignore[arg-type]
    assert caught.value.field == field


def test_the_backoff_grows_to_its_cap_and_never_overflows() -> None:
    policy = RetryPolicy(initial_backoff_s=0.05, max_backoff_s=1.0, backoff_multiplier=2.0)
    assert [policy.backoff_s(attempt) for attempt in (1, 2, 3, 5, 6)] == [
        0.05,
        0.1,
        0.2,
        0.8,
        1.0,
    ]
    # A cluster's call retries until its deadline: attempt counts far past 2 ** 10.
    assert policy.backoff_s(5_000) == 1.0
    assert RetryPolicy(backoff_multiplier=1.0).backoff_s(10_000) == 0.05
