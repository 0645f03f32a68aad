"""The operator's commands (``kvcm pools|describe|lookup|events``) against a real server.

A real server on loopback with bearer tokens and the ZMQ KV-event stream on; pools filled by
the workload generator's replay scheduler through the SDK. Each command runs in-process
(``kvcm.cli.main``, stdout captured) in text and in ``--json``, and its answer is checked
against what the SDK's own calls say; a few run as the real ``python -m kvcm.cli`` process to
check the entry point and the one-line errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcm.cli import main
from kvcm.client import (
    LookupQuery,
    PoolConfig,
    SchedulerClient,
    ServiceAlreadyExistsError,
    StepBuilder,
    StepResult,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import HashAlgorithm
from kvcm.common.specs import FullAttentionSpec
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from workload import ReplayScheduler, WorkloadOptions, make_workload

TOKEN = "operator-token"
READER_TOKEN = "reader-b-token"
CLI = [sys.executable, "-m", "kvcm.cli"]
POOLS = ("chat-0", "chat-1")
TRACE = make_workload(WorkloadOptions(num_requests=24, seed=3, arrivals_per_step=3))


def _config(role: str) -> PoolConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
    layout = KVCacheConfig(
        num_blocks=512,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )
    return PoolConfig(
        max_model_len=4096,
        explicit_layout=layout,
        hash_algorithm=HashAlgorithm.SHA256_CBOR,
        enable_kv_cache_events=True,
        labels={"model": "tiny", "role": role},
        scheduler_lease_s=30.0,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    folder = tmp_path_factory.mktemp("cli")
    tokens = folder / "tokens.toml"
    entries = [("ops", TOKEN, "admin:*"), ("router-b", READER_TOKEN, "reader:b-*")]
    tokens.write_text(
        "".join(
            f'[[tokens]]\nname = "{name}"\n'
            f'sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\nroles = ["{roles}"]\n'
            for name, token, roles in entries
        ),
        encoding="utf-8",
    )
    settings = ServerSettings(
        grpc_address="127.0.0.1:0",
        http_address="",
        log_level="WARNING",
        auth_tokens=str(tokens),
        kv_events_endpoint="tcp://*:0",
    )
    running = start_embedded_server(settings)
    try:
        with SchedulerClient(running.grpc_address, token=TOKEN) as client:
            for index, pool_id in enumerate(POOLS):
                client.create_pool(pool_id, _config("decode" if index else "prefill"))
            hasher = client.block_hasher(POOLS[0])

            def backend(builder: StepBuilder) -> StepResult:
                return client.step(POOLS[0], builder)

            ReplayScheduler(backend, TRACE, hasher, max_num_batched_tokens=1024).run()
        yield running
    finally:
        running.stop()


@pytest.fixture
def env(server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The variables an operator's shell would hold; the commands read them."""
    values = {"KVCM_GRPC_ADDRESS": server.grpc_address, "KVCM_TOKEN": TOKEN}
    for name in ("KVCM_CONFIG", "KVCM_TLS_CA", "KVCM_TLS_CERT", "KVCM_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_pools_lists_every_pool_with_labels_usage_and_events(
    env: dict[str, str], server: EmbeddedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with SchedulerClient(server.grpc_address, token=TOKEN) as client:
        infos = {pool_id: client.describe_pool(pool_id) for pool_id in POOLS}
    code, out, err = _run(capsys, "pools", "--json")
    assert (code, err) == (0, "")
    records = {record["pool_id"]: record for record in json.loads(out)["pools"]}
    assert sorted(records) == sorted(POOLS)
    for pool_id, info in infos.items():
        record = records[pool_id]
        assert record["labels"] == dict(info.config.labels)
        assert record["usage"] == pytest.approx(info.usage)
        assert record["num_free_blocks"] == info.num_free_blocks
        assert record["epoch"] == info.epoch
        assert record["last_event_sequence"] == info.last_event_sequence
        assert record["num_blocks"] == 512
    assert records["chat-0"]["last_event_sequence"] > 0  # the workload cached blocks
    totals = infos["chat-0"].prefix_cache
    assert totals.hits > 0  # shared system prompts hit
    assert records["chat-0"]["hit_rate"] == pytest.approx(totals.hits / totals.queries)
    assert records["chat-1"]["hit_rate"] == 0
    assert records["chat-1"]["last_event_sequence"] == 0
    code, out, err = _run(capsys, "pools")
    assert (code, err) == (0, "")
    header, *lines = out.splitlines()
    assert header.split()[:4] == ["POOL", "STATE", "LABELS", "BLOCKS"]
    by_pool = {line.split()[0]: line.split() for line in lines}
    assert by_pool["chat-0"][7] == f"{100 * totals.hits / totals.queries:.1f}%"
    assert by_pool["chat-0"][1:3] == ["READY", "model=tiny,role=prefill"]
    assert by_pool["chat-1"][2] == "model=tiny,role=decode"
    free = infos["chat-0"].num_free_blocks
    assert by_pool["chat-0"][3:5] == ["512", str(free)]


def test_pools_answers_only_what_the_token_may_read(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCM_TOKEN", READER_TOKEN)  # reader:b-*: none of the pools
    code, out, _ = _run(capsys, "pools", "--json")
    assert code == 0
    assert json.loads(out) == {"pools": []}
    code, out, _ = _run(capsys, "pools")
    assert out.strip() == "no pools"


def test_describe_shows_config_groups_usage_epoch_events_and_leases(
    env: dict[str, str], server: EmbeddedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with SchedulerClient(server.grpc_address, token=TOKEN) as client:
        info = client.describe_pool("chat-0")
    code, out, err = _run(capsys, "describe", "chat-0", "--json")
    assert (code, err) == (0, "")
    document = json.loads(out)
    assert document["pool_id"] == "chat-0"
    assert document["state"] == "READY"
    assert document["epoch"] == info.epoch
    assert document["config"]["labels"] == {"model": "tiny", "role": "prefill"}
    assert document["config"]["scheduler_lease_s"] == 30.0
    assert document["config"]["lease_expiry"] == "FREE_REQUESTS"
    assert document["hashing"]["algorithm"] == "SHA256_CBOR"
    assert document["last_event_sequence"] == info.last_event_sequence
    assert document["kv_cache_config"]["num_blocks"] == 512
    assert document["zmq_events"]["topic"] == info.zmq_events.topic  # type: ignore[union-attr]
    code, out, err = _run(capsys, "describe", "chat-0")
    assert (code, err) == (0, "")
    head = out.split("\n\n", 1)[0].splitlines()
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in head)
    assert fields["state"] == "READY"
    assert fields["epoch"] == str(info.epoch)
    assert fields["labels"] == "model=tiny,role=prefill"
    assert fields["usage"].endswith(f"({info.num_free_blocks} of 512 blocks free)")
    assert f"last sequence {info.last_event_sequence}" in fields["events"]
    assert fields["leases"] == "scheduler 30s, on expiry FREE_REQUESTS"
    assert "sha256_cbor, 16 tokens a block" in fields["hashing"]
    assert "groups:" in out
    assert any(line.split()[:3] == ["0", "FullAttentionSpec", "16"] for line in out.splitlines())


def test_describe_of_an_unknown_pool_is_one_line_with_the_fix(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "describe", "nope")
    assert (code, out) == (1, "")
    assert err.count("\n") == 1
    assert "nope" in err
    assert "`kvcm pools` lists the pools" in err


def test_lookup_answers_as_the_lookup_rpc(
    env: dict[str, str], server: EmbeddedServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    prompt = list(TRACE[0].prompt_token_ids)
    with SchedulerClient(server.grpc_address, token=TOKEN) as client:
        expected = client.lookup(LookupQuery(token_ids=prompt))
        hasher = client.block_hasher("chat-0")
    assert expected.pools[0].pool_id == "chat-0"
    assert expected.pools[0].num_hit_tokens > 0
    ids = tmp_path / "prompt.txt"
    ids.write_text(" ".join(map(str, prompt)), encoding="utf-8")
    code, out, err = _run(capsys, "lookup", "--tokens-file", str(ids), "--json")
    assert (code, err) == (0, "")
    answer = json.loads(out)
    assert [p["pool_id"] for p in answer["pools"]] == [p.pool_id for p in expected.pools]
    assert [p["num_hit_tokens"] for p in answer["pools"]] == [
        p.num_hit_tokens for p in expected.pools
    ]
    assert answer["num_pools_in_scope"] == 2
    # Text, scoped by label, prompt as --tokens.
    code, out, err = _run(capsys, "lookup", "--tokens", ",".join(map(str, prompt)), "--label",
                          "role=prefill")  # fmt: skip
    assert (code, err) == (0, "")
    header, row, scope = out.splitlines()
    assert header.split()[:4] == ["RANK", "POOL", "HIT_TOKENS", "TOKENS"]
    assert row.split()[:4] == ["1", "chat-0", str(expected.pools[0].num_hit_tokens),
                               str(len(prompt))]  # fmt: skip
    assert scope == "1 pool(s) in scope"
    # Block hashes, in hex: the same hit.
    hashes = hasher.hash_token_ids(prompt)
    hex_hashes = [bytes(h).hex() for h in hashes]
    flags = [f"--hashes={h}" for h in hex_hashes]
    code, out, err = _run(capsys, "lookup", "--pool", "chat-0", "--json",
                          "--num-tokens", str(len(prompt)), *flags)  # fmt: skip
    assert (code, err) == (0, "")
    assert json.loads(out)["pools"][0]["num_hit_tokens"] == expected.pools[0].num_hit_tokens


def test_lookup_refuses_bad_input_in_one_line(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, "lookup", "--tokens", "1,two,3")
    assert code == 2
    assert "item 1 is 'two', not a token id" in err
    assert err.count("\n") == 1
    code, _, err = _run(capsys, "lookup", "--tokens", "1", "--pool", "missing")
    assert code == 1
    assert "missing" in err
    assert err.count("\n") == 1
    code, _, err = _run(capsys, "lookup", "--hashes", "zz")
    assert code == 2
    assert "--hashes: not hex" in err


def _step_once(address: str, pool_id: str, key: int) -> None:
    with SchedulerClient(address, token=TOKEN) as client:
        hasher = client.block_hasher(pool_id)
        prompt = [7000 + key * 64 + i for i in range(64)]
        builder = StepBuilder()
        builder.add_request(key, prompt, hasher.hash_token_ids(prompt))
        builder.allocate(key, len(prompt), 0, lookup=True)
        builder.finish(key)
        client.step(pool_id, builder)


def test_events_follows_the_grpc_stream(
    env: dict[str, str], server: EmbeddedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with SchedulerClient(server.grpc_address, token=TOKEN) as client:
        start = client.describe_pool("chat-1").last_event_sequence + 1
    _step_once(server.grpc_address, "chat-1", key=1)
    code, out, err = _run(capsys, "events", "chat-1", "--from", str(start), "--count", "1",
                          "--json")  # fmt: skip
    assert (code, err) == (0, "")
    batch = json.loads(out)
    assert batch["pool_id"] == "chat-1"
    assert batch["first_sequence"] == start
    stored = batch["events"][0]
    assert len(stored["block_hashes"]) == 4  # 64 tokens, 16 a block
    code, out, err = _run(capsys, "events", "chat-1", "--from", str(start), "--count", "1")
    assert (code, err) == (0, "")
    first, event = out.splitlines()[:2]
    assert first.startswith(f"chat-1 seq {start}-")
    assert event.strip().startswith(f"{start} BlockStored group 0: 4 block(s)")


def test_events_reads_the_zmq_wire(
    env: dict[str, str], server: EmbeddedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("zmq")
    done: dict[str, object] = {}

    def follow() -> None:
        done["code"] = main(["events", "chat-1", "--zmq", "--count", "1", "--json"])

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    # PUB drops what it sends before the SUB connects: step until a batch gets through.
    seq = 100
    while reader.is_alive() and seq < 160:
        seq += 1
        _step_once(server.grpc_address, "chat-1", key=seq)
        reader.join(0.2)
    assert not reader.is_alive(), "no ZMQ batch arrived"
    assert done["code"] == 0
    out, _ = capsys.readouterr()
    record = json.loads(out.splitlines()[0])
    assert record["topic"].split("@")[1] == "chat-1"
    _timestamp, events, _rank = record["batch"]
    assert events[0]["type"] == "BlockStored"


def test_the_entry_point_runs_as_a_process_with_one_line_errors(
    env: dict[str, str], server: EmbeddedServer, tmp_path: Path
) -> None:
    ok = subprocess.run([*CLI, "pools"], capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0].startswith("POOL")
    no_token = subprocess.run(
        [*CLI, "pools", "--token", "wrong"], capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert no_token.returncode == 1
    assert no_token.stderr.count("\n") == 1
    assert "Traceback" not in no_token.stderr
    assert "--token" in no_token.stderr
    # The address from the server's own TOML, a wildcard host reached on loopback.
    port = server.grpc_address.rsplit(":", 1)[1]
    config = tmp_path / "kvcm.toml"
    config.write_text(f'[server]\ngrpc_address = "0.0.0.0:{port}"\n', encoding="utf-8")
    environ = {k: v for k, v in env.items() if k != "KVCM_GRPC_ADDRESS"}
    from_toml = subprocess.run(
        [*CLI, "describe", "chat-1", "--config", str(config), "--json"],
        capture_output=True, text=True, timeout=60, check=False,
        env={**{k: v for k, v in os.environ.items() if k != "KVCM_GRPC_ADDRESS"}, **environ},
    )  # fmt: skip
    assert from_toml.returncode == 0, from_toml.stderr
    assert json.loads(from_toml.stdout)["pool_id"] == "chat-1"
    down = subprocess.run(
        [*CLI, "pools", "--grpc-address", "127.0.0.1:1", "--timeout", "2"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert down.returncode == 1
    assert down.stderr.count("\n") == 1
    assert "is `kvcm serve` running there?" in down.stderr


def test_data_dir_check_runs_under_the_same_command(tmp_path: Path) -> None:
    result = subprocess.run(
        [*CLI, "data-dir", "check", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["status"] != "damaged"


def test_reading_the_hit_rate_drains_nothing(
    env: dict[str, str], server: EmbeddedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """DescribePool's lifetime counters leave the scheduler's TakePrefixCacheStats whole."""
    with SchedulerClient(server.grpc_address, token=TOKEN) as client:
        client.create_pool("chat-drain", _config("prefill"))
        _step_once(server.grpc_address, "chat-drain", key=1)
        for _ in range(2):
            code, out, _ = _run(capsys, "describe", "chat-drain", "--json")
            assert code == 0
            assert json.loads(out)["prefix_cache"]["queries"] == 64
        taken = client.take_prefix_cache_stats("chat-drain")
        assert taken is not None
        assert taken.queries == 64
        assert client.describe_pool("chat-drain").prefix_cache.queries == 64
        client.delete_pool("chat-drain")


def test_a_second_scheduler_on_a_busy_pool_is_told_whose_key_it_is(
    server: EmbeddedServer,
) -> None:
    prompt = [900 + i for i in range(32)]
    with (
        SchedulerClient(server.grpc_address, token=TOKEN) as first,
        SchedulerClient(server.grpc_address, token=TOKEN) as second,
    ):
        first.create_pool("busy", _config("decode"))
        hashes = first.block_hasher("busy").hash_token_ids(prompt)
        builder = StepBuilder(step_seq=1)
        builder.add_request(0, prompt, hashes)
        first.step("busy", builder)
        again = StepBuilder()
        again.add_request(0, prompt, hashes)
        with pytest.raises(ServiceAlreadyExistsError) as by_step:
            second.step("busy", again)
        with pytest.raises(ServiceAlreadyExistsError) as by_call:
            second.add_request("busy", 0, prompt, hashes)
        for error in (by_step.value, by_call.value):
            assert "request key 0 is live in pool 'busy'" in error.details
            assert "another scheduler is likely driving this pool (its last step was 1)" in (
                error.details
            )
            assert "give this one its own pool" in error.details
        assert first.describe_pool("busy").num_requests == 1  # nothing changed
        first.delete_pool("busy")


def test_the_commands_speak_mutual_tls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_tls import Pki, _start

    for name in ("KVCM_GRPC_ADDRESS", "KVCM_TOKEN", "KVCM_CONFIG", "KVCM_TLS_CA", "KVCM_TLS_CERT"):
        monkeypatch.delenv(name, raising=False)
    pki = Pki(tmp_path, "cli")
    running, _, _ = _start(pki, client_ca=True)
    try:
        ca = str(pki.write("ca.pem", pki.ca_pem))
        cert, key = pki.issue("operator")
        client_cert, client_key = str(pki.write("op.pem", cert)), str(pki.write("op.key", key))
        address = ["--grpc-address", running.grpc_address, "--timeout", "5"]
        mutual = ["--tls-client-cert", client_cert, "--tls-client-key", client_key]
        code, out, err = _run(capsys, "pools", *address, "--tls-ca", ca, *mutual)
        assert (code, err) == (0, "")
        assert out.strip() == "no pools"
        monkeypatch.setenv("KVCM_TLS_CA", ca)  # the variable, without a client certificate
        code, out, err = _run(capsys, "pools", *address)
        assert code == 1
        assert out == ""
        assert err.count("\n") == 1
        code, _, err = _run(capsys, "pools", *address, "--tls-client-cert", client_cert)
        assert code == 2
        assert "--tls-client-cert and --tls-client-key go together" in err
    finally:
        running.stop()


def test_the_operator_commands_run_without_the_server_installed(server: EmbeddedServer) -> None:
    """On the base install (no FastAPI, uvicorn, ...): the SDK commands work, `serve` says what
    to install, in one line."""
    blocked = ["fastapi", "starlette", "uvicorn", "prometheus_client", "grpc_health"]
    script = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "from kvcm.cli import main\n"
        f"code = main(['pools', '--grpc-address', {server.grpc_address!r}, '--json'])\n"
        "assert 'fastapi' not in sys.modules or sys.modules['fastapi'] is None\n"
        "raise SystemExit(code * 10 + main(['serve', '--grpc-address', '127.0.0.1:0']))\n"
    )
    env = {**os.environ, "KVCM_TOKEN": TOKEN}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr  # pools: 0, serve: 2
    assert json.loads(result.stdout)["pools"]
    assert result.stderr.count("\n") == 1
    assert "pip install 'kvcm[server]'" in result.stderr
