"""The SDK's twins cannot drift: the two scheduler clients, and the one SlotOptions.

``scripts/gen_sync_client.py`` derives ``kvcm.client.scheduler`` from ``kvcm.client.aio``;
these tests fail when the generated module is stale and check what the generation promises:
the same public methods with the same signatures and docstrings, coroutines on one side and
plain functions on the other. The SDK's ``SlotOptions`` is the core's.
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


def test_slot_options_are_one_type_and_unset_lookahead_stays_off_the_unary_wire() -> None:
    # kvcm.client.SlotOptions is the core's class (one type per concept, as ItemStatus); the
    # in-flight tokens travel beside it, as in Pool.allocate. Unset lookahead (None) stays
    # off the unary wire, an explicit 0 travels; in a Step both take the Step's default, so
    # neither travels there.
    from kvcm.client import SlotOptions
    from kvcm.client._base import build_allocate_slots
    from kvcm.core import manager
    from kvcm.core.program import AllocOptions, OpKind, StepProgram
    from kvcm.wire import program_to_proto, slot_options_from_proto

    assert SlotOptions is manager.SlotOptions
    unset = build_allocate_slots(
        "p",
        1,
        num_new_tokens=4,
        num_computed_tokens=0,
        hit=None,
        options=SlotOptions(reserved_blocks=1),
    )
    zero = build_allocate_slots(
        "p",
        1,
        num_new_tokens=4,
        num_computed_tokens=0,
        hit=None,
        options=SlotOptions(num_lookahead_tokens=0, reserved_blocks=1),
        num_in_flight_tokens=3,
    )
    assert not unset.options.HasField("num_lookahead_tokens")
    assert zero.options.HasField("num_lookahead_tokens")
    assert zero.options.num_in_flight_tokens == 3
    assert slot_options_from_proto(unset.options)[0].num_lookahead_tokens is None
    assert slot_options_from_proto(zero.options) == (
        SlotOptions(num_lookahead_tokens=0, reserved_blocks=1),
        3,
    )
    # An in-flight count alone still travels, with the default options.
    only = build_allocate_slots(
        "p",
        1,
        num_new_tokens=4,
        num_computed_tokens=0,
        hit=None,
        options=manager.DEFAULT_SLOT_OPTIONS,
        num_in_flight_tokens=2,
    )
    assert slot_options_from_proto(only.options) == (manager.DEFAULT_SLOT_OPTIONS, 2)
    program = StepProgram(
        ops=[OpKind.ALLOCATE, OpKind.ALLOCATE],
        request_keys=[1, 2],
        alloc_num_new_tokens=[4, 4],
        alloc_num_computed_tokens=[0, 0],
        alloc_options={
            0: AllocOptions(slot_options=SlotOptions(num_lookahead_tokens=0, reserved_blocks=1)),
            1: AllocOptions(slot_options=SlotOptions(reserved_blocks=1)),
        },
    )
    first, second = program_to_proto(program, "p").alloc_options
    assert first.options == second.options
    assert not first.options.HasField("num_lookahead_tokens")


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
    # A worker looks nothing up: the scheduler clients' lookup_address is theirs alone.
    scheduler = [p for p in inspect.signature(SchedulerClient).parameters if p != "lookup_address"]
    assert list(worker) == scheduler
    assert worker["timeout"].default == 600.0
