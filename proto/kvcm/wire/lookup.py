"""Lookup across pools: ``kvcm.v1.LookupRequest`` / ``LookupResponse`` and their core values.

The HTTP side (``POST /v1/lookup``) speaks the same messages in protobuf's canonical JSON
mapping (``bytes`` as base64, 64-bit integers as strings), so the two sides cannot drift.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial
from itertools import chain, islice
from operator import eq
from types import MappingProxyType
from typing import Any, TypeVar

from google.protobuf import json_format  # type: ignore[import-untyped]

from kvcm.common.errors import InvalidArgumentError
from kvcm.common.hashing import MultiModalFeature
from kvcm.core.lookup import DEFAULT_LOAD_WEIGHT, LookupAnswer, LookupQuery, PoolHit, PoolLoad
from kvcm.v1 import lookup_pb2, scheduler_pb2

__all__ = [
    "parse_json_body",
    "lookup_query_from_json",
    "lookup_query_from_proto",
    "lookup_query_to_proto",
    "lookup_result_from_proto",
    "lookup_result_to_json",
    "lookup_result_to_proto",
]


def lookup_query_to_proto(query: LookupQuery, *, packed: bool = True) -> lookup_pb2.LookupRequest:
    """The wire form of a query (asking for the packed answer unless ``packed`` is False)."""
    message = lookup_pb2.LookupRequest(max_results=query.max_results, packed=packed)
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
_M = TypeVar("_M")


def parse_json_body(body: bytes, message: _M) -> _M:
    """``message`` filled from a JSON body in protobuf's JSON mapping (a route's request).

    Raises:
        InvalidArgumentError: Not UTF-8, not JSON, an unknown field or a wrong type
            (``field="body"``; the parser's reason, cut to 300 characters since it may quote
            the body).
    """
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
        reason = str(exc)
        if len(reason) > _MAX_REASON_CHARS:
            reason = f"{reason[:_MAX_REASON_CHARS]}... ({len(reason)} characters)"
        raise InvalidArgumentError(f"request body: {reason}", field="body") from None
    return message


def lookup_query_from_json(body: bytes) -> LookupQuery:
    """The query of a JSON body (``LookupRequest`` in protobuf's JSON mapping).

    Raises:
        InvalidArgumentError: Not UTF-8, not JSON, an unknown field, a wrong type, or a value
            out of its domain (the message names it).
    """
    message = parse_json_body(body, lookup_pb2.LookupRequest())
    return lookup_query_from_proto(message)


def lookup_result_to_proto(
    result: LookupAnswer, *, packed: bool = False
) -> lookup_pb2.LookupResponse:
    """The wire form of an answer: the pools as ``PoolHit`` messages, or with ``packed`` as
    columns in ``PackedPoolHits`` (what the request's ``packed`` asks for)."""
    message = lookup_pb2.LookupResponse(num_pools_in_scope=result.num_pools_in_scope)
    for pool_id, reason in result.skipped:
        message.skipped.add(pool_id=pool_id, reason=reason)
    if packed:
        _pack(result.pools, message.packed)
        return message
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
    return message


def _pack(pools: tuple[PoolHit, ...], packed: lookup_pb2.PackedPoolHits) -> None:
    # Columns by transposition (zip in C), each extended at once.
    packed.SetInParent()
    if not pools:
        return
    names, hits, groups, tiers, num_tokens, loads, scores = zip(*pools, strict=True)
    usage, num_free, num_running, num_waiting = zip(*loads, strict=True)
    packed.pool_id.extend(names)
    packed.num_hit_tokens.extend(hits)
    packed.num_tokens.extend(num_tokens)
    packed.score.extend(scores)
    packed.usage.extend(usage)
    packed.num_free_blocks.extend(num_free)
    packed.num_running.extend(num_running)
    packed.num_waiting.extend(num_waiting)
    flat = list(chain.from_iterable(groups))
    if not (len(flat) == len(hits) and all(groups) and flat == list(hits)):
        packed.num_groups.extend(map(len, groups))
        packed.group_hit_tokens.extend(flat)
    tier = next(iter(tiers[0]), None)
    if tier is not None:
        # One mapping per distinct hit, compared pool by pool in C.
        expected = {hit: {tier: hit} for hit in set(hits)}
        if all(map(eq, tiers, map(expected.__getitem__, hits))):
            packed.tier.append(tier)
            return
    packed.num_tiers.extend(map(len, tiers))
    packed.tier.extend(chain.from_iterable(tiers))
    packed.tier_hit_tokens.extend(chain.from_iterable(tier.values() for tier in tiers))


def _unpack(packed: lookup_pb2.PackedPoolHits) -> tuple[PoolHit, ...]:
    """The pools of ``PackedPoolHits`` (columns checked for equal lengths).

    Pools with the same hit share their (immutable) groups tuple and tiers mapping.

    Raises:
        InvalidArgumentError: The columns do not line up (a damaged or foreign answer).
    """
    names = list(packed.pool_id)
    hits = list(packed.num_hit_tokens)
    count = len(names)
    columns = (
        hits,
        packed.num_tokens,
        packed.score,
        packed.usage,
        packed.num_free_blocks,
        packed.num_running,
        packed.num_waiting,
    )
    if any(len(column) != count for column in columns):
        raise InvalidArgumentError("packed: the answer's columns do not line up", field="packed")
    groups = _unpack_groups(packed, hits)
    tiers = _unpack_tiers(packed, hits)
    loads = map(
        partial(tuple.__new__, PoolLoad),
        zip(
            packed.usage,
            packed.num_free_blocks,
            packed.num_running,
            packed.num_waiting,
            strict=True,
        ),
    )
    return tuple(
        map(
            partial(tuple.__new__, PoolHit),
            zip(names, hits, groups, tiers, packed.num_tokens, loads, packed.score, strict=True),
        )
    )


def _unpack_groups(packed: lookup_pb2.PackedPoolHits, hits: list[int]) -> Iterable[tuple[int, ...]]:
    num_groups = list(packed.num_groups)
    if not num_groups and not packed.group_hit_tokens:
        shared = {hit: (hit,) for hit in set(hits)}
        return map(shared.__getitem__, hits)
    if len(num_groups) != len(hits) or sum(num_groups) != len(packed.group_hit_tokens):
        raise InvalidArgumentError("packed: the answer's columns do not line up", field="packed")
    flat = iter(packed.group_hit_tokens)
    return [tuple(islice(flat, size)) for size in num_groups]


def _unpack_tiers(
    packed: lookup_pb2.PackedPoolHits, hits: list[int]
) -> Iterable[Mapping[str, int]]:
    num_tiers = list(packed.num_tiers)
    names = list(packed.tier)
    if not num_tiers and not packed.tier_hit_tokens and len(names) == 1:
        tier = names[0]
        shared = {hit: MappingProxyType({tier: hit}) for hit in set(hits)}
        return map(shared.__getitem__, hits)
    if (
        len(num_tiers) != len(hits)
        or sum(num_tiers) != len(names)
        or len(names) != len(packed.tier_hit_tokens)
    ):
        raise InvalidArgumentError("packed: the answer's columns do not line up", field="packed")
    pairs = zip(names, packed.tier_hit_tokens, strict=True)
    return [dict(islice(pairs, size)) for size in num_tiers]


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
    """The answer of a wire response (either form).

    Raises:
        InvalidArgumentError: A packed answer's columns do not line up.
    """
    skipped = tuple((item.pool_id, item.reason) for item in message.skipped)
    if message.HasField("packed"):
        return LookupAnswer(_unpack(message.packed), skipped, message.num_pools_in_scope)
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
    return LookupAnswer(tuple(pools), skipped, message.num_pools_in_scope)
