"""vLLM 0.33's own P/D flow (``NixlConnector``, pull mode) on kvcm pools, against vLLM's.

Each case builds two clusters of two vLLM ``EngineCore`` s (tests/compat/_engine_core.py): a
prefill engine (``kv_producer``) and a decode engine (``kv_consumer``), both with vLLM's
``NixlConnector``, whose scheduler side builds on CPU without NIXL installed; the simulated
workers move KV over a deterministic :class:`~_engine_core.TransferFabric` and report
``finished_sending`` / ``finished_recving`` (and load failures) to the scheduler side as NIXL's
workers do. One cluster runs vLLM's own schedulers, the other kvcm's (``KvcmScheduler`` /
``KvcmAsyncScheduler``, each engine on its own pool of one kvcm server on 127.0.0.1, in
mirror or remote mode). A proxy written here plays vLLM's P/D example proxy: it sends each
conversation turn to the prefill engine with ``do_remote_decode`` (one token), takes the
``kv_transfer_params`` the prefill engine answers, and sends the turn to the decode engine
with them (``do_remote_prefill``); the decode engine's output extends the conversation.

Every turn of both engines is compared: ``SchedulerOutput`` (block tables included), what the
connector's scheduler side handed the workers (blocks to pull, leases, aborts),
``EngineCoreOutputs`` (``kv_transfer_params`` and ``SchedulerStats`` with the connector's
prefix-cache stats included) and KV events; at the end the pools (free queue order and
reference counts) are equal, nothing is held, and the server's copy equals each mirror.

Scenarios: plain P/D; the decode engine's own prefix hit (it pulls only what it lacks);
load failures (the whole pull, or blocks from an index on) recomputed; decode requests
aborted before they were scheduled (the prefill engine's blocks are released at once) and
while decoding (an asynchronous decode engine's deferred free); a decode engine that never
pulls (the prefill lease runs out); multi-turn conversations. In CI all of them run at once
per mode and loop; ``KVCM_LONG=1`` also runs each alone and 1,280 conversations with over
1,000 faulty transfers. Faults of kvcm itself: the server restarted mid-transfer.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from _engine_core import (
    VOCAB,
    Engine,
    RequestPlan,
    Setup,
    TransferFabric,
    build_engine,
    plain,
    workload_scale,
)
from _program_replay import pool_state

from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

# The prefill lease: 8 turns of the driver. vLLM's decode side renews leases with heartbeats
# every kv_lease_duration / 6 seconds of wall time (after a first one at once); a lease of 600 s
# keeps that wall-clock beat out of the compared runs, which last seconds.
LEASE_S = 600
LEASE_TURNS = 8
# Conversations of the "faults" scenario per workload_scale() (KVCM_LONG only).
FAULTY_CONVERSATIONS = 320
# Turns after a decode request is sent that an "abort-while-decoding" fault aborts it.
ABORT_AFTER_TURNS = 4
# What vLLM's P/D proxies send the prefill engine.
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Conversation:
    """A conversation the proxy drives: user turns, each prefilled then decoded.

    Attributes:
        conv_id: Names its requests (``<conv_id>-<turn>``).
        arrival: The driver turn its first user turn arrives.
        user_turns: The new user tokens of each turn (appended to the history).
        max_tokens: Tokens the decode engine generates per turn.
        faults: Per turn index: ``"never-pull"`` (the proxy never sends the turn to the
            decode engine), ``"abort-before-schedule"`` (sent and aborted before the decode
            engine schedules it), ``"fail"`` / an int (the decode engine's pull fails, wholly
            or from that block on).
        delays: Per turn index: driver turns the user takes before sending it.
    """

    conv_id: str
    arrival: int
    user_turns: list[tuple[int, ...]]
    max_tokens: int = 6
    faults: dict[int, str | int] = field(default_factory=dict)
    delays: dict[int, int] = field(default_factory=dict)
    # The proxy's state.
    history: tuple[int, ...] = ()
    turn: int = 0
    next_at: int = 0
    pending: RequestPlan | None = None
    decoded_params: dict[str, Any] | None = None


@dataclass
class PdTally:
    """What a compared run covered."""

    turns: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    pulls: int = 0
    prefill_pulls: int = 0
    pull_tokens: int = 0
    local_hit_tokens: int = 0
    events: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    fabric: dict[str, int] = field(default_factory=dict)


def _connector_meta(batch: Any) -> Any:
    # What the connector's scheduler side handed the workers, less wall-clock values
    # (deadlines, heartbeat timing).
    meta = batch.kv_connector_metadata
    if meta is None:
        return None
    return {
        "recv": {
            req_id: (
                plain(m.local_block_ids),
                plain(m.local_num_computed_blocks),
                m.awaiting_kvs,
                plain(m.remote.block_ids),
                m.remote.engine_id,
                m.remote.request_id,
                m.remote.num_tokens,
            )
            for req_id, m in sorted(meta.reqs_to_recv.items())
        },
        "send": sorted(meta.reqs_to_send),
        "in_batch": sorted(meta.reqs_in_batch),
        "not_processed": sorted(meta.reqs_not_processed),
    }


def _without_deadlines(outputs: Any) -> Any:
    # A decode engine's bidirectional answer carries its blocks' expiry as a wall-clock value
    # (perf_counter); keep whether it is set.
    for client_outputs in (outputs or {}).values():
        for output in client_outputs["outputs"]:
            params = output.get("kv_transfer_params")
            if params and params.get("remote_blocks_expiry_time") is not None:
                params["remote_blocks_expiry_time"] = "set"
    return outputs


class PdCluster:
    """A prefill engine, a decode engine, their fabric, and the proxy between them."""

    def __init__(
        self,
        prefill: Engine,
        decode: Engine,
        fabric: TransferFabric,
        bidirectional: bool = False,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.fabric = fabric
        self.bidirectional = bidirectional
        self.decoded: dict[str, list[int]] = {}
        self.aborts: dict[int, str] = {}  # driver turn -> decode request to abort then
        # Called before each turn while the prefill engine lives; True: it dies now (it is
        # never stepped again, the proxy sends it nothing more).
        self.prefill_dies: Callable[[int, PdCluster], bool] | None = None
        self.prefill_dead = False
        self.in_prefill: set[str] = set()  # conversations whose turn the prefill engine runs

    def engines(self) -> tuple[Engine, Engine]:
        return self.prefill, self.decode

    def _record(self, engine: Engine, outputs: Any, executed: bool) -> dict[str, Any]:
        batches = engine.take_scheduled()
        return {
            "scheduled": plain(batches),
            "connector": [_connector_meta(b) for b in batches],
            "outputs": _without_deadlines(plain(outputs)),
            "executed": executed,
            "events": plain(engine.take_events()),
        }

    def run(self, conversations: list[Conversation]) -> Iterator[Any]:
        """Drive the conversations to their end; one record per driver turn."""
        max_turns = 600 + 12 * len(conversations)
        convs = [
            Conversation(
                c.conv_id,
                c.arrival,
                list(c.user_turns),
                c.max_tokens,
                dict(c.faults),
                dict(c.delays),
            )
            for c in conversations
        ]
        for conv in convs:
            conv.next_at = conv.arrival
        by_request: dict[str, Conversation] = {}
        for turn in range(max_turns):
            self.fabric.now = turn
            for conv in convs:
                self._proxy(conv, turn, by_request)
            aborted = self.aborts.pop(turn, None)
            if aborted is not None and aborted in self.decode.scheduler.requests:
                # The client went away while the decode engine runs the request.
                self.decode.abort([aborted])
                self._end_turn(by_request[aborted], turn + 1)
            dies = self.prefill_dies
            if not self.prefill_dead and dies is not None and dies(turn, self):
                self.prefill_dead = True
                self.fabric.dead.add("prefill")
            p_out: dict[int, Any] | None = None
            p_ran = False
            if not self.prefill_dead:
                p_out, p_ran = self.prefill.step()
            p_record = self._record(self.prefill, p_out, p_ran)
            d_out, d_ran = self.decode.step()
            d_record = self._record(self.decode, d_out, d_ran)
            self._take_prefill(p_out, by_request, turn)
            self._take_decode(d_out, by_request, turn)
            yield turn, p_record, d_record
            if self.prefill_dead:
                # Conversations waiting on the dead prefill engine end there.
                for conv in convs:
                    if conv.conv_id in self.in_prefill:
                        conv.turn = len(conv.user_turns)
                self.in_prefill.clear()
            prefill_busy = not self.prefill_dead and self.prefill.has_work()
            if all(c.turn >= len(c.user_turns) for c in convs) and not (
                prefill_busy or self.decode.has_work()
            ):
                return
        raise AssertionError(f"the P/D flow did not end in {max_turns} turns")

    def _proxy(self, conv: Conversation, turn: int, by_request: dict[str, Conversation]) -> None:
        if conv.pending is not None:
            # The prefill answered: send the turn to the decode engine (or not).
            plan, conv.pending = conv.pending, None
            fault = conv.faults.get(conv.turn)
            if fault == "never-pull":
                self._end_turn(conv, turn + 1)
                return
            if isinstance(fault, int) or fault == "fail":
                self.fabric.failures[plan.request_id] = fault
            self.decode.add(plan)
            if fault == "abort-before-schedule":
                self.decode.abort([plan.request_id])
                self._end_turn(conv, turn + 1)
            elif fault == "abort-while-decoding":
                self.aborts[turn + ABORT_AFTER_TURNS] = plan.request_id
                conv.faults[conv.turn] = "aborted"
            return
        if conv.turn >= len(conv.user_turns) or conv.next_at != turn:
            return
        if self.prefill_dead:
            conv.turn = len(conv.user_turns)  # nowhere to prefill: the user gives up
            return
        request_id = f"{conv.conv_id}-{conv.turn}"
        prompt = conv.history + conv.user_turns[conv.turn]
        by_request[request_id] = conv
        params = PREFILL_PARAMS
        if self.bidirectional and conv.decoded_params is not None:
            # vLLM's bidirectional flow: the decode engine kept the last turn's blocks and
            # answered where they are; the prefill engine may pull them.
            params = {**conv.decoded_params, "do_remote_decode": True, "do_remote_prefill": False}
        self.prefill.add(RequestPlan(turn, request_id, prompt, 1, kv_transfer_params=params))
        self.in_prefill.add(conv.conv_id)
        conv.next_at = -1

    def _take_prefill(
        self, outputs: dict[int, Any] | None, by_request: dict[str, Conversation], turn: int
    ) -> None:
        for client_outputs in (outputs or {}).values():
            for output in client_outputs.outputs:
                if output.finish_reason is None:
                    continue
                conv = by_request[output.request_id]
                self.in_prefill.discard(conv.conv_id)
                params = output.kv_transfer_params
                assert params is not None
                assert params["do_remote_prefill"], params
                prompt = conv.history + conv.user_turns[conv.turn]
                conv.pending = RequestPlan(
                    turn + 1,
                    output.request_id,
                    prompt,
                    conv.max_tokens,
                    kv_transfer_params=params,
                )

    def _take_decode(
        self, outputs: dict[int, Any] | None, by_request: dict[str, Conversation], turn: int
    ) -> None:
        for client_outputs in (outputs or {}).values():
            for output in client_outputs.outputs:
                generated = self.decoded.setdefault(output.request_id, [])
                generated.extend(output.new_token_ids)
                if output.finish_reason is None:
                    continue
                conv = by_request[output.request_id]
                conv.history = conv.history + conv.user_turns[conv.turn] + tuple(generated)
                conv.decoded_params = output.kv_transfer_params
                self._end_turn(conv, turn + 1)

    @staticmethod
    def _end_turn(conv: Conversation, next_at: int) -> None:
        conv.turn += 1
        conv.next_at = next_at + conv.delays.get(conv.turn, 0)


# ----------------------------------------------------------------------------- building
def _setup(role: str, fabric: TransferFabric, engine_async: bool, extra: dict[str, Any]) -> Setup:
    return Setup(
        num_blocks=96,
        max_model_len=1024,
        max_num_batched_tokens=128,
        async_scheduling=engine_async,
        kv_transfer={
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "engine_id": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kv_lease_duration": LEASE_S, **extra},
        },
        fabric=fabric,
    )


def build_cluster(
    engine_async: bool,
    scheduler: tuple[type, type] | None,
    config: dict[str, Any] | None = None,
    *,
    pull_turns: int = 1,
    bidirectional: bool = False,
) -> PdCluster:
    """A prefill and a decode engine on one fabric; ``scheduler``: kvcm's (sync, async) pair,
    ``None`` for vLLM's; ``config``: the engines' ``additional_config`` per role;
    ``bidirectional``: vLLM's ``bidirectional_kv_xfer`` (the prefill engine pulls what the
    decode engine kept of the last turn)."""
    fabric = TransferFabric(pull_turns=pull_turns, seconds_per_turn=LEASE_S / LEASE_TURNS)
    extra: dict[str, Any] = {}
    if bidirectional:
        extra = {
            "bidirectional_kv_xfer": True,
            "decoder_kv_blocks_ttl": LEASE_S * 2,  # 16 turns
            "kv_recompute_threshold": 8,
        }
    engines = []
    for role in ("prefill", "decode"):
        cls = None if scheduler is None else scheduler[1 if engine_async else 0]
        additional = None if config is None else config[role]
        engines.append(build_engine(_setup(role, fabric, engine_async, extra), cls, additional))
    return PdCluster(engines[0], engines[1], fabric, bidirectional)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def scenario(name: str, seed: int = 0) -> list[Conversation]:
    """The conversations of a named scenario."""
    rng = random.Random(seed)
    system = _tokens(rng, 48)  # a shared system prompt (three blocks)
    if name == "plain":
        return [
            Conversation(f"c{i}", i * 2, [_tokens(rng, rng.randrange(20, 140))]) for i in range(8)
        ]
    if name == "decode-local-hit":
        # The decode engine has seen the system prompt: later turns pull only the rest.
        return [
            Conversation(f"c{i}", i * 6, [system + _tokens(rng, rng.randrange(10, 90))])
            for i in range(6)
        ]
    if name == "load-failure":
        return [
            Conversation("whole", 0, [system + _tokens(rng, 60)], faults={0: "fail"}),
            Conversation("partial", 3, [_tokens(rng, 100)], faults={0: 2}),
            Conversation("ok", 5, [system + _tokens(rng, 30)]),
            Conversation("after", 20, [system + _tokens(rng, 40)], faults={0: "fail"}),
        ]
    if name == "abort-before-schedule":
        return [
            Conversation("aborted", 0, [_tokens(rng, 70)], faults={0: "abort-before-schedule"}),
            Conversation("ok", 1, [_tokens(rng, 50)]),
            Conversation("hit-aborted", 8, [system + _tokens(rng, 20)]),
            Conversation(
                "aborted2", 9, [system + _tokens(rng, 30)], faults={0: "abort-before-schedule"}
            ),
            Conversation(
                "running",
                12,
                [_tokens(rng, 40)],
                max_tokens=30,
                faults={0: "abort-while-decoding"},
            ),
        ]
    if name == "lease-expiry":
        return [
            Conversation("never", 0, [_tokens(rng, 90)], faults={0: "never-pull"}),
            Conversation("ok", 2, [_tokens(rng, 40)]),
            Conversation("never2", 4, [system + _tokens(rng, 33)], faults={0: "never-pull"}),
            Conversation("late", 30, [system + _tokens(rng, 20)]),
        ]
    if name == "multi-turn":
        return [
            Conversation(
                f"c{i}",
                i * 3,
                [system + _tokens(rng, 20)]
                + [_tokens(rng, rng.randrange(5, 40)) for _ in range(3)],
                max_tokens=rng.choice((4, 9, 17)),
                faults={2: "fail"} if i == 1 else {},
            )
            for i in range(4)
        ]
    if name == "bidirectional":
        # Multi-turn with bidirectional transfers: each next turn's prefill pulls the history
        # the decode engine kept (one user pauses, within the decode engine's TTL); one decode
        # pull fails. (Not a failed prefill-side pull: vLLM 0.33 then matches the same remote
        # tokens again on the recompute and waits for a pull that never starts.)
        return [
            Conversation(
                f"c{i}",
                i * 3,
                [system + _tokens(rng, 24)]
                + [_tokens(rng, rng.randrange(4, 30)) for _ in range(2)],
                max_tokens=rng.choice((12, 17)),
                faults={1: "fail"} if i == 2 else {},
                delays={2: LEASE_TURNS} if i == 1 else {},
            )
            for i in range(4)
        ]
    if name == "faults":
        # Many transfers, most of them faulty, one new conversation per turn (KVCM_LONG).
        kinds: list[str | int | None] = [
            None,
            "never-pull",
            "fail",
            1,
            "abort-before-schedule",
            "abort-while-decoding",
        ]
        convs = []
        for i in range(FAULTY_CONVERSATIONS * workload_scale()):
            fault = rng.choice(kinds)
            prefix = system if rng.random() < 0.5 else ()
            convs.append(
                Conversation(
                    f"f{i}",
                    i,
                    [prefix + _tokens(rng, rng.randrange(20, 100))],
                    max_tokens=rng.choice((3, 8, 30)) if fault == "abort-while-decoding" else 3,
                    faults={} if fault is None else {0: fault},
                )
            )
        return convs
    if name == "all":
        # Every scenario at once, staggered, on the same two engines.
        mixed: list[Conversation] = []
        for index, part in enumerate(SCENARIOS):
            for conv in scenario(part, seed + index + 1):
                conv.conv_id = f"{part}/{conv.conv_id}"
                conv.arrival += index * 4
                mixed.append(conv)
        return mixed
    raise ValueError(name)


SCENARIOS = (
    "plain",
    "decode-local-hit",
    "load-failure",
    "abort-before-schedule",
    "lease-expiry",
    "multi-turn",
)


# ----------------------------------------------------------------------------- comparing
def _count(tally: PdTally, p_record: Any, d_record: Any) -> None:
    tally.turns += 1
    tally.prefill_batches += len(p_record["scheduled"])
    tally.decode_batches += len(d_record["scheduled"])
    tally.events += len(p_record["events"]) + len(d_record["events"])
    for meta in p_record["connector"]:
        tally.prefill_pulls += sum(v[2] for v in (meta or {}).get("recv", {}).values())
    for meta in d_record["connector"]:
        for local, computed, awaiting, *_ in (meta or {}).get("recv", {}).values():
            if awaiting:
                tally.pulls += 1
                tally.pull_tokens += len(local[0]) * 16
            tally.local_hit_tokens += computed[0] * 16 if computed else 0
    for role, record in (("prefill", p_record), ("decode", d_record)):
        for outputs in (record["outputs"] or {}).values():
            for output in outputs["outputs"]:
                if output["finish_reason"] is not None:
                    tally.finished[role] = tally.finished.get(role, 0) + 1


def assert_same_pd_runs(
    reference: PdCluster,
    kvcm: PdCluster,
    conversations: list[Conversation],
    after_turn: Callable[[int, PdCluster], None] | None = None,
) -> PdTally:
    """Both clusters' engines turn by turn: every record equal. ``after_turn(turn, kvcm)``
    runs after each compared turn (faults)."""
    tally = PdTally()
    for expected, actual in zip(reference.run(conversations), kvcm.run(conversations), strict=True):
        turn, p_expected, d_expected = expected
        _, p_actual, d_actual = actual
        for role, want, got in (
            ("prefill", p_expected, p_actual),
            ("decode", d_expected, d_actual),
        ):
            for key in ("scheduled", "connector", "outputs", "executed", "events"):
                assert got[key] == want[key], f"turn {turn}: the {role} engine's {key} differ"
        _count(tally, p_expected, d_expected)
        if after_turn is not None:
            after_turn(turn, kvcm)
    assert reference.fabric.log == kvcm.fabric.log
    for _, event, _, _ in reference.fabric.log:
        tally.fabric[event] = tally.fabric.get(event, 0) + 1
    return tally


def _free_state(block_pool: Any) -> dict[str, Any]:
    return {
        "free": [b.block_id for b in block_pool.free_block_queue.get_all_free_blocks()],
        "ref_cnts": [b.ref_cnt for b in block_pool.blocks[1:]],
    }


def _server_state(server: EmbeddedServer, pool_id: str) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        pool = await server.server.state.pool(pool_id)
        return pool_state(pool.ready_manager(), [])

    return server.call(read())


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def server(vllm: Any) -> Iterator[EmbeddedServer]:
    """One kvcm server on 127.0.0.1 (gRPC) for every case's pools."""
    del vllm
    embedded = start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    try:
        yield embedded
    finally:
        embedded.stop()


