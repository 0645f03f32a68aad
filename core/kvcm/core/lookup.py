"""Exact prefix lookup across pools: where is a prompt cached, and how busy is each pool.

A router asks, for one prompt, how many of its tokens each pool of a scope would hit now,
which is exactly what the pool's own ``get_computed_blocks`` answers (capped at
``num_tokens - 1``), without changing any pool or counting any prefix-cache statistic.

How it stays cheap with many pools (the answer costs O(blocks hit + pools answered)):

* :class:`PrefixIndex` maps every cache key of every *indexed* pool to a bitmask of the pools
  caching it. The allocator keeps it exact itself (:meth:`BlockPool.attach_index`): a key's
  bit is set where the key enters the pool's prefix cache and cleared where it leaves, so
  there is no event lag. The index also keeps per pool what an answer reads, and per kind of
  pool (hashing parameters, ``max_model_len``) its members and their mask, so a scope of
  every pool builds nothing pool by pool.
* Pools that share hashing parameters share the prompt's block hashes, hashed (or split) once.
  A pool with one full-attention group (the common case: every layer full attention, MLA
  included) is indexed; for those the lookup walks the prompt's blocks once, intersecting
  bitmasks in C, and stops at the first block no pool in scope caches: O(blocks hit),
  whatever the number of pools. Other pools (hybrid, sliding window, Mamba, caching off) are
  answered by their own coordinator, read-only: O(pools of that kind).
* Only the pools answered are scored: with ``max_results``, pools are taken from the deepest
  hit down, and the rest is never read once no deeper-ranked pool can be outscored.

The ranking (best first): ``score = num_hit_tokens / num_tokens - load_weight * usage``,
ties broken by fewer waiting requests, then lower usage, then pool id.
"""

from __future__ import annotations

import heapq
import math
import threading
from bisect import insort
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, count, repeat
from operator import attrgetter, is_, itemgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeAlias, cast, overload

from kvcm.common.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from kvcm.common.hashing import (
    BlockHash,
    HashAlgorithm,
    MultiModalFeature,
    make_block_hash_with_group_id,
)
from kvcm.core._key_index import MAX_SLOT, NATIVE, KeyIndex, KeyIndexLike, key_chunks
from kvcm.core.coordinator import UnitaryKVCacheCoordinator
from kvcm.core.host_tier import prefix_host_hit_tokens
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
    "PendingPool",
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

Profile: TypeAlias = tuple[HashAlgorithm, str, int, int, int]
"""Hashing parameters that give a prompt the same hashes: algorithm, seed, block size, length."""


def _indexable(manager: KVCacheManager) -> bool:
    """Whether the pool's hits follow one chain of full-attention keys of group 0."""
    coordinator = manager.coordinator
    return (
        manager.enable_caching
        and type(coordinator) is UnitaryKVCacheCoordinator
        and type(coordinator.single_type_managers[0]) is FullAttentionManager
    )


KindKey: TypeAlias = tuple[Profile, int]
"""Indexed pools answered alike: hashing parameters and ``max_model_len``."""


class _Member:
    """An indexed pool, with what answering it reads kept at hand (no per-query gathering)."""

    __slots__ = (
        "bit",
        "block_pool",
        "block_size",
        "free_queue",
        "kind",
        "medium",
        "name",
        "num_usable",
        "pool",
        "requests",
        "running",
        "slot",
    )

    def __init__(self, pool: Pool, manager: KVCacheManager, slot: int, kind: _Kind) -> None:
        self.pool = pool
        self.name = pool.name
        self.slot = slot
        self.bit = 1 << slot
        self.kind = kind
        block_pool = manager.block_pool
        self.block_pool = block_pool
        self.num_usable = block_pool.num_gpu_blocks - 1
        self.medium = block_pool.medium
        self.block_size = pool.hashing.hash_block_size
        # NOTE: what the load is read from, held directly (each hop is a likely cache miss
        # with millions of blocks in memory). A live pool never replaces these objects: a
        # snapshot restores into a new pool, which the registry adds as a new incarnation.
        self.free_queue = block_pool.free_block_queue
        self.running = manager.coordinator.single_type_managers[0].req_to_blocks
        self.requests = pool.requests


_Columns: TypeAlias = tuple[
    list[int], list[Any], list[Any], list[Any], list[str], list[int], list[str]
]
"""Per pool, side by side: slot, free queue, running requests' table, requests' table, name,
usable blocks, medium (what answering every pool reads, without visiting each member)."""


