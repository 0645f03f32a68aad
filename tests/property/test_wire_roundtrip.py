"""kvcm.wire round trips: whatever value the core can hold comes back equal from its message.

Specs of every kind, KV-cache configs with tensors, pool configs with any mix of optional
fields, and events (the fields the wire carries) are drawn by Hypothesis; each must satisfy
``decode(encode(x)) == x``, and the encoded message must survive serialization.
"""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec, KVCacheLayout, KVCacheTensor
from kvcm.common.dtypes import DType
from kvcm.common.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvcm.common.hashing import HashAlgorithm
from kvcm.common.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvcm.core.pool_types import PoolConfig
from kvcm.v1 import admin_pb2, common_pb2, events_pb2
from kvcm.wire import (
    DTYPE_TO_PROTO,
    SPEC_KIND_TO_PROTO,
    decode_event_batch,
    events_to_proto,
    kv_cache_config_from_proto,
    kv_cache_config_to_proto,
    pool_config_from_proto,
    pool_config_to_proto,
    spec_from_proto,
    spec_to_proto,
)

PROFILE = settings.get_profile(os.environ.get("KVCM_PROPERTY_PROFILE", "kvcm-ci"))
FAST = settings(PROFILE, max_examples=min(PROFILE.max_examples, 150))

dtypes = st.sampled_from(sorted(DTYPE_TO_PROTO))
block_sizes = st.sampled_from([1, 8, 16, 32, 64])
small = st.integers(min_value=1, max_value=256)


@st.composite
def attention(draw: st.DrawFn) -> dict[str, object]:
    head_size = draw(st.integers(1, 256))
    return {
        "block_size": draw(block_sizes),
        "num_kv_heads": draw(st.integers(1, 16)),
        "head_size": head_size,
        "dtype": draw(dtypes),
        "head_size_v": draw(st.none() | st.integers(1, 256)),
    }


def _maybe(values: st.SearchStrategy[int]) -> st.SearchStrategy[int | None]:
    return st.none() | values


