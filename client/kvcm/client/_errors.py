"""What the SDK raises when the service answers with a status other than OK.

Users never see ``grpc.RpcError``: one table (``_ERROR_FOR_CODE``) turns every status code into
an SDK exception, keeping the ``grpc.RpcError`` as ``__cause__``. The domain codes map to
subclasses of the ``kvcm.common.errors`` classes the in-process core raises for the same
contract violation, so code written against the core catches the same classes remotely::

    KVCMError                                   (kvcm.common.errors)
    └── ServiceError                            any non-OK status; .code, .details, .method
        ├── ServiceInvalidArgumentError         INVALID_ARGUMENT    (+ InvalidArgumentError)
        ├── ServiceNotFoundError                NOT_FOUND           (+ NotFoundError)
        ├── ServiceAlreadyExistsError           ALREADY_EXISTS      (+ AlreadyExistsError)
        ├── ServiceFailedPreconditionError      FAILED_PRECONDITION (+ FailedPreconditionError)
        ├── ServiceResourceExhaustedError       RESOURCE_EXHAUSTED  (+ ResourceExhaustedError)
        ├── ServiceOutOfRangeError              OUT_OF_RANGE        (+ OutOfRangeError)
        ├── DeadlineExceededError               DEADLINE_EXCEEDED   (+ TimeoutError)
        ├── UnavailableError                    UNAVAILABLE         (+ ConnectionError)
        ├── CallCancelledError                  CANCELLED
        ├── UnimplementedError                  UNIMPLEMENTED (client and server disagree)
        ├── PermissionDeniedError               PERMISSION_DENIED, UNAUTHENTICATED
        └── InternalError                       INTERNAL, UNKNOWN, DATA_LOSS, ABORTED

A rejected Step also carries ``rejection`` (the op index and field at fault), decoded from the
``kvcm-step-rejection-bin`` trailer; its op index and field are also the error's ``op_index``
and ``field``, the attributes every ``KVCMError`` has, so code that reads them works the same
on an in-process core's error and on the service's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCMError,
    NotFoundError,
    OutOfRangeError,
    ResourceExhaustedError,
)

if TYPE_CHECKING:
    import grpc

__all__ = [
    "CallCancelledError",
    "DeadlineExceededError",
    "InternalError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "ServiceAlreadyExistsError",
    "ServiceError",
    "ServiceFailedPreconditionError",
    "ServiceInvalidArgumentError",
    "ServiceNotFoundError",
    "ServiceOutOfRangeError",
    "ServiceResourceExhaustedError",
    "StatusCode",
    "StepRejection",
    "UnavailableError",
    "UnimplementedError",
    "error_from_rpc",
    "error_from_status",
]


@enum.unique
class StatusCode(enum.IntEnum):
    """gRPC status codes, mirrored so that SDK users never import grpc.

    The values are gRPC's numeric codes.
    """

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


@dataclass(frozen=True, slots=True)
class StepRejection:
    """Why the server rejected a whole Step (nothing ran).

    Attributes:
        op_index: Index into the Step's ops of the first op that failed validation; ``None``
            when the Step as a whole was malformed (column lengths, step_seq).
        field: The field at fault with its index (``"alloc_num_computed_tokens[5]"``).
        reason: Human-readable reason (the status message).
    """

    op_index: int | None
    field: str
    reason: str


class ServiceError(KVCMError):
    """Raised when an RPC ends with a non-OK status.

    Attributes:
        code: The status code.
        details: The server's message (names the field at fault for INVALID_ARGUMENT).
        method: The RPC's short name (``"Step"``, ``"AllocateSlots"``).
        rejection: For a rejected Step, which op and field failed; else ``None``.
        field: The rejection's field (``None`` without one), as the core's errors name it.
        op_index: The rejection's op index (``None`` without one, or for a whole Step).
    """

    def __init__(
        self,
        details: str,
        *,
        code: StatusCode = StatusCode.UNKNOWN,
        method: str = "",
        rejection: StepRejection | None = None,
    ) -> None:
        """Build the error.

        Args:
            details: The server's message.
            code: The status code.
            method: The RPC's short name.
            rejection: A rejected Step's details, if any.
        """
        super().__init__(
            details,
            field=(rejection.field or None) if rejection is not None else None,
            op_index=rejection.op_index if rejection is not None else None,
        )
        self.code = code
        self.details = details
        self.method = method
        self.rejection = rejection

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        return f"{where}{self.code.name}: {self.details}"


class ServiceInvalidArgumentError(ServiceError, InvalidArgumentError):
    """Raised on INVALID_ARGUMENT: a field is outside its domain; nothing changed."""


class ServiceNotFoundError(ServiceError, NotFoundError):
    """Raised on NOT_FOUND: an unknown pool, request key or rank; nothing changed."""

    def __str__(self) -> str:
        return ServiceError.__str__(self)


class ServiceAlreadyExistsError(ServiceError, AlreadyExistsError):
    """Raised on ALREADY_EXISTS: a pool id or live request key is taken; nothing changed."""


class ServiceFailedPreconditionError(ServiceError, FailedPreconditionError):
    """Raised on FAILED_PRECONDITION: pool not READY, step_seq out of sequence, no events."""


class ServiceResourceExhaustedError(ServiceError, ResourceExhaustedError):
    """Raised on RESOURCE_EXHAUSTED: a hard limit (never "does not fit"); nothing changed."""


class ServiceOutOfRangeError(ServiceError, OutOfRangeError):
    """Raised on OUT_OF_RANGE: an event subscription's start sequence is no longer kept."""