def _columns_of(members: Sequence[_Member]) -> _Columns:
    return (
        list(map(_SLOT, members)),
        list(map(_FREE_QUEUE, members)),
        list(map(_RUNNING, members)),
        list(map(_REQUESTS, members)),
        list(map(_NAME, members)),
        list(map(_NUM_USABLE, members)),
        list(map(_MEDIUM, members)),
    )


class _Kind:
    """The indexed pools of one :data:`KindKey`: their members, the mask of their bits, and
    their columns (built when first read after the members change)."""

    __slots__ = ("_columns", "key", "mask", "members")

    # NOTE: members are kept sorted by name.

    def __init__(self, key: KindKey) -> None:
        self.key = key
        self.mask = 0
        self.members: list[_Member] = []
        self._columns: _Columns | None = None

    def columns(self) -> _Columns:
        """The members' columns, kept until the members change."""
        if self._columns is None:
            self._columns = _columns_of(self.members)
        return self._columns

    def changed(self) -> None:
        """The members changed (drops the columns)."""
        self._columns = None


class PendingPool:
    """A pool being indexed (:meth:`PrefixIndex.reserve`): its slot is taken, its bits may be
    set, and no answer includes it yet."""

    __slots__ = ("member",)

    def __init__(self, member: _Member) -> None:
        self.member = member

    @property
    def pool(self) -> Pool:
        """The pool."""
        return self.member.pool


