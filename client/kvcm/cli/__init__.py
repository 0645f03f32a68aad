"""The ``kvcm`` command line: the server's commands and the operator's.

``kvcm serve`` and ``kvcm data-dir check|recover`` run the server's code (``kvcm[server]``);
``kvcm pools``, ``kvcm describe``, ``kvcm lookup`` and ``kvcm events`` talk to a running
server through the SDK and need only the base install (``kvcm events --zmq`` reads vLLM's
ZMQ wire, which needs pyzmq and msgspec). docs/server.md describes every command.
"""

from __future__ import annotations

from kvcm.cli._main import main

__all__ = ["main"]