MODES = ("mirror", "remote")
# CI: every scenario at once ("all") in mirror mode (sync loop) and remote mode (both loops;
# remote mode checks every answer with the server); KVCM_LONG=1: every pair, each scenario alone.
PARAMS = [
    (name, mode, engine_async)
    for name in (("all", *SCENARIOS) if workload_scale() > 1 else ("all",))
    for mode in MODES
    for engine_async in (False, True)
    if workload_scale() > 1 or mode == "remote" or not engine_async
]
# KVCM_LONG=1: 1,280 conversations, over 1,000 with a faulty transfer, in both modes.
if workload_scale() > 1:
    PARAMS += [("faults", "mirror", False), ("faults", "remote", True)]


@pytest.mark.parametrize(("name", "mode", "engine_async"), PARAMS)
def test_pd_flow_on_kvcm_equals_vllm(
    name: str, mode: str, engine_async: bool, server: EmbeddedServer
) -> None:
    """Every turn of both engines equals vLLM's; the pools end equal and empty of requests."""
    check_pd_flow(name, mode, engine_async, server)


def check_pd_flow(name: str, mode: str, engine_async: bool, server: EmbeddedServer) -> PdTally:
    """Run scenario ``name`` on vLLM's and kvcm's clusters; check every turn and the ends."""
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    conversations = scenario(name, seed=len(name))
    bidirectional = name == "bidirectional"
    suffix = f"{name}-{mode}-{'async' if engine_async else 'sync'}"
    pools = {role: f"pd-{role}-{suffix}" for role in ("prefill", "decode")}
    config = {
        role: {"kvcm": {"address": server.grpc_address, "pool_id": pool, "mode": mode}}
        for role, pool in pools.items()
    }
    reference = build_cluster(engine_async, None, bidirectional=bidirectional)
    kvcm = build_cluster(
        engine_async, (KvcmScheduler, KvcmAsyncScheduler), config, bidirectional=bidirectional
    )
    try:
        tally = assert_same_pd_runs(reference, kvcm, conversations)
        for role, ref_engine, kvcm_engine in zip(
            ("prefill", "decode"), reference.engines(), kvcm.engines(), strict=True
        ):
            scheduler = kvcm_engine.scheduler
            manager = scheduler.kv_cache_manager
            assert not scheduler.requests
            assert not ref_engine.scheduler.requests
            # Nothing leaked: every block is free (cached or not) once the flow ended.
            assert all(b.ref_cnt == 0 for b in manager.core.block_pool.blocks[1:])
            assert _free_state(manager.core.block_pool) == _free_state(
                ref_engine.scheduler.kv_cache_manager.block_pool
            ), f"the {role} pools differ"
            assert manager.flush(30.0)
            stats = manager.recorder.sink.stats
            assert stats.mismatches == 0, stats
            assert stats.resyncs == 0, stats
            assert _server_state(server, pools[role]) == pool_state(manager.core, [])
        assert reference.decoded == kvcm.decoded
    finally:
        for engine in (*kvcm.engines(), *reference.engines()):
            engine.shutdown()
    print(f"{suffix}: {tally}")
    # The flow did what the scenario is about.
    assert tally.finished.get("prefill", 0) >= len(conversations)
    covers = {name} if name != "all" else set(SCENARIOS)
    if covers - {"lease-expiry"}:
        assert tally.pulls > 0
    if covers & {"decode-local-hit", "multi-turn"}:
        assert tally.local_hit_tokens > 0
    if "load-failure" in covers:
        assert tally.fabric.get("pull-failed", 0) >= 2
        assert tally.fabric.get("pull-partly-invalid", 0) == 1
    if "abort-before-schedule" in covers:
        assert tally.fabric.get("release", 0) >= 2
    if "lease-expiry" in covers:
        assert tally.fabric.get("lease-expired", 0) >= 2
    if name == "faults":
        faulty = sum(bool(c.faults) for c in conversations)
        print(f"{suffix}: {faulty} faulty transfers of {len(conversations)}, 0 blocks leaked")
        assert faulty >= 1000
    if bidirectional:
        # Prefill engines pulled what the decode engine kept of the conversations.
        assert tally.prefill_pulls >= 8
    return tally


