"""kvcm.wire: specs, configs, pool configs and events survive the round trip; errors name fields."""

from __future__ import annotations

import pytest

from kvcm.client import FreeMode, PoolConfig, PoolState
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.common.hashing import HashAlgorithm, external_block_hash
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
from kvcm.v1 import common_pb2, events_pb2
from kvcm.wire import (
    DTYPE_TO_PROTO,
    FREE_MODE_TO_PROTO,
    HASH_ALGORITHM_TO_PROTO,
    decode_event_batch,
    dtype_from_proto,
    fill_grouped,
    free_mode_from_proto,
    grouped_from_proto,
    hash_algorithm_from_proto,
    hash_algorithm_to_proto,
    hashing_from_proto,
    kv_cache_config_from_proto,
    kv_cache_config_to_proto,
    layer_specs_from_proto,
    layer_specs_to_proto,
    pool_config_from_proto,
    pool_config_to_proto,
    pool_state_from_proto,
    pool_state_to_proto,
    spec_from_proto,
    spec_to_proto,
)

ATTENTION = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": DType.BFLOAT16}

SPECS: list[KVCacheSpec] = [
    FullAttentionSpec(**ATTENTION),  # type: ignore[arg-type]
    FullAttentionSpec(**ATTENTION, sliding_window=128, attention_chunk_size=256),  # type: ignore[arg-type]
    FullAttentionSpec(**ATTENTION, head_size_v=32, page_size_padded=8192),  # type: ignore[arg-type]
    MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype=DType.FLOAT8_E4M3FN,
        cache_dtype_str="fp8_ds_mla",
    ),
    SinkFullAttentionSpec(**ATTENTION, sink_len=4),  # type: ignore[arg-type]
    SlidingWindowSpec(**ATTENTION, sliding_window=64),  # type: ignore[arg-type]
    ChunkedLocalAttentionSpec(**ATTENTION, attention_chunk_size=128),  # type: ignore[arg-type]
    CrossAttentionSpec(**ATTENTION),  # type: ignore[arg-type]
    EncoderOnlyAttentionSpec(**ATTENTION),  # type: ignore[arg-type]
    MambaSpec(
        block_size=32,
        shapes=((4, 8), (2,)),
        dtypes=(DType.FLOAT16, DType.FLOAT32),
        num_speculative_blocks=1,
    ),
    UniformTypeKVCacheSpecs(
        block_size=16,
        kv_cache_specs={
            "a": FullAttentionSpec(**ATTENTION),  # type: ignore[arg-type]
            "b": FullAttentionSpec(
                block_size=16, num_kv_heads=4, head_size=64, dtype=DType.BFLOAT16
            ),
        },
    ),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: type(spec).__name__)
def test_specs_round_trip(spec: KVCacheSpec) -> None:
    assert spec_from_proto(spec_to_proto(spec)) == spec


def test_layer_specs_keep_the_callers_order_and_unset_specs_are_rejected() -> None:
    # The model runner's order (model.layers.2 before model.layers.10) decides planning.
    names = ["model.layers.2.attn", "model.layers.10.attn", "b", "a"]
    entries = layer_specs_to_proto(dict.fromkeys(names, SPECS[0]))
    assert [entry.layer_name for entry in entries] == names
    with pytest.raises(InvalidArgumentError, match="spec is unset"):
        spec_from_proto(common_pb2.KVCacheSpec())
    with pytest.raises(InvalidArgumentError, match="wire form"):
        spec_to_proto(FullAttentionSpec(**{**ATTENTION, "dtype": DType.FLOAT64}))  # type: ignore[arg-type]


def test_kv_cache_config_round_trips_with_its_tensor_placement() -> None:
    full = FullAttentionSpec(**ATTENTION)  # type: ignore[arg-type]
    window = SlidingWindowSpec(**ATTENTION, sliding_window=64)  # type: ignore[arg-type]
    page = full.page_size_bytes
    num_blocks = 100
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(
            # Two layers of one group stacked, layer-outermost.
            KVCacheTensor(
                size=2 * page * num_blocks,
                layers=("l0", "l1"),
                layer_stride=page * num_blocks,
                block_stride=page,
            ),
            # One layer of each group overlaying one allocation.
            KVCacheTensor(
                size=page * num_blocks, layers=("l2", "l3"), layer_stride=0, block_stride=page
            ),
        ),
        kv_cache_groups=(
            KVCacheGroupSpec(layer_names=("l0", "l1", "l2"), kv_cache_spec=full),
            KVCacheGroupSpec(layer_names=("l3",), kv_cache_spec=window),
        ),
    )
    assert kv_cache_config_from_proto(kv_cache_config_to_proto(config)) == config


