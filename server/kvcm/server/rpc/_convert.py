"""Translations between ``kvcm.v1`` messages and the core's values, for the servicers.

Specs and KV-cache configs go through the SDK's translators (``kvcm.client._convert``) so
both sides of the wire read them alike; what only the server writes (pool options, events,
pool info, block id groups) is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvcm.client._convert import (
    kv_cache_config_from_proto,
    kv_cache_config_to_proto,
    spec_from_proto,
)
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.events import BlockRemoved, BlockStored, KVCacheEvent
from kvcm.common.hashing import HashAlgorithm
from kvcm.common.specs import KVCacheSpec
from kvcm.core.pool import DEFAULT_EVENT_RETENTION, Pool, PoolOptions, PoolState
from kvcm.v1 import admin_pb2, common_pb2, events_pb2

__all__ = [
    "events_to_proto",
    "fill_grouped",
    "hashing_to_proto",
    "layer_specs_from_proto",
    "pool_info",
    "pool_options_from_proto",
    "pool_state_to_proto",
]

_HASH_ALGORITHM: Final = {
    common_pb2.HASH_ALGORITHM_UNSPECIFIED: HashAlgorithm.SHA256,
    common_pb2.HASH_ALGORITHM_SHA256: HashAlgorithm.SHA256,
    common_pb2.HASH_ALGORITHM_SHA256_CBOR: HashAlgorithm.SHA256_CBOR,
    common_pb2.HASH_ALGORITHM_XXHASH: HashAlgorithm.XXHASH,
    common_pb2.HASH_ALGORITHM_XXHASH_CBOR: HashAlgorithm.XXHASH_CBOR,
}
_HASH_ALGORITHM_TO_PROTO: Final = {
    HashAlgorithm.SHA256: common_pb2.HASH_ALGORITHM_SHA256,
    HashAlgorithm.SHA256_CBOR: common_pb2.HASH_ALGORITHM_SHA256_CBOR,
    HashAlgorithm.XXHASH: common_pb2.HASH_ALGORITHM_XXHASH,
    HashAlgorithm.XXHASH_CBOR: common_pb2.HASH_ALGORITHM_XXHASH_CBOR,
}
_SPEC_KIND: Final = {
    "full_attention": common_pb2.KV_CACHE_SPEC_KIND_FULL_ATTENTION,
    "mla_attention": common_pb2.KV_CACHE_SPEC_KIND_MLA_ATTENTION,
    "sliding_window": common_pb2.KV_CACHE_SPEC_KIND_SLIDING_WINDOW,
    "mamba": common_pb2.KV_CACHE_SPEC_KIND_MAMBA,
    "chunked_local_attention": common_pb2.KV_CACHE_SPEC_KIND_CHUNKED_LOCAL_ATTENTION,
    "sink_full_attention": common_pb2.KV_CACHE_SPEC_KIND_SINK_FULL_ATTENTION,
    "encoder_only_attention": common_pb2.KV_CACHE_SPEC_KIND_ENCODER_ONLY_ATTENTION,
    "cross_attention": common_pb2.KV_CACHE_SPEC_KIND_CROSS_ATTENTION,
}
_MEDIUM: Final = {
    "GPU": events_pb2.MEDIUM_GPU,
    "CPU": events_pb2.MEDIUM_CPU,
    "STORAGE": events_pb2.MEDIUM_STORAGE,
}


def pool_state_to_proto(state: PoolState) -> admin_pb2.PoolState:
    """The wire value of a pool state."""
    if state is PoolState.READY:
        return admin_pb2.POOL_STATE_READY
    return admin_pb2.POOL_STATE_PENDING_WORKERS


def pool_options_from_proto(message: admin_pb2.PoolConfig) -> PoolOptions:
    """The core's ``PoolOptions`` of a wire ``PoolConfig`` (validated by ``PoolOptions``).

    Raises:
        InvalidArgumentError: A field is out of its domain (names it).
    """
    algorithm = _HASH_ALGORITHM.get(message.hash_algorithm)
    if algorithm is None:
        raise InvalidArgumentError(
            f"config.hash_algorithm has an unknown value {message.hash_algorithm}"
        )
    layout = None
    if message.HasField("explicit_layout"):
        wire = common_pb2.KVCacheConfig(
            num_blocks=message.explicit_layout.num_blocks,
            kv_cache_groups=message.explicit_layout.kv_cache_groups,
        )
        try:
            layout = kv_cache_config_from_proto(wire)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"config.explicit_layout: {exc}") from exc

    def optional(name: str) -> int | None:
        if not message.HasField(name):
            return None
        value: int = getattr(message, name)
        return value

    retention = optional("event_retention_num_events")
    return PoolOptions(
        max_model_len=message.max_model_len,
        world_size=message.world_size,
        explicit_layout=layout,
        num_blocks_override=optional("num_blocks_override"),
        scheduler_block_size=optional("scheduler_block_size"),
        hash_block_size=optional("hash_block_size"),
        max_in_flight_tokens=optional("max_in_flight_tokens"),
        enable_caching=message.enable_caching if message.HasField("enable_caching") else True,
        hash_algorithm=algorithm,
        hash_seed=message.hash_seed if message.HasField("hash_seed") else None,
        verify_block_hashes=message.verify_block_hashes,
        enable_kv_cache_events=message.enable_kv_cache_events,
        event_retention_num_events=DEFAULT_EVENT_RETENTION if retention is None else retention,
        log_stats=message.log_stats if message.HasField("log_stats") else True,
        watermark=message.watermark,
    )


def layer_specs_from_proto(layers: Sequence[common_pb2.LayerSpec]) -> dict[str, KVCacheSpec]:
    """``{layer name: spec}`` of a RegisterWorker's layers.

    Raises:
        InvalidArgumentError: No layers, an empty or duplicate name, an unset spec.
    """
    if not layers:
        raise InvalidArgumentError("layer_specs must not be empty")
    specs: dict[str, KVCacheSpec] = {}
    for index, layer in enumerate(layers):
        name = layer.layer_name
        if not name:
            raise InvalidArgumentError(f"layer_specs[{index}].layer_name must not be empty")
        if name in specs:
            raise InvalidArgumentError(f"layer_specs[{index}].layer_name {name!r} is a duplicate")
        if not layer.HasField("spec") or layer.spec.WhichOneof("spec") is None:
            raise InvalidArgumentError(f"layer_specs[{index}].spec is unset")
        try:
            specs[name] = spec_from_proto(layer.spec)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"layer_specs[{index}].spec: {exc}") from exc
    return specs


def hashing_to_proto(pool: Pool) -> common_pb2.HashingParameters:
    """The pool's ``HashingParameters``."""
    hashing = pool.hashing
    return common_pb2.HashingParameters(
        algorithm=_HASH_ALGORITHM_TO_PROTO[hashing.algorithm],
        seed=hashing.seed,
        hash_block_size=hashing.hash_block_size,
        hash_length_bytes=hashing.hash_length_bytes,
    )