class PrefixIndex:
    """Cache key -> bitmask of the pools caching it, over every indexed pool of a registry.

    Each indexed pool holds one bit (slots are reused, lowest first, so masks stay short).
    Pools change their bits from whatever thread runs them, under the index's lock; readers
    take single ``dict.get`` reads (atomic) and need no lock. Besides the keys, the index
    keeps per pool what an answer reads (:class:`_Member`) and, per kind of pool, the members
    and the mask of their bits, so a query over whole kinds builds nothing pool by pool.
    """

    __slots__ = ("_by_name", "_by_pool", "_every", "_keys", "_kinds", "_lock", "_slots", "_version")

    def __init__(self) -> None:
        """An empty index."""
        self._keys: KeyIndexLike = KeyIndex()
        self._lock = threading.Lock()
        self._slots: list[_Member | None] = []
        self._by_name: dict[str, _Member] = {}
        self._by_pool: dict[Pool, _Member] = {}  # identity keys: a replaced pool misses
        self._kinds: dict[KindKey, _Kind] = {}
        self._version = 0  # counts the changes of the indexed pools (commit, remove)
        # The last scope found to hold exactly the indexed pools, and the version then: the
        # same list of pools (compared by identity, in C) needs no dictionary read per pool.
        self._every: tuple[Sequence[Pool], int] | None = None

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
        member = self._member(pool)
        return None if member is None else member.slot

    def unindexed(self, pools: Sequence[Pool]) -> list[Pool]:
        """The pools of ``pools`` the index does not hold, in order: a dictionary read per
        pool in C, or one comparison by identity for the same list of pools as the last
        scope found to be every indexed pool (nothing indexed or removed since)."""
        every = self._every
        if (
            every is not None
            and every[1] == self._version
            and (every[0] is pools or every[0] == pools)
        ):
            return []
        return list(compress(pools, map(is_, map(self._by_pool.get, pools), repeat(None))))

    def every_kind(self, pools: Iterable[Pool]) -> list[KindKey] | None:
        """The kinds of the indexed pools when ``pools`` is the same list as the last scope
        found to hold exactly them (nothing indexed or removed since; one comparison by
        identity, in C), else ``None``: what a scope of every pool is made of, without
        visiting a pool (indexed pools are READY)."""
        every = self._every
        if (
            every is not None
            and every[1] == self._version
            and (every[0] is pools or every[0] == pools)
        ):
            return list(self._kinds)
        return None

    def _member(self, pool: Pool) -> _Member | None:
        member = self._by_pool.get(pool)
        if member is not None:
            return member
        pending = self.reserve(pool)
        if pending is None:
            return None
        self.attach(pending)
        self.commit(pending)
        return pending.member

    def reserve(self, pool: Pool) -> PendingPool | None:
        """Take a slot for indexing ``pool`` in three steps: this one, :meth:`attach` (the
        O(cache) part, which may run in a thread holding the pool) and :meth:`commit`
        (answers include the pool from then on); or :meth:`abandon`.

        ``None``: the pool is indexed already, or cannot be now (not READY, not one
        full-attention group, or lent to another thread: a later lookup indexes it).
        A reserved slot is in no answer's mask, so its bits being set meanwhile change
        no answer.
        """
        manager = pool.manager
        if pool in self._by_pool or manager is None or pool.lent or not _indexable(manager):
            return None
        if pool.host_tier is not None:
            return None  # answered directly: its host hits are read from the tier
        if manager.block_pool.num_gpu_blocks < 2:
            return None  # no usable block (the null block only): answered directly
        try:
            slot = self._slots.index(None)
        except ValueError:
            slot = len(self._slots)
            if slot > MAX_SLOT:
                return None  # answered directly
            self._slots.append(None)
        key = (_profile(pool), pool.max_model_len)
        kind = self._kinds.get(key) or _Kind(key)  # a new kind is stored by commit
        member = _Member(pool, manager, slot, kind)
        self._slots[slot] = member
        return PendingPool(member)

    def attach(self, pending: PendingPool) -> None:
        """Set the reserved slot's bit on every key the pool caches now; from then on the
        pool's allocator keeps it exact. Run by whoever owns the pool (the event loop, or a
        thread it is lent to)."""
        member = pending.member
        member.block_pool.attach_index(self._keys, member.slot, self._lock)

    def commit(self, pending: PendingPool) -> None:
        """Answer the attached pool from now on (replacing a former incarnation under its
        name, if any)."""
        member = pending.member
        self.remove(member.name)
        kind = member.kind = self._kinds.setdefault(member.kind.key, member.kind)
        self._by_name[member.name] = member
        self._by_pool[member.pool] = member
        insort(kind.members, member, key=_NAME)  # answers sort by name last (_ranked_all)
        kind.mask |= member.bit
        kind.changed()
        self._version += 1

    def abandon(self, pending: PendingPool) -> None:
        """Give a reserved slot back, clearing its bits if they were set (the pool went away
        while it was attached)."""
        member = pending.member
        member.block_pool.detach_index()
        self._slots[member.slot] = None

    def remove(self, name: str) -> None:
        """Stop indexing the pool called ``name`` (nothing if it is not indexed)."""
        member = self._by_name.pop(name, None)
        if member is None:
            return
        del self._by_pool[member.pool]
        self._slots[member.slot] = None
        kind = member.kind
        kind.members.remove(member)
        kind.mask &= ~member.bit
        kind.changed()
        self._version += 1
        if not kind.members:
            del self._kinds[kind.key]
        member.block_pool.detach_index()


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
        tier_hit_tokens: Per storage medium, the hit: ``"GPU"`` the device's
            (``num_hit_tokens``); ``"CPU"``, for a pool with a host tier, the tokens its tier
            holds after the device hit (not in ``num_hit_tokens`` nor the score).
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
        missing_replicas: In a kvcm cluster, the replicas that did not answer their part in
            time (their pools are neither ranked nor counted here); empty when every replica
            answered, and always from one server. Not compared: an answer equals another
            whatever replicas it missed.
    """

    pools: tuple[PoolHit, ...]
    skipped: tuple[tuple[str, str], ...]
    num_pools_in_scope: int
    missing_replicas: tuple[str, ...] = field(default=(), compare=False)


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
    return (
        hashing.algorithm,
        hashing.seed,
        hashing.hash_block_size,
        hashing.hash_length_bytes,
        hashing.num_lookahead_tokens,
    )


def _takes(pool: Pool, query: LookupQuery) -> bool:
    """Whether the pool is READY and, for a token prompt, long enough to take it."""
    if pool.manager is None or pool.state is not PoolState.READY:
        return False
    return query.token_ids is None or len(query.token_ids) <= pool.max_model_len


def hashing_work(
    pools: Iterable[Pool], query: LookupQuery, index: PrefixIndex | None = None
) -> int:
    """Blocks :func:`hash_prompt` would hash for ``query`` over ``pools`` (0 for hashes).

    ``index``: the registry's; a scope it recognizes as every indexed pool
    (:meth:`PrefixIndex.every_kind`) is read from its kinds, not pool by pool (visiting 1,000
    pools costs ~0.4 ms, mostly cache misses).

    Raises:
        ResourceExhaustedError: More than ``MAX_LOOKUP_HASH_WORK`` (one prompt hashed once per
            distinct seed: many xxhash pools, each with its own seed, multiply it).
    """
    if query.token_ids is None:
        return 0
    kinds = None if index is None else index.every_kind(pools)
    if kinds is not None:  # the pools that take the prompt: those long enough for it
        num_tokens = len(query.token_ids)
        seen = {profile for profile, max_model_len in kinds if num_tokens <= max_model_len}
    else:
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
    """Answer ``query`` over ``pools`` (its scope, already resolved: distinct pools, as
    :func:`scope_pools` gives them); changes no pool.

    ``hashed``: the prompt's hashes from :func:`hash_prompt` (parameter sets it lacks are
    hashed here). A pool being changed in another thread (a Step in its lane) is answered from
    the index at some point of that change when it is indexed, and skipped as busy otherwise.

    Cost: one dictionary read per pool in scope to sort it into kinds; one walk over the
    prompt's blocks per hashing profile (bit operations over the pools still matching, stopped
    at the first block none of them caches); then only the pools answered are scored (with
    ``max_results``, pools that cannot enter the top are never read).
    """
    kinds, others = _sort_scope(pools, index)
    prompts = _Prompts(query, hashed)
    skipped: list[tuple[Pool, str]] = []
    groups: dict[Profile, _Group] = {}
    for kind, members in kinds:
        reason = _kind_reason(members[0], query, prompts)
        if reason:
            skipped.extend((member.pool, reason) for member in members)
            continue
        if len(members) == len(kind.members):
            mask = kind.mask  # the whole kind is in scope
        else:
            mask = 0
            for member in members:
                mask |= member.bit
        profile = kind.key[0]
        group = groups.get(profile)
        if group is None:
            hashes, num_tokens = prompts.get(members[0].pool)
            groups[profile] = _Group(hashes, num_tokens, members, mask)
        else:
            group.members = group.members + members
            group.mask |= mask
        groups[profile].kinds.append((kind, members))
    rows = _direct_rows(others, query, prompts, skipped) if others else []
    for group in groups.values():
        group.levels = _walk(index._keys, group)
    limit = query.max_results
    if limit and limit < len(rows) + sum(len(group.members) for group in groups.values()):
        ranked = _top(groups.values(), index._slots, rows, query.load_weight, limit)
    else:
        ranked = _ranked_all(groups.values(), rows, query.load_weight)
    return LookupAnswer(ranked, _in_scope_order(pools, skipped), len(pools))


# ------------------------------------------------------------------------------- internals
def _prompt_hashes(pool: Pool, query: LookupQuery) -> list[BlockHash]:
    hashing = pool.hashing
    if query.token_ids is not None:
        hasher = hashing.block_hasher()
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


def _sort_scope(
    pools: Sequence[Pool], index: PrefixIndex
) -> tuple[list[tuple[_Kind, list[_Member]]], list[Pool]]:
    """The scope's indexed pools by kind, and the others (indexing those that can be now).

    A scope holding every indexed pool (the common "all pools" query) reuses each kind's own
    member list: one C-level pass of dictionary reads, no grouping; and when it is the same
    list of pools as the last such scope, with no pool indexed or removed since, one C-level
    comparison by identity.
    """
    every = index._every
    if (
        every is not None
        and every[1] == index._version
        and (every[0] is pools or every[0] == pools)
    ):
        return [(kind, kind.members) for kind in index._kinds.values()], []
    found = list(map(index._by_pool.get, pools))
    if len(found) == index.num_pools and None not in found:
        # The registry's own tuple of every pool is kept as it is (compared by identity).
        index._every = (pools if type(pools) is tuple else list(pools), index._version)
        return [(kind, kind.members) for kind in index._kinds.values()], []
    by_kind: dict[_Kind, list[_Member]] = {}
    others: list[Pool] = []
    admit = index._member
    for pool, known in zip(pools, found, strict=True):
        member = admit(pool) if known is None else known
        if member is None:
            others.append(pool)
            continue
        members = by_kind.get(member.kind)
        if members is None:
            by_kind[member.kind] = [member]
        else:
            members.append(member)
    return list(by_kind.items()), others


class _Prompts:
    """The prompt's hashes and length per hashing profile, hashed or split once each."""

    __slots__ = ("_hashed", "_known", "_query")

    def __init__(
        self, query: LookupQuery, hashed: Mapping[Profile, Sequence[BlockHash]] | None
    ) -> None:
        self._query = query
        self._hashed = hashed
        self._known: dict[Profile, tuple[Sequence[BlockHash], int]] = {}

    def get(self, pool: Pool) -> tuple[Sequence[BlockHash], int]:
        """The hashes for ``pool``'s profile and the prompt's length as the pool judges it."""
        profile = _profile(pool)
        known = self._known.get(profile)
        if known is None:
            hashes = None if self._hashed is None else self._hashed.get(profile)
            raw = self._query.block_hashes
            if hashes is None and raw is not None and not len(raw) % profile[3]:
                hashes = _SplitHashes(raw, profile[3])
            elif hashes is None:
                hashes = _prompt_hashes(pool, self._query)
            known = (hashes, _num_tokens(self._query, len(hashes), profile[2]))
            self._known[profile] = known
        return known


