"""kvcm's block hashes against vLLM 0.33.0's, live, on randomised requests.

Both sides see the very same Python objects (token ids, identifiers, salts), so even the
pickle-based algorithms, which serialise string identity, must agree byte for byte.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcm.common.hashing import (
    BlockHash,
    BlockHasher,
    HashAlgorithm,
    MultiModalFeature,
    PromptEmbeds,
    external_block_hash,
    generate_block_hash_extra_keys,
    get_hash_fn,
    make_block_hash_with_group_id,
    none_hash,
    resolve_none_hash_seed,
    to_event_extra_keys,
)


class _Req:
    """The request fields kvcm's hasher reads."""

    def __init__(self, token_ids: list[int], **fields: Any) -> None:
        self.all_token_ids = token_ids
        self.block_hashes: list[BlockHash] = []
        self.lora_name: str | None = fields.get("lora_name")
        self.lora_path: str | None = fields.get("lora_path")
        self.cache_salt: str | None = fields.get("cache_salt")
        self.mm_features: list[MultiModalFeature] = fields.get("mm_features", [])
        self.prompt_embeds: PromptEmbeds | None = fields.get("prompt_embeds")


@pytest.fixture(scope="module")
def ref(vllm: ModuleType) -> dict[str, Any]:
    """vLLM's hashing modules and request types."""
    del vllm
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils import hashing
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    return {
        "kcu": kv_cache_utils,
        "hashing": hashing,
        "Request": Request,
        "SamplingParams": SamplingParams,
        "LoRARequest": LoRARequest,
        "Feature": MultiModalFeatureSpec,
        "Range": PlaceholderRange,
    }


@pytest.fixture
def vllm_none_hash(ref: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set vLLM's process-global NONE_HASH for one test and restore it afterwards."""
    kcu = ref["kcu"]
    monkeypatch.setattr(kcu, "NONE_HASH", getattr(kcu, "NONE_HASH", None), raising=False)
    monkeypatch.setattr(kcu, "_NONE_HASH_SEED", kcu._NONE_HASH_SEED)

    def init(algorithm: str, seed: str | None) -> str:
        """Initialise vLLM from ``seed`` (``None``: its own rule); return the seed it used."""
        if seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = seed
        try:
            kcu.init_none_hash(ref["hashing"].get_hash_fn_by_name(algorithm))
        finally:
            os.environ.pop("PYTHONHASHSEED", None)
        resolved: str = kcu.get_none_hash_seed()
        return resolved

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    return init


def test_hash_functions_and_none_hash(ref: dict[str, Any], vllm_none_hash: Any) -> None:
    values: list[Any] = ["", "x", b"\x00" * 32, (b"p", (1, 2, 3), None), (b"p", (), (("a", 1),))]
    for algorithm in HashAlgorithm:
        theirs = ref["hashing"].get_hash_fn_by_name(algorithm.value)
        ours = get_hash_fn(algorithm)
        for value in values:
            assert ours(value) == theirs(value)
        for seed in (None, "0", "abc"):
            resolved = vllm_none_hash(algorithm.value, seed)
            assert none_hash(algorithm, resolved) == ref["kcu"].NONE_HASH
            if seed is not None or algorithm.is_cryptographic:
                assert resolve_none_hash_seed(algorithm, seed) == resolved


@st.composite
def _mm_layout(draw: st.DrawFn, num_tokens: int) -> list[tuple[str, int, int]]:
    items: list[tuple[str, int, int]] = []
    pos = draw(st.integers(0, 6))
    names = st.sampled_from(["img", "img", "aud", "vid-\u00e9", ""])
    while pos < num_tokens and len(items) < 5:
        length = draw(st.integers(1, 9))
        items.append((draw(names) + str(len(items) % 2), pos, length))
        pos += length + draw(st.integers(0, 5))
    return items


@st.composite
def _case(draw: st.DrawFn) -> dict[str, Any]:
    use_embeds = draw(st.booleans())
    num_prompt = draw(st.integers(1, 40))
    prompt = (
        [0] * num_prompt
        if use_embeds
        else draw(st.lists(st.integers(0, 2**32), min_size=num_prompt, max_size=num_prompt))
    )
    with_lora = draw(st.booleans())
    return {
        "algorithm": draw(st.sampled_from(list(HashAlgorithm))),
        # vLLM reads an explicit seed from PYTHONHASHSEED: no NUL and no lone surrogate (not
        # encodable) in an environment variable.
        "seed": draw(
            st.one_of(
                st.none(),
                st.text(
                    st.characters(exclude_characters="\x00", exclude_categories=("Cs",)),
                    max_size=8,
                ),
            )
        ),
        "block_size": draw(st.integers(1, 8)),
        "lookahead": draw(st.sampled_from([0, 0, 1, 2])),
        "prompt": prompt,
        "chunks": draw(st.lists(st.lists(st.integers(0, 200_000), max_size=5), max_size=6)),
        "lora": (draw(st.text(min_size=1, max_size=6)), draw(st.text(min_size=1, max_size=6)))
        if with_lora
        else None,
        "salt": draw(st.one_of(st.none(), st.text(max_size=6))),
        "mm": draw(_mm_layout(num_prompt)) if draw(st.booleans()) else [],
        "embeds": (draw(st.integers(1, 6)), draw(st.sampled_from(["float16", "bfloat16"])))
        if use_embeds
        else None,
        "torch_seed": draw(st.integers(0, 1000)),
    }


def _prompt_embeds(tensor: Any) -> PromptEmbeds:
    # The SDK's torch module (this test runs where torch is: vLLM needs it).
    from kvcm.client.tensors import prompt_embeds_from_tensor

    return prompt_embeds_from_tensor(tensor)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=_case())
