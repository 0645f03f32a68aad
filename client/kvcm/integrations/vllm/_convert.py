"""Translation between vLLM 0.33's scheduler-side values and kvcm's core vocabulary.

vLLM's specs become kvcm specs (refusing the kinds kvcm's core does not model), kvcm's KV
events become vLLM's event structs, and a vLLM ``Request`` is seen by kvcm's core through
:class:`RequestView`, which shares the request's token and hash lists rather than copying them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final, cast

from kvcm.common import specs as kvcm_specs
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.core.coordinator import partial_hash_hits_enabled
from kvcm.core.request import Request, RequestStatus

__all__ = [
    "RequestView",
    "check_connector_groups",
    "check_engine_resolution",
    "convert_kv_cache_config",
    "to_vllm_events",
]

# vLLM's RequestStatus has kvcm's members with the same values (both mirror vLLM 0.33).
_STATUS_BY_VALUE: Final = {int(status): status for status in RequestStatus}


def _dtype(value: Any, where: str) -> DType:
    name = str(value).removeprefix("torch.")
    try:
        return DType(name)
    except ValueError:
        raise ConfigError(f"{where}: dtype {value!r} is not one kvcm manages") from None


def _attention_kwargs(spec: Any, where: str) -> dict[str, Any]:
    if getattr(spec, "non_causal", False):
        raise ConfigError(f"{where}: non-causal attention is not supported")
    return {
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": _dtype(spec.dtype, where),
        "head_size_v": spec.head_size_v,
        "page_size_padded": spec.page_size_padded,
    }


# The fields every attention spec shares; a type's own fields are copied by name.
_ATTENTION_FIELDS: Final = frozenset(f.name for f in dataclasses.fields(kvcm_specs.AttentionSpec))


def _convert_attention(cls: type[Any], spec: Any, where: str) -> kvcm_specs.KVCacheSpec:
    kwargs = _attention_kwargs(spec, where)
    for field in dataclasses.fields(cls):
        if field.name not in _ATTENTION_FIELDS and hasattr(spec, field.name):
            kwargs[field.name] = getattr(spec, field.name)
    converted = cast("kvcm_specs.KVCacheSpec", cls(**kwargs))
    _check_quantized_page(spec, converted, where)
    return converted


def _check_quantized_page(spec: Any, converted: kvcm_specs.KVCacheSpec, where: str) -> None:
    """A quantized KV cache (``--kv-cache-dtype fp8`` and others) changes only the kernels and
    the page's bytes: vLLM's manager decides nothing by it. kvcm takes one whose page it
    computes to the byte from the dtype (per-tensor scales live outside the page: fp8, the
    common case); one whose backend lays the page out otherwise (per-token-head scales,
    packed 4-bit codes) is refused, saying what to serve instead."""
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is None or getattr(mode, "name", "NONE") == "NONE":
        return
    ours, theirs = converted.page_size_bytes, int(spec.page_size_bytes)
    if ours != theirs:
        name = getattr(mode, "name", str(mode))
        raise ConfigError(
            f"{where}: the quantized KV cache {name} lays a {spec.block_size}-token page out as "
            f"{theirs} bytes, where kvcm computes {ours} from its dtype; kvcm serves KV caches "
            "whose page is the dtype's (--kv-cache-dtype auto, fp8, fp8_e4m3 or fp8_e5m2)"
        )


def _convert_uniform(spec: Any, where: str) -> kvcm_specs.KVCacheSpec:
    return kvcm_specs.UniformTypeKVCacheSpecs(
        block_size=spec.block_size,
        kv_cache_specs={
            name: convert_spec(layer, f"{where}[{name!r}]")
            for name, layer in spec.kv_cache_specs.items()
        },
    )


# vLLM's class name -> kvcm's spec class: every class that names one (traits.vllm_class).
_SPEC_FOR_VLLM_CLASS: Final = {
    cls.traits.vllm_class: cls for cls in kvcm_specs.spec_classes() if cls.traits.vllm_class
}


def convert_spec(spec: Any, where: str = "kv_cache_spec") -> kvcm_specs.KVCacheSpec:
    """kvcm's spec for one of vLLM 0.33's KV-cache specs.

    The kinds accepted, by exact type, are those whose kvcm spec class names them in
    ``traits.vllm_class``: full attention (with a recorded window or chunk), MLA, sliding
    window, chunked local attention, Mamba (in either cache mode, "align" included), and
    uniform groups of those. An attention spec's own fields are copied by name; Mamba and
    uniform groups have converters of their own.

    Raises:
        ConfigError: The kind (or a setting of it) is not supported; the message names it.
    """
    kind = type(spec).__name__
    cls = _SPEC_FOR_VLLM_CLASS.get(kind)
    if cls is kvcm_specs.UniformTypeKVCacheSpecs:
        return _convert_uniform(spec, where)
    if cls is kvcm_specs.MambaSpec:
        return _convert_mamba(spec, where)
    if cls is not None and issubclass(cls, kvcm_specs.AttentionSpec):
        return _convert_attention(cls, spec, where)
    raise ConfigError(
        f"{where}: {kind} layers are not supported by kvcm's vLLM integration yet (supported: "
        f"{', '.join(sorted(_SPEC_FOR_VLLM_CLASS))})"
    )


def _convert_mamba(spec: Any, where: str) -> kvcm_specs.MambaSpec:
    # tokens_per_state: vLLM 0.33's KV-cache manager never reads it for Mamba; EngineCore only
    # checks that hits land on multiples of it (check_engine_resolution does too).
    mamba_type = getattr(spec.mamba_type, "name", spec.mamba_type)
    return kvcm_specs.MambaSpec(
        block_size=spec.block_size,
        shapes=tuple(tuple(shape) for shape in spec.shapes),
        dtypes=tuple(_dtype(dtype, where) for dtype in spec.dtypes),
        page_size_padded=spec.page_size_padded,
        mamba_type=str(mamba_type).lower(),
        mamba_cache_mode=spec.mamba_cache_mode,
        num_speculative_blocks=spec.num_speculative_blocks,
        num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
        prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment,
    )


def convert_kv_cache_config(config: Any) -> KVCacheConfig:
    """kvcm's KV-cache config for vLLM's (groups in order; tensors are the workers' business).

    The fields EngineCore resolves (``hash_block_size``, ``cache_hit_alignment_tokens``,
    ``prefix_cache_retention_interval``) are checked against the scheduler's block sizes by
    :func:`check_engine_resolution`; the worker-side ones (``kv_cache_tensors``,
    ``kv_cache_layout``, ``kv_tp_replicas``) do not concern the manager.

    Raises:
        ConfigError: A group's spec is not supported (see :func:`convert_spec`), a group has a
            role kvcm does not model (HiSparse, host resident), or the config uses HiSparse
            host blocks. An EAGLE draft group (``is_eagle_group``) is an ordinary group to
            the pool; which groups drop a block on a hit reaches the manager separately
            (``MirrorManagerConfig.eagle_block_drop_group_ids``).
    """
    if getattr(config, "hisparse_host_num_blocks", None) is not None:
        raise ConfigError("kv_cache_config: HiSparse host blocks are not supported")
    groups = []
    for index, group in enumerate(config.kv_cache_groups):
        where = f"kv_cache_groups[{index}]"
        role = group.role.value
        if role != "default":
            raise ConfigError(f"{where}: HiSparse groups (role {role!r}) are not supported")
        if group.host_resident:
            raise ConfigError(f"{where}: host-resident groups are not supported")
        # Under pipeline parallelism the scheduler's config is the first stage's: a group
        # whose layers all live on later stages has no names there. The manager never reads
        # them; a pool's layout needs one, so name the group by its place.
        names = tuple(group.layer_names) or (f"{where} (layers on later pipeline stages)",)
        groups.append(
            KVCacheGroupSpec(
                layer_names=names,
                kv_cache_spec=convert_spec(group.kv_cache_spec, where),
            )
        )
    return KVCacheConfig(num_blocks=config.num_blocks, kv_cache_tensors=(), kv_cache_groups=groups)


def check_engine_resolution(
    config: Any,
    *,
    scheduler_block_size: int,
    hash_block_size: int,
    enable_caching: bool,
    dcp_world_size: int = 1,
) -> None:
    """Accept what vLLM's EngineCore resolved into ``config`` where kvcm computes the same.

    EngineCore resolves, before it builds the scheduler, the block sizes
    (``resolve_kv_cache_block_sizes``: the scheduler's ``block_size`` and ``hash_block_size``
    arguments), the granularity prefix-cache hits land on
    (``resolve_cache_hit_alignment_tokens``) and, through its planning, the sliding-window
    retention policy (``CacheConfig.prefix_cache_retention_interval``), and writes them into
    every KV-cache config. kvcm's core hashes at ``hash_block_size``, lands hits where vLLM
    does (on the hash block size for a hybrid model with an align-mode Mamba group whose
    blocks are larger than a hash block, vLLM's partial hash hits; on the scheduler block
    size otherwise) and applies the retention policy as vLLM does (the mirror passes it on);
    a value that asks for anything else is refused, naming it and the setting that avoids it.

    Args:
        config: vLLM's (scheduler's) ``KVCacheConfig``.
        scheduler_block_size: The scheduler's ``block_size`` argument.
        hash_block_size: The scheduler's ``hash_block_size`` argument.
        enable_caching: ``CacheConfig.enable_prefix_caching`` (as EngineCore left it).
        dcp_world_size: ``ParallelConfig.decode_context_parallel_size`` (under DCP a Mamba
            block equal to the hash block already serves sub-block hits, as in vLLM).

    Raises:
        ConfigError: The message names the field, vLLM's value, what kvcm would use, and the fix.
    """
    resolved_hash = config.hash_block_size
    if resolved_hash is not None and resolved_hash != hash_block_size:
        raise ConfigError(
            f"kv_cache_config.hash_block_size={resolved_hash} differs from the scheduler's "
            f"hash_block_size={hash_block_size}: construct the scheduler with the sizes "
            "EngineCore resolves (resolve_kv_cache_block_sizes)"
        )
    alignment = config.cache_hit_alignment_tokens
    kvcm_alignment = scheduler_block_size
    converted = convert_kv_cache_config(config)
    if (
        enable_caching
        and len(converted.kv_cache_groups) > 1
        and partial_hash_hits_enabled(converted, hash_block_size, dcp_world_size)
    ):
        kvcm_alignment = hash_block_size
    if enable_caching:
        _check_state_alignment(config, scheduler_block_size, hash_block_size, dcp_world_size)
    if alignment is not None and alignment != kvcm_alignment:
        raise ConfigError(
            f"kv_cache_config.cache_hit_alignment_tokens={alignment}: vLLM lands prefix-cache "
            f"hits on {alignment}-token boundaries here, kvcm on {kvcm_alignment} (it serves "
            "sub-block hits, as vLLM 0.33 does, only beside an align-mode Mamba group whose "
            f"blocks are larger than a hash block): pass --prefix-match-unit "
            f"{scheduler_block_size}, or run this model on vLLM's own scheduler"
        )


def _check_state_alignment(
    config: Any, scheduler_block_size: int, hash_block_size: int, dcp_world_size: int
) -> None:
    # vLLM's resolve_kv_cache_block_sizes (EngineCore runs it before building the scheduler):
    # the boundaries hits land on must be multiples of every cacheable spec's tokens_per_state
    # (a Mamba spec's included), with the same message.
    groups = config.kv_cache_groups
    if len(groups) <= 1 or any(
        type(g.kv_cache_spec).__name__ == "MambaSpec"
        and g.kv_cache_spec.mamba_cache_mode != "align"
        for g in groups
    ):
        return
    # vLLM's partial_hash_hits_enabled without the managers: under DCP a Mamba block equal to
    # the hash block qualifies.
    least = hash_block_size if dcp_world_size > 1 else hash_block_size + 1
    partial = any(
        type(g.kv_cache_spec).__name__ == "MambaSpec" and g.kv_cache_spec.block_size >= least
        for g in groups
    )
    alignment = hash_block_size if partial else scheduler_block_size
    alignments = sorted(
        {
            per_state
            for group in config.kv_cache_groups
            if getattr(group.kv_cache_spec, "prefix_cacheable", True)
            for per_state in [getattr(group.kv_cache_spec, "tokens_per_state", -1)]
            if isinstance(per_state, int) and per_state > 1
        }
    )
    if any(alignment % per_state for per_state in alignments):
        raise ConfigError(
            f"Invalid prefix_match_unit={hash_block_size}; prefix-cache boundaries must align "
            f"with each spec's per-state compression. Got alignments={alignments}."
        )


def check_connector_groups(vllm_config: Any, config: Any) -> None:
    """Refuse what vLLM 0.33 refuses for this model's groups, and what kvcm cannot mirror
    (nothing at present: the hook stays where the scheduler checks its groups first).

    Prefill context parallelism is not refused: vLLM 0.33's scheduler builds its manager with
    ``pcp_world_size=1`` whatever ``prefill_context_parallel_size`` is (the KV cache is
    replicated over the PCP ranks), so its coordinator's PCP check never runs and the manager
    decides as without PCP; kvcm's does the same. KV connectors are accepted with Mamba
    layers as vLLM accepts them (its connector lookup, boundary-state hand-offs, partial tails
    and, on an asynchronous KV consumer, deferred frees and copy retentions are the core's).

    Args:
        vllm_config: vLLM's config.
        config: vLLM's (scheduler's) ``KVCacheConfig``.

    Raises:
        ConfigError: The message names the setting and why (never raised at present).
    """
    del vllm_config, config  # nothing vLLM 0.33 refuses here is left for kvcm to refuse


class RequestView(Request):
    """A vLLM ``Request`` as kvcm's core reads it.

    The token list and the block-hash list are vLLM's own objects (shared, never copied);
    the counters the scheduler changes between calls are copied in by :meth:`sync`.

    Attributes:
        source: The vLLM request.
        num_first_prompt_tokens: The prompt's length when the view was made: a streaming
            session's first chunk (``num_prompt_tokens`` follows vLLM's, which each later
            chunk moves).
    """

    __slots__ = ("_hash_block_size", "_plain_tokens", "num_first_prompt_tokens", "source")

    def __init__(self, source: Any, hash_block_size: int = 0) -> None:
        """View ``source`` (vLLM's request); see the class docstring.

        ``hash_block_size`` (0: unknown) trims hashes past the tokens: a KV producer's NIXL
        connector drops a hybrid Mamba prompt's last token after vLLM hashed it, so the
        request may carry one hash more than its full blocks (which vLLM never reads).

        Raises:
            InvalidArgumentError: The request carries multi-modal inputs or prompt embeddings,
                which kvcm's integration does not hash yet.
        """
        if source.mm_features:
            raise InvalidArgumentError(
                f"request {source.request_id!r}: multi-modal requests are not supported by "
                "kvcm's vLLM integration yet"
            )
        if source.prompt_embeds is not None:
            raise InvalidArgumentError(
                f"request {source.request_id!r}: prompt embeddings are not supported by kvcm's "
                "vLLM integration yet"
            )
        lora = source.lora_request
        self.source = source
        self._hash_block_size = hash_block_size
        self.request_id = source.request_id
        self.prompt_token_ids = source.prompt_token_ids
        # vLLM's ``all_token_ids`` is a read-only wrapper (``ConstantList``) whose len() and
        # slices run in Python; the list it wraps, ``_all_token_ids``, is the same tokens
        # (vLLM changes it in place, never rebinds it), read at C speed (sync(), below, reads
        # the tokens, the prompt's end and the hashes). Any other request type is read
        # through ``all_token_ids``.
        plain: Any = getattr(source, "_all_token_ids", None)
        self._plain_tokens = (
            type(plain) is list and getattr(source.all_token_ids, "_x", plain) is plain
        )
        self.lora_name = None if lora is None else lora.lora_name
        self.lora_id = None if lora is None else lora.lora_int_id
        self.lora_path = None if lora is None else lora.lora_path
        self.cache_salt = source.cache_salt
        self.mm_features = []
        self.prompt_embeds = None
        self.session_id = source.session_id
        self.skip_reading_prefix_cache = source.skip_reading_prefix_cache
        # vLLM's per-request mode (SamplingParams.extra_args["kv_cache_report_mode"]): vLLM
        # compares it with "full" only, so any other value (or none) is its incremental mode.
        self.report_cached_blocks = getattr(source, "kv_cache_report_mode", "incremental") == "full"
        self._block_hasher = None
        self.sync()
        self.num_first_prompt_tokens = self.num_prompt_tokens

    def sync(self) -> None:
        """Copy the scheduler-owned counters, the status, the prompt's end and the token and
        hash lists from the vLLM request."""
        source = self.source
        self.num_computed_tokens = source.num_computed_tokens
        self.num_in_flight_tokens = source.num_in_flight_tokens
        self.num_preemptions = source.num_preemptions
        self.status = _STATUS_BY_VALUE[int(source.status)]
        # A streaming-input session's next chunk makes the prompt longer (vLLM's
        # _update_request_as_session): the prompt's end moves with it.
        self.num_prompt_tokens = source.num_prompt_tokens
        # Re-read each time: vLLM changes its lists in place (streaming input too), another
        # request type may rebind them.
        all_token_ids = self.all_token_ids = (
            source._all_token_ids if self._plain_tokens else source.all_token_ids
        )
        hashes = source.block_hashes
        size = self._hash_block_size
        if size and len(hashes) * size > len(all_token_ids):
            hashes = hashes[: len(all_token_ids) // size]
        self.block_hashes = hashes


def to_vllm_events(
    events: list[Any], vllm_kv_events: Any, convert_hash: Callable[[bytes], Any]
) -> list[Any]:
    """vLLM's event structs for kvcm's events, field for field.

    Args:
        events: kvcm's events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), hashes
            full width.
        vllm_kv_events: The ``vllm.distributed.kv_events`` module.
        convert_hash: vLLM's ``maybe_convert_block_hash``: the form the engine publishes
            (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
    """
    # Positional, in the field order both records share (test_event_convert checks it), and
    # the one-hash list of a decode turn's event made without a comprehension: a 256-request
    # decode turn that fills a block per request converts 256 of these inside the engine's
    # step.
    stored = vllm_kv_events.BlockStored
    removed = vllm_kv_events.BlockRemoved
    converted: list[Any] = []
    append = converted.append
    for event in events:
        if type(event) is BlockStored:
            hashes = event.block_hashes
            parent = event.parent_block_hash
            append(
                stored(
                    [convert_hash(hashes[0])]
                    if len(hashes) == 1
                    else [convert_hash(h) for h in hashes],
                    None if parent is None else convert_hash(parent),
                    event.token_ids,
                    event.block_size,
                    event.lora_id,
                    event.medium,
                    event.lora_name,
                    event.extra_keys,
                    event.group_idx,
                    event.kv_cache_spec_kind,
                    event.kv_cache_spec_sliding_window,
                    event.locality,
                    event.ownership,
                    event.session_id,
                    event.lookahead_token_ids,
                )
            )
        elif type(event) is stored:  # made as vLLM's by the core (make_stored_event)
            append(event)
        elif type(event) is BlockRemoved:
            append(
                removed(
                    block_hashes=[convert_hash(h) for h in event.block_hashes],
                    medium=event.medium,
                    group_idx=event.group_idx,
                    locality=event.locality,
                    ownership=event.ownership,
                )
            )
        elif type(event) is AllBlocksCleared:
            append(vllm_kv_events.AllBlocksCleared())
        else:  # pragma: no cover - the core emits only the three kinds
            raise TypeError(f"unknown KV event {event!r}")
    return converted
