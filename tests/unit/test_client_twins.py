"""The SDK's twins cannot drift: the two scheduler clients, and the SDK's and core's knobs.

``scripts/gen_sync_client.py`` derives ``kvcm.client.scheduler`` from ``kvcm.client.aio``;
these tests fail when the generated module is stale and check what the generation promises:
the same public methods with the same signatures and docstrings, coroutines on one side and
plain functions on the other. The SDK's ``SlotOptions`` must stay the core's allocate_slots
knobs plus ``num_in_flight_tokens``.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def test_the_sdk_slot_options_are_the_core_knobs_plus_in_flight_tokens() -> None:
    # kvcm.client.SlotOptions is what a caller gives one allocation: the core's allocate_slots
    # knobs (kvcm.core.manager.SlotOptions) plus num_in_flight_tokens, which the core carries
    # in AllocOptions. A knob added to the core without the SDK (or the other way) fails here,
    # and so does a knob core_alloc_options drops on the way to the core.
    import dataclasses

    from kvcm.client import SlotOptions
    from kvcm.client._step import core_alloc_options
    from kvcm.core.manager import SlotOptions as CoreSlotOptions

    sdk = {field.name: field.default for field in dataclasses.fields(SlotOptions)}
    core = {field.name: field.default for field in dataclasses.fields(CoreSlotOptions)}
    assert sdk.keys() == core.keys() | {"num_in_flight_tokens"}
    # Unset lookahead is None in the SDK (the unary wire field stays absent), 0 in the core;
    # both read as the Step's default_num_lookahead_tokens.
    assert (sdk.pop("num_lookahead_tokens"), core.pop("num_lookahead_tokens")) == (None, 0)
    assert sdk.pop("num_in_flight_tokens") == 0
    assert sdk == core
    changed: dict[str, Any] = {
        name: (not default if isinstance(default, bool) else 3)
        for name, default in {**core, "num_lookahead_tokens": 0}.items()
    }
    converted = core_alloc_options(SlotOptions(**changed, num_in_flight_tokens=5))
    assert converted.slot_options == CoreSlotOptions(**changed)
    assert converted.num_in_flight_tokens == 5


def test_every_client_stands_on_one_channel_client_base() -> None:
    # The channel, settings, stubs, error mapping and retries are written once, in
    # kvcm.client._base: the sync base and the asyncio base have the same surface, and each
    # client derives from one of them.
    from kvcm.client import WorkerClient
    from kvcm.client._base import AsyncChannelClient, ChannelClient

    assert issubclass(SchedulerClient, ChannelClient)
    assert issubclass(WorkerClient, ChannelClient)
    assert issubclass(AsyncSchedulerClient, AsyncChannelClient)
    sync = {"_unary", "close", "__enter__", "__exit__"}
    aio = {"_unary", "close", "__aenter__", "__aexit__"}
    assert sync <= set(vars(ChannelClient))
    assert aio <= set(vars(AsyncChannelClient))
    for name in ("_unary", "close"):
        assert inspect.signature(getattr(ChannelClient, name)) == inspect.signature(
            getattr(AsyncChannelClient, name)
        )
        assert inspect.iscoroutinefunction(getattr(AsyncChannelClient, name))
        assert not inspect.iscoroutinefunction(getattr(ChannelClient, name))
    # The clients themselves open no channel and map no error: none defines its own plumbing.
    for client in (SchedulerClient, AsyncSchedulerClient, WorkerClient):
        assert not (sync | aio | {"_open_channel"}) & set(vars(client)), client
    assert str(inspect.signature(SchedulerClient)) == str(inspect.signature(AsyncSchedulerClient))
    worker = inspect.signature(WorkerClient).parameters
    assert list(worker) == list(inspect.signature(SchedulerClient).parameters)
    assert worker["timeout"].default == 600.0
