"""Work a server runs in a worker thread so that no call holds its event loop for long.

Two kinds: building or dismantling a large pool (``rpc._admin``, holding
:data:`OFF_LOOP_WORK`), and a Step whose estimated cost exceeds a few milliseconds
(``rpc._scheduler``, through :meth:`ServerState.run_in_lane`, holding :data:`OFF_LOOP_STEP`):
decoding, running, publishing the events of and encoding it.
"""

from __future__ import annotations

import gc
import sys
import threading
from typing import Final

__all__ = ["OFF_LOOP_STEP", "OFF_LOOP_WORK", "OffLoopWork"]


class OffLoopWork:
    """Held by every worker thread that runs long work for the server.

    While any holds one, the interpreter hands its lock over every 0.1 ms instead of 5 ms, so
    the loop thread waits less for it.

    Building a large pool (``pause_gc=True``) also pauses the cyclic garbage collector while
    it runs (its collections would walk the growing pool again and again) and, when the last
    such holder leaves, freezes every tracked object (``gc.freeze``, as vLLM's engine does once
    its KV cache exists): the new pool's blocks, young because the collector was paused, would
    otherwise make the next young-generation collection walk all of them on whatever thread
    allocates.

    A Step leaves the collector running (``pause_gc=False``): paused, the Step's survivors (a
    4,096-admission Step leaves ~25k tracked objects) all stayed young and the first
    collection after it walked them in one go, holding the lock ~12 ms of CPU (50-130 ms on a
    loaded 2-core VM); running, the collector walks them in small young collections while
    the Step runs. Nor does it freeze: its garbage must stay collectable.
    """

    _lock = threading.Lock()
    _holders = 0
    _gc_pausers = 0
    _freeze = False
    _gc_was_enabled = False
    _switch_interval_s = 0.0

    def __init__(self, *, pause_gc: bool) -> None:
        self._pauses_gc = pause_gc

    def __enter__(self) -> None:
        cls = OffLoopWork
        with cls._lock:
            if cls._holders == 0:
                cls._switch_interval_s = sys.getswitchinterval()
                sys.setswitchinterval(_SWITCH_INTERVAL_S)
            cls._holders += 1
            if self._pauses_gc:
                if cls._gc_pausers == 0:
                    cls._gc_was_enabled = gc.isenabled()
                    gc.disable()
                cls._gc_pausers += 1
                cls._freeze = True

    def __exit__(self, *exc_info: object) -> None:
        cls = OffLoopWork
        with cls._lock:
            if self._pauses_gc:
                cls._gc_pausers -= 1
                if cls._gc_pausers == 0:
                    if cls._freeze:
                        gc.freeze()
                    cls._freeze = False
                    if cls._gc_was_enabled:
                        gc.enable()
            cls._holders -= 1
            if cls._holders == 0:
                sys.setswitchinterval(cls._switch_interval_s)


# A loop thread woken by a call waits up to one switch interval for the lock, once per wake-up
# (a unary call wakes it a few times). Beside a busy thread, a synthetic call (three wake-ups
# of 0.1 ms of Python) took a median 3.0 ms at 0.5 ms, 1.4 ms at 0.1 ms, 1.3 ms at 0.05 ms
# and 0.6 ms alone, on a 2-core VM (docs/server.md, "Event-loop fairness"). The worker pays
# with more lock hand-overs, only while the loop has work.
_SWITCH_INTERVAL_S: Final = 0.0001
OFF_LOOP_WORK: Final = OffLoopWork(pause_gc=True)
"""Building or dismantling a large pool."""
OFF_LOOP_STEP: Final = OffLoopWork(pause_gc=False)
"""Running a long Step program."""
