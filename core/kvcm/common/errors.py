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

from typing import Self

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

    An error carries its bare message (:attr:`message`) and where it happened: the field
    path at fault and, for an op of a Step program, the op's index and kind name. ``str()``
    renders the message with its op location (``ops[3] ALLOCATE: ...``); :meth:`unlocated`
    drops the location (a unary call reports the same rule without it); :meth:`at_op` adds
    it; :meth:`rerooted` renames the field path's first part (a scope answered by role).

    Attributes:
        path: The field at fault as its parts (``("alloc_options[5]", "hit")``); ``None``
            when the call as a whole is at fault.
        op_index: For a rejected Step program: the index of the op at fault, or ``None``.
        op_name: The kind name of that op (``None``: the message carries no op location).
    """

    path: tuple[str, ...] | None

    def __init__(
        self,
        *args: object,
        field: str | tuple[str, ...] | None = None,
        op_index: int | None = None,
        op_name: str | None = None,
    ) -> None:
        super().__init__(*args)
        self.field = field
        self.op_index = op_index
        self.op_name = op_name

    @property
    def field(self) -> str | None:
        """The field at fault, its parts joined (``alloc_num_computed_tokens[5]``), or
        ``None`` when the call as a whole is at fault. The service sends it in the status
        details."""
        return None if self.path is None else ".".join(self.path)

    @field.setter
    def field(self, value: str | tuple[str, ...] | None) -> None:
        self.path = tuple(value.split(".")) if isinstance(value, str) else value

    @property
    def message(self) -> str:
        """The message without its op location."""
        return BaseException.__str__(self)

    def __str__(self) -> str:
        if self.op_index is None or self.op_name is None:
            return self.message
        return f"ops[{self.op_index}] {self.op_name}: {self.message}"

    def at_op(self, op_index: int, op_name: str, field: str | tuple[str, ...]) -> Self:
        """This error located at op ``op_index`` (kind ``op_name``), naming ``field``."""
        return type(self)(str(self), field=field, op_index=op_index, op_name=op_name)

    def unlocated(self) -> Self:
        """This error without its op location (same class, message and field)."""
        return type(self)(self.message, field=self.path)

    def rerooted(self, root: str, new_root: str) -> Self:
        """This error with the field path's first part ``root`` renamed ``new_root``, in the
        path and where the message starts by naming it (``scope.pool_ids[1]: ...`` becomes
        ``prefill_scope.pool_ids[1]: ...``)."""
        path = self.path
        if path is not None and path[0] == root:
            path = (new_root, *path[1:])
        message = self.message
        if message.startswith(root) and message[len(root) : len(root) + 1] == ".":
            message = new_root + message[len(root) :]
        return type(self)(message, field=path, op_index=self.op_index, op_name=self.op_name)


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

    @property
    def message(self) -> str:
        """The message without its op location (KeyError would quote it: readable instead)."""
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return KVCMError.__str__(self)


class AlreadyExistsError(KVCMError):
    """Raised when creating something whose id is already taken."""


class FailedPreconditionError(KVCMError):
    """Raised when a valid call cannot run in the current state (a pool not yet planned)."""


class ResourceExhaustedError(KVCMError):
    """Raised when a hard capacity limit is hit (too many pools, requests or subscribers)."""


class OutOfRangeError(KVCMError):
    """Raised when events are asked for from a sequence number no longer kept."""
