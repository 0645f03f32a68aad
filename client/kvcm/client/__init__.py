"""kvcm's client SDK for schedulers and GPU workers."""

from __future__ import annotations
