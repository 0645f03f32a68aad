"""Prefix-cache block hashing, bit-identical to vLLM 0.33.0.

A block hash fingerprints a whole prefix: it hashes the triple ``(parent_hash, block_tokens,
extra_keys)``, where ``parent_hash`` is the previous block's hash, or, for the first block, the
pool's *none hash* (the hash of a seed string). Four algorithms exist, with vLLM's names:

==============  ===================================  ==========================
algorithm       serialisation of the triple          digest
==============  ===================================  ==========================
``sha256``      ``pickle`` (protocol 5)              SHA-256 (32 bytes)
``sha256_cbor`` canonical CBOR (``cbor2``)           SHA-256 (32 bytes)
``xxhash``      ``pickle`` (protocol 5)              XXH3-128 (16 bytes)
``xxhash_cbor`` canonical CBOR (``cbor2``)           XXH3-128 (16 bytes)
==============  ===================================  ==========================

Extra keys make blocks with equal tokens but different meaning hash apart. In vLLM's order:
``("lora", lora_name, lora_path)`` on every block of a LoRA request, ``("mm", identifier,
offset_in_block)`` for every multi-modal item the block overlaps (the offset is relative to the
block start and is negative when the item began in an earlier block), ``("cache_salt", salt)``
on the first block only, and ``("prompt_embeds", sha256(raw bytes of the block's embedding
rows))`` when the prompt is given as embeddings. A block without any extra key hashes ``None``
in their place.

Unlike vLLM, kvcm keeps no process-global state: every :class:`BlockHasher` carries its own
algorithm, seed and none hash, so pools with different seeds live side by side in one server.
The seed rule is vLLM's: an explicit seed wins, then ``PYTHONHASHSEED``, then the fixed default
``"vllm-none-hash"`` for the SHA-256 family, or 32 random bytes (hex) for the xxHash family,
whose seed must stay secret because XXH3 is not collision resistant.

NOTE: the pickle-based algorithms serialise object identity as well as value: a ``str`` object
that occurs twice in one block's triple is written once and then referenced. vLLM's requests
arrive through msgspec decoding, so equal strings there are distinct objects; callers of this
module should likewise not share one ``str`` object between two different keys of a block (for
example two multi-modal items with equal identifiers) if they need pickle-identical hashes.
The CBOR algorithms do not depend on identity.
"""

from __future__ import annotations

import enum
import hashlib
import os
import pickle
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NewType, Protocol, TypeAlias, cast

import cbor2
import xxhash as _xxhash

from kvcm.common.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "BlockHash",
    "BlockHashWithGroupId",
    "BlockHasher",
    "ExtraKeys",
    "HashAlgorithm",
    "HashFunction",
    "HashableRequest",
    "MultiModalFeature",
    "PromptEmbeds",
    "external_block_hash",
    "generate_block_hash_extra_keys",
    "generate_lookahead_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn",
    "hash_block_tokens",
    "make_block_hash_with_group_id",
    "none_hash",
    "resolve_none_hash_seed",
    "sha256",
    "sha256_cbor",
    "to_event_extra_keys",
    "xxhash",
    "xxhash_cbor",
]

BlockHash = NewType("BlockHash", bytes)
"""The chained hash of one full block (32 bytes for SHA-256, 16 for XXH3-128)."""

BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
"""A block hash followed by its KV-cache group id as 4 big-endian bytes (the cache key)."""

HashFunction: TypeAlias = Callable[[Any], bytes]
"""Serialises an object and digests it."""

ExtraKeys: TypeAlias = tuple[Any, ...]
"""A block's extra keys, as passed to :func:`hash_block_tokens`."""

DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"
"""vLLM's seed for the SHA-256 family when ``PYTHONHASHSEED`` is unset."""

# Pinned rather than pickle.HIGHEST_PROTOCOL: the bytes must not change with the interpreter.
# Protocol 5 is what HIGHEST_PROTOCOL is on every Python that vLLM 0.33 supports.
_PICKLE_PROTOCOL: Final = 5
_GROUP_ID_NBYTES: Final = 4
_EXTERNAL_HASH_NBYTES: Final = 8