attention_specs: st.SearchStrategy[KVCacheSpec] = st.one_of(
    st.builds(
        lambda a, window, chunk: FullAttentionSpec(
            **a, sliding_window=window, attention_chunk_size=chunk
        ),
        attention(),
        _maybe(small),
        _maybe(small),
    ),
    st.builds(
        lambda a, cache: MLAAttentionSpec(**{**a, "head_size_v": 0}, cache_dtype_str=cache),
        attention(),
        st.none() | st.sampled_from(["auto", "fp8_ds_mla"]),
    ),
    st.builds(lambda a, n: SinkFullAttentionSpec(**a, sink_len=n), attention(), _maybe(small)),
    st.builds(lambda a, w: SlidingWindowSpec(**a, sliding_window=w), attention(), small),
    st.builds(
        lambda a, c: ChunkedLocalAttentionSpec(**a, attention_chunk_size=c), attention(), small
    ),
    st.builds(lambda a: CrossAttentionSpec(**a), attention()),
    st.builds(lambda a: EncoderOnlyAttentionSpec(**a), attention()),
)
mamba_specs = st.builds(
    lambda bs, shapes, dts, spec_blocks, align: MambaSpec(
        block_size=bs,
        shapes=tuple(shapes),
        dtypes=tuple(dts[: len(shapes)] + [DType.FLOAT16] * (len(shapes) - len(dts))),
        num_speculative_blocks=spec_blocks,
        mamba_cache_mode="align" if align is not None else "none",
        num_prefill_checkpoint_blocks=0 if align is None else align[0],
        prefill_checkpoint_alignment=None if align is None else align[1],
    ),
    block_sizes,
    st.lists(
        st.lists(st.integers(1, 64), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3
    ),
    st.lists(dtypes, max_size=3),
    st.integers(0, 3),
    st.none() | st.tuples(st.integers(0, 2), st.none() | st.integers(1, 512)),
)
specs = st.one_of(attention_specs, mamba_specs)


@FAST
@given(specs)
def test_every_spec_round_trips(spec: KVCacheSpec) -> None:
    message = common_pb2.KVCacheSpec.FromString(spec_to_proto(spec).SerializeToString())
    assert spec_from_proto(message) == spec


@FAST
@given(block_sizes, attention(), st.lists(st.integers(1, 8), min_size=1, max_size=4))
def test_uniform_type_specs_round_trip(
    block_size: int, fields: dict[str, object], heads: list[int]
) -> None:
    layers = {
        f"layer.{i}": FullAttentionSpec(**{**fields, "block_size": block_size, "num_kv_heads": n})  # type: ignore[arg-type]
        for i, n in enumerate(heads)
    }
    spec = UniformTypeKVCacheSpecs(block_size=block_size, kv_cache_specs=layers)
    assert spec_from_proto(spec_to_proto(spec)) == spec


@st.composite
def kv_cache_configs(draw: st.DrawFn) -> KVCacheConfig:
    num_groups = draw(st.integers(1, 3))
    groups = tuple(
        KVCacheGroupSpec(
            layer_names=tuple(f"g{g}.l{i}" for i in range(draw(st.integers(1, 3)))),
            kv_cache_spec=draw(attention_specs),
        )
        for g in range(num_groups)
    )
    num_blocks = draw(st.integers(2, 1000))
    names = [name for group in groups for name in group.layer_names]
    tensors = tuple(
        KVCacheTensor(
            size=draw(st.integers(1, 1 << 30)),
            layers=(name,),
            layer_stride=0,
            block_stride=draw(st.integers(0, 1 << 20)),
            offset=0,
        )
        for name in names
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_layout=draw(st.sampled_from(list(KVCacheLayout))),
        kv_cache_tensors=tensors if draw(st.booleans()) else (),
        kv_cache_groups=groups,
    )


@FAST
@given(kv_cache_configs())
def test_kv_cache_configs_round_trip(config: KVCacheConfig) -> None:
    message = common_pb2.KVCacheConfig.FromString(
        kv_cache_config_to_proto(config).SerializeToString()
    )
    assert kv_cache_config_from_proto(message) == config


@st.composite
def pool_configs(draw: st.DrawFn) -> PoolConfig:
    explicit = draw(st.booleans())
    layout = None
    if explicit:
        full = draw(kv_cache_configs())
        layout = KVCacheConfig(
            num_blocks=full.num_blocks, kv_cache_tensors=(), kv_cache_groups=full.kv_cache_groups
        )
    return PoolConfig(
        max_model_len=draw(st.integers(1, 1 << 20)),
        world_size=0 if explicit else draw(st.integers(1, 8)),
        explicit_layout=layout,
        num_blocks_override=draw(_maybe(st.integers(2, 1 << 20))),
        scheduler_block_size=draw(_maybe(st.integers(1, 512))),
        hash_block_size=draw(_maybe(st.integers(1, 512))),
        max_in_flight_tokens=draw(_maybe(st.integers(1, 1 << 20))),
        enable_caching=draw(st.booleans()),
        hash_algorithm=draw(st.sampled_from(list(HashAlgorithm))),
        hash_seed=draw(st.none() | st.text(max_size=20)),
        verify_block_hashes=draw(st.booleans()),
        enable_kv_cache_events=draw(st.booleans()),
        event_retention_num_events=draw(st.integers(1, 1 << 20)),
        log_stats=draw(st.booleans()),
        watermark=draw(st.floats(0.0, 0.99, allow_nan=False)),
        disable_hybrid_kv_cache_manager=draw(st.none() | st.booleans()),
        max_num_batched_tokens=draw(_maybe(st.integers(1, (1 << 32) - 1))),
        max_num_encoder_input_tokens=draw(st.none() | st.integers(0, (1 << 32) - 1)),
        kv_cache_memory_bytes=draw(_maybe(st.integers(1, (1 << 64) - 1))),
        auto_fit_max_model_len=draw(st.booleans()),
        kv_cache_layout=draw(st.sampled_from(list(KVCacheLayout))),
        host_tier_bytes=draw(st.integers(0, (1 << 64) - 1)),
    )


@FAST
@given(pool_configs())
def test_pool_configs_round_trip(config: PoolConfig) -> None:
    message = admin_pb2.PoolConfig.FromString(pool_config_to_proto(config).SerializeToString())
    assert pool_config_from_proto(message) == config


def _hashes(length: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=length, max_size=length)


_extra_key = st.one_of(
    st.text(max_size=8),
    st.binary(min_size=32, max_size=32),
    st.tuples(st.text(max_size=8), st.integers(0, 1 << 20)),
)


def _events(length: int) -> st.SearchStrategy[KVCacheEvent]:
    hashes = _hashes(length)
    return st.one_of(
        st.builds(
            lambda hs, parent, tokens, bs, lora, medium, name, group, kind, window, keys, more: (
                BlockStored(
                    block_hashes=hs,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=bs,
                    lora_id=lora,
                    medium=medium,
                    lora_name=name,
                    group_idx=group,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                    extra_keys=keys,
                    locality=more[0],
                    session_id=more[1],
                    lookahead_token_ids=more[2],
                )
            ),
            st.lists(hashes, max_size=4),
            st.none() | hashes,
            st.lists(st.integers(0, 1 << 31), max_size=32),
            block_sizes,
            _maybe(st.integers(0, 100)),
            st.sampled_from([None, MEDIUM_GPU, MEDIUM_CPU]),
            st.none() | st.text(max_size=10),
            _maybe(st.integers(0, 4)),
            st.sampled_from([None, *sorted(SPEC_KIND_TO_PROTO)]),
            _maybe(small),
            st.none()
            | st.lists(st.none() | st.lists(_extra_key, min_size=1, max_size=3).map(tuple)),
            st.tuples(
                st.sampled_from([None, "LOCAL", "REMOTE"]),
                st.none() | st.text(max_size=6),
                st.none() | st.lists(st.lists(st.integers(0, 1 << 31), max_size=3)),
            ),
        ),
        st.builds(
            lambda hs, medium, group, owner: BlockRemoved(
                block_hashes=hs, medium=medium, group_idx=group, ownership=owner
            ),
            st.lists(hashes, max_size=4),
            st.sampled_from([None, MEDIUM_GPU]),
            _maybe(st.integers(0, 4)),
            st.none() | st.text(max_size=6),
        ),
        st.just(AllBlocksCleared()),
    )


@FAST
@given(st.data(), st.sampled_from([16, 32]), st.integers(0, 1 << 40))
def test_events_round_trip(data: st.DataObject, length: int, first: int) -> None:
    batch = data.draw(st.lists(_events(length), max_size=6))
    message = events_pb2.SubscribeEventsResponse(
        first_sequence=first, events=events_to_proto(batch)
    )
    wire = events_pb2.SubscribeEventsResponse.FromString(message.SerializeToString())
    decoded = decode_event_batch(wire, length)
    assert decoded.first_sequence == first
    assert decoded.events == batch