class _SplitHashes(Sequence[BlockHash]):
    """A hash prompt's block hashes, split only if a coordinator reads them by position (the
    walk of indexed pools reads the raw bytes)."""

    __slots__ = ("_list", "_size", "raw")

    def __init__(self, raw: bytes, size: int) -> None:
        self.raw = raw
        self._size = size
        self._list: list[BlockHash] | None = None

    def __len__(self) -> int:
        return len(self.raw) // self._size

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self._split())

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...

    @overload
    def __getitem__(self, index: slice) -> list[BlockHash]: ...

    def __getitem__(self, index: int | slice) -> BlockHash | list[BlockHash]:
        return self._split()[index]

    def _split(self) -> list[BlockHash]:
        if self._list is None:
            split = chain.from_iterable(key_chunks(self.raw, self._size, len(self), b""))
            self._list = cast("list[BlockHash]", list(split))
        return self._list


class _Group:
    """Indexed pools in scope sharing a hashing profile: one walk answers them all."""

    __slots__ = (
        "block_size",
        "hash_size",
        "kinds",
        "levels",
        "mask",
        "members",
        "num_tokens",
        "raw",
    )

    def __init__(
        self, hashes: Sequence[BlockHash], num_tokens: int, members: list[_Member], mask: int
    ) -> None:
        # The walk reads the hashes as one string (a hash prompt's own bytes, as sent).
        self.raw = hashes.raw if isinstance(hashes, _SplitHashes) else b"".join(hashes)
        self.hash_size = members[0].kind.key[0][3]
        self.num_tokens = num_tokens
        self.members = members
        self.mask = mask
        # Indexed pools hash at their block size, so one profile means one block size.
        self.block_size = members[0].block_size
        self.levels: list[tuple[int, int]] = []
        self.kinds: list[tuple[_Kind, list[_Member]]] = []  # the group's pools, by kind