class DeadlineExceededError(ServiceError, TimeoutError):
    """Raised on DEADLINE_EXCEEDED: the call's deadline passed; a mutation's outcome is unknown.

    Retry a Step with the same ``step_seq`` to learn it (exactly-once).
    """


class UnavailableError(ServiceError, ConnectionError):
    """Raised on UNAVAILABLE: no server, or it is shutting down (after the SDK's retries)."""


class CallCancelledError(ServiceError):
    """Raised on CANCELLED: the call was cancelled (by the client or the server's shutdown)."""


class UnimplementedError(ServiceError):
    """Raised on UNIMPLEMENTED: the server does not know the RPC (version mismatch)."""


class PermissionDeniedError(ServiceError):
    """Raised on PERMISSION_DENIED or UNAUTHENTICATED."""


class InternalError(ServiceError):
    """Raised on INTERNAL, UNKNOWN, DATA_LOSS or ABORTED: a server bug or a broken transport."""


_ERROR_FOR_CODE: dict[StatusCode, type[ServiceError]] = {
    StatusCode.CANCELLED: CallCancelledError,
    StatusCode.UNKNOWN: InternalError,
    StatusCode.INVALID_ARGUMENT: ServiceInvalidArgumentError,
    StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    StatusCode.NOT_FOUND: ServiceNotFoundError,
    StatusCode.ALREADY_EXISTS: ServiceAlreadyExistsError,
    StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    StatusCode.RESOURCE_EXHAUSTED: ServiceResourceExhaustedError,
    StatusCode.FAILED_PRECONDITION: ServiceFailedPreconditionError,
    StatusCode.ABORTED: InternalError,
    StatusCode.OUT_OF_RANGE: ServiceOutOfRangeError,
    StatusCode.UNIMPLEMENTED: UnimplementedError,
    StatusCode.INTERNAL: InternalError,
    StatusCode.UNAVAILABLE: UnavailableError,
    StatusCode.DATA_LOSS: InternalError,
    StatusCode.UNAUTHENTICATED: PermissionDeniedError,
}


def _status_code(code: object) -> StatusCode:
    # grpc.StatusCode values are (int, str) tuples; anything unexpected reads as UNKNOWN.
    value = getattr(code, "value", None)
    if isinstance(value, tuple) and value and isinstance(value[0], int):
        try:
            return StatusCode(value[0])
        except ValueError:
            return StatusCode.UNKNOWN
    return StatusCode.UNKNOWN


def _step_rejection(trailers: object) -> StepRejection | None:
    from kvcm.wire import step_rejection_from_trailers

    decoded = step_rejection_from_trailers(trailers)
    if decoded is None:
        return None
    op_index, field, reason = decoded
    return StepRejection(op_index=op_index, field=field, reason=reason)


def error_from_rpc(exc: grpc.RpcError, method: str) -> ServiceError:
    """Translate a failed call into the SDK exception for its status.

    Works for sync (``grpc.Call``) and async (``grpc.aio.AioRpcError``) failures alike. The
    caller raises the result ``from exc`` so the gRPC error stays the cause.

    Args:
        exc: The failed call.
        method: The RPC's short name, for the message.

    Returns:
        The exception to raise.
    """
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    trailers_fn = getattr(exc, "trailing_metadata", None)
    code = _status_code(code_fn()) if callable(code_fn) else StatusCode.UNKNOWN
    details = (details_fn() if callable(details_fn) else None) or str(exc)
    rejection = _step_rejection(trailers_fn()) if callable(trailers_fn) else None
    error_type = _ERROR_FOR_CODE.get(code, InternalError)
    return error_type(str(details), code=code, method=method, rejection=rejection)


def error_from_status(code: int, details: str, method: str) -> ServiceError:
    """The SDK exception for a status given as its number and message (the lookup port's
    error frames; an unknown number reads as UNKNOWN), as :func:`error_from_rpc` maps it.

    Args:
        code: gRPC's numeric status code.
        details: The server's message.
        method: The RPC's short name, for the message.
    """
    try:
        status = StatusCode(code)
    except ValueError:
        status = StatusCode.UNKNOWN
    error_type = _ERROR_FOR_CODE.get(status, InternalError)
    return error_type(details, code=status, method=method)