@pytest.mark.parametrize("connector", ["NixlPushConnector", "ExampleConnector"])
def test_other_kv_connectors_are_refused(connector: str, vllm: Any) -> None:
    """A KV connector kvcm does not answer for is refused before vLLM builds anything."""
    from _engine_core import vllm_config

    from kvcm.common.errors import ConfigError
    from kvcm.integrations.vllm import check_supported

    del vllm
    setup = _setup("decode", TransferFabric(), False, {})
    transfer = {**(setup.kv_transfer or {}), "kv_connector": connector}
    config = vllm_config(dataclasses.replace(setup, kv_transfer=transfer))
    with pytest.raises(ConfigError, match="NIXL connector and its offloading connector"):
        check_supported(config)
    check_supported(vllm_config(setup))  # vLLM's NixlConnector is accepted


def _in_flight(cluster: PdCluster) -> tuple[int, int]:
    # (prefill requests finished and holding blocks for a pull, decode requests pulling)
    prefill = cluster.prefill.scheduler
    num_running, num_waiting = prefill.get_request_counts()
    held = len(prefill.requests) - num_running - num_waiting
    pulling = sum(
        r.status.name == "WAITING_FOR_REMOTE_KVS"
        for r in cluster.decode.scheduler.requests.values()
    )
    return held, pulling


