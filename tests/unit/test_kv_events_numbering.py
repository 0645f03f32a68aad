"""The ZMQ wire's numbering per pool id and the stream endpoints, on real core pools.

``KvEventNumbering`` turns each incarnation's own batch numbers (0, 1, ... in its event log)
into wire numbers that never go backwards for a pool id; ``offset_endpoint`` is vLLM's
endpoint-per-rank rule.
"""

from __future__ import annotations

import pytest

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import Pool, PoolConfig
from kvcm.server.kv_events import KvEventNumbering, offset_endpoint, stream_offset

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
LAYOUT = KVCacheConfig(
    num_blocks=8,
    kv_cache_tensors=(),
    kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
)


def _pool(name: str, **labels: str) -> Pool:
    return Pool(
        name,
        PoolConfig(
            max_model_len=64, explicit_layout=LAYOUT, enable_kv_cache_events=True, labels=labels
        ),
    )


def _publish(pool: Pool, batches: int, ts: float = 1.0) -> None:
    for _ in range(batches):
        pool.publish_cleared(ts)  # one batch each (the cheapest the core publishes)


def _end(numbering: KvEventNumbering, pool: Pool, ts: float = 9.0) -> None:
    """What ServerState.retire does: AllBlocksCleared last, then the numbering moves on."""
    pool.publish_cleared(ts)
    numbering.retire(pool, f"kv@{pool.name}@", list)


def test_a_new_incarnation_goes_on_after_the_old_ones_all_blocks_cleared() -> None:
    numbering = KvEventNumbering()
    first = _pool("a")
    assert numbering.last_seq(first) == -1
    _publish(first, 3)
    assert numbering.base("a") == 0
    assert numbering.last_seq(first) == 2
    _end(numbering, first)  # batch 3 is its AllBlocksCleared
    second = _pool("a")
    assert numbering.base("a") == 4
    assert numbering.last_seq(second) == 3  # nothing yet: the clear is the last on the wire
    _publish(second, 2)
    assert numbering.last_seq(second) == 5
    _end(numbering, second)  # wire 6
    assert numbering.base("a") == 7
    assert numbering.base("b") == 0  # another id keeps its own numbering


def test_an_incarnation_that_published_nothing_leaves_the_numbering_alone() -> None:
    numbering = KvEventNumbering()
    quiet = Pool("q", PoolConfig(max_model_len=64, explicit_layout=LAYOUT))  # events off
    quiet.publish_cleared(1.0)
    numbering.retire(quiet, "kv@q@", list)
    assert numbering.base("q") == 0
    assert numbering.cleared_batches(0, None, 0) == []


def test_the_cleared_batch_stays_replayable_by_start_topic_and_stream() -> None:
    numbering = KvEventNumbering("data_parallel_rank")
    one = _pool("one", data_parallel_rank="1")
    _publish(one, 2)
    _end(numbering, one, ts=5.5)  # wire 2, on stream 1
    two = _pool("two")
    _end(numbering, two, ts=6.5)  # wire 0, on stream 0
    [cleared] = numbering.cleared_batches(0, None, 1)
    assert (cleared.topic, cleared.seq, cleared.ts, cleared.dp_rank) == (b"kv@one@", 2, 5.5, 1)
    assert [type(e).__name__ for e in cleared.events] == ["AllBlocksCleared"]
    assert numbering.cleared_batches(3, None, 1) == []  # asked from after it
    assert numbering.cleared_batches(0, "kv@two@", 1) == []  # another topic
    assert [b.topic for b in numbering.cleared_batches(0, "kv@two@", 0)] == [b"kv@two@"]


def test_the_table_round_trips_through_its_bytes_and_refuses_damage() -> None:
    numbering = KvEventNumbering()
    for name in ("x", "y"):
        pool = _pool(name)
        _publish(pool, 4)
        _end(numbering, pool)
    restored = KvEventNumbering()
    restored.restore(numbering.encode())
    assert (restored.base("x"), restored.base("y"), restored.base("z")) == (5, 5, 0)
    assert restored.cleared_batches(0, None, 0) == numbering.cleared_batches(0, None, 0)
    empty = KvEventNumbering()
    empty.restore(b"")
    assert empty.base("x") == 0
    with pytest.raises(ConfigError, match="numbering is damaged"):
        KvEventNumbering().restore(b"\x93\x01")


def test_over_the_cap_an_unused_id_is_forgotten_and_no_id_goes_backwards() -> None:
    numbering = KvEventNumbering(max_retired=2)
    live = ["kept", "fresh"]  # "fresh" has a pool that never ended: its numbers start at 0
    bases = {}
    for name, batches in (("kept", 9), ("old", 5), ("mid", 2), ("new", 1)):
        pool = _pool(name)
        _publish(pool, batches)
        pool.publish_cleared(1.0)
        numbering.retire(pool, f"kv@{name}@", lambda: live)
        bases[name] = numbering.base(name)
    # "kept" has a pool again: never forgotten; "old" and "mid" were, and the floor rose
    # past both; "fresh" was pinned where it was, so its live numbers did not move.
    assert numbering.base("kept") == bases["kept"] == 10
    assert numbering.base("old") >= bases["old"]
    assert numbering.base("mid") >= bases["mid"]
    assert numbering.base("never-seen") == numbering.base("old") == 6
    assert numbering.base("new") == bases["new"]
    assert numbering.base("fresh") == 0
    restored = KvEventNumbering()
    restored.restore(numbering.encode())
    assert [restored.base(n) for n in ("fresh", "kept", "old", "new")] == [0, 10, 6, 8]
    # Once "fresh" is gone, its pin goes with the next forgetting.
    live.remove("fresh")
    for name in ("a", "b"):
        pool = _pool(name)
        pool.publish_cleared(1.0)
        numbering.retire(pool, f"kv@{name}@", lambda: live)
    assert numbering.base("fresh") == numbering.base("never-seen")


@pytest.mark.parametrize(
    ("endpoint", "offset", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://indexer:5557", 1, "tcp://indexer:5558"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("tcp://*:0", 2, "tcp://*:0"),  # each stream its own ephemeral port
        ("inproc://cache", 1, "inproc://cache_dp1"),  # vLLM's suffix
        ("ipc:///run/kvcm/pub", 2, "ipc:///run/kvcm/pub_dp2"),
    ],
)
def test_offset_endpoint_is_vllms_port_plus_rank(endpoint: str, offset: int, expected: str) -> None:
    assert offset_endpoint(endpoint, offset) == expected


def test_a_pool_s_stream_is_its_label_value_else_the_shared_one() -> None:
    ranked = _pool("r", data_parallel_rank="2")
    odd = _pool("o", data_parallel_rank="two")
    assert stream_offset(ranked, "data_parallel_rank") == 2
    assert stream_offset(ranked, "") == 0  # one socket for every pool
    assert stream_offset(odd, "data_parallel_rank") == 0
    assert stream_offset(_pool("u", data_parallel_rank="²"), "data_parallel_rank") == 0
