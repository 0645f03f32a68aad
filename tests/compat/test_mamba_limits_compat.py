"""What vLLM 0.33 accepts and refuses for hybrid Mamba models beyond align mode itself, and
kvcm's answer to each: Mamba states covering several tokens (``tokens_per_state``), prefill
and decode context parallelism (PCP/DCP). See docs/mamba.md.
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


def test_pcp_with_mamba_is_refused_with_vllms_reason(vllm: ModuleType) -> None:
    """vLLM's hybrid coordinator refuses prefill context parallelism beside a Mamba group;
    kvcm's scheduler refuses it first, with the same reason (and without PCP it passes)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvcm.integrations.vllm._convert import check_connector_groups

    del vllm
    config = _config(attention_block=MAMBA_BLOCK)
    with pytest.raises(AssertionError) as refused:
        KVCacheManager(
            kv_cache_config=config,
            max_model_len=2048,
            scheduler_block_size=MAMBA_BLOCK,
            hash_block_size=HASH_BLOCK,
            enable_caching=True,
            pcp_world_size=2,
        )
    with pytest.raises(ConfigError) as ours:
        check_connector_groups(_engine_config(pcp=2), config)
    assert str(ours.value) == str(refused.value)
    check_connector_groups(_engine_config(), config)


def test_dcp_with_mamba_is_vllms_and_kvcm_refuses_all_dcp(vllm: ModuleType) -> None:
    """vLLM 0.33 builds a hybrid Mamba manager under decode context parallelism (the Mamba
    state is replicated, full attention's blocks scaled); kvcm models no DCP for any model
    and refuses it at construction, naming it (docs/mamba.md)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvcm.integrations.vllm._scheduler import check_supported

    del vllm
    KVCacheManager(
        kv_cache_config=_config(attention_block=MAMBA_BLOCK),
        max_model_len=2048,
        scheduler_block_size=MAMBA_BLOCK * 2,
        hash_block_size=HASH_BLOCK,
        enable_caching=True,
        dcp_world_size=2,
    )
    engine = _engine_config(dcp=2)
    engine.speculative_config = None
    engine.num_hash_lookahead_tokens = 0
    engine.aux_output_config = SimpleNamespace(enabled=False)
    with pytest.raises(ConfigError, match=r"decode context parallelism \(DCP\)"):
        check_supported(engine)
