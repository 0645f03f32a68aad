"""kvcm.wire: the one translation between kvcm's values and ``kvcm.v1`` messages.

Every enum table lives in :mod:`kvcm.wire.enums`; specs and KV-cache configs in
:mod:`kvcm.wire.specs`; pool configs, hashing parameters, pool info, usage and stats in
:mod:`kvcm.wire.pools`; grouped block ids and slot options in :mod:`kvcm.wire.blocks`;
events in :mod:`kvcm.wire.events`; Step programs and outcomes in :mod:`kvcm.wire.step`.
Both the server and the SDK import from here, so the two sides of the wire read every
message alike. Decoders raise :class:`~kvcm.common.errors.InvalidArgumentError` with
``field`` set, never ``KeyError``.
"""

from __future__ import annotations

from kvcm.wire.blocks import (
    fill_grouped,
    grouped_from_proto,
    slot_options_from_proto,
    slot_options_to_proto,
)
from kvcm.wire.enums import (
    DTYPE_TO_PROTO,
    FREE_MODE_TO_PROTO,
    HASH_ALGORITHM_TO_PROTO,
    ITEM_STATUS_TO_PROTO,
    MEDIUM_TO_PROTO,
    POOL_STATE_TO_PROTO,
    SPEC_KIND_TO_PROTO,
    decode_enum,
    dtype_from_proto,
    dtype_to_proto,
    free_mode_from_proto,
    hash_algorithm_from_proto,
    hash_algorithm_to_proto,
    item_status_from_proto,
    medium_from_proto,
    medium_to_proto,
    pool_state_from_proto,
    pool_state_to_proto,
    spec_kind_from_proto,
    spec_kind_to_proto,
)
from kvcm.wire.events import (
    EventBatch,
    decode_event_batch,
    event_from_proto,
    events_to_proto,
)
from kvcm.wire.pools import (
    hashing_from_proto,
    hashing_to_proto,
    pool_config_from_proto,
    pool_config_to_proto,
    pool_info_from_proto,
    pool_info_to_proto,
    pool_summaries_from_proto,
    prefix_cache_stats_from_proto,
    prefix_cache_stats_to_proto,
    usage_from_proto,
    zmq_event_stream_from_proto,
    zmq_event_stream_to_proto,
)
from kvcm.wire.specs import (
    kv_cache_config_from_proto,
    kv_cache_config_to_proto,
    layer_specs_from_proto,
    layer_specs_to_proto,
    spec_from_proto,
    spec_to_proto,
)
from kvcm.wire.step import (
    STEP_REJECTION_TRAILER,
    alloc_options_from_proto,
    outcome_from_proto,
    outcome_to_proto,
    program_from_proto,
    program_to_proto,
    step_rejection_from_trailers,
    step_rejection_to_trailer,
)

__all__ = [
    "STEP_REJECTION_TRAILER",
    "alloc_options_from_proto",
    "outcome_from_proto",
    "outcome_to_proto",
    "program_from_proto",
    "program_to_proto",
    "step_rejection_from_trailers",
    "step_rejection_to_trailer",
    "DTYPE_TO_PROTO",
    "FREE_MODE_TO_PROTO",
    "HASH_ALGORITHM_TO_PROTO",
    "ITEM_STATUS_TO_PROTO",
    "MEDIUM_TO_PROTO",
    "POOL_STATE_TO_PROTO",
    "SPEC_KIND_TO_PROTO",
    "EventBatch",
    "decode_enum",
    "decode_event_batch",
    "dtype_from_proto",
    "dtype_to_proto",
    "event_from_proto",
    "events_to_proto",
    "fill_grouped",
    "free_mode_from_proto",
    "grouped_from_proto",
    "hash_algorithm_from_proto",
    "hash_algorithm_to_proto",
    "hashing_from_proto",
    "hashing_to_proto",
    "item_status_from_proto",
    "kv_cache_config_from_proto",
    "kv_cache_config_to_proto",
    "layer_specs_from_proto",
    "layer_specs_to_proto",
    "medium_from_proto",
    "medium_to_proto",
    "pool_config_from_proto",
    "pool_config_to_proto",
    "pool_info_from_proto",
    "pool_info_to_proto",
    "pool_state_from_proto",
    "pool_state_to_proto",
    "pool_summaries_from_proto",
    "prefix_cache_stats_from_proto",
    "prefix_cache_stats_to_proto",
    "slot_options_from_proto",
    "slot_options_to_proto",
    "spec_from_proto",
    "spec_kind_from_proto",
    "spec_kind_to_proto",
    "spec_to_proto",
    "usage_from_proto",
    "zmq_event_stream_from_proto",
    "zmq_event_stream_to_proto",
]
