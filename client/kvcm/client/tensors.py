"""A worker's KV-cache tensors, built from its rank's ``KVCacheConfig`` (imports torch).

The config places every layer in one backing allocation: layer ``layers[i]`` of a
:class:`~kvcm.common.config.KVCacheTensor` keeps block ``b``'s page at byte
``offset + i * layer_stride + b * block_stride``. This module allocates that buffer once (an
``int8`` tensor of ``size`` bytes) and views it per layer, as vLLM 0.33's
``allocate_kv_cache`` does:

- attention layers: ``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]`` in
  the layer's dtype (keys then values along the last axis), strided as the config's layout
  says;
- Mamba layers: ``[num_blocks, 1, 1, page_bytes]`` raw bytes (the model splits its states).

Groups overlay the same bytes, so one block id addresses the same bytes in every layer of
its group and never two groups' data at once. Everything is validated before anything is
allocated; nothing half-built is returned.

::

    kv_caches = allocate_kv_cache_tensors(registration.kv_cache_config, device="cuda:0")
    kv_caches["model.layers.0.self_attn"].shape   # (num_blocks, heads, block_size, 2 * head)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvcm.common.config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
    page_shape,
)
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.hashing import PromptEmbeds
from kvcm.common.specs import KVCacheSpec, UniformTypeKVCacheSpecs

__all__ = [
    "LayerPlacement",
    "allocate_host_blocks",
    "allocate_kv_cache_tensors",
    "copy_block_pages",
    "from_torch",
    "kv_cache_views",
    "layer_placements",
    "layer_specs_of",
    "prompt_embeds_from_tensor",
    "to_torch",
]


def to_torch(dtype: DType | str) -> torch.dtype:
    """The ``torch.dtype`` for ``dtype`` (kvcm's dtype names are torch's).

    Raises:
        InvalidArgumentError: Unknown dtype.
    """
    return getattr(torch, DType.parse(dtype).value)  # type: ignore[no-any-return]


def from_torch(torch_dtype: torch.dtype) -> DType:
    """The ``DType`` of a ``torch.dtype``.

    Raises:
        InvalidArgumentError: The torch dtype has no kvcm wire name.
    """
    return DType.parse(str(torch_dtype))


def prompt_embeds_from_tensor(tensor: torch.Tensor) -> PromptEmbeds:
    """Capture a ``[num_tokens, hidden_size]`` prompt-embeddings tensor as the raw row bytes
    vLLM hashes per block.
    """
    flat = tensor.detach().flatten().cpu().contiguous().view(torch.uint8)
    # Copied through torch.frombuffer: no numpy needed, and one C-level copy.
    raw = bytearray(flat.numel())
    if raw:
        torch.frombuffer(raw, dtype=torch.uint8).copy_(flat)
    return PromptEmbeds(bytes(raw), int(tensor.shape[0]))


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerPlacement:
    """Where one layer's pages live in the backing allocation.

    Attributes:
        layer_name: The layer.
        spec: The layer's own spec.
        size: ``[L, B, H, N, C]`` of the layer's tensor set (C in bytes).
        stride: Byte strides of those axes.
        offset: Byte offset of the tensor set's first layer's block 0.
        layer_index: This layer's index along L.
    """

    layer_name: str
    spec: KVCacheSpec
    size: tuple[int, int, int, int, int]
    stride: tuple[int, int, int, int, int]
    offset: int
    layer_index: int

    @property
    def block_offset_bytes(self) -> int:
        """Byte offset of this layer's block 0."""
        return self.offset + self.layer_index * self.stride[0]

    def block_byte_offset(self, block_id: int) -> int:
        """Byte offset of this layer's page of ``block_id``."""
        return self.block_offset_bytes + block_id * self.stride[1]


