"""The server's log lines: one format for kvcm's and uvicorn's records, text or JSON.

``configure_logging(level, log_format)`` installs one stderr handler on the root logger; uvicorn
runs with ``log_config=None`` so its records reach that handler too. Facts go in ``extra``
fields (``event``, ``pool``, ``code``, ``field`` ...): the text format appends them as
``key=value`` after the message, the JSON format writes them as keys of the line's object::

    2026-01-01T12:00:00.000Z INFO kvcm.server.pools pool created event=pool_created pool=llama
    {"time": "2026-01-01T12:00:00.000Z", "level": "INFO", "logger": "kvcm.server.pools",
     "message": "pool created", "event": "pool_created", "pool": "llama"}

grpc's Python loggers and asyncio's stay at WARNING even with ``DEBUG``: their debug lines
(poller choice, every transport) are not kvcm's. gRPC's C core logs on its own, and only when
asked with ``GRPC_VERBOSITY=debug`` (and ``GRPC_TRACE``).
"""

from __future__ import annotations

import json
import logging
import logging.config
import time
from typing import Any, Final

__all__ = ["LOG_FORMATS", "JsonFormatter", "TextFormatter", "configure_logging"]

LOG_FORMATS: Final = ("text", "json")
# Loggers kept at WARNING whatever the level: their DEBUG lines are library internals.
_QUIET_LOGGERS: Final = ("grpc", "asyncio")
# Every attribute a plain LogRecord has; anything else on a record came from ``extra``.
_RECORD_ATTRS: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


def _timestamp(record: logging.LogRecord) -> str:
    """RFC 3339 UTC with milliseconds (what log pipelines parse without a pattern)."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS}


class TextFormatter(logging.Formatter):
    """``time LEVEL logger message key=value ...``, then the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        """One line (plus a traceback for exceptions)."""
        line = f"{_timestamp(record)} {record.levelname} {record.name} {record.getMessage()}"
        extras = " ".join(f"{key}={value}" for key, value in _extras(record).items())
        if extras:
            line = f"{line} {extras}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the extras, and exc_info."""

    def format(self, record: logging.LogRecord) -> str:
        """The line as compact JSON (values JSON cannot hold are written as strings)."""
        entry: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_extras(record))
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, separators=(",", ":"))


def configure_logging(level: str, log_format: str = "text") -> None:
    """Send every record of the process to stderr in one format.

    Args:
        level: a logging level name (``"INFO"``); applies to kvcm's and uvicorn's loggers.
        log_format: ``"text"`` or ``"json"``.

    Raises:
        ValueError: ``log_format`` is not one of :data:`LOG_FORMATS`.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")
    formatter = JsonFormatter if log_format == "json" else TextFormatter
    quiet = {name: {"level": "WARNING"} for name in _QUIET_LOGGERS}
    # uvicorn's loggers: no handlers of their own, records propagate to the root handler.
    uvicorn = {
        name: {"level": level.upper(), "handlers": [], "propagate": True}
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
    }
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"kvcm": {"()": formatter}},
            "handlers": {
                "stderr": {
                    "class": "logging.StreamHandler",
                    "formatter": "kvcm",
                    "stream": "ext://sys.stderr",
                }
            },
            "root": {"level": level.upper(), "handlers": ["stderr"]},
            "loggers": {**quiet, **uvicorn},
        }
    )
