"""The kvcm server: allocation core, gRPC servicers and the HTTP side."""

from __future__ import annotations
