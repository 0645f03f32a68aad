"""The integration's settings: ``additional_config["kvcm"]``, then ``KVCM_*`` variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.core.pool_types import check_labels

__all__ = ["MODES", "SHIPPERS", "KvcmSettings"]

MODES: Final = ("mirror", "remote")
SHIPPERS: Final = ("thread", "process")

# Setting name -> (environment variable, parser).
_ENV: Final = {
    "address": "KVCM_ADDRESS",
    "pool_id": "KVCM_POOL_ID",
    "mode": "KVCM_MODE",
    "step_timeout_s": "KVCM_STEP_TIMEOUT_S",
    "max_backlog": "KVCM_MAX_BACKLOG",
    "shutdown_timeout_s": "KVCM_SHUTDOWN_TIMEOUT_S",
    "lease_s": "KVCM_LEASE_S",
    "tls_ca": "KVCM_TLS_CA",
    "tls_cert": "KVCM_TLS_CERT",
    "tls_key": "KVCM_TLS_KEY",
    "token": "KVCM_TOKEN",
    "labels": "KVCM_POOL_LABELS",
    "shipper": "KVCM_SHIPPER",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class KvcmSettings:
    """How a vLLM scheduler uses kvcm.

    Attributes:
        address: The kvcm server (``host:port``); ``None``: mirror runs without a server.
        pool_id: The pool this engine's scheduler owns (``None``: ``vllm-<host>-dp<rank>``).
        mode: ``"mirror"``: answer every manager call from an in-process replica and ship one
            Step program per ``schedule()`` in the background; ``"remote"``: every call that
            answers waits for the server's acknowledgement.
        step_timeout_s: Deadline of one call to the server.
        max_backlog: Steps kept while the server lags or is unreachable; beyond it they are
            dropped and the server is repaired from a snapshot of the mirror instead (the
            scheduler never waits for kvcm in mirror mode).
        shutdown_timeout_s: How long ``shutdown()`` waits for the backlog to be shipped.
        lease_s: The pool's scheduler lease (0: none): if the engine dies, the server frees
            its requests this long after its last call; an idle engine sends KeepAlives.
        tls_ca: PEM file of the CA that signed the server's certificate (TLS on when set).
        tls_cert: PEM client certificate, for a server that requires mutual TLS.
        tls_key: Its key.
        token: Bearer token for a server with ``auth_tokens`` (prefer ``KVCM_TOKEN``: the
            additional config is part of vLLM's compile-cache hash and its logs).
        labels: Labels the pool is created with, for routers' lookup scopes (``role``,
            ``tenant``...), on top of ``model`` and ``data_parallel_rank``, which the
            integration sets from the engine's config. ``KVCM_POOL_LABELS`` reads
            ``key=value,key=value``.
        shipper: Mirror mode with an address: where the Step programs are built, encoded
            and sent. ``"thread"``: a thread of the engine's process (it shares the engine's
            interpreter lock); ``"process"``: a child process the engine hands each step's
            notes to over a pipe (docs/vllm.md, "The shipper process").
    """

    address: str | None = None
    pool_id: str | None = None
    mode: str = "mirror"
    step_timeout_s: float = 10.0
    max_backlog: int = 4096
    shutdown_timeout_s: float = 5.0
    lease_s: float = 0.0
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    shipper: str = "thread"

    @classmethod
    def from_sources(
        cls, additional_config: Any, environ: Mapping[str, str] | None = None
    ) -> KvcmSettings:
        """Read ``additional_config["kvcm"]``, then ``KVCM_*`` variables for what it omits.

        Args:
            additional_config: ``vllm_config.additional_config`` (a dict, or anything else,
                which carries no kvcm settings).
            environ: Environment; ``None``: ``os.environ``.

        Raises:
            ConfigError: An unknown key, or a value out of its domain (the message names it).
        """
        environ = os.environ if environ is None else environ
        given = additional_config.get("kvcm", {}) if isinstance(additional_config, dict) else {}
        if not isinstance(given, Mapping):
            raise ConfigError(f'additional_config["kvcm"] must be a mapping, got {given!r}')
        unknown = sorted(set(given) - set(_ENV))
        if unknown:
            raise ConfigError(
                f'additional_config["kvcm"] has unknown keys {unknown}; known: {sorted(_ENV)}'
            )
        values: dict[str, Any] = {}
        for name, variable in _ENV.items():
            if name in given:
                values[name] = given[name]
            elif variable in environ:
                values[name] = environ[variable]
        try:
            for name in ("step_timeout_s", "shutdown_timeout_s", "lease_s"):
                if name in values:
                    values[name] = float(values[name])
            if "max_backlog" in values:
                values["max_backlog"] = int(values["max_backlog"])
            if isinstance(values.get("labels"), str):
                values["labels"] = _parse_labels(values["labels"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"kvcm settings: {exc}") from exc
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first setting out of its domain."""
        if self.mode not in MODES:
            raise ConfigError(f"kvcm mode must be one of {MODES}, got {self.mode!r}")
        if self.shipper not in SHIPPERS:
            raise ConfigError(f"kvcm shipper must be one of {SHIPPERS}, got {self.shipper!r}")
        if not self.step_timeout_s > 0:
            raise ConfigError(f"kvcm step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.max_backlog < 1:
            raise ConfigError(f"kvcm max_backlog must be >= 1, got {self.max_backlog}")
        if not self.shutdown_timeout_s >= 0:
            raise ConfigError(
                f"kvcm shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}"
            )
        if not self.lease_s >= 0:
            raise ConfigError(f"kvcm lease_s must be >= 0, got {self.lease_s}")
        try:
            check_labels(self.labels, "kvcm labels")
        except InvalidArgumentError as exc:
            raise ConfigError(str(exc)) from None
        if self.mode == "remote" and self.address is None:
            raise ConfigError("kvcm mode 'remote' needs an address (the server answers)")


def _parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"KVCM_POOL_LABELS: {item!r} is not key=value")
        labels[key.strip()] = value.strip()
    return labels
