"""KV-cache specs: what one layer needs per block, shared by workers, schedulers and the server.

The types and field names follow vLLM 0.33's ``kv_cache_interface`` so that a spec means the
same thing on both sides, with two deliberate differences: ``dtype`` is a wire-friendly
:class:`~kvcm.common.dtypes.DType` instead of a ``torch.dtype``, and sizing takes explicit
:class:`SizingLimits` instead of a whole engine config.

Hierarchy::

    KVCacheSpec
    ├── AttentionSpec
    │   ├── FullAttentionSpec ── MLAAttentionSpec, SinkFullAttentionSpec
    │   ├── SlidingWindowSpec
    │   ├── ChunkedLocalAttentionSpec
    │   ├── CrossAttentionSpec
    │   └── EncoderOnlyAttentionSpec
    ├── MambaSpec
    └── UniformTypeKVCacheSpecs   (several layers of one type sharing a block table)

Every spec validates its fields on construction and raises
:class:`~kvcm.common.errors.InvalidArgumentError` naming the field.

Traits. What the rest of kvcm asks of an attention type is declared once, on its spec class:
``kind`` (the ``kv_cache_spec_kind`` of KV events) and ``traits`` (a :class:`SpecTraits`:
wire tag and the fields that do not travel, snapshot support, vLLM's class name, block
recycling, retention, zeroing, grouping and prefix-caching rules), plus a few methods whose
answer depends on the type's fields (``page_shape``, ``attention_dtype``,
``partial_block_hits``, ``max_admission_blocks_per_request``, ...). Planning, grouping, the
coordinator, the managers, the wire and snapshot codecs and the vLLM converter read those
(the codecs and the converter build their tables from :func:`spec_classes`) instead of
testing types, so a new attention type touches its spec class here, its manager in
:mod:`kvcm.core.single_type_managers` (with that module's spec-to-manager table), its
``kvcm.v1`` message, and tests.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import ClassVar, Final, Self

from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError, InvalidArgumentError

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "MambaSpec",
    "SinkFullAttentionSpec",
    "SizingLimits",
    "SlidingWindowSpec",
    "SpecTraits",
    "StatePacking",
    "UINT64_MAX",
    "UniformTypeKVCacheSpecs",
    "check_plannable_spec",
    "spec_classes",
    "pins_hash_block_size",
]

UINT64_MAX: Final = (1 << 64) - 1
"""The largest byte count the wire (and a worker's allocator) can carry."""


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def _check_int(owner: object, name: str, value: object, *, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise InvalidArgumentError(
            f"{type(owner).__name__}.{name} must be a {bound} int, got {value!r}"
        )


def _check_optional_int(owner: object, name: str, value: object, *, minimum: int = 1) -> None:
    if value is not None:
        _check_int(owner, name, value, minimum=minimum)


def _check_padding(owner: object, padded: int | None, real: int) -> None:
    _check_optional_int(owner, "page_size_padded", padded)
    if padded is not None and padded < real:
        raise InvalidArgumentError(
            f"{type(owner).__name__}.page_size_padded ({padded}) is smaller than the page it "
            f"pads ({real} bytes)"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SizingLimits:
    """The engine limits that bound how much KV cache one request can hold.

    Attributes:
        max_model_len: Longest sequence (prompt + output) a request may reach.
        max_in_flight_tokens: Tokens scheduled but not yet settled (vLLM: concurrent batches
            times ``max_num_batched_tokens``); sliding-window and chunked-local layers
            reserve for them. ``None`` means ``max_model_len``.
        max_num_encoder_input_tokens: Encoder length cross-attention layers cache.
        mamba_cache_mode: vLLM's ``CacheConfig.mamba_cache_mode``: ``"none"`` or ``"align"``
            (prefix caching of hybrid Mamba models).
    """

    max_model_len: int
    max_in_flight_tokens: int | None = None
    max_num_encoder_input_tokens: int = 0
    mamba_cache_mode: str = "none"

    def __post_init__(self) -> None:
        _check_int(self, "max_model_len", self.max_model_len, minimum=1)
        _check_optional_int(self, "max_in_flight_tokens", self.max_in_flight_tokens)
        _check_int(
            self, "max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, minimum=0
        )

    @property
    def in_flight_tokens(self) -> int:
        """``max_in_flight_tokens`` with its default applied."""
        if self.max_in_flight_tokens is None:
            return self.max_model_len
        return self.max_in_flight_tokens


@enum.unique
class StatePacking(enum.Enum):
    """When block-outermost packing treats a bucket of this type as per-request state.

    A state bucket may be cut down to one layer per group, so that its groups fit the block
    the other buckets already need.
    """

    NEVER = "never"
    ALWAYS = "always"
    """Fixed-size states (Mamba)."""
    WITHOUT_PATTERN = "without_pattern"
    """Only when no bucket repeats a page-size pattern that fixes the groups (sliding window)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecTraits:
    """What kvcm's layers ask of an attention type, declared once per spec class.

    Attributes:
        wire_tag: The ``kvcm.v1.KVCacheSpec`` oneof field that carries this spec.
        full_attention: A block for every token; hits are downward closed (a hit's prefix is
            a hit), so the hybrid coordinator looks these groups up first and only trims them.
            Also what local attention is promoted to when the hybrid manager is disabled.
        recycles_blocks: Local attention: blocks that fall out of the window or chunk are
            freed (null blocks in the table), the admission reservation is capped, and the
            layer is promoted to full attention when the hybrid manager is disabled.
        hit_needs_shared_block_size: With prefix caching, every group must share this
            group's block size (chunked local attention's hits are chunk aligned).
        needs_kv_cache_zeroing: Blocks are read before they are fully written (Mamba states),
            so workers zero newly allocated blocks.
        pins_hash_block_size: The hash block size is the scheduler block size, never the gcd
            of the groups' block sizes.
        can_scale_block_size: Page unification may grow the block size to reach the largest
            page (otherwise the page is padded).
        can_pad_page: Page unification may pad the page (MLA pages cannot be padded).
        state_packing: When block-outermost packing treats a bucket as per-request state.
        prefix_caching_unsupported: Why kvcm cannot prefix cache this type (the error names
            it), or ``None``.
        keeps_kv_cache: ``False`` for layers that keep nothing across steps (encoder-only):
            they are not registered for planning.
        sparse_retention: ``prefix_cache_retention_interval`` applies: the type drops blocks
            behind a request's progress, so a retention interval keeps some (vLLM: sliding
            window and Mamba).
        not_on_the_wire: Spec fields that do not travel in ``kvcm.v1`` (the server never
            needs them); the decoded spec has their defaults.
        snapshot: A pool's snapshot may hold this spec (a rank's registered layer specs).
        vllm_class: The name of vLLM 0.33's spec class that the vLLM integration converts to
            this one; ``None``: the integration refuses the type.
        eagle_block_drop: A hit may drop its last block for an EAGLE drafter (vLLM refuses the
            drop on a chunked local attention group).
    """

    wire_tag: str
    full_attention: bool = False
    recycles_blocks: bool = False
    hit_needs_shared_block_size: bool = False
    needs_kv_cache_zeroing: bool = False
    pins_hash_block_size: bool = False
    can_scale_block_size: bool = True
    can_pad_page: bool = False
    state_packing: StatePacking = StatePacking.NEVER
    prefix_caching_unsupported: str | None = None
    keeps_kv_cache: bool = True
    sparse_retention: bool = False
    not_on_the_wire: frozenset[str] = frozenset()
    snapshot: bool = True
    vllm_class: str | None = None
    eagle_block_drop: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheSpec:
    """The KV-cache format of one layer.

    Attributes:
        block_size: Tokens per block.
    """

    kind: ClassVar[str] = "unknown"
    """The spec kind vLLM reports in KV events (``kv_cache_spec_kind``)."""
    traits: ClassVar[SpecTraits] = SpecTraits(wire_tag="")
    """What the core asks of this type (see :class:`SpecTraits`)."""

    block_size: int

    def __post_init__(self) -> None:
        _check_int(self, "block_size", self.block_size, minimum=1)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """Bytes one request can hold at most in this layer."""
        raise NotImplementedError

    def max_num_blocks_per_req(self, limits: SizingLimits, max_len: int) -> int:
        """Block-table entries one request needs (the worker's block-table row length)."""
        del limits
        return _cdiv(max_len, self.block_size)

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int | None:
        """Blocks a request holds at most, for types that recycle blocks; else ``None``."""
        del max_in_flight_tokens, max_model_len
        return None

    def page_shape(self) -> tuple[int, int, int]:
        """``(H, N, C)`` of one page: heads, states (tokens) and content bytes per cell.

        Raises:
            ConfigError: The type has no per-layer page shape.
        """
        raise ConfigError(f"{type(self).__name__} has no per-layer page shape")

    @property
    def padded_page_size_bytes(self) -> int | None:
        """The page size a ``page_size_padded`` field sets, or ``None`` when unpadded."""
        return None

    def with_padded_page(self, page_size_bytes: int) -> Self:
        """The same spec with its page padded to ``page_size_bytes`` (``traits.can_pad_page``).

        Raises:
            ConfigError: The type's pages cannot be padded.
        """
        raise ConfigError(f"{type(self).__name__} pages cannot be padded")

    def promoted_to_full_attention(self, block_size: int) -> FullAttentionSpec:
        """The full-attention spec this local-attention layer becomes when the hybrid manager
        is disabled (``traits.recycles_blocks``), recording its window or chunk.

        Raises:
            ConfigError: The type is not local attention.
        """
        del block_size
        raise ConfigError(f"{type(self).__name__} cannot be promoted to full attention")

    def attention_dtype(self) -> DType | None:
        """The element type of an attention layer's keys and values; ``None`` otherwise."""
        return None

    def event_sliding_window(self) -> int | None:
        """The ``sliding_window`` vLLM reports in this group's KV events."""
        return None

    @property
    def partial_block_hits(self) -> bool:
        """Whether prefix-cache hits may end inside this layer's blocks (a state per hash
        block: vLLM's align-mode Mamba), so a hybrid pool may serve sub-block hits and the
        hash block size is not pinned to the scheduler's."""
        return False

    def copy_with_new_block_size(self, block_size: int) -> Self:
        """The same spec with another block size."""
        return replace(self, block_size=block_size)

    def is_uniform_with(self, specs: Mapping[str, KVCacheSpec]) -> bool:
        """Whether every spec in ``specs`` needs the same token slots as this one."""
        base = self.uniform_base()
        return all(isinstance(spec, base) for spec in specs.values())

    @classmethod
    def uniform_base(cls) -> type[KVCacheSpec]:
        """The class whose instances may share one uniform-type group with this one."""
        return cls

    @classmethod
    def merge(cls, specs: Sequence[Self]) -> Self:
        """Merge the specs of the layers of one group into the group's spec.

        Raises:
            ConfigError: The layers' specs differ.
        """
        if not specs:
            raise ConfigError("cannot merge an empty list of KV-cache specs")
        first = specs[0]
        if any(spec != first for spec in specs[1:]):
            raise ConfigError("All layers in the same KV cache group must be the same.")
        return first


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer: keys and values per token and KV head.

    Attributes:
        num_kv_heads: KV heads held by this rank.
        head_size: Key head size.
        dtype: Element type.
        head_size_v: Value head size; ``None`` means ``head_size``.
        page_size_padded: Page size in bytes after padding, if padded.
    """

    traits: ClassVar[SpecTraits] = SpecTraits(wire_tag="", can_pad_page=True)

    num_kv_heads: int
    head_size: int
    dtype: DType
    head_size_v: int | None = None
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _check_int(self, "num_kv_heads", self.num_kv_heads, minimum=1)
        _check_int(self, "head_size", self.head_size, minimum=1)
        object.__setattr__(self, "dtype", DType.parse(self.dtype, f"{type(self).__name__}.dtype"))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        _check_int(self, "head_size_v", self.head_size_v, minimum=0)
        _check_padding(self, self.page_size_padded, self.real_page_size_bytes)

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block before padding."""
        head_size_v = self.head_size if self.head_size_v is None else self.head_size_v
        return (
            self.block_size
            * self.num_kv_heads
            * (self.head_size + head_size_v)
            * self.dtype.itemsize
        )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block, padding included."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def page_shape(self) -> tuple[int, int, int]:
        """Heads, tokens, and key plus value bytes per head and token."""
        head_size_v = self.head_size if self.head_size_v is None else self.head_size_v
        return (
            self.num_kv_heads,
            self.block_size,
            (self.head_size + head_size_v) * (self.dtype.itemsize),
        )

    @property
    def padded_page_size_bytes(self) -> int | None:
        """``page_size_padded``."""
        return self.page_size_padded

    def with_padded_page(self, page_size_bytes: int) -> Self:
        """The same spec with ``page_size_padded`` set."""
        return replace(self, page_size_padded=page_size_bytes)

    def attention_dtype(self) -> DType | None:
        """``dtype``."""
        return self.dtype

    def _as_full_attention(
        self, block_size: int, *, sliding_window: int | None, attention_chunk_size: int | None
    ) -> FullAttentionSpec:
        padded = self.page_size_padded
        if padded is not None:
            # A padded page grows with the block size; padding never shrinks it below the data.
            padded = max(padded, self.real_page_size_bytes * block_size // self.block_size)
        return FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            head_size_v=self.head_size_v,
            dtype=self.dtype,
            page_size_padded=padded,
            sliding_window=sliding_window,
            attention_chunk_size=attention_chunk_size,
        )

    def _attention_fields_equal(self, other: AttentionSpec) -> bool:
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(AttentionSpec))


