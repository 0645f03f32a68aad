"""Write tests/golden/hash_vectors.json with vLLM 0.33.0's own hashing functions.

Run it with the vLLM reference's interpreter (``bash ../shared/tools/vllm-reference/setup.sh``
builds it), from the repository root and with no ``PYTHONPATH``::

    env -u PYTHONPATH -u PYTHONHASHSEED \\
        ~/.cache/kvcm/vllm-ref/bin/python tests/golden/make_hash_vectors.py

The file records, for each case, the inputs (token ids, LoRA, salt, multi-modal items, prompt
embedding bytes, lookahead) and what vLLM computes from them: the block hashes produced by
``get_request_block_hasher`` on a real ``vllm.v1.request.Request`` grown by output tokens, the
per-block extra keys, the KV-event int form of each hash, NONE_HASH per algorithm and seed, and
group-id cache keys. kvcm's unit tests replay it without vLLM.

Each case's inputs go through a JSON round trip before vLLM sees them, so equal strings are
distinct objects on both sides (pickle-based hashes depend on string identity).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
os.environ.pop("PYTHONHASHSEED", None)

import torch
import vllm
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request
from vllm.v1.utils import tensor_data

OUT = Path(__file__).with_name("hash_vectors.json")
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
SEEDS = ("vllm-none-hash", "0", "my-cluster", "", "seed with spaces \u00e9")


def set_none_hash(algorithm: str, seed: str) -> Any:
    """Initialise vLLM's process-global NONE_HASH from ``seed``; return the hash function."""
    hash_fn = get_hash_fn_by_name(algorithm)
    os.environ["PYTHONHASHSEED"] = seed
    try:
        kcu.init_none_hash(hash_fn)
    finally:
        del os.environ["PYTHONHASHSEED"]
    return hash_fn


def embeds_tensor(spec: dict[str, Any]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(spec["torch_seed"])
    dtype = getattr(torch, spec["dtype"])
    return torch.randn(spec["num_tokens"], spec["hidden"], generator=gen).to(dtype)


def build_request(case: dict[str, Any], hasher: Any) -> Request:
    lora = LoRARequest(case["lora_name"], 1, case["lora_path"]) if case.get("lora_name") else None
    mm = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=PlaceholderRange(offset=offset, length=length),
        )
        for ident, offset, length in case.get("mm", [])
    ]
    embeds = embeds_tensor(case["embeds_spec"]) if "embeds_spec" in case else None
    prompt_ids = None if embeds is not None else case["prompt_token_ids"]
    request = Request(
        request_id=case["name"],
        prompt_token_ids=prompt_ids,
        sampling_params=SamplingParams(max_tokens=1 << 20),
        pooling_params=None,
        prompt_embeds=embeds,
        mm_features=mm or None,
        lora_request=lora,
        cache_salt=case.get("cache_salt"),
        block_hasher=hasher,
    )
    # Decode: one token at a time, so vLLM's incremental path produces the hashes.
    for token in case["output_token_ids"]:
        request.append_output_token_ids(token)
    return request


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    case = json.loads(json.dumps(case))
    hash_fn = set_none_hash(case["algorithm"], case["seed"])
    lookahead = case.get("num_lookahead_tokens", 0)
    block_size = case["block_size"]
    hasher = kcu.get_request_block_hasher(block_size, hash_fn, lookahead)
    request = build_request(case, hasher)
    hashes = list(request.block_hashes)
    out = {k: v for k, v in case.items() if k not in ("prompt_token_ids", "output_token_ids")}
    out["token_ids"] = list(request.all_token_ids)
    if "embeds_spec" in case:
        out["prompt_embeds"] = {
            "data": bytes(tensor_data(request.prompt_embeds)).hex(),
            "num_tokens": case["embeds_spec"]["num_tokens"],
        }
        del out["embeds_spec"]
    out["block_hashes"] = [h.hex() for h in hashes]
    out["external"] = [kcu.maybe_convert_block_hash(h) for h in hashes]
    if not lookahead:
        extra, mm_idx = [], 0
        for i in range(len(hashes)):
            keys, mm_idx = kcu.generate_block_hash_extra_keys(
                request, i * block_size, (i + 1) * block_size, mm_idx
            )
            extra.append(keys)
        out["extra_keys"] = json.loads(json.dumps(extra, default=bytes.hex))
    return out


