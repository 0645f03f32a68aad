"""P/D routing: ``kvcm.v1.RoutePdRequest`` / ``RoutePdResponse`` and their core values.

The prompt and the pools' answers travel as Lookup's (``TokenPrompt``/``HashPrompt``,
``PoolHit``), converted by :mod:`kvcm.wire.lookup`; ``POST /v1/pd/route`` speaks the same
messages in protobuf's JSON mapping.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format  # type: ignore[import-untyped]

from kvcm.core.lookup import DEFAULT_LOAD_WEIGHT, LookupAnswer
from kvcm.core.pd_route import HeldRequest, PdRoute, PdRouteQuery, PdScope
from kvcm.v1 import lookup_pb2, pd_pb2
from kvcm.wire.lookup import (
    lookup_query_from_proto,
    lookup_query_to_proto,
    lookup_result_from_proto,
    lookup_result_to_proto,
    parse_json_body,
)

__all__ = [
    "pd_route_from_proto",
    "pd_route_query_from_json",
    "pd_route_query_from_proto",
    "pd_route_query_to_proto",
    "pd_route_to_json",
    "pd_route_to_proto",
]


def pd_route_query_to_proto(query: PdRouteQuery) -> pd_pb2.RoutePdRequest:
    """The wire form of a routing query."""
    lookup = lookup_query_to_proto(query.prompt, packed=False)
    message = pd_pb2.RoutePdRequest(
        max_results=query.prompt.max_results, bidirectional=query.bidirectional
    )
    if lookup.HasField("tokens"):
        message.tokens.CopyFrom(lookup.tokens)
    else:
        message.hashes.CopyFrom(lookup.hashes)
    if query.prompt.load_weight != DEFAULT_LOAD_WEIGHT:
        message.load_weight = query.prompt.load_weight
    for scope, target in (
        (query.prefill, message.prefill_scope),
        (query.decode, message.decode_scope),
    ):
        target.pool_ids.extend(scope.pool_ids)
        target.labels.update(scope.labels)
    for item in query.held:
        message.held.add(pool_id=item.pool_id, request_id=item.request_id)
    return message


def pd_route_query_from_proto(message: pd_pb2.RoutePdRequest) -> PdRouteQuery:
    """The query of a wire request (validated).

    Raises:
        InvalidArgumentError: A field is out of its domain (the message names it).
    """
    lookup = lookup_pb2.LookupRequest(max_results=message.max_results)
    kind = message.WhichOneof("prompt")
    if kind == "tokens":
        lookup.tokens.CopyFrom(message.tokens)
    elif kind == "hashes":
        lookup.hashes.CopyFrom(message.hashes)
    if message.HasField("load_weight"):
        lookup.load_weight = message.load_weight
    prompt = lookup_query_from_proto(lookup)
    return PdRouteQuery(
        prompt=prompt,
        prefill=PdScope(
            pool_ids=tuple(message.prefill_scope.pool_ids),
            labels=dict(message.prefill_scope.labels),
        ),
        decode=PdScope(
            pool_ids=tuple(message.decode_scope.pool_ids),
            labels=dict(message.decode_scope.labels),
        ),
        bidirectional=message.bidirectional,
        held=tuple(HeldRequest(item.pool_id, item.request_id) for item in message.held),
    )


def pd_route_query_from_json(body: bytes) -> PdRouteQuery:
    """The query of a JSON body (``RoutePdRequest`` in protobuf's JSON mapping).

    Raises:
        InvalidArgumentError: Not UTF-8, not JSON, an unknown field, a wrong type, or a value
            out of its domain (the message names it).
    """
    message = parse_json_body(body, pd_pb2.RoutePdRequest())
    return pd_route_query_from_proto(message)


def pd_route_to_proto(route: PdRoute) -> pd_pb2.RoutePdResponse:
    """The wire form of a routing answer."""
    message = pd_pb2.RoutePdResponse(
        num_tokens=route.num_tokens,
        decode_hit_tokens=route.decode_hit_tokens,
        decode_pull_tokens=route.decode_pull_tokens,
        remote_num_tokens=route.remote_num_tokens,
        prefill_compute_tokens=route.prefill_compute_tokens,
        num_prefill_pools_in_scope=route.num_prefill_pools_in_scope,
        num_decode_pools_in_scope=route.num_decode_pools_in_scope,
        held_request_id=route.held_request_id,
    )
    message.prefill.extend(lookup_result_to_proto(LookupAnswer(route.prefill, (), 0)).pools)
    message.decode.extend(lookup_result_to_proto(LookupAnswer(route.decode, (), 0)).pools)
    for pool_id, reason in route.skipped:
        message.skipped.add(pool_id=pool_id, reason=reason)
    return message


def pd_route_from_proto(message: pd_pb2.RoutePdResponse) -> PdRoute:
    """The routing answer of a wire response."""
    prefill = lookup_result_from_proto(lookup_pb2.LookupResponse(pools=message.prefill)).pools
    decode = lookup_result_from_proto(lookup_pb2.LookupResponse(pools=message.decode)).pools
    return PdRoute(
        prefill=prefill,
        decode=decode,
        skipped=tuple((item.pool_id, item.reason) for item in message.skipped),
        num_tokens=message.num_tokens,
        decode_hit_tokens=message.decode_hit_tokens,
        decode_pull_tokens=message.decode_pull_tokens,
        remote_num_tokens=message.remote_num_tokens,
        prefill_compute_tokens=message.prefill_compute_tokens,
        num_prefill_pools_in_scope=message.num_prefill_pools_in_scope,
        num_decode_pools_in_scope=message.num_decode_pools_in_scope,
        held_request_id=message.held_request_id,
    )


def pd_route_to_json(route: PdRoute) -> dict[str, Any]:
    """The answer as ``RoutePdResponse`` JSON (every field present, snake_case names, 64-bit
    integers as JSON numbers where they fit a double exactly)."""
    document: dict[str, Any] = json_format.MessageToDict(
        pd_route_to_proto(route),
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )
    return document
