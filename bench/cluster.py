"""Benchmark: Steps/s of a kvcm cluster, one replica against three, with and without standbys.

Starts a real etcd (``scripts/install-etcd.sh`` installs it) and, per configuration, 1 or 3
``kvcm serve --etcd-endpoints`` replicas on 127.0.0.1, then drives them with N SDK schedulers
(processes; bench/rpc.py's throughput workload: each scheduler creates its own pool, admits
R requests and sends R-request decode Steps back to back). Each scheduler is given every
replica as its seed list: its pool is placed by the cluster and the SDK follows the redirect
to the pool's primary once, then talks to it directly. Configurations, each run ``--rounds``
times on a fresh cluster (rounds interleave the configurations, so machine load hits all alike):

- ``1 replica``: one replica, no data directory (in memory, no standby);
- ``1 replica, journal``: ``--data-dir`` (every answer waits for the local journal; a lone
  replica has no standby);
- ``3 replicas``: pools spread over three replicas, no data directory, no standbys;
- ``3 replicas, sync standbys``: ``--data-dir`` on each, every pool with a hot standby on
  another replica in ``sync`` mode (each answer waits for the standby's acknowledgement).

Printed per configuration: Steps/s over all schedulers (median over the rounds), the Step
latency p50 and p99 under that load (median over the rounds), the ratio to ``1 replica``, and
Steps per CPU-second the replicas spent (``process_cpu_seconds_total`` read before and after):
the per-core figure docs/capacity.md sizes with, robust to other load on the machine.

    python bench/cluster.py                               # 8 schedulers, 256-request Steps
    python bench/cluster.py --schedulers 4 --steps 200 --rounds 3

On a machine with fewer cores than replicas plus schedulers, the replicas share the cores with
each other and with the schedulers: three replicas cannot serve more than the cores allow, and
the figure then measures the cluster's overhead rather than its scaling (docs/capacity.md).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import multiprocessing
from collections.abc import Callable

import httpx
from _common import free_port
from rpc import Timing, _scheduler_process

CONFIGS: dict[str, tuple[int, bool]] = {
    "1 replica": (1, False),
    "1 replica, journal": (1, True),
    "3 replicas": (3, False),
    "3 replicas, sync standbys": (3, True),
}
BASELINE = "1 replica"


def _wait_port(port: int, process: subprocess.Popen[bytes], what: str) -> None:
    give_up_at = time.monotonic() + 30
    while time.monotonic() < give_up_at:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited at start")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not come up")


@contextmanager
def etcd_server(directory: str) -> Iterator[str]:
    """One etcd member on free loopback ports; yields its client endpoint."""
    binary = shutil.which("etcd")
    if binary is None:
        raise SystemExit("etcd is not installed: bash scripts/install-etcd.sh")
    client_port, peer_port = free_port(), free_port()
    endpoint, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    process = subprocess.Popen(
        [binary, "--name", "kvcm-bench", "--data-dir", directory,
         "--listen-client-urls", endpoint, "--advertise-client-urls", endpoint,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"kvcm-bench={peer}", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_port(client_port, process, "etcd")
        yield endpoint
    finally:
        process.terminate()
        process.wait(timeout=10)


def _gauge(http_port: int, name: str) -> float:
    """An unlabelled metric's value as the replica at ``http_port`` reports it (0: none yet)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def _server_cpu_s(http_ports: list[int]) -> float:
    """CPU seconds the replicas have used (``process_cpu_seconds_total``, summed)."""
    return sum(_gauge(port, "process_cpu_seconds_total") for port in http_ports)