def test_kvcm_restarted_mid_transfer(vllm: Any) -> None:
    """The kvcm server dies (every pool with it) and comes back on the same port while
    prefill engines hold blocks for pulls and decode engines pull: both engines schedule as
    vLLM's throughout, and each pool is resynchronised to its engine's mirror."""
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    del vllm
    servers = [start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))]
    address = servers[0].grpc_address
    pools = {role: f"pd-{role}-restart" for role in ("prefill", "decode")}
    config = {
        role: {"kvcm": {"address": address, "pool_id": pool, "step_timeout_s": 2}}
        for role, pool in pools.items()
    }
    restarts: list[tuple[int, tuple[int, int]]] = []

    def restart(turn: int, cluster: PdCluster) -> None:
        in_flight = _in_flight(cluster)
        if restarts or turn < 10 or not all(in_flight):
            return
        for engine in cluster.engines():
            assert engine.scheduler.kv_cache_manager.flush(10.0)
        servers[0].stop()
        servers[0] = start_embedded_server(ServerSettings(grpc_address=address, http_address=""))
        restarts.append((turn, in_flight))

    reference = build_cluster(False, None)
    kvcm = build_cluster(False, (KvcmScheduler, KvcmAsyncScheduler), config)
    try:
        tally = assert_same_pd_runs(reference, kvcm, scenario("all", seed=3), restart)
        assert restarts, "no turn had transfers in flight"
        for role, engine in zip(("prefill", "decode"), kvcm.engines(), strict=True):
            manager = engine.scheduler.kv_cache_manager
            assert manager.flush(30.0)
            stats = manager.sink.stats
            assert stats.resyncs >= 1, stats
            assert stats.mismatches == 0, stats
            assert _server_state(servers[0], pools[role]) == pool_state(manager.core, [])
            assert all(b.ref_cnt == 0 for b in manager.core.block_pool.blocks[1:])
    finally:
        for engine in (*kvcm.engines(), *reference.engines()):
            engine.shutdown()
        servers[0].stop()
    print(f"restarted at turn {restarts[0][0]} (held, pulling) = {restarts[0][1]}: {tally}")


