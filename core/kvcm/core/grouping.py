"""KV-cache grouping: which layers share a block table, and each group's spec.

The rules are vLLM 0.33's (``vllm/v1/core/kv_cache_planning.py``: ``get_kv_cache_groups``
and the spec unification it relies on), tried in vLLM's order:

1. Hybrid manager disabled: sliding-window and chunked-local layers next to full attention
   are promoted to full attention (``unify_hybrid_kv_cache_specs``).
2. Every layer's spec merges into one: one group.
3. Every layer needs the same token slots (``UniformTypeKVCacheSpecs``): one group whose
   block is the sum of its layers' pages.
4. Block-outermost layouts with mixed page sizes: pages are packed side by side in a block
   (``_packed_groups``), nothing is unified.
5. Otherwise (hybrid): page sizes are unified (block size scaled up, or the page padded),
   layers are bucketed by mergeable spec, and buckets are cut into groups of equal layer
   count, layer ``i`` of a bucket going to group ``i % num_groups`` (strided), the last
   group of a bucket padded.

Also the cross-rank rules: a layer must have one spec on every rank that names it
(``merge_rank_specs``), and each rank sees the model's groups restricted to its own layers
(``project_groups_to_rank``). Pure and deterministic; bad input raises
:class:`~kvcm.common.errors.ConfigError` naming the layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcm.common.config import KVCacheGroupSpec, KVCacheLayout
from kvcm.common.errors import ConfigError
from kvcm.common.specs import (
    KVCacheSpec,
    StatePacking,
    UniformTypeKVCacheSpecs,
    check_plannable_spec,
)

__all__ = [
    "GroupingOptions",
    "get_kv_cache_groups",
    "merge_rank_specs",
    "project_groups_to_rank",
    "unify_hybrid_kv_cache_specs",
    "unify_kv_cache_spec_page_size",
]

_WINDOW_MISMATCH = "must have the same window size"


class GroupingOptions(Protocol):
    """The planning settings grouping reads.

    NOTE: grouping sits below planning (planning imports grouping, never the reverse);
    :class:`kvcm.core.planning.PlanningOptions` satisfies this protocol.
    """

    @property
    def enable_hybrid_manager(self) -> bool:
        """``False`` promotes local-attention layers to full attention."""
        ...

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        """Physical axis order of the workers' KV cache."""
        ...


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


# ----------------------------------------------------------------------------- spec rules
def _merges(specs: Sequence[KVCacheSpec]) -> bool:
    """Whether ``specs`` merge into one spec (vLLM's ``is_kv_cache_spec_uniform``).

    Layers of one full-attention kind with different recorded windows are an error, not a
    "no": vLLM lets that one through as well.
    """
    if not specs:
        return True
    try:
        type(specs[0]).merge(list(specs))
    except ConfigError as exc:
        if _WINDOW_MISMATCH in str(exc):
            raise
        return False
    return True


def _is_single_type(specs: Mapping[str, KVCacheSpec]) -> bool:
    return _merges(list(specs.values())) or UniformTypeKVCacheSpecs.is_uniform_type(specs)


