"""A journal write or fsync that fails changes nothing: UNAVAILABLE, then the server resumes.

``kvcm serve --data-dir`` runs as a subprocess. The disk fails two ways:

* a real full filesystem: the data directory is a 2 MiB tmpfs mounted for the test, filled
  with a filler file (skipped, and said so, where the test may not mount: not root);
* the journal's documented test hook (``KVCM_JOURNAL_FAULT_FILE``): while the named file
  exists, every journal write or fsync fails with the errno it names (ENOSPC, EIO).

Either way: a Step answers UNAVAILABLE naming the reason; DescribePool shows the pool as it
was before the Step; a unary call fails alike; the same Step succeeds once the disk is back
and later ones follow; a restart (kill -9) replays to exactly the Steps answered; and a
restart while the disk is still full is one line on stderr and a non-zero exit code, no
traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _data_dir_server import CONFIG, Server, assert_pool_is, program

from kvcm.client import SchedulerClient, ServiceError, UnavailableError
from kvcm.server.journal import FAULT_ENV


def _state(client: SchedulerClient) -> object:
    """DescribePool without its clock readings (the ages of the step progress)."""
    info = client.describe_pool("p")
    progress = info.step_progress
    return (
        dataclasses.replace(info, step_progress=None),
        None if progress is None else (progress.last_step_seq, progress.scheduler_step_seq),
    )


def _run_until_the_disk_fails(
    client: SchedulerClient, break_disk: object, heal_disk: object, first: int
) -> int:
    """Break the disk, run Steps from ``first`` on until one fails (a full filesystem may
    still take a few records in its last page) and check that it changed nothing; heal the
    disk, run the same Step again and a few more; returns the last Step answered."""
    break_disk()  # type: ignore[operator]
    seq = first
    while True:
        before = _state(client)
        try:
            client.step("p", program(seq))
        except UnavailableError as failed:
            reason = str(failed)
            break
        seq += 1
        assert seq < first + 500, "the disk never refused a record"
    assert "nothing was changed" in reason
    assert _state(client) == before  # the state before the Step
    with pytest.raises(ServiceError) as unary:
        client.evict_blocks("p", [1])
    assert unary.value.code.name == "UNAVAILABLE"
    assert _state(client) == before
    heal_disk()  # type: ignore[operator]
    client.step("p", program(seq))  # the same step_seq: runs now
    for later in range(seq + 1, seq + 4):
        client.step("p", program(later))
    assert_pool_is(client, seq + 3)
    return seq + 3


def _check_restart(server: Server, answered: int) -> int:
    """kill -9 and restart: every answered Step is back; one more Step (so that the next
    start has a record to replay, and a checkpoint to write)."""
    server.kill()
    server.start()
    with SchedulerClient(server.address) as client:
        assert_pool_is(client, answered)
        client.step("p", program(answered + 1))
    return answered + 1


def _refused_one_line(server: Server) -> str:
    server.kill()
    err = server.refused()
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcm serve: data_dir: "), err
    return lines[0]


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[None]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` with a filler file until it is full."""
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 4096)
    return filler


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a size-limited tmpfs needs root")
def test_a_full_filesystem(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    with _tmpfs(mount, "2m"):
        server = Server(mount / "data")
        server.start()
        try:
            with SchedulerClient(server.address) as client:
                client.create_pool("p", CONFIG)
                for seq in range(1, 6):
                    client.step("p", program(seq))
                filler: list[Path] = []
                answered = _run_until_the_disk_fails(
                    client,
                    lambda: filler.append(_fill(mount)),
                    lambda: filler[0].unlink(),  # noqa: PLW0108 - filler is filled later
                    6,
                )
            answered = _check_restart(server, answered)
            _fill(mount)
            line = _refused_one_line(server)
            assert "No space left on device" in line
            (mount / "filler").unlink()
            server.start()  # space is back: the same directory starts
            with SchedulerClient(server.address) as client:
                assert_pool_is(client, answered)
        finally:
            server.stop()


@pytest.mark.parametrize("fault", ["write ENOSPC", "fsync EIO"])
def test_an_injected_write_failure(tmp_path: Path, fault: str) -> None:
    switch = tmp_path / "fault"
    server = Server(tmp_path / "data", env={FAULT_ENV: str(switch)})
    server.start()
    try:
        with SchedulerClient(server.address) as client:
            client.create_pool("p", CONFIG)
            for seq in range(1, 6):
                client.step("p", program(seq))
            answered = _run_until_the_disk_fails(
                client, lambda: switch.write_text(fault), switch.unlink, 6
            )
        answered = _check_restart(server, answered)
        switch.write_text("any ENOSPC")
        line = _refused_one_line(server)
        assert os.strerror(errno.ENOSPC) in line
        switch.unlink()
        server.start()
        with SchedulerClient(server.address) as client:
            assert_pool_is(client, answered)
    finally:
        server.stop()