def pool_info(pool: Pool, config: admin_pb2.PoolConfig) -> admin_pb2.PoolInfo:
    """``PoolInfo`` of a pool and the config it was created with."""
    info = admin_pb2.PoolInfo(
        pool_id=pool.name,
        state=pool_state_to_proto(pool.state),
        config=config,
        hashing=hashing_to_proto(pool),
        registered_ranks=sorted(pool.registrations),
        num_requests=len(pool.requests),
        last_event_sequence=pool.last_event_sequence,
    )
    manager = pool.manager
    if manager is not None and pool.kv_cache_config is not None:
        info.kv_cache_config.CopyFrom(kv_cache_config_to_proto(pool.kv_cache_config))
        info.num_free_blocks = manager.num_free_blocks
        info.usage = manager.usage
    return info


def fill_grouped(block_ids: Sequence[Sequence[int]], message: common_pb2.GroupedBlockIds) -> None:
    """Fill a ``GroupedBlockIds`` from per-group id lists."""
    for group in block_ids:
        message.block_ids.extend(group)
        message.num_block_ids.append(len(group))


def _hash_bytes(value: int, length: int) -> bytes:
    # The core publishes vLLM's external (int, low 64 bits) hashes; they travel as
    # `length`-byte big-endian values, so the SDK's external_block_hash reads them back.
    return value.to_bytes(length, "big")


def events_to_proto(events: Sequence[KVCacheEvent], hash_length: int) -> list[events_pb2.KVEvent]:
    """Wire events of core events."""
    out: list[events_pb2.KVEvent] = []
    for event in events:
        message = events_pb2.KVEvent()
        if isinstance(event, BlockStored):
            stored = message.block_stored
            stored.block_hashes = b"".join(_hash_bytes(h, hash_length) for h in event.block_hashes)
            if event.parent_block_hash is not None:
                stored.parent_block_hash = _hash_bytes(event.parent_block_hash, hash_length)
            stored.token_ids.extend(event.token_ids)
            stored.block_size = event.block_size
            if event.lora_id is not None:
                stored.lora_id = event.lora_id
            if event.lora_name is not None:
                stored.lora_name = event.lora_name
            stored.medium = _MEDIUM.get(event.medium or "", events_pb2.MEDIUM_UNSPECIFIED)
            if event.group_idx is not None:
                stored.group_idx = event.group_idx
            stored.kv_cache_spec_kind = _SPEC_KIND.get(
                event.kv_cache_spec_kind or "", common_pb2.KV_CACHE_SPEC_KIND_UNSPECIFIED
            )
            if event.kv_cache_spec_sliding_window is not None:
                stored.kv_cache_spec_sliding_window = event.kv_cache_spec_sliding_window
        elif isinstance(event, BlockRemoved):
            removed = message.block_removed
            removed.block_hashes = b"".join(_hash_bytes(h, hash_length) for h in event.block_hashes)
            removed.medium = _MEDIUM.get(event.medium or "", events_pb2.MEDIUM_UNSPECIFIED)
            if event.group_idx is not None:
                removed.group_idx = event.group_idx
        else:
            message.all_blocks_cleared.SetInParent()
        out.append(message)
    return out