def make_cases() -> list[dict[str, Any]]:
    rng = random.Random(20260433)
    edge_tokens = [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**33]
    cases: list[dict[str, Any]] = []

    def add(name: str, **fields: Any) -> None:
        fields.setdefault("output_token_ids", [])
        cases.append({"name": name, **fields})

    for algorithm in ALGORITHMS:
        for seed in SEEDS:
            add(
                f"{algorithm}/seed={seed!r}/plain",
                algorithm=algorithm,
                seed=seed,
                block_size=4,
                prompt_token_ids=[rng.randrange(150_000) for _ in range(17)],
                output_token_ids=[rng.randrange(150_000) for _ in range(6)],
            )
        add(
            f"{algorithm}/edge-token-ids",
            algorithm=algorithm,
            seed="0",
            block_size=5,
            prompt_token_ids=edge_tokens + edge_tokens[::-1],
        )
        add(
            f"{algorithm}/block-size-1",
            algorithm=algorithm,
            seed="0",
            block_size=1,
            prompt_token_ids=[7, 7, 7],
        )
        add(
            f"{algorithm}/block-size-16",
            algorithm=algorithm,
            seed="my-cluster",
            block_size=16,
            prompt_token_ids=[rng.randrange(32_000) for _ in range(50)],
            output_token_ids=[rng.randrange(32_000) for _ in range(20)],
        )
        add(
            f"{algorithm}/lora",
            algorithm=algorithm,
            seed="0",
            block_size=4,
            lora_name="sql-adapter",
            lora_path="/adapters/sql",
            prompt_token_ids=list(range(10)),
            output_token_ids=[5, 6],
        )
        add(
            f"{algorithm}/salt",
            algorithm=algorithm,
            seed="0",
            block_size=4,
            cache_salt="tenant-42",
            prompt_token_ids=list(range(12)),
        )
        add(
            f"{algorithm}/mm",
            algorithm=algorithm,
            seed="0",
            block_size=4,
            # An item inside one block, one spanning blocks (negative offsets after its first
            # block), two sharing a block, and one starting on a block boundary.
            mm=[["img-a", 1, 2], ["img-b", 6, 7], ["img-c", 14, 1], ["img-b", 16, 8]],
            prompt_token_ids=list(range(100, 128)),
            output_token_ids=[1, 2, 3, 4, 5],
        )
        add(
            f"{algorithm}/everything",
            algorithm=algorithm,
            seed="my-cluster",
            block_size=4,
            lora_name="a",
            lora_path="/a",
            cache_salt="s",
            mm=[["vid", 0, 9], ["aud", 9, 3]],
            prompt_token_ids=list(range(14)),
            output_token_ids=[9, 9, 9, 9, 9],
        )
        add(
            f"{algorithm}/prompt-embeds",
            algorithm=algorithm,
            seed="0",
            block_size=4,
            embeds_spec={"num_tokens": 10, "hidden": 8, "dtype": "float16", "torch_seed": 1},
            cache_salt="s",
            # Decode blocks reach past the prompt: their embedding digests cover fewer rows.
            output_token_ids=[11, 12, 13, 14, 15, 16, 17, 18],
        )
        add(
            f"{algorithm}/prompt-embeds-bf16",
            algorithm=algorithm,
            seed="0",
            block_size=3,
            embeds_spec={"num_tokens": 7, "hidden": 5, "dtype": "bfloat16", "torch_seed": 2},
            output_token_ids=[1, 2],
        )
        for lookahead in (1, 3):
            add(
                f"{algorithm}/lookahead-{lookahead}",
                algorithm=algorithm,
                seed="0",
                block_size=4,
                num_lookahead_tokens=lookahead,
                cache_salt="s",
                lora_name="a",
                lora_path="/a",
                mm=[["img", 2, 5], ["img2", 11, 2]],
                prompt_token_ids=list(range(200, 215)),
                output_token_ids=[1, 2, 3, 4, 5, 6],
            )
    return cases


def main() -> None:
    if not vllm.__version__.startswith("0.33.0"):
        sys.exit(f"expected vLLM 0.33.0, found {vllm.__version__}")
    none_hashes = []
    for algorithm in ALGORITHMS:
        for seed in SEEDS:
            set_none_hash(algorithm, seed)
            none_hashes.append(
                {"algorithm": algorithm, "seed": seed, "none_hash": kcu.NONE_HASH.hex()}
            )
    sha_default = kcu.resolve_none_hash_seed(get_hash_fn_by_name("sha256"))
    cases = [run_case(case) for case in make_cases()]
    group_keys = []
    for case in cases[:4]:
        for group_id in (0, 1, 7, 65_535, 2**32 - 1):
            block_hash = bytes.fromhex(case["block_hashes"][0])
            key = kcu.make_block_hash_with_group_id(kcu.BlockHash(block_hash), group_id)
            group_keys.append(
                {"block_hash": block_hash.hex(), "group_id": group_id, "key": key.hex()}
            )
    data = {
        "vllm_version": vllm.__version__,
        "default_sha256_seed": sha_default,
        "none_hashes": none_hashes,
        "cases": cases,
        "group_keys": group_keys,
    }
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=True) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