def _kind_reason(member: _Member, query: LookupQuery, prompts: _Prompts) -> str:
    """Why a kind's pools cannot be answered ("" if they can); checks the prompt's length
    against max_model_len before hashing a token prompt."""
    pool = member.pool
    token_ids = query.token_ids
    if token_ids is not None and len(token_ids) > pool.max_model_len:
        return f"prompt of {len(token_ids)} tokens exceeds max_model_len {pool.max_model_len}"
    hashes, num_tokens = prompts.get(pool)
    return _unanswerable(pool, query, num_tokens, len(hashes))


# A row: the rank key (negated score, waiting requests, usage, pool id), then the answer.
_Row: TypeAlias = tuple[float, int, float, str, PoolHit]
_new = tuple.__new__


def _direct_rows(
    others: list[Pool],
    query: LookupQuery,
    prompts: _Prompts,
    skipped: list[tuple[Pool, str]],
) -> list[_Row]:
    """Rows of the pools the index does not hold, each answered by its own coordinator."""
    rows: list[_Row] = []
    ready = PoolState.READY
    token_ids = query.token_ids
    weight = query.load_weight
    for pool in others:
        manager = pool.manager
        if manager is None or pool.state is not ready:
            skipped.append((pool, "not ready: workers have not registered"))
            continue
        if token_ids is not None and len(token_ids) > pool.max_model_len:
            skipped.append(
                (
                    pool,
                    f"prompt of {len(token_ids)} tokens exceeds max_model_len {pool.max_model_len}",
                )
            )
            continue
        hashes, num_tokens = prompts.get(pool)
        if token_ids is None:
            reason = _unanswerable(pool, query, num_tokens, len(hashes))
            if reason:
                skipped.append((pool, reason))
                continue
        if pool.lent:
            skipped.append((pool, "busy: a long call is running on it"))
            continue
        num_hit, per_group, num_tokens = _coordinator_hit(manager, hashes, num_tokens)
        block_pool = manager.block_pool
        usage = block_pool.get_usage()
        score = num_hit / num_tokens - weight * usage
        num_running = len(manager.coordinator.single_type_managers[0].req_to_blocks)
        num_waiting = len(pool.requests) - num_running
        load = _new(
            PoolLoad, (usage, block_pool.get_num_free_blocks(), num_running, max(0, num_waiting))
        )
        tiers = {block_pool.medium: num_hit}
        host = pool.host_tier
        if host is not None:
            # What the host tier holds after the device hit (not in num_hit nor the score).
            num_host = prefix_host_hit_tokens(manager, host, hashes, num_hit, num_tokens - 1)
            if num_host:
                tiers[host.medium] = num_host
        hit = _new(
            PoolHit,
            (
                pool.name,
                num_hit,
                per_group,
                MappingProxyType(tiers),
                num_tokens,
                load,
                score,
            ),
        )
        rows.append((-score, num_waiting, usage, pool.name, hit))
    return rows


