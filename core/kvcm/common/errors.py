"""The one exception hierarchy of kvcm's core, planning layer and shared vocabulary.

Expected outcomes are values, not exceptions (``allocate_slots`` answers ``None`` when a
request does not fit; ``reset_prefix_cache`` answers ``False`` while blocks are in use).
Exceptions mean a caller broke the contract, and every one of them is raised *before* any
state changes, so a rejected call leaves the pool exactly as it was.

::

    KVCMError
    ├── InvalidArgumentError     a field of a call is out of its domain (names the field)
    │   └── ConfigError          specs, configs or planning inputs are inconsistent
    ├── NotFoundError            an id (request, pool, layer, rank) is unknown
    ├── AlreadyExistsError       an id is taken
    ├── FailedPreconditionError  the call is valid but not in the current state
    ├── ResourceExhaustedError   a hard capacity limit (not "does not fit this step")
    └── OutOfRangeError          events asked for from a sequence number no longer kept

The service maps each class to one gRPC status code (INVALID_ARGUMENT, NOT_FOUND,
ALREADY_EXISTS, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, OUT_OF_RANGE); the SDK raises
subclasses of the same classes, so one ``except`` works in-process and remotely.
"""

from __future__ import annotations

__all__ = [
    "AlreadyExistsError",
    "ConfigError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "KVCMError",
    "NotFoundError",
    "OutOfRangeError",
    "ResourceExhaustedError",
    "shown",
]

# Characters of client input an error message quotes before cutting it short.
_SHOWN_CHARS = 32


def shown(value: str) -> str:
    """``value`` quoted for an error message, cut short with its length when long.

    Messages name what the caller sent, but must stay small whatever it sent (a 1 MB id):
    the quote is ASCII (``ascii()``) and at most :data:`_SHOWN_CHARS` characters of it.
    """
    if len(value) <= _SHOWN_CHARS:
        return ascii(value)
    return f"{value[:_SHOWN_CHARS]!a}... ({len(value)} characters)"


class KVCMError(Exception):
    """Base class of every error kvcm raises on purpose.

    Attributes:
        field: The argument at fault, with its index (``alloc_num_computed_tokens[5]``), or
            ``None`` when the call as a whole is at fault. The service sends it in the
            status details.
        op_index: For a rejected Step program: the index of the op at fault, or ``None``.
    """

    def __init__(
        self, *args: object, field: str | None = None, op_index: int | None = None
    ) -> None:
        super().__init__(*args)
        self.field = field
        self.op_index = op_index


class InvalidArgumentError(KVCMError, ValueError):
    """Raised when an argument is outside its domain.

    The message names the offending field (``num_new_tokens must be >= 0, got -1``).
    """


class ConfigError(InvalidArgumentError):
    """Raised when KV-cache specs, a KV-cache config or planning inputs are inconsistent.

    The message names the layer, group or field at fault.
    """


class NotFoundError(KVCMError, KeyError):
    """Raised when an id (request, pool, layer, rank) is not known."""

    def __str__(self) -> str:
        # KeyError quotes its argument; a readable message matters more here.
        return str(self.args[0]) if self.args else ""


class AlreadyExistsError(KVCMError):
    """Raised when creating something whose id is already taken."""


class FailedPreconditionError(KVCMError):
    """Raised when a valid call cannot run in the current state (a pool not yet planned)."""


class ResourceExhaustedError(KVCMError):
    """Raised when a hard capacity limit is hit (too many pools, requests or subscribers)."""


class OutOfRangeError(KVCMError):
    """Raised when events are asked for from a sequence number no longer kept."""
