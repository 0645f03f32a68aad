"""Pool states for the checks: the core's ``Pool.state_fingerprint``.

``registry_state`` maps every pool to its fingerprint, to prove that a rejected call changed
nothing. ``untimed_fingerprint`` is the fingerprint with the event log's publication times
zeroed (wall clock on the server, 0.0 in the reference), to compare the served pool with the
in-process reference.
"""

from __future__ import annotations

from collections import deque

from kvcm.core.pool import Pool, PoolRegistry

__all__ = ["registry_state", "untimed_fingerprint"]


def untimed_fingerprint(pool: Pool) -> bytes:
    """``pool.state_fingerprint()`` with every event's publication time read as 0.0."""
    log = pool._events
    # The log keeps each event's encoding (with its time) for digests: read the zeroed events
    # through an empty cache, then put the log back as it was.
    saved = (log._events, log._cache, log._cached_first, log._hash_sum)
    kept = log._events
    log._events = deque(((event, 0.0) for event, _ in kept), maxlen=kept.maxlen)
    log._cache, log._cached_first, log._hash_sum = deque(), log.oldest_sequence, 0
    try:
        return pool.state_fingerprint()
    finally:
        log._events, log._cache, log._cached_first, log._hash_sum = saved


def registry_state(registry: PoolRegistry) -> dict[str, bytes]:
    """Every pool's fingerprint by pool id (pools created or deleted show as keys)."""
    return {pool.name: pool.state_fingerprint() for pool in registry.list()}