def test_pool_config_round_trips_with_defaults_left_unset() -> None:
    layout = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPECS[0]),),
    )
    for config in (
        PoolConfig(max_model_len=2048, world_size=4),
        PoolConfig(
            max_model_len=4096,
            explicit_layout=layout,
            scheduler_block_size=16,
            hash_block_size=16,
            max_in_flight_tokens=8192,
            enable_caching=False,
            hash_algorithm="xxhash_cbor",
            hash_seed="secret",
            verify_block_hashes=True,
            enable_kv_cache_events=True,
            event_retention_num_events=100,
            log_stats=False,
            watermark=0.01,
        ),
        # vLLM's CacheConfig default (0) travels as set, unlike an unset (dense) interval.
        PoolConfig(max_model_len=64, world_size=1, prefix_cache_retention_interval=0),
        PoolConfig(max_model_len=64, world_size=1, prefix_cache_retention_interval=32),
    ):
        message = pool_config_to_proto(config)
        assert pool_config_from_proto(message) == config
    defaults = pool_config_to_proto(PoolConfig(max_model_len=2048, world_size=1))
    assert not defaults.HasField("enable_caching")
    assert not defaults.HasField("hash_seed")
    assert not defaults.HasField("prefix_cache_retention_interval")
    with pytest.raises(InvalidArgumentError, match=r"config\.prefix_cache_retention_interval"):
        PoolConfig(max_model_len=64, world_size=1, prefix_cache_retention_interval=-16)
    with pytest.raises(InvalidArgumentError, match="hash_algorithm"):
        pool_config_to_proto(PoolConfig(max_model_len=1, hash_algorithm="md5"))


def test_hashing_parameters_build_the_pools_hasher() -> None:
    message = common_pb2.HashingParameters(
        algorithm=common_pb2.HASH_ALGORITHM_XXHASH,
        seed="s",
        hash_block_size=16,
        hash_length_bytes=16,
    )
    hashing = hashing_from_proto(message)
    assert hashing.algorithm is HashAlgorithm.XXHASH
    assert "seed=<hidden>" in repr(hashing)  # an xxhash seed is a secret
    hasher = hashing.block_hasher()
    assert hasher.block_size == 16
    assert len(hasher.hash_token_ids(list(range(32)))[0]) == 16


def test_events_decode_full_width_hashes() -> None:
    first, second, parent = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    message = events_pb2.SubscribeEventsResponse(
        first_sequence=7,
        hash_length_bytes=32,
        oldest_sequence=1,
        timestamp_unix_seconds=12.5,
        events=[
            events_pb2.KVEvent(
                block_stored=events_pb2.BlockStored(
                    block_hashes=first + second,
                    parent_block_hash=parent,
                    token_ids=list(range(32)),
                    block_size=16,
                    medium=events_pb2.MEDIUM_GPU,
                    group_idx=0,
                    kv_cache_spec_kind=common_pb2.KV_CACHE_SPEC_KIND_FULL_ATTENTION,
                )
            ),
            events_pb2.KVEvent(
                block_removed=events_pb2.BlockRemoved(
                    block_hashes=first, medium=events_pb2.MEDIUM_GPU, group_idx=0
                )
            ),
            events_pb2.KVEvent(all_blocks_cleared=events_pb2.AllBlocksCleared()),
        ],
    )
    batch = decode_event_batch(message, 32)
    assert batch.first_sequence == 7
    assert batch.last_sequence == 9
    assert batch.oldest_sequence == 1
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [first, second]
    assert stored.parent_block_hash == parent
    assert external_block_hash(first) == int.from_bytes(first[-8:], "big")
    assert stored.token_ids == list(range(32))
    assert stored.medium == "GPU"
    assert stored.kv_cache_spec_kind == "full_attention"
    assert stored.lora_name is None
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [first]
    assert isinstance(cleared, AllBlocksCleared)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_planned_configs_round_trip(layout: str) -> None:
    from kvcm.common.config import KVCacheLayout
    from kvcm.core.planning import get_kv_cache_config_from_groups

    full = FullAttentionSpec(**ATTENTION)  # type: ignore[arg-type]
    window = SlidingWindowSpec(**ATTENTION, sliding_window=64)  # type: ignore[arg-type]
    groups = (
        KVCacheGroupSpec(layer_names=("l0", "l2"), kv_cache_spec=full),
        KVCacheGroupSpec(layer_names=("l1", "l3"), kv_cache_spec=window),
    )
    config = get_kv_cache_config_from_groups(groups, 128, KVCacheLayout[layout])
    assert kv_cache_config_from_proto(kv_cache_config_to_proto(config)) == config


