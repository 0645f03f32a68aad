"""The mirror's KV events as vLLM 0.33's structs: every field of kvcm's records carried.

``to_vllm_events`` names each field (it runs inside the engine's step, so it builds no dict per
event); these checks fail when either side gains a field the conversion does not carry.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.common.hashing import external_block_hash
from kvcm.integrations.vllm._convert import to_vllm_events


def test_kvcm_and_vllm_event_records_have_the_same_fields(kv_events: ModuleType) -> None:
    for ours, theirs in (
        (BlockStored, kv_events.BlockStored),
        (BlockRemoved, kv_events.BlockRemoved),
        (AllBlocksCleared, kv_events.AllBlocksCleared),
    ):
        assert tuple(f.name for f in dataclasses.fields(ours)) == theirs.__struct_fields__


def test_every_field_is_carried_and_hashes_take_the_engine_form(kv_events: ModuleType) -> None:
    parent, first, second = (bytes([i]) * 32 for i in (1, 2, 3))
    stored = BlockStored(
        block_hashes=[first, second],
        parent_block_hash=parent,
        token_ids=list(range(32)),
        block_size=16,
        lora_id=7,
        medium="GPU",
        lora_name="adapter",
        extra_keys=[("adapter",), None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=64,
        locality="LOCAL",
        ownership="tier-1",
        session_id="s",
        lookahead_token_ids=[[32], [33]],
    )
    removed = BlockRemoved(
        block_hashes=[second], medium="GPU", group_idx=1, locality="REMOTE", ownership="tier-2"
    )
    for convert in (external_block_hash, lambda h: h):
        out = to_vllm_events([stored, removed, AllBlocksCleared()], kv_events, convert)
        assert [type(e) for e in out] == [
            kv_events.BlockStored,
            kv_events.BlockRemoved,
            kv_events.AllBlocksCleared,
        ]
        for ours, theirs in zip((stored, removed), out[:2], strict=True):
            for field in dataclasses.fields(ours):
                value = getattr(ours, field.name)
                if field.name == "block_hashes":
                    value = [convert(h) for h in value]
                elif field.name == "parent_block_hash":
                    value = convert(value)
                assert getattr(theirs, field.name) == value, field.name
    root = dataclasses.replace(stored, parent_block_hash=None)
    assert to_vllm_events([root], kv_events, external_block_hash)[0].parent_block_hash is None
    # A decode turn's event: one block.
    one = dataclasses.replace(stored, block_hashes=[first], extra_keys=[None])
    (out,) = to_vllm_events([one], kv_events, external_block_hash)
    assert out.block_hashes == [external_block_hash(first)]
    assert out.parent_block_hash == external_block_hash(parent)
    assert out.extra_keys == [None]


def test_the_mirror_s_maker_makes_what_the_conversion_makes(kv_events: ModuleType) -> None:
    """The mirror's core makes vLLM's ``BlockStored`` as it caches (``make_stored_event``):
    the same struct ``to_vllm_events`` makes of kvcm's record, in either hash form, and
    ``to_vllm_events`` passes it through."""
    from kvcm.common.events import new_block_stored
    from kvcm.integrations.vllm._manager import _same_hash, _vllm_stored_maker

    parent, first, second = (bytes([i]) * 32 for i in (4, 5, 6))
    for hashes, parent_hash in (([first], parent), ([first, second], None)):
        args = (
            hashes,
            parent_hash,
            list(range(16 * len(hashes))),
            16,
            3,
            "GPU",
            "adapter",
            [None] * len(hashes),
            0,
            "full_attention",
            None,
            "session",
            None,
        )
        for convert in (external_block_hash, _same_hash):
            made = _vllm_stored_maker(kv_events.BlockStored, convert)(*args)
            (expected,) = to_vllm_events([new_block_stored(*args)], kv_events, convert)
            assert made == expected
            assert to_vllm_events([made], kv_events, convert) == [made]
