"""A pool's sequenced KV-event log: what EventService subscribers read and resume from.

Events get consecutive sequence numbers 1, 2, ... in publication order; the log keeps the last
``retention`` of them, so a subscriber that fell further behind than that learns it
(:class:`OutOfRangeError`) instead of silently missing events. Pure: the caller stamps each
published batch with its time.

Each publication is also a *batch* (vLLM publishes one ``KVEventBatch`` per scheduler step, its
ZMQ sequence number counting batches from 0): the log numbers batches 0, 1, ... and keeps those
whose events are all still kept, so a ZMQ replay can send exactly the batches it published,
also after a restart (the numbering is part of the pool's snapshot).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from collections.abc import Callable, Sequence

from kvcm.common.errors import InvalidArgumentError, OutOfRangeError
from kvcm.common.events import KVCacheEvent

__all__ = ["EventBatchRecord", "EventLog", "OutOfRangeError"]

EventBatchRecord = tuple[int, int, int, float]
"""One kept batch: (batch sequence, sequence of its first event, number of events, timestamp)."""


class EventLog:
    """Published events with consecutive sequence numbers, the last ``retention`` kept.

    NOTE: ``_events[i]`` holds sequence ``oldest_sequence + i``; appending past ``retention``
    drops from the left, which advances ``oldest_sequence`` and keeps that identity.
    ``_cache[i]`` holds sequence ``_cached_first + i`` encoded and hashed (:meth:`digest`,
    :meth:`encoded`), filled in lazily: the events published since the last use, never the
    whole log again (it costs about the kept events' encoded size in memory).
    """

    __slots__ = (
        "_batches",
        "_cache",
        "_cached_first",
        "_events",
        "_hash_sum",
        "_next_batch",
        "_next_sequence",
        "retention",
    )

    def __init__(self, retention: int) -> None:
        """An empty log keeping at most ``retention`` (>= 1) events."""
        self.retention = retention
        self._events: deque[tuple[KVCacheEvent, float]] = deque(maxlen=retention)
        self._next_sequence = 1
        self._batches: deque[EventBatchRecord] = deque()
        self._next_batch = 0
        self._cache: deque[tuple[bytes, int]] = deque()
        self._cached_first = 1
        self._hash_sum = 0

    @property
    def next_batch(self) -> int:
        """The batch sequence number the next publication gets (vLLM's ZMQ ``seq``)."""
        return self._next_batch

    def batches(self) -> list[EventBatchRecord]:
        """The kept batches, oldest first (a copy)."""
        return list(self._batches)

    def restore_batches(self, next_batch: int, batches: Sequence[EventBatchRecord]) -> None:
        """Install a saved batch numbering (after :meth:`restore`).

        Raises:
            InvalidArgumentError: The batches are not consecutive or not within the kept
                events.
        """
        expected_event = self.oldest_sequence
        kept: list[EventBatchRecord] = []
        for record in batches:
            seq, first, count, _ = record
            if count < 1 or first < expected_event or first + count > self._next_sequence:
                raise InvalidArgumentError(
                    f"event batch {seq} ({count} events from {first}) is not within the kept "
                    "events",
                    field="data",
                )
            if kept and seq != kept[-1][0] + 1:
                raise InvalidArgumentError(f"event batch {seq} does not follow", field="data")
            expected_event = first + count
            kept.append(record)
        if kept and kept[-1][0] >= next_batch:
            raise InvalidArgumentError(f"next_batch {next_batch} is not after the kept batches")
        self._batches = deque(kept)
        self._next_batch = next_batch

    @property
    def next_sequence(self) -> int:
        """The sequence number the next published event gets."""
        return self._next_sequence

    @property
    def last_sequence(self) -> int:
        """Sequence number of the last published event (0: none yet)."""
        return self._next_sequence - 1

    @property
    def oldest_sequence(self) -> int:
        """Oldest sequence number still kept (== ``next_sequence`` when none are kept)."""
        return self._next_sequence - len(self._events)

    def contents(self) -> list[tuple[KVCacheEvent, float]]:
        """The kept events with their timestamps, oldest first (a copy)."""
        return list(self._events)

    def restore(self, next_sequence: int, entries: Sequence[tuple[KVCacheEvent, float]]) -> None:
        """Replace the log: ``entries`` are the kept events, the last one numbered
        ``next_sequence - 1`` (a snapshot's log; at most ``retention`` are kept).

        Raises:
            InvalidArgumentError: ``next_sequence`` leaves no room for the entries.
        """
        if next_sequence < 1 or len(entries) > next_sequence - 1:
            raise InvalidArgumentError(
                f"next_sequence {next_sequence} cannot follow {len(entries)} kept events",
                field="data",
            )
        self._events = deque(entries, maxlen=self.retention)
        self._next_sequence = next_sequence
        self._batches = deque()
        self._next_batch = 0
        self._cache = deque()
        self._cached_first = next_sequence - len(self._events)
        self._hash_sum = 0

    def _cached(self, encode: Callable[[KVCacheEvent, float], bytes]) -> deque[tuple[bytes, int]]:
        """The kept events' cache entries, oldest first: ``encode(event, timestamp)`` and the
        BLAKE2b hash of the sequence number and those bytes. Only the events published since
        the last call are encoded; those dropped since leave the cache and the hash sum."""
        cache = self._cache
        oldest = self.oldest_sequence
        first = self._cached_first
        while cache and first < oldest:  # dropped from the log since the last call
            self._hash_sum -= cache.popleft()[1]
            first += 1
        first = max(first, oldest)  # some were dropped before they were ever cached
        new = self._next_sequence - (first + len(cache))
        if new > 0:
            fresh = list(itertools.islice(reversed(self._events), new))
            fresh.reverse()
            sequence = first + len(cache)
            for offset, (event, now) in enumerate(fresh):
                data = encode(event, now)
                keyed = (sequence + offset).to_bytes(8, "big") + data
                value = int.from_bytes(hashlib.blake2b(keyed, digest_size=16).digest(), "big")
                cache.append((data, value))
                self._hash_sum += value
        self._cached_first = first
        self._hash_sum %= 1 << 128
        return cache

    def digest(self, encode: Callable[[KVCacheEvent, float], bytes]) -> bytes:
        """A 16-byte digest of the kept events, each with its sequence number and timestamp.

        The sum (mod 2**128) of one BLAKE2b hash per kept event, over its sequence number and
        ``encode(event, timestamp)``: equal for two logs that keep the same events under the
        same numbers. ``encode`` must be one function for the life of the log (the snapshot
        codec's entry): the encodings and hashes are kept, so a digest costs O(events
        published since the last digest or :meth:`encoded`), not O(kept events).
        """
        self._cached(encode)
        return self._hash_sum.to_bytes(16, "big")

    def encoded(self, encode: Callable[[KVCacheEvent, float], bytes]) -> list[bytes]:
        """``encode(event, timestamp)`` of each kept event, oldest first (kept, as for
        :meth:`digest`: a snapshot of a long log encodes only its new events)."""
        return [data for data, _ in self._cached(encode)]

    def append(self, events: Sequence[KVCacheEvent], now: float) -> int:
        """Publish ``events`` in order as one batch, all stamped ``now``; returns how many."""
        count = len(events)
        if not count:
            return 0
        self._events.extend([(event, now) for event in events])
        batches = self._batches
        batches.append((self._next_batch, self._next_sequence, count, now))
        self._next_batch += 1
        self._next_sequence += count
        # A batch is kept while all of its events are.
        oldest = self._next_sequence - len(self._events)
        while batches[0][1] < oldest:
            batches.popleft()
            if not batches:
                break
        return count

    def last_batch(self) -> tuple[int, list[KVCacheEvent], float] | None:
        """The batch just published: (batch sequence, its events, timestamp); ``None``: none
        kept."""
        if not self._batches:
            return None
        seq, first, count, now = self._batches[-1]
        return seq, self._events_of(first, count), now

    def batches_from(self, start: int) -> list[tuple[int, list[KVCacheEvent], float]]:
        """Every kept batch numbered ``start`` or later: (batch sequence, events, timestamp)."""
        return [
            (seq, self._events_of(first, count), now)
            for seq, first, count, now in self._batches
            if seq >= start
        ]

    def _events_of(self, first: int, count: int) -> list[KVCacheEvent]:
        # The kept events numbered first .. first + count - 1.
        events = self._events
        base = first - (self._next_sequence - len(events))
        return [events[base + i][0] for i in range(count)]

    def check_start(self, start: int | None) -> int:
        """The first sequence a subscription starting at ``start`` reads.

        Args:
            start: The requested first sequence; ``None``: the live edge (the next event).

        Raises:
            OutOfRangeError: ``start`` is older than the oldest kept event.
            InvalidArgumentError: ``start`` is below 1 or beyond the next event.
        """
        if start is None:
            return self._next_sequence
        if start < 1 or start > self._next_sequence:
            raise InvalidArgumentError(
                f"start_sequence must be in [1, {self._next_sequence}], got {start}"
            )
        if start < self.oldest_sequence:
            raise OutOfRangeError(
                f"start_sequence {start} is older than the oldest kept event "
                f"{self.oldest_sequence}; resubscribe from the live edge"
            )
        return start

    def read(self, sequence: int, max_events: int) -> tuple[list[KVCacheEvent], float] | None:
        """Up to ``max_events`` events from ``sequence`` on, with the newest one's timestamp.

        Returns:
            ``([], 0.0)`` when nothing from ``sequence`` on is published yet, ``None`` when
            ``sequence`` was dropped.
        """
        oldest = self.oldest_sequence
        if sequence < oldest:
            return None
        start = sequence - oldest
        end = min(len(self._events), start + max_events)
        if start >= end:
            return [], 0.0
        # Indexing walks from the nearer end: cheap for subscribers near the live edge.
        events = self._events
        window = [events[i] for i in range(start, end)]
        return [event for event, _ in window], window[-1][1]
