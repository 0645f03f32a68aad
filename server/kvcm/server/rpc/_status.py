"""The one table from kvcm's exception classes to gRPC status codes, and Step rejections.

Every servicer raises :mod:`kvcm.common.errors` classes (and :class:`StepRejectedError` for a
Step that failed validation); the interceptor turns them into statuses with
:func:`status_of`. The most specific class wins (``ConfigError`` before
``InvalidArgumentError``); anything else is INTERNAL.
"""

from __future__ import annotations

import re
from typing import Final

import grpc

from kvcm.common.errors import (
    AlreadyExistsError,
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVCMError,
    NotFoundError,
    ResourceExhaustedError,
)
from kvcm.core.pool import OutOfRangeError
from kvcm.wire import step_rejection_to_trailer

__all__ = [
    "STATUS_FOR_ERROR",
    "AbortRpc",
    "StepRejectedError",
    "status_details",
    "status_of",
]

# Most characters a status message or a trailer string carries. grpc sends details as the
# percent-encoded grpc-message header: a non-ASCII character grows to up to 12 bytes there,
# and a client refuses headers over 8 KiB with RESOURCE_EXHAUSTED, hiding the real status.
MAX_DETAILS_CHARS: Final = 512
# Printable ASCII stays; everything else is escaped before the cap is applied.
_UNSAFE: Final = re.compile(r"[^\x20-\x7e]")

# Most specific first: the first class the exception is an instance of decides.
STATUS_FOR_ERROR: Final[tuple[tuple[type[BaseException], grpc.StatusCode], ...]] = (
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (OutOfRangeError, grpc.StatusCode.OUT_OF_RANGE),
)


class StepRejectedError(KVCMError):
    """Raised when a Step fails validation: carries the op, the field and the cause's class.

    Attributes:
        error: The error the failing op would raise as a unary call.
        op_index: Index of the failing op; ``None`` for a malformed Step as a whole.
        field: The field at fault, with its index.
    """

    def __init__(self, error: KVCMError, op_index: int | None, field: str) -> None:
        """Wrap ``error`` for op ``op_index`` and ``field``."""
        super().__init__(str(error))
        self.error = error
        self.op_index = op_index
        self.field = field

    def trailer(self) -> tuple[tuple[str, bytes], ...]:
        """The ``kvcm-step-rejection-bin`` trailing metadata."""
        return step_rejection_to_trailer(
            self.op_index, status_details(self.field or ""), status_details(str(self))
        )


def _escape(match: re.Match[str]) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


def status_details(text: str) -> str:
    """``text`` made safe to send as status details or in a trailer.

    Client input echoed in messages (a 1 MB pool id) must not make the status itself fail:
    every character outside printable ASCII is escaped, and the result is cut to
    :data:`MAX_DETAILS_CHARS` with the original length said at the end.
    """
    if len(text) <= MAX_DETAILS_CHARS and text.isascii() and text.isprintable():
        return text
    safe = _UNSAFE.sub(_escape, text[: MAX_DETAILS_CHARS * 2])
    if len(safe) <= MAX_DETAILS_CHARS and len(text) <= MAX_DETAILS_CHARS * 2:
        return safe
    suffix = f"... ({len(text)} characters in all)"
    return safe[: MAX_DETAILS_CHARS - len(suffix)] + suffix


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code for an exception raised by a servicer (INTERNAL when unknown)."""
    if isinstance(exc, StepRejectedError):
        exc = exc.error
    for error_type, code in STATUS_FOR_ERROR:
        if isinstance(exc, error_type):
            return code
    return grpc.StatusCode.INTERNAL


class AbortRpc(Exception):  # noqa: N818 - it is a control-flow signal, not an error class
    """Raised by a servicer to end its call with a status outside the error table."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with ``code`` and ``details``."""
        super().__init__(details)
        self.code = code
        self.details = details