def test_random_requests_match_vllm(
    ref: dict[str, Any], vllm_none_hash: Any, case: dict[str, Any]
) -> None:
    import torch

    algorithm: HashAlgorithm = case["algorithm"]
    seed = vllm_none_hash(algorithm.value, case["seed"])
    kcu = ref["kcu"]
    block_size, lookahead = case["block_size"], case["lookahead"]

    embeds = None
    if case["embeds"] is not None:
        hidden, dtype = case["embeds"]
        gen = torch.Generator().manual_seed(case["torch_seed"])
        embeds = torch.randn(len(case["prompt"]), hidden, generator=gen).to(getattr(torch, dtype))
    features = [MultiModalFeature(*item) for item in case["mm"]]
    lora = case["lora"]
    theirs = ref["Request"](
        request_id="r",
        prompt_token_ids=None if embeds is not None else list(case["prompt"]),
        sampling_params=ref["SamplingParams"](max_tokens=1 << 20),
        pooling_params=None,
        prompt_embeds=embeds,
        mm_features=[
            ref["Feature"](
                data=None,
                modality="image",
                identifier=f.identifier,
                mm_position=ref["Range"](offset=f.offset, length=f.length),
            )
            for f in features
        ]
        or None,
        lora_request=None if lora is None else ref["LoRARequest"](lora[0], 1, lora[1]),
        cache_salt=case["salt"],
        block_hasher=kcu.get_request_block_hasher(
            block_size, ref["hashing"].get_hash_fn_by_name(algorithm.value), lookahead
        ),
    )

    hasher = BlockHasher(block_size, algorithm, seed, num_lookahead_tokens=lookahead)
    fields = {
        "lora_name": None if lora is None else lora[0],
        "lora_path": None if lora is None else lora[1],
        "cache_salt": case["salt"],
        "mm_features": features,
        "prompt_embeds": None if embeds is None else _prompt_embeds(embeds),
    }
    ours = _Req(list(case["prompt"]), **fields)
    ours.block_hashes.extend(hasher.hash_request_blocks(ours))
    assert ours.block_hashes == theirs.block_hashes
    for chunk in case["chunks"]:
        theirs.append_output_token_ids(chunk)
        ours.all_token_ids.extend(chunk)
        ours.block_hashes.extend(hasher.hash_request_blocks(ours))
        assert ours.block_hashes == theirs.block_hashes
    assert hasher.hash_token_ids(ours.all_token_ids, **fields) == theirs.block_hashes

    our_keys, their_keys, our_idx, their_idx = [], [], 0, 0
    for i in range(len(ours.block_hashes)):
        start, end = i * block_size, (i + 1) * block_size
        keys, our_idx = generate_block_hash_extra_keys(ours, start, end, our_idx)
        our_keys.append(keys)
        keys, their_idx = kcu.generate_block_hash_extra_keys(theirs, start, end, their_idx)
        their_keys.append(keys)
        assert our_idx == their_idx
    assert our_keys == their_keys
    assert to_event_extra_keys(our_keys) == kcu.to_event_extra_keys(their_keys)

    for i, block_hash in enumerate(ours.block_hashes):
        assert external_block_hash(block_hash) == kcu.maybe_convert_block_hash(block_hash)
        assert make_block_hash_with_group_id(block_hash, i) == kcu.make_block_hash_with_group_id(
            block_hash, i
        )