def _merge_window(values: set[int], what: str) -> int | None:
    if len(values) > 1:
        raise ConfigError(
            f"All attention layers in the same KV cache group must have the same {what}."
        )
    return next(iter(values)) if values else None


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: a request keeps a block for every token.

    When the hybrid allocator is disabled, sliding-window and chunked-local layers are
    managed as full attention and their window is recorded here for the worker.

    Attributes:
        sliding_window: Recorded window of a promoted sliding-window layer, if any.
        attention_chunk_size: Recorded chunk of a promoted chunked-local layer, if any.
        non_causal: Whether the layer attends non-causally (prefix LM).
    """

    kind: ClassVar[str] = "full_attention"
    traits: ClassVar[SpecTraits] = SpecTraits(
        wire_tag="full_attention",
        full_attention=True,
        can_pad_page=True,
        not_on_the_wire=frozenset({"non_causal"}),
        vllm_class="FullAttentionSpec",
    )

    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        _check_optional_int(self, "sliding_window", self.sliding_window)
        _check_optional_int(self, "attention_chunk_size", self.attention_chunk_size)

    @classmethod
    def uniform_base(cls) -> type[KVCacheSpec]:
        """MLA and sink layers group with full attention."""
        return FullAttentionSpec

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """A block for every token up to ``max_model_len``."""
        return _cdiv(limits.max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: Sequence[Self]) -> Self:
        """Merge full-attention layers; recorded windows must agree.

        Raises:
            ConfigError: The layers differ in their attention fields or windows, or mix a
                sliding window with chunked-local attention.
        """
        if not specs:
            raise ConfigError("cannot merge an empty list of KV-cache specs")
        if not all(isinstance(spec, FullAttentionSpec) for spec in specs):
            raise ConfigError(
                "All attention layers in the same KV cache group must be FullAttentionSpec."
            )
        if cls is not MLAAttentionSpec and any(isinstance(s, MLAAttentionSpec) for s in specs):
            raise ConfigError("MLAAttentionSpec layers merge with MLAAttentionSpec.merge")
        windows = {s.sliding_window for s in specs if s.sliding_window is not None}
        chunks = {s.attention_chunk_size for s in specs if s.attention_chunk_size is not None}
        merged = replace(
            specs[0],
            sliding_window=_merge_window(windows, "window size"),
            attention_chunk_size=_merge_window(chunks, "window size"),
            non_causal=any(s.non_causal for s in specs),
        )
        if not all(merged._attention_fields_equal(s) for s in specs):
            raise ConfigError(
                "All attention layers in the same KV cache group must have the same attention spec."
            )
        if merged.sliding_window is not None and merged.attention_chunk_size is not None:
            raise ConfigError(
                "Model with both sliding window layers and chunked local attention layers "
                "is not supported."
            )
        return merged


@dataclass(frozen=True, slots=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token, no separate values.

    Attributes:
        cache_dtype_str: The cache dtype string the backend was configured with.
        alignment: Page-size alignment in bytes (pages are padded up to it), if any.
    """

    kind: ClassVar[str] = "mla_attention"
    traits: ClassVar[SpecTraits] = SpecTraits(
        wire_tag="mla_attention",
        full_attention=True,
        not_on_the_wire=frozenset(
            {"non_causal", "sliding_window", "attention_chunk_size", "alignment"}
        ),
        vllm_class="MLAAttentionSpec",
    )

    head_size_v: int | None = 0
    cache_dtype_str: str | None = None
    alignment: int | None = None

    def __post_init__(self) -> None:
        FullAttentionSpec.__post_init__(self)
        _check_optional_int(self, "alignment", self.alignment)
        if self.alignment is not None:
            real = self.real_page_size_bytes
            padded = _cdiv(real, self.alignment) * self.alignment
            if padded != real:
                object.__setattr__(self, "page_size_padded", padded)

    @classmethod
    def merge(cls, specs: Sequence[Self]) -> Self:
        """Merge MLA layers; quantisation and attention fields must agree.

        Raises:
            ConfigError: The layers differ.
        """
        if not specs or not all(isinstance(spec, MLAAttentionSpec) for spec in specs):
            raise ConfigError(
                "All attention layers in the same KV cache group must be MLAAttentionSpec."
            )
        if len({spec.cache_dtype_str for spec in specs}) != 1:
            raise ConfigError(
                "All attention layers in the same KV cache group must use the same "
                "quantization method."
            )
        # Two-argument super: slotted dataclasses are rebuilt, so the implicit form fails.
        return super(MLAAttentionSpec, cls).merge(specs)


