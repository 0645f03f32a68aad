"""BlockPool: allocation, free order, cache hits, eviction, partial entries, events, counters."""

from __future__ import annotations

import pytest

from kvcm.common.errors import FailedPreconditionError, InvalidArgumentError
from kvcm.common.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.common.hashing import (
    BlockHash,
    BlockHasher,
    make_block_hash_with_group_id,
)
from kvcm.core.block import KVCacheBlock
from kvcm.core.block_pool import BlockPool
from kvcm.core.request import Request

BLOCK = 4


def make_pool(
    num_blocks: int = 10, *, caching: bool = True, events: bool = False, hash_block_size: int = 4
) -> BlockPool:
    return BlockPool(
        num_gpu_blocks=num_blocks,
        enable_caching=caching,
        hash_block_size=hash_block_size,
        enable_kv_cache_events=events,
    )


def make_request(
    num_tokens: int, request_id: str = "r", first_token: int = 0, **kwargs: object
) -> Request:
    return Request(
        request_id,
        list(range(first_token, first_token + num_tokens)),
        block_hasher=BlockHasher(block_size=BLOCK, seed="test"),
        **kwargs,  # type: ignore[arg-type]
    )


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def allocate_and_cache(pool: BlockPool, request: Request, group_id: int = 0) -> list[KVCacheBlock]:
    num_full = len(request.block_hashes)
    blocks = pool.get_new_blocks(num_full)
    pool.cache_full_blocks(request, blocks, 0, num_full, BLOCK, group_id)
    return blocks


# --------------------------------------------------------------------------- construction
def test_null_block_is_block_zero_and_not_free() -> None:
    pool = make_pool(5)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0
    assert make_pool(1).get_usage() == 0.0


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("num_gpu_blocks", {"num_gpu_blocks": 0}),
        ("hash_block_size", {"hash_block_size": 0}),
        ("num_hash_lookahead_tokens", {"num_hash_lookahead_tokens": -1}),
    ],
)
def test_constructor_validates(field: str, kwargs: dict[str, int]) -> None:
    args: dict[str, object] = {"num_gpu_blocks": 4, "enable_caching": True, "hash_block_size": 4}
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=field):
        BlockPool(**args)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- allocation, free
def test_get_new_blocks_pops_front_with_ref_one() -> None:
    pool = make_pool(6)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]
    assert all(block.ref_cnt == 1 for block in blocks)
    assert pool.get_usage() == pytest.approx(3 / 5)
    with pytest.raises(FailedPreconditionError, match="cannot get 3"):
        pool.get_new_blocks(3)
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        pool.get_new_blocks(-1)
    assert pool.get_num_free_blocks() == 2


def test_free_uncached_front_lifo_cached_back_fifo() -> None:
    pool = make_pool(8)
    request = make_request(8)
    cached = allocate_and_cache(pool, request)  # blocks 1, 2 cached
    plain = pool.get_new_blocks(3)  # blocks 3, 4, 5
    pool.free_blocks(cached[::-1])
    assert free_ids(pool) == [6, 7, 2, 1]
    pool.free_blocks(plain[::-1])
    assert free_ids(pool) == [5, 4, 3, 6, 7, 2, 1]
    assert pool.get_num_free_blocks() == 7


def test_free_without_caching_always_goes_front() -> None:
    pool = make_pool(6, caching=False)
    blocks = pool.get_new_blocks(3)
    blocks[0].block_hash = make_block_hash_with_group_id(BlockHash(b"x" * 32), 0)
    pool.free_blocks(blocks[::-1])
    assert free_ids(pool) == [3, 2, 1, 4, 5]


def test_shared_block_freed_only_at_last_reference() -> None:
    pool = make_pool(5)
    request = make_request(4)
    (block,) = allocate_and_cache(pool, request)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert 1 not in free_ids(pool)
    pool.free_blocks([pool.null_block, block])
    assert free_ids(pool)[-1] == 1


