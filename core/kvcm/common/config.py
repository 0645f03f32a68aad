"""The unified KV-cache config: how many blocks, which layers share a block table, and where
each layer's pages live in the worker's memory.

Field names follow vLLM 0.33's ``KVCacheConfig``; the objects are frozen and hold tuples, so a
config handed to many ranks cannot be changed by one of them. Placement (groups -> tensors and
strides, :func:`get_kv_cache_config_from_groups`) lives here too, so a worker can derive or check
the same byte offsets the server planned.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.specs import KVCacheSpec, UniformTypeKVCacheSpecs

__all__ = [
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheTensor",
    "compute_layout_strides",
    "get_kv_cache_config_from_groups",
    "layer_spec",
    "page_shape",
    "pool_bytes_per_block",
]


def _check_nonnegative(owner: str, name: str, value: object) -> None:
    if type(value) is not int or value < 0:
        raise InvalidArgumentError(f"{owner}.{name} must be a non-negative int, got {value!r}")


# Logical axes of a placed page set: layer, block, head, state (token), content bytes.
_DIM_L, _DIM_B = 0, 1


@enum.unique
class KVCacheLayout(enum.Enum):
    """The physical order of the logical ``[L, B, H, N, C]`` axes of a worker's KV cache.

    Each value lists the logical axes from outermost to innermost in memory (vLLM 0.33's
    ``KVCacheLayout``). ``LBNHC`` is vLLM's default preference.
    """

    LBHNC = (0, 1, 2, 3, 4)
    LBNHC = (0, 1, 3, 2, 4)
    LHBNC = (0, 2, 1, 3, 4)
    BLHNC = (1, 0, 2, 3, 4)
    BLNHC = (1, 0, 3, 2, 4)
    BHLNC = (1, 2, 0, 3, 4)

    @property
    def stride_order(self) -> tuple[int, ...]:
        """Logical axes, outermost first in memory."""
        return self.value

    @property
    def is_layer_compact(self) -> bool:
        """Whether the layer axis is outermost (each layer owns one region)."""
        return self.stride_order[0] == _DIM_L

    @property
    def is_block_outermost(self) -> bool:
        """Whether the block axis is outermost (a block holds every layer's page)."""
        return self.stride_order[0] == _DIM_B

    @property
    def is_block_compact(self) -> bool:
        """Whether each page is one contiguous run (layer and block axes outermost)."""
        return set(self.stride_order[:2]) == {_DIM_L, _DIM_B}

    @classmethod
    def parse(cls, value: KVCacheLayout | str, field: str = "kv_cache_layout") -> KVCacheLayout:
        """Accept a layout or its name (``"LBNHC"``).

        Raises:
            InvalidArgumentError: ``value`` names no layout; the message names ``field``.
        """
        if isinstance(value, KVCacheLayout):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        known = ", ".join(cls.__members__)
        raise InvalidArgumentError(
            f"{field}: unknown KV-cache layout {value!r} (known: {known})", field=field
        )


def page_shape(spec: KVCacheSpec) -> tuple[int, int, int]:
    """``(H, N, C)`` of one page: heads, states (tokens) and content bytes per cell.

    Raises:
        ConfigError: The spec has no per-layer page shape (a uniform-type group's spec).
    """
    return spec.page_shape()


def compute_layout_strides(
    spec: KVCacheSpec,
    num_blocks: int,
    num_layers: int,
    layout: KVCacheLayout,
    *,
    block_stride: int | None = None,
    layer_stride: int | None = None,
) -> tuple[int, int, int, int, int]:
    """Byte strides of the logical ``[L, B, H, N, C]`` axes of a set of same-spec layers.

    Axes are laid out innermost first in ``layout``'s order; a padded page widens the stride
    of the innermost page-grid axis (layer or block) to the padded size.

    Args:
        spec: The layers' (per-layer) spec.
        num_blocks: Blocks in the pool.
        num_layers: Layers placed together.
        layout: The physical axis order.
        block_stride: A fixed block stride (block-outermost layouts), or ``None``.
        layer_stride: A fixed layer stride (a placed tensor's), or ``None``.

    Returns:
        ``(layer, block, head, state, content)`` strides in bytes.

    Raises:
        ConfigError: The layout cannot pad this spec's page (heads between the page-grid axes).
    """
    heads, states, content = page_shape(spec)
    shape = (num_layers, num_blocks, heads, states, content)
    order = layout.stride_order
    padded = spec.padded_page_size_bytes
    grid_end = max(order.index(_DIM_L), order.index(_DIM_B)) + 1
    if padded is not None and math.prod(shape[d] for d in order[:grid_end]) != (
        num_layers * num_blocks
    ):
        raise ConfigError(
            f"kv_cache_layout {layout.name} cannot pad a page of {heads} heads "
            f"({type(spec).__name__}.page_size_padded={padded})"
        )
    fixed = (layer_stride, block_stride, None, None, None)
    strides = [0] * 5
    current = 1
    for position in range(4, -1, -1):
        dim = order[position]
        if padded is not None and position == grid_end - 1:
            current = max(current, padded)
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return strides[0], strides[1], strides[2], strides[3], strides[4]


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
        kv_cache_layout: The physical axis order the tensors' strides were planned for.
    """

    num_blocks: int
    kv_cache_tensors: Sequence[KVCacheTensor]
    kv_cache_groups: Sequence[KVCacheGroupSpec]
    kv_cache_layout: KVCacheLayout = KVCacheLayout.LBNHC

    def __post_init__(self) -> None:
        _check_nonnegative("KVCacheConfig", "num_blocks", self.num_blocks)
        object.__setattr__(self, "kv_cache_layout", KVCacheLayout.parse(self.kv_cache_layout))
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))


# ----------------------------------------------------------------------------- placement
def layer_spec(group: KVCacheGroupSpec, layer_name: str) -> KVCacheSpec:
    """The spec of one layer of ``group`` (its own spec inside a uniform-type group)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer_name]
    return spec


