"""KVCacheManager: vLLM 0.33's scenarios, step by step, and bad input that changes nothing."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import (
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvcm.core.manager import (
    CacheHit,
    KVCacheBlocks,
    KVCacheManager,
    KVCacheManagerConfig,
    SlotOptions,
)
from kvcm.core.request import Request, RequestStatus

MAX_MODEL_LEN = 1024


def full(block_size: int = 4, dtype: object = DType.FLOAT16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=dtype)


def swa(block_size: int = 4, window: int = 8) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype=DType.FLOAT16,
        sliding_window=window,
    )


def make_manager(
    specs: Sequence[KVCacheSpec] = (),
    *,
    num_blocks: int = 11,
    enable_caching: bool = True,
    watermark: float = 0.0,
    events: bool = False,
) -> KVCacheManager:
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs or [full()])]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    return KVCacheManager(
        KVCacheManagerConfig(
            kv_cache_config=kv_cache_config,
            max_model_len=MAX_MODEL_LEN,
            enable_caching=enable_caching,
            watermark=watermark,
            enable_kv_cache_events=events,
        )
    )


def make_request(
    manager: KVCacheManager,
    request_id: str,
    tokens: Sequence[int],
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> Request:
    return Request(
        request_id,
        tokens,
        block_hasher=BlockHasher(manager.hash_block_size),
        lora_name=lora_name,
        cache_salt=cache_salt,
    )


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> CacheHit:
    """Look up, allocate the rest of the prompt (or a chunk), and mark it computed."""
    hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - hit.num_computed_tokens
    blocks = manager.allocate_slots(request, num_new_tokens, hit)
    assert blocks is not None
    request.num_computed_tokens += hit.num_computed_tokens + num_new_tokens
    request.status = RequestStatus.RUNNING
    return hit


def decode(manager: KVCacheManager, request: Request, token: int = 7) -> KVCacheBlocks | None:
    request.append_output_token_ids(token)
    blocks = manager.allocate_slots(request, 1)
    if blocks is not None:
        request.num_computed_tokens += 1
    return blocks


def free_queue(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def snapshot(manager: KVCacheManager, *request_ids: str) -> object:
    return (
        manager.block_pool.get_num_free_blocks(),
        free_queue(manager),
        [manager.get_block_ids(rid) if manager.holds_blocks(rid) else None for rid in request_ids],
    )


# ----------------------------------------------------------------------------- prefill
def test_prefill_partial_hit_shares_blocks() -> None:
    manager = make_manager()
    req0 = make_request(manager, "0", range(14))
    hit = manager.get_computed_blocks(req0)
    assert hit.num_computed_tokens == 0
    assert hit.blocks is manager.empty_kv_cache_blocks
    blocks = manager.allocate_slots(req0, 14, hit)
    assert blocks is not None
    assert blocks.get_block_ids() == ([1, 2, 3, 4],)
    req0.num_computed_tokens = 14
    # Three full blocks are cached; the partial fourth is not.
    assert [b.block_hash is not None for b in manager.get_blocks("0").blocks[0]] == [
        True,
        True,
        True,
        False,
    ]

    req1 = make_request(manager, "1", [*range(12), 99, 98, 97])
    hit1 = manager.get_computed_blocks(req1)
    assert hit1.num_computed_tokens == 12
    assert hit1.blocks.get_block_ids() == ([1, 2, 3],)
    blocks1 = manager.allocate_slots(req1, 3, hit1)
    assert blocks1 is not None
    assert blocks1.get_block_ids() == ([5],)
    assert manager.get_block_ids("1") == ([1, 2, 3, 5],)
    assert [b.ref_cnt for b in manager.get_blocks("1").blocks[0]] == [2, 2, 2, 1]
    assert manager.block_pool.get_num_free_blocks() == 5


def test_full_hit_is_capped_to_recompute_last_token() -> None:
    manager = make_manager()
    req0 = make_request(manager, "0", range(12))
    admit(manager, req0)
    manager.free(req0)
    req1 = make_request(manager, "1", range(12))
    hit = manager.get_computed_blocks(req1)
    # 11 tokens may hit; hits are whole blocks, so the last block is recomputed.
    assert hit.num_computed_tokens == 8
    assert hit.blocks.get_block_ids() == ([1, 2],)
    assert manager.get_computed_blocks(req1, max_cache_hit_length=12).num_computed_tokens == 12


def test_free_order_and_eviction_lru_tail_first() -> None:
    manager = make_manager()
    req0 = make_request(manager, "0", range(16))
    admit(manager, req0)
    assert manager.get_block_ids("0") == ([1, 2, 3, 4],)
    manager.free(req0)
    # Uncached-never blocks first (none here), then cached blocks tail first.
    assert free_queue(manager) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    req1 = make_request(manager, "1", range(100, 140))
    admit(manager, req1)
    # 10 blocks: the never-used ones first, then the LRU cached tail 4, 3, 2, 1.
    assert manager.get_block_ids("1") == ([5, 6, 7, 8, 9, 10, 4, 3, 2, 1],)
    assert manager.block_pool.get_num_free_blocks() == 0
    req2 = make_request(manager, "2", range(16))
    assert manager.get_computed_blocks(req2).num_computed_tokens == 0


def test_decode_allocates_at_block_boundary_and_caches_full_blocks() -> None:
    manager = make_manager()
    req = make_request(manager, "0", range(6))
    admit(manager, req)
    assert manager.get_block_ids("0") == ([1, 2],)
    decode(manager, req)  # 7 tokens
    blocks = decode(manager, req)  # 8 tokens: block 2 becomes full and cached
    assert blocks is manager.empty_kv_cache_blocks
    assert manager.get_blocks("0").blocks[0][1].block_hash is not None
    blocks = decode(manager, req)  # 9 tokens: a new block
    assert blocks is not None
    assert blocks.get_block_ids() == ([3],)
    assert manager.get_block_ids("0") == ([1, 2, 3],)


def test_preemption_resume_hits_own_blocks_and_counts_preempted_stats() -> None:
    manager = make_manager()
    req = make_request(manager, "0", range(10))
    admit(manager, req)
    for _ in range(4):
        decode(manager, req)
    manager.free(req)
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    req.status = RequestStatus.PREEMPTED
    hit = manager.get_computed_blocks(req)
    assert hit.num_computed_tokens == 12
    assert hit.blocks.get_block_ids() == ([1, 2, 3],)
    manager.record_prefix_cache_stats(req, hit.num_computed_tokens)
    assert manager.allocate_slots(req, req.num_tokens - 12, hit) is not None
    stats = manager.make_prefix_cache_stats()
    assert stats is not None
    assert (stats.requests, stats.preempted_requests, stats.preempted_hits) == (0, 1, 12)


# ---------------------------------------------------------------------- sliding window
def test_sliding_window_hit_pads_with_null_blocks() -> None:
    manager = make_manager([swa(block_size=4, window=8)], num_blocks=20)
    req0 = make_request(manager, "0", range(24))
    admit(manager, req0)
    manager.free(req0)
    req1 = make_request(manager, "1", [*range(24), 50, 51])
    hit = manager.get_computed_blocks(req1)
    # The window before token 24 needs the last two blocks (7 tokens back).
    assert hit.num_computed_tokens == 24
    ids = hit.blocks.get_block_ids()[0]
    assert ids[:4] == [0, 0, 0, 0]
    assert len(ids) == 6
    blocks = manager.allocate_slots(req1, 2, hit)
    assert blocks is not None
    assert manager.get_block_ids("1")[0][:4] == [0, 0, 0, 0]


def test_sliding_window_decode_replaces_blocks_outside_window_by_null() -> None:
    manager = make_manager([swa(block_size=4, window=8)], num_blocks=20)
    req = make_request(manager, "0", range(8))
    admit(manager, req)
    for _ in range(9):
        decode(manager, req)
    ids = manager.get_block_ids("0")[0]
    assert ids[:2] == [0, 0]
    assert all(block_id != 0 for block_id in ids[2:])
    # Only the window's blocks are held.
    held = len([i for i in ids if i != 0])
    assert manager.block_pool.get_num_free_blocks() == 19 - held


def test_remove_skipped_blocks_directly() -> None:
    manager = make_manager([swa(block_size=4, window=8)], num_blocks=20)
    req = make_request(manager, "0", range(20))
    admit(manager, req)
    manager.remove_skipped_blocks("0", 20)
    # 20 - 8 + 1 = 13 tokens skipped: 3 whole blocks.
    assert manager.get_block_ids("0")[0][:3] == [0, 0, 0]
    assert manager.get_block_ids("0")[0][3] != 0


# ------------------------------------------------------------------------------ hybrid
def test_hybrid_full_and_sliding_window_with_different_block_sizes() -> None:
    manager = make_manager([full(block_size=8), swa(block_size=4, window=8)], num_blocks=40)
    assert (manager.scheduler_block_size, manager.hash_block_size) == (8, 4)
    req0 = make_request(manager, "0", range(30))
    admit(manager, req0)
    manager.free(req0)
    req1 = make_request(manager, "1", [*range(30), 77])
    hit = manager.get_computed_blocks(req1)
    # Aligned to the lcm (8): 24 tokens, 3 full-attention blocks, 6 sliding-window slots.
    assert hit.num_computed_tokens == 24
    full_ids, swa_ids = hit.blocks.get_block_ids()
    assert len(full_ids) == 3
    assert len(swa_ids) == 6
    assert swa_ids[:4] == [0, 0, 0, 0]
    assert manager.allocate_slots(req1, 7, hit) is not None


def test_hybrid_hit_shrinks_when_sliding_window_blocks_were_evicted() -> None:
    manager = make_manager([full(block_size=4), swa(block_size=4, window=8)], num_blocks=40)
    req0 = make_request(manager, "0", range(24))
    admit(manager, req0)
    swa_blocks = manager.get_blocks("0").blocks[1]
    manager.free(req0)
    # Evict the sliding-window tail: the window before token 20 is gone.
    manager.evict_blocks([swa_blocks[4].block_id])
    req1 = make_request(manager, "1", [*range(24), 1])
    hit = manager.get_computed_blocks(req1)
    assert hit.num_computed_tokens == 16
    assert len(hit.blocks.blocks[0]) == 4


# ----------------------------------------------------------------- caching off / groups
def test_caching_disabled_never_hits_and_reuses_freed_blocks_lifo() -> None:
    manager = make_manager(enable_caching=False)
    req0 = make_request(manager, "0", range(12))
    admit(manager, req0)
    manager.free(req0)
    assert free_queue(manager)[:3] == [3, 2, 1]
    req1 = make_request(manager, "1", range(12))
    assert manager.get_computed_blocks(req1) == (manager.empty_kv_cache_blocks, 0)
    admit(manager, req1)
    assert manager.get_block_ids("1") == ([3, 2, 1],)


def test_zero_groups() -> None:
    kv_cache_config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[])
    manager = KVCacheManager(
        KVCacheManagerConfig(
            kv_cache_config=kv_cache_config, max_model_len=MAX_MODEL_LEN, enable_caching=False
        )
    )
    req = Request("0", range(5))
    blocks = manager.allocate_slots(req, 5)
    assert blocks is manager.empty_kv_cache_blocks
    assert blocks.get_block_ids() == ()
    assert manager.get_block_ids("0") == ()
    assert manager.get_num_common_prefix_blocks("0") == []
    manager.free(req)
    assert manager.usage == 0.0


def test_prefix_caching_with_zero_groups_is_a_config_error() -> None:
    kv_cache_config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[])
    with pytest.raises(ConfigError):
        KVCacheManager(
            KVCacheManagerConfig(kv_cache_config=kv_cache_config, max_model_len=MAX_MODEL_LEN)
        )


def test_encoder_tokens_allocate_cross_attention_once() -> None:
    cross = CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16)
    manager = make_manager([full(), cross], enable_caching=False, num_blocks=20)
    req = make_request(manager, "0", range(6))
    blocks = manager.allocate_slots(req, 6, options=SlotOptions(num_encoder_tokens=10))
    assert blocks is not None
    assert [len(ids) for ids in blocks.get_block_ids()] == [2, 3]
    req.num_computed_tokens = 6
    req.append_output_token_ids(1)
    req.append_output_token_ids(2)
    again = manager.allocate_slots(req, 2, options=SlotOptions(num_encoder_tokens=10))
    assert again is not None
    assert [len(ids) for ids in again.get_block_ids()] == [0, 0]


def test_cross_attention_with_caching_is_a_config_error() -> None:
    cross = CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DType.FLOAT16)
    with pytest.raises(ConfigError, match="cross attention"):
        make_manager([full(), cross])


def test_mamba_pool_records_new_attention_block_ids_for_zeroing() -> None:
    mamba = MambaSpec(block_size=MAX_MODEL_LEN, shapes=((2,),), dtypes=(DType.FLOAT16,))
    manager = make_manager([full(), mamba], enable_caching=False, num_blocks=20)
    req = make_request(manager, "0", range(6))
    blocks = manager.allocate_slots(req, 6)
    assert blocks is not None
    full_ids, mamba_ids = blocks.get_block_ids()
    assert len(mamba_ids) == 1
    assert manager.take_new_block_ids() == full_ids
    assert manager.take_new_block_ids() == []


def test_a_failed_loads_blocks_are_recorded_for_zeroing_again_from_an_aligned_token() -> None:
    """vLLM's record_blocks_for_zeroing: after a failed asynchronous KV load the request's
    attention blocks from ``start_token`` on are zeroed again (Mamba groups are not
    recorded); a start inside a block, which would wipe its valid tokens, is refused."""
    mamba = MambaSpec(block_size=MAX_MODEL_LEN, shapes=((2,),), dtypes=(DType.FLOAT16,))
    manager = make_manager([full(), mamba], enable_caching=False, num_blocks=20)
    req = make_request(manager, "0", range(10))
    blocks = manager.allocate_slots(req, 10)
    assert blocks is not None
    full_ids, _ = blocks.get_block_ids()
    assert manager.take_new_block_ids() == full_ids
    manager.record_blocks_for_zeroing("0", 4)
    assert manager.take_new_block_ids() == full_ids[1:]
    manager.record_blocks_for_zeroing("unknown", 0)  # nothing held: nothing recorded
    assert manager.take_new_block_ids() == []
    for bad in (5, -4):
        with pytest.raises(InvalidArgumentError, match="start_token"):
            manager.record_blocks_for_zeroing("0", bad)
    assert manager.take_new_block_ids() == []


# ---------------------------------------------------------------------- admission knobs
def test_watermark_applies_to_waiting_requests_only_when_others_are_scheduled() -> None:
    manager = make_manager(num_blocks=11, watermark=0.2)  # 2 blocks of headroom
    assert manager.watermark_blocks == 2
    req = make_request(manager, "0", range(36))  # 9 blocks of 10 free
    assert manager.allocate_slots(req, 36, options=SlotOptions(has_scheduled_reqs=True)) is None
    assert manager.allocate_slots(req, 36, options=SlotOptions(has_scheduled_reqs=False))
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = 36
    # A running request is never held back by the watermark: it takes the last block.
    req.append_output_token_ids([1] * 3)
    assert manager.allocate_slots(req, 3) is not None
    assert manager.block_pool.get_num_free_blocks() == 0


def test_reserved_blocks_are_left_free() -> None:
    manager = make_manager(num_blocks=11)
    req = make_request(manager, "0", range(32))  # 8 of 10 free blocks
    assert manager.allocate_slots(req, 32, options=SlotOptions(reserved_blocks=3)) is None
    assert manager.block_pool.get_num_free_blocks() == 10
    assert manager.allocate_slots(req, 32, options=SlotOptions(reserved_blocks=2)) is not None


def test_full_sequence_must_fit_gates_chunked_prefill() -> None:
    manager = make_manager(num_blocks=11)
    req = make_request(manager, "0", range(48))  # 12 blocks > 10
    gate = SlotOptions(full_sequence_must_fit=True)
    assert manager.allocate_slots(req, 8, options=gate) is None
    # Without the gate the first chunk fits.
    assert manager.allocate_slots(req, 8) is not None


def test_lookahead_tokens_get_slots_but_are_not_cached() -> None:
    manager = make_manager(num_blocks=11)
    req = make_request(manager, "0", range(8))
    blocks = manager.allocate_slots(req, 8, options=SlotOptions(num_lookahead_tokens=3))
    assert blocks is not None
    assert blocks.get_block_ids() == ([1, 2, 3],)
    assert [b.block_hash is not None for b in manager.get_blocks("0").blocks[0]] == [
        True,
        True,
        False,
    ]


def test_external_tokens_and_delayed_caching() -> None:
    manager = make_manager(num_blocks=11)
    req = make_request(manager, "0", range(13))
    options = SlotOptions(num_external_computed_tokens=8, delay_cache_blocks=True)
    blocks = manager.allocate_slots(req, 5, options=options)
    assert blocks is not None
    # Blocks for the external tokens are allocated first (not returned as new), then the rest.
    assert manager.get_block_ids("0") == ([1, 2, 3, 4],)
    assert blocks.get_block_ids() == ([3, 4],)
    assert all(b.block_hash is None for b in manager.get_blocks("0").blocks[0])
    req.num_computed_tokens = 13
    manager.cache_blocks(req, 13)
    assert [b.block_hash is not None for b in manager.get_blocks("0").blocks[0]] == [
        True,
        True,
        True,
        False,
    ]


def test_adopting_external_tokens_only_is_allowed() -> None:
    manager = make_manager()
    req = make_request(manager, "0", range(13))
    options = SlotOptions(num_external_computed_tokens=8)
    assert manager.allocate_slots(req, 0, options=options) is not None
    assert manager.get_block_ids("0") == ([1, 2],)


# ------------------------------------------------------------------- isolation / reset
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"lora_name": "a"}, {"lora_name": "b"}),
        ({"cache_salt": "x"}, {"cache_salt": "y"}),
        ({}, {"cache_salt": "y"}),
    ],
)
def test_lora_and_salt_isolate_the_cache(first: dict[str, str], second: dict[str, str]) -> None:
    manager = make_manager()
    req0 = make_request(manager, "0", range(13), **first)
    admit(manager, req0)
    manager.free(req0)
    other = make_request(manager, "1", range(13), **second)
    assert manager.get_computed_blocks(other).num_computed_tokens == 0
    same = make_request(manager, "2", range(13), **first)
    assert manager.get_computed_blocks(same).num_computed_tokens == 12


def test_reset_prefix_cache_refused_while_in_use() -> None:
    manager = make_manager()
    req = make_request(manager, "0", range(13))
    admit(manager, req)
    assert manager.reset_prefix_cache() is False
    stats = manager.make_prefix_cache_stats()
    assert stats is not None
    assert stats.reset is False
    manager.free(req)
    assert manager.reset_prefix_cache() is True
    stats = manager.make_prefix_cache_stats()
    assert stats is not None
    assert stats.reset is True
    again = make_request(manager, "1", range(13))
    assert manager.get_computed_blocks(again).num_computed_tokens == 0


def test_evict_blocks_drops_hits() -> None:
    manager = make_manager()
    req = make_request(manager, "0", range(13))
    admit(manager, req)
    manager.free(req)
    manager.evict_blocks({2})
    again = make_request(manager, "1", range(13))
    hit = manager.get_computed_blocks(again)
    assert hit.num_computed_tokens == 4
    assert hit.blocks.get_block_ids() == ([1],)


def test_skip_reading_prefix_cache() -> None:
    manager = make_manager()
    admit(manager, make_request(manager, "0", range(13)))
    req = Request(
        "1",
        range(13),
        block_hasher=BlockHasher(manager.hash_block_size),
        skip_reading_prefix_cache=True,
    )
    assert manager.get_computed_blocks(req) == (manager.empty_kv_cache_blocks, 0)


# ----------------------------------------------------------------------- common prefix
def test_common_prefix_blocks_count_blocks_held_by_every_request() -> None:
    manager = make_manager(num_blocks=20)
    admit(manager, make_request(manager, "0", [*range(8), 1, 2, 3]))
    admit(manager, make_request(manager, "1", [*range(8), 4, 5, 6]))
    assert manager.get_num_common_prefix_blocks("0") == [2]
    admit(manager, make_request(manager, "2", range(100, 105)))
    assert manager.get_num_common_prefix_blocks("0") == [0]


def test_common_prefix_blocks_are_zero_for_sliding_window_groups() -> None:
    manager = make_manager([full(), swa()], num_blocks=30)
    admit(manager, make_request(manager, "0", [*range(8), 1]))
    assert manager.get_num_common_prefix_blocks("0") == [3, 0]


# ------------------------------------------------------------------------------ stats
def test_stats_and_recent_hit_rate() -> None:
    manager = make_manager()
    req0 = make_request(manager, "0", range(13))
    hit = admit(manager, req0)
    manager.record_prefix_cache_stats(req0, hit.num_computed_tokens)
    req1 = make_request(manager, "1", range(13))
    hit = admit(manager, req1)
    manager.record_prefix_cache_stats(req1, hit.num_computed_tokens)
    stats = manager.make_prefix_cache_stats()
    assert stats is not None
    assert (stats.requests, stats.queries, stats.hits) == (2, 26, 12)
    assert manager.prefix_cache_hit_rate == pytest.approx(12 / 26)
    assert manager.usage == pytest.approx(5 / 10)


# -------------------------------------------------------------------------- bad input
def test_bad_input_raises_before_any_change() -> None:
    manager = make_manager(num_blocks=20)
    req = make_request(manager, "0", range(10))
    admit(manager, req)
    before = snapshot(manager, "0")
    # vLLM 0.33 answers empty tables for a request holding no blocks.
    assert manager.get_block_ids("nope") == ([],)
    with pytest.raises(NotFoundError):
        manager.remove_skipped_blocks("nope", 4)
    with pytest.raises(NotFoundError):
        manager.get_num_common_prefix_blocks("nope")
    with pytest.raises(InvalidArgumentError, match="num_new_tokens"):
        manager.allocate_slots(req, -1)
    with pytest.raises(InvalidArgumentError, match="num_new_tokens"):
        manager.allocate_slots(req, 0)
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        manager.allocate_slots(req, MAX_MODEL_LEN)
    with pytest.raises(InvalidArgumentError, match="reserved_blocks"):
        manager.allocate_slots(req, 1, options=SlotOptions(reserved_blocks=-1))
    with pytest.raises(InvalidArgumentError, match="block_ids"):
        manager.evict_blocks([1, 999])
    with pytest.raises(InvalidArgumentError, match="total_computed_tokens"):
        manager.remove_skipped_blocks("0", -1)
    other = make_request(manager, "1", range(10))
    stolen = manager.get_computed_blocks(other)
    with pytest.raises(InvalidArgumentError, match="cannot adopt"):
        manager.allocate_slots(req, 1, stolen)
    bad_hashes = Request("2", range(10))
    bad_hashes.block_hashes.extend(req.block_hashes * 2)
    with pytest.raises(InvalidArgumentError, match="block_hashes"):
        manager.get_computed_blocks(bad_hashes)
    with pytest.raises(InvalidArgumentError, match=r"hit\.blocks"):
        manager.allocate_slots(other, 2, CacheHit(KVCacheBlocks(((), ())), 8))
    assert snapshot(manager, "0") == before
    assert not manager.holds_blocks("1")


def test_stale_or_foreign_hits_are_rejected_before_any_change() -> None:
    manager = make_manager(num_blocks=20)
    first = make_request(manager, "0", range(10))
    admit(manager, first)
    manager.free(first)
    late = make_request(manager, "1", range(10))
    stale = manager.get_computed_blocks(late)
    assert stale.num_computed_tokens == 8
    admit(manager, make_request(manager, "2", range(10)))
    resumed = make_request(manager, "3", range(10))
    fresh = manager.get_computed_blocks(resumed)
    resumed.num_computed_tokens = 4
    other = make_manager(num_blocks=20)
    admit(other, make_request(other, "x", range(10)))
    foreign = other.get_computed_blocks(make_request(other, "y", range(10)))
    manager.evict_blocks(stale.blocks.get_block_ids()[0])
    before = snapshot(manager, "2")
    with pytest.raises(FailedPreconditionError, match="left the prefix cache"):
        manager.allocate_slots(late, 2, stale)
    with pytest.raises(InvalidArgumentError, match="not this pool's"):
        manager.allocate_slots(late, 2, foreign)
    with pytest.raises(InvalidArgumentError, match="from token 0"):
        manager.allocate_slots(resumed, 2, fresh)
    assert snapshot(manager, "2") == before
    assert not manager.holds_blocks("1")
    assert not manager.holds_blocks("3")


def test_cache_blocks_beyond_the_held_blocks_is_rejected() -> None:
    manager = make_manager([full(), swa()], num_blocks=40)
    req = make_request(manager, "0", range(20))
    assert manager.allocate_slots(req, 8, manager.get_computed_blocks(req)) is not None
    before = (free_queue(manager), manager.block_pool.cached_block_ids())
    with pytest.raises(InvalidArgumentError, match="holds only 2 blocks"):
        manager.cache_blocks(req, 16)
    assert (free_queue(manager), manager.block_pool.cached_block_ids()) == before
    manager.cache_blocks(req, 8)


def test_block_ids_take_vllms_arguments() -> None:
    manager = make_manager([full(), swa()], num_blocks=20)
    assert manager.empty_kv_cache_blocks.get_block_ids(allow_none=True) is None
    assert manager.empty_kv_cache_blocks.get_block_ids() == ([], [])
    req = make_request(manager, "0", range(6))
    blocks = manager.allocate_slots(req, 6)
    assert blocks is not None
    assert blocks.get_block_ids(True) == ([1, 2], [3, 4])
    assert blocks.get_block_ids(group_ids=[1]) == ([3, 4],)


def test_sliding_window_extra_retained_tokens_delay_frees() -> None:
    spec = SlidingWindowSpec(
        block_size=4,
        num_kv_heads=1,
        head_size=8,
        dtype=DType.FLOAT16,
        sliding_window=4,
        extra_retained_tokens=4,
    )
    manager = make_manager([spec], num_blocks=20)
    req = make_request(manager, "0", range(16))
    admit(manager, req)
    # 16 computed: the window needs tokens 13..15, the extra tail 9..12: block 2 stays.
    manager.remove_skipped_blocks("0", 16)
    assert manager.get_block_ids("0") == ([0, 0, 3, 4],)


def test_event_blocks_are_annotated_with_the_group_kind() -> None:
    manager = make_manager([full(), swa()], num_blocks=20, events=True)
    admit(manager, make_request(manager, "0", range(9)))
    stored = [e for e in manager.take_events() if type(e).__name__ == "BlockStored"]
    assert [
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored
    ] == [
        (0, "full_attention", None),
        (1, "sliding_window", 8),
    ]


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="watermark"):
        make_manager(watermark=-0.1)
    with pytest.raises(ConfigError, match="max_model_len"):
        KVCacheManager(
            KVCacheManagerConfig(
                kv_cache_config=KVCacheConfig(
                    num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[]
                ),
                max_model_len=0,
            )
        )


def test_free_of_unknown_request_is_ignored() -> None:
    manager = make_manager()
    manager.free(Request("ghost", [1]))
    assert manager.block_pool.get_num_free_blocks() == 10
