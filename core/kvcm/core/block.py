"""Block records and the free queue they thread through.

A pool owns one :class:`KVCacheBlock` per block id for its whole life. The free queue links the
free ones into an intrusive doubly linked list: the links live on the blocks themselves, so
queue operations move pointers and allocate nothing (only ``popleft_n`` builds its result).

Eviction order of the queue, front first: blocks never cached (reused first, most recently
freed at the very front), then cached blocks from least to most recently freed. Within one
request's release the tail of its chain goes first, because the caller frees in reverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcm.common.errors import FailedPreconditionError

if TYPE_CHECKING:
    from kvcm.common.hashing import BlockHashWithGroupId

__all__ = ["FreeKVCacheBlockQueue", "KVCacheBlock"]


class KVCacheBlock:
    """Bookkeeping of one KV-cache block.

    Attributes:
        block_id: Index of the block in the pool, ``0 .. num_blocks - 1`` (``-1`` for the
            queue's sentinels).
        ref_cnt: Number of block tables holding the block.
        block_hash: Primary prefix-cache key (hash + group id) while the block is cached.
        block_hash_num_tokens: Prefix length, in tokens, that ``block_hash`` covers (a whole
            block, or less for a partial entry).
        prev_free_block: Previous block in the free queue (owned by the queue).
        next_free_block: Next block in the free queue (owned by the queue).
        is_null: Whether this is the pool's null block, the placeholder for skipped blocks.
    """

    # NOTE: invariants the pool keeps.
    # * A non-null block with ref_cnt == 0 is in the free queue; its links are both set.
    #   A block outside the queue has both links None.
    # * The null block is never in the queue, never cached, and its ref_cnt stays 0 (it is
    #   shared by any number of tables; nobody counts them).
    # * block_hash is None exactly when the prefix cache maps no key to this block.
    __slots__ = (
        "block_hash",
        "block_hash_num_tokens",
        "block_id",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int, ref_cnt: int = 0) -> None:
        """Create a free, uncached block.

        Args:
            block_id: Index of the block in its pool.
            ref_cnt: Initial reference count.
        """
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.block_hash: BlockHashWithGroupId | None = None
        self.block_hash_num_tokens: int | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def reset_hash(self) -> None:
        """Forget the block's primary cache key (the pool removes the map entries)."""
        self.block_hash = None
        self.block_hash_num_tokens = None

    def __repr__(self) -> str:
        # Neighbours by id only: following the links would recurse through the whole queue.
        prev_block = self.prev_free_block
        next_block = self.next_free_block
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self.block_hash!r}, "
            f"block_hash_num_tokens={self.block_hash_num_tokens}, "
            f"prev_free_block={None if prev_block is None else prev_block.block_id}, "
            f"next_free_block={None if next_block is None else next_block.block_id}, "
            f"is_null={self.is_null})"
        )


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: an intrusive doubly linked list between two sentinels.

    Unlike ``collections.deque`` it removes a block from the middle in O(1) (a cache hit
    revives a free cached block), and unlike a list of nodes it allocates nothing: it rewires
    the ``prev_free_block`` / ``next_free_block`` fields of the blocks themselves.

    Attributes:
        num_free_blocks: Number of blocks in the queue.
    """

    # NOTE: the sentinels are never handed out and never leave the list, so every real block
    # in the queue has both neighbours and no operation branches on "first" or "last".
    # head.next_free_block is the next block to evict; tail.prev_free_block the last.
    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Queue ``blocks`` in the given order (a new pool passes them by block id).

        Args:
            blocks: Blocks to queue; their links are overwritten.
        """
        head = KVCacheBlock(-1)
        tail = KVCacheBlock(-1)
        prev = head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = tail
        tail.prev_free_block = prev
        self._head = head
        self._tail = tail
        self.num_free_blocks = len(blocks)

    def __len__(self) -> int:
        """Number of blocks in the queue."""
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Take the block at the front.

        Returns:
            The next block to evict, unlinked.

        Raises:
            FailedPreconditionError: The queue is empty.
        """
        head = self._head
        block = head.next_free_block
        if block is self._tail or block is None:
            raise FailedPreconditionError("the free block queue is empty")
        following = block.next_free_block
        assert following is not None
        head.next_free_block = following
        following.prev_free_block = head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the ``n`` blocks at the front, in queue order.

        Args:
            n: How many blocks to take.

        Returns:
            The blocks, unlinked.

        Raises:
            FailedPreconditionError: Fewer than ``n`` blocks are queued (nothing is taken).
        """
        if n > self.num_free_blocks or n < 0:
            raise FailedPreconditionError(
                f"cannot pop {n} blocks from a free queue of {self.num_free_blocks}"
            )
        head = self._head
        # Never None: the walk stops at the tail sentinel at the latest.
        block: KVCacheBlock = head.next_free_block  # type: ignore[assignment]
        taken: list[KVCacheBlock] = []
        append = taken.append
        for _ in range(n):
            append(block)
            following = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = following  # type: ignore[assignment]
        # `block` is the new front: a real block or the tail sentinel.
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue.

        Args:
            block: A block in the queue.

        Raises:
            FailedPreconditionError: The block is not in the queue.
        """
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        if prev_block is None or next_block is None:
            raise FailedPreconditionError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Queue a block at the back (evicted last).

        Args:
            block: A block outside the queue.
        """
        tail = self._tail
        last = tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Queue blocks at the back, keeping their order (``blocks[0]`` is evicted first).

        Args:
            blocks: Blocks outside the queue.
        """
        if not blocks:
            return
        tail = self._tail
        prev = tail.prev_free_block
        assert prev is not None
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = tail
        tail.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Queue blocks at the front, keeping their order (``blocks[0]`` becomes the front).

        Args:
            blocks: Blocks outside the queue.
        """
        if not blocks:
            return
        head = self._head
        first = head.next_free_block
        assert first is not None
        prev = head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every queued block, front (next to evict) to back. O(queue length); for tests."""
        blocks: list[KVCacheBlock] = []
        tail = self._tail
        block = self._head.next_free_block
        while block is not None and block is not tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks
