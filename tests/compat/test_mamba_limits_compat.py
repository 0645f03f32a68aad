"""What vLLM 0.33 accepts and refuses for hybrid Mamba models beyond align mode itself, and
kvcm's answer to each: Mamba states covering several tokens (``tokens_per_state``), prefill
and decode context parallelism (PCP/DCP). See docs/mamba.md; DCP itself is compared in
test_dcp_compat.py.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kvcm.common.errors import ConfigError

HASH_BLOCK = 64
MAMBA_BLOCK = 256


def _config(tokens_per_state: int = -1, attention_block: int = HASH_BLOCK) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    attention = FullAttentionSpec(
        block_size=attention_block, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    mamba = MambaSpec(
        block_size=MAMBA_BLOCK,
        shapes=((4, 32),),
        dtypes=(torch.float16,),
        mamba_cache_mode="align",
        tokens_per_state=tokens_per_state,
    )
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["attn"], attention), KVCacheGroupSpec(["m"], mamba)],
    )


def _engine_config(dcp: int = 1, pcp: int = 1, transfer: Any = None) -> Any:
    # The fields vLLM's resolve_kv_cache_block_sizes and kvcm's checks read.
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=HASH_BLOCK, prefix_match_unit=None, enable_prefix_caching=True
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp
        ),
        kv_transfer_config=transfer,
        max_concurrent_batches=1,
    )


def _vllm_resolution(config: Any) -> tuple[int, int] | str:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    try:
        return resolve_kv_cache_block_sizes(config, _engine_config())
    except ValueError as error:
        return str(error)


def _kvcm_resolution(config: Any, scheduler_block: int, hash_block: int) -> str | None:
    from kvcm.integrations.vllm._convert import check_engine_resolution, convert_kv_cache_config

    convert_kv_cache_config(config)
    try:
        check_engine_resolution(
            config,
            scheduler_block_size=scheduler_block,
            hash_block_size=hash_block,
            enable_caching=True,
        )
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("tokens_per_state", [-1, 2, 32, 64, 128, 256])
def test_tokens_per_state_is_accepted_and_checked_as_vllm(
    tokens_per_state: int, vllm: ModuleType
) -> None:
    """vLLM's KV-cache manager never reads a Mamba spec's ``tokens_per_state``; EngineCore only
    requires the hit alignment (here the 64-token hash block: sub-block hits) to be a
    multiple of it. kvcm converts the spec and refuses exactly where vLLM does, with its
    message."""
    del vllm
    config = _config(tokens_per_state)
    theirs = _vllm_resolution(config)
    mine = _kvcm_resolution(config, MAMBA_BLOCK, HASH_BLOCK)
    if isinstance(theirs, str):
        assert mine == theirs
        assert tokens_per_state > HASH_BLOCK
    else:
        assert theirs == (MAMBA_BLOCK, HASH_BLOCK)
        assert mine is None


def test_pcp_with_mamba_is_accepted_as_vllms_scheduler_accepts_it(vllm: ModuleType) -> None:
    """vLLM's hybrid coordinator would refuse prefill context parallelism beside a Mamba group,
    but vLLM 0.33's scheduler never hands it PCP: it builds its manager with
    ``pcp_world_size=1`` (the KV cache is replicated over the PCP ranks). So kvcm accepts the
    setting and its manager decides as without PCP, like vLLM's scheduler's."""
    import inspect

    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvcm.integrations.vllm._convert import check_connector_groups
    from kvcm.integrations.vllm._scheduler import check_supported

    del vllm
    config = _config(attention_block=MAMBA_BLOCK)
    with pytest.raises(AssertionError, match="PCP only supports full attention"):
        KVCacheManager(
            kv_cache_config=config,
            max_model_len=2048,
            scheduler_block_size=MAMBA_BLOCK,
            hash_block_size=HASH_BLOCK,
            enable_caching=True,
            pcp_world_size=2,
        )
    # A tripwire on vLLM's own construction: should a later vLLM pass PCP on, this fails.
    assert "pcp_world_size=1," in inspect.getsource(Scheduler.__init__)
    engine = _engine_config(pcp=2)
    engine.speculative_config = None
    engine.num_hash_lookahead_tokens = 0
    engine.aux_output_config = SimpleNamespace(enabled=False)
    check_connector_groups(engine, config)
    check_supported(engine)


def test_dcp_with_mamba_is_modelled_as_vllm_resolves_and_builds_it(vllm: ModuleType) -> None:
    """Under decode context parallelism vLLM 0.33 scales full attention's blocks (64 x 2 =
    128 here) and keeps the Mamba state whole (256): EngineCore resolves scheduler block 256
    and hash block 128, and its manager serves hits on 128-token boundaries. kvcm's scheduler
    accepts the setting, and its manager resolves and decides the same."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    from kvcm.core.manager import KVCacheManager, KVCacheManagerConfig
    from kvcm.integrations.vllm._convert import check_engine_resolution, convert_kv_cache_config
    from kvcm.integrations.vllm._scheduler import check_supported

    del vllm
    config = _config()
    engine = _engine_config(dcp=2)
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(config, engine)
    assert (scheduler_block, hash_block) == (MAMBA_BLOCK, HASH_BLOCK * 2)
    theirs = VllmManager(
        kv_cache_config=config,
        max_model_len=2048,
        scheduler_block_size=scheduler_block,
        hash_block_size=hash_block,
        enable_caching=True,
        dcp_world_size=2,
    )
    ours = KVCacheManager(
        KVCacheManagerConfig(
            kv_cache_config=convert_kv_cache_config(config), max_model_len=2048, dcp_world_size=2
        )
    )
    assert (ours.scheduler_block_size, ours.hash_block_size) == (scheduler_block, hash_block)
    assert [m.block_size for m in ours.coordinator.single_type_managers] == [
        m.block_size for m in theirs.coordinator.single_type_managers
    ]
    assert ours.coordinator.enable_partial_hash_hits == theirs.coordinator.enable_partial_hash_hits
    engine.speculative_config = None
    engine.num_hash_lookahead_tokens = 0
    engine.aux_output_config = SimpleNamespace(enabled=False)
    check_supported(engine)
    check_engine_resolution(
        config,
        scheduler_block_size=scheduler_block,
        hash_block_size=hash_block,
        enable_caching=True,
        dcp_world_size=2,
    )
