"""Lookup across pools: ``kvcm.v1.LookupRequest`` / ``LookupResponse`` and their core values.

The HTTP side (``POST /v1/lookup``) speaks the same messages in protobuf's canonical JSON
mapping (``bytes`` as base64, 64-bit integers as strings), so the two sides cannot drift.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format  # type: ignore[import-untyped]

from kvcm.common.errors import InvalidArgumentError
from kvcm.common.hashing import MultiModalFeature
from kvcm.core.lookup import DEFAULT_LOAD_WEIGHT, LookupAnswer, LookupQuery, PoolHit, PoolLoad
from kvcm.v1 import lookup_pb2, scheduler_pb2

__all__ = [
    "lookup_query_from_json",
    "lookup_query_from_proto",
    "lookup_query_to_proto",
    "lookup_result_from_proto",
    "lookup_result_to_json",
    "lookup_result_to_proto",
]


def lookup_query_to_proto(query: LookupQuery) -> lookup_pb2.LookupRequest:
    """The wire form of a query."""
    message = lookup_pb2.LookupRequest(max_results=query.max_results)
    if query.load_weight != DEFAULT_LOAD_WEIGHT:
        message.load_weight = query.load_weight
    if query.token_ids is not None:
        tokens = message.tokens
        tokens.token_ids.extend(query.token_ids)
        for name in ("lora_name", "lora_path", "cache_salt"):
            value = getattr(query, name)
            if value is not None:
                setattr(tokens, name, value)
        for feature in query.mm_features:
            tokens.mm_features.add(
                identifier=feature.identifier,
                offset_tokens=feature.offset,
                length_tokens=feature.length,
            )
    else:
        assert query.block_hashes is not None
        message.hashes.block_hashes = query.block_hashes
        message.hashes.num_tokens = query.num_tokens
    message.scope.pool_ids.extend(query.pool_ids)
    message.scope.labels.update(query.labels)
    return message


def _mm_feature(message: scheduler_pb2.MultiModalFeature, index: int) -> MultiModalFeature:
    field = f"tokens.mm_features[{index}]"
    if message.length_tokens < 1:
        raise InvalidArgumentError(f"{field}.length_tokens must be >= 1", field=field)
    return MultiModalFeature(message.identifier, message.offset_tokens, message.length_tokens)


def lookup_query_from_proto(message: lookup_pb2.LookupRequest) -> LookupQuery:
    """The query of a wire request (validated).

    Raises:
        InvalidArgumentError: A field is out of its domain (the message names it).
    """
    kind = message.WhichOneof("prompt")
    weight = message.load_weight if message.HasField("load_weight") else DEFAULT_LOAD_WEIGHT
    common: dict[str, Any] = {
        "pool_ids": tuple(message.scope.pool_ids),
        "labels": dict(message.scope.labels),
        "load_weight": weight,
        "max_results": message.max_results,
    }
    if kind == "tokens":
        tokens = message.tokens
        features = [_mm_feature(item, i) for i, item in enumerate(tokens.mm_features)]
        offsets = [feature.offset for feature in features]
        if offsets != sorted(offsets):
            raise InvalidArgumentError(
                "tokens.mm_features must be sorted by offset_tokens", field="tokens.mm_features"
            )
        return LookupQuery(
            token_ids=list(tokens.token_ids),
            lora_name=tokens.lora_name if tokens.HasField("lora_name") else None,
            lora_path=tokens.lora_path if tokens.HasField("lora_path") else None,
            cache_salt=tokens.cache_salt if tokens.HasField("cache_salt") else None,
            mm_features=tuple(features),
            **common,
        )
    if kind == "hashes":
        return LookupQuery(
            block_hashes=message.hashes.block_hashes,
            num_tokens=message.hashes.num_tokens,
            **common,
        )
    return LookupQuery(**common)  # raises: no prompt


_MAX_REASON_CHARS = 300


def lookup_query_from_json(body: bytes) -> LookupQuery:
    """The query of a JSON body (``LookupRequest`` in protobuf's JSON mapping).

    Raises:
        InvalidArgumentError: Not UTF-8, not JSON, an unknown field, a wrong type, or a value
            out of its domain (the message names it).
    """
    message = lookup_pb2.LookupRequest()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(
            f"request body: not UTF-8 JSON (byte {exc.start} is {body[exc.start]:#04x})",
            field="body",
        ) from None
    try:
        json_format.Parse(text, message)
    except (json_format.ParseError, RecursionError) as exc:
        reason = str(exc)  # may quote the body: kept short
        if len(reason) > _MAX_REASON_CHARS:
            reason = f"{reason[:_MAX_REASON_CHARS]}... ({len(reason)} characters)"
        raise InvalidArgumentError(f"request body: {reason}", field="body") from None
    return lookup_query_from_proto(message)


def lookup_result_to_proto(result: LookupAnswer) -> lookup_pb2.LookupResponse:
    """The wire form of an answer."""
    message = lookup_pb2.LookupResponse(num_pools_in_scope=result.num_pools_in_scope)
    for hit in result.pools:
        load = hit.load
        item = message.pools.add(
            pool_id=hit.pool_id,
            num_hit_tokens=hit.num_hit_tokens,
            group_hit_tokens=hit.group_hit_tokens,
            num_tokens=hit.num_tokens,
            score=hit.score,
        )
        item.tier_hit_tokens.update(hit.tier_hit_tokens)
        item.load.usage = load.usage
        item.load.num_free_blocks = load.num_free_blocks
        item.load.num_running = load.num_running
        item.load.num_waiting = load.num_waiting
    for pool_id, reason in result.skipped:
        message.skipped.add(pool_id=pool_id, reason=reason)
    return message


def lookup_result_to_json(result: LookupAnswer) -> dict[str, Any]:
    """The answer as ``LookupResponse`` JSON (every field present, snake_case names, 64-bit
    integers as JSON numbers where they fit a double exactly)."""
    document: dict[str, Any] = json_format.MessageToDict(
        lookup_result_to_proto(result),
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )
    return document


def lookup_result_from_proto(message: lookup_pb2.LookupResponse) -> LookupAnswer:
    """The answer of a wire response."""
    new_hit = PoolHit._make
    new_load = PoolLoad._make
    pools = []
    for item in message.pools:  # positional construction: a 1,000-pool answer is common
        load = item.load
        pools.append(
            new_hit(
                (
                    item.pool_id,
                    item.num_hit_tokens,
                    tuple(item.group_hit_tokens),
                    dict(item.tier_hit_tokens),
                    item.num_tokens,
                    new_load(
                        (load.usage, load.num_free_blocks, load.num_running, load.num_waiting)
                    ),
                    item.score,
                )
            )
        )
    skipped = tuple((item.pool_id, item.reason) for item in message.skipped)
    return LookupAnswer(tuple(pools), skipped, message.num_pools_in_scope)