def test_double_free_is_rejected_without_change() -> None:
    pool = make_pool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c])
    before = (free_ids(pool), a.ref_cnt, b.ref_cnt, c.ref_cnt)
    with pytest.raises(FailedPreconditionError, match=f"block {c.block_id}"):
        pool.free_blocks([a, b, c])
    assert (free_ids(pool), a.ref_cnt, b.ref_cnt, c.ref_cnt) == before
    pool_nc = make_pool(4, caching=False)
    (d,) = pool_nc.get_new_blocks(1)
    pool_nc.free_blocks([d])
    with pytest.raises(FailedPreconditionError):
        pool_nc.free_blocks([d])
    assert d.ref_cnt == 0


# ---------------------------------------------------------------------------- caching
def test_cache_hit_and_touch_revives_free_block() -> None:
    pool = make_pool(8)
    request = make_request(12)
    blocks = allocate_and_cache(pool, request)
    hashes = request.block_hashes
    assert pool.num_cached_blocks == 3
    assert pool.get_cached_block(hashes[1], [0]) == [blocks[1]]
    assert pool.get_cached_block(hashes[1], [1]) is None
    assert pool.get_cached_block(hashes[1], [0, 1]) is None
    assert blocks[2].block_hash == make_block_hash_with_group_id(hashes[2], 0)
    assert blocks[2].block_hash_num_tokens == 12
    pool.free_blocks(blocks[::-1])
    assert pool.get_num_free_blocks() == 7
    pool.touch([pool.null_block, blocks[0], blocks[1]])
    assert (blocks[0].ref_cnt, blocks[1].ref_cnt, pool.null_block.ref_cnt) == (1, 1, 0)
    assert pool.get_num_free_blocks() == 5
    assert blocks[0].block_id not in free_ids(pool)


def test_no_dedup_first_inserted_answers() -> None:
    pool = make_pool(8)
    first = allocate_and_cache(pool, make_request(4, "a"))
    second = allocate_and_cache(pool, make_request(4, "b"))
    key = first[0].block_hash
    assert key is not None
    assert second[0].block_hash == key
    assert pool.cached_block_ids() == {key: [first[0].block_id, second[0].block_id]}
    assert pool.get_cached_block(make_request(4).block_hashes[0], [0]) == [first[0]]
    pool.evict_blocks([first[0].block_id])
    assert pool.get_cached_block(make_request(4).block_hashes[0], [0]) == [second[0]]
    assert pool.cached_block_ids() == {key: [second[0].block_id]}
    third = allocate_and_cache(pool, make_request(4, "c"))
    assert pool.cached_block_ids() == {key: [second[0].block_id, third[0].block_id]}


def test_multi_group_lookup_needs_every_group() -> None:
    pool = make_pool(8)
    request = make_request(4)
    g0 = allocate_and_cache(pool, request, 0)
    g2 = allocate_and_cache(pool, request, 2)
    big = allocate_and_cache(pool, request, 1000)
    assert pool.get_cached_block(request.block_hashes[0], [0, 2]) == [g0[0], g2[0]]
    assert pool.get_cached_block(request.block_hashes[0], [1000]) == [big[0]]


def test_reuse_of_cached_free_block_evicts_it() -> None:
    pool = make_pool(3, events=True)
    request = make_request(8)
    blocks = allocate_and_cache(pool, request)
    pool.free_blocks(blocks[::-1])
    pool.take_events()
    assert free_ids(pool) == [2, 1]
    taken = pool.get_new_blocks(1)
    assert ids(taken) == [2]
    assert taken[0].block_hash is None
    assert pool.get_cached_block(request.block_hashes[1], [0]) is None
    assert pool.num_evicted_blocks == 1
    assert pool.num_cached_blocks == 1
    assert pool.take_events() == [
        BlockRemoved(
            block_hashes=[request.block_hashes[1]],
            medium=MEDIUM_GPU,
            group_idx=0,
        )
    ]


