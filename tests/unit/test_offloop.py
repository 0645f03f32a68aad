"""Off-loop work: a pool build pauses the collector and freezes what it built; a Step does not."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest

from kvcm.server.rpc._offloop import OFF_LOOP_STEP, OFF_LOOP_WORK


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    was_enabled, interval = gc.isenabled(), sys.getswitchinterval()
    gc.enable()
    yield
    gc.unfreeze()
    if not was_enabled:
        gc.disable()
    sys.setswitchinterval(interval)


def test_a_step_keeps_the_collector_running_and_hands_the_lock_over_often() -> None:
    interval = sys.getswitchinterval()
    frozen = gc.get_freeze_count()
    with OFF_LOOP_STEP:
        assert gc.isenabled()  # its survivors are collected young, a few at a time
        assert sys.getswitchinterval() < interval
    assert gc.isenabled()
    assert sys.getswitchinterval() == interval
    # Its garbage stays collectable: nothing new is frozen. (The count may fall: an object another
    # test's pool build froze can be freed meanwhile by a server thread still winding down.)
    assert gc.get_freeze_count() <= frozen


def test_a_build_pauses_the_collector_and_freezes_what_it_built_once_the_last_leaves() -> None:
    interval = sys.getswitchinterval()
    with OFF_LOOP_WORK:
        assert not gc.isenabled()
        with OFF_LOOP_STEP:  # a Step in another lane meanwhile changes nothing
            assert not gc.isenabled()
        assert not gc.isenabled()
        assert sys.getswitchinterval() < interval
        built = [[i] for i in range(1000)]
    assert gc.isenabled()
    assert sys.getswitchinterval() == interval
    assert gc.get_freeze_count() >= len(built)