@dataclass(frozen=True, slots=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with attention-sink tokens.

    Attributes:
        sink_len: Number of sink tokens, if known.
    """

    kind: ClassVar[str] = "sink_full_attention"
    traits: ClassVar[SpecTraits] = SpecTraits(
        wire_tag="sink_full_attention",
        full_attention=True,
        can_pad_page=True,
        not_on_the_wire=frozenset({"non_causal", "sliding_window", "attention_chunk_size"}),
    )

    sink_len: int | None = None

    def __post_init__(self) -> None:
        FullAttentionSpec.__post_init__(self)
        _check_optional_int(self, "sink_len", self.sink_len, minimum=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a token reads the ``sliding_window`` tokens ending at it.

    Attributes:
        sliding_window: Window length in tokens.
        extra_retained_tokens: Tokens kept below the window (multi-token speculative
            re-prefill), counted when sizing.
    """

    kind: ClassVar[str] = "sliding_window"
    traits: ClassVar[SpecTraits] = SpecTraits(
        wire_tag="sliding_window",
        recycles_blocks=True,
        can_pad_page=True,
        state_packing=StatePacking.WITHOUT_PATTERN,
        sparse_retention=True,
        not_on_the_wire=frozenset({"extra_retained_tokens"}),
        vllm_class="SlidingWindowSpec",
    )

    sliding_window: int
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        _check_int(self, "sliding_window", self.sliding_window, minimum=1)
        _check_int(self, "extra_retained_tokens", self.extra_retained_tokens, minimum=0)

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Blocks a request holds at most: the window, the in-flight tokens, one partial."""
        num_tokens = min(
            self.sliding_window - 1 + self.extra_retained_tokens + max_in_flight_tokens,
            max_model_len,
        )
        # +1: the window need not start at a block boundary.
        return _cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """The admission cap in bytes."""
        blocks = self.max_admission_blocks_per_request(
            limits.in_flight_tokens, limits.max_model_len
        )
        return blocks * self.page_size_bytes

    def promoted_to_full_attention(self, block_size: int) -> FullAttentionSpec:
        """Full attention recording the window."""
        return self._as_full_attention(
            block_size, sliding_window=self.sliding_window, attention_chunk_size=None
        )

    def event_sliding_window(self) -> int | None:
        """The window."""
        return self.sliding_window

    def is_uniform_with(self, specs: Mapping[str, KVCacheSpec]) -> bool:
        """Uniform only with sliding-window layers of the same window."""
        return all(
            isinstance(spec, SlidingWindowSpec) and spec.sliding_window == self.sliding_window
            for spec in specs.values()
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention: a token reads only the tokens of its own chunk.

    Attributes:
        attention_chunk_size: Chunk length in tokens.
    """

    kind: ClassVar[str] = "chunked_local_attention"
    traits: ClassVar[SpecTraits] = SpecTraits(
        wire_tag="chunked_local_attention",
        recycles_blocks=True,
        hit_needs_shared_block_size=True,
        can_pad_page=True,
        vllm_class="ChunkedLocalAttentionSpec",
        eagle_block_drop=False,
    )

    attention_chunk_size: int

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        _check_int(self, "attention_chunk_size", self.attention_chunk_size, minimum=1)

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Blocks a request holds at most: one chunk plus the in-flight tokens."""
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return _cdiv(num_tokens, self.block_size)

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """The admission cap in bytes."""
        blocks = self.max_admission_blocks_per_request(
            limits.in_flight_tokens, limits.max_model_len
        )
        return blocks * self.page_size_bytes

    def promoted_to_full_attention(self, block_size: int) -> FullAttentionSpec:
        """Full attention recording the chunk."""
        return self._as_full_attention(
            block_size, sliding_window=None, attention_chunk_size=self.attention_chunk_size
        )

    def is_uniform_with(self, specs: Mapping[str, KVCacheSpec]) -> bool:
        """Uniform only with chunked-local layers of the same chunk."""
        return all(
            isinstance(spec, ChunkedLocalAttentionSpec)
            and spec.attention_chunk_size == self.attention_chunk_size
            for spec in specs.values()
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Cross attention of an encoder-decoder model: caches the encoder's states."""

    kind: ClassVar[str] = "cross_attention"
    traits: ClassVar[SpecTraits] = SpecTraits(
        wire_tag="cross_attention",
        can_pad_page=True,
        prefix_caching_unsupported=(
            "cross attention cannot be prefix cached; "
            "disable enable_caching for encoder-decoder models"
        ),
    )

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """Blocks for the longest encoder input."""
        return _cdiv(limits.max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Encoder-only attention: needs no KV cache across steps."""

    kind: ClassVar[str] = "encoder_only_attention"
    traits: ClassVar[SpecTraits] = SpecTraits(
        wire_tag="encoder_only_attention", can_pad_page=True, keeps_kv_cache=False
    )

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """Nothing is cached."""
        del limits
        return 0


@dataclass(frozen=True, slots=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A Mamba (state-space) layer: fixed-size states per request, not per token.

    Attributes:
        shapes: Shape of each state tensor of one block.
        dtypes: Element type of each state tensor.
        page_size_padded: Page size in bytes after padding, if padded.
        mamba_type: The Mamba variant (``"mamba2"``, ...).
        mamba_cache_mode: ``"none"``: only the latest state is kept; ``"align"``: states at
            block boundaries are checkpoints that may enter the prefix cache.
        num_speculative_blocks: Extra blocks for speculative decoding.
        num_prefill_checkpoint_blocks: Align mode: blocks reserved for a checkpoint the
            backend exports inside a prefill chunk (0: chunks end at checkpoints instead).
        prefill_checkpoint_alignment: Token granularity at which the backend can export such
            a checkpoint, if it can.
    """

    kind: ClassVar[str] = "mamba"
    traits: ClassVar[SpecTraits] = SpecTraits(
        wire_tag="mamba",
        needs_kv_cache_zeroing=True,
        pins_hash_block_size=True,
        can_scale_block_size=False,
        can_pad_page=True,
        state_packing=StatePacking.ALWAYS,
        sparse_retention=True,
        vllm_class="MambaSpec",
    )

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[DType, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        shapes = tuple(tuple(shape) for shape in self.shapes)
        if not shapes:
            raise InvalidArgumentError("MambaSpec.shapes must name at least one state")
        for shape in shapes:
            if not shape or any(type(d) is not int or d <= 0 for d in shape):
                raise InvalidArgumentError(
                    f"MambaSpec.shapes must hold positive int dimensions, got {shape!r}"
                )
        dtypes = tuple(DType.parse(d, "MambaSpec.dtypes") for d in self.dtypes)
        if len(dtypes) != len(shapes):
            raise InvalidArgumentError(
                f"MambaSpec.dtypes has {len(dtypes)} entries for {len(shapes)} shapes"
            )
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        _check_int(self, "num_speculative_blocks", self.num_speculative_blocks, minimum=0)
        _check_int(
            self, "num_prefill_checkpoint_blocks", self.num_prefill_checkpoint_blocks, minimum=0
        )
        _check_optional_int(self, "prefill_checkpoint_alignment", self.prefill_checkpoint_alignment)
        _check_padding(self, self.page_size_padded, self.real_page_size_bytes)

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block's states before padding."""
        return sum(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block, padding included."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def page_shape(self) -> tuple[int, int, int]:
        """One cell holding all of a block's states."""
        return 1, 1, self.real_page_size_bytes

    @property
    def padded_page_size_bytes(self) -> int | None:
        """``page_size_padded``."""
        return self.page_size_padded

    def with_padded_page(self, page_size_bytes: int) -> Self:
        """The same spec with ``page_size_padded`` set."""
        return replace(self, page_size_padded=page_size_bytes)

    @property
    def partial_block_hits(self) -> bool:
        """In vLLM's "align" mode a state is kept per hash block, so hits may end inside a
        block."""
        return self.mamba_cache_mode == "align"

    def _align(self, limits: SizingLimits) -> bool:
        # The layer's own mode (what its worker reports) or the engine's.
        return self.mamba_cache_mode == "align" or limits.mamba_cache_mode == "align"

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """The latest state (in align mode also the state read and a prefill checkpoint)
        plus the speculative blocks."""
        live = 2 + self.num_prefill_checkpoint_blocks if self._align(limits) else 1
        return self.page_size_bytes * (live + self.num_speculative_blocks)

    def max_num_blocks_per_req(self, limits: SizingLimits, max_len: int) -> int:
        """Align-mode rows have a column per block of tokens; otherwise the live states."""
        if self._align(limits):
            return _cdiv(max_len, self.block_size) + self.num_speculative_blocks
        return _cdiv(self.max_memory_usage_bytes(limits), self.page_size_bytes)

    def is_uniform_with(self, specs: Mapping[str, KVCacheSpec]) -> bool:
        """Uniform with Mamba layers of the same page size, speculative and checkpoint blocks."""
        return all(
            isinstance(spec, MambaSpec)
            and spec.num_speculative_blocks == self.num_speculative_blocks
            and spec.num_prefill_checkpoint_blocks == self.num_prefill_checkpoint_blocks
            and spec.prefill_checkpoint_alignment == self.prefill_checkpoint_alignment
            and spec.page_size_bytes == self.page_size_bytes
            for spec in specs.values()
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one attention type (same token slots) sharing one block table.

    Their pages may differ in size; a block of the group is the sum of its layers' pages.

    Attributes:
        kv_cache_specs: Each layer's own spec, by layer name, in layer order.
    """

    traits: ClassVar[SpecTraits] = SpecTraits(
        wire_tag="uniform_type", snapshot=False, vllm_class="UniformTypeKVCacheSpecs"
    )

    kv_cache_specs: Mapping[str, KVCacheSpec]

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        if not self.kv_cache_specs:
            raise InvalidArgumentError("UniformTypeKVCacheSpecs.kv_cache_specs is empty")
        object.__setattr__(self, "kv_cache_specs", dict(self.kv_cache_specs))

    def __hash__(self) -> int:
        return hash((self.block_size, tuple(self.kv_cache_specs.items())))

    @property
    def first_spec(self) -> KVCacheSpec:
        """The spec of the first layer (it speaks for the group's slot needs)."""
        return next(iter(self.kv_cache_specs.values()))

    @property
    def kind(self) -> str:  # type: ignore[override]
        """The kind vLLM reports for the group.

        The layers' common kind; ``full_attention`` when full-attention variants mix (full
        attention and MLA, say); ``unknown`` otherwise.
        """
        kinds = {spec.kind for spec in self.kv_cache_specs.values()}
        if len(kinds) == 1:
            return next(iter(kinds))
        if all(spec.traits.full_attention for spec in self.kv_cache_specs.values()):
            return FullAttentionSpec.kind
        return KVCacheSpec.kind

    @property
    def page_size_bytes(self) -> int:
        """Sum of the layers' pages."""
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_bytes(self, limits: SizingLimits) -> int:
        """The most pages any layer needs, times the group's page size."""
        max_pages = max(
            _cdiv(spec.max_memory_usage_bytes(limits), spec.page_size_bytes)
            for spec in self.kv_cache_specs.values()
        )
        return max_pages * self.page_size_bytes

    def get_max_layers_per_page_size(self) -> int:
        """The most layers that share one page size.

        For layers that repeat a pattern of one layer per page size, this is the number of
        repeats.
        """
        counts: dict[int, int] = {}
        for spec in self.kv_cache_specs.values():
            counts[spec.page_size_bytes] = counts.get(spec.page_size_bytes, 0) + 1
        return max(counts.values())

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: Mapping[str, KVCacheSpec]) -> bool:
        """Whether the layers share block size and token-slot needs."""
        if not kv_cache_specs:
            return False
        if len({spec.block_size for spec in kv_cache_specs.values()}) > 1:
            return False
        first = next(iter(kv_cache_specs.values()))
        return first.is_uniform_with(kv_cache_specs)

    @classmethod
    def from_specs(
        cls, kv_cache_specs: Mapping[str, KVCacheSpec]
    ) -> UniformTypeKVCacheSpecs | None:
        """The uniform-type group of these layers, or ``None`` when they are not uniform."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=kv_cache_specs)


def spec_classes() -> tuple[type[KVCacheSpec], ...]:
    """Every spec class declaring its own traits with a wire tag, bases before subclasses.

    The tables that depend on the type (the wire's fields left off, the snapshot's allowed
    classes, the vLLM converter's class names) are derived from these classes' traits.
    """
    found: dict[type[KVCacheSpec], None] = {}

    def walk(base: type[KVCacheSpec]) -> None:
        for cls in base.__subclasses__():
            # A slotted dataclass is a new class; the one it replaced lingers among the
            # subclasses until collected. Only the class its module names is the spec.
            # A subclass that declares no traits of its own is no type of its own.
            named = getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls
            traits = cls.__dict__.get("traits")
            if named and isinstance(traits, SpecTraits) and traits.wire_tag:
                found[cls] = None
            walk(cls)

    walk(KVCacheSpec)
    return tuple(found)


def pins_hash_block_size(spec: KVCacheSpec) -> bool:
    """Whether a layer forces the hash block size to the scheduler block size.

    Mamba layers do outside vLLM's "align" mode, where their states sit at block boundaries
    and finer hashes serve sub-block hits.
    """
    return spec.traits.pins_hash_block_size and not spec.partial_block_hits


def check_plannable_spec(layer_name: str, spec: KVCacheSpec, field: str = "layer_specs") -> None:
    """Refuse a layer spec that kvcm cannot plan yet, naming the layer and the field.

    Every place a layer spec enters (the SDK's ``WorkerClient.register``, the server's
    RegisterWorker, planning) calls this, so the refusal reads the same everywhere.

    Args:
        layer_name: The layer, as the model runner names it.
        spec: Its spec.
        field: Where the spec came from, for the error's ``field``.

    Raises:
        InvalidArgumentError: An unknown Mamba cache mode, or a page larger than a uint64.
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        for inner_name, inner in spec.kv_cache_specs.items():
            check_plannable_spec(inner_name, inner, field)
        return
    if isinstance(spec, MambaSpec) and spec.mamba_cache_mode not in ("none", "align"):
        raise InvalidArgumentError(
            f"layer {layer_name!r}: MambaSpec.mamba_cache_mode must be 'none' or 'align', "
            f"got {spec.mamba_cache_mode!r}",
            field=f"{field}[{layer_name}].mamba_cache_mode",
        )
    if spec.page_size_bytes > UINT64_MAX:
        raise InvalidArgumentError(
            f"layer {layer_name!r}: its page of {spec.page_size_bytes} bytes does not fit a "
            "uint64 (check block_size, num_kv_heads, head_size, shapes, page_size_padded_bytes)",
            field=f"{field}[{layer_name}]",
        )