def _layer_specs(groups: tuple[KVCacheGroupSpec, ...]) -> dict[str, KVCacheSpec]:
    specs: dict[str, KVCacheSpec] = {}
    for group in groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            if isinstance(spec, UniformTypeKVCacheSpecs):
                if name not in spec.kv_cache_specs:
                    raise ConfigError(f"layer {name!r} has no spec in its uniform-type group")
                specs[name] = spec.kv_cache_specs[name]
            else:
                specs[name] = spec
    return specs


def _placement_of(
    tensor: KVCacheTensor, spec: KVCacheSpec, config: KVCacheConfig
) -> tuple[tuple[int, int, int, int, int], tuple[int, int, int, int, int]]:
    heads, states, content = page_shape(spec)
    size = (len(tensor.layers), config.num_blocks, heads, states, content)
    stride = compute_layout_strides(
        spec,
        config.num_blocks,
        len(tensor.layers),
        config.kv_cache_layout,
        block_stride=tensor.block_stride or None,
        layer_stride=tensor.layer_stride or None,
    )
    # The last byte any index reaches must lie inside the allocation.
    last = tensor.offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= tensor.size:
        raise ConfigError(
            f"layer {tensor.layers[0]!r}: its pages reach byte {last}, beyond the "
            f"KVCacheTensor.size of {tensor.size} bytes"
        )
    return size, stride


def layer_placements(config: KVCacheConfig) -> dict[str, LayerPlacement]:
    """Every layer's placement in the backing allocation, validated against the config.

    Raises:
        ConfigError: A tensor names a layer that no group holds, a layer is placed twice,
            tensors disagree on the allocation size, or a layer's pages overrun it.
    """
    specs = _layer_specs(tuple(config.kv_cache_groups))
    sizes = {tensor.size for tensor in config.kv_cache_tensors}
    if len(sizes) > 1:
        raise ConfigError(
            f"KVCacheTensor.size differs between tensors ({sorted(sizes)}); they must share "
            "one backing allocation"
        )
    placements: dict[str, LayerPlacement] = {}
    for tensor in config.kv_cache_tensors:
        missing = [name for name in tensor.layers if name not in specs]
        if missing:
            raise ConfigError(f"layer {missing[0]!r} of a KVCacheTensor is in no KV-cache group")
        spec = specs[tensor.layers[0]]
        if any(specs[name] != spec for name in tensor.layers):
            raise ConfigError(
                f"layers of one KVCacheTensor must share a spec ({tensor.layers[0]!r} differs)"
            )
        size, stride = _placement_of(tensor, spec, config)
        for index, name in enumerate(tensor.layers):
            if name in placements:
                raise ConfigError(f"layer {name!r} is placed by two KVCacheTensors")
            placements[name] = LayerPlacement(
                layer_name=name,
                spec=spec,
                size=size,
                stride=stride,
                offset=tensor.offset,
                layer_index=index,
            )
    return placements


def _view(buffer: torch.Tensor, placement: LayerPlacement) -> torch.Tensor:
    grid = torch.as_strided(
        buffer,
        size=placement.size,
        stride=placement.stride,
        storage_offset=buffer.storage_offset() + placement.offset,
    )
    layer = grid[placement.layer_index]
    dtype = placement.spec.attention_dtype()
    if dtype is not None:
        return layer.view(to_torch(dtype))
    return layer


