"""Workers execute the core's block mappings: real bytes moved between CPU tensors.

A real pool decides (a fork's copy-on-write, a host tier's swap-out, demotions and swap-in);
the worker's tensors are planned for the same block count; every block of every layer is
checked after the mappings ran.
"""

from __future__ import annotations

import pytest
import torch

from kvcm.client.tensors import allocate_host_blocks, allocate_kv_cache_tensors, copy_block_pages
from kvcm.client.worker import WorkerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec
from kvcm.core.fork import fork_request, take_fork_copies
from kvcm.core.planning import PlanningOptions, plan_kv_cache
from kvcm.core.pool import Pool, PoolConfig

BS = 4
SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype="float16")
NUM_BLOCKS = 10


def _tensors() -> dict[str, torch.Tensor]:
    specs: dict[str, KVCacheSpec] = {"l0": SPEC, "l1": SPEC, "l2": SPEC}
    options = PlanningOptions(max_model_len=32, num_gpu_blocks_override=NUM_BLOCKS)
    config = plan_kv_cache([specs], [1 << 22], options).ranks[0].kv_cache_config
    assert config.num_blocks == NUM_BLOCKS
    return allocate_kv_cache_tensors(config)


def _pool(host_blocks: int = 0) -> Pool:
    layout = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0", "l1", "l2"), kv_cache_spec=SPEC),),
    )
    return Pool(
        "p",
        PoolConfig(
            max_model_len=64,
            explicit_layout=layout,
            host_tier_bytes=host_blocks * SPEC.page_size_bytes * 3,
        ),
    )


def _admit(pool: Pool, key: int, tokens: list[int]) -> list[int]:
    hasher = BlockHasher(BS, pool.hashing.algorithm, pool.hashing.seed)
    pool.add_request(key, f"r{key}", tokens, b"".join(hasher.hash_token_ids(tokens)))
    ids = pool.allocate(key, len(tokens), 0)
    assert ids is not None
    return ids[0]


def _fill(kv: dict[str, torch.Tensor], block_ids: list[int], seed: int) -> None:
    # What the forward pass would write: a distinct pattern per layer and block.
    generator = torch.Generator().manual_seed(seed)
    for layer in kv.values():
        for block_id in block_ids:
            layer[block_id] = torch.randn(layer.shape[1:], generator=generator).to(layer.dtype)


def _snapshot(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: layer.clone() for name, layer in kv.items()}


def test_fork_copy_on_write_copies_the_shared_block_and_nothing_else() -> None:
    kv = _tensors()
    pool = _pool()
    parent = _admit(pool, 1, [1, 2, 3, 4, 5, 6])
    _fill(kv, parent, seed=1)
    fork_request(pool, 1, 2, "child", 6)
    pool.append_tokens(2, [7], b"")
    assert pool.allocate(2, 1, 6) == ([],)
    copies = take_fork_copies(pool)
    ((source, destination),) = copies
    before = _snapshot(kv)
    WorkerClient.apply_block_mappings(kv, copies=copies)
    for name, layer in kv.items():
        for block_id in range(NUM_BLOCKS):
            expected = before[name][source if block_id == destination else block_id]
            assert torch.equal(layer[block_id], expected), (name, block_id)


def test_swap_out_demotions_and_swap_in_move_every_block() -> None:
    kv = _tensors()
    pool = _pool(host_blocks=6)
    host = allocate_host_blocks(kv, 6, pin_memory=False)
    tokens = list(range(10))  # two full blocks and a partial one
    table = _admit(pool, 1, tokens)
    _fill(kv, table, seed=2)
    original = {name: layer[table].clone() for name, layer in kv.items()}
    pool.request(1).num_computed_tokens = len(tokens)
    out = pool.swap_out(1)
    assert out is not None
    assert [device for device, _ in out] == table
    WorkerClient.apply_block_mappings(kv, host_blocks=host, device_to_host=out)
    for name, layer in host.items():
        for position, (_, host_id) in enumerate(out):
            assert torch.equal(layer[host_id], original[name][position])
    # Other requests take the whole device pool: the cached blocks are evicted (their keys
    # are in the tier already) and every block is rewritten by its new owner.
    for key in (2, 3):
        pool.take_host_copies()
        ids = _admit(pool, key, list(range(100 * key, 100 * key + 16)))
        demoted, loaded = pool.take_host_copies()
        WorkerClient.apply_block_mappings(
            kv, host_blocks=host, device_to_host=demoted, host_to_device=loaded
        )
        _fill(kv, ids, seed=10 + key)
        pool.request(key).num_computed_tokens = 16
        pool.free(key, preempt=False)
    pool.take_host_copies()
    admission = pool.swap_in(1, 1)
    assert admission is not None
    # The first block is still cached on the device; the rest comes back from the host.
    assert (admission.num_device_hit_tokens, admission.num_host_hit_tokens) == (4, 6)
    assert len(admission.host_to_device) == 2
    demoted, _ = pool.take_host_copies()
    WorkerClient.apply_block_mappings(
        kv, host_blocks=host, device_to_host=demoted, host_to_device=admission.host_to_device
    )
    assert pool.manager is not None
    restored = pool.manager.get_block_ids("1")[0][:3]
    for name, layer in kv.items():
        for position, block_id in enumerate(restored):
            assert torch.equal(layer[block_id], original[name][position]), (name, position)


def test_bad_mappings_name_the_field_and_copy_nothing() -> None:
    kv = _tensors()
    _fill(kv, list(range(NUM_BLOCKS)), seed=3)
    before = _snapshot(kv)
    with pytest.raises(InvalidArgumentError, match=r"copies\.destination\[1\]"):
        copy_block_pages(kv, kv, [(1, 2), (3, NUM_BLOCKS)])
    with pytest.raises(InvalidArgumentError, match="appears twice"):
        copy_block_pages(kv, kv, [(1, 2), (3, 2)])
    with pytest.raises(InvalidArgumentError, match="host_blocks"):
        WorkerClient.apply_block_mappings(kv, device_to_host=[(1, 0)])
    for name, layer in kv.items():
        assert torch.equal(layer, before[name])
    # A block that is a destination and a later pair's source is read before it is written.
    copy_block_pages(kv, kv, [(1, 2), (2, 3)])
    for name, layer in kv.items():
        assert torch.equal(layer[2], before[name][1])
        assert torch.equal(layer[3], before[name][2])
