"""Pool configs, hashing parameters, pool info and summaries, usage and prefix-cache stats.

The core's value types (:mod:`kvcm.core.pool_types`, :mod:`kvcm.core.stats`) are what both
the server and the SDK hold; these functions are their only translation to ``kvcm.v1``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any, Final

from kvcm.common.config import KVCacheLayout
from kvcm.common.errors import InvalidArgumentError
from kvcm.core.pool_types import (
    DEFAULT_EVENT_RETENTION,
    HashingParameters,
    LeaseExpiry,
    PoolConfig,
    PoolInfo,
    PoolSummary,
    PrefixCacheTotals,
    StepProgress,
    Usage,
    ZmqEventStream,
)
from kvcm.core.stats import PrefixCacheStats
from kvcm.v1 import admin_pb2, common_pb2, scheduler_pb2
from kvcm.wire.enums import (
    hash_algorithm_from_proto,
    hash_algorithm_to_proto,
    pool_state_from_proto,
    pool_state_to_proto,
)
from kvcm.wire.specs import kv_cache_config_from_proto, kv_cache_config_to_proto

if TYPE_CHECKING:
    from kvcm.core.pool import Pool

__all__ = [
    "hashing_from_proto",
    "hashing_to_proto",
    "pool_config_from_proto",
    "pool_config_to_proto",
    "pool_info_from_proto",
    "pool_info_to_proto",
    "pool_summaries_from_proto",
    "prefix_cache_stats_from_proto",
    "prefix_cache_stats_to_proto",
    "usage_from_proto",
    "zmq_event_stream_from_proto",
    "zmq_event_stream_to_proto",
]

_DEFAULT_LAYOUT: Final = KVCacheLayout.LBNHC
# The prefix-cache counters: their names in the core (PrefixCacheStats, the pool's lifetime
# totals) and in kvcm.v1 (PrefixCacheStats, PrefixCacheTotals).
_PREFIX_CACHE_COUNTERS: Final = (
    ("requests", "num_requests"),
    ("queries", "num_query_tokens"),
    ("hits", "num_hit_tokens"),
    ("preempted_requests", "num_preempted_requests"),
    ("preempted_queries", "num_preempted_query_tokens"),
    ("preempted_hits", "num_preempted_hit_tokens"),
)
# Optional ints of PoolConfig that travel only when set.
_OPTIONAL_INTS: Final = (
    "num_blocks_override",
    "scheduler_block_size",
    "hash_block_size",
    "max_in_flight_tokens",
    "max_num_batched_tokens",
    "max_num_encoder_input_tokens",
    "kv_cache_memory_bytes",
    "prefix_cache_retention_interval",
)


# ----------------------------------------------------------------------------- config
def pool_config_to_proto(config: PoolConfig) -> admin_pb2.PoolConfig:
    """The wire form of a ``PoolConfig`` (``None`` fields stay unset)."""
    message = admin_pb2.PoolConfig(
        world_size=config.world_size,
        max_model_len=config.max_model_len,
        hash_algorithm=hash_algorithm_to_proto(config.hash_algorithm),  # type: ignore[arg-type]
        verify_block_hashes=config.verify_block_hashes,
        enable_kv_cache_events=config.enable_kv_cache_events,
        watermark=config.watermark,
        scheduler_lease_s=config.scheduler_lease_s,
    )
    if config.lease_expiry is not LeaseExpiry.FREE_REQUESTS:
        message.lease_expiry = int(config.lease_expiry)  # type: ignore[assignment]
    if config.explicit_layout is not None:
        layout = kv_cache_config_to_proto(config.explicit_layout)
        message.explicit_layout.num_blocks = layout.num_blocks
        message.explicit_layout.kv_cache_groups.extend(layout.kv_cache_groups)
    for name in _OPTIONAL_INTS:
        value = getattr(config, name)
        if value is not None:
            setattr(message, name, value)
    if config.hash_seed is not None:
        message.hash_seed = config.hash_seed
    if config.event_retention_num_events != DEFAULT_EVENT_RETENTION:
        message.event_retention_num_events = config.event_retention_num_events
    if not config.enable_caching:
        message.enable_caching = False
    if not config.log_stats:
        message.log_stats = False
    message.labels.update(config.labels)
    if config.disable_hybrid_kv_cache_manager is not None:
        message.disable_hybrid_kv_cache_manager = config.disable_hybrid_kv_cache_manager
    message.auto_fit_max_model_len = config.auto_fit_max_model_len
    if config.kv_cache_layout is not _DEFAULT_LAYOUT:
        message.kv_cache_layout = config.kv_cache_layout.name
    message.host_tier_bytes = config.host_tier_bytes
    message.offload_host_blocks = config.offload_host_blocks
    if config.decode_context_parallel_size != 1:
        message.decode_context_parallel_size = config.decode_context_parallel_size
    message.num_hash_lookahead_tokens = config.num_hash_lookahead_tokens
    message.num_prefill_lookahead = config.num_prefill_lookahead
    message.eagle_block_drop_group_ids.extend(config.eagle_block_drop_group_ids)
    message.enable_mamba_shared_prefix_checkpoint = config.enable_mamba_shared_prefix_checkpoint
    return message


def pool_config_from_proto(message: admin_pb2.PoolConfig, field: str = "config") -> PoolConfig:
    """The ``PoolConfig`` of a wire one (unset fields take their defaults; validated).

    Raises:
        InvalidArgumentError: A field is out of its domain (the message names it).
    """
    layout = None
    if message.HasField("explicit_layout"):
        wire = common_pb2.KVCacheConfig(
            num_blocks=message.explicit_layout.num_blocks,
            kv_cache_groups=message.explicit_layout.kv_cache_groups,
        )
        layout = kv_cache_config_from_proto(wire, f"{field}.explicit_layout")
    optional = {
        name: getattr(message, name) if message.HasField(name) else None for name in _OPTIONAL_INTS
    }
    return PoolConfig(
        max_model_len=message.max_model_len,
        world_size=message.world_size,
        explicit_layout=layout,
        enable_caching=message.enable_caching if message.HasField("enable_caching") else True,
        hash_algorithm=hash_algorithm_from_proto(message.hash_algorithm, f"{field}.hash_algorithm"),
        hash_seed=message.hash_seed if message.HasField("hash_seed") else None,
        verify_block_hashes=message.verify_block_hashes,
        enable_kv_cache_events=message.enable_kv_cache_events,
        event_retention_num_events=(
            message.event_retention_num_events
            if message.HasField("event_retention_num_events")
            else DEFAULT_EVENT_RETENTION
        ),
        log_stats=message.log_stats if message.HasField("log_stats") else True,
        watermark=message.watermark,
        scheduler_lease_s=message.scheduler_lease_s,
        lease_expiry=_lease_expiry(message.lease_expiry, f"{field}.lease_expiry"),
        labels=dict(message.labels),
        disable_hybrid_kv_cache_manager=(
            message.disable_hybrid_kv_cache_manager
            if message.HasField("disable_hybrid_kv_cache_manager")
            else None
        ),
        auto_fit_max_model_len=message.auto_fit_max_model_len,
        kv_cache_layout=KVCacheLayout.parse(
            message.kv_cache_layout or _DEFAULT_LAYOUT.name, f"{field}.kv_cache_layout"
        ),
        host_tier_bytes=message.host_tier_bytes,
        offload_host_blocks=message.offload_host_blocks,
        decode_context_parallel_size=(
            message.decode_context_parallel_size
            if message.HasField("decode_context_parallel_size")
            else 1
        ),
        num_hash_lookahead_tokens=message.num_hash_lookahead_tokens,
        num_prefill_lookahead=message.num_prefill_lookahead,
        eagle_block_drop_group_ids=tuple(message.eagle_block_drop_group_ids),
        enable_mamba_shared_prefix_checkpoint=message.enable_mamba_shared_prefix_checkpoint,
        **optional,
    )


def _lease_expiry(value: int, field: str) -> LeaseExpiry:
    if value == 0:
        return LeaseExpiry.FREE_REQUESTS
    try:
        return LeaseExpiry(value)
    except ValueError:
        raise InvalidArgumentError(f"{field}: unknown LeaseExpiry {value}", field=field) from None


# ---------------------------------------------------------------------------- hashing
def hashing_to_proto(hashing: HashingParameters) -> common_pb2.HashingParameters:
    """The wire form of a pool's hashing parameters."""
    return common_pb2.HashingParameters(
        algorithm=hash_algorithm_to_proto(hashing.algorithm),  # type: ignore[arg-type]
        seed=hashing.seed,
        hash_block_size=hashing.hash_block_size,
        hash_length_bytes=hashing.hash_length_bytes,
        num_lookahead_tokens=hashing.num_lookahead_tokens,
    )


