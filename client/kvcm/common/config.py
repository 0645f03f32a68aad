"""The unified KV-cache config: how many blocks, which layers share a block table, and where
each layer's pages live in the worker's memory.

Field names follow vLLM 0.33's ``KVCacheConfig``; the objects are frozen and hold tuples, so a
config handed to many ranks cannot be changed by one of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcm.common.errors import InvalidArgumentError
from kvcm.common.specs import KVCacheSpec

__all__ = ["KVCacheConfig", "KVCacheGroupSpec", "KVCacheTensor"]


def _check_nonnegative(owner: str, name: str, value: object) -> None:
    if type(value) is not int or value < 0:
        raise InvalidArgumentError(f"{owner}.{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVCacheTensor:
    """One backing allocation of a worker and the same-shaped layers placed in it.

    Layer ``layers[i]``'s page for block ``b`` starts ``offset + i * layer_stride +
    b * block_stride`` bytes into the allocation of ``size`` bytes. Tensors of different
    groups may overlay the same bytes: a block id belongs to one group at a time.

    Attributes:
        size: Bytes of the backing allocation.
        layers: Layer names, in placement order.
        layer_stride: Bytes between consecutive layers' block 0.
        block_stride: Bytes between consecutive blocks of one layer.
        offset: Byte offset of ``layers[0]``'s block 0.
    """

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        for name in ("size", "layer_stride", "block_stride", "offset"):
            _check_nonnegative("KVCacheTensor", name, getattr(self, name))
        if any(not isinstance(layer, str) or not layer for layer in self.layers):
            raise InvalidArgumentError("KVCacheTensor.layers must be non-empty layer names")


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table, and their (merged) spec.

    Attributes:
        layer_names: The layers of the group.
        kv_cache_spec: The group's spec.
    """

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise InvalidArgumentError(
                f"KVCacheGroupSpec.kv_cache_spec must be a KVCacheSpec, "
                f"got {type(self.kv_cache_spec).__name__}"
            )


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The KV-cache config every rank of an engine shares.

    Attributes:
        num_blocks: Blocks in the pool (the null block included).
        kv_cache_tensors: Backing allocations and their layers' placement.
        kv_cache_groups: Groups of layers sharing a block table, in group-id order.
    """

    num_blocks: int
    kv_cache_tensors: Sequence[KVCacheTensor]
    kv_cache_groups: Sequence[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        _check_nonnegative("KVCacheConfig", "num_blocks", self.num_blocks)
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
