"""A real Prometheus scrapes a kvcm server whose tokens are on, as deploy/ tells it to.

The scrape job is deploy/prometheus/prometheus.yml's, with its commented ``authorization``
block uncommented and pointed at a file holding a ``scrape:*`` token: the target must be up and
its series kvcm's. A second job without the block must be down with a 401. Skipped, with the
reason, where the ``prometheus`` binary is missing (``scripts/install-prometheus.sh``).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOYED = ROOT / "deploy" / "prometheus" / "prometheus.yml"
SCRAPE_TOKEN = "the-scrape-token"

pytestmark = pytest.mark.slow


def _deployed_job(token_file: Path, target: str) -> dict[str, Any]:
    """deploy/'s kvcm job with its authorization block uncommented, aimed at ``target``."""
    text = DEPLOYED.read_text(encoding="utf-8")
    block = re.search(r"^( +)# authorization:\n(?:\1#   .*\n)+", text, re.M)
    assert block is not None, "deploy/prometheus/prometheus.yml lost its authorization block"
    indent = block.group(1)
    uncommented = block.group(0).replace(f"{indent}# ", indent)
    config = yaml.safe_load(text.replace(block.group(0), uncommented))
    (job,) = config["scrape_configs"]
    assert job["authorization"]["type"] == "Bearer"
    job["authorization"]["credentials_file"] = str(token_file)
    job["static_configs"] = [{"targets": [target]}]
    job["scrape_interval"] = job["scrape_timeout"] = "1s"
    return dict(job)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    tokens = tmp_path / "tokens.toml"
    digest = hashlib.sha256(SCRAPE_TOKEN.encode()).hexdigest()
    tokens.write_text(
        f'[[tokens]]\nname = "prometheus"\nsha256 = "{digest}"\nroles = ["scrape:*"]\n',
        encoding="utf-8",
    )
    running = start_embedded_server(
        ServerSettings(
            grpc_address="127.0.0.1:0",
            http_address="127.0.0.1:0",
            auth_tokens=str(tokens),
            log_level="ERROR",
        )
    )
    try:
        yield running
    finally:
        running.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_prometheus_scrapes_with_the_deployed_token_settings(
    tmp_path: Path, server: EmbeddedServer
) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "the prometheus server binary is not installed "
            "(bash scripts/install-prometheus.sh installs Debian's package)"
        )
    token_file = tmp_path / "kvcm-scrape-token"
    token_file.write_text(SCRAPE_TOKEN + "\n", encoding="utf-8")
    job = _deployed_job(token_file, server.http_address)
    anonymous = {key: value for key, value in job.items() if key != "authorization"}
    anonymous["job_name"] = "kvcm-anonymous"
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": [job, anonymous]}), encoding="utf-8")
    port = _free_port()
    log = tmp_path / "prometheus.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        try:
            health = _wait_for_targets(f"http://127.0.0.1:{port}", process, log)
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert health["kvcm"] == ("up", "")
    state, error = health["kvcm-anonymous"]
    assert state == "down"
    assert "401" in error


def _wait_for_targets(
    url: str, process: subprocess.Popen[bytes], log: Path
) -> dict[str, tuple[str, str]]:
    """Each job's target health and last error, once both were scraped."""
    give_up_at = time.monotonic() + 30.0
    health: dict[str, tuple[str, str]] = {}
    with httpx.Client(base_url=url, timeout=5.0) as http:
        while time.monotonic() < give_up_at:
            if process.poll() is not None:
                pytest.fail("prometheus exited: " + log.read_text("utf-8"))
            try:
                targets = http.get("/api/v1/targets").json()["data"]["activeTargets"]
            except (httpx.HTTPError, ValueError, KeyError):
                time.sleep(0.2)
                continue
            health = {
                t["labels"]["job"]: (t["health"], t["lastError"])
                for t in targets
                if t["health"] != "unknown"
            }
            if len(health) == 2:
                query = {"query": 'count({job="kvcm", __name__=~"kvcm_.+"})'}
                series = http.get("/api/v1/query", params=query).json()["data"]["result"]
                if health["kvcm"][0] != "up" or series:
                    return health
            time.sleep(0.2)
    pytest.fail(f"timed out waiting for both scrape jobs; last: {health}")
