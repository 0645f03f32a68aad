"""kvcm's Request record: validation, token bookkeeping and incremental block hashing."""

from __future__ import annotations

import pytest

from kvcm.common.errors import InvalidArgumentError
from kvcm.common.hashing import BlockHasher
from kvcm.core.request import Request, RequestStatus


def test_fields_and_counts() -> None:
    request = Request("r", [1, 2, 3], lora_name="l", cache_salt="s")
    assert request.num_tokens == request.num_prompt_tokens == 3
    assert request.num_computed_tokens == 0
    assert request.num_in_flight_tokens == 0
    assert request.status is RequestStatus.WAITING
    assert request.num_preemptions == 0
    assert not request.skip_reading_prefix_cache
    assert request.block_hashes == []
    request.append_output_token_ids(4)
    request.append_output_token_ids([5, 6])
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert request.prompt_token_ids == [1, 2, 3]
    assert request.num_output_tokens == 3


def test_block_hashes_follow_full_blocks() -> None:
    hasher = BlockHasher(4)
    request = Request("r", range(6), block_hasher=hasher)
    assert len(request.block_hashes) == 1
    request.append_output_token_ids([6, 7])
    assert len(request.block_hashes) == 2
    again = Request("q", range(8), block_hasher=hasher)
    assert again.block_hashes == request.block_hashes
    salted = Request("s", range(8), block_hasher=hasher, cache_salt="x")
    assert salted.block_hashes[0] != request.block_hashes[0]
    lora = Request("t", range(8), block_hasher=hasher, lora_name="adapter")
    assert lora.block_hashes[0] != request.block_hashes[0]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_id": "", "prompt_token_ids": [1]}, "request_id"),
        ({"request_id": "r", "prompt_token_ids": []}, "prompt_token_ids"),
        ({"request_id": "r", "prompt_token_ids": [1, -2]}, r"prompt_token_ids\[1\]"),
        ({"request_id": "r", "prompt_token_ids": [True]}, r"prompt_token_ids\[0\]"),
        ({"request_id": "r", "prompt_token_ids": [1], "lora_id": -1}, "lora_id"),
        ({"request_id": "r", "prompt_token_ids": [1], "lora_path": 3}, "lora_path"),
        ({"request_id": "r", "prompt_token_ids": [1], "status": 3}, "status"),
    ],
)
def test_constructor_validation_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        Request(**kwargs)  # type: ignore[arg-type]


def test_bad_append_changes_nothing() -> None:
    request = Request("r", range(6), block_hasher=BlockHasher(4))
    before = (list(request.all_token_ids), list(request.block_hashes))
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        request.append_output_token_ids([7, -1])
    assert (request.all_token_ids, request.block_hashes) == before


def test_status_enum() -> None:
    assert not RequestStatus.PREEMPTED.is_finished
    assert RequestStatus.FINISHED_ABORTED.is_finished
    assert str(RequestStatus.RUNNING) == "RUNNING"
    request = Request("r", [1], status=RequestStatus.FINISHED_STOPPED)
    assert request.is_finished


def test_lora_path_is_hashed_with_the_name() -> None:
    hasher = BlockHasher(4)
    tokens = range(8)
    a = Request("a", tokens, block_hasher=hasher, lora_name="x", lora_path="/w/1")
    b = Request("b", tokens, block_hasher=hasher, lora_name="x", lora_path="/w/2")
    c = Request("c", tokens, block_hasher=hasher, lora_name="x", lora_path="/w/1")
    assert a.lora_path == "/w/1"
    assert a.block_hashes != b.block_hashes
    assert a.block_hashes == c.block_hashes
