"""The server's settings: defaults, overridden by a TOML file, overridden by flags."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Final

from kvcm.common.errors import ConfigError

__all__ = ["DEFAULT_GRPC_ADDRESS", "DEFAULT_HTTP_ADDRESS", "ServerSettings", "load_settings"]

DEFAULT_GRPC_ADDRESS: Final = "127.0.0.1:50051"
DEFAULT_HTTP_ADDRESS: Final = "127.0.0.1:8080"
_LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    """How ``kvcm serve`` runs.

    Attributes:
        grpc_address: ``host:port`` of the gRPC side (port 0: any free port).
        http_address: ``host:port`` of the HTTP side (/metrics, probes); ``""``: no HTTP.
        log_level: Python logging level name.
        max_pools: Pools the server holds at most (CreatePool answers RESOURCE_EXHAUSTED).
        shutdown_grace_s: Seconds in-flight RPCs get to finish on shutdown.
        max_message_bytes: Largest gRPC message either way.
    """

    grpc_address: str = DEFAULT_GRPC_ADDRESS
    http_address: str = DEFAULT_HTTP_ADDRESS
    log_level: str = "INFO"
    max_pools: int = 1024
    shutdown_grace_s: float = 5.0
    max_message_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("grpc_address", "http_address"):
            value = getattr(self, name)
            if not isinstance(value, str) or (value and ":" not in value):
                raise ConfigError(f"{name} must be 'host:port', got {value!r}")
        if not self.grpc_address:
            raise ConfigError("grpc_address must not be empty")
        if self.log_level.upper() not in _LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {_LOG_LEVELS}, got {self.log_level!r}")
        if self.max_pools < 1:
            raise ConfigError(f"max_pools must be >= 1, got {self.max_pools}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.max_message_bytes < 1:
            raise ConfigError(f"max_message_bytes must be >= 1, got {self.max_message_bytes}")


def split_address(address: str) -> tuple[str, int]:
    """``("host", port)`` of ``host:port`` (IPv6 hosts in brackets).

    Raises:
        ConfigError: Not ``host:port`` with a port in [0, 65535].
    """
    host, _, port = address.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not host or not 0 <= number <= 65535:
        raise ConfigError(f"address must be 'host:port', got {address!r}")
    return host.strip("[]"), number


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> ServerSettings:
    """Settings from defaults, the ``[server]`` table of a TOML file, then ``overrides``.

    ``None`` overrides are ignored (a flag that was not given).

    Raises:
        ConfigError: The file is unreadable or names an unknown key, or a value is bad.
    """
    settings = ServerSettings()
    known = {f.name for f in fields(ServerSettings)}
    if config_file is not None:
        try:
            document = tomllib.loads(Path(config_file).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {str(config_file)!r}: {exc}") from exc
        table = document.get("server", {})
        if not isinstance(table, dict):
            raise ConfigError(f"config file {str(config_file)!r}: [server] must be a table")
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(f"config file {str(config_file)!r}: unknown keys {unknown}")
        settings = replace(settings, **table)
    given = {name: value for name, value in overrides.items() if value is not None}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"unknown settings {unknown}")
    return replace(settings, **given)
