"""KV events: vLLM's field names, frozen slotted records, hashable for cross-worker counting."""

from __future__ import annotations

import dataclasses

import pytest

from kvcm.common.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    new_block_stored,
)


def stored(**overrides: object) -> BlockStored:
    fields: dict[str, object] = {
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": MEDIUM_GPU,
        "lora_name": None,
    }
    fields.update(overrides)
    return BlockStored(**fields)  # type: ignore[arg-type]


def test_fields_match_vllm() -> None:
    assert [f.name for f in dataclasses.fields(BlockStored)] == [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    ]
    assert [f.name for f in dataclasses.fields(BlockRemoved)] == [
        "block_hashes",
        "medium",
        "group_idx",
        "locality",
        "ownership",
    ]
    assert dataclasses.fields(AllBlocksCleared) == ()
    assert [f.name for f in dataclasses.fields(KVEventBatch)] == [
        "ts",
        "events",
        "data_parallel_rank",
    ]


def test_frozen_slotted_and_replace() -> None:
    event = stored()
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.group_idx = 3  # type: ignore[misc]
    assert not hasattr(event, "__dict__")
    annotated = dataclasses.replace(event, kv_cache_spec_kind="full_attention")
    assert annotated.kv_cache_spec_kind == "full_attention"
    assert event.kv_cache_spec_kind is None


def test_new_block_stored_equals_the_constructor_s_event() -> None:
    """The block pool's fast builder sets every field, in order, as the constructor does."""
    values = {
        "block_hashes": [b"a", b"b"],
        "parent_block_hash": b"p",
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": 7,
        "medium": MEDIUM_GPU,
        "lora_name": "adapter",
        "extra_keys": [("adapter",), None],
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 64,
        "session_id": "s",
        "lookahead_token_ids": [[5], [6]],
    }
    fast = new_block_stored(*values.values())  # type: ignore[arg-type]
    made = BlockStored(**values)  # type: ignore[arg-type]
    assert fast == made
    assert hash(fast) == hash(made)
    assert {f.name: getattr(fast, f.name) for f in dataclasses.fields(BlockStored)} == {
        **values,
        "locality": None,
        "ownership": None,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.block_size = 3  # type: ignore[misc]


def test_equal_events_hash_alike() -> None:
    a = stored(extra_keys=[("lora",), None], lookahead_token_ids=[[5], [6]])
    b = stored(extra_keys=[("lora",), None], lookahead_token_ids=[[5], [6]])
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b, stored(group_idx=1)}) == 2
    removed = BlockRemoved(block_hashes=[9], medium=MEDIUM_GPU, group_idx=0)
    assert hash(removed) == hash(BlockRemoved(block_hashes=[9], medium=MEDIUM_GPU, group_idx=0))
    assert AllBlocksCleared() == AllBlocksCleared()
    assert hash(AllBlocksCleared()) == hash(AllBlocksCleared())


def test_keyword_only_and_batch() -> None:
    with pytest.raises(TypeError):
        BlockRemoved([1], MEDIUM_GPU)  # type: ignore[call-arg]
    events: list[KVCacheEvent] = [stored(), AllBlocksCleared()]
    batch = KVEventBatch(ts=1.5, events=events)
    assert batch.data_parallel_rank is None
    assert batch.events[1] == AllBlocksCleared()