def test_cache_full_blocks_skips_null_and_masked_and_is_incremental() -> None:
    pool = make_pool(10, events=True)
    request = make_request(16, lora_name="ad", lora_id=3, session_id="s")
    blocks = [pool.null_block, *pool.get_new_blocks(3)]
    pool.cache_full_blocks(request, blocks, 0, 2, BLOCK, 1, [True, True])
    pool.cache_full_blocks(request, blocks, 2, 4, BLOCK, 1, [False, True])
    assert blocks[1].block_hash is not None
    assert blocks[2].block_hash is None
    assert blocks[3].block_hash is not None
    assert pool.null_block.block_hash is None
    first, second = pool.take_events()
    hashes = list(request.block_hashes)
    assert first == BlockStored(
        block_hashes=[hashes[1]],
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=BLOCK,
        lora_id=3,
        medium=MEDIUM_GPU,
        lora_name="ad",
        extra_keys=[("ad",)],
        group_idx=1,
        session_id="s",
    )
    assert second.block_hashes == [hashes[3]]  # type: ignore[union-attr]
    assert second.parent_block_hash == hashes[1]  # type: ignore[union-attr]
    assert second.token_ids == list(range(8, 16))  # type: ignore[union-attr]
    pool.cache_full_blocks(request, blocks, 4, 4, BLOCK, 1)
    assert pool.take_events() == []


def test_cache_full_blocks_at_larger_block_size() -> None:
    pool = make_pool(10, events=True)
    request = make_request(17)  # 4 hashes of 4 tokens
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 1, 8, 0)
    pool.cache_full_blocks(request, blocks, 1, 2, 8, 0)
    hashes = request.block_hashes
    assert blocks[0].block_hash == make_block_hash_with_group_id(hashes[1], 0)
    assert blocks[1].block_hash == make_block_hash_with_group_id(hashes[3], 0)
    second = pool.take_events()[1]
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == hashes[1]
    assert (second.block_size, second.token_ids) == (8, list(range(8, 16)))


def test_cache_full_blocks_validates_before_change() -> None:
    pool = make_pool(10)
    request = make_request(8)
    blocks = pool.get_new_blocks(3)
    with pytest.raises(InvalidArgumentError, match="block hashes"):
        pool.cache_full_blocks(request, blocks, 0, 3, BLOCK, 0)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        pool.cache_full_blocks(request, blocks, 0, 1, 6, 0)
    with pytest.raises(InvalidArgumentError, match="block_mask"):
        pool.cache_full_blocks(request, blocks, 0, 2, BLOCK, 0, [True])
    with pytest.raises(InvalidArgumentError, match="table"):
        pool.cache_full_blocks(request, blocks[:1], 0, 2, BLOCK, 0)
    assert pool.num_cached_blocks == 0
    assert all(block.block_hash is None for block in blocks)


# --------------------------------------------------------------------- partial entries
def test_partial_entry_then_promotion_to_full() -> None:
    pool = make_pool(10, events=True, hash_block_size=4)
    request = make_request(13)  # 3 hashes; a group of 8-token blocks
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 1, 8, 0)
    key = pool.cache_partial_block(request, blocks[1], 12, 0, 8)
    hashes = request.block_hashes
    assert key == make_block_hash_with_group_id(hashes[2], 0)
    assert (blocks[1].block_hash, blocks[1].block_hash_num_tokens) == (key, 12)
    assert pool.get_cached_block(hashes[2], [0]) == [blocks[1]]
    assert pool.cache_partial_block(request, blocks[1], 12, 0, 8) == key  # no new event
    assert pool.cache_partial_block(request, pool.null_block, 12, 0, 8) is None
    stored_full, stored_partial = pool.take_events()
    assert stored_partial == BlockStored(
        block_hashes=[hashes[2]],
        parent_block_hash=hashes[1],
        token_ids=[8, 9, 10, 11],
        block_size=4,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
        extra_keys=[None],
        group_idx=0,
    )
    del stored_full
    request.append_output_token_ids([13, 14, 15, 16])
    pool.cache_full_blocks(request, blocks, 1, 2, 8, 0)
    full_key = make_block_hash_with_group_id(hashes[3], 0)
    assert (blocks[1].block_hash, blocks[1].block_hash_num_tokens) == (full_key, 16)
    assert pool.get_cached_block(hashes[2], [0]) is None
    removed, stored = pool.take_events()
    assert removed == BlockRemoved(block_hashes=[hashes[2]], medium=MEDIUM_GPU, group_idx=0)
    assert isinstance(stored, BlockStored)
    assert pool.num_evicted_blocks == 0
    assert pool.num_cached_blocks == 2


