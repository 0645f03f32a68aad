"""A real etcd and real ``kvcm serve`` replicas on 127.0.0.1, for the cluster tests.

etcd is Debian's ``etcd-server`` (``scripts/install-etcd.sh`` installs it where missing); the
tests skip, saying so, where ``etcd`` is not on PATH. Every process gets free ports and a
temporary directory, and is stopped at the end (``kill -9`` for the ones a test killed).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcm.client import SchedulerClient

# kvcm serve, able to dump its threads' and tasks' stacks on SIGUSR1 (_replica_main.py).
CLI = [sys.executable, str(Path(__file__).resolve().parent / "_replica_main.py")]
# The replicas' log level (KVCM_TEST_REPLICA_LOG_LEVEL=INFO shows checkpoints and links).
LOG_LEVEL = os.environ.get("KVCM_TEST_REPLICA_LOG_LEVEL", "WARNING")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Etcd:
    """One etcd member on 127.0.0.1 with its data in ``data_dir``; stoppable and restartable
    on the same ports (the data survives a stop)."""

    def __init__(self, binary: str, data_dir: Path) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.client_port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.process = subprocess.Popen(
            [self.binary, "--name", "kvcm-test", "--data-dir", str(self.data_dir),
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvcm-test={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.client_port)) == 0:
                    return
            assert self.process.poll() is None, "etcd exited at start"
            time.sleep(0.05)
        raise AssertionError("etcd did not come up")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


class Replica:
    """``kvcm serve --etcd-endpoints`` in a subprocess.

    Its stderr (its log) goes to a file, ``<data_dir>.log`` beside its data directory (else
    in a temporary directory): a pipe nobody reads would stall a replica that logs a lot.
    :meth:`log_tail` reads the end of it; :meth:`dump_stacks` has the replica write where
    each of its threads and asyncio tasks waits there.
    """

    def __init__(
        self, etcd: Etcd, prefix: str, *, lease_ttl_s: int = 2, data_dir: Path | None = None
    ) -> None:
        self.data_dir = data_dir
        self.address = f"127.0.0.1:{free_port()}"
        self.http_port = free_port()
        self.etcd = etcd
        self.prefix = prefix
        self.lease_ttl_s = lease_ttl_s
        self.process: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] | None = None
        self._served = False
        if data_dir is not None:
            self.log_path = data_dir.with_name(data_dir.name + ".log")
        else:
            self.log_path = Path(tempfile.mkdtemp(prefix="kvcm-replica-")) / "replica.log"

    def start(self) -> None:
        self.spawn()
        self.wait_serving()

    def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._popen(log)

    def _popen(self, log: io.BufferedWriter) -> None:
        if self._env is None:  # the first spawn's environment, for a respawn on other ports
            self._env = dict(os.environ)
        self.process = subprocess.Popen(
            [*CLI, "serve", "--grpc-address", self.address,
             "--http-address", f"127.0.0.1:{self.http_port}",
             "--etcd-endpoints", self.etcd.endpoint, "--etcd-prefix", self.prefix,
             "--etcd-lease-ttl-s", str(self.lease_ttl_s), "--etcd-timeout-s", "1",
             "--cluster-fanout-timeout-s", "1", "--log-level", LOG_LEVEL,
             *(["--data-dir", str(self.data_dir)] if self.data_dir is not None else [])],
            stdout=subprocess.DEVNULL, stderr=log, env=self._env,
        )  # fmt: skip

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the replica's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def dump_stacks(self) -> None:
        """Have the running replica write its threads' and tasks' stacks to its log."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)

    def wait_serving(self) -> None:
        """Wait until the replica answers. On its first start only, a port that another
        process took between :func:`free_port` and the bind (xdist workers pick ports at
        once) is replaced and the replica spawned again, up to three times; a restart keeps
        its ports (routers and peers know them)."""
        for attempt in range(3):
            if self._wait() or attempt == 2:
                break
            self.address = f"127.0.0.1:{free_port()}"
            self.http_port = free_port()
            self.spawn()
        self._served = True

    def _wait(self) -> bool:
        # True once serving; False when a first start lost a port race (spawn again).
        assert self.process is not None
        started = time.monotonic()
        with SchedulerClient(self.address, timeout=2.0) as client:
            while True:
                try:
                    client.list_pools()
                    return True
                except Exception:
                    if self.process.poll() is not None:
                        tail = self.log_tail()
                        if not self._served and "Address already in use" in tail:
                            return False
                        raise AssertionError(
                            f"kvcm serve exited; its log ({self.log_path}) ends:\n" + tail
                        ) from None
                    assert time.monotonic() - started < 60, "kvcm serve did not come up"
                    time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (bash scripts/install-etcd.sh installs Debian's)")
    server = Etcd(binary, tmp_path_factory.mktemp("etcd"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def replicas(etcd: Etcd, request: pytest.FixtureRequest) -> Iterator[list[Replica]]:
    """Three replicas of one cluster (a key prefix of the module's own)."""
    prefix = "/kvcm-test-" + request.module.__name__.rsplit(".", 1)[-1]
    with running([Replica(etcd, prefix) for _ in range(3)], stop_signal=signal.SIGTERM) as started:
        yield started


def durable_replicas(
    etcd: Etcd, prefix: str, directory: Path, *, lease_ttl_s: int = 2, count: int = 3
) -> list[Replica]:
    """``count`` replicas of the cluster ``prefix``, each with a data directory under
    ``directory`` (``r0``, ``r1``, ...), not started."""
    return [
        Replica(etcd, prefix, lease_ttl_s=lease_ttl_s, data_dir=directory / f"r{i}")
        for i in range(count)
    ]


@contextlib.contextmanager
def running(
    replicas: list[Replica], *, stop_signal: int = signal.SIGKILL
) -> Iterator[list[Replica]]:
    """Start ``replicas`` side by side (each spends its start-up importing), wait until each
    serves and every one sees them all; at the end stop each with ``stop_signal``, one a test
    left SIGSTOPped continued first."""
    try:
        for replica in replicas:
            replica.spawn()
        for replica in replicas:
            replica.wait_serving()
        wait_for_members(replicas, len(replicas))
        yield replicas
    finally:
        for replica in replicas:
            if replica.process is not None and replica.process.poll() is None:
                replica.process.send_signal(signal.SIGCONT)
            replica.stop(stop_signal)


def wait_for_members(replicas: list[Replica], count: int, timeout_s: float = 10.0) -> None:
    """Wait until every running replica's /metrics shows ``count`` live replicas."""
    import httpx

    deadline = time.monotonic() + timeout_s
    for replica in replicas:
        if replica.process is None:
            continue
        while True:
            text = httpx.get(f"http://127.0.0.1:{replica.http_port}/metrics").text
            if f"kvcm_cluster_replicas {float(count)}" in text:
                break
            assert time.monotonic() < deadline, f"{replica.address} never saw {count} replicas"
            time.sleep(0.05)