def pool_bytes_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Bytes one block id takes in the backing allocation: the widest group's pages.

    Groups overlay the same bytes (a block id belongs to one group at a time), so the
    widest group sets the stride. 0 for no groups.
    """
    return max(
        (
            sum(layer_spec(group, name).page_size_bytes for name in group.layer_names)
            for group in groups
        ),
        default=0,
    )


def _validate_layout(layout: KVCacheLayout, groups: Sequence[KVCacheGroupSpec]) -> None:
    page_sizes = {
        layer_spec(group, name).page_size_bytes for group in groups for name in group.layer_names
    }
    if len(page_sizes) <= 1:
        return
    if not layout.is_block_compact or (len(groups) > 1 and layout.is_layer_compact):
        raise ConfigError(
            f"KV cache layout {layout.name} cannot express this model's mixed page sizes "
            f"({sorted(page_sizes)}); use a block-outermost layout (e.g. BLHNC)"
        )


def get_kv_cache_config_from_groups(
    groups: Sequence[KVCacheGroupSpec], num_blocks: int, layout: KVCacheLayout
) -> KVCacheConfig:
    """Place ``groups`` in one backing allocation of ``num_blocks`` blocks.

    Every group starts at byte 0 (groups overlay: a block id belongs to one group at a
    time). Within a group, layers of equal spec form one :class:`KVCacheTensor`;
    layer-outermost layouts give each layer a region of ``num_blocks`` pages,
    block-outermost ones make block ``b`` the run of every layer's page.

    Args:
        groups: The rank's groups.
        num_blocks: Blocks of the pool (the null block included).
        layout: The physical axis order.

    Returns:
        The rank's config; an attention-free model gets 1 block (the null block) and no
        tensors.

    Raises:
        ConfigError: ``num_blocks`` is not positive, or the layout cannot place the pages.
    """
    if not groups:
        return KVCacheConfig(
            num_blocks=1, kv_cache_tensors=(), kv_cache_groups=(), kv_cache_layout=layout
        )
    if type(num_blocks) is not int or num_blocks < 1:
        raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
    _validate_layout(layout, groups)
    bytes_per_block = pool_bytes_per_block(groups)
    size = bytes_per_block * num_blocks
    fixed_block_stride = bytes_per_block if layout.is_block_outermost else None
    tensors: list[KVCacheTensor] = []
    for group in groups:
        by_spec: dict[KVCacheSpec, list[str]] = {}
        for name in group.layer_names:
            by_spec.setdefault(layer_spec(group, name), []).append(name)
        offset = 0
        for spec, names in by_spec.items():
            layer_stride, block_stride, *_ = compute_layout_strides(
                spec, num_blocks, len(names), layout, block_stride=fixed_block_stride
            )
            tensors.append(
                KVCacheTensor(
                    size=size,
                    layers=tuple(names),
                    layer_stride=layer_stride,
                    block_stride=block_stride,
                    offset=offset,
                )
            )
            step = spec.page_size_bytes if layout.is_block_outermost else layer_stride
            offset += len(names) * step
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tuple(tensors),
        kv_cache_groups=tuple(groups),
        kv_cache_layout=layout,
    )
