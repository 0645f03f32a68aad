"""Exact prefix lookup across pools: where is a prompt cached, and how busy is each pool.

A router asks, for one prompt, how many of its tokens each pool of a scope would hit now,
which is exactly what the pool's own ``get_computed_blocks`` answers (capped at
``num_tokens - 1``), without changing any pool or counting any prefix-cache statistic.

How it stays cheap with many pools:

* :class:`PrefixIndex` maps every cache key of every *indexed* pool to a bitmask of the pools
  caching it. The allocator keeps it exact itself (:meth:`BlockPool.attach_index`): a key's
  bit is set where the key enters the pool's prefix cache and cleared where it leaves, so
  there is no event lag.
* Pools that share hashing parameters share the prompt's block hashes, hashed once. A pool
  with one full-attention group (the common case: every layer full attention, MLA included)
  is indexed; for those the lookup walks the prompt's blocks once, intersecting bitmasks, and
  stops at the first block no pool in scope caches: O(blocks hit), whatever the number of
  pools. Other pools (hybrid, sliding window, Mamba, caching off) are answered by their own
  coordinator, read-only: O(pools of that kind).
* Building the answer reads every pool's load: O(pools in scope), a few attribute reads each.

The ranking (best first): ``score = num_hit_tokens / num_tokens - load_weight * usage``,
ties broken by fewer waiting requests, then lower usage, then pool id.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NamedTuple, TypeAlias

from kvcm.common.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from kvcm.common.hashing import (
    BlockHash,
    BlockHasher,
    BlockHashWithGroupId,
    HashAlgorithm,
    MultiModalFeature,
    make_block_hash_with_group_id,
)
from kvcm.core.coordinator import UnitaryKVCacheCoordinator
from kvcm.core.pool_types import PoolState, check_labels
from kvcm.core.single_type_managers import FullAttentionManager

if TYPE_CHECKING:
    from kvcm.core.manager import KVCacheManager
    from kvcm.core.pool import Pool

__all__ = [
    "DEFAULT_LOAD_WEIGHT",
    "MAX_LOOKUP_HASH_BYTES",
    "MAX_LOOKUP_HASH_WORK",
    "MAX_LOOKUP_TOKENS",
    "LookupQuery",
    "LookupAnswer",
    "PoolHit",
    "PoolLoad",
    "PrefixIndex",
    "Profile",
    "hash_prompt",
    "hashing_work",
    "lookup",
    "scope_pools",
]

DEFAULT_LOAD_WEIGHT: Final = 0.5
MAX_LOOKUP_TOKENS: Final = 4 * 1024 * 1024
MAX_LOOKUP_HASH_BYTES: Final = 8 * 1024 * 1024
MAX_LOOKUP_HASH_WORK: Final = 1024 * 1024
"""Block hashes one token lookup may compute (about 1-3 s of CPU, off the server's loop)."""
_MAX_LOAD_WEIGHT: Final = 1e6
_GROUP0_SUFFIX: Final = make_block_hash_with_group_id(BlockHash(b""), 0)

Profile: TypeAlias = tuple[HashAlgorithm, str, int, int]
"""Hashing parameters that give a prompt the same hashes: algorithm, seed, block size, length."""


def _indexable(manager: KVCacheManager) -> bool:
    """Whether the pool's hits follow one chain of full-attention keys of group 0."""
    coordinator = manager.coordinator
    return (
        manager.enable_caching
        and type(coordinator) is UnitaryKVCacheCoordinator
        and type(coordinator.single_type_managers[0]) is FullAttentionManager
    )


class PrefixIndex:
    """Cache key -> bitmask of the pools caching it, over every indexed pool of a registry.

    Each indexed pool holds one bit (slots are reused, lowest first, so masks stay short).
    Pools change their bits from whatever thread runs them, under the index's lock; readers
    take single ``dict.get`` reads (atomic) and need no lock.
    """

    __slots__ = ("_by_name", "_keys", "_lock", "_slots")

    def __init__(self) -> None:
        """An empty index."""
        self._keys: dict[BlockHashWithGroupId, int] = {}
        self._lock = threading.Lock()
        self._slots: list[Pool | None] = []
        self._by_name: dict[str, int] = {}

    def __len__(self) -> int:
        """Distinct keys cached by at least one indexed pool."""
        return len(self._keys)

    @property
    def num_pools(self) -> int:
        """Pools indexed now."""
        return len(self._by_name)

    def slot(self, pool: Pool) -> int | None:
        """The pool's slot, indexing it first if it can be (READY, one full-attention group,
        not lent to another thread).

        ``None``: the pool is not indexed (it is answered by its own coordinator).
        """
        slot = self._by_name.get(pool.name)
        if slot is not None and self._slots[slot] is pool:
            return slot
        manager = pool.manager
        if manager is None or pool.lent or not _indexable(manager):
            # A lent pool changes in another thread: its keys cannot be copied now (it is
            # indexed at a later lookup; this one answers it as busy).
            return None
        if slot is not None:
            self.remove(pool.name)  # a new incarnation under the same name
        try:
            slot = self._slots.index(None)
        except ValueError:
            slot = len(self._slots)
            self._slots.append(None)
        self._slots[slot] = pool
        self._by_name[pool.name] = slot
        manager.block_pool.attach_index(self._keys, 1 << slot, self._lock)
        return slot

    def remove(self, name: str) -> None:
        """Stop indexing the pool called ``name`` (nothing if it is not indexed)."""
        slot = self._by_name.pop(name, None)
        if slot is None:
            return
        pool = self._slots[slot]
        self._slots[slot] = None
        if pool is not None and pool.manager is not None:
            pool.manager.block_pool.detach_index()


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupQuery:
    """One prompt and the pools to look it up in.

    Exactly one of ``token_ids`` (kvcm hashes them with each pool's parameters) and
    ``block_hashes`` (already hashed: concatenated request block hashes, read with each
    pool's hash length and block size) is set.

    Attributes:
        token_ids: The prompt's token ids.
        lora_name: Token prompts: the LoRA adapter's name, hashed as vLLM does.
        lora_path: Token prompts: the LoRA adapter's path (vLLM 0.33 hashes it too).
        cache_salt: Token prompts: vLLM's per-tenant ``cache_salt``.
        mm_features: Token prompts: multi-modal items, sorted by offset.
        block_hashes: The prompt's block hashes.
        num_tokens: Hash prompts: the prompt's length in tokens; 0: one token past the last
            hashed block (every hashed block can hit).
        pool_ids: Scope: these pools (empty: every pool).
        labels: Scope: pools whose labels include all of these.
        load_weight: Weight of a pool's usage against its hit fraction in the score (>= 0).
        max_results: Answer at most this many pools, best first (0: all of them).
    """

    token_ids: Sequence[int] | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_features: Sequence[MultiModalFeature] = ()
    block_hashes: bytes | None = None
    num_tokens: int = 0
    pool_ids: Sequence[str] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    load_weight: float = DEFAULT_LOAD_WEIGHT
    max_results: int = 0

    def __post_init__(self) -> None:
        if (self.token_ids is None) == (self.block_hashes is None):
            raise InvalidArgumentError(
                "prompt: exactly one of tokens (token_ids) and hashes (block_hashes) must be set",
                field="prompt",
            )
        if self.token_ids is not None:
            if not self.token_ids:
                raise InvalidArgumentError("tokens.token_ids is empty", field="tokens.token_ids")
            if len(self.token_ids) > MAX_LOOKUP_TOKENS:
                raise InvalidArgumentError(
                    f"tokens.token_ids has {len(self.token_ids)} tokens, at most "
                    f"{MAX_LOOKUP_TOKENS} are allowed",
                    field="tokens.token_ids",
                )
            if self.num_tokens:
                raise InvalidArgumentError(
                    "hashes.num_tokens is for hash prompts (a token prompt's length is its own)",
                    field="hashes.num_tokens",
                )
        else:
            assert self.block_hashes is not None
            if not self.block_hashes:
                raise InvalidArgumentError(
                    "hashes.block_hashes is empty", field="hashes.block_hashes"
                )
            if len(self.block_hashes) > MAX_LOOKUP_HASH_BYTES:
                raise InvalidArgumentError(
                    f"hashes.block_hashes has {len(self.block_hashes)} bytes, at most "
                    f"{MAX_LOOKUP_HASH_BYTES} are allowed",
                    field="hashes.block_hashes",
                )
            if not 0 <= self.num_tokens <= MAX_LOOKUP_TOKENS:
                raise InvalidArgumentError(
                    f"hashes.num_tokens must be in [0, {MAX_LOOKUP_TOKENS}], got {self.num_tokens}",
                    field="hashes.num_tokens",
                )
        for index, pool_id in enumerate(self.pool_ids):
            if not isinstance(pool_id, str) or not pool_id:
                raise InvalidArgumentError(
                    f"scope.pool_ids[{index}] must be a pool id, got {pool_id!r}",
                    field=f"scope.pool_ids[{index}]",
                )
        check_labels(self.labels, "scope.labels")
        weight = self.load_weight
        if not (isinstance(weight, int | float) and math.isfinite(weight)) or not (
            0.0 <= weight <= _MAX_LOAD_WEIGHT
        ):
            raise InvalidArgumentError(
                f"load_weight must be in [0, {_MAX_LOAD_WEIGHT:g}], got {weight!r}",
                field="load_weight",
            )
        if type(self.max_results) is not int or self.max_results < 0:
            raise InvalidArgumentError(
                f"max_results must be >= 0, got {self.max_results!r}", field="max_results"
            )


class PoolLoad(NamedTuple):
    """How busy a pool is now.

    Attributes:
        usage: Fraction of its usable blocks in use, 0..1.
        num_free_blocks: Blocks that can be allocated now (free cached blocks included).
        num_running: Requests holding blocks.
        num_waiting: Requests the pool tracks that hold none (not admitted yet, preempted).
    """

    usage: float
    num_free_blocks: int
    num_running: int
    num_waiting: int


class PoolHit(NamedTuple):
    """One pool's answer.

    Attributes:
        pool_id: The pool.
        num_hit_tokens: Its longest prefix hit in tokens: what its ``get_computed_blocks``
            answers for the prompt now.
        group_hit_tokens: Per KV-cache group, the longest hit that group's cache alone
            holds (capped like the pool's; the pool's hit is what all groups agree on).
        tier_hit_tokens: Per storage medium (``"GPU"`` until other tiers exist), the hit.
        num_tokens: The prompt's length as this pool judges it.
        load: The pool's load.
        score: The ranking score (see the module docstring).
    """

    pool_id: str
    num_hit_tokens: int
    group_hit_tokens: tuple[int, ...]
    tier_hit_tokens: Mapping[str, int]
    num_tokens: int
    load: PoolLoad
    score: float


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    """The answer to a :class:`LookupQuery`.

    Attributes:
        pools: Pool answers, best ranked first (at most ``max_results``).
        skipped: Pools in scope that could not be answered, with the reason (not ready,
            prompt longer than max_model_len, hashes of another length, busy).
        num_pools_in_scope: Pools the scope matched.
    """

    pools: tuple[PoolHit, ...]
    skipped: tuple[tuple[str, str], ...]
    num_pools_in_scope: int


def scope_pools(
    pools: Iterable[Pool], by_name: Mapping[str, Pool], query: LookupQuery
) -> list[Pool]:
    """The pools a query's scope matches (``pools``: every pool, ``by_name`` to resolve ids).

    Raises:
        NotFoundError: A listed pool id does not exist (the field names its index).
    """
    if query.pool_ids:
        chosen: list[Pool] = []
        seen: set[str] = set()
        for index, pool_id in enumerate(query.pool_ids):
            pool = by_name.get(pool_id)
            if pool is None:
                raise NotFoundError(
                    f"scope.pool_ids[{index}]: pool {pool_id!r} not found",
                    field=f"scope.pool_ids[{index}]",
                )
            if pool_id not in seen:
                seen.add(pool_id)
                chosen.append(pool)
    else:
        chosen = list(pools)
    wanted = query.labels.items()
    if wanted:
        chosen = [
            pool for pool in chosen if all(pool.options.labels.get(k) == v for k, v in wanted)
        ]
    return chosen


def _profile(pool: Pool) -> Profile:
    hashing = pool.hashing
    return (hashing.algorithm, hashing.seed, hashing.hash_block_size, hashing.hash_length_bytes)


def _takes(pool: Pool, query: LookupQuery) -> bool:
    """Whether the pool is READY and, for a token prompt, long enough to take it."""
    if pool.manager is None or pool.state is not PoolState.READY:
        return False
    return query.token_ids is None or len(query.token_ids) <= pool.max_model_len


def hashing_work(pools: Iterable[Pool], query: LookupQuery) -> int:
    """Blocks :func:`hash_prompt` would hash for ``query`` over ``pools`` (0 for hashes).

    Raises:
        ResourceExhaustedError: More than ``MAX_LOOKUP_HASH_WORK`` (one prompt hashed once per
            distinct seed: many xxhash pools, each with its own seed, multiply it).
    """
    if query.token_ids is None:
        return 0
    seen = {_profile(pool) for pool in pools if _takes(pool, query)}
    work = sum(len(query.token_ids) // profile[2] for profile in seen)
    if work > MAX_LOOKUP_HASH_WORK:
        raise ResourceExhaustedError(
            f"tokens.token_ids: hashing the prompt for the {len(seen)} hashing parameter sets "
            f"of the scope takes {work} block hashes, more than {MAX_LOOKUP_HASH_WORK}; "
            "narrow the scope or send block hashes"
        )
    return work


def hash_prompt(pools: Iterable[Pool], query: LookupQuery) -> dict[Profile, list[BlockHash]]:
    """The prompt's block hashes per distinct hashing parameters among ``pools``.

    Pure (reads only the pools' fixed hashing parameters), so a server runs it in a worker
    thread when the prompt is long or the scope spans many parameter sets (xxhash pools have
    a seed each), then hands the result to :func:`lookup`.
    """
    hashed: dict[Profile, list[BlockHash]] = {}
    for pool in pools:
        if _takes(pool, query):
            profile = _profile(pool)
            if profile not in hashed:
                hashed[profile] = _prompt_hashes(pool, query)
    return hashed


def lookup(
    pools: Sequence[Pool],
    index: PrefixIndex,
    query: LookupQuery,
    hashed: Mapping[Profile, Sequence[BlockHash]] | None = None,
) -> LookupAnswer:
    """Answer ``query`` over ``pools`` (its scope, already resolved); changes no pool.

    ``hashed``: the prompt's hashes from :func:`hash_prompt` (parameter sets it lacks are
    hashed here). A pool being changed in another thread (a Step in its lane) is answered from
    the index at some point of that change when it is indexed, and skipped as busy otherwise.
    """
    skipped: list[tuple[str, str]] = []
    # name -> (pool, hit tokens, per-group hits, prompt tokens)
    hits: dict[str, tuple[Pool, int, tuple[int, ...], int]] = {}
    # Pools sharing hashing parameters share the prompt's hashes (hashed or split once).
    profiles: dict[Profile, tuple[Sequence[BlockHash], int]] = {}
    walks: dict[Profile, list[tuple[int, Pool]]] = {}
    ready = PoolState.READY
    token_ids = query.token_ids
    slot_of = index.slot
    for pool in pools:
        manager = pool.manager
        if manager is None or pool.state is not ready:
            skipped.append((pool.name, "not ready: workers have not registered"))
            continue
        if token_ids is not None and len(token_ids) > pool.max_model_len:
            skipped.append(
                (
                    pool.name,
                    f"prompt of {len(token_ids)} tokens exceeds max_model_len {pool.max_model_len}",
                )
            )
            continue
        profile = _profile(pool)
        known = profiles.get(profile)
        if known is None:
            hashes = None if hashed is None else hashed.get(profile)
            if hashes is None:
                hashes = _prompt_hashes(pool, query)
            known = profiles[profile] = (
                hashes,
                _num_tokens(query, len(hashes), profile[2]),
            )
        hashes, num_tokens = known
        if token_ids is None:
            reason = _unanswerable(pool, query, num_tokens, len(hashes))
            if reason:
                skipped.append((pool.name, reason))
                continue
        slot = slot_of(pool)
        if slot is not None:
            walks.setdefault(profile, []).append((slot, pool))
            continue
        if pool.lent:
            skipped.append((pool.name, "busy: a long call is running on it"))
            continue
        hits[pool.name] = (pool, *_coordinator_hit(manager, hashes, num_tokens))
    for shared, members in walks.items():
        hashes, num_tokens = profiles[shared]
        _walk(index, hashes, num_tokens, members, hits)
    ranked = _ranked(hits.values(), query.load_weight, query.max_results)
    return LookupAnswer(tuple(ranked), tuple(skipped), len(pools))


# ------------------------------------------------------------------------------- internals
def _prompt_hashes(pool: Pool, query: LookupQuery) -> list[BlockHash]:
    hashing = pool.hashing
    if query.token_ids is not None:
        hasher = BlockHasher(hashing.hash_block_size, hashing.algorithm, hashing.seed)
        return hasher.hash_token_ids(
            query.token_ids,
            lora_name=query.lora_name,
            lora_path=query.lora_path,
            cache_salt=query.cache_salt,
            mm_features=query.mm_features,
        )
    raw = query.block_hashes
    assert raw is not None
    size = hashing.hash_length_bytes
    if len(raw) % size:
        return []  # _unanswerable says why
    return [BlockHash(raw[i : i + size]) for i in range(0, len(raw), size)]


def _num_tokens(query: LookupQuery, num_hashes: int, hash_block_size: int) -> int:
    if query.token_ids is not None:
        return len(query.token_ids)
    return query.num_tokens or num_hashes * hash_block_size + 1


def _unanswerable(pool: Pool, query: LookupQuery, num_tokens: int, num_hashes: int) -> str:
    hashing = pool.hashing
    if query.block_hashes is not None:
        size = hashing.hash_length_bytes
        if len(query.block_hashes) % size:
            return f"block_hashes are not a whole number of {size}-byte hashes"
        if num_hashes * hashing.hash_block_size > num_tokens:
            return (
                f"{num_hashes} block hashes of {hashing.hash_block_size} tokens exceed "
                f"num_tokens {num_tokens}"
            )
    if num_tokens > pool.max_model_len:
        return f"prompt of {num_tokens} tokens exceeds max_model_len {pool.max_model_len}"
    return ""


def _coordinator_hit(
    manager: KVCacheManager, hashes: Sequence[BlockHash], num_tokens: int
) -> tuple[int, tuple[int, ...], int]:
    """The pool's own answer (read-only), per group, for pools the index does not hold."""
    coordinator = manager.coordinator
    groups = coordinator.single_type_managers
    if not manager.enable_caching:
        return 0, (0,) * len(groups), num_tokens
    cap = num_tokens - 1
    hit = coordinator.find_longest_cache_hit(hashes, cap)
    if len(groups) == 1:
        return hit.num_tokens, (hit.num_tokens,), num_tokens
    alignment = coordinator.scheduler_block_size
    per_group = tuple(
        group.find_longest_cache_hit(hashes, cap, (group.kv_cache_group_id,), alignment).num_tokens
        for group in groups
    )
    return hit.num_tokens, per_group, num_tokens


def _walk(
    index: PrefixIndex,
    hashes: Sequence[BlockHash],
    num_tokens: int,
    members: list[tuple[int, Pool]],
    hits: dict[str, tuple[Pool, int, tuple[int, ...], int]],
) -> None:
    """Hits of indexed pools sharing ``hashes``: one pass over the blocks, bitmask per block.

    Indexed pools hash at their block size, so one profile means one block size and one cap.
    """
    block_size = members[0][1].hashing.hash_block_size
    max_blocks = min((num_tokens - 1) // block_size, len(hashes))
    mask = 0
    for slot, _ in members:
        mask |= 1 << slot
    # NOTE: a pool leaves the mask at the first block it misses; its hit is the blocks before.
    reached: dict[int, int] = {}
    get = index._keys.get
    suffix = _GROUP0_SUFFIX
    i = 0
    while i < max_blocks and mask:
        holders = get(hashes[i] + suffix, 0)  # type: ignore[call-overload]
        kept = mask & holders
        if kept != mask and i:
            dropped = mask ^ kept
            while dropped:
                low = dropped & -dropped
                reached[low.bit_length() - 1] = i
                dropped ^= low
        mask = kept
        i += 1
    while mask:
        low = mask & -mask
        reached[low.bit_length() - 1] = i
        mask ^= low
    for slot, pool in members:
        num_hit = reached.get(slot, 0) * block_size
        hits[pool.name] = (pool, num_hit, (num_hit,), num_tokens)


def _ranked(
    hits: Iterable[tuple[Pool, int, tuple[int, ...], int]], load_weight: float, limit: int
) -> list[PoolHit]:
    """Answers, best first (at most ``limit``; 0: all); only returned ones are built."""
    rows = []
    for pool, num_hit, per_group, num_tokens in hits:
        block_pool = pool.manager.block_pool  # type: ignore[union-attr]
        usage = block_pool.get_usage()
        score = num_hit / num_tokens - load_weight * usage
        num_running = len(pool.manager.coordinator.single_type_managers[0].req_to_blocks)  # type: ignore[union-attr]
        num_waiting = len(pool.requests) - num_running
        rows.append((-score, num_waiting, usage, pool.name, pool, num_hit, per_group, num_tokens))
    if limit and limit < len(rows):
        chosen = heapq.nsmallest(limit, rows, key=_rank_key)
    else:
        rows.sort(key=_rank_key)
        chosen = rows
    answers = []
    for negative, num_waiting, usage, name, pool, num_hit, per_group, num_tokens in chosen:
        block_pool = pool.manager.block_pool  # type: ignore[union-attr]
        load = PoolLoad(
            usage,
            block_pool.get_num_free_blocks(),
            len(pool.requests) - num_waiting,
            max(0, num_waiting),
        )
        answers.append(
            PoolHit(
                name,
                num_hit,
                per_group,
                {block_pool.medium: num_hit},
                num_tokens,
                load,
                -negative,
            )
        )
    return answers


def _rank_key(row: tuple[object, ...]) -> tuple[object, ...]:
    return row[:4]
