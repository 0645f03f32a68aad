"""The lookup's key index: the compiled KeyIndex and the pure-Python PyKeyIndex answer alike.

Random adds and discards of runs of keys by many slots (past the compiled sets' inline room and
past one 64-bit word of slots; the table growing and backward-shifting on deletion), each
index's holders of every key and its walks over random prompts compared after each change.
"""

from __future__ import annotations

import os
import random

import pytest

from kvcm.core import _key_index
from kvcm.core._key_index import MAX_SLOT, KeyIndexLike, PyKeyIndex

SUFFIX = b"\0\0\0\0"


@pytest.fixture
def compiled() -> type[KeyIndexLike]:
    if _key_index.COMPILED is None:
        if os.environ.get("KVCM_PURE_PYTHON") == "1":
            pytest.skip("KVCM_PURE_PYTHON=1: the compiled key index is not built")
        pytest.fail("kvcm.core._lookup_index is not built (pip install -e . builds it)")
    return _key_index.COMPILED


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_index_answers_as_the_python_one(
    compiled: type[KeyIndexLike], seed: int
) -> None:
    rng = random.Random(seed)
    ours, reference = compiled(), PyKeyIndex()
    hash_size = rng.choice([8, 16, 32])
    hashes = [rng.randbytes(hash_size) for _ in range(400)]
    num_slots = rng.choice([3, 70, 300])
    for step in range(300):
        slot = rng.randrange(num_slots)
        first = rng.randrange(len(hashes))
        keys = [h + SUFFIX for h in hashes[first : first + rng.randrange(1, 80)]]
        if rng.random() < 0.6:
            ours.add(keys, slot)
            reference.add(keys, slot)
        else:
            ours.discard(keys, slot)
            reference.discard(keys, slot)
        assert len(ours) == len(reference)
        if step % 15:
            continue
        for block_hash in hashes:
            assert ours.get(block_hash + SUFFIX) == reference.get(block_hash + SUFFIX)
        for _ in range(8):
            start = rng.randrange(len(hashes))
            raw = b"".join(hashes[start : start + rng.randrange(0, 300)])
            raw += rng.randbytes(rng.choice([0, hash_size, 3]))  # a miss, a partial hash
            scope = rng.getrandbits(num_slots)
            max_blocks = rng.randrange(-1, 310)
            expected = reference.walk(raw, hash_size, SUFFIX, max_blocks, scope)
            assert ours.walk(raw, hash_size, SUFFIX, max_blocks, scope) == expected
    for slot in range(num_slots):  # everything leaves: no key is kept
        ours.discard([h + SUFFIX for h in hashes], slot)
    assert len(ours) == 0


def test_growth_and_deletion_keep_every_key(compiled: type[KeyIndexLike]) -> None:
    index = compiled()
    keys = [i.to_bytes(8, "little") + SUFFIX for i in range(50_000)]
    index.add(keys, 1)
    index.add(keys[::3], MAX_SLOT)
    assert len(index) == len(keys)
    index.discard(keys[::2], 1)
    for i, key in enumerate(keys):
        expected = (0 if i % 2 == 0 else 1 << 1) | (1 << MAX_SLOT if i % 3 == 0 else 0)
        assert index.get(key) == expected
    assert len(index) == sum(1 for i in range(len(keys)) if i % 2 or i % 3 == 0)


@pytest.mark.parametrize("implementation", ["compiled", "python"])
def test_bad_slots_and_keys_are_refused(compiled: type[KeyIndexLike], implementation: str) -> None:
    index = compiled() if implementation == "compiled" else PyKeyIndex()
    for slot in (-1, MAX_SLOT + 1):
        with pytest.raises(ValueError, match="slot must be in"):
            index.add([b"k"], slot)
    assert len(index) == 0
    if implementation == "compiled":
        with pytest.raises(TypeError, match="keys must be bytes"):
            index.add(["k"], 0)  # type: ignore[list-item]
        # Every key is checked before any changes: a bad one in a batch changes nothing.
        with pytest.raises(TypeError, match="keys must be bytes"):
            index.add([b"a", b"b", "c"], 0)  # type: ignore[list-item]
        assert len(index) == 0
        index.add([b"a", b"b"], 0)
        with pytest.raises(TypeError, match="keys must be bytes"):
            index.discard([b"a", 7], 0)  # type: ignore[list-item]
        assert (index.get(b"a"), index.get(b"b")) == (1, 1)
        index.discard(iter([b"a", b"b"]), 0)  # any iterable
        assert len(index) == 0
    assert index.walk(b"k" * 8, 8, SUFFIX, 1, 0) == []
    assert index.walk(b"k" * 8, 8, SUFFIX, 1, 0b101) == [(0, 0b101)]