def test_unknown_enum_values_name_their_field() -> None:
    message = pool_config_to_proto(PoolConfig(max_model_len=16, world_size=1))
    message.hash_algorithm = 7  # type: ignore[assignment]
    with pytest.raises(
        InvalidArgumentError, match=r"^config.hash_algorithm: unknown value 7$"
    ) as e:
        pool_config_from_proto(message)
    assert e.value.field == "config.hash_algorithm"
    spec = spec_to_proto(SPECS[0])
    spec.full_attention.attention.dtype = 99  # type: ignore[assignment]
    layer = common_pb2.LayerSpec(layer_name="l0", spec=spec)
    with pytest.raises(InvalidArgumentError) as e:
        layer_specs_from_proto([layer])
    assert e.value.field == "layer_specs[0].spec.full_attention.attention.dtype"
    assert str(e.value) == "layer_specs[0].spec.full_attention.attention.dtype: unknown value 99"


def test_out_of_domain_spec_fields_name_the_layer() -> None:
    spec = spec_to_proto(SPECS[0])
    spec.full_attention.attention.num_kv_heads = 0
    with pytest.raises(InvalidArgumentError) as e:
        layer_specs_from_proto([common_pb2.LayerSpec(layer_name="x", spec=spec)])
    assert (e.value.field or "").startswith("layer_specs[0].spec")
    assert "num_kv_heads" in str(e.value)
    with pytest.raises(InvalidArgumentError, match=r"layer_specs\[1\].layer_name is a duplicate"):
        layer_specs_from_proto(
            [common_pb2.LayerSpec(layer_name="x", spec=spec_to_proto(s)) for s in SPECS[:2]]
        )
    with pytest.raises(InvalidArgumentError, match="layer_specs must not be empty"):
        layer_specs_from_proto([])


def test_enum_tables_cover_every_python_member_and_decode_back() -> None:
    for state in PoolState:
        assert pool_state_from_proto(pool_state_to_proto(state)) is state
    assert pool_state_from_proto(0) is PoolState.PENDING_WORKERS
    for mode in FreeMode:
        assert free_mode_from_proto(FREE_MODE_TO_PROTO[mode]) is mode
    with pytest.raises(InvalidArgumentError, match=r"^mode: unknown value 0$"):
        free_mode_from_proto(0)
    for algorithm in HashAlgorithm:
        assert hash_algorithm_from_proto(hash_algorithm_to_proto(algorithm)) is algorithm
    assert hash_algorithm_from_proto(0) is HashAlgorithm.SHA256
    for dtype, value in DTYPE_TO_PROTO.items():
        assert dtype_from_proto(value) is dtype
    assert set(common_pb2.HashAlgorithm.values()) - {0} == set(HASH_ALGORITHM_TO_PROTO.values())
    assert set(common_pb2.DataType.values()) - {0} == set(DTYPE_TO_PROTO.values())


def test_grouped_block_ids_round_trip() -> None:
    message = common_pb2.GroupedBlockIds()
    fill_grouped(([1, 2, 3], [], [7]), message)
    assert grouped_from_proto(message) == ([1, 2, 3], [], [7])


