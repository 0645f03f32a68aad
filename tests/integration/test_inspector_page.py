"""The pool inspector page (``GET /``) in a real headless Chromium, against a real server.

A server on loopback with bearer tokens on; Debian's chromium (``scripts/install-chromium.sh``)
driven by Playwright. The page must ask for the token, then show the pools a workload creates,
update after Steps (requests, Steps/s, event numbering), show a pool's detail, and answer the
lookup box as the Lookup RPC does. ``KVCM_SCREENSHOT=path.png`` saves what the browser shows
(docs/inspector.png is made so). Skipped, with the reason, where Chromium or Playwright is
missing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcm.client import LookupQuery, PoolConfig, SchedulerClient, StepBuilder
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
TOKEN = "inspector-token"
POOLS = ("engine-a", "engine-b")
PROMPT = [11 + i for i in range(96)]  # 6 blocks of 16

if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(
        f"{CHROMIUM} not found: run scripts/install-chromium.sh (Debian's chromium package)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
)


def _config(role: str) -> PoolConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
    layout = KVCacheConfig(
        num_blocks=128,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )
    return PoolConfig(
        max_model_len=2048,
        explicit_layout=layout,
        enable_kv_cache_events=True,
        labels={"role": role},
        scheduler_lease_s=60.0,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    tokens = tmp_path_factory.mktemp("inspector") / "tokens.toml"
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    tokens.write_text(
        f'[[tokens]]\nname = "ops"\nsha256 = "{digest}"\nroles = ["admin:*"]\n', encoding="utf-8"
    )
    settings = ServerSettings(
        grpc_address="127.0.0.1:0",
        http_address="127.0.0.1:0",
        log_level="WARNING",
        auth_tokens=str(tokens),
    )
    running = start_embedded_server(settings)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def client(server: EmbeddedServer) -> Iterator[SchedulerClient]:
    with SchedulerClient(server.grpc_address, token=TOKEN) as client:
        yield client


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()


class Engine:
    """A scheduler driving one pool with Steps: each step admits one request or finishes one."""

    def __init__(self, client: SchedulerClient, pool_id: str) -> None:
        self.client = client
        self.pool_id = pool_id
        self.hasher = client.block_hasher(pool_id)
        self.seq = 0
        self.key = 0

    def admit(self, prompt: list[int]) -> int:
        self.key += 1
        builder = self._builder()
        builder.add_request(self.key, prompt, self.hasher.hash_token_ids(prompt))
        builder.allocate(self.key, len(prompt), 0, lookup=True)
        self.client.step(self.pool_id, builder)
        return self.key

    def idle_steps(self, count: int) -> None:
        for _ in range(count):
            self.client.step(self.pool_id, self._builder())

    def _builder(self) -> StepBuilder:
        self.seq += 1
        return StepBuilder(step_seq=self.seq)


def _cells(page: Any, pool_id: str) -> dict[str, str]:
    row = page.locator(f'#pools tbody tr[data-pool="{pool_id}"]')
    names = ("name", "state", "labels", "free", "requests", "hit", "steps", "events")
    return {name: row.locator(f"td.c-{name}").inner_text() for name in names}


def test_the_page_is_open_but_its_data_needs_the_token(server: EmbeddedServer) -> None:
    base = f"http://{server.http_address}"
    page = httpx.get(base + "/")
    assert page.status_code == 200
    assert "kvcm pool inspector" in page.text
    assert httpx.get(base + "/v1/pools").status_code == 401
    docs = httpx.get(base + "/docs")
    assert docs.status_code == 200
    assert "/openapi.json" in docs.text
    events = httpx.get(base + "/v1/pools/none/events", headers={"Authorization": f"Bearer {TOKEN}"})
    assert events.status_code == 404


def test_the_page_shows_the_pools_updates_and_answers_lookups(
    server: EmbeddedServer, client: SchedulerClient, browser: Any
) -> None:
    for index, pool_id in enumerate(POOLS):
        client.create_pool(pool_id, _config("prefill" if index == 0 else "decode"))
    engine = Engine(client, POOLS[0])
    engine.admit(PROMPT)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        page.goto(f"http://{server.http_address}/?interval=300")
        # Auth is on: the page asks for the token before it shows anything.
        page.wait_for_selector("#token-form:not([hidden])")
        assert page.locator("#pools tbody tr").count() == 0
        page.fill("#token", TOKEN)
        page.click("#token-save")
        page.wait_for_selector(f'#pools tbody tr[data-pool="{POOLS[1]}"]')
        first = _cells(page, POOLS[0])
        assert first["state"] == "READY"
        assert first["labels"] == "role=prefill"
        assert first["requests"] == "1"
        assert _cells(page, POOLS[1])["labels"] == "role=decode"
        info = client.describe_pool(POOLS[0])
        assert first["free"] == f"{info.num_free_blocks} / 128"
        assert first["events"] == str(info.last_event_sequence)
        # Steps: a second request, then a run of steps; the page follows.
        engine.admit([5000 + i for i in range(48)])
        engine.idle_steps(30)
        page.wait_for_function(
            "document.querySelector('#pools tr[data-pool=\"engine-a\"] td.c-requests')"
            ".textContent === '2'"
        )
        page.wait_for_function(
            "Number(document.querySelector('#pools tr[data-pool=\"engine-a\"]')"
            ".dataset.stepSeq) === 32"
        )
        # Steps/s is computed between polls: steps arriving while the page watches show.
        for _ in range(6):
            engine.idle_steps(10)
            page.wait_for_timeout(150)
        page.wait_for_function(
            "Number(document.querySelector('#pools tr[data-pool=\"engine-a\"] td.c-steps')"
            ".textContent) > 0"
        )
        # Detail of a pool: fields, groups and its recent events.
        page.click(f'#pools tbody tr[data-pool="{POOLS[0]}"]')
        page.wait_for_selector("#events li")
        assert page.inner_text("#detail-name") == POOLS[0]
        assert page.inner_text('dd[data-field="lease"]') == "scheduler 60s"
        assert page.inner_text('dd[data-field="requests"]') == "2"
        assert page.locator("#groups tbody tr").count() == 1
        assert "BlockStored" in page.inner_text("#events")
        # The lookup box answers as the Lookup RPC does.
        expected = client.lookup(LookupQuery(token_ids=PROMPT))
        page.fill("#lookup-tokens", " ".join(map(str, PROMPT)))
        page.click("#lookup-go")
        page.wait_for_selector("#lookup-results tbody tr")
        rows = page.locator("#lookup-results tbody tr")
        shown = [
            (
                rows.nth(i).locator("td.c-pool").inner_text(),
                int(rows.nth(i).locator("td.c-hit-tokens").inner_text()),
            )
            for i in range(rows.count())
        ]
        assert shown == [(hit.pool_id, hit.num_hit_tokens) for hit in expected.pools]
        assert shown[0] == (POOLS[0], 80)  # 5 full blocks: the last token is never a hit
        # Scoped by label, as the RPC scopes it.
        page.fill("#lookup-labels", "role=decode")
        page.click("#lookup-go")
        page.wait_for_function("document.querySelectorAll('#lookup-results tbody tr').length === 1")
        assert page.inner_text("#lookup-results tbody td.c-pool") == POOLS[1]
        screenshot = os.environ.get("KVCM_SCREENSHOT")
        if screenshot:  # docs/inspector.png: the page while the engine steps
            stop = threading.Event()

            def pump() -> None:
                while not stop.is_set():
                    engine.idle_steps(1)
                    time.sleep(0.01)

            stepping = threading.Thread(target=pump)
            stepping.start()
            try:
                page.fill("#lookup-labels", "")
                page.click("#lookup-go")
                page.wait_for_function(
                    "document.querySelectorAll('#lookup-results tbody tr').length === 2"
                )
                page.wait_for_timeout(1000)
                page.screenshot(path=screenshot, full_page=True)
            finally:
                stop.set()
                stepping.join()
            assert Path(screenshot).stat().st_size > 0
    finally:
        page.close()


def test_chromium_is_the_debian_package() -> None:
    assert shutil.which("chromium") == CHROMIUM or os.access(CHROMIUM, os.X_OK)