@enum.unique
class HashAlgorithm(enum.StrEnum):
    """Block hash algorithm, named as vLLM's ``--prefix-caching-hash-algo`` names it."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"
    XXHASH = "xxhash"
    XXHASH_CBOR = "xxhash_cbor"

    @property
    def is_cryptographic(self) -> bool:
        """Whether collisions are infeasible even when the seed is known (SHA-256 family)."""
        return self is HashAlgorithm.SHA256 or self is HashAlgorithm.SHA256_CBOR


# --------------------------------------------------------------------------- hash functions


def sha256(value: Any) -> bytes:
    """SHA-256 of ``value`` pickled with protocol 5 (vLLM's ``sha256``)."""
    return hashlib.sha256(pickle.dumps(value, protocol=_PICKLE_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    """SHA-256 of ``value`` as canonical CBOR (vLLM's ``sha256_cbor``)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def xxhash(value: Any) -> bytes:
    """XXH3-128 of ``value`` pickled with protocol 5 (vLLM's ``xxhash``)."""
    return _xxhash.xxh3_128_digest(pickle.dumps(value, protocol=_PICKLE_PROTOCOL))


def xxhash_cbor(value: Any) -> bytes:
    """XXH3-128 of ``value`` as canonical CBOR (vLLM's ``xxhash_cbor``)."""
    return _xxhash.xxh3_128_digest(cbor2.dumps(value, canonical=True))


_HASH_FUNCTIONS: Final[dict[HashAlgorithm, HashFunction]] = {
    HashAlgorithm.SHA256: sha256,
    HashAlgorithm.SHA256_CBOR: sha256_cbor,
    HashAlgorithm.XXHASH: xxhash,
    HashAlgorithm.XXHASH_CBOR: xxhash_cbor,
}


def _algorithm(value: object, field: str = "algorithm") -> HashAlgorithm:
    if isinstance(value, HashAlgorithm):
        return value
    if isinstance(value, str):
        try:
            return HashAlgorithm(value)
        except ValueError:
            pass
    names = ", ".join(a.value for a in HashAlgorithm)
    raise InvalidArgumentError(f"{field} must be one of {names}, got {value!r}")


def get_hash_fn(algorithm: HashAlgorithm | str) -> HashFunction:
    """The hash function of ``algorithm``.

    Raises:
        InvalidArgumentError: ``algorithm`` names no supported algorithm.
    """
    return _HASH_FUNCTIONS[_algorithm(algorithm)]


# --------------------------------------------------------------------------- none hash


def resolve_none_hash_seed(algorithm: HashAlgorithm | str, seed: str | None = None) -> str:
    """The seed the first block's parent hash derives from.

    Args:
        algorithm: The pool's hash algorithm.
        seed: An explicit seed; ``None`` applies vLLM 0.33's rule: ``PYTHONHASHSEED`` if set,
            else ``"vllm-none-hash"`` for the SHA-256 family, else a fresh random seed for the
            xxHash family (so two processes then never share block hashes).

    Raises:
        InvalidArgumentError: ``algorithm`` is unknown or ``seed`` is not a str.
    """
    resolved = _algorithm(algorithm)
    if seed is not None:
        if not isinstance(seed, str):
            raise InvalidArgumentError(f"seed must be a str or None, got {seed!r}")
        return seed
    env_seed = os.environ.get("PYTHONHASHSEED")
    if env_seed is not None:
        return env_seed
    if resolved.is_cryptographic:
        return DEFAULT_NONE_HASH_SEED
    return os.urandom(32).hex()


def none_hash(algorithm: HashAlgorithm | str, seed: str) -> BlockHash:
    """The parent hash of a first block: the hash of the seed string itself (vLLM's NONE_HASH).

    Raises:
        InvalidArgumentError: ``algorithm`` is unknown or ``seed`` is not a str.
    """
    hash_fn = get_hash_fn(algorithm)
    if not isinstance(seed, str):
        raise InvalidArgumentError(f"seed must be a str, got {seed!r}")
    return BlockHash(hash_fn(seed))


# --------------------------------------------------------------------------- keys and ints


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """The cache key of a block of group ``group_id``: the hash, then 4 big-endian bytes."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(_GROUP_ID_NBYTES, "big"))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The block hash inside a cache key."""
    return BlockHash(key[:-_GROUP_ID_NBYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The KV-cache group id inside a cache key."""
    return int.from_bytes(key[-_GROUP_ID_NBYTES:], "big")


def external_block_hash(block_hash: bytes) -> int:
    """The int that vLLM's KV events carry for a block hash (its default int form).

    vLLM reads the whole digest as a big-endian integer and keeps its low 64 bits, which are the
    digest's last 8 bytes.
    """
    return int.from_bytes(block_hash[-_EXTERNAL_HASH_NBYTES:], "big")


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """The part of a multi-modal input that block hashes read.

    Attributes:
        identifier: The item's content hash (vLLM's ``MultiModalFeatureSpec.identifier``, which
            includes a LoRA prefix where applicable).
        offset: Index of the item's first placeholder token in the prompt.
        length: Number of placeholder tokens.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str):
            raise InvalidArgumentError(
                f"mm_features identifier must be a str, got {self.identifier!r}"
            )
        if type(self.offset) is not int or self.offset < 0:
            raise InvalidArgumentError(
                f"mm_features offset must be a non-negative int, got {self.offset!r}"
            )
        if type(self.length) is not int or self.length < 0:
            raise InvalidArgumentError(
                f"mm_features length must be a non-negative int, got {self.length!r}"
            )

    @property
    def end(self) -> int:
        """Index one past the item's last placeholder token."""
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class PromptEmbeds:
    """A prompt given as embeddings, as the bytes that vLLM hashes per block.

    vLLM hashes ``sha256`` of the raw bytes of the embedding rows of each block (rows past the
    prompt's end simply are not there, so decode blocks hash fewer or no bytes). A row-major
    ``[num_tokens, hidden_size]`` buffer in the tensor's own dtype reproduces those bytes
    without torch (``kvcm.client.tensors.prompt_embeds_from_tensor`` captures a tensor).

    Attributes:
        data: The rows' raw bytes, row-major, ``num_tokens`` rows of equal size.
        num_tokens: Number of rows (prompt positions).
    """

    data: bytes
    num_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes):
            raise InvalidArgumentError(
                f"prompt_embeds data must be bytes, got {type(self.data).__name__}"
            )
        if type(self.num_tokens) is not int or self.num_tokens <= 0:
            raise InvalidArgumentError(
                f"prompt_embeds num_tokens must be a positive int, got {self.num_tokens!r}"
            )
        if len(self.data) % self.num_tokens:
            raise InvalidArgumentError(
                f"prompt_embeds data ({len(self.data)} bytes) must hold {self.num_tokens} "
                "rows of equal size"
            )

    @property
    def row_nbytes(self) -> int:
        """Bytes per prompt position."""
        return len(self.data) // self.num_tokens

    def block_digest(self, start_token_idx: int, end_token_idx: int) -> bytes:
        """SHA-256 of the rows ``[start_token_idx, end_token_idx)`` (clipped to the prompt)."""
        row = len(self.data) // self.num_tokens
        view = memoryview(self.data)[start_token_idx * row : end_token_idx * row]
        return hashlib.sha256(view).digest()


class HashableRequest(Protocol):
    """What the hasher reads from a request (kvcm's ``Request`` has these fields)."""

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt plus output token ids."""

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Hashes of the blocks hashed so far."""

    @property
    def lora_name(self) -> str | None:
        """LoRA adapter name, if any."""

    @property
    def lora_path(self) -> str | None:
        """LoRA adapter path, if any (vLLM keys an adapter by name and path)."""

    @property
    def cache_salt(self) -> str | None:
        """Per-tenant salt, if any."""

    @property
    def mm_features(self) -> Sequence[MultiModalFeature]:
        """Multi-modal items sorted by offset, non-overlapping."""

    @property
    def prompt_embeds(self) -> object | None:
        """A :class:`PromptEmbeds` when the prompt is given as embeddings, else ``None``."""


@dataclass(frozen=True, slots=True)
class _KeySource:
    """The per-request inputs of the extra keys, resolved once per hashing call."""

    lora_key: tuple[str, str, str] | None
    mm_features: Sequence[MultiModalFeature]
    cache_salt: str | None
    prompt_embeds: PromptEmbeds | None

    @property
    def is_plain(self) -> bool:
        """Whether no block of the request has extra keys."""
        return (
            self.lora_key is None
            and not self.mm_features
            and not self.cache_salt
            and self.prompt_embeds is None
        )

    @classmethod
    def of(cls, request: HashableRequest) -> _KeySource:
        return cls(
            _lora_key(request.lora_name, request.lora_path),
            request.mm_features,
            request.cache_salt,
            _prompt_embeds(request.prompt_embeds),
        )


def _lora_key(lora_name: str | None, lora_path: str | None) -> tuple[str, str, str] | None:
    # vLLM keys a LoRA by name and path; a request whose adapter is re-pointed at another path
    # must not reuse KV computed with the old weights. vLLM requires a non-empty path; kvcm
    # uses LoRARequest's default "" when the caller knows only the name.
    if not lora_name:
        return None
    return ("lora", lora_name, lora_path or "")


def _prompt_embeds(value: object) -> PromptEmbeds | None:
    if value is None or isinstance(value, PromptEmbeds):
        return value
    raise InvalidArgumentError(
        f"prompt_embeds must be a PromptEmbeds or None, got {type(value).__name__}"
    )


# --------------------------------------------------------------------------- extra keys


def _mm_extra_keys(
    mm_features: Sequence[MultiModalFeature],
    start_token_idx: int,
    end_token_idx: int,
    mm_idx: int,
) -> tuple[list[Any], int]:
    """Keys of the multi-modal items overlapping the block, and the next item to look at.

    Items are sorted by offset and do not overlap, so a cursor carried from block to block
    visits each item once.
    """
    keys: list[Any] = []
    if not mm_features or mm_features[-1].end <= start_token_idx:
        return keys, mm_idx
    if mm_idx < 0:
        mm_idx += len(mm_features)
    num_features = len(mm_features)
    while mm_idx < num_features:
        feature = mm_features[mm_idx]
        offset = feature.offset
        if end_token_idx <= offset:
            break  # the item starts in a later block
        end = offset + feature.length
        if start_token_idx >= end:
            mm_idx += 1  # the item ended in an earlier block
            continue
        keys.append(("mm", feature.identifier, offset - start_token_idx))
        if end_token_idx < end:
            break  # the item continues into the next block, which must see it again
        mm_idx += 1
    return keys, mm_idx


def _extra_keys(
    source: _KeySource, start_token_idx: int, end_token_idx: int, mm_idx: int
) -> tuple[ExtraKeys | None, int]:
    keys: list[Any]
    keys, mm_idx = _mm_extra_keys(source.mm_features, start_token_idx, end_token_idx, mm_idx)
    if source.lora_key is not None:
        keys.insert(0, source.lora_key)
    if source.cache_salt and start_token_idx == 0:
        keys.append(("cache_salt", source.cache_salt))
    prompt_embeds = source.prompt_embeds
    if prompt_embeds is not None:
        keys.append(("prompt_embeds", prompt_embeds.block_digest(start_token_idx, end_token_idx)))
    return (tuple(keys) if keys else None), mm_idx


def generate_block_hash_extra_keys(
    request: HashableRequest, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[ExtraKeys | None, int]:
    """The extra keys of the block ``[start_token_idx, end_token_idx)`` of ``request``.

    Args:
        request: The request (its LoRA, salt, multi-modal items and prompt embeddings).
        start_token_idx: First token of the block.
        end_token_idx: One past the block's last token.
        start_mm_idx: Index of the first multi-modal item that may overlap the block (0 when
            unknown; negative counts from the end).

    Returns:
        The keys (``None`` when there are none) and the item index to pass for the next block.
    """
    return _extra_keys(_KeySource.of(request), start_token_idx, end_token_idx, start_mm_idx)


def _rewind_mm_idx(
    mm_features: Sequence[MultiModalFeature], mm_idx: int, end_token_idx: int
) -> int:
    # The lookahead window reaches into the next block: items that extend past this block's
    # end must be seen again by the next block.
    while mm_idx > 0 and mm_features[mm_idx - 1].end > end_token_idx:
        mm_idx -= 1
    return mm_idx


def generate_lookahead_block_hash_extra_keys(
    request: HashableRequest,
    start_token_idx: int,
    end_token_idx: int,
    hash_end_token_idx: int,
    start_mm_idx: int,
) -> tuple[ExtraKeys | None, int]:
    """Extra keys over a block plus its lookahead tokens (vLLM's Eagle lookahead hashing).

    The keys cover ``[start_token_idx, hash_end_token_idx)``; the returned item index is
    rewound so the next block (starting at ``end_token_idx``) sees items that reach into it.
    """
    keys, mm_idx = generate_block_hash_extra_keys(
        request, start_token_idx, hash_end_token_idx, start_mm_idx
    )
    return keys, _rewind_mm_idx(request.mm_features, mm_idx, end_token_idx)


def to_event_extra_keys(
    extra_keys: Iterable[ExtraKeys | None] | None,
) -> list[ExtraKeys | None] | None:
    """Per-block extra keys in the untagged form vLLM's KV events publish.

    Events drop the tags: a LoRA key becomes its name, a salt the salt, a prompt-embeds key its
    digest, and a multi-modal key ``(identifier, offset_in_block)``.
    """
    if not extra_keys:
        return None
    untagged = [
        None if keys is None else tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
        for keys in extra_keys
    ]
    return untagged or None


def hash_block_tokens(
    hash_fn: HashFunction,
    parent_block_hash: BlockHash,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> BlockHash:
    """The hash of one full block.

    Args:
        hash_fn: The pool's hash function (:func:`get_hash_fn`).
        parent_block_hash: The previous block's hash, or the pool's :func:`none_hash` for the
            first block.
        token_ids: The block's token ids.
        extra_keys: The block's extra keys, or ``None``.
    """
    return BlockHash(hash_fn((parent_block_hash, tuple(token_ids), extra_keys)))


# --------------------------------------------------------------------------- the hasher


class BlockHasher:
    """One pool's block hasher: algorithm, seed and block size, with no global state.

    Hashes are chained over the whole prefix and computed every ``block_size`` tokens (the
    pool's hash block size). The hasher is immutable and may be shared by many requests.

    Attributes:
        block_size: Tokens per hashed block.
        algorithm: The hash algorithm.
        seed: The resolved none-hash seed (hand it to every process that must agree).
        none_hash: Parent hash of every first block.
        num_lookahead_tokens: Tokens after each block that its hash also covers (vLLM's Eagle
            lookahead hashing; 0 for the standard hashes).
    """

    __slots__ = ("_hash_fn", "algorithm", "block_size", "none_hash", "num_lookahead_tokens", "seed")

    def __init__(
        self,
        block_size: int,
        algorithm: HashAlgorithm | str = HashAlgorithm.SHA256,
        seed: str | None = None,
        *,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """Build a hasher.

        Args:
            block_size: Tokens per hashed block (positive).
            algorithm: The hash algorithm (member or its string value).
            seed: The none-hash seed; ``None`` applies vLLM's rule (:func:`resolve_none_hash_seed`).
            num_lookahead_tokens: Lookahead tokens per block hash (non-negative).

        Raises:
            InvalidArgumentError: An argument is out of its domain (the message names it).
        """
        if type(block_size) is not int or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        if type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0:
            raise InvalidArgumentError(
                f"num_lookahead_tokens must be a non-negative int, got {num_lookahead_tokens!r}"
            )
        self.algorithm = _algorithm(algorithm)
        self.block_size = block_size
        self.seed = resolve_none_hash_seed(self.algorithm, seed)
        self._hash_fn = _HASH_FUNCTIONS[self.algorithm]
        self.none_hash = BlockHash(self._hash_fn(self.seed))
        self.num_lookahead_tokens = num_lookahead_tokens

    def __repr__(self) -> str:
        return (
            f"BlockHasher(block_size={self.block_size}, algorithm={self.algorithm.value!r}, "
            f"num_lookahead_tokens={self.num_lookahead_tokens})"
        )

    @property
    def hash_fn(self) -> HashFunction:
        """The algorithm's hash function."""
        return self._hash_fn

    def hash_request_blocks(self, request: HashableRequest) -> list[BlockHash]:
        """Hashes of the blocks of ``request`` that became full since ``request.block_hashes``.

        Args:
            request: The request; ``len(request.block_hashes)`` blocks are already hashed.

        Returns:
            The new hashes, in order (empty when no block became full).

        Raises:
            InvalidArgumentError: ``request.prompt_embeds`` is neither ``None`` nor a
                :class:`PromptEmbeds`.
        """
        block_hashes = request.block_hashes
        token_ids = request.all_token_ids
        # Most decode steps complete no block: answer before building the key source.
        if len(token_ids) - self.num_lookahead_tokens < (len(block_hashes) + 1) * self.block_size:
            return []
        return self._hash_blocks(
            token_ids,
            len(block_hashes),
            block_hashes[-1] if block_hashes else self.none_hash,
            _KeySource.of(request),
        )

    def hash_token_ids(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        prompt_embeds: PromptEmbeds | None = None,
    ) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids``, from scratch (for SDK use).

        Args:
            token_ids: Prompt (plus output) token ids: non-negative ints, not re-validated here
                (a per-token check would cost as much as hashing; ``Request`` validates them).
            lora_name: LoRA adapter name, if any.
            lora_path: LoRA adapter path (vLLM keys it too); ``None`` hashes the empty path.
            cache_salt: Per-tenant salt, if any.
            mm_features: Multi-modal items, sorted by offset.
            prompt_embeds: The prompt's embeddings, if given as embeddings.

        Raises:
            InvalidArgumentError: An argument has the wrong type (the message names it).
        """
        if lora_name is not None and not isinstance(lora_name, str):
            raise InvalidArgumentError(f"lora_name must be a str or None, got {lora_name!r}")
        if lora_path is not None and not isinstance(lora_path, str):
            raise InvalidArgumentError(f"lora_path must be a str or None, got {lora_path!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidArgumentError(f"cache_salt must be a str or None, got {cache_salt!r}")
        for index, feature in enumerate(mm_features):
            if not isinstance(feature, MultiModalFeature):
                raise InvalidArgumentError(
                    f"mm_features[{index}] must be a MultiModalFeature, got {feature!r}"
                )
        source = _KeySource(
            _lora_key(lora_name, lora_path), mm_features, cache_salt, _prompt_embeds(prompt_embeds)
        )
        return self._hash_blocks(token_ids, 0, self.none_hash, source)

    def _hash_blocks(
        self,
        token_ids: Sequence[int],
        num_hashed_blocks: int,
        parent: bytes,
        source: _KeySource,
    ) -> list[BlockHash]:
        block_size = self.block_size
        lookahead = self.num_lookahead_tokens
        start = num_hashed_blocks * block_size
        num_new_blocks = (len(token_ids) - lookahead - start) // block_size
        if num_new_blocks <= 0:
            return []
        stop = start + num_new_blocks * block_size
        # One tuple for all new blocks; slicing it yields each block's tuple directly.
        tokens = tuple(token_ids[start : stop + lookahead])

        mm_features = source.mm_features
        mm_idx = 0
        if start and mm_features and mm_features[-1].end > start:
            # First item that ends after the first new block starts.
            mm_idx = bisect_left(mm_features, start + 1, key=_feature_end)
        hash_triple = _triple_hasher(self.algorithm, block_size)
        plain = source.is_plain
        # Plain bytes in the loop: wrapping each digest in the NewType would cost a call.
        hashes: list[bytes] = []
        append = hashes.append
        for offset in range(0, num_new_blocks * block_size, block_size):
            if plain:
                extra: Any = None
            else:
                block_start = start + offset
                block_end = block_start + block_size
                extra, mm_idx = _extra_keys(source, block_start, block_end + lookahead, mm_idx)
                if lookahead:
                    mm_idx = _rewind_mm_idx(mm_features, mm_idx, block_end)
            end = offset + block_size
            if lookahead:
                # The hash covers the block's tokens and the lookahead tokens after it.
                if lookahead == 1:
                    extra = (extra, tokens[end])
                else:
                    extra = (extra, *tokens[end : end + lookahead])
            parent = hash_triple(parent, tokens[offset:end], extra)
            append(parent)
        return cast("list[BlockHash]", hashes)


def _feature_end(feature: MultiModalFeature) -> int:
    return feature.offset + feature.length


# --------------------------------------------------------------------------- fast serialisation
#
# Hashing a block serialises the triple (parent, tokens, extra_keys). For the pickle algorithms
# the C pickler is already fast; the closures below only save a call layer. For the CBOR
# algorithms cbor2's encoder costs ~150 ns per token id, so kvcm writes the triple's canonical
# CBOR itself (a 3-array of a byte string, an array of unsigned ints, and the extra keys) and
# leaves only the rare extra keys to cbor2. The bytes are identical to
# cbor2.dumps(triple, canonical=True): canonical mode changes map order and float width,
# neither of which occurs outside the extra keys.

_TripleHasher: TypeAlias = Callable[[bytes, tuple[int, ...], Any], bytes]

# NOTE: a pure memo of each token id's CBOR encoding, shared by all hashers (it holds no
# semantic state). Ids below the cap are kept, so it stays under ~20 MB for any vocabulary.
_CBOR_UINTS: dict[int, bytes] = {}
_CBOR_UINTS_CAP: Final = 1 << 18


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item head: major type and minimal-width argument."""
    kind = major << 5
    if value < 24:
        return bytes((kind | value,))
    if value < 1 << 8:
        return bytes((kind | 24, value))
    if value < 1 << 16:
        return bytes((kind | 25,)) + value.to_bytes(2, "big")
    if value < 1 << 32:
        return bytes((kind | 26,)) + value.to_bytes(4, "big")
    return bytes((kind | 27,)) + value.to_bytes(8, "big")


def _cbor_token_ids(token_ids: tuple[int, ...]) -> bytes:
    """The concatenated CBOR items of ``token_ids`` (without the array head)."""
    try:
        return b"".join(map(_CBOR_UINTS.__getitem__, token_ids))
    except KeyError:
        pass
    parts = []
    for token in token_ids:
        encoded = _CBOR_UINTS.get(token)
        if encoded is None:
            # cbor2 itself for the first sighting: exact for any value, negative ones included.
            encoded = cbor2.dumps(token, canonical=True)
            if type(token) is int and 0 <= token < _CBOR_UINTS_CAP:
                _CBOR_UINTS[token] = encoded
        parts.append(encoded)
    return b"".join(parts)


def _triple_hasher(algorithm: HashAlgorithm, block_size: int) -> _TripleHasher:
    """A function hashing ``(parent, tokens, extra)`` exactly as ``get_hash_fn(algorithm)``.

    Built once per hashing call: the CBOR variant memoises the encoding of repeated extra keys
    (a LoRA key is the same on every block) for that call only.
    """
    dumps = pickle.dumps
    sha = hashlib.sha256
    xxh = _xxhash.xxh3_128_digest
    if algorithm is HashAlgorithm.SHA256:

        def sha256_triple(parent: bytes, tokens: tuple[int, ...], extra: Any) -> bytes:
            return sha(dumps((parent, tokens, extra), _PICKLE_PROTOCOL)).digest()

        return sha256_triple
    if algorithm is HashAlgorithm.XXHASH:

        def xxhash_triple(parent: bytes, tokens: tuple[int, ...], extra: Any) -> bytes:
            return xxh(dumps((parent, tokens, extra), _PICKLE_PROTOCOL))

        return xxhash_triple

    is_sha = algorithm is HashAlgorithm.SHA256_CBOR
    heads = {n: b"\x83" + _cbor_head(2, n) for n in (16, 32)}  # 3-array, then the parent
    array_head = _cbor_head(4, block_size)
    tails: dict[Any, bytes] = {None: b"\xf6"}
    join = b"".join

    def cbor_triple(parent: bytes, tokens: tuple[int, ...], extra: Any) -> bytes:
        size = len(parent)
        head = heads.get(size) or b"\x83" + _cbor_head(2, size)
        tail = tails.get(extra)
        if tail is None:
            tail = tails[extra] = cbor2.dumps(extra, canonical=True)
        body = array_head if len(tokens) == block_size else _cbor_head(4, len(tokens))
        data = join((head, parent, body, _cbor_token_ids(tokens), tail))
        return sha(data).digest() if is_sha else xxh(data)

    return cbor_triple