@contextmanager
def kvcm_cluster(
    endpoint: str, prefix: str, replicas: int, data_root: str | None
) -> Iterator[tuple[str, list[int]]]:
    """``replicas`` kvcm replicas under ``prefix``; once each sees all, yields the seed list
    and the replicas' HTTP ports."""
    processes: list[subprocess.Popen[bytes]] = []
    addresses, http_ports = [], []
    try:
        for index in range(replicas):
            address, http_port = f"127.0.0.1:{free_port()}", free_port()
            data = ["--data-dir", os.path.join(data_root, str(index))] if data_root else []
            command = [sys.executable, "-m", "kvcm.server.cli", "serve",
                       "--grpc-address", address, "--http-address", f"127.0.0.1:{http_port}",
                       "--etcd-endpoints", endpoint, "--etcd-prefix", prefix,
                       "--log-level", "WARNING", *data]  # fmt: skip
            process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            processes.append(process)
            addresses.append(address)
            http_ports.append(http_port)
        give_up_at = time.monotonic() + 60
        while any(_gauge(port, "kvcm_cluster_replicas") != replicas for port in http_ports):
            if any(p.poll() is not None for p in processes) or time.monotonic() > give_up_at:
                raise RuntimeError(f"the {replicas} replicas did not all see each other")
            time.sleep(0.1)
        yield ",".join(addresses), http_ports
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def throughput(
    seeds: str, schedulers: int, requests: int, steps: int, cpu_s: Callable[[], float]
) -> tuple[float, Timing, float]:
    """bench/rpc.py's throughput run (``schedulers`` processes, each on its own pool, ``steps``
    R-request decode Steps), against the seed list ``seeds``. Returns Steps/s, the Step latency
    under that load, and the replicas' CPU seconds (``cpu_s``) over the timed Steps only (pool
    creation and admission excluded)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    start_event = context.Event()
    processes = [
        context.Process(
            target=_scheduler_process,
            args=(seeds, index, requests, steps, queue, start_event),
        )
        for index in range(schedulers)
    ]
    for process in processes:
        process.start()
    for _ in processes:
        queue.get(timeout=120)
    cpu_before = cpu_s()
    start = time.perf_counter()
    start_event.set()
    samples: list[float] = []
    for _ in processes:
        _, _, process_samples = queue.get(timeout=600)
        samples.extend(process_samples)
    elapsed = time.perf_counter() - start
    used = cpu_s() - cpu_before
    for process in processes:
        process.join(timeout=30)
    return schedulers * steps / elapsed, Timing.of(samples), used


def main(argv: list[str] | None = None) -> None:
    # SIGTERM ends the run like Ctrl-C: the replicas and etcd are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedulers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60, help="Steps per scheduler per round")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)

    throughputs: dict[str, list[float]] = {name: [] for name in CONFIGS}
    samples: dict[str, list[Timing]] = {name: [] for name in CONFIGS}
    per_cpu_s: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with (
        tempfile.TemporaryDirectory(prefix="kvcm-bench-cluster-") as root,
        etcd_server(os.path.join(root, "etcd")) as endpoint,
    ):
        for round_ in range(args.rounds):
            names = list(CONFIGS) if round_ % 2 == 0 else list(reversed(CONFIGS))
            for name in names:
                replicas, journal = CONFIGS[name]
                prefix = f"/bench-{round_}-{list(CONFIGS).index(name)}"
                data_root = os.path.join(root, prefix.strip("/")) if journal else None
                with kvcm_cluster(endpoint, prefix, replicas, data_root) as (seeds, ports):
                    steps_per_s, timing, cpu_s = throughput(
                        seeds,
                        args.schedulers,
                        args.requests,
                        args.steps,
                        functools.partial(_server_cpu_s, ports),
                    )
                per_cpu_s[name].append(args.schedulers * args.steps / cpu_s)
                throughputs[name].append(steps_per_s)
                samples[name].append(timing)
                print(
                    f"  round {round_ + 1} {name:<27} {steps_per_s:7.0f} Steps/s  "
                    f"p50 {timing.median_ms:6.2f} ms  p99 {timing.p99_ms:6.2f} ms  "
                    f"{per_cpu_s[name][-1]:6.0f} Steps per server CPU-s",
                    flush=True,
                )
    print(
        f"\n{args.schedulers} schedulers x {args.requests}-request decode Steps, "
        f"{args.steps} Steps each per round, {args.rounds} round(s), {os.cpu_count()} CPUs"
    )
    print(
        f"{'configuration':<28}{'Steps/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'x Steps/s':>11}"
        f"{'Steps/CPU-s':>13}"
    )
    base = statistics.median(throughputs[BASELINE])
    for name in CONFIGS:
        rate = statistics.median(throughputs[name])
        # Per-round p50 and p99 (each over all schedulers' Steps), the median over rounds.
        p50 = statistics.median(t.median_ms for t in samples[name])
        p99 = statistics.median(t.p99_ms for t in samples[name])
        per_core = statistics.median(per_cpu_s[name])
        print(f"{name:<28}{rate:9.0f}{p50:9.2f}{p99:9.2f}{rate / base:11.2f}{per_core:13.0f}")
    sync = statistics.median(throughputs["3 replicas, sync standbys"])
    plain = statistics.median(throughputs["3 replicas"])
    print(f"sync standbys / none (3 replicas): {sync / plain:.2f}x Steps/s")


if __name__ == "__main__":
    main()
