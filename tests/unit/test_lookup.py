"""Exact lookup across pools (kvcm.core.lookup): answers equal each pool's own lookup."""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import threading

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import InvalidArgumentError, NotFoundError
from kvcm.common.hashing import BlockHasher, HashAlgorithm, MultiModalFeature
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvcm.core import _key_index
from kvcm.core import lookup as lookup_module
from kvcm.core.block import FreeKVCacheBlockQueue
from kvcm.core.lookup import LookupQuery, PoolHit, PoolLoad, PrefixIndex
from kvcm.core.pool import Pool, PoolConfig, PoolRegistry
from kvcm.core.program import HitSpec
from kvcm.core.request import Request
from kvcm.core.snapshot import decode_pool, encode_pool

COMMON = {"num_kv_heads": 2, "head_size": 64, "dtype": DType.BFLOAT16}


@pytest.fixture(autouse=True, params=["compiled", "python"])
def key_index(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs against both implementations (kvcm.core._key_index): the compiled key
    index and answer loops, which must be built (``pip install -e .`` builds them;
    KVCM_PURE_PYTHON=1 skips their runs where no compiler is at hand), and the pure-Python
    fallback."""
    if request.param == "compiled":
        if _key_index.COMPILED is None:
            if os.environ.get("KVCM_PURE_PYTHON") == "1":
                pytest.skip("KVCM_PURE_PYTHON=1: the compiled key index is not built")
            pytest.fail("kvcm.core._lookup_index is not built (pip install -e . builds it)")
        assert _key_index.NATIVE is not None
        monkeypatch.setattr(lookup_module, "KeyIndex", _key_index.COMPILED)
        monkeypatch.setattr(lookup_module, "_answer_all", _key_index.NATIVE.answer_all)
    else:
        monkeypatch.setattr(lookup_module, "KeyIndex", _key_index.PyKeyIndex)
        monkeypatch.setattr(lookup_module, "_answer_all", lookup_module._py_answer_all)
    return str(request.param)


def _layout(specs: list[KVCacheSpec], num_blocks: int) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=tuple(
            KVCacheGroupSpec(layer_names=(f"l{i}",), kv_cache_spec=spec)
            for i, spec in enumerate(specs)
        ),
    )


def _full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, **COMMON)  # type: ignore[arg-type]


def _swa(block_size: int = 4, window: int = 8) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, sliding_window=window, **COMMON)  # type: ignore[arg-type]


def _create(
    registry: PoolRegistry,
    name: str,
    specs: list[KVCacheSpec],
    *,
    num_blocks: int = 48,
    labels: dict[str, str] | None = None,
    **options: object,
) -> Pool:
    config = PoolConfig(
        max_model_len=512,
        explicit_layout=_layout(specs, num_blocks),
        labels=labels or {},
        **options,  # type: ignore[arg-type]
    )
    return registry.create(name, config)


def _hashes(pool: Pool, tokens: list[int], **extra: object) -> list[bytes]:
    hashing = pool.hashing
    hasher = BlockHasher(hashing.hash_block_size, hashing.algorithm, hashing.seed)
    return list(hasher.hash_token_ids(tokens, **extra))  # type: ignore[arg-type]


def _own_hit(pool: Pool, tokens: list[int], **extra: object) -> int:
    """The pool's own get_computed_blocks for a probe request (read-only)."""
    assert pool.manager is not None
    request = Request("probe", tokens, **extra)  # type: ignore[arg-type]
    request.block_hashes = _hashes(pool, tokens, **extra)
    return pool.manager.get_computed_blocks(request).num_computed_tokens


def _serve(pool: Pool, key: int, tokens: list[int], *, finish: bool = True) -> None:
    hashes = b"".join(_hashes(pool, tokens)) if pool.options.enable_caching else b""
    pool.add_request(key, f"r{key}", tokens, hashes)
    hit = pool.get_computed_blocks(key, None)
    found = HitSpec(num_tokens=hit.num_computed_tokens, block_ids=hit.blocks.get_block_ids())
    if pool.allocate(key, len(tokens) - hit.num_computed_tokens, 0, hit=found) is None:
        pool.free(key, preempt=False)
        return
    if finish:
        pool.free(key, preempt=False)


def _by_pool(hits: tuple[PoolHit, ...]) -> dict[str, int]:
    return {hit.pool_id: hit.num_hit_tokens for hit in hits}


def test_randomized_answers_equal_each_pools_own_lookup() -> None:
    rng = random.Random(11)
    registry = PoolRegistry()
    kinds = [
        lambda name: _create(registry, name, [_full()]),
        lambda name: _create(registry, name, [_full()], num_blocks=12),  # evicts a lot
        lambda name: _create(registry, name, [_full(8)]),
        lambda name: _create(registry, name, [_full(), _swa()], scheduler_block_size=4),
        lambda name: _create(registry, name, [_full()], hash_algorithm=HashAlgorithm.XXHASH),
        lambda name: _create(registry, name, [_full()], enable_caching=False),
    ]
    pools = [kinds[i % len(kinds)](f"p{i}") for i in range(30)]
    documents = [[rng.randrange(1000) for _ in range(rng.randrange(8, 120))] for _ in range(12)]
    for key in range(1, 401):
        pool = rng.choice(pools)
        prompt = rng.choice(documents)[: rng.randrange(1, 120)] + [
            rng.randrange(1000) for _ in range(rng.randrange(0, 9))
        ]
        _serve(pool, key, prompt, finish=rng.random() < 0.8)
        if rng.random() < 0.02 and pool.manager is not None:
            for held in list(pool.requests):
                pool.free(held, preempt=False)
            assert pool.manager.reset_prefix_cache()
        if key % 20 == 0:
            probe = rng.choice(documents)[: rng.randrange(1, 120)]
            result = registry.lookup(LookupQuery(token_ids=probe))
            assert result.num_pools_in_scope == len(pools)
            assert not result.skipped
            assert _by_pool(result.pools) == {p.name: _own_hit(p, probe) for p in pools}
    assert registry.index.num_pools == 20  # the full-attention, caching pools


def test_ranking_scope_labels_and_load() -> None:
    registry = PoolRegistry()
    a = _create(registry, "a", [_full()], labels={"role": "prefill", "model": "m"})
    b = _create(registry, "b", [_full()], labels={"role": "decode", "model": "m"})
    c = _create(registry, "c", [_full()], labels={"role": "prefill", "model": "other"})
    prompt = list(range(40))
    _serve(a, 1, prompt[:17])
    _serve(b, 2, prompt)
    _serve(c, 3, prompt)
    _serve(c, 4, list(range(500, 540)), finish=False)  # c is busier
    result = registry.lookup(LookupQuery(token_ids=prompt, load_weight=0.0))
    assert [(h.pool_id, h.num_hit_tokens) for h in result.pools] == [
        ("b", 36),
        ("c", 36),
        ("a", 16),
    ]
    assert result.pools[1].load.num_running == 1
    assert result.pools[0].load.num_running == 0
    assert result.pools[0].tier_hit_tokens == {"GPU": 36}
    assert result.pools[0].group_hit_tokens == (36,)
    assert result.pools[0].score == pytest.approx(36 / 40)
    weighted = registry.lookup(LookupQuery(token_ids=prompt, load_weight=10.0))
    assert weighted.pools[0].pool_id == "b"
    assert weighted.pools[-1].pool_id == "c"  # the busy pool ranks last
    prefill = registry.lookup(LookupQuery(token_ids=prompt, labels={"role": "prefill"}))
    assert sorted(h.pool_id for h in prefill.pools) == ["a", "c"]
    both = registry.lookup(
        LookupQuery(token_ids=prompt, labels={"role": "prefill", "model": "m"}, max_results=5)
    )
    assert [h.pool_id for h in both.pools] == ["a"]
    listed = registry.lookup(LookupQuery(token_ids=prompt, pool_ids=["c", "a"], max_results=1))
    assert [h.pool_id for h in listed.pools] == ["c"]
    assert listed.num_pools_in_scope == 2
    with pytest.raises(NotFoundError, match=r"scope.pool_ids\[1\]"):
        registry.lookup(LookupQuery(token_ids=prompt, pool_ids=["a", "nope"]))


def test_every_pool_answer_breaks_ties_by_name_and_outlives_collections(key_index: str) -> None:
    """Most pools of an every-pool answer tie on score, waiting and usage: the name decides,
    whether the names reach the ranking sorted (a whole kind) or not (a listed scope, two
    kinds, pools answered by their own coordinator). The compiled answer's records are left
    out of the cyclic collector (they can be in no cycle): a full collection keeps them whole."""
    registry = PoolRegistry()
    rng = random.Random(5)
    names = [f"p{index:02d}" for index in range(40)]
    rng.shuffle(names)
    pools = {}
    for index, name in enumerate(names):
        block_size = 4 if index % 3 else 8  # two kinds
        pools[name] = _create(registry, name, [_full(block_size)])
    for name in ("s1", "s0"):  # answered by their own coordinator (not indexed)
        pools[name] = _create(registry, name, [_full(), _swa()])
    prompt = list(range(64))
    for key, name in enumerate(sorted(pools)[::5]):
        _serve(pools[name], key, prompt[: 16 + key])
    expected_hits = {name: _own_hit(pool, prompt) for name, pool in pools.items()}
    one_kind = sorted(names[::3])  # the pools of block size 8, the whole kind: names sorted
    scopes: list[list[str]] = [[], one_kind, sorted(names, reverse=True), names[:7]]
    for scope in scopes:
        answer = registry.lookup(LookupQuery(token_ids=prompt, pool_ids=scope, load_weight=0.0))
        hits = answer.pools
        assert {hit.pool_id for hit in hits} == set(scope or pools)
        assert _by_pool(hits) == {name: expected_hits[name] for name in scope or pools}
        assert [hit.pool_id for hit in hits] == sorted(
            (hit.pool_id for hit in hits), key=lambda name: (-expected_hits[name], name)
        )
        gc.collect()
        assert [hit.num_tokens for hit in hits] == [64] * len(hits)
        assert all(type(hit.load) is PoolLoad and hit.load.num_running == 0 for hit in hits)
        if key_index == "compiled":
            indexed = [hit for hit in hits if not hit.pool_id.startswith("s")]
            assert indexed
            assert not any(gc.is_tracked(hit) for hit in indexed)
            assert gc.is_tracked(hits) == any(hit.pool_id.startswith("s") for hit in hits)


_FREE_SLOT = FreeKVCacheBlockQueue.__dict__["num_free_blocks"]


class _PropertyQueue(FreeKVCacheBlockQueue):
    """A free queue whose count is a property: the compiled answer reads a queue's count from
    its slot where the type keeps it in one (borrowed, referenced a few pools later) and
    through getattr otherwise, which may run Python code."""

    __slots__ = ()
    reads = 0
    fail = False

    @property  # type: ignore[override]
    def num_free_blocks(self) -> int:
        if _PropertyQueue.fail:
            raise RuntimeError("free count unreadable")
        _PropertyQueue.reads += 1
        value: int = _FREE_SLOT.__get__(self, FreeKVCacheBlockQueue)
        return value

    @num_free_blocks.setter
    def num_free_blocks(self, value: int) -> None:
        _FREE_SLOT.__set__(self, value)


def test_every_pool_loads_equal_each_pools_own_whatever_its_queue_type() -> None:
    """Every pool answered: each pool's load is its own free count and tables, whether its
    queue keeps the count in a slot or answers it through a property (mixed within one kind,
    so the compiled loop switches between its two reads), with requests left running; a
    count that cannot be read fails the lookup and leaves the next one whole."""
    registry = PoolRegistry()
    rng = random.Random(11)
    pools = [_create(registry, f"q{index:02d}", [_full()]) for index in range(30)]
    for index, pool in enumerate(pools):
        assert pool.manager is not None
        if index % 3 == 1 or index in (20, 21, 22, 23):
            pool.manager.block_pool.free_block_queue.__class__ = _PropertyQueue
    prompt = list(range(48))
    for key in range(60):
        pool = rng.choice(pools)
        _serve(pool, key, prompt[: rng.randrange(4, 48)], finish=rng.random() < 0.6)
    _PropertyQueue.reads = 0
    try:
        for weight in (0.0, 0.5):
            answer = registry.lookup(LookupQuery(token_ids=prompt, load_weight=weight))
            assert [hit.pool_id for hit in answer.pools] != []
            for hit in answer.pools:
                pool = registry.get(hit.pool_id)
                assert pool.manager is not None
                block_pool = pool.manager.block_pool
                running = pool.manager.coordinator.single_type_managers[0].req_to_blocks
                assert hit.num_hit_tokens == _own_hit(pool, prompt)
                assert hit.load.num_free_blocks == block_pool.get_num_free_blocks()
                assert hit.load.usage == block_pool.get_usage()
                assert hit.load.num_running == len(running)
                assert hit.load.num_waiting == len(pool.requests) - len(running)
        assert _PropertyQueue.reads >= 2 * 14
        _PropertyQueue.fail = True
        with pytest.raises(RuntimeError, match="free count unreadable"):
            registry.lookup(LookupQuery(token_ids=prompt))
    finally:
        _PropertyQueue.fail = False
    again = registry.lookup(LookupQuery(token_ids=prompt, load_weight=0.5))
    assert again.pools == answer.pools


def test_hash_prompts_lora_salt_and_multimodal_keys() -> None:
    registry = PoolRegistry()
    pool = _create(registry, "p", [_full()])
    _create(registry, "x", [_full()], hash_algorithm=HashAlgorithm.XXHASH)
    prompt = list(range(33))
    extra = {
        "lora_name": "adapter",
        "cache_salt": "tenant-a",
        "mm_features": [MultiModalFeature("img", 4, 6)],
    }
    pool.add_request(1, "r1", prompt, b"".join(_hashes(pool, prompt, **extra)), lora_name="adapter")
    assert pool.allocate(1, 33, 0) is not None
    plain = registry.lookup(LookupQuery(token_ids=prompt, pool_ids=["p"]))
    assert plain.pools[0].num_hit_tokens == 0  # other keys: other hashes
    keyed = registry.lookup(LookupQuery(token_ids=prompt, pool_ids=["p"], **extra))  # type: ignore[arg-type]
    assert keyed.pools[0].num_hit_tokens == 32
    raw = b"".join(_hashes(pool, prompt, **extra))
    by_hash = registry.lookup(LookupQuery(block_hashes=raw, num_tokens=33))
    assert _by_pool(by_hash.pools) == {"p": 32}
    # Read as 16-byte xxhash hashes, the same bytes are twice as many blocks.
    assert by_hash.skipped == (("x", "16 block hashes of 4 tokens exceed num_tokens 33"),)
    odd = registry.lookup(LookupQuery(block_hashes=raw[:-8]))
    assert {pool_id for pool_id, _ in odd.skipped} == {"p", "x"}
    assert "whole number of 32-byte hashes" in dict(odd.skipped)["p"]
    # Without num_tokens every hashed block may hit.
    assert registry.lookup(LookupQuery(block_hashes=raw, pool_ids=["p"])).pools[0].num_tokens == 33
    too_long = registry.lookup(LookupQuery(token_ids=list(range(600)), pool_ids=["p"]))
    assert too_long.skipped == (("p", "prompt of 600 tokens exceeds max_model_len 512"),)


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({}, "prompt"),
        ({"token_ids": [1], "block_hashes": b"x" * 32}, "prompt"),
        ({"token_ids": []}, "tokens.token_ids"),
        ({"block_hashes": b""}, "hashes.block_hashes"),
        ({"token_ids": [1], "num_tokens": 4}, "hashes.num_tokens"),
        ({"token_ids": [1], "load_weight": float("nan")}, "load_weight"),
        ({"token_ids": [1], "load_weight": -1.0}, "load_weight"),
        ({"token_ids": [1], "max_results": -1}, "max_results"),
        ({"token_ids": [1], "pool_ids": [""]}, r"scope.pool_ids\[0\]"),
        ({"token_ids": [1], "labels": {"bad key": "v"}}, "scope.labels"),
    ],
)
def test_bad_queries_name_the_field(query: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        LookupQuery(**query)  # type: ignore[arg-type]


def test_labels_are_checked_and_kept() -> None:
    with pytest.raises(InvalidArgumentError, match=r"config\.labels"):
        PoolConfig(max_model_len=8, world_size=1, labels={"": "x"})
    with pytest.raises(InvalidArgumentError, match=r"config\.labels"):
        PoolConfig(max_model_len=8, world_size=1, labels={f"k{i}": "v" for i in range(33)})
    with pytest.raises(InvalidArgumentError, match=r"config\.labels"):
        PoolConfig(max_model_len=8, world_size=1, labels={"k": "line\nbreak"})
    config = PoolConfig(max_model_len=8, world_size=1, labels={"role": "decode", "model": "m"})
    assert dict(config.labels) == {"model": "m", "role": "decode"}


def test_index_follows_delete_reset_restore_and_pending_pools() -> None:
    registry = PoolRegistry()
    pool = _create(registry, "p", [_full()])
    prompt = list(range(20))
    _serve(pool, 1, prompt)
    assert registry.lookup(LookupQuery(token_ids=prompt)).pools[0].num_hit_tokens == 16
    assert len(registry.index) == 5  # 20 tokens: five 4-token blocks
    saved = encode_pool(pool)
    assert pool.manager is not None
    assert pool.manager.reset_prefix_cache()
    assert len(registry.index) == 0
    assert registry.lookup(LookupQuery(token_ids=prompt)).pools[0].num_hit_tokens == 0
    # The pool replaced by a restored incarnation (ResyncPool, recovery) is indexed afresh.
    registry.delete("p")
    assert registry.index.num_pools == 0
    registry.reserve("p", pool.options)
    registry.add(decode_pool(saved, "p", pool.options))
    assert registry.lookup(LookupQuery(token_ids=prompt)).pools[0].num_hit_tokens == 16
    assert len(registry.index) == 5
    registry.delete("p")
    assert len(registry.index) == 0
    assert registry.index.num_pools == 0
    # A pool planned later (workers register) is indexed on its first lookup.
    pending = registry.create("q", PoolConfig(max_model_len=64, world_size=1))
    result = registry.lookup(LookupQuery(token_ids=prompt))
    assert result.pools == ()
    assert result.skipped == (("q", "not ready: workers have not registered"),)
    assert pending.manager is None


def test_concurrent_pools_keep_the_index_exact() -> None:
    """Pools run in worker threads (a Step's lane) change the shared index concurrently."""
    registry = PoolRegistry()
    pools = [_create(registry, f"p{i}", [_full()], num_blocks=20) for i in range(8)]
    registry.lookup(LookupQuery(token_ids=[1]))  # index them all
    documents = [list(range(d * 1000, d * 1000 + 64)) for d in range(6)]

    def drive(pool: Pool, seed: int) -> None:
        rng = random.Random(seed)
        for key in range(300):
            _serve(pool, key, rng.choice(documents)[: rng.randrange(4, 64)])

    threads = [threading.Thread(target=drive, args=(p, i)) for i, p in enumerate(pools)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected: dict[bytes, int] = {}
    for slot, pool in enumerate(pools):
        assert pool.manager is not None
        for key in pool.manager.block_pool.cached_block_ids():
            expected[key] = expected.get(key, 0) | (1 << slot)
    keys = registry.index._keys
    assert len(keys) == len(expected)
    assert all(keys.get(key) == mask for key, mask in expected.items())
    for document in documents:
        result = registry.lookup(LookupQuery(token_ids=document))
        assert _by_pool(result.pools) == {p.name: _own_hit(p, document) for p in pools}


def test_index_slots_are_reused() -> None:
    index = PrefixIndex()
    registry = PoolRegistry()
    first = _create(registry, "a", [_full()])
    second = _create(registry, "b", [_full()])
    assert (index.slot(first), index.slot(second)) == (0, 1)
    index.remove("a")
    third = _create(registry, "c", [_full()])
    assert index.slot(third) == 0
    assert index.slot(_create(registry, "h", [_full(), _swa()], scheduler_block_size=4)) is None


def test_a_lent_pool_is_not_indexed_until_it_is_back() -> None:
    """A pool lent to a worker thread (a long Step) changes meanwhile: its keys are not copied
    into the index then; the lookup answers it as busy, and indexes it once it is back."""
    registry = PoolRegistry()
    pool = _create(registry, "p", [_full()])
    _serve(pool, 1, list(range(20)))
    pool.lent = True
    answer = registry.lookup(LookupQuery(token_ids=list(range(20))))
    assert answer.skipped == (("p", "busy: a long call is running on it"),)
    assert registry.index.num_pools == 0
    pool.lent = False
    assert registry.lookup(LookupQuery(token_ids=list(range(20)))).pools[0].num_hit_tokens == 16
    assert registry.index.num_pools == 1


def test_token_prompts_hashed_for_too_many_seeds_are_refused() -> None:
    """xxhash pools draw a seed each, so a prompt is hashed once per pool: beyond
    MAX_LOOKUP_HASH_WORK block hashes the lookup is refused before hashing anything."""
    from kvcm.common.errors import ResourceExhaustedError
    from kvcm.core.lookup import MAX_LOOKUP_HASH_WORK, MAX_LOOKUP_TOKENS

    registry = PoolRegistry()
    for index in range(5):
        registry.create(
            f"x{index}",
            PoolConfig(
                max_model_len=MAX_LOOKUP_TOKENS,
                explicit_layout=_layout([_full()], 16),
                hash_algorithm=HashAlgorithm.XXHASH,
            ),
        )
    prompt = [1] * MAX_LOOKUP_TOKENS
    assert 5 * MAX_LOOKUP_TOKENS // 4 > MAX_LOOKUP_HASH_WORK
    with pytest.raises(ResourceExhaustedError, match="narrow the scope"):
        registry.lookup(LookupQuery(token_ids=prompt))
    # One pool's worth is fine (a prompt of 4M tokens: 1M hashes of 4 tokens).
    answer = registry.lookup(LookupQuery(token_ids=prompt[:400_000], pool_ids=["x0"]))
    assert answer.pools[0].num_hit_tokens == 0


def _brute_force(
    pools: list[Pool], prompt: list[int], weight: float, limit: int
) -> list[tuple[object, ...]]:
    """The answer by definition: each pool's own hit and load, scored and ranked one by one."""
    rows = []
    for pool in pools:
        assert pool.manager is not None
        num_hit = _own_hit(pool, prompt)
        block_pool = pool.manager.block_pool
        usage = block_pool.get_usage()
        score = num_hit / len(prompt) - weight * usage
        num_running = len(pool.manager.coordinator.single_type_managers[0].req_to_blocks)
        num_waiting = len(pool.requests) - num_running
        load = PoolLoad(usage, block_pool.get_num_free_blocks(), num_running, max(0, num_waiting))
        rows.append(((-score, num_waiting, usage, pool.name), (pool.name, num_hit, load, score)))
    rows.sort(key=lambda row: row[0])
    return [row[1] for row in rows[: limit or None]]


def test_property_answers_equal_a_brute_force_ranking() -> None:
    """Randomized workloads (evictions by id and by allocation, resets, deletes and
    re-creations under the same name with another kind, labels): every answer, all pools or
    the best k, whole or partial scopes, equals the ranking computed pool by pool from each
    pool's own get_computed_blocks and load, ties included."""
    rng = random.Random(26)
    registry = PoolRegistry()
    kinds = [
        lambda name, labels: _create(registry, name, [_full()], labels=labels),
        lambda name, labels: _create(registry, name, [_full()], num_blocks=10, labels=labels),
        lambda name, labels: _create(registry, name, [_full(8)], labels=labels),
        lambda name, labels: _create(
            registry, name, [_full(), _swa()], scheduler_block_size=4, labels=labels
        ),
        lambda name, labels: _create(
            registry, name, [_full()], hash_algorithm=HashAlgorithm.XXHASH, labels=labels
        ),
        lambda name, labels: _create(
            registry, name, [_full()], enable_caching=False, labels=labels
        ),
    ]
    names = [f"p{i:02d}" for i in range(24)]

    def make(name: str) -> Pool:
        labels = {"role": rng.choice(["prefill", "decode"])}
        return rng.choice(kinds[:3] if rng.random() < 0.7 else kinds)(name, labels)

    pools = {name: make(name) for name in names}
    documents = [[rng.randrange(500) for _ in range(rng.randrange(8, 100))] for _ in range(6)]
    for key in range(1, 601):
        pool = pools[rng.choice(names)]
        prompt = rng.choice(documents)[: rng.randrange(1, 100)] + [
            rng.randrange(500) for _ in range(rng.randrange(0, 6))
        ]
        _serve(pool, key, prompt, finish=rng.random() < 0.7)
        roll = rng.random()
        if roll < 0.03:  # a pool deleted and re-created (maybe of another kind)
            name = rng.choice(names)
            registry.delete(name)
            pools[name] = make(name)
        elif roll < 0.08 and pool.manager is not None:  # evictions by block id
            pool.evict_blocks(rng.sample(range(1, pool.manager.block_pool.num_gpu_blocks), 4))
        elif roll < 0.09 and pool.manager is not None:
            for held in list(pool.requests):
                pool.free(held, preempt=False)
            assert pool.manager.reset_prefix_cache()
        if key % 10:
            continue
        probe = rng.choice(documents)[: rng.randrange(2, 100)]
        weight = rng.choice([0.0, 0.5, 3.0])
        limit = rng.choice([0, 1, 3, 5, 30])
        scope = rng.random()
        if scope < 0.5:
            query = LookupQuery(token_ids=probe, load_weight=weight, max_results=limit)
            chosen = [pools[name] for name in names]
        elif scope < 0.8:
            picked = rng.sample(names, rng.randrange(1, len(names)))
            query = LookupQuery(
                token_ids=probe, pool_ids=picked, load_weight=weight, max_results=limit
            )
            chosen = [pools[name] for name in picked]
        else:
            role = rng.choice(["prefill", "decode"])
            query = LookupQuery(
                token_ids=probe, labels={"role": role}, load_weight=weight, max_results=limit
            )
            chosen = [pools[n] for n in names if pools[n].options.labels["role"] == role]
        answer = registry.lookup(query)
        got = [(h.pool_id, h.num_hit_tokens, h.load, h.score) for h in answer.pools]
        assert got == _brute_force(chosen, probe, weight, limit)
        assert answer.skipped == ()
        assert answer.num_pools_in_scope == len(chosen)
        for hit in answer.pools:
            assert hit.num_tokens == len(probe)
            assert hit.tier_hit_tokens == {"GPU": hit.num_hit_tokens}
            if len(hit.group_hit_tokens) == 1:
                assert hit.group_hit_tokens == (hit.num_hit_tokens,)
        # The same prompt already hashed, over the pools sharing the first pool's hashing.
        first = chosen[0]
        alike = [p for p in chosen if p.hashing == first.hashing]
        raw = b"".join(_hashes(first, probe))
        hashed = registry.lookup(
            LookupQuery(
                block_hashes=raw,
                num_tokens=len(probe),
                pool_ids=[p.name for p in alike],
                load_weight=weight,
                max_results=limit,
            )
        )
        got = [(h.pool_id, h.num_hit_tokens, h.load, h.score) for h in hashed.pools]
        assert got == _brute_force(alike, probe, weight, limit)
    # Everything left indexed is exactly the indexed pools' caches.
    expected: dict[bytes, int] = {}
    for pool in pools.values():
        slot = registry.index.slot(pool)
        if slot is not None:
            assert pool.manager is not None
            for cache_key in pool.manager.block_pool.cached_block_ids():
                expected[cache_key] = expected.get(cache_key, 0) | 1 << slot
    keys = registry.index._keys
    assert len(keys) == len(expected)
    assert all(keys.get(key) == mask for key, mask in expected.items())


def test_packed_answers_decode_to_the_same_answer() -> None:
    """The packed wire form (columns) decodes to the answer the PoolHit messages give, for an
    answer mixing single- and multi-group pools, an empty one, and a misaligned one refused."""
    from kvcm.core.lookup import LookupAnswer
    from kvcm.v1 import lookup_pb2
    from kvcm.wire.lookup import lookup_result_from_proto, lookup_result_to_proto

    registry = PoolRegistry()
    full = _create(registry, "full", [_full()])
    hybrid = _create(registry, "hybrid", [_full(), _swa()], scheduler_block_size=4)
    _create(registry, "idle", [_full()])
    prompt = list(range(30))
    _serve(full, 1, prompt, finish=False)
    _serve(hybrid, 2, prompt)
    answer = registry.lookup(LookupQuery(token_ids=prompt))
    assert len(answer.pools) == 3
    assert {len(hit.group_hit_tokens) for hit in answer.pools} == {1, 2}
    two_tiers = LookupAnswer(
        (
            PoolHit("a", 8, (8,), {"GPU": 8, "CPU": 12}, 20, PoolLoad(0.5, 3, 1, 0), 0.1),
            PoolHit("b", 4, (4,), {"GPU": 4}, 20, PoolLoad(0.0, 9, 0, 2), 0.2),
        ),
        (),
        2,
    )
    single = registry.lookup(LookupQuery(token_ids=prompt, pool_ids=["full", "idle"]))
    compact = lookup_result_to_proto(single, packed=True).packed
    # One group and one tier per pool, equal to the hit: neither column is sent.
    assert (list(compact.num_groups), list(compact.group_hit_tokens)) == ([], [])
    assert (list(compact.num_tiers), list(compact.tier)) == ([], ["GPU"])
    for result in (answer, single, two_tiers, LookupAnswer((), (("x", "busy"),), 1)):
        packed = lookup_result_to_proto(result, packed=True)
        assert not packed.pools
        assert packed.HasField("packed")
        wire = lookup_pb2.LookupResponse.FromString(packed.SerializeToString())
        assert lookup_result_from_proto(wire) == result
        plain = lookup_result_from_proto(lookup_result_to_proto(result))
        assert plain == result
    for damage in (
        lambda packed: packed.num_waiting.pop(),
        lambda packed: packed.num_groups.pop(),
        lambda packed: packed.tier.append("CPU"),
    ):
        broken = lookup_result_to_proto(answer, packed=True)
        damage(broken.packed)
        with pytest.raises(InvalidArgumentError, match="packed"):
            lookup_result_from_proto(broken)


def test_long_hash_prompts_are_walked_past_the_split_chunks() -> None:
    """Hash prompts are split 256 blocks at a time as the walk reads them: hits that end on,
    just past and far beyond a chunk's edge equal the pool's own answer."""
    registry = PoolRegistry()
    pool = registry.create(
        "long", PoolConfig(max_model_len=8192, explicit_layout=_layout([_full()], 700))
    )
    cached = list(range(600 * 4))  # 600 blocks of 4 tokens
    _serve(pool, 1, cached)
    for num_shared in (0, 1, 255, 256, 257, 512, 599, 600):
        probe = cached[: num_shared * 4] + [100_000 + i for i in range(40)]
        raw = b"".join(_hashes(pool, probe))
        answer = registry.lookup(LookupQuery(block_hashes=raw, num_tokens=len(probe)))
        assert answer.pools[0].num_hit_tokens == _own_hit(pool, probe) == num_shared * 4


def test_pools_leaving_the_walk_at_and_across_chunk_edges() -> None:
    """Many pools whose hits end around the walk's 256-block chunks (some with holes from
    evictions) answer what each pool's own lookup does, for hash and token prompts, whole
    answers and best k."""
    rng = random.Random(26)
    registry = PoolRegistry()
    cached = list(range(700 * 4))  # 700 blocks of 4 tokens
    pools = []
    for index, num_blocks in enumerate((0, 1, 255, 256, 257, 300, 511, 512, 513, 600, 700)):
        pool = registry.create(
            f"p{index:02d}",
            PoolConfig(max_model_len=8192, explicit_layout=_layout([_full()], 800)),
        )
        if num_blocks:
            _serve(pool, 1, [*cached[: num_blocks * 4], 7])
        pools.append(pool)
    assert registry.lookup(LookupQuery(token_ids=[1, 2, 3, 4, 5])).pools  # indexes them all
    for pool in pools[5:]:
        assert pool.manager is not None
        pool.evict_blocks(rng.sample(range(1, pool.manager.block_pool.num_gpu_blocks), 3))
    for num_shared in (1, 255, 256, 257, 299, 512, 513, 650, 700):
        probe = cached[: num_shared * 4] + [100_000 + i for i in range(6)]
        expected = {pool.name: _own_hit(pool, probe) for pool in pools}
        raw = b"".join(_hashes(pools[0], probe))
        for query in (
            LookupQuery(block_hashes=raw, num_tokens=len(probe)),
            LookupQuery(token_ids=probe),
        ):
            answer = registry.lookup(query)
            assert {hit.pool_id: hit.num_hit_tokens for hit in answer.pools} == expected
            best = registry.lookup(dataclasses.replace(query, max_results=3))
            assert best.pools == answer.pools[:3]


def test_unindexed_names_the_pools_a_lookup_would_index() -> None:
    """PrefixIndex.unindexed: the scope's pools not indexed yet, in order; none once a lookup
    indexed them all (the same list again is recognized by identity), a new pool again."""
    registry = PoolRegistry()
    pools = [_create(registry, f"p{i}", [_full()]) for i in range(3)]
    swa = _create(registry, "swa", [_full(), _swa()])  # answered by its coordinator
    index = registry.index
    assert index.unindexed(registry.list()) == [*pools, swa]
    registry.lookup(LookupQuery(token_ids=list(range(9))))
    assert index.unindexed(registry.list()) == [swa]
    registry.lookup(LookupQuery(token_ids=list(range(9)), pool_ids=["p0", "p1", "p2"]))
    scope = registry.list()[:3]
    assert index.unindexed(scope) == []
    assert index.unindexed(scope) == []  # the same list of pools: by identity
    late = _create(registry, "p3", [_full()])
    assert index.unindexed(registry.list()) == [late, swa]
    registry.delete("p0")
    assert index.unindexed(registry.list()) == [late, swa]


def test_hashing_work_of_every_indexed_pool_is_read_from_the_kinds() -> None:
    """hashing_work with the index: a scope recognized as every indexed pool is read from the
    kinds (no pool visited), and gives what visiting the pools gives: each kind's profile once
    when the prompt fits its max_model_len, none when it fits no pool; a changed registry is
    visited pool by pool again."""
    from kvcm.common.errors import ResourceExhaustedError
    from kvcm.core.lookup import MAX_LOOKUP_HASH_WORK, hashing_work

    registry = PoolRegistry()
    kinds = [
        (64, HashAlgorithm.SHA256, 4),
        (64, HashAlgorithm.SHA256, 4),  # the same kind twice
        (96, HashAlgorithm.SHA256, 4),
        (128, HashAlgorithm.SHA256, 8),
        (512, HashAlgorithm.XXHASH, 4),  # a seed of its own
        (512, HashAlgorithm.XXHASH, 4),  # another seed: another profile
    ]
    for number, (max_model_len, algorithm, block_size) in enumerate(kinds):
        config = PoolConfig(
            max_model_len=max_model_len,
            explicit_layout=_layout([_full(block_size)], 16),
            hash_algorithm=algorithm,
        )
        registry.create(f"k{number}", config)
    index = registry.index
    registry.lookup(LookupQuery(token_ids=[1, 2, 3]))  # indexes every pool
    pools = list(registry.scope(LookupQuery(token_ids=[1])))
    assert index.every_kind(pools) is None  # not seen as a scope yet
    registry.lookup(LookupQuery(token_ids=[1, 2, 3]))
    pools = list(registry.scope(LookupQuery(token_ids=[1])))
    registry.lookup(LookupQuery(token_ids=[1]))
    for length in (1, 63, 64, 65, 96, 97, 128, 129, 512, 513):
        query = LookupQuery(token_ids=[7] * length)
        expected = hashing_work(pools, query)
        scope = registry.scope(query)
        assert index.every_kind(scope) is not None
        assert hashing_work(scope, query, index) == expected
    # 64 tokens: every kind takes it; four profiles (the sha256 pools of 4-token blocks share
    # one whatever their max_model_len; each xxhash pool has its seed): 16 + 8 + 16 + 16.
    assert hashing_work(pools, LookupQuery(token_ids=[7] * 64), index) == 56
    assert hashing_work(pools, LookupQuery(token_ids=[7] * 513), index) == 0
    # A new pool: the registry is no longer the recognized scope, and is visited.
    late = registry.create(
        "late",
        PoolConfig(
            max_model_len=4 * MAX_LOOKUP_HASH_WORK,
            explicit_layout=_layout([_full(2)], 16),  # 2M hashes for a 4M-token prompt
            hash_algorithm=HashAlgorithm.XXHASH,
        ),
    )
    scope = registry.scope(LookupQuery(token_ids=[1]))
    assert late in scope
    assert index.every_kind(scope) is None
    long_prompt = LookupQuery(token_ids=[7] * (4 * MAX_LOOKUP_HASH_WORK))
    with pytest.raises(ResourceExhaustedError):
        hashing_work(scope, long_prompt, index)
    registry.lookup(LookupQuery(token_ids=[1]))  # indexes it
    registry.lookup(LookupQuery(token_ids=[1]))  # recognizes the scope again
    scope = registry.scope(LookupQuery(token_ids=[1]))
    assert index.every_kind(scope) is not None
    with pytest.raises(ResourceExhaustedError):
        hashing_work(scope, long_prompt, index)
    assert hashing_work(scope, LookupQuery(token_ids=[7] * 64), index) == 56 + 32


def test_best_k_filled_from_many_pools_that_miss_equals_a_brute_force_ranking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt hit by fewer pools than asked for fills the top from the pools that miss: with
    many of them, that level is scored from the kinds' columns (two kinds of one hashing
    profile, whole and partial scopes), and every answer equals the ranking computed pool by
    pool, with loads varied by running and waiting requests and evictions."""
    import kvcm.core.lookup as lookup_module

    levels: list[int] = []
    level_rows = lookup_module._level_rows

    def counted(group: object, level: set[int], *args: object) -> object:
        levels.append(len(level))
        return level_rows(group, level, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(lookup_module, "_level_rows", counted)
    rng = random.Random(2626)
    registry = PoolRegistry()
    pools: list[Pool] = []
    for number in range(40):
        config = PoolConfig(
            max_model_len=512 if number % 3 else 256,  # two kinds, one hashing profile
            explicit_layout=_layout([_full()], rng.choice([12, 24, 48])),
        )
        pools.append(registry.create(f"m{number:02d}", config))
    documents = [[rng.randrange(500) for _ in range(rng.randrange(8, 60))] for _ in range(5)]
    key = 0
    for pool in pools:  # each pool: a few requests, some left running, one left waiting
        for _ in range(rng.randrange(0, 4)):
            key += 1
            prompt = [*rng.choice(documents)[: rng.randrange(1, 60)], rng.randrange(500)]
            _serve(pool, key, prompt, finish=rng.random() < 0.6)
        if rng.random() < 0.3:
            key += 1
            pool.add_request(key, f"w{key}", [1, 2, 3], b"")
        if rng.random() < 0.2 and pool.manager is not None:
            pool.evict_blocks(rng.sample(range(1, pool.manager.block_pool.num_gpu_blocks), 3))
    for _ in range(40):
        if rng.random() < 0.5:  # a prompt few pools hold (a document's start), or none
            probe = rng.choice(documents)[: rng.randrange(2, 60)]
        else:
            probe = [rng.randrange(500, 900) for _ in range(rng.randrange(2, 60))]
        weight = rng.choice([0.0, 0.5, 3.0])
        limit = rng.choice([1, 3, 5, 30])
        if rng.random() < 0.6:
            chosen = pools
            query = LookupQuery(token_ids=probe, load_weight=weight, max_results=limit)
        else:
            chosen = sorted(rng.sample(pools, rng.randrange(20, 40)), key=lambda p: p.name)
            query = LookupQuery(
                token_ids=probe,
                pool_ids=[p.name for p in chosen],
                load_weight=weight,
                max_results=limit,
            )
        answer = registry.lookup(query)
        got = [(h.pool_id, h.num_hit_tokens, h.load, h.score) for h in answer.pools]
        assert got == _brute_force(chosen, probe, weight, limit)
    assert len(levels) >= 20  # the columns scored most of the answers
