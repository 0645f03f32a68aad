"""Bearer tokens and roles on a real server: who may do what, to which pool; the audit log.

Tokens are stored hashed in the tokens file; the SDK presents them as ``authorization``
metadata. No token or an unknown one is UNAUTHENTICATED; a reader cannot mutate or delete; a
scheduler token for pool A cannot touch pool B; the hash seed is shown only to those who drive
the pool; admin actions are audited; SIGHUP's reload picks up a new token.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcm.client import (
    PermissionDeniedError,
    SchedulerClient,
    StepBuilder,
)
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import ConfigError
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.server.auth import TokenTable
from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=256,
    hash_seed="the-seed",
    explicit_layout=KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)
TOKENS = {
    "admin-token": ("ops", ["admin:*"]),
    "sched-a-token": ("engine-a", ["scheduler:a-*"]),
    "reader-token": ("router", ["reader:*"]),
}


def _write_tokens(path: Path, tokens: dict[str, tuple[str, list[str]]]) -> None:
    entries = []
    for token, (name, roles) in tokens.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        quoted = ", ".join(f'"{role}"' for role in roles)
        entries.append(f'[[tokens]]\nname = "{name}"\nsha256 = "{digest}"\nroles = [{quoted}]\n')
    path.write_text("\n".join(entries), encoding="utf-8")


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    _write_tokens(path, TOKENS)
    return path


@pytest.fixture
def server(tokens_file: Path) -> Iterator[EmbeddedServer]:
    running = start_embedded_server(
        ServerSettings(grpc_address="127.0.0.1:0", http_address="", auth_tokens=str(tokens_file))
    )
    try:
        yield running
    finally:
        running.stop()


def _client(server: EmbeddedServer, token: str | None) -> SchedulerClient:
    return SchedulerClient(server.grpc_address, token=token, timeout=5.0)


def test_roles_decide_who_may_do_what_to_which_pool(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvcm.audit")
    with _client(server, "admin-token") as admin:
        admin.create_pool("a-engine", CONFIG)
        admin.create_pool("b-engine", CONFIG)
    for token in (None, "not-a-token"):
        with _client(server, token) as anonymous, pytest.raises(PermissionDeniedError) as caught:
            anonymous.list_pools()
        assert "UNAUTHENTICATED" in str(caught.value)
    with _client(server, "reader-token") as reader:
        assert [p.pool_id for p in reader.list_pools()] == ["a-engine", "b-engine"]
        assert reader.describe_pool("a-engine").hashing.seed == ""  # a reader does not hash
        for forbidden in (
            lambda: reader.delete_pool("a-engine"),
            lambda: reader.create_pool("c-engine", CONFIG),
            lambda: reader.step("a-engine", StepBuilder()),
        ):
            with pytest.raises(PermissionDeniedError, match="PERMISSION_DENIED"):
                forbidden()
    with _client(server, "sched-a-token") as scheduler:
        assert scheduler.describe_pool("a-engine").hashing.seed == "the-seed"
        scheduler.keep_alive("a-engine")
        step = StepBuilder()
        step.add_request(1, list(range(20)))
        step.allocate(1, 20, 0)
        scheduler.step("a-engine", step)
        with pytest.raises(PermissionDeniedError, match="b-engine"):
            scheduler.step("b-engine", step)
        with pytest.raises(PermissionDeniedError):
            scheduler.delete_pool("a-engine")
    with _client(server, "admin-token") as admin:
        assert admin.describe_pool("a-engine").num_requests == 1  # refusals changed nothing
        assert admin.describe_pool("b-engine").num_requests == 0
        admin.delete_pool("b-engine")
    audit = [
        (r.principal, r.method, r.pool, r.outcome)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "kvcm.audit"
    ]
    assert audit == [
        ("ops", "CreatePool", "a-engine", "OK"),
        ("ops", "CreatePool", "b-engine", "OK"),
        ("ops", "DeletePool", "b-engine", "OK"),
    ]


def test_a_reload_picks_up_new_tokens(server: EmbeddedServer, tokens_file: Path) -> None:
    with _client(server, "late-token") as late, pytest.raises(PermissionDeniedError):
        late.list_pools()
    _write_tokens(tokens_file, {**TOKENS, "late-token": ("late", ["reader:*"])})
    tokens = server.server.tokens
    assert tokens is not None
    tokens.reload()  # what SIGHUP does
    with _client(server, "late-token") as late:
        assert late.list_pools() == []


def test_a_bad_tokens_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[tokens]]\nsha256 = "abc"\nroles = ["admin:*"]\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="64 hex digits"):
        TokenTable(str(path))
    path.write_text(f'[[tokens]]\nsha256 = "{"0" * 64}"\nroles = ["root:*"]\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="not one of"):
        TokenTable(str(path))
