"""Fork and copy-on-write: the V0 prefix-caching allocator's sharing semantics on kvcm's core.

A *fork* gives a new request (the child) every block its parent's computed tokens occupy, the
partial last block included: the blocks gain one reference each and nothing is copied. Blocks
the parent holds beyond its computed tokens (slots allocated ahead) stay the parent's.

*Copy-on-write*: the first allocation that writes into a partial last block still shared
(its ``ref_cnt`` above 1) gives the writer a private block in its place and queues the copy
``(source_block_id, destination_block_id)`` for the workers; the source loses the writer's
reference and keeps the others'. Whoever writes first (parent or child) gets the copy, the last
holder keeps the original, as V0's ``cow_block_if_not_appendable``. Full shared blocks are
never written, so they stay shared. The copy and the allocation fit together or neither
happens (``allocate_slots`` answers ``None`` and nothing changed).

*Promotion*: a block that fills is cached as every full block is (its hash registered in the
prefix cache by ``cache_blocks``). Unlike V0, which maps a newly promoted block onto an
existing cached block with the same content and frees the new one, kvcm keeps both (vLLM V1's
prefix cache holds several blocks per hash); the duplicate is evicted in its turn.

*Common computed blocks* (V0's ``get_common_computed_block_ids``): per group, the longest
prefix of cached blocks that every request of a group of requests holds at the same
positions (the blocks a group of samples can skip computing).

*Free* of a forked request drops only its own references (``KVCacheManager.free``).

Copies are transient (not in snapshots, like the host tier's): a worker runs a step's copies
before the step's forward pass, so a source freed and reallocated in the same step is still
intact when copied (its new owner writes it only in the forward pass).

Forking needs a pool whose KV-cache groups are all full attention hashed at their own block
size; other pools refuse it (sliding windows free blocks a child would share, Mamba states are
not token blocks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from kvcm.core.request import Request, RequestStatus
from kvcm.core.single_type_managers import FullAttentionManager

if TYPE_CHECKING:
    from kvcm.core.block import KVCacheBlock
    from kvcm.core.manager import KVCacheManager, SlotOptions
    from kvcm.core.pool import Pool

__all__ = [
    "common_computed_block_ids",
    "copy_shared_tail",
    "fork_blocks",
    "fork_granule",
    "fork_request",
    "take_fork_copies",
]


def fork_granule(manager: KVCacheManager) -> int:
    """The lcm of the groups' block sizes when the pool can fork, else 0.

    A request whose computed tokens are a multiple of it has no partial last block.
    """
    managers = manager.coordinator.single_type_managers
    if not managers or any(
        type(m) is not FullAttentionManager
        or (manager.enable_caching and m.block_size != manager.hash_block_size)
        for m in managers
    ):
        return 0
    return math.lcm(*(m.block_size for m in managers))


def fork_blocks(
    manager: KVCacheManager, parent: Request, child: Request, num_computed_tokens: int
) -> None:
    """Share the blocks holding ``parent``'s first ``num_computed_tokens`` with ``child``.

    Both requests take ``num_computed_tokens`` as their computed tokens (checked by the
    caller against the parent's tokens and slots). The parent's full computed blocks are
    cached first (V0's ``mark_blocks_as_computed``), so parent and child agree on which
    blocks are immutable. ``child`` becomes RUNNING.

    Raises:
        FailedPreconditionError: The pool cannot fork, or the parent holds no blocks.
        AlreadyExistsError: The child holds blocks already.
    """
    if not manager.fork_granule:
        raise FailedPreconditionError(
            "fork needs a pool whose KV-cache groups are all full attention hashed at their "
            "own block size"
        )
    parent_id, child_id = parent.request_id, child.request_id
    if not manager.holds_blocks(parent_id):
        raise FailedPreconditionError(f"request {parent_id!r} holds no blocks to fork")
    if manager.holds_blocks(child_id):
        raise AlreadyExistsError(f"request {child_id!r} holds blocks already")
    num_computed = num_computed_tokens
    parent.num_computed_tokens = num_computed
    if manager.enable_caching:
        manager.coordinator.cache_blocks(parent, min(num_computed, parent.num_tokens))
    for group in manager.coordinator.single_type_managers:
        shared = group.req_to_blocks[parent_id][: -(-num_computed // group.block_size)]
        for block in shared:
            block.ref_cnt += 1
        group.req_to_blocks[child_id] = list(shared)
        if parent_id in group.num_cached_block:
            group.num_cached_block[child_id] = min(group.num_cached_block[parent_id], len(shared))
    child.num_computed_tokens = num_computed
    child.status = RequestStatus.RUNNING
    manager.note_fork(parent_id, child_id)


def copy_shared_tail(
    manager: KVCacheManager, request: Request, num_new_tokens: int, options: SlotOptions
) -> bool:
    """Give ``request`` private copies of the shared partial blocks it is about to write.

    Called by ``allocate_slots`` (fork-capable pools, ``num_new_tokens > 0``). Returns
    ``False``, changing nothing, when the copies and the allocation's new blocks do not fit.
    """
    request_id = request.request_id
    num_computed = request.num_computed_tokens
    shared: list[tuple[list[KVCacheBlock], int]] = []
    groups = manager.coordinator.single_type_managers
    for group in groups:
        size = group.block_size
        if not num_computed % size:
            continue
        blocks = group.req_to_blocks.get(request_id)
        index = num_computed // size
        if blocks is not None and index < len(blocks) and blocks[index].ref_cnt > 1:
            shared.append((blocks, index))
    if not shared:
        return True
    pool = manager.block_pool
    lookahead = options.num_lookahead_tokens or 0
    total = min(num_computed + num_new_tokens + lookahead, manager.max_model_len)
    needed = len(shared)
    for group in groups:
        held = len(group.req_to_blocks.get(request_id, ()))
        needed += max(0, -(-total // group.block_size) - held)
    if needed > pool.get_num_free_blocks() - options.reserved_blocks:
        return False
    copies = manager.fork_copies
    for blocks, index in shared:
        source = blocks[index]
        (copy,) = pool.get_new_blocks(1)
        blocks[index] = copy
        pool.free_blocks([source])
        copies.append((source.block_id, copy.block_id))
    return True


def common_computed_block_ids(
    manager: KVCacheManager, request_ids: Sequence[str]
) -> tuple[list[int], ...]:
    """Per group, the cached blocks every request holds at the same leading positions.

    Raises:
        InvalidArgumentError: No request given.
        NotFoundError: A request holds no blocks.
    """
    if not request_ids:
        raise InvalidArgumentError("request_keys: at least one request")
    for request_id in request_ids:
        if not manager.holds_blocks(request_id):
            raise NotFoundError(f"request {request_id!r} holds no blocks in this pool")
    answer: list[list[int]] = []
    for group in manager.coordinator.single_type_managers:
        tables = [
            group.req_to_blocks[rid][: group.num_cached_block.get(rid, 0)] for rid in request_ids
        ]
        common: list[int] = []
        for column in zip(*tables, strict=False):
            first = column[0]
            if any(block is not first for block in column):
                break
            common.append(first.block_id)
        answer.append(common)
    return tuple(answer)


# ---------------------------------------------------------------------------------- pools


def fork_request(
    pool: Pool, parent_key: int, child_key: int, request_id: str, num_computed_tokens: int
) -> Request:
    """Fork a live request of a pool: ``child_key`` starts as a copy sharing its blocks.

    The child has the parent's tokens, block hashes, LoRA and salt. ``num_computed_tokens``
    is the parent's computed tokens now (the scheduler's count, as an ALLOCATE carries it):
    both requests take it, and the blocks holding them are shared.

    Raises:
        FailedPreconditionError: The pool is not READY or cannot fork, or the parent is not
            running with blocks.
        NotFoundError: Unknown parent key.
        AlreadyExistsError: The child key is live.
        InvalidArgumentError: ``num_computed_tokens`` is negative, beyond the parent's tokens
            or beyond the slots its blocks hold.
    """
    manager = pool.ready_manager()
    parent = pool.request(parent_key)
    if child_key in pool.requests:
        raise AlreadyExistsError(pool.live_key_message(child_key))
    if parent.status is not RequestStatus.RUNNING:
        raise FailedPreconditionError(
            f"request key {parent_key}: only a running request can be forked"
        )
    if manager.holds_blocks(parent.request_id):
        slots = min(
            len(group.req_to_blocks[parent.request_id]) * group.block_size
            for group in manager.coordinator.single_type_managers
        )
        most = min(parent.num_tokens, slots)
        if not 0 <= num_computed_tokens <= most:
            raise InvalidArgumentError(
                f"num_computed_tokens: {num_computed_tokens} is outside 0..{most} "
                f"(request key {parent_key}'s tokens and slots)"
            )
    child = Request(
        str(child_key),
        parent.prompt_token_ids,
        lora_id=parent.lora_id,
        lora_name=parent.lora_name,
        cache_salt=parent.cache_salt,
        skip_reading_prefix_cache=parent.skip_reading_prefix_cache,
        report_cached_blocks=parent.report_cached_blocks,
    )
    child.all_token_ids = list(parent.all_token_ids)
    child.block_hashes = list(parent.block_hashes)
    fork_blocks(manager, parent, child, num_computed_tokens)
    pool.requests[child_key] = child
    pool.request_ids[child_key] = request_id
    return child


def take_fork_copies(pool: Pool) -> list[tuple[int, int]]:
    """Drain the copy-on-write copies ``(source, destination)`` of the pool's last Step.

    A unary ``Pool.allocate`` is a Step; a Step program's outcome answers its own copies too
    (``StepOutcome.copy_block_ids``), and each Step starts with none.
    """
    manager = pool.ready_manager()
    copies = manager.fork_copies
    manager.fork_copies = []
    return copies


def pool_common_computed_block_ids(pool: Pool, keys: Sequence[int]) -> tuple[list[int], ...]:
    """:func:`common_computed_block_ids` of live request keys."""
    manager = pool.ready_manager()
    for key in keys:
        pool.request(key)
    return common_computed_block_ids(manager, [str(key) for key in keys])
