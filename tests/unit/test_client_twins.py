"""The two scheduler clients are one: SchedulerClient is generated from AsyncSchedulerClient.

``scripts/gen_sync_client.py`` derives ``kvcm.client.scheduler`` from ``kvcm.client.aio``;
these tests fail when the generated module is stale and check what the generation promises:
the same public methods with the same signatures and docstrings, coroutines on one side and
plain functions on the other.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

from kvcm.client import AsyncSchedulerClient, SchedulerClient

ROOT = Path(__file__).resolve().parents[2]


def _public(cls: type) -> dict[str, object]:
    return {name: member for name, member in vars(cls).items() if not name.startswith("_")}


def test_the_sync_client_is_up_to_date() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_sync_client.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_the_twins_have_the_same_methods_signatures_and_docs() -> None:
    sync, aio = _public(SchedulerClient), _public(AsyncSchedulerClient)
    assert sync.keys() == aio.keys()
    assert {"step", "resync_pool", "lookup", "subscribe_events", "keep_alive"} <= sync.keys()
    for name, sync_member in sync.items():
        aio_member = aio[name]
        if not callable(sync_member):
            continue
        assert str(inspect.signature(sync_member)) == str(
            inspect.signature(aio_member)  # type: ignore[arg-type]
        ).replace("AsyncEventStream", "EventStream"), name
        assert inspect.getdoc(sync_member) == inspect.getdoc(aio_member), name
        # subscribe_events returns a stream at once; every other call waits for the server.
        waits = name != "subscribe_events"
        assert inspect.iscoroutinefunction(aio_member) is waits, name
        assert not inspect.iscoroutinefunction(sync_member), name
