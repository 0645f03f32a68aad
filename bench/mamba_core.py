"""Benchmark rows: a hybrid full attention + Mamba model in vLLM 0.33's "align" mode.

The pool has a full-attention group of 64-token blocks and an align-mode Mamba group of
256-token blocks; hashes are 64 tokens, so prefix hits land on 64-token boundaries and a hit
ending inside a Mamba block is served through a copy of that block (drained with
``take_kv_cache_block_copies``, whose retained blocks are released right away, as vLLM's
scheduler does once no step is in flight). Two rows, on kvcm's core and vLLM's
KVCacheManager in the same run (ratio = vLLM / kvcm):

1. decode step: 256 running requests, one new token each (``allocate_slots(req, 1)``).
2. admission with a sub-block hit: a 32k-token prompt whose first 16,448 tokens are cached
   (the warm request's prompt tail boundary, inside a Mamba block): lookup, allocate the
   rest, record stats, drain the copy. Between samples the request is freed and its new
   blocks evicted (untimed).

Called from ``bench/core.py``; ``python bench/mamba_core.py [--quick]`` prints these rows only.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from _common import Row, Sample, import_vllm, init_vllm_none_hash, measure, print_table

from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher, HashAlgorithm
from kvcm.common.specs import FullAttentionSpec, KVCacheSpec, MambaSpec
from kvcm.core.manager import KVCacheManager, KVCacheManagerConfig
from kvcm.core.request import Request, RequestStatus

__all__ = ["bench_mamba_rows"]

ATTN_BLOCK = 64
MAMBA_BLOCK = 256
HASH_SEED = "kvcm-bench"
HASH_ALGORITHM = HashAlgorithm.SHA256
VOCAB = 32_000
MAX_MODEL_LEN = 40_960
VLLM_MODULES = (
    "vllm.utils.hashing",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.request",
    "vllm.sampling_params",
)
# The warm prompt: its tail boundary (length less one token, floored to the hash block) lies
# inside a Mamba block, so the admitted request hits there, 64 tokens past a Mamba boundary.
WARM_TOKENS = 16_484
EXPECTED_HIT = 16_448
ADMIT_TOKENS = 32_768
DECODE_REQUESTS = 256
DECODE_PROMPT = 1000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


class _KvcmSide:
    name = "kvcm"

    def __init__(self, num_blocks: int) -> None:
        specs: list[KVCacheSpec] = [
            FullAttentionSpec(
                block_size=ATTN_BLOCK, num_kv_heads=8, head_size=128, dtype=DType.BFLOAT16
            ),
            MambaSpec(
                block_size=MAMBA_BLOCK,
                shapes=((64, 128), (4, 256)),
                dtypes=(DType.BFLOAT16, DType.BFLOAT16),
                mamba_cache_mode="align",
            ),
        ]
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=(),
            kv_cache_groups=tuple(
                KVCacheGroupSpec(layer_names=(f"layer.{i}",), kv_cache_spec=spec)
                for i, spec in enumerate(specs)
            ),
        )
        self.manager = KVCacheManager(
            KVCacheManagerConfig(
                kv_cache_config=config,
                max_model_len=MAX_MODEL_LEN,
                log_stats=True,
                prefix_cache_retention_interval=0,
            )
        )
        self.hasher = BlockHasher(self.manager.hash_block_size, HASH_ALGORITHM, HASH_SEED)

    def request(self, request_id: str, tokens: list[int]) -> Any:
        return Request(request_id, tokens, block_hasher=self.hasher)

    @staticmethod
    def set_status(request: Any, running: bool) -> None:
        request.status = RequestStatus.RUNNING if running else RequestStatus.WAITING

    def allocate(self, request: Any, num_new: int, hit: Any = None) -> list[int]:
        blocks = self.manager.allocate_slots(request, num_new, hit)
        if blocks is None:
            raise RuntimeError("allocation did not fit")
        if hit is not None:
            request.num_computed_tokens = hit.num_computed_tokens
        request.num_computed_tokens += num_new
        return [i for group in blocks.get_block_ids() for i in group]

    def lookup(self, request: Any) -> tuple[Any, int]:
        hit = self.manager.get_computed_blocks(request)
        return hit, hit.num_computed_tokens

    def admit(self, request: Any) -> tuple[int, list[int], int]:
        manager = self.manager
        hit, num_hit = self.lookup(request)
        ids = self.allocate(request, request.num_tokens - num_hit, hit)
        manager.record_prefix_cache_stats(request, num_hit)
        return num_hit, ids, self.drain_copies()

    def drain_copies(self) -> int:
        copies, retained = self.manager.take_kv_cache_block_copies()
        self.manager.block_pool.free_blocks(retained)
        return len(copies)

    def decode_step(self, requests: list[Any]) -> None:
        manager = self.manager
        allocate = manager.allocate_slots
        manager.new_step_starts()
        for request in requests:
            if allocate(request, 1) is None:
                raise RuntimeError("decode step did not fit")
            request.num_computed_tokens += 1

    def free(self, request: Any) -> None:
        self.manager.free(request)

    def evict(self, block_ids: list[int]) -> None:
        self.manager.evict_blocks([i for i in block_ids if i])

    def free_order(self) -> list[int]:
        return [b.block_id for b in self.manager.block_pool.free_block_queue.get_all_free_blocks()]


class _VllmSide(_KvcmSide):
    name = "vllm"

    def __init__(self, ref: dict[str, ModuleType], num_blocks: int) -> None:
        import torch

        kci = ref["vllm.v1.kv_cache_interface"]
        kcu = ref["vllm.v1.core.kv_cache_utils"]
        hash_fn = ref["vllm.utils.hashing"].get_hash_fn_by_name(HASH_ALGORITHM.value)
        init_vllm_none_hash(kcu, hash_fn, HASH_SEED)
        self._hasher = kcu.get_request_block_hasher(ATTN_BLOCK, hash_fn)
        self._request_mod = ref["vllm.v1.request"]
        self._sampling = ref["vllm.sampling_params"]
        specs = [
            kci.FullAttentionSpec(
                block_size=ATTN_BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
            ),
            kci.MambaSpec(
                block_size=MAMBA_BLOCK,
                shapes=((64, 128), (4, 256)),
                dtypes=(torch.bfloat16, torch.bfloat16),
                mamba_cache_mode="align",
            ),
        ]
        config = kci.KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                kci.KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=spec)
                for i, spec in enumerate(specs)
            ],
            prefix_cache_retention_interval=0,
        )
        self.manager = ref["vllm.v1.core.kv_cache_manager"].KVCacheManager(  # type: ignore[assignment]
            kv_cache_config=config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=MAMBA_BLOCK,
            hash_block_size=ATTN_BLOCK,
            enable_caching=True,
            log_stats=True,
        )

    def request(self, request_id: str, tokens: list[int]) -> Any:
        return self._request_mod.Request(
            request_id=request_id,
            prompt_token_ids=list(tokens),
            sampling_params=self._sampling.SamplingParams(max_tokens=1 << 20),
            pooling_params=None,
            block_hasher=self._hasher,
        )

    def set_status(self, request: Any, running: bool) -> None:  # type: ignore[override]
        status = self._request_mod.RequestStatus
        request.status = status.RUNNING if running else status.WAITING

    def allocate(self, request: Any, num_new: int, hit: Any = None) -> list[int]:
        blocks = self.manager.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=0 if hit is None else hit[1],
            new_computed_blocks=None if hit is None else hit[0],
        )
        if blocks is None:
            raise RuntimeError("allocation did not fit")
        if hit is not None:
            request.num_computed_tokens = hit[1]
        request.num_computed_tokens += num_new
        return [i for group in blocks.get_block_ids() for i in group]

    def lookup(self, request: Any) -> tuple[Any, int]:
        blocks, num_hit, junction = self.manager.get_computed_blocks(request)
        request.shared_prefix_boundary = junction
        return (blocks, num_hit), num_hit

    def admit(self, request: Any) -> tuple[int, list[int], int]:
        hit, num_hit = self.lookup(request)
        ids = self.allocate(request, request.num_tokens - num_hit, hit)
        self.manager.record_prefix_cache_stats(request, num_hit)
        return num_hit, ids, self.drain_copies()

    def drain_copies(self) -> int:
        copies, retained = self.manager.take_kv_cache_block_copies()
        self.manager.block_pool.free_blocks(retained)
        return len(copies)

    def evict(self, block_ids: list[int]) -> None:
        self.manager.evict_blocks({i for i in block_ids if i})


Side = _KvcmSide


def _prefill(side: Side, request: Any) -> None:
    # Chunks as vLLM's scheduler cuts them in align mode: the prompt's tail boundary first.
    side.set_status(request, True)
    tail = (request.num_tokens - 1) // ATTN_BLOCK * ATTN_BLOCK
    side.allocate(request, tail)
    side.allocate(request, request.num_tokens - tail)
    side.drain_copies()


def _decode_sample(side: Side) -> Sample:
    rng = random.Random(1)
    requests = []
    for i in range(DECODE_REQUESTS):
        request = side.request(f"d{i}", _tokens(rng, DECODE_PROMPT + i))
        _prefill(side, request)
        requests.append(request)
    next_tokens = _tokens(rng, 4096)
    step = 0

    def sample() -> float:
        nonlocal step
        token = next_tokens[step % len(next_tokens)]
        step += 1
        for request in requests:
            request.append_output_token_ids(token)
        start = _now()
        side.decode_step(requests)
        return _now() - start

    return sample


def _admit_sample(side: Side) -> Sample:
    rng = random.Random(2)
    warm_tokens = _tokens(rng, WARM_TOKENS)
    warm = side.request("warm", warm_tokens)
    _prefill(side, warm)
    side.free(warm)
    request = side.request("admit", warm_tokens + _tokens(rng, ADMIT_TOKENS - WARM_TOKENS))

    def sample() -> float:
        request.num_computed_tokens = 0
        side.set_status(request, False)
        side.manager.new_step_starts()  # the scheduler's step start: last step's states are done
        start = _now()
        num_hit, new_ids, num_copies = side.admit(request)
        elapsed = _now() - start
        if num_hit != EXPECTED_HIT or num_copies != 1:
            raise RuntimeError(f"{side.name}: hit {num_hit} tokens with {num_copies} copies")
        side.free(request)
        side.evict(new_ids)
        return elapsed

    return sample


def _now() -> float:
    import time

    return time.perf_counter()


WORKLOADS: tuple[tuple[str, Callable[[Side], Sample], int, int], ...] = (
    ("hybrid full+Mamba align: decode step", _decode_sample, 8 * DECODE_REQUESTS * 24, 300),
    ("hybrid full+Mamba align: admit 32k, sub-block hit", _admit_sample, 4096, 100),
)


def bench_mamba_rows(ref: dict[str, ModuleType] | None, *, quick: bool = False) -> list[Row]:
    """Time the hybrid Mamba rows on kvcm and, if ``ref`` is given, on vLLM in the same run."""
    rows = []
    for name, make_sample, num_blocks, repeats in WORKLOADS:
        kvcm_side = _KvcmSide(num_blocks)
        samples = [make_sample(kvcm_side)]
        vllm_side = None
        if ref is not None:
            vllm_side = _VllmSide(ref, num_blocks)
            samples.append(make_sample(vllm_side))
        timings = measure(samples, 20 if quick else repeats)
        if vllm_side is not None and kvcm_side.free_order() != vllm_side.free_order():
            raise RuntimeError(f"{name}: kvcm and vLLM free queues differ; the runs diverged")
        rows.append(Row.of_timings(name, timings[0], timings[1] if len(timings) > 1 else None))
        del samples, kvcm_side, vllm_side
        gc.collect()
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the hybrid Mamba rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="few samples: a smoke run")
    parser.add_argument("--no-vllm", action="store_true", help="time kvcm only")
    args = parser.parse_args(argv)
    ref = None if args.no_vllm else import_vllm(*VLLM_MODULES)
    print_table(
        bench_mamba_rows(ref, quick=args.quick),
        "kvcm core vs vLLM 0.33.0, hybrid Mamba align (ratio = vLLM / kvcm)",
    )


if __name__ == "__main__":
    main()
