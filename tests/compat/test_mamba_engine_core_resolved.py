"""vLLM's real EngineCore on a hybrid Mamba model whose block sizes vLLM itself resolves.

``test_mamba_engine_core`` sets align mode and 256-token blocks by hand on a toy Mamba layer.
Here nothing is set by hand but the user's options: the model is Nemotron-H (the layer dims of
Nemotron-H-8B: 128 Mamba2 heads of 64, state 128, 8 groups, conv kernel 4; attention 8 KV
heads of 128) from a Hugging Face config written here, four layers (Mamba, MLP, Mamba,
attention), nothing downloaded. vLLM's own config path decides: ``VllmConfig`` runs the
hybrid model's ``verify_and_update_config`` (align mode, prefix caching on), the executor
runs the platform's hybrid block-size alignment after "loading" the model, as vLLM's
executors do (the attention block grown until its page holds a Mamba state, at
FlashAttention's kernel block granularity; the Mamba block equal to it in align mode; the
Mamba page padded to the attention page), and the simulated workers report the specs the
model's layers build from that config: the Mamba state shapes and dtypes from vLLM's model
class. With ``--prefix-match-unit`` a fifth of that block, EngineCore resolves the hash block
size and the cache-hit alignment, and kvcm's schedulers (mirror mode, and remote mode on a
kvcm server on 127.0.0.1) must answer it turn for turn as vLLM's own scheduler does.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _engine_core import (
    VOCAB,
    Engine,
    Setup,
    SimulatedWorker,
    assert_same_runs,
    executor_class,
    workload_scale,
)
from test_mamba_engine_core import _plans

from kvcm.server.embedded import EmbeddedServer, start_embedded_server
from kvcm.server.settings import ServerSettings

# Nemotron-H-8B's layer dims; "M" Mamba2 mixer, "-" MLP, "*" attention.
NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 4,
    "hybrid_override_pattern": "M-M*",
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 16384,
    "torch_dtype": "bfloat16",
}
# What the alignment gives for these dims (checked against vLLM's answer, not fed to it):
# a Mamba state of 3 x 10240 fp16 + 128 x 64 x 128 fp32 bytes, attention 4096 bytes a token,
# so 65 kernel blocks of 16.
RESOLVED_BLOCK = 1040
MATCH_UNIT = RESOLVED_BLOCK // 5


def _model_dir() -> str:
    path = Path(tempfile.mkdtemp(prefix="kvcm-nemotron-h-"))
    (path / "config.json").write_text(json.dumps(NEMOTRON_H))
    return str(path)


class _NemotronHWorker(SimulatedWorker):
    """Reports the specs Nemotron-H's layers build from the resolved config."""

    def get_kv_cache_spec(self) -> dict[str, Any]:
        import torch
        from vllm.model_executor.models import ModelRegistry
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

        config = self.vllm_config
        cache = config.cache_config
        model = config.model_config
        model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
        attention = FullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=model.get_num_kv_heads(config.parallel_config),
            head_size=model.get_head_size(),
            dtype=torch.float16,
        )
        mamba = MambaSpec(
            block_size=cache.mamba_block_size,
            shapes=model_cls.get_mamba_state_shape_from_config(config),
            dtypes=model_cls.get_mamba_state_dtype_from_config(config),
            page_size_padded=cache.mamba_page_size_padded,
            mamba_cache_mode=cache.mamba_cache_mode,
        )
        specs: dict[str, Any] = {}
        for layer, kind in enumerate(NEMOTRON_H["hybrid_override_pattern"]):
            if kind == "M":
                specs[f"model.layers.{layer}.mixer"] = mamba
            elif kind == "*":
                specs[f"model.layers.{layer}.mixer.attn"] = attention
        return specs