def test_secondary_entry_removed_with_block() -> None:
    pool = make_pool(4, events=True)
    request = make_request(9)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1, 8, 0)
    partial = pool.cache_partial_block(request, blocks[0], 4, 0, 8)
    assert blocks[0].block_hash == make_block_hash_with_group_id(request.block_hashes[1], 0)
    assert pool.get_cached_block(request.block_hashes[0], [0]) == blocks
    assert partial is not None
    pool.take_events()
    pool.evict_blocks([blocks[0].block_id])
    assert pool.cached_block_ids() == {}
    assert [e.block_hashes for e in pool.take_events()] == [  # type: ignore[union-attr]
        [request.block_hashes[1]],
        [request.block_hashes[0]],
    ]
    assert pool.num_evicted_blocks == 1
    assert pool.num_cached_blocks == 0


def test_partial_replace_existing_and_validation() -> None:
    pool = make_pool(4)
    request = make_request(9)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [block], 0, 1, 8, 0)
    pool.cache_partial_block(request, block, 4, 0, 8, replace_existing_hashes=True)
    assert block.block_hash_num_tokens == 4
    assert len(pool.cached_block_ids()) == 1
    for bad in (0, 6, 12):
        with pytest.raises(InvalidArgumentError, match="num_tokens"):
            pool.cache_partial_block(request, block, bad, 0, 8)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        pool.cache_partial_block(request, block, 4, 0, 6)


# --------------------------------------------------------------------- eviction, reset
def test_evict_blocks_by_id_keeps_allocation_and_queue_position() -> None:
    pool = make_pool(6, events=True)
    request = make_request(8)
    blocks = allocate_and_cache(pool, request)
    pool.free_blocks([blocks[1]])
    order = free_ids(pool)
    pool.evict_blocks({blocks[0].block_id, blocks[1].block_id, 5})
    assert free_ids(pool) == order
    assert blocks[0].ref_cnt == 1
    assert pool.num_evicted_blocks == 2
    assert pool.cached_block_ids() == {}
    assert len(pool.take_events()) == 3  # one stored, two removed
    with pytest.raises(InvalidArgumentError, match="block_ids"):
        pool.evict_blocks([1, 6])
    with pytest.raises(InvalidArgumentError, match="block_ids"):
        pool.evict_blocks([-1])


def test_reset_prefix_cache_needs_every_block_free() -> None:
    pool = make_pool(5, events=True)
    request = make_request(8)
    blocks = allocate_and_cache(pool, request)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks[::-1])
    order = free_ids(pool)
    assert pool.reset_prefix_cache() is True
    assert free_ids(pool) == order
    assert pool.cached_block_ids() == {}
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.num_cached_blocks == 0
    assert pool.take_events()[-1] == AllBlocksCleared()
    assert pool.num_evicted_blocks == 0


def test_events_off_records_nothing_and_counters() -> None:
    pool = make_pool(5)
    allocate_and_cache(pool, make_request(8))
    assert pool.take_events() == []
    assert pool.num_events_emitted == 0
    on = make_pool(5, events=True)
    allocate_and_cache(on, make_request(8))
    assert on.num_events_emitted == 1
    assert len(on.take_events()) == 1
    assert on.take_events() == []
    assert on.num_events_emitted == 1


def test_event_extra_keys_carry_salt_on_first_block_only() -> None:
    pool = make_pool(6, events=True)
    request = make_request(8, cache_salt="salt")
    allocate_and_cache(pool, request)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.extra_keys == [("salt",), None]
