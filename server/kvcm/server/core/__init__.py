"""kvcm's allocation core: vLLM 0.33 V1 KV-cache semantics as a pure-Python library.

Deterministic and I/O free: no grpc, fastapi or prometheus_client imports (a test proves it).
"""

from __future__ import annotations
