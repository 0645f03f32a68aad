"""The event log's kept encodings and hashes (EventLog.digest / EventLog.encoded).

Replication compares a pool's digest every few hundred records and seeds and checkpoints
encode it; a pool keeping tens of thousands of events made each of those O(kept events) in
Python (seconds, under the GIL), which grew a failover with the log. The log now encodes and
hashes each event once. These tests hold what that must not change: the digest depends only
on the kept events (their numbers, contents and timestamps), never on when it was computed or
what the log dropped meanwhile; the snapshot bytes are exactly what the plain encoding writes;
and a digest or a snapshot encodes only the events published since the last one.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvcm.common.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.core._snapshot_codec import Writer, encoded_list, event_entry
from kvcm.core.event_log import EventLog
from kvcm.core.pool import Pool
from kvcm.core.snapshot import decode_pool, encode_pool
from kvcm.server.cluster.replication import pool_digest


def _stored(block: int) -> BlockStored:
    return BlockStored(
        block_hashes=[block],
        parent_block_hash=None,
        token_ids=[block, block + 1],
        block_size=2,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
    )


def _batches(count: int, seed: int = 0) -> list[tuple[list[object], float]]:
    rng = random.Random(seed)
    out: list[tuple[list[object], float]] = []
    for index in range(count):
        size = rng.randint(1, 4)
        events: list[object] = []
        for _ in range(size):
            block = rng.randrange(1000)
            events.append(
                _stored(block)
                if rng.random() < 0.6
                else BlockRemoved(block_hashes=[block], medium=MEDIUM_GPU)
            )
        out.append((events, 1000.0 + index * 0.25))
    return out


def _fill(log: EventLog, batches: list[tuple[list[object], float]], digest_every: int = 0) -> None:
    for index, (events, now) in enumerate(batches):
        log.append(events, now)  # type: ignore[arg-type]
        if digest_every and index % digest_every == 0:
            log.digest(event_entry)


def _counting() -> tuple[Callable[[object, float], bytes], list[int]]:
    calls = [0]

    def encode(event: object, now: float) -> bytes:
        calls[0] += 1
        return event_entry(event, now)

    return encode, calls


def test_digest_depends_on_the_kept_events_only_not_on_when_it_was_taken() -> None:
    batches = _batches(400)
    eager, lazy, never = EventLog(150), EventLog(150), EventLog(150)
    _fill(eager, batches, digest_every=1)  # every batch: drops hashed events as it goes
    _fill(lazy, batches, digest_every=97)  # some dropped before they were ever hashed
    _fill(never, batches)
    assert eager.oldest_sequence > 1  # the retention dropped events
    assert eager.digest(event_entry) == lazy.digest(event_entry) == never.digest(event_entry)
    # A log restored from the kept events (a snapshot's) has the same digest.
    restored = EventLog(150)
    restored.restore(never.next_sequence, never.contents())
    assert restored.digest(event_entry) == never.digest(event_entry)


def test_digest_differs_for_another_event_timestamp_or_numbering() -> None:
    batches = _batches(50)
    base = EventLog(1000)
    _fill(base, batches)
    digest = base.digest(event_entry)

    other_event = EventLog(1000)
    _fill(other_event, batches[:-1])
    other_event.append([AllBlocksCleared()], batches[-1][1])
    other_time = EventLog(1000)
    _fill(other_time, [*batches[:-1], (batches[-1][0], batches[-1][1] + 0.5)])
    shifted = EventLog(1000)  # the same kept events under other sequence numbers
    shifted.restore(base.next_sequence + 1, base.contents())
    assert len({digest, other_event.digest(event_entry), other_time.digest(event_entry),
                shifted.digest(event_entry)}) == 4  # fmt: skip

    base.append([AllBlocksCleared()], 5000.0)  # and a digest follows what is appended
    assert base.digest(event_entry) != digest


def test_a_digest_or_an_encoding_encodes_only_the_events_published_since() -> None:
    log = EventLog(65_536)
    encode, calls = _counting()
    _fill(log, _batches(3000))
    published = log.last_sequence
    log.digest(encode)
    assert calls[0] == published  # the first one: every kept event, once
    log.append([_stored(1), _stored(2)], 9999.0)
    log.append([BlockRemoved(block_hashes=[1], medium=MEDIUM_GPU)], 9999.5)
    log.digest(encode)
    assert calls[0] == published + 3
    assert len(log.encoded(encode)) == published + 3
    assert calls[0] == published + 3  # encoded() reuses what digest() kept


def test_the_kept_encodings_write_exactly_what_a_snapshot_always_wrote() -> None:
    log = EventLog(120)
    _fill(log, _batches(200), digest_every=13)
    plain = Writer()
    plain.value([[event, now] for event, now in log.contents()])
    cached = Writer()
    cached.value(encoded_list(log.encoded(event_entry)))
    assert bytes(cached.out) == bytes(plain.out)


def test_a_pool_snapshot_and_digest_are_the_same_with_or_without_the_cache() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
    from _data_dir_server import CONFIG, program

    used, fresh = Pool("p", CONFIG), Pool("p", CONFIG)
    for seq in range(1, 120):
        for pool in (used, fresh):
            pool.run_step(program(seq))
            pool.publish_events(seq * 0.01)
        if seq % 17 == 0:
            pool_digest(used)
            encode_pool(used)
            fresh.snapshot()  # drains the prefix-cache counters as a digest does, no more
    assert used.last_event_sequence > 0
    data = encode_pool(used)
    assert data == encode_pool(fresh)
    assert pool_digest(used) == pool_digest(fresh)
    copy = decode_pool(data, "p", CONFIG)
    assert pool_digest(copy) == pool_digest(used)
    assert encode_pool(copy) == data
