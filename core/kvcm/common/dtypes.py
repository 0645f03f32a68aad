"""KV-cache element types: wire names and byte sizes.

Workers, schedulers and the server exchange dtypes by name (``"bfloat16"``); the names are
torch's, and the conversions to and from ``torch.dtype`` live on the worker side, in
``kvcm.client.tensors`` (this package never imports torch).
"""

from __future__ import annotations

import enum

from kvcm.common.errors import InvalidArgumentError

__all__ = ["DType", "dtype_size"]


@enum.unique
class DType(enum.StrEnum):
    """A KV-cache element type, named as torch names it (``torch.<name>``)."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"
    INT8 = "int8"
    UINT8 = "uint8"
    INT16 = "int16"
    INT32 = "int32"
    INT64 = "int64"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _SIZES[self]

    @classmethod
    def parse(cls, value: DType | str, field: str = "dtype") -> DType:
        """Accept a ``DType`` or its wire name (``"bfloat16"``, also ``"torch.bfloat16"``).

        Raises:
            InvalidArgumentError: ``value`` names no known dtype; the message names ``field``.
        """
        if isinstance(value, DType):
            return value
        if isinstance(value, str):
            name = value.removeprefix("torch.")
            member = _BY_NAME.get(name)
            if member is not None:
                return member
        known = ", ".join(d.value for d in cls)
        raise InvalidArgumentError(f"{field}: unknown dtype {value!r} (known: {known})")


_SIZES: dict[DType, int] = {
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
    DType.FLOAT8_E4M3FN: 1,
    DType.FLOAT8_E5M2: 1,
    DType.INT8: 1,
    DType.UINT8: 1,
    DType.INT16: 2,
    DType.INT32: 4,
    DType.INT64: 8,
}
# Common aliases used in configs ("half", "fp8", ...) resolve to the canonical member.
_BY_NAME: dict[str, DType] = {d.value: d for d in DType} | {
    "half": DType.FLOAT16,
    "float": DType.FLOAT32,
    "double": DType.FLOAT64,
    "bf16": DType.BFLOAT16,
    "fp16": DType.FLOAT16,
    "fp32": DType.FLOAT32,
}


def dtype_size(dtype: DType | str) -> int:
    """Bytes per element of ``dtype``.

    Raises:
        InvalidArgumentError: Unknown dtype.
    """
    return _SIZES[DType.parse(dtype)]