def _walk(keys: KeyIndexLike, group: _Group) -> list[tuple[int, int]]:
    """The walk of a group: ``(blocks hit, mask of the pools hitting exactly that many)``.

    One pass over the prompt's blocks (:meth:`KeyIndexLike.walk`: compiled where the extension
    is built), intersecting the pools still matching at each block, stopped at the first block
    none of them caches: O(blocks hit), whatever the number of pools.
    """
    max_blocks = min((group.num_tokens - 1) // group.block_size, len(group.raw) // group.hash_size)
    return keys.walk(group.raw, group.hash_size, _GROUP0_SUFFIX, max_blocks, group.mask)


_BITS: Final = bytes.maketrans(b"01", b"\0\1")


def _slots_of(mask: int) -> list[int]:
    """The set bits of ``mask`` (in no set order), found in C: in a dense mask (the pools that
    hit nothing, say) each bit of its binary text made a byte 0 or 1 and selected by
    ``compress``; in a sparse one the text searched for each ``1`` in turn."""
    if mask.bit_count() * 16 > mask.bit_length():
        return list(compress(count(), bin(mask)[:1:-1].encode().translate(_BITS)))
    text = bin(mask)
    last = len(text) - 1  # the character of bit 0
    slots = []
    position = text.find("1", 2)
    while position >= 0:
        slots.append(last - position)
        position = text.find("1", position + 1)
    return slots


def _hit_parts(
    parts: dict[int, tuple[tuple[int, ...], Mapping[str, int]]], num_hit: int, medium: str
) -> tuple[tuple[int, ...], Mapping[str, int]]:
    """``(group_hit_tokens, tier_hit_tokens)`` of an indexed pool's hit, shared by the pools
    of one answer with the same hit (both immutable: a tuple and a read-only mapping)."""
    shared = parts.get(num_hit)
    if shared is None or medium not in shared[1]:
        shared = parts[num_hit] = ((num_hit,), MappingProxyType({medium: num_hit}))
    return shared


_KindSpec: TypeAlias = tuple[list[tuple[int, int]], int, int, _Columns]
"""What :func:`_answer_all` reads of one kind in scope: its group's walk (levels), block size
and prompt length, and the kind's columns."""


def _ranked_all(groups: Iterable[_Group], rows: list[_Row], weight: float) -> tuple[PoolHit, ...]:
    """Every pool answered, best first (:func:`_answer_all`: compiled where the extension is
    built, ``kvcm.core._lookup_index``: no Python-level work per pool, and no object per pool
    but the answer's own)."""
    kinds: list[_KindSpec] = []
    for group in groups:
        for kind, members in group.kinds:
            # A whole kind's columns are kept ready; a part of one is read here.
            columns = kind.columns() if len(members) == len(kind.members) else _columns_of(members)
            kinds.append((group.levels, group.block_size, group.num_tokens, columns))
    return _answer_all(kinds, rows, weight, {}, _hit_parts, PoolHit, PoolLoad)


def _py_answer_all(  # noqa: PLR0917 (the compiled twin's positional signature)
    kinds: list[_KindSpec],
    rows: list[_Row],
    weight: float,
    parts: dict[int, tuple[tuple[int, ...], Mapping[str, int]]],
    hit_parts: Callable[
        [dict[int, tuple[tuple[int, ...], Mapping[str, int]]], int, str],
        tuple[tuple[int, ...], Mapping[str, int]],
    ],
    pool_hit: type[PoolHit],
    pool_load: type[PoolLoad],
) -> tuple[PoolHit, ...]:
    """Every pool answered, best first: a row per pool of each kind (:func:`_py_score_rows`)
    after ``rows`` (the pools the index does not hold), ranked (:func:`_py_ranked`). The
    compiled ``answer_all`` answers the same, sorting C records and making the PoolHits last."""
    for levels, block_size, num_tokens, columns in kinds:
        _py_score_rows(
            rows,
            levels,
            block_size,
            num_tokens,
            weight,
            columns,
            parts,
            hit_parts,
            pool_hit,
            pool_load,
        )
    return _py_ranked(rows)


def _py_score_rows(  # noqa: PLR0917 (the compiled answer_all reads the same values)
    rows: list[_Row],
    levels: list[tuple[int, int]],
    block_size: int,
    num_tokens: int,
    weight: float,
    columns: _Columns,
    parts: dict[int, tuple[tuple[int, ...], Mapping[str, int]]],
    hit_parts: Callable[
        [dict[int, tuple[tuple[int, ...], Mapping[str, int]]], int, str],
        tuple[tuple[int, ...], Mapping[str, int]],
    ],
    pool_hit: type[PoolHit],
    pool_load: type[PoolLoad],
) -> None:
    """Append a row ``(-score, num_waiting, usage, name, PoolHit)`` per pool of one kind's
    ``columns`` (its pools' hits read from the group's walk, ``levels``); pools with the same
    hit share their ``group_hit_tokens`` and ``tier_hit_tokens`` (``parts``, made by
    ``hit_parts``). The compiled ``answer_all`` computes the same."""
    append = rows.append
    new = _new
    hit_of: dict[int, int] = {}  # slot -> hit tokens, pools with a hit only
    for num_blocks, mask in levels:
        if num_blocks:
            num_hit = num_blocks * block_size
            for slot in _slots_of(mask):
                hit_of[slot] = num_hit
    get = hit_of.get
    for slot, queue, running, requests, name, num_usable, medium in zip(*columns, strict=True):
        num_hit = get(slot, 0)
        num_free = queue.num_free_blocks
        usage = 1.0 - num_free / num_usable if num_usable else 0.0
        score = num_hit / num_tokens - weight * usage
        num_running = len(running)
        num_waiting = len(requests) - num_running
        shared = parts.get(num_hit)
        if shared is None or medium not in shared[1]:
            shared = hit_parts(parts, num_hit, medium)
        load = (usage, num_free, num_running, num_waiting if num_waiting > 0 else 0)
        hit = (name, num_hit, shared[0], shared[1], num_tokens, new(pool_load, load), score)
        append((-score, num_waiting, usage, name, new(pool_hit, hit)))


def _py_ranked(rows: list[_Row]) -> tuple[PoolHit, ...]:
    """The rows' answers, best first: by ``(-score, num_waiting, usage, name)``, in stable
    passes, least significant key first: each sorts one float, int or str column (specialized
    comparisons), where one pass over whole rows compares tuples element by element. The
    compiled ``answer_all`` sorts the same keys in one pass."""
    for column in _RANK_COLUMNS:
        rows.sort(key=column)
    return tuple(map(_ANSWER, rows))


def _top(
    groups: Iterable[_Group],
    slots: Sequence[_Member | None],
    rows: list[tuple[Any, ...]],
    weight: float,
    limit: int,
) -> tuple[PoolHit, ...]:
    """The best ``limit`` pools; pools that cannot enter the top are never scored.

    A pool's score is at most its hit fraction (usage >= 0), so levels are expanded from the
    deepest hit fraction down, and the expansion stops once the ``limit``-th best score is
    above the next level's hit fraction.
    """
    levels = sorted(
        (
            (num_blocks * group.block_size / group.num_tokens, num_blocks, mask, group)
            for group in groups
            for num_blocks, mask in group.levels
        ),
        key=_FIRST,
        reverse=True,
    )
    # Candidates are ranked on keys read once (an indexed pool's row holds None where a
    # PoolHit goes, then what makes it); only the winners' PoolHits are made.
    for bound, num_blocks, mask, group in levels:
        if len(rows) >= limit:
            rows = heapq.nsmallest(limit, rows)
            if -rows[-1][0] > bound:
                break
        num_hit = num_blocks * group.block_size
        level = _slots_of(mask)
        if 2 * len(level) > len(group.members) >= _COLUMNS_FROM:
            rows.extend(_level_rows(group, set(level), bound, num_hit, weight))
            continue
        append = rows.append
        for member in map(slots.__getitem__, level):
            assert member is not None
            num_free = member.free_queue.num_free_blocks
            num_usable = member.num_usable
            usage = 1.0 - num_free / num_usable if num_usable else 0.0
            score = bound - weight * usage  # bound: num_hit / num_tokens
            num_running = len(member.running)
            num_waiting = len(member.requests) - num_running
            append(
                (
                    -score,
                    num_waiting,
                    usage,
                    member.name,
                    None,
                    member.medium,
                    num_hit,
                    group.num_tokens,
                    num_free,
                    num_running,
                )
            )
    parts: dict[int, tuple[tuple[int, ...], Mapping[str, int]]] = {}
    return tuple(_top_answer(row, parts) for row in heapq.nsmallest(limit, rows))


_COLUMNS_FROM: Final = 16
"""Groups of this many pools or more score a level holding most of them from the kinds'
columns (:func:`_level_rows`)."""


def _level_rows(
    group: _Group, level: set[int], bound: float, num_hit: int, weight: float
) -> list[tuple[Any, ...]]:
    """:func:`_top`'s rows for the pools of a level holding most of a group (the pools that hit
    nothing, when fewer pools hit than asked for: a cold prompt's top is filled from them),
    read from the kinds' columns (kept ready for a whole kind): no member object is visited,
    and one comprehension makes every row. Computes what :func:`_top`'s loop does. Indexed
    pools have usable blocks (:meth:`PrefixIndex.reserve`), so the usage needs no zero test."""
    rows: list[tuple[Any, ...]] = []
    num_tokens = group.num_tokens
    for kind, members in group.kinds:
        columns = kind.columns() if len(members) == len(kind.members) else _columns_of(members)
        slots, queues, running, requests, names, usable, media = columns
        rows += [
            (
                -(bound - weight * (usage := 1.0 - (num_free := queue.num_free_blocks) / n)),
                len(tracked) - (num_running := len(held)),
                usage,
                name,
                None,
                medium,
                num_hit,
                num_tokens,
                num_free,
                num_running,
            )
            for slot, queue, held, tracked, name, n, medium in zip(
                slots, queues, running, requests, names, usable, media, strict=True
            )
            if slot in level
        ]
    return rows


def _top_answer(
    row: tuple[Any, ...], parts: dict[int, tuple[tuple[int, ...], Mapping[str, int]]]
) -> PoolHit:
    """The PoolHit of a ranked row: a direct row's own, or made from what an indexed pool's
    row read (the same reads the row was ranked on)."""
    hit: PoolHit | None = row[4]
    if hit is not None:
        return hit
    neg_score, num_waiting, usage, name, _, medium, num_hit, num_tokens, num_free, num_running = row
    groups, tiers = _hit_parts(parts, num_hit, medium)
    load = _new(PoolLoad, (usage, num_free, num_running, num_waiting if num_waiting > 0 else 0))
    return _new(PoolHit, (name, num_hit, groups, tiers, num_tokens, load, -neg_score))


_ANSWER = itemgetter(4)
_NAME = attrgetter("name")
_SLOT = attrgetter("slot")
_FREE_QUEUE = attrgetter("free_queue")
_RUNNING = attrgetter("running")
_REQUESTS = attrgetter("requests")
_NUM_USABLE = attrgetter("num_usable")
_MEDIUM = attrgetter("medium")
_RANK_COLUMNS = (itemgetter(3), itemgetter(2), itemgetter(1), itemgetter(0))

# The compiled answer's loops where the extension is built (tests switch both ways).
_answer_all: Callable[..., tuple[PoolHit, ...]] = (
    _py_answer_all if NATIVE is None else NATIVE.answer_all
)
_FIRST = itemgetter(0)


def _in_scope_order(
    pools: Sequence[Pool], skipped: list[tuple[Pool, str]]
) -> tuple[tuple[str, str], ...]:
    if not skipped:
        return ()
    position = {id(pool): index for index, pool in enumerate(pools)}
    skipped.sort(key=lambda item: position[id(item[0])])
    return tuple((pool.name, reason) for pool, reason in skipped)
