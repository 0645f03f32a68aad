"""A pool's host tier in its snapshot: a restored pool goes on exactly as the original.

The tier decides later answers (host hits, which host block a demotion takes, what is evicted),
so a checkpoint or a ResyncPool that dropped it would make a restored pool diverge from the
pool that acknowledged the same calls. These tests build tiers with every kind of state
(recency order, pins, pending stores, swapped requests with keyed and private blocks, copies
and events not taken), restore them, drive both copies identically and compare their complete
state fingerprints; forged tier sections are refused with an error naming the field.
"""

from __future__ import annotations

from array import array

import pytest

from kvcm.common.errors import InvalidArgumentError
from kvcm.common.hashing import BlockHash, make_block_hash_with_group_id
from kvcm.core.pool import Pool
from kvcm.core.snapshot import decode_pool, decode_sections, encode_pool, encode_sections
from tests.unit.test_host_tier import _add, _flood, _pool, _run


def _busy_pool() -> Pool:
    pool = _pool(10, enable_kv_cache_events=True)
    host = pool.host_tier
    assert host is not None
    _run(pool, 1, list(range(64)))
    pool.free(1, preempt=False)
    _flood(pool, 2, 15, 5000)  # the first prompt's 4 blocks and more are demoted
    _run(pool, 3, [*range(9000, 9040)])  # two full blocks and a partial one, running
    assert pool.swap_out(3) is not None  # keyed blocks and a private partial block
    pending = make_block_hash_with_group_id(BlockHash(bytes(32)), 0)
    assert host.store([pending], ready=False) is not None
    host.pin(host.lru_keys()[-1:])  # a load in flight
    assert host.private_blocks()
    assert host.pinned()
    assert host.pending_keys()
    return pool


def _drive(pool: Pool) -> list[object]:
    """The same later calls on either copy: their answers."""
    answers: list[object] = []
    _add(pool, 4, [*range(64), 7])
    answers.append(pool.lookup_tiers(4)[1])
    answers.append(pool.admit_with_host(4, 1))
    _flood(pool, 5, 6, 20_000)
    answers.append(pool.swap_in(3, 1))
    answers.append(pool.take_host_copies())
    pool.publish_events(1.0)
    answers.append(pool.host_tier.stats() if pool.host_tier else None)
    return answers


def test_a_restored_tier_is_the_original_and_decides_as_it_does() -> None:
    pool = _busy_pool()
    restored = decode_pool(encode_pool(pool), "p", pool.options)
    assert restored.state_fingerprint() == pool.state_fingerprint()
    host, copy = pool.host_tier, restored.host_tier
    assert host is not None
    assert copy is not None
    assert copy.recency() == host.recency()
    assert copy.keys() == host.keys()
    assert copy.swapped() == host.swapped()
    assert copy.lru_keys() == host.lru_keys()
    assert copy.num_evictable == host.num_evictable
    assert copy.stats() == host.stats()
    first, second = _drive(pool), _drive(restored)
    assert second == first
    assert first[0] > 0  # the restored tier still answers a host hit
    assert restored.state_fingerprint() == pool.state_fingerprint()


def test_the_fingerprint_sees_the_tier() -> None:
    pool, other = _busy_pool(), _busy_pool()
    assert pool.state_fingerprint() == other.state_fingerprint()
    assert other.host_tier is not None
    other.host_tier.touch(other.host_tier.recency()[:1])  # recency only
    assert pool.state_fingerprint() != other.state_fingerprint()


def _forged(pool: Pool, edit: object) -> bytes:
    sections = decode_sections(encode_pool(pool))
    edit(sections[3]["host_tier"])  # type: ignore[operator]
    return encode_sections(sections)


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda t: t.update(num_blocks=11), "extras.host_tier.num_blocks"),
        (lambda t: t.update(free=array("q", [*t["free"], 0])), "extras.host_tier.free"),
        (lambda t: t["key_blocks"].__setitem__(1, t["key_blocks"][0]), "key_blocks[1]"),
        (lambda t: t.update(key_blocks=array("q", [99] * len(t["key_blocks"]))), "key_blocks"),
        (lambda t: t.update(pending=array("q", [10**6])), "extras.host_tier.pending"),
        (lambda t: t.update(pin_counts=array("q", [0] * len(t["pinned"]))), "pin_counts"),
        (lambda t: t.update(pinned=array("q"), pin_counts=array("q")), "extras.host_tier.p"),
        (lambda t: t.update(swapped={"77": t["swapped"]["3"]}), "swapped['77']"),
        (lambda t: t.update(counters=array("q", [-1] * 11)), "extras.host_tier.counters"),
        (lambda t: t.update(device_to_host=array("q", [1])), "device_to_host"),
        (lambda t: t.update(events=[1]), "extras.host_tier.events[0]"),
        (lambda t: t.update(extra=1), "extras.host_tier"),
        (lambda t: t.update(keys=b""), "extras.host_tier.keys"),
    ],
)
def test_a_forged_tier_is_refused_naming_the_field(edit: object, where: str) -> None:
    pool = _busy_pool()
    with pytest.raises(InvalidArgumentError) as info:
        decode_pool(_forged(pool, edit), "p", pool.options)
    assert info.value.field == "data"
    assert where in str(info.value)


def test_a_tier_saved_for_a_pool_without_one_is_refused_and_none_saved_starts_empty() -> None:
    pool = _busy_pool()
    without = _pool(0)
    with pytest.raises(InvalidArgumentError, match=r"extras\.host_tier is saved for a pool"):
        decode_pool(encode_pool(pool), "p", without.options)
    sections = decode_sections(encode_pool(pool))
    del sections[3]["host_tier"]
    sections[1]["groups"][0]["req_to_blocks"].pop("3", None)  # nothing refers to the tier
    restored = decode_pool(encode_sections(sections), "p", pool.options)
    assert restored.host_tier is not None
    assert restored.host_tier.keys() == {}
