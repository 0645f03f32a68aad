"""vLLM 0.33's bidirectional P/D flow (``bidirectional_kv_xfer``) on kvcm pools, against vLLM's.

The clusters and the comparison are tests/compat/test_pd_nixl.py's. With bidirectional
transfers a decode engine keeps each finished request's blocks for ``decoder_kv_blocks_ttl``
and answers where they are (``remote_block_ids``, ``remote_num_tokens``); the proxy hands that
to the prefill engine with the conversation's next turn, whose NIXL connector pulls the tokens
it lacks from the decode engine (external tokens on the prefill side) and tells it to free
them; blocks nobody reads are freed when the TTL runs out. Multi-turn conversations, a user
pause within the TTL and a failed decode-side pull, compared turn by turn in mirror and remote
mode, synchronous and asynchronous.
"""

from __future__ import annotations

import pytest
from _engine_core import workload_scale
from test_pd_nixl import MODES, check_pd_flow, server

from kvcm.server.embedded import EmbeddedServer

__all__ = ["server"]  # the module's kvcm server fixture

# CI: mirror mode on the synchronous loop, remote mode on the asynchronous one; KVCM_LONG=1:
# every pair.
PARAMS = [
    (mode, engine_async)
    for mode in MODES
    for engine_async in (False, True)
    if workload_scale() > 1 or engine_async == (mode == "remote")
]


@pytest.mark.parametrize(("mode", "engine_async"), PARAMS)
def test_bidirectional_pd_flow_on_kvcm_equals_vllm(
    mode: str, engine_async: bool, server: EmbeddedServer
) -> None:
    """Every turn of both engines equals vLLM's; the pools end equal and empty of requests."""
    tally = check_pd_flow("bidirectional", mode, engine_async, server)
    assert tally.fabric.get("pull-failed", 0) == 1