def kv_cache_views(buffer: torch.Tensor, config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """Per-layer views of a caller's backing buffer, as the config places them.

    Args:
        buffer: A 1-D contiguous ``torch.int8`` tensor of at least the config's size.
        config: The rank's config.

    Returns:
        ``{layer name: view}``, in placement order.

    Raises:
        InvalidArgumentError: The buffer has the wrong dtype, shape or size.
        ConfigError: The config is inconsistent (see :func:`layer_placements`).
    """
    if buffer.dtype != torch.int8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise InvalidArgumentError(
            f"buffer must be a contiguous 1-D torch.int8 tensor, got {buffer.dtype} "
            f"with shape {tuple(buffer.shape)}"
        )
    placements = layer_placements(config)
    needed = max((t.size for t in config.kv_cache_tensors), default=0)
    if buffer.numel() < needed:
        raise InvalidArgumentError(
            f"buffer holds {buffer.numel()} bytes, the config needs {needed}"
        )
    return {name: _view(buffer, placement) for name, placement in placements.items()}


def allocate_kv_cache_tensors(
    kv_cache_config: KVCacheConfig, *, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Allocate one zeroed backing buffer for the config and view it per layer.

    Args:
        kv_cache_config: The rank's config (from registration or planning).
        device: The torch device (``"cpu"``, ``"cuda:0"``, ...).

    Returns:
        ``{layer name: view}``; empty for a config without tensors. The backing buffer is
        each view's storage (``view.untyped_storage()``).

    Raises:
        ConfigError: The config is inconsistent (checked before anything is allocated).
    """
    if not kv_cache_config.kv_cache_tensors:
        return {}
    layer_placements(kv_cache_config)
    size = kv_cache_config.kv_cache_tensors[0].size
    buffer = torch.zeros(size, dtype=torch.int8, device=torch.device(device))
    return kv_cache_views(buffer, kv_cache_config)


def layer_specs_of(config: KVCacheConfig) -> Mapping[str, KVCacheSpec]:
    """Each layer's own spec, by layer name (uniform-type groups unpacked)."""
    return _layer_specs(tuple(config.kv_cache_groups))


def _block_index(
    field: str, ids: Sequence[int], num_blocks: int, device: torch.device
) -> torch.Tensor:
    for position, block_id in enumerate(ids):
        if not 0 <= block_id < num_blocks:
            raise InvalidArgumentError(
                f"{field}[{position}]: block id {block_id} is outside 0..{num_blocks - 1}"
            )
    return torch.tensor(list(ids), dtype=torch.long, device=device)


def copy_block_pages(
    sources: Mapping[str, torch.Tensor],
    destinations: Mapping[str, torch.Tensor],
    pairs: Sequence[tuple[int, int]],
    *,
    field: str = "copies",
) -> None:
    """Copy block pages ``(source id, destination id)`` in every layer, batched per layer.

    ``sources`` and ``destinations`` are per-layer block tensors (block id first): the same
    mapping for copies within one set (copy-on-write), a device and a host set for swaps.
    Every source is read before any destination is written (one gather, one scatter per
    layer), so a block may be both a destination and a later pair's source.

    Raises:
        InvalidArgumentError: A block id is out of range, a destination appears twice, or
            the layer names differ; nothing is copied then.
    """
    if not pairs:
        return
    if set(sources) != set(destinations):
        raise InvalidArgumentError(f"{field}: the source and destination layers differ")
    targets = [dst for _, dst in pairs]
    if len(set(targets)) != len(targets):
        raise InvalidArgumentError(f"{field}: a destination block appears twice")
    checked = []
    for name, source in sources.items():
        destination = destinations[name]
        src = _block_index(f"{field}.source", [s for s, _ in pairs], source.shape[0], source.device)
        dst = _block_index(
            f"{field}.destination", targets, destination.shape[0], destination.device
        )
        checked.append((source, destination, src, dst))
    for source, destination, src, dst in checked:
        pages = source.index_select(0, src).to(destination.device, non_blocking=True)
        destination.index_copy_(0, dst, pages)


def allocate_host_blocks(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int, *, pin_memory: bool | None = None
) -> dict[str, torch.Tensor]:
    """Host block tensors shaped as the device layers' pages: ``num_blocks`` per layer.

    Args:
        kv_caches: The device layers (``{layer name: tensor}``, block id first).
        num_blocks: The host tier's blocks.
        pin_memory: Pin the buffers (faster, asynchronous copies); ``None``: when CUDA is
            available.
    """
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    return {
        name: torch.zeros(
            (num_blocks, *layer.shape[1:]), dtype=layer.dtype, device="cpu", pin_memory=pin
        )
        for name, layer in kv_caches.items()
    }
