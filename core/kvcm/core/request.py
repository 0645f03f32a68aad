"""kvcm's own request record: the fields vLLM's V1 KV-cache manager reads from a request.

The record carries no sampling or scheduling state beyond what the allocation core needs. Its
``block_hashes`` grow through an optional per-pool ``BlockHasher`` when the request is built and
whenever output tokens are appended, exactly as vLLM's ``Request.update_block_hashes`` does.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvcm.common.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvcm.common.hashing import BlockHash, BlockHasher, MultiModalFeature

__all__ = ["Request", "RequestStatus"]


@enum.unique
class RequestStatus(enum.IntEnum):
    """Lifecycle state of a request, with vLLM's members and order.

    Every status after ``PREEMPTED`` means the request is finished. The manager reads the status
    only to decide whether the admission watermark applies (``WAITING`` and ``PREEMPTED``).
    """

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @property
    def is_finished(self) -> bool:
        """Whether this status ends the request."""
        return self > RequestStatus.PREEMPTED


def _validated_token_ids(field: str, token_ids: Iterable[int]) -> list[int]:
    tokens = list(token_ids)
    for index, token in enumerate(tokens):
        # bool is an int subclass; a True "token" is almost certainly a caller bug.
        if type(token) is not int or token < 0:
            raise InvalidArgumentError(
                f"{field}[{index}] must be a non-negative int, got {token!r}"
            )
    return tokens


class Request:
    """One sequence as the KV-cache manager sees it.

    Attributes:
        request_id: Unique id of the request within its pool.
        prompt_token_ids: The prompt's token ids (a private copy).
        all_token_ids: Prompt plus output token ids. Treat as read-only; append through
            ``append_output_token_ids`` so the block hashes stay in step.
        num_prompt_tokens: Length of the prompt.
        num_computed_tokens: Tokens whose KV is computed (or scheduled, optimistically); the
            scheduler owns and updates it.
        num_in_flight_tokens: Tokens of steps whose output has not been processed yet (async
            scheduling); sliding-window frees stay behind them.
        block_hashes: Chained hashes of the full ``hash_block_size`` blocks of
            ``all_token_ids``.
        lora_name: LoRA adapter name, part of the block hash (isolation between adapters).
        lora_id: LoRA adapter integer id, reported in KV events.
        lora_path: LoRA adapter path, part of the block hash with the name (vLLM keys an
            adapter by both, so re-pointed weights do not reuse old KV).
        cache_salt: Salt mixed into the first block hash (isolation between tenants).
        mm_features: Multi-modal inputs, part of the block hashes of the blocks they cover.
        prompt_embeds: Opaque per-prompt embedding payload when the prompt is given as
            embeddings; ``None`` otherwise.
        session_id: Optional session id, reported in KV events.
        status: The request's lifecycle state.
        num_preemptions: How many times the scheduler preempted the request.
        skip_reading_prefix_cache: The request computes everything itself (prompt logprobs,
            all-token pooling) and never reads the prefix cache.
        report_cached_blocks: A prefix-cache hit is reported in KV events as ``BlockStored``
            (vLLM's ``kv_cache_report_mode="full"``); otherwise only newly stored blocks are.
    """

    __slots__ = (
        "_block_hasher",
        "all_token_ids",
        "block_hashes",
        "cache_salt",
        "lora_id",
        "lora_name",
        "lora_path",
        "mm_features",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "prompt_embeds",
        "prompt_token_ids",
        "report_cached_blocks",
        "request_id",
        "session_id",
        "skip_reading_prefix_cache",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        block_hasher: BlockHasher | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        prompt_embeds: object | None = None,
        session_id: str | None = None,
        status: RequestStatus = RequestStatus.WAITING,
        skip_reading_prefix_cache: bool = False,
        report_cached_blocks: bool = False,
    ) -> None:
        """Build and validate a request, hashing its prompt's full blocks.

        Args:
            request_id: Unique, non-empty id.
            prompt_token_ids: At least one non-negative token id.
            block_hasher: The pool's hasher; ``None`` leaves ``block_hashes`` empty (no
                prefix caching for this request).
            lora_name: LoRA adapter name, if any.
            lora_id: LoRA adapter id, if any (events only).
            lora_path: LoRA adapter path, if any (hashed with the name).
            cache_salt: Per-tenant salt, if any.
            mm_features: Multi-modal inputs, in prompt order.
            prompt_embeds: Prompt embeddings payload, if the prompt is given as embeddings.
            session_id: Session id for events, if any.
            status: Initial status.
            skip_reading_prefix_cache: Opt out of prefix-cache reads.
            report_cached_blocks: Report prefix-cache hits in KV events (a bool).

        Raises:
            InvalidArgumentError: A field is out of its domain (the message names it).
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        tokens = _validated_token_ids("prompt_token_ids", prompt_token_ids)
        if not tokens:
            raise InvalidArgumentError("prompt_token_ids must not be empty")
        if lora_name is not None and not isinstance(lora_name, str):
            raise InvalidArgumentError(f"lora_name must be a str or None, got {lora_name!r}")
        if lora_path is not None and not isinstance(lora_path, str):
            raise InvalidArgumentError(f"lora_path must be a str or None, got {lora_path!r}")
        if lora_id is not None and (type(lora_id) is not int or lora_id < 0):
            raise InvalidArgumentError(f"lora_id must be a non-negative int, got {lora_id!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidArgumentError(f"cache_salt must be a str or None, got {cache_salt!r}")
        if type(report_cached_blocks) is not bool:
            raise InvalidArgumentError(
                f"report_cached_blocks must be a bool, got {report_cached_blocks!r}"
            )
        if not isinstance(status, RequestStatus):
            raise InvalidArgumentError(f"status must be a RequestStatus, got {status!r}")
        self.request_id = request_id
        self.prompt_token_ids = tokens
        self.all_token_ids = tokens.copy()
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.lora_path = lora_path
        self.cache_salt = cache_salt
        self.mm_features = list(mm_features)
        self.prompt_embeds = prompt_embeds
        self.session_id = session_id
        self.status = status
        self.num_preemptions = 0
        self.skip_reading_prefix_cache = bool(skip_reading_prefix_cache)
        self.report_cached_blocks = report_cached_blocks
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the request's status is a finished one."""
        return self.status > RequestStatus.PREEMPTED

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens and hash the blocks they complete.

        Args:
            token_ids: One token id or a sequence of them.

        Raises:
            InvalidArgumentError: A token id is not a non-negative int (nothing is appended).
        """
        if isinstance(token_ids, int):
            new_tokens = _validated_token_ids("token_ids", (token_ids,))
        else:
            new_tokens = _validated_token_ids("token_ids", token_ids)
        self.all_token_ids.extend(new_tokens)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Hash the blocks that became full since the last call (no-op without a hasher)."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher.hash_request_blocks(self))

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status!s})"
        )