def hashing_from_proto(
    message: common_pb2.HashingParameters, field: str = "hashing"
) -> HashingParameters:
    """The ``HashingParameters`` of a wire one."""
    return HashingParameters(
        algorithm=hash_algorithm_from_proto(message.algorithm, f"{field}.algorithm"),
        seed=message.seed,
        hash_block_size=message.hash_block_size,
        hash_length_bytes=message.hash_length_bytes,
        num_lookahead_tokens=message.num_lookahead_tokens,
    )


# ------------------------------------------------------------------------------- info
def pool_info_to_proto(pool: Pool, config: admin_pb2.PoolConfig) -> admin_pb2.PoolInfo:
    """``PoolInfo`` of a pool and the wire config it was created with."""
    info = admin_pb2.PoolInfo(
        pool_id=pool.name,
        state=pool_state_to_proto(pool.state),  # type: ignore[arg-type]
        config=config,
        hashing=hashing_to_proto(pool.hashing),
        registered_ranks=sorted(pool.registrations),
        num_requests=len(pool.requests),
        last_event_sequence=pool.last_event_sequence,
        epoch=pool.epoch,
    )
    manager = pool.manager
    if manager is not None and pool.kv_cache_config is not None:
        info.kv_cache_config.CopyFrom(kv_cache_config_to_proto(pool.kv_cache_config))
        info.num_free_blocks = manager.num_free_blocks
        info.usage = manager.usage
    snapshot = pool.snapshot()  # the lifetime counters; drains nothing a take would answer
    _counters_to_proto(snapshot, info.prefix_cache)
    info.prefix_cache.recent_hit_rate = snapshot.recent_hit_rate
    return info