def unify_hybrid_kv_cache_specs(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """The specs as the single-type manager sees them when the hybrid manager is disabled.

    Sliding-window and chunked-local layers of a model that also has full attention become
    :class:`FullAttentionSpec` (blocks for every token) recording their window or chunk, so
    the worker still computes local attention. Specs of one type come back unchanged.

    Args:
        specs: Each layer's spec.

    Returns:
        A new mapping, in the same layer order.

    Raises:
        ConfigError: The layers cannot be brought to one type (e.g. sliding window next to
            Mamba, or two different windows).
    """
    promoted = dict(specs)
    if _is_single_type(promoted):
        return promoted
    values = list(specs.values())
    has_full = any(s.traits.full_attention for s in values)
    has_local = any(s.traits.recycles_blocks for s in values)
    full_block_sizes = {s.block_size for s in values if s.traits.full_attention}
    full_block_size = next(iter(full_block_sizes)) if len(full_block_sizes) == 1 else None
    if has_full and has_local:
        for name, spec in specs.items():
            if spec.traits.recycles_blocks:
                promoted[name] = spec.promoted_to_full_attention(full_block_size or spec.block_size)
    if not _is_single_type(promoted):
        raise ConfigError("Failed to promote local KV cache specs to one unified type.")
    return promoted


def unify_kv_cache_spec_page_size(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Give every layer the largest page: a larger block size when it divides, else padding.

    Raises:
        ConfigError: A layer's page neither divides the largest nor can be padded (MLA).
    """
    page_sizes = {spec.page_size_bytes for spec in specs.values()}
    if len(page_sizes) <= 1:
        return dict(specs)
    max_page = max(page_sizes)
    unified: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        traits = spec.traits
        if page == max_page:
            unified[name] = spec
        elif not traits.can_scale_block_size and traits.can_pad_page:
            unified[name] = spec.with_padded_page(max_page)
        elif max_page % page == 0:
            unified[name] = spec.copy_with_new_block_size(spec.block_size * (max_page // page))
        elif traits.can_pad_page:
            unified[name] = spec.with_padded_page(max_page)
        else:
            raise ConfigError(
                f"Layer {name}: page size is not divisible by the maximum page size and "
                "cannot be padded. Padding is only supported for non-MLA attention layers."
            )
    return unified


def _uniform_type_group(spec: UniformTypeKVCacheSpecs) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layer_names=tuple(spec.kv_cache_specs), kv_cache_spec=spec)


def _merged_group(specs: Mapping[str, KVCacheSpec], names: Sequence[str]) -> KVCacheGroupSpec:
    layer_specs = [specs[name] for name in names]
    merged = type(layer_specs[0]).merge(layer_specs)
    return KVCacheGroupSpec(layer_names=tuple(names), kv_cache_spec=merged)


def _hybrid_groups(specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Groups of equal layer count for a model whose layers share one page size."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    # Buckets: specs that merge (e.g. full attention differing only in a recorded window)
    # share a bucket, which keeps the number of groups down.
    bucket_names: list[list[str]] = []
    bucket_specs: list[list[KVCacheSpec]] = []
    for spec, names in by_spec.items():
        for b_names, b_specs in zip(bucket_names, bucket_specs, strict=True):
            try:
                type(b_specs[0]).merge([*b_specs, spec])
            except ConfigError:
                continue
            b_names.extend(names)
            b_specs.append(spec)
            break
        else:
            bucket_names.append(list(names))
            bucket_specs.append([spec])
    sizes = [len(names) for names in bucket_names]
    # The "1" of an n:1 pattern sets the group size, unless the buckets are nearly equal,
    # where one group per bucket pads less (12 sliding + 13 full -> 13 + 13).
    group_size = min(sizes)
    if max(sizes) < min(sizes) * 1.5:
        group_size = max(sizes)
    grouped: list[list[str]] = []
    for names in bucket_names:
        num_groups = _cdiv(len(names), group_size)
        # Strided, so pipeline stages holding consecutive layers pad the least.
        grouped.extend(names[i::num_groups] for i in range(num_groups))
    return [_merged_group(specs, names) for names in grouped]


def _full_allocation_fallback(specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec] | None:
    """MLA next to sliding window, pages not unifiable: allocate the window layers fully.

    In traits: full attention whose page cannot be padded (MLA) next to local attention whose
    hits need no shared block size (sliding window), and no chunked local attention.
    """
    values = [s.traits for s in specs.values()]
    if any(t.hit_needs_shared_block_size for t in values):
        return None
    has_mla = any(t.full_attention and not t.can_pad_page for t in values)
    has_swa = any(t.recycles_blocks for t in values)
    if not (has_mla and has_swa):
        return None
    try:
        promoted = unify_hybrid_kv_cache_specs(specs)
    except ConfigError:
        return None
    uniform = UniformTypeKVCacheSpecs.from_specs(promoted)
    return None if uniform is None else [_uniform_type_group(uniform)]


def _least_padding_divisor(values: Sequence[int], lower_bound: int) -> int:
    """The ``d >= lower_bound`` that pads ``values`` up to multiples of ``d`` the least.

    Ties go to the larger ``d``; candidates stop at ``max(values)``.
    """
    best, best_padding = lower_bound, -1
    for divisor in range(lower_bound, max(values) + 1):
        padding = sum(-value % divisor for value in values)
        if best_padding < 0 or padding <= best_padding:
            best, best_padding = divisor, padding
    return best


@dataclass(frozen=True, slots=True)
class _Bucket:
    """Layers of one type (a uniform-type spec), by page size, for block-outermost packing."""

    spec: UniformTypeKVCacheSpecs
    by_page: dict[int, list[str]]

    @property
    def balanced(self) -> bool:
        """Every page size has as many layers (a repeating one-layer-per-page pattern)."""
        return len({len(names) for names in self.by_page.values()}) == 1

    @property
    def repeats(self) -> int:
        return self.spec.get_max_layers_per_page_size()

    def group_bytes(self, num_groups: int) -> int:
        """Page bytes of the widest of ``num_groups`` groups cut from this bucket."""
        return sum(_cdiv(len(names), num_groups) * page for page, names in self.by_page.items())


def _buckets_of_one_type(specs: Mapping[str, KVCacheSpec]) -> list[_Bucket]:
    """Layers bucketed greedily: each joins the first bucket it keeps uniform-type."""
    members: list[dict[str, KVCacheSpec]] = []
    for name, spec in specs.items():
        for bucket in members:
            if UniformTypeKVCacheSpecs.is_uniform_type({**bucket, name: spec}):
                bucket[name] = spec
                break
        else:
            members.append({name: spec})
    buckets = []
    for bucket in members:
        by_page: dict[int, list[str]] = {}
        for name, spec in bucket.items():
            by_page.setdefault(spec.page_size_bytes, []).append(name)
        uniform = UniformTypeKVCacheSpecs(
            block_size=next(iter(bucket.values())).block_size, kv_cache_specs=bucket
        )
        buckets.append(_Bucket(uniform, by_page))
    return buckets


def _packed_groups(specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Groups for a block-outermost layout whose layers' pages differ in size.

    Pages sit side by side inside a block, so nothing is unified: layers of one type form a
    bucket, and buckets repeating a one-layer-per-page-size pattern are cut into groups of
    the same number of repeats (chosen to pad the least, never splitting a mixed-page
    bucket's pattern), so every group packs into the same block. State buckets (Mamba;
    sliding window when no pattern sets the repeats) are cut so that a group fits the
    block the others already need.

    Raises:
        ConfigError: A state bucket of unequal page-size counts would have to be cut.
    """
    buckets = _buckets_of_one_type(specs)
    floor = max((b.repeats for b in buckets if b.balanced and len(b.by_page) > 1), default=0)
    repeats = (
        _least_padding_divisor([b.repeats for b in buckets if b.balanced], floor) if floor else None
    )

    def num_groups(bucket: _Bucket) -> int:
        return 1 if repeats is None or not bucket.balanced else _cdiv(bucket.repeats, repeats)

    def is_state(bucket: _Bucket) -> bool:
        packing = bucket.spec.first_spec.traits.state_packing
        return packing is StatePacking.ALWAYS or (
            repeats is None and packing is StatePacking.WITHOUT_PATTERN
        )

    block_bytes = max(
        b.group_bytes(len(b.spec.kv_cache_specs) if is_state(b) else num_groups(b)) for b in buckets
    )
    groups: list[KVCacheGroupSpec] = []
    for bucket in buckets:
        count = num_groups(bucket)
        if is_state(bucket):
            per_block = max(block_bytes // bucket.spec.first_spec.page_size_bytes, 1)
            count = max(count, _cdiv(len(bucket.spec.kv_cache_specs), per_block))
        if count == 1:
            groups.append(_uniform_type_group(bucket.spec))
            continue
        if not bucket.balanced:
            raise ConfigError(
                f"Packing {len(bucket.spec.kv_cache_specs)} {bucket.spec.kind} layers of "
                f"unequal page-size counts into {count} block-outermost groups is not "
                "implemented"
            )
        pattern = list(zip(*bucket.by_page.values(), strict=True))
        for index in range(count):
            names = [name for repeat in pattern[index::count] for name in repeat]
            uniform = UniformTypeKVCacheSpecs(
                block_size=bucket.spec.block_size,
                kv_cache_specs={name: bucket.spec.kv_cache_specs[name] for name in names},
            )
            groups.append(_uniform_type_group(uniform))
    return groups


def get_kv_cache_groups(
    specs: Mapping[str, KVCacheSpec], options: GroupingOptions
) -> tuple[KVCacheGroupSpec, ...]:
    """Split the model's layers into groups that share one block table.

    Args:
        specs: Every layer's spec (all ranks' layers), in layer order.
        options: Planning options (``enable_hybrid_manager``, ``kv_cache_layout``).

    Returns:
        The groups, in group-id order; empty for an attention-free model.

    Raises:
        ConfigError: The specs cannot be grouped (see the module docstring).
    """
    if not options.enable_hybrid_manager:
        specs = unify_hybrid_kv_cache_specs(specs)
    if not specs:
        return ()
    if _merges(list(specs.values())):
        return (_merged_group(specs, list(specs)),)
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    if uniform is not None:
        return (_uniform_type_group(uniform),)
    if options.kv_cache_layout.is_block_outermost and (
        len({spec.page_size_bytes for spec in specs.values()}) > 1
    ):
        return tuple(_packed_groups(specs))
    try:
        unified = unify_kv_cache_spec_page_size(specs)
    except ConfigError:
        fallback = _full_allocation_fallback(specs)
        if fallback is None:
            raise
        return tuple(fallback)
    return tuple(_hybrid_groups(unified))


def merge_rank_specs(rank_specs: Sequence[Mapping[str, KVCacheSpec]]) -> dict[str, KVCacheSpec]:
    """The model's specs: every rank's layers, the first rank's order first.

    Raises:
        ConfigError: A layer's spec differs between ranks (names the layer and the ranks), or
            a layer is encoder-only (it keeps no KV cache across steps: vLLM's workers add
            such layers after planning, so they are not registered), or a layer kvcm cannot
            plan yet (a Mamba layer in "align" mode).
        InvalidArgumentError: A layer's page does not fit a uint64.
    """
    merged: dict[str, KVCacheSpec] = {}
    first_rank: dict[str, int] = {}
    for rank, specs in enumerate(rank_specs):
        for name, spec in specs.items():
            if not isinstance(spec, KVCacheSpec):
                raise ConfigError(
                    f"rank {rank}: layer {name!r} has no KVCacheSpec (got {type(spec).__name__})"
                )
            if not spec.traits.keeps_kv_cache:
                raise ConfigError(
                    f"rank {rank}: layer {name!r} is encoder-only and needs no planned KV "
                    "cache; leave it out of the registered specs"
                )
            check_plannable_spec(name, spec, f"rank_specs[{rank}]")
            known = merged.get(name)
            if known is None:
                merged[name] = spec
                first_rank[name] = rank
            elif known != spec:
                raise ConfigError(
                    f"The KV cache specs for layer {name!r} differ between rank "
                    f"{first_rank[name]} and rank {rank}: {known!r} != {spec!r}"
                )
    return merged


def project_groups_to_rank(
    groups: Sequence[KVCacheGroupSpec], rank_specs: Mapping[str, KVCacheSpec]
) -> tuple[KVCacheGroupSpec, ...]:
    """The model's groups restricted to the layers one rank holds (pipeline stages)."""
    projected: list[KVCacheGroupSpec] = []
    for group in groups:
        names = tuple(name for name in group.layer_names if name in rank_specs)
        if len(names) == len(group.layer_names):
            projected.append(group)
            continue
        spec = group.kv_cache_spec
        if names and isinstance(spec, UniformTypeKVCacheSpecs):
            spec = UniformTypeKVCacheSpecs(
                block_size=spec.block_size,
                kv_cache_specs={name: spec.kv_cache_specs[name] for name in names},
            )
        projected.append(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec))
    return tuple(projected)
