"""kvcm.common.hashing: golden vectors made by vLLM 0.33.0, and the hasher's own behaviours."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvcm.common.errors import InvalidArgumentError
from kvcm.common.hashing import (
    DEFAULT_NONE_HASH_SEED,
    BlockHash,
    BlockHasher,
    HashAlgorithm,
    MultiModalFeature,
    PromptEmbeds,
    external_block_hash,
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_hash_fn,
    hash_block_tokens,
    make_block_hash_with_group_id,
    none_hash,
    resolve_none_hash_seed,
    to_event_extra_keys,
)

GOLDEN = Path(__file__).parents[1] / "golden" / "hash_vectors.json"


class _Req:
    """A request-shaped record for the hasher (kvcm's Request validates more)."""

    def __init__(
        self,
        token_ids: list[int],
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> None:
        self.all_token_ids = token_ids
        self.block_hashes: list[BlockHash] = []
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.cache_salt = cache_salt
        self.mm_features = mm_features or []
        self.prompt_embeds = prompt_embeds


def _load_golden() -> dict[str, Any]:
    with GOLDEN.open() as f:
        data: dict[str, Any] = json.load(f)
    return data


def _case_inputs(case: dict[str, Any]) -> dict[str, Any]:
    embeds = case.get("prompt_embeds")
    return {
        "lora_name": case.get("lora_name"),
        "lora_path": case.get("lora_path"),
        "cache_salt": case.get("cache_salt"),
        "mm_features": [MultiModalFeature(m[0], m[1], m[2]) for m in case.get("mm", [])],
        "prompt_embeds": None
        if embeds is None
        else PromptEmbeds(bytes.fromhex(embeds["data"]), embeds["num_tokens"]),
    }


def _golden_ids() -> list[str]:
    if not GOLDEN.exists():
        return []
    return [c["name"] for c in _load_golden()["cases"]]


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN} is missing: run tests/golden/make_hash_vectors.py")
    return _load_golden()


def test_golden_none_hashes(golden: dict[str, Any]) -> None:
    assert golden["vllm_version"].startswith("0.33.0")
    assert golden["default_sha256_seed"] == DEFAULT_NONE_HASH_SEED
    for entry in golden["none_hashes"]:
        assert none_hash(entry["algorithm"], entry["seed"]).hex() == entry["none_hash"]


@pytest.mark.parametrize("name", _golden_ids())
def test_golden_block_hashes(golden: dict[str, Any], name: str) -> None:
    case = next(c for c in golden["cases"] if c["name"] == name)
    hasher = BlockHasher(
        case["block_size"],
        case["algorithm"],
        case["seed"],
        num_lookahead_tokens=case.get("num_lookahead_tokens", 0),
    )
    inputs = _case_inputs(case)
    tokens = case["token_ids"]
    expected = case["block_hashes"]
    assert [h.hex() for h in hasher.hash_token_ids(tokens, **inputs)] == expected
    # Incrementally, as a request grows token by token, the hashes are the same.
    request = _Req(tokens[:1], **inputs)
    for token in tokens[1:]:
        request.all_token_ids.append(token)
        request.block_hashes.extend(hasher.hash_request_blocks(request))
    assert [h.hex() for h in request.block_hashes] == expected
    assert [external_block_hash(bytes.fromhex(h)) for h in expected] == case["external"]
    if "extra_keys" in case:
        got = []
        mm_idx = 0
        size = case["block_size"]
        for i in range(len(expected)):
            keys, mm_idx = generate_block_hash_extra_keys(request, i * size, (i + 1) * size, mm_idx)
            got.append(keys)
        assert json.loads(json.dumps(got, default=bytes.hex)) == case["extra_keys"]


def test_golden_group_keys(golden: dict[str, Any]) -> None:
    for entry in golden["group_keys"]:
        block_hash = BlockHash(bytes.fromhex(entry["block_hash"]))
        key = make_block_hash_with_group_id(block_hash, entry["group_id"])
        assert key.hex() == entry["key"]
        assert get_block_hash(key) == block_hash
        assert get_group_id(key) == entry["group_id"]


def test_incremental_equals_from_scratch_with_everything() -> None:
    rng = random.Random(7)
    features = [
        MultiModalFeature("img-a", 3, 9),
        MultiModalFeature("img-b", 12, 4),
        MultiModalFeature("aud-c", 30, 21),
    ]
    embeds = PromptEmbeds(bytes(rng.randrange(256) for _ in range(40 * 6)), 40)
    for algorithm in HashAlgorithm:
        for lookahead in (0, 1, 3):
            hasher = BlockHasher(4, algorithm, "s", num_lookahead_tokens=lookahead)
            tokens = [rng.randrange(50_000) for _ in range(61)]
            kwargs: dict[str, Any] = {
                "lora_name": "ad",
                "lora_path": "/ad",
                "cache_salt": "t",
                "mm_features": features,
                "prompt_embeds": embeds,
            }
            scratch = hasher.hash_token_ids(tokens, **kwargs)
            assert len(scratch) == (61 - lookahead) // 4
            request = _Req(tokens[:5], **kwargs)
            request.block_hashes.extend(hasher.hash_request_blocks(request))
            while len(request.all_token_ids) < len(tokens):
                step = rng.randrange(1, 7)
                request.all_token_ids.extend(
                    tokens[len(request.all_token_ids) : len(request.all_token_ids) + step]
                )
                request.block_hashes.extend(hasher.hash_request_blocks(request))
            assert request.block_hashes == scratch


def test_extra_keys_order_and_offsets() -> None:
    request = _Req(
        list(range(16)),
        lora_name="ad",
        lora_path="/ad",
        cache_salt="salt",
        mm_features=[MultiModalFeature("x", 2, 5), MultiModalFeature("y", 7, 2)],
    )
    keys, mm_idx = generate_block_hash_extra_keys(request, 0, 4, 0)
    assert keys == (("lora", "ad", "/ad"), ("mm", "x", 2), ("cache_salt", "salt"))
    assert mm_idx == 0  # "x" continues into the next block
    keys, mm_idx = generate_block_hash_extra_keys(request, 4, 8, mm_idx)
    assert keys == (("lora", "ad", "/ad"), ("mm", "x", -2), ("mm", "y", 3))
    assert mm_idx == 1
    keys, mm_idx = generate_block_hash_extra_keys(request, 8, 12, mm_idx)
    assert keys == (("lora", "ad", "/ad"), ("mm", "y", -1))
    assert mm_idx == 2
    keys, _ = generate_lookahead_block_hash_extra_keys(request, 0, 4, 8, 0)
    assert keys is not None
    assert [k[1] for k in keys] == ["ad", "x", "y", "salt"]
    plain = _Req(list(range(8)), cache_salt="")
    assert generate_block_hash_extra_keys(plain, 0, 4, 0) == (None, 0)
    assert to_event_extra_keys([None, (("lora", "ad", "/ad"), ("mm", "x", -2))]) == [
        None,
        ("ad", ("x", -2)),
    ]
    assert to_event_extra_keys([]) is None


def test_extra_keys_change_hashes_where_vllm_says() -> None:
    hasher = BlockHasher(4, HashAlgorithm.SHA256_CBOR, "s")
    tokens = list(range(12))
    base = hasher.hash_token_ids(tokens)
    salted = hasher.hash_token_ids(tokens, cache_salt="t")
    assert all(a != b for a, b in zip(base, salted, strict=True))  # chained from block 0
    mm = hasher.hash_token_ids(tokens, mm_features=[MultiModalFeature("i", 5, 2)])
    assert mm[0] == base[0]
    assert mm[1] != base[1]
    path = hasher.hash_token_ids(tokens, lora_name="a", lora_path="/one")
    other = hasher.hash_token_ids(tokens, lora_name="a", lora_path="/two")
    assert path[0] != other[0]
    assert hasher.hash_token_ids(tokens[:3]) == []


def test_hash_block_tokens_chains_from_none_hash() -> None:
    hasher = BlockHasher(2, HashAlgorithm.XXHASH, "s")
    fn = get_hash_fn(HashAlgorithm.XXHASH)
    first = hash_block_tokens(fn, hasher.none_hash, [1, 2])
    second = hash_block_tokens(fn, first, (3, 4))
    assert hasher.hash_token_ids([1, 2, 3, 4, 5]) == [first, second]
    assert len(first) == 16
    assert len(BlockHasher(2).none_hash) == 32


def test_seed_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert resolve_none_hash_seed(HashAlgorithm.SHA256) == DEFAULT_NONE_HASH_SEED
    assert resolve_none_hash_seed("sha256_cbor") == DEFAULT_NONE_HASH_SEED
    random_seeds = {resolve_none_hash_seed(HashAlgorithm.XXHASH) for _ in range(3)}
    assert len(random_seeds) == 3
    assert all(len(s) == 64 for s in random_seeds)
    assert resolve_none_hash_seed(HashAlgorithm.XXHASH_CBOR, "mine") == "mine"
    assert BlockHasher(4, "xxhash").seed != BlockHasher(4, "xxhash").seed
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert resolve_none_hash_seed(HashAlgorithm.XXHASH) == "0"
    assert resolve_none_hash_seed(HashAlgorithm.SHA256) == "0"
    assert resolve_none_hash_seed(HashAlgorithm.SHA256, "") == ""
    hasher = BlockHasher(4)
    assert hasher.seed == "0"
    assert hasher.none_hash == none_hash(HashAlgorithm.SHA256, "0")


def test_readme_call_shape() -> None:
    hasher = BlockHasher(algorithm=HashAlgorithm.SHA256_CBOR, seed="my-cluster", block_size=16)
    assert (hasher.block_size, hasher.algorithm, hasher.seed) == (16, "sha256_cbor", "my-cluster")
    assert str(HashAlgorithm.XXHASH) == "xxhash"
    assert HashAlgorithm("sha256") is HashAlgorithm.SHA256


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: BlockHasher(0), "block_size"),
        (lambda: BlockHasher(True), "block_size"),
        (lambda: BlockHasher(4, "md5"), "algorithm"),
        (lambda: BlockHasher(4, seed=3), "seed"),
        (lambda: BlockHasher(4, num_lookahead_tokens=-1), "num_lookahead_tokens"),
        (lambda: none_hash("sha256", None), "seed"),
        (lambda: get_hash_fn("sha1"), "algorithm"),
        (lambda: MultiModalFeature("x", -1, 2), "offset"),
        (lambda: MultiModalFeature("x", 0, -2), "length"),
        (lambda: MultiModalFeature(3, 0, 2), "identifier"),
        (lambda: PromptEmbeds(b"abc", 2), "prompt_embeds"),
        (lambda: PromptEmbeds(b"ab", 0), "num_tokens"),
        (lambda: BlockHasher(2).hash_token_ids([1, 2], cache_salt=5), "cache_salt"),
        (lambda: BlockHasher(2).hash_token_ids([1, 2], lora_name=5), "lora_name"),
        (lambda: BlockHasher(2).hash_token_ids([1, 2], mm_features=[(1, 2)]), r"mm_features\[0\]"),
        (lambda: BlockHasher(2).hash_token_ids([1, 2], prompt_embeds=b"x"), "prompt_embeds"),
    ],
)
def test_errors_name_the_field(call: Any, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        call()


def test_group_keys_and_external_ints() -> None:
    block_hash = BlockHash(bytes(range(32)))
    key = make_block_hash_with_group_id(block_hash, 258)
    assert key[-4:] == b"\x00\x00\x01\x02"
    assert get_block_hash(key) == block_hash
    assert get_group_id(key) == 258
    assert external_block_hash(block_hash) == int.from_bytes(bytes(range(24, 32)), "big")
    assert external_block_hash(b"\x01\x02") == 0x0102


def test_prompt_embeds_digest_clips_past_the_prompt() -> None:
    embeds = PromptEmbeds(bytes(range(12)), 3)
    assert embeds.row_nbytes == 4
    assert embeds.block_digest(2, 4) == embeds.block_digest(2, 3)
    assert embeds.block_digest(5, 7) == embeds.block_digest(3, 3)


@pytest.mark.parametrize("algorithm", list(HashAlgorithm))
def test_fast_triple_serialisation_equals_the_generic_hash_function(
    algorithm: HashAlgorithm,
) -> None:
    from kvcm.common.hashing import _triple_hasher

    generic = get_hash_fn(algorithm)
    fast = _triple_hasher(algorithm, 3)
    odd_tokens = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64, 2**70, -1, -(2**40)]
    parents = [b"", b"p" * 16, b"q" * 32, b"r" * 300]
    extras: list[Any] = [
        None,
        (("lora", "a", "/a"),),
        (("mm", "\u00e9", -3), ("cache_salt", "")),
        (None, 5, 2**40),
        (("prompt_embeds", b"\x00" * 32),),
    ]
    for parent in parents:
        for extra in extras:
            for i in range(len(odd_tokens) - 2):
                tokens = tuple(odd_tokens[i : i + 3])
                assert fast(parent, tokens, extra) == generic((parent, tokens, extra))
            # A run of another length than the block size.
            tokens = tuple(odd_tokens)
            assert fast(parent, tokens, extra) == generic((parent, tokens, extra))


def test_prompt_embeds_from_tensor_are_the_raw_row_bytes() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(12, dtype=torch.float32).reshape(6, 2).to(torch.bfloat16)
    from kvcm.client.tensors import prompt_embeds_from_tensor

    embeds = prompt_embeds_from_tensor(tensor)
    assert embeds.num_tokens == 6
    assert embeds.row_nbytes == 4
    import hashlib

    rows = tensor.view(torch.int16)[2:4].flatten().tolist()
    raw = b"".join(v.to_bytes(2, "little", signed=True) for v in rows)
    assert embeds.block_digest(2, 4) == hashlib.sha256(raw).digest()