def test_prefill_engine_dies_with_sources_held(vllm: Any) -> None:
    """The prefill engine dies while it holds blocks for pulls: the decode engine's pulls from
    it fail and are recomputed exactly as on vLLM's schedulers, and the server's scheduler
    lease gives the dead engine's held blocks back to its pool (nothing leaks)."""
    from kvcm.integrations.vllm import KvcmAsyncScheduler, KvcmScheduler

    del vllm
    lease_s = 1.0
    server = start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    pools = {role: f"pd-{role}-dies" for role in ("prefill", "decode")}
    config = {
        role: {
            "kvcm": {
                "address": server.grpc_address,
                "pool_id": pool,
                "lease_s": lease_s if role == "prefill" else 0.0,
            }
        }
        for role, pool in pools.items()
    }
    deaths: list[tuple[int, int, float]] = []

    def dies(turn: int, cluster: PdCluster) -> bool:
        held, pulling = _in_flight(cluster)
        if turn < 8 or not held or not pulling:
            return False
        manager = cluster.prefill.scheduler.kv_cache_manager
        if hasattr(manager, "sink"):  # kvcm's: the server has every step, then silence
            assert manager.flush(10.0)
            manager.sink.close(0.0)
            deaths.append((turn, held, time.monotonic()))
        return True

    reference = build_cluster(False, None)
    kvcm = build_cluster(False, (KvcmScheduler, KvcmAsyncScheduler), config)
    reference.prefill_dies = kvcm.prefill_dies = dies
    try:
        tally = assert_same_pd_runs(reference, kvcm, scenario("all", seed=3))
        assert deaths, "the prefill engine never held blocks while a pull ran"
        turn, held, died_at = deaths[0]
        assert tally.fabric.get("pull-failed", 0) >= 1
        decode = kvcm.decode.scheduler.kv_cache_manager
        assert decode.flush(30.0)
        assert _server_state(server, pools["decode"]) == pool_state(decode.core, [])
        # The dead engine's pool: its held requests are reclaimed by the lease, no block stays
        # referenced.
        while True:
            state = _server_state(server, pools["prefill"])
            if not any(state["ref_cnts"]):
                reclaimed_after = time.monotonic() - died_at
                break
            assert time.monotonic() - died_at < lease_s + 10, "the lease never reclaimed"
            time.sleep(0.05)
        assert not state["tables"]
    finally:
        for engine in (*kvcm.engines(), *reference.engines()):
            engine.shutdown()
        server.stop()
    print(
        f"prefill died at turn {turn} holding {held} requests' blocks; reclaimed "
        f"{reclaimed_after:.2f} s later (lease {lease_s} s): {tally}"
    )
    assert reclaimed_after >= lease_s
