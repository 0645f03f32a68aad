"""Follow a pool's event stream in the background, for ``RemoteKVCacheManager.take_events``.

vLLM's ``take_events`` drains the events of the calls made so far. Remotely, events arrive on a
stream, so the follower reads it on a daemon thread into a buffer, and ``take_until(S)`` waits
until every event up to sequence ``S`` (the pool's last published one, from ``DescribePool``)
has arrived, then hands them over: the same events, in the same order, none twice.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from kvcm.client._errors import ServiceError
from kvcm.common.errors import FailedPreconditionError

if TYPE_CHECKING:
    from kvcm.client.scheduler import EventStream, SchedulerClient
    from kvcm.common.events import KVCacheEvent

__all__ = ["EventFollower"]

# How long take_until waits for events the server has already published, in seconds.
_DELIVERY_TIMEOUT_S = 10.0


class EventFollower:
    """Buffers a pool's events from a given sequence on, on a daemon thread."""

    def __init__(
        self,
        client: SchedulerClient,
        pool_id: str,
        last_seen_sequence: int,
        epoch: int | None = None,
    ) -> None:
        """Subscribe from ``last_seen_sequence + 1`` and start reading.

        Args:
            client: The client to subscribe with.
            pool_id: The pool.
            last_seen_sequence: Events up to this sequence are not wanted.
            epoch: The pool epoch ``last_seen_sequence`` belongs to (``PoolInfo.epoch``); a
                re-created pool then fails the stream rather than feeding another log's
                events. ``None``: any.
        """
        self._condition = threading.Condition()
        self._events: list[KVCacheEvent] = []
        self._next_sequence = last_seen_sequence + 1  # of the next event to arrive
        self._taken_until = last_seen_sequence
        self._error: ServiceError | None = None
        self._stream: EventStream = client.subscribe_events(
            pool_id, start_sequence=last_seen_sequence + 1, expected_epoch=epoch
        )
        self._thread = threading.Thread(
            target=self._run, name=f"kvcm-events-{pool_id}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch in self._stream:
                if not batch.events:
                    continue
                with self._condition:
                    self._events.extend(batch.events)
                    self._next_sequence = batch.first_sequence + len(batch.events)
                    self._condition.notify_all()
        except ServiceError as exc:
            with self._condition:
                self._error = exc
                self._condition.notify_all()

    def take_until(self, sequence: int) -> list[KVCacheEvent]:
        """Events after the last take up to ``sequence``, waiting for them to arrive.

        Raises:
            ServiceError: The stream failed (e.g. the pool was deleted).
            FailedPreconditionError: The events did not arrive in time.
        """
        give_up_at = time.monotonic() + _DELIVERY_TIMEOUT_S
        with self._condition:
            while self._next_sequence <= sequence:
                if self._error is not None:
                    raise self._error
                left = give_up_at - time.monotonic()
                if left <= 0:
                    raise FailedPreconditionError(
                        f"events up to {sequence} did not arrive within {_DELIVERY_TIMEOUT_S}s"
                    )
                self._condition.wait(left)
            num_wanted = sequence - self._taken_until
            taken = self._events[:num_wanted]
            del self._events[:num_wanted]
            self._taken_until = sequence
            return taken

    def close(self) -> None:
        """Cancel the subscription and let the thread end."""
        self._stream.close()
        self._thread.join(timeout=5.0)