def test_pool_config_accepts_algorithm_names_and_refuses_unknown_ones() -> None:
    config = PoolConfig(max_model_len=16, world_size=1, hash_algorithm="xxhash")  # type: ignore[arg-type]
    assert config.hash_algorithm is HashAlgorithm.XXHASH
    with pytest.raises(InvalidArgumentError) as e:
        PoolConfig(max_model_len=16, world_size=1, hash_algorithm="md5")  # type: ignore[arg-type]
    assert e.value.field == "config.hash_algorithm"


def test_lookup_messages_round_trip() -> None:
    import dataclasses

    from kvcm.common.hashing import MultiModalFeature
    from kvcm.core.lookup import LookupAnswer, LookupQuery, PoolHit, PoolLoad
    from kvcm.v1 import lookup_pb2
    from kvcm.wire.lookup import (
        lookup_query_from_json,
        lookup_query_from_proto,
        lookup_query_to_proto,
        lookup_result_from_proto,
        lookup_result_to_json,
        lookup_result_to_proto,
    )

    tokens = LookupQuery(
        token_ids=[5, 6, 7, 8],
        lora_name="adapter",
        lora_path="/loras/a",
        cache_salt="tenant",
        mm_features=(MultiModalFeature("img", 1, 2),),
        pool_ids=("a", "b"),
        labels={"role": "decode"},
        load_weight=0.0,
        max_results=3,
    )
    hashed = LookupQuery(block_hashes=b"h" * 64, num_tokens=40)
    for query in (tokens, hashed):
        wire = lookup_pb2.LookupRequest.FromString(lookup_query_to_proto(query).SerializeToString())
        back = lookup_query_from_proto(wire)
        assert back == dataclasses.replace(query, token_ids=back.token_ids)
        assert list(back.token_ids or []) == list(query.token_ids or [])
    parsed = lookup_query_from_json(b'{"tokens": {"tokenIds": [1, 2]}, "maxResults": 1}')
    assert (list(parsed.token_ids or []), parsed.max_results) == ([1, 2], 1)
    request = lookup_query_to_proto(tokens)
    request.tokens.mm_features.add(identifier="x", offset_tokens=0, length_tokens=1)
    with pytest.raises(InvalidArgumentError, match="mm_features must be sorted"):
        lookup_query_from_proto(request)
    answer = LookupAnswer(
        (PoolHit("a", 32, (32, 16), {"GPU": 32}, 40, PoolLoad(0.25, 7, 2, 1), 0.675),),
        (("b", "not ready: workers have not registered"),),
        2,
    )
    wire_answer = lookup_pb2.LookupResponse.FromString(
        lookup_result_to_proto(answer).SerializeToString()
    )
    assert lookup_result_from_proto(wire_answer) == answer
    document = lookup_result_to_json(answer)
    assert document["pools"][0]["num_hit_tokens"] == 32  # a JSON number, snake_case
    assert document["skipped"][0]["pool_id"] == "b"


def test_every_attention_spec_field_travels_or_is_declared_not_to() -> None:
    # The attention specs' wire form is derived from their classes (traits.wire_tag and
    # field names); a spec field the proto message lacks must be listed in NOT_ON_THE_WIRE,
    # so adding a field to a spec class cannot silently drop it on the wire.
    import dataclasses

    from kvcm.common.specs import AttentionSpec
    from kvcm.wire.specs import _DECODERS, NOT_ON_THE_WIRE

    attention_fields = {f.name for f in dataclasses.fields(AttentionSpec)}
    classes = [
        decoder.args[0]  # type: ignore[attr-defined]
        for tag, decoder in _DECODERS.items()
        if tag not in ("mamba", "uniform_type")
    ]
    assert {cls.traits.wire_tag for cls in classes} == {
        f.name for f in common_pb2.KVCacheSpec.DESCRIPTOR.oneofs_by_name["spec"].fields
    } - {"mamba", "uniform_type"}
    for cls in classes:
        own = getattr(common_pb2, cls.__name__).DESCRIPTOR
        on_wire = {f.name for f in own.fields} - {"attention"}
        spec_fields = {f.name for f in dataclasses.fields(cls)} - attention_fields
        assert on_wire <= spec_fields, (cls.__name__, on_wire - spec_fields)
        assert spec_fields - on_wire == NOT_ON_THE_WIRE.get(cls, frozenset()), cls.__name__