def pool_info_from_proto(message: admin_pb2.PoolInfo) -> PoolInfo:
    """The ``PoolInfo`` of a wire one."""
    kv_cache_config = (
        kv_cache_config_from_proto(message.kv_cache_config)
        if message.HasField("kv_cache_config")
        else None
    )
    return PoolInfo(
        pool_id=message.pool_id,
        state=pool_state_from_proto(message.state),
        config=pool_config_from_proto(message.config),
        kv_cache_config=kv_cache_config,
        hashing=hashing_from_proto(message.hashing),
        registered_ranks=tuple(message.registered_ranks),
        num_free_blocks=message.num_free_blocks,
        num_requests=message.num_requests,
        usage=message.usage,
        last_event_sequence=message.last_event_sequence,
        epoch=message.epoch,
        zmq_events=(
            zmq_event_stream_from_proto(message.zmq_events)
            if message.HasField("zmq_events")
            else None
        ),
        step_progress=(
            _step_progress_from_proto(message.step_progress)
            if message.HasField("step_progress")
            else None
        ),
        prefix_cache=_prefix_cache_from_proto(message.prefix_cache),
    )


def _same_named(record: type, source: object) -> dict[str, Any]:
    # The fields of a record whose kvcm.v1 message has fields of the same names, read from
    # either side.
    return {field.name: getattr(source, field.name) for field in fields(record)}


def _step_progress_from_proto(message: admin_pb2.StepProgress) -> StepProgress:
    return StepProgress(**_same_named(StepProgress, message))


def _counters_to_proto(counters: object, message: Any) -> None:
    for name, wire in _PREFIX_CACHE_COUNTERS:
        setattr(message, wire, getattr(counters, name))


def _counters_from_proto(message: Any) -> dict[str, Any]:
    return {name: getattr(message, wire) for name, wire in _PREFIX_CACHE_COUNTERS}


def _prefix_cache_from_proto(message: admin_pb2.PrefixCacheTotals) -> PrefixCacheTotals:
    return PrefixCacheTotals(
        **_counters_from_proto(message), recent_hit_rate=message.recent_hit_rate
    )


def zmq_event_stream_to_proto(stream: ZmqEventStream) -> admin_pb2.ZmqEventStream:
    """``kvcm.v1.ZmqEventStream`` of a pool's ZMQ stream."""
    return admin_pb2.ZmqEventStream(**_same_named(ZmqEventStream, stream))


def zmq_event_stream_from_proto(message: admin_pb2.ZmqEventStream) -> ZmqEventStream:
    """The ``ZmqEventStream`` of a wire one."""
    return ZmqEventStream(**_same_named(ZmqEventStream, message))


def pool_summaries_from_proto(message: admin_pb2.ListPoolsResponse) -> list[PoolSummary]:
    """The ``PoolSummary`` lines of ``ListPools``' answer."""
    return [
        PoolSummary(
            pool_id=pool.pool_id,
            state=pool_state_from_proto(pool.state, f"pools[{index}].state"),
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_requests=pool.num_requests,
        )
        for index, pool in enumerate(message.pools)
    ]


def usage_from_proto(message: scheduler_pb2.GetUsageResponse) -> Usage:
    """The ``Usage`` of ``GetUsage``' answer."""
    return Usage(**_same_named(Usage, message))


# ------------------------------------------------------------------------------ stats
def prefix_cache_stats_to_proto(
    stats: PrefixCacheStats, message: scheduler_pb2.PrefixCacheStats
) -> None:
    """Fill a wire ``PrefixCacheStats`` from the core's counters."""
    message.reset = stats.reset
    _counters_to_proto(stats, message)


def prefix_cache_stats_from_proto(
    message: scheduler_pb2.TakePrefixCacheStatsResponse,
) -> PrefixCacheStats | None:
    """The counters of ``TakePrefixCacheStats``' answer (``None``: the pool's log_stats is off)."""
    if not message.HasField("stats"):
        return None
    stats = message.stats
    return PrefixCacheStats(reset=stats.reset, **_counters_from_proto(stats))
