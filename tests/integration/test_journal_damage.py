"""A damaged journal never loses acknowledged records silently; a torn tail is trimmed.

``kvcm serve --data-dir`` runs as a subprocess and is killed with SIGKILL after acknowledged
Steps; the test then damages ``journal.log`` as a disk would and starts the server again:

* a damaged record in the middle: the start is refused with one line naming the file and the
  byte offset, and the file is byte-identical afterwards; ``kvcm data-dir check`` reports the
  same offset and the records after it; ``recover`` without ``--drop-after-damage`` changes
  nothing; with it, it drops exactly the reported records and the server then starts with
  the Steps before the damage, as an in-process pool that ran them;
* a length field damaged in the middle (it claims more bytes than the file has) is damage too,
  not a torn tail;
* a torn tail (half a frame at the end; a last record whose CRC fails) is trimmed and the
  server starts with every acknowledged Step.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from _data_dir_server import CLI, CONFIG, Server, assert_pool_is, program

from kvcm.client import SchedulerClient


def frames(data: bytes) -> list[tuple[int, int]]:
    """(offset, length) of each frame of a journal (the test's own reading of the format)."""
    found = []
    at = 0
    while at + 8 <= len(data):
        (size,) = struct.unpack_from("<I", data, at)
        found.append((at, 8 + size))
        at += 8 + size
    return found


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def killed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory whose server answered CreatePool and Steps 1..100, then was killed
    (kill -9): its journal holds 101 records and there is no checkpoint."""
    data_dir = tmp_path_factory.mktemp("journaled") / "data"
    server = Server(data_dir)
    server.start()
    try:
        with SchedulerClient(server.address) as client:
            client.create_pool("p", CONFIG)
            for seq in range(1, 101):
                client.step("p", program(seq))
    finally:
        server.kill()
    return data_dir


@pytest.fixture
def journaled(killed_dir: Path, tmp_path: Path) -> Server:
    """A server (not started) on a copy of ``killed_dir``."""
    shutil.copytree(killed_dir, tmp_path / "data")
    return Server(tmp_path / "data")


def test_a_damaged_record_in_the_middle_stops_the_start_and_changes_nothing(
    journaled: Server,
) -> None:
    journal = journaled.data_dir / "journal.log"
    data = bytearray(journal.read_bytes())
    layout = frames(bytes(data))
    assert len(layout) == 101  # CreatePool, then Steps 1..100
    offset, length = layout[34]  # Step 34
    data[offset + length // 2] ^= 0x5A
    journal.write_bytes(bytes(data))
    damaged = bytes(data)

    err = journaled.refused()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcm serve: data_dir: ")
    assert str(journal) in lines[0]
    assert f"at byte {offset} " in lines[0]
    assert "66 intact records (seq 36..101)" in lines[0]  # Steps 35..100 follow it
    assert journal.read_bytes() == damaged  # nothing truncated or rewritten

    check = run_cli("data-dir", "check", str(journaled.data_dir), "--json")
    assert check.returncode == 1, check.stderr
    report = json.loads(check.stdout)
    assert report["status"] == "damaged"
    damage = report["journal"]["damage"]
    assert damage["offset"] == offset
    assert not damage["torn"]
    assert damage["records_after"] == 66
    assert damage["seq_after"] == [36, 101]
    assert damage["bytes_dropped"] == len(damaged) - offset
    assert report["journal"]["records"] == 34
    assert report["journal"]["last_seq"] == 34

    asked = run_cli("data-dir", "recover", str(journaled.data_dir))
    assert asked.returncode == 2
    assert "--drop-after-damage" in asked.stderr
    assert journal.read_bytes() == damaged

    recovered = run_cli("data-dir", "recover", str(journaled.data_dir), "--drop-after-damage")
    assert recovered.returncode == 0, recovered.stderr
    assert "dropped 66 intact records (seq 36..101)" in recovered.stdout
    assert f"{len(damaged) - offset} bytes from byte {offset}" in recovered.stdout
    assert journal.read_bytes() == damaged[:offset]
    saved = journaled.data_dir / f"journal.log.dropped-{offset}"
    assert saved.read_bytes() == damaged[offset:]
    assert run_cli("data-dir", "check", str(journaled.data_dir)).returncode == 0

    journaled.start()  # CreatePool and Steps 1..33 are back
    try:
        with SchedulerClient(journaled.address) as client:
            assert_pool_is(client, 33)
            client.step("p", program(34))  # the scheduler goes on from there
            assert_pool_is(client, 34)
    finally:
        journaled.stop()


def test_a_damaged_length_in_the_middle_is_not_taken_for_a_torn_tail(journaled: Server) -> None:
    journal = journaled.data_dir / "journal.log"
    data = bytearray(journal.read_bytes())
    offset, _ = frames(bytes(data))[50]
    struct.pack_into("<I", data, offset, len(data))  # claims more than the file holds
    journal.write_bytes(bytes(data))
    err = journaled.refused()
    assert f"at byte {offset} " in err
    assert "seq 52..101" in err
    assert "Traceback" not in err
    assert journal.read_bytes() == bytes(data)


@pytest.mark.parametrize("tear", ["half a frame", "last record's CRC"])
def test_a_torn_tail_is_trimmed_and_every_acknowledged_step_is_back(
    journaled: Server, tear: str
) -> None:
    journal = journaled.data_dir / "journal.log"
    data = journal.read_bytes()
    if tear == "half a frame":  # a crash in the middle of writing record 102
        torn = data + data[frames(data)[-1][0] :][:30]
        intact = len(data)
    else:  # the last record's bytes never reached the disk whole (never acknowledged)
        offset, _ = frames(data)[-1]
        torn = data[:-3] + b"\x00\x00\x00"
        intact = offset
    journal.write_bytes(torn)
    check = run_cli("data-dir", "check", str(journaled.data_dir), "--json")
    assert check.returncode == 0
    assert json.loads(check.stdout)["status"] == "torn_tail"
    journaled.start()
    try:
        with SchedulerClient(journaled.address) as client:
            assert_pool_is(client, 100 if tear == "half a frame" else 99)
    finally:
        journaled.stop()
    assert intact <= len(data)


def test_check_verifies_the_checkpoint_too(journaled: Server) -> None:
    journaled.start()  # the replay writes a checkpoint; a graceful stop another
    journaled.stop()
    checkpoint = journaled.data_dir / "checkpoint.bin"
    good = run_cli("data-dir", "check", str(journaled.data_dir), "--json")
    report = json.loads(good.stdout)
    assert good.returncode == 0
    assert report["status"] == "ok"
    assert [pool["pool_id"] for pool in report["checkpoint"]["pools"]] == ["p"]
    assert report["checkpoint"]["pools"][0]["error"] is None
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0x01
    checkpoint.write_bytes(bytes(data))
    bad = run_cli("data-dir", "check", str(journaled.data_dir))
    assert bad.returncode == 1
    assert "checkpoint.bin: DAMAGED" in bad.stdout
    refused = run_cli("data-dir", "recover", str(journaled.data_dir), "--drop-after-damage")
    assert refused.returncode == 1
    assert "only a backup can replace it" in refused.stdout
    assert checkpoint.read_bytes() == bytes(data)


def test_check_verifies_a_cluster_replicas_roles_too(journaled: Server) -> None:
    """``replication.json`` (a cluster replica's pools' roles and placement epochs, written by
    the server as placements change) is checked as a start reads it: ok with each pool's role
    and epoch, or damaged, naming the file; a start is refused on it then, and ``recover``
    never changes it."""
    from _replication import place

    journaled.start()
    try:  # a static placement: pool p's primary is this server, at epoch 3, without standby
        assert place(journaled.address, "p", journaled.address, None, 3) == "primary"
    finally:
        journaled.stop()
    roles = journaled.data_dir / "replication.json"
    good = run_cli("data-dir", "check", str(journaled.data_dir), "--json")
    assert good.returncode == 0, good.stdout
    report = json.loads(good.stdout)
    assert report["status"] == "ok"
    assert report["replication"] == {
        "file": str(roles),
        "present": True,
        "error": None,
        "pools": [{"pool_id": "p", "role": "primary", "epoch": 3}],
    }
    text = run_cli("data-dir", "check", str(journaled.data_dir))
    assert "replication.json: ok, 1 pools (1 primary)" in text.stdout

    damaged = roles.read_bytes()[:-7]  # a write cut short (the server renames whole files)
    roles.write_bytes(damaged)
    bad = run_cli("data-dir", "check", str(journaled.data_dir), "--json")
    assert bad.returncode == 1
    found = json.loads(bad.stdout)
    assert found["status"] == "damaged"
    assert found["replication"]["error"].startswith(f"{roles} is damaged")
    assert found["checkpoint"]["error"] is None
    assert found["journal"]["damage"] is None
    assert (
        f"replication.json: DAMAGED: {roles} is damaged"
        in run_cli("data-dir", "check", str(journaled.data_dir)).stdout
    )
    assert f"{roles} is damaged" in journaled.refused()
    recovered = run_cli("data-dir", "recover", str(journaled.data_dir), "--drop-after-damage")
    assert "recover never changes it" in recovered.stdout
    assert roles.read_bytes() == damaged

    roles.unlink()  # a lone server's directory: no roles, nothing wrong
    lone = json.loads(run_cli("data-dir", "check", str(journaled.data_dir), "--json").stdout)
    assert lone["status"] == "ok"
    assert lone["replication"] == {"file": str(roles), "present": False, "error": None}
