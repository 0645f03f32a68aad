"""KVCacheBlock and the intrusive free queue: order, O(1) removal, batch ops, sentinels."""

from __future__ import annotations

import itertools

import pytest

from kvcm.common.errors import FailedPreconditionError
from kvcm.common.hashing import BlockHashWithGroupId
from kvcm.core.block import FreeKVCacheBlockQueue, KVCacheBlock


def make(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def hash_state(block: KVCacheBlock) -> tuple[object, object]:
    return block.block_hash, block.block_hash_num_tokens


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_block_defaults_slots_and_repr() -> None:
    block = KVCacheBlock(7)
    assert (block.block_id, block.ref_cnt, block.block_hash, block.is_null) == (7, 0, None, False)
    with pytest.raises(AttributeError):
        block.unknown = 1  # type: ignore[attr-defined]
    block.block_hash = BlockHashWithGroupId(b"k")
    block.block_hash_num_tokens = 16
    block.reset_hash()
    assert hash_state(block) == (None, None)
    _, queue = make(3)
    text = repr(queue.get_all_free_blocks()[1])
    assert "prev_free_block=0" in text
    assert "next_free_block=2" in text


def test_initial_order_and_popleft() -> None:
    blocks, queue = make(4)
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3]
    assert len(queue) == queue.num_free_blocks == 4
    first = queue.popleft()
    assert first is blocks[0]
    assert first.prev_free_block is None
    assert first.next_free_block is None
    assert ids(queue.get_all_free_blocks()) == [1, 2, 3]


def test_popleft_n_takes_front_in_order_and_unlinks() -> None:
    blocks, queue = make(6)
    taken = queue.popleft_n(4)
    assert ids(taken) == [0, 1, 2, 3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in taken)
    assert ids(queue.get_all_free_blocks()) == [4, 5]
    assert queue.popleft_n(0) == []
    assert ids(queue.popleft_n(2)) == [4, 5]
    assert queue.num_free_blocks == 0
    assert queue.get_all_free_blocks() == []
    queue.append(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [2]


def test_popleft_errors_leave_queue_intact() -> None:
    _, queue = make(2)
    with pytest.raises(FailedPreconditionError):
        queue.popleft_n(3)
    with pytest.raises(FailedPreconditionError):
        queue.popleft_n(-1)
    assert queue.num_free_blocks == 2
    queue.popleft_n(2)
    with pytest.raises(FailedPreconditionError, match="empty"):
        queue.popleft()


def test_remove_from_middle_and_ends() -> None:
    blocks, queue = make(5)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    assert queue.num_free_blocks == 2
    with pytest.raises(FailedPreconditionError, match="block 2"):
        queue.remove(blocks[2])
    assert queue.num_free_blocks == 2


def test_append_prepend_batches_keep_order() -> None:
    blocks, queue = make(8)
    taken = queue.popleft_n(6)
    queue.append_n(taken[:2])
    queue.prepend_n([taken[4], taken[3]])
    queue.append(taken[5])
    queue.prepend_n([])
    queue.append_n([])
    assert ids(queue.get_all_free_blocks()) == [4, 3, 6, 7, 0, 1, 5]
    assert queue.num_free_blocks == 7
    # Links agree in both directions.
    walk = queue.get_all_free_blocks()
    for left, right in itertools.pairwise(walk):
        assert left.next_free_block is right
        assert right.prev_free_block is left
    del blocks


def test_empty_queue_accepts_blocks() -> None:
    queue = FreeKVCacheBlockQueue([])
    block = KVCacheBlock(0)
    queue.prepend_n([block])
    assert ids(queue.get_all_free_blocks()) == [0]
    assert queue.popleft() is block