def _build(
    setup: Setup,
    monkeypatch: pytest.MonkeyPatch,
    scheduler_cls: Any = None,
    additional_config: Any = None,
) -> Engine:
    import _engine_core
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.engine.core import EngineCore

    base = executor_class(setup)

    def init_executor(self: Any) -> None:
        base._init_executor(self)
        # As vLLM's executors do once the model is loaded (update_block_size_for_backend):
        # this CPU machine's platform knows no attention backend, so run the hybrid alignment
        # a CUDA platform runs, with FlashAttention's kernel blocks.
        Platform._align_hybrid_block_size(self.vllm_config, FlashAttentionBackend)
        world = self.vllm_config.parallel_config.world_size
        self.workers = [_NemotronHWorker(self.vllm_config, r, setup) for r in range(world)]

    executor = type("NemotronHExecutor", (base,), {"_init_executor": init_executor})
    monkeypatch.setattr(_engine_core, "_model_dir", _model_dir)
    config = _engine_core.vllm_config(setup, scheduler_cls, additional_config)
    cache = config.cache_config
    # vLLM's hybrid verification ran in VllmConfig: align mode with prefix caching on.
    assert config.model_config.is_hybrid
    assert cache.mamba_cache_mode == "align"
    cache.prefix_match_unit = MATCH_UNIT  # the user's --prefix-match-unit
    config.parallel_config.distributed_executor_backend = executor
    core = EngineCore(config, executor, setup.log_stats)
    return Engine(core, setup)


SETUP = Setup(
    block_size=16,  # the user's --block-size; the hybrid alignment overrides it
    num_blocks=24,
    max_model_len=4 * RESOLVED_BLOCK,
    max_num_batched_tokens=2 * RESOLVED_BLOCK,
    max_num_seqs=6,
)


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A kvcm server on 127.0.0.1 (gRPC only)."""
    embedded = start_embedded_server(ServerSettings(grpc_address="127.0.0.1:0", http_address=""))
    try:
        yield embedded
    finally:
        embedded.stop()


@pytest.mark.parametrize("mode", ["mirror", "remote"])
def test_resolved_hybrid_mamba_engine_turns_equal_vllm(
    mode: str, server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch, vllm: Any
) -> None:
    """vLLM resolves the block sizes, hash block and alignment; kvcm's scheduler answers
    every turn as vLLM's own, sub-block hits and their copies included."""
    from test_vllm_shipping import mirror_state, server_pool_state

    from kvcm.integrations.vllm import KvcmScheduler

    del vllm
    plans = _plans(11 + len(mode), 24 * workload_scale(), SETUP.max_model_len)
    pool_id = f"nemotron-h-{mode}"
    config = {"kvcm": {"mode": mode}}
    if mode == "remote":
        config["kvcm"].update(address=server.grpc_address, pool_id=pool_id)
    reference = _build(SETUP, monkeypatch)
    engine = _build(SETUP, monkeypatch, KvcmScheduler, config)
    copies = {"n": 0}
    try:
        for side in (reference, engine):
            cache = side.core.vllm_config.cache_config
            assert cache.block_size == cache.mamba_block_size == RESOLVED_BLOCK
            assert cache.mamba_page_size_padded is not None
            kv_config = side.scheduler.kv_cache_config
            assert kv_config.hash_block_size == MATCH_UNIT
            assert kv_config.cache_hit_alignment_tokens == MATCH_UNIT
            assert side.scheduler.mamba_partial_cache_hit
        assert engine.scheduler.kv_cache_config == reference.scheduler.kv_cache_config
        manager = engine.scheduler.kv_cache_manager
        assert manager.coordinator.enable_partial_hash_hits
        original = manager.take_kv_cache_block_copies

        def counting() -> tuple[list[Any], list[Any]]:
            found = original()
            copies["n"] += len(found[0])
            return found

        manager.take_kv_cache_block_copies = counting
        tally = assert_same_runs(reference, engine, plans)
        if mode == "remote":
            assert manager.sink.acknowledges_each_answer
            assert manager.sink.stats.step_rpcs == manager.sink.stats.steps_submitted
            assert manager.flush(30.0), manager.sink.stats
            assert manager.sink.stats.mismatches == 0
            assert server_pool_state(server, pool_id) == mirror_state(engine)
    finally:
        engine.shutdown()
        reference.shutdown()
    print(
        f"\nNemotron-H {mode}: block {RESOLVED_BLOCK}, hash block {MATCH_UNIT}: {tally.turns} "
        f"turns, {tally.batches} batches, {tally.events} events, {tally.hits} hits, "
        f"{copies['n']} block copies, {tally.preempted} preemptions"
    )
    assert tally.hits > 0
    assert copies["n"] > 0
    assert tally.finished == len(plans)
