"""Vocabulary shared by kvcm's server, its schedulers and its GPU workers.

Everything here imports without the server: KV-cache spec types and configs, the
vLLM-compatible block hasher, dtype sizes, KV events and the exception hierarchy.
"""

from __future__ import annotations
