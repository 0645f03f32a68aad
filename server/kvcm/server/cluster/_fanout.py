"""Cluster-wide calls: ask every live replica in parallel, with a deadline, and merge.

``ListPools``, ``Lookup`` and ``RoutePd`` answer over every replica's pools. The replica that
got the call (the *coordinator*) sends each live peer the same request marked
``kvcm-cluster-local: 1`` (the peer answers from its own pools only, never fanning out
again), answers its own part, and merges:

* ``ListPools``: the union, sorted by pool id; a pool listed by two replicas (a move in
  flight) is taken from its placement's primary.
* ``Lookup``: a scope of pool ids is split by owner, each replica asked only about its own; an
  open scope (labels or nothing) goes to every replica. The answers are ranked again by the
  core's rank key (score, then waiting requests, then usage, then pool id) and cut at
  ``max_results``; ``skipped`` and ``num_pools_in_scope`` add up. Packed or not, as asked.
  A standby's copy of a pool (replication) is left out: only the primary's answer counts.
* ``RoutePd``: each role's Lookup fanned out and merged as above, both roles at once (this
  replica's part over the loopback), the held request (bidirectional) read by the best decode
  pool's own replica, then the core's ranking, so the route is the one a single server
  holding every pool gives.
* ``ListTransfers`` of every pool (no ``pool_id``; one pool's is redirected to its primary):
  each replica's records of the pools it is the primary of (a standby's copies left out), in
  flight first (oldest first), then ended ones (latest first), as one server orders them.

A peer that does not answer within ``fanout_timeout_s`` (or the caller's deadline, if sooner),
or answers UNAVAILABLE, is *missed*: the answer still comes, and its trailing metadata say so
(``kvcm-replicas``: replicas asked, this one included; ``kvcm-missing-replicas``: the missed
addresses, comma-separated, only when some were). A peer that refuses the call (a bad
argument, an unknown pool, a denied principal) fails the whole call with its status.

The HTTP side's cluster-wide reads (``POST /v1/lookup``, ``POST /v1/pd/route``, ``GET
/v1/transfers``) run the same fan-out and merge through :func:`cluster_lookup`,
:func:`cluster_route_pd` and :func:`cluster_list_transfers`, their caller
described by a :class:`CallerContext` (its bearer token, forwarded to every replica), every
replica (this one included, over the loopback) asked over gRPC as a peer; the replicas they
missed are in the answer (``missing_replicas``). ``GET /v1/pools`` merges the replicas'
listings with :func:`merge_listings`, as ``ListPools`` does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Final, TypeVar

import grpc

from kvcm.common.errors import KVCMError
from kvcm.core.lookup import LookupAnswer, LookupQuery
from kvcm.core.pd_route import PdRoute, PdRouteQuery, rank_pd
from kvcm.server.cluster._node import ClusterNode
from kvcm.v1 import admin_pb2, lookup_pb2, pd_pb2, service_pb2_grpc
from kvcm.wire.lookup import (
    lookup_query_to_proto,
    lookup_result_from_proto,
    lookup_result_to_proto,
)
from kvcm.wire.pd import pd_route_query_from_proto, pd_route_query_to_proto, pd_route_to_proto

__all__ = [
    "LOCAL_KEY",
    "MISSING_KEY",
    "REPLICAS_KEY",
    "CallerContext",
    "PeerChannels",
    "PeerRefusedError",
    "cluster_list_transfers",
    "cluster_lookup",
    "cluster_route_pd",
    "fan_out_list_pools",
    "fan_out_list_transfers",
    "fan_out_lookup",
    "fan_out_route_pd",
    "is_local_call",
    "merge_listings",
]

_LOG = logging.getLogger("kvcm.server.cluster")

#: Metadata marking a replica-to-replica call: answer from this replica's pools, as is.
LOCAL_KEY: Final = "kvcm-cluster-local"
#: Trailing metadata of a fanned-out answer: the replicas asked (this one included).
REPLICAS_KEY: Final = "kvcm-replicas"
#: Trailing metadata of a fanned-out answer that missed replicas: their addresses.
MISSING_KEY: Final = "kvcm-missing-replicas"

# A peer answering one of these is missed, not an error of the call.
_MISSED_CODES: Final = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# Forwarded from the caller so peers authorize the same principal.
_FORWARDED: Final = ("authorization",)

Behavior = Callable[[Any, Any], Awaitable[Any]]
T = TypeVar("T")


class PeerRefusedError(Exception):
    """A replica refused its part of a cluster-wide call (not a missed replica): the whole
    call fails with its status.

    Attributes:
        code: The replica's status code.
        details: Its message.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        """A refusal with ``code`` and ``details``."""
        super().__init__(details)
        self.code = code
        self.details = details


class CallerContext:
    """The caller of a cluster-wide read that did not come in over gRPC (an HTTP route): what
    the fan-out reads of a gRPC call's context. Peers are sent the caller's bearer token;
    there is no deadline of the caller's own, so each part gets ``fanout_timeout_s``."""

    def __init__(self, authorization: str | None) -> None:
        """A caller whose ``Authorization`` header is ``authorization`` (``None``: none)."""
        self._metadata = (("authorization", authorization),) if authorization else ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The caller's metadata (its ``authorization``, if any)."""
        return self._metadata

    def time_remaining(self) -> float | None:
        """No deadline of the caller's own."""
        return None


def is_local_call(context: Any) -> bool:
    """Whether the call is a peer's part of a fan-out (or otherwise asks for this replica)."""
    for key, value in context.invocation_metadata() or ():
        if key == LOCAL_KEY and value == "1":
            return True
    return False


class PeerChannels:
    """One grpc.aio channel per peer replica, opened on first use and kept."""

    def __init__(
        self,
        max_message_bytes: int,
        credentials: Callable[[], grpc.ChannelCredentials] | None = None,
    ) -> None:
        """No channel yet; with ``credentials`` (:func:`kvcm.server.tls.peer_credentials`)
        each channel speaks TLS."""
        self._credentials = credentials
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._stubs: dict[str, tuple[grpc.aio.Channel, Any, Any]] = {}
        self._transfer_stubs: dict[str, Any] = {}

    def stubs(self, address: str) -> tuple[Any, Any]:
        """``(AdminServiceStub, LookupServiceStub)`` of the replica at ``address``."""
        entry = self._stubs.get(address)
        if entry is None:
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=self._options)
            else:
                channel = grpc.aio.secure_channel(
                    address, self._credentials(), options=self._options
                )
            entry = (
                channel,
                service_pb2_grpc.AdminServiceStub(channel),  # type: ignore[no-untyped-call]
                service_pb2_grpc.LookupServiceStub(channel),  # type: ignore[no-untyped-call]
            )
            self._stubs[address] = entry
        return entry[1], entry[2]

    def transfers(self, address: str) -> Any:
        """``TransferServiceStub`` of the replica at ``address`` (on its one channel)."""
        self.stubs(address)
        stub = self._transfer_stubs.get(address)
        if stub is None:
            channel = self._stubs[address][0]
            stub = service_pb2_grpc.TransferServiceStub(channel)  # type: ignore[no-untyped-call]
            self._transfer_stubs[address] = stub
        return stub

    async def close(self) -> None:
        """Close every channel."""
        entries, self._stubs = list(self._stubs.values()), {}
        self._transfer_stubs = {}
        for channel, _, _ in entries:
            await channel.close()


def _peer_metadata(context: Any) -> tuple[tuple[str, str], ...]:
    forwarded = tuple(
        (key, value) for key, value in context.invocation_metadata() or () if key in _FORWARDED
    )
    return ((LOCAL_KEY, "1"), *forwarded)


def _timeout(node: ClusterNode, context: Any) -> float:
    remaining = context.time_remaining()
    limit = node.config.fanout_timeout_s
    return limit if remaining is None else max(min(limit, remaining - 0.05), 0.01)


async def _ask(
    node: ClusterNode,
    context: Any,
    method: str,
    parts: Sequence[tuple[str, Callable[[float, Any], Awaitable[Any]]]],
) -> tuple[list[tuple[str, Any]], list[str]]:
    """Run each peer's part in parallel: ``(address, answer)`` in order, the missed addresses.

    Raises:
        grpc.aio.AioRpcError: A peer refused the call (not a missed peer).
        PeerRefusedError: A part said the peer refused (a part that does not call gRPC).
    """
    timeout = _timeout(node, context)
    metadata = _peer_metadata(context)
    results = await asyncio.gather(
        *(call(timeout, metadata) for _, call in parts), return_exceptions=True
    )
    answers: list[tuple[str, Any]] = []
    missed: list[str] = []
    for (address, _), result in zip(parts, results, strict=True):
        if isinstance(result, grpc.aio.AioRpcError) and result.code() not in _MISSED_CODES:
            raise result
        if isinstance(result, PeerRefusedError):
            raise result
        if isinstance(result, BaseException):
            _LOG.info("fan-out %s: replica %s missed: %r", method, address, result)
            missed.append(address)
            continue
        answers.append((address, result))
    if missed:
        node.stats.fanout_missed[method] = node.stats.fanout_missed.get(method, 0) + len(missed)
    return answers, missed


def _say_missed(context: Any, asked: int, missed: Sequence[str]) -> None:
    trailer: list[tuple[str, str]] = [(REPLICAS_KEY, str(asked))]
    if missed:
        trailer.append((MISSING_KEY, ",".join(missed)))
    context.set_trailing_metadata(tuple(trailer))


async def _refused(context: Any, exc: grpc.aio.AioRpcError) -> None:
    await context.abort(exc.code(), exc.details() or "")


async def fan_out_list_pools(
    node: ClusterNode,
    peers: PeerChannels,
    behavior: Behavior,
    request: admin_pb2.ListPoolsRequest,
    context: Any,
) -> admin_pb2.ListPoolsResponse:
    """``ListPools`` over every live replica (see the module docstring)."""
    addresses = node.peers()

    def part(address: str) -> Callable[[float, Any], Awaitable[Any]]:
        def call(timeout: float, metadata: Any) -> Awaitable[Any]:
            admin, _ = peers.stubs(address)
            return admin.ListPools(request, timeout=timeout, metadata=metadata)  # type: ignore[no-any-return]

        return call

    local_task = asyncio.ensure_future(behavior(request, context))
    try:
        answers, missed = await _ask(node, context, "ListPools", [(a, part(a)) for a in addresses])
    except grpc.aio.AioRpcError as exc:
        local_task.cancel()
        await _refused(context, exc)
        raise
    local = await local_task
    listings: list[tuple[str, Iterable[Any]]] = [
        (owner, answer.pools) for owner, answer in [(node.address, local), *answers]
    ]
    _say_missed(context, len(addresses) + 1, missed)
    return admin_pb2.ListPoolsResponse(pools=merge_listings(node, listings, _proto_pool_id))


def _proto_pool_id(pool: Any) -> str:
    return str(pool.pool_id)


def merge_listings(
    node: ClusterNode,
    listings: Iterable[tuple[str, Iterable[T]]],
    pool_id: Callable[[T], str],
) -> list[T]:
    """Replicas' pool listings, ``(replica address, pools)``, as one: the union sorted by
    pool id; a pool listed by two replicas (a move in flight, a standby's copy) is taken from
    its placement's primary."""
    by_id: dict[str, T] = {}
    for owner, pools in listings:
        for pool in pools:
            key = pool_id(pool)
            placement = node.get(key)
            if key not in by_id or (placement is not None and placement.primary == owner):
                by_id[key] = pool
    return [by_id[key] for key in sorted(by_id)]


def _owner_parts(
    node: ClusterNode, pool_ids: Sequence[str]
) -> tuple[dict[str, list[str]], list[str]]:
    """Split a scope's pool ids by the replica that owns each (unplaced: this one); also the
    owners that are not live (their pools cannot be asked)."""
    live = set(node.peers()) | {node.address}
    by_owner: dict[str, list[str]] = {}
    dead: list[str] = []
    for pool_id in pool_ids:
        placement = node.get(pool_id)
        owner = node.address if placement is None else placement.primary
        if owner not in live:
            if owner not in dead:
                dead.append(owner)
            continue
        by_owner.setdefault(owner, []).append(pool_id)
    return by_owner, dead


def _rank_key(hit: Any) -> tuple[float, int, float, str]:
    # The core's rank key (kvcm.core.lookup): best score, fewest waiting, least used, by name.
    return (-hit.score, hit.load.num_waiting, hit.load.usage, hit.pool_id)


async def _cluster_lookup(
    node: ClusterNode,
    peers: PeerChannels,
    local: Behavior | None,
    request: lookup_pb2.LookupRequest,
    context: Any,
    *,
    method: str,
) -> tuple[LookupAnswer, int]:
    """A Lookup over every live replica's pools: the merged answer (with the replicas it
    missed) and the replicas asked. ``local``: this replica's Lookup handler (``None``: asked
    over the loopback like a peer).

    Raises:
        grpc.aio.AioRpcError: A replica refused its part.
    """
    dead: list[str] = []
    if request.scope.pool_ids:
        by_owner, dead = _owner_parts(node, list(request.scope.pool_ids))
        requests: dict[str, lookup_pb2.LookupRequest] = {}
        for owner, pool_ids in by_owner.items():
            sub = lookup_pb2.LookupRequest()
            sub.CopyFrom(request)
            del sub.scope.pool_ids[:]
            sub.scope.pool_ids.extend(pool_ids)
            requests[owner] = sub
    else:
        open_scope = request
        if request.max_results and any(p.standby for p in node.placements().values()):
            # Standbys' copies are dropped from each answer below: ask for every pool, so a
            # replica's own pools are not pushed out of its top by the copies it follows.
            open_scope = lookup_pb2.LookupRequest()
            open_scope.CopyFrom(request)
            open_scope.max_results = 0
        requests = dict.fromkeys([node.address, *node.peers()], open_scope)
    local_request = requests.pop(node.address, None) if local is not None else None
    addresses = sorted(requests)

    def part(address: str) -> Callable[[float, Any], Awaitable[Any]]:
        def call(timeout: float, metadata: Any) -> Awaitable[Any]:
            _, lookup = peers.stubs(address)
            return lookup.Lookup(requests[address], timeout=timeout, metadata=metadata)  # type: ignore[no-any-return]

        return call

    local_task = (
        asyncio.ensure_future(local(local_request, context))
        if local is not None and local_request is not None
        else None
    )
    try:
        answers, missed = await _ask(node, context, method, [(a, part(a)) for a in addresses])
    except grpc.aio.AioRpcError:
        if local_task is not None:
            local_task.cancel()
        raise
    if local_task is not None:
        answers.append((node.address, await local_task))
    pools: list[Any] = []
    skipped: list[tuple[str, str]] = []
    num_in_scope = 0
    for address, answer in answers:
        decoded = lookup_result_from_proto(answer)

        def served_by(pool_id: str, address: str = address) -> bool:
            placement = node.get(pool_id)  # a standby's copy is answered by its primary
            return placement is None or placement.primary == address

        kept = [hit for hit in decoded.pools if served_by(hit.pool_id)]
        kept_skipped = [item for item in decoded.skipped if served_by(item[0])]
        dropped = len(decoded.pools) - len(kept) + len(decoded.skipped) - len(kept_skipped)
        pools.extend(kept)
        skipped.extend(kept_skipped)
        num_in_scope += decoded.num_pools_in_scope - dropped
    pools.sort(key=_rank_key)
    if request.max_results:
        pools = pools[: request.max_results]
    asked = len(addresses) + (local_request is not None) + len(dead)
    merged = LookupAnswer(tuple(pools), tuple(skipped), num_in_scope, (*missed, *dead))
    return merged, asked


async def fan_out_lookup(
    node: ClusterNode,
    peers: PeerChannels,
    behavior: Behavior,
    request: lookup_pb2.LookupRequest,
    context: Any,
) -> lookup_pb2.LookupResponse:
    """``Lookup`` over every live replica's pools (see the module docstring)."""
    try:
        merged, asked = await _cluster_lookup(
            node, peers, behavior, request, context, method="Lookup"
        )
    except grpc.aio.AioRpcError as exc:
        await _refused(context, exc)
        raise
    _say_missed(context, asked, merged.missing_replicas)
    return lookup_result_to_proto(merged, packed=request.packed)


async def cluster_lookup(
    node: ClusterNode, peers: PeerChannels, query: LookupQuery, caller: CallerContext
) -> tuple[LookupAnswer, int]:
    """``Lookup``'s fan-out and merge for a caller that is not a gRPC call (every replica,
    this one included, asked over gRPC): the merged answer, with the replicas it missed, and
    the number of replicas asked.

    Raises:
        PeerRefusedError: A replica refused its part (a bad field, an unknown pool, a denied
            principal): the status a single server answers.
    """
    request = lookup_query_to_proto(query, packed=False)
    try:
        return await _cluster_lookup(node, peers, None, request, caller, method="Lookup")
    except grpc.aio.AioRpcError as exc:
        raise PeerRefusedError(exc.code(), exc.details() or "") from exc


async def fan_out_route_pd(
    node: ClusterNode,
    peers: PeerChannels,
    behavior: Behavior,
    request: pd_pb2.RoutePdRequest,
    context: Any,
) -> pd_pb2.RoutePdResponse:
    """``RoutePd`` over every live replica's pools (:func:`cluster_route_pd`)."""
    try:
        query = pd_route_query_from_proto(request)
    except KVCMError:
        refused: pd_pb2.RoutePdResponse = await behavior(request, context)  # names the field
        return refused
    try:
        route, asked = await cluster_route_pd(node, peers, query, context)
    except PeerRefusedError as exc:
        await context.abort(exc.code, exc.details)
        raise
    _say_missed(context, asked, route.missing_replicas)
    return pd_route_to_proto(route)


async def cluster_route_pd(
    node: ClusterNode, peers: PeerChannels, query: PdRouteQuery, context: Any
) -> tuple[PdRoute, int]:
    """``RoutePd`` over every live replica's pools: each role's Lookup fanned out and merged
    (both roles at once; this replica's part over the loopback), the held request read on the
    best decode pool's own replica, then the core's ranking
    (:func:`kvcm.core.pd_route.rank_pd`). Returns the route, with the replicas it missed, and
    the number of replicas asked. ``context``: the
    gRPC call's, or a :class:`CallerContext`.

    Raises:
        PeerRefusedError: A replica refused a role's part (its field named by role, as a
            single server names it).
    """

    async def role_answer(role: str) -> tuple[LookupAnswer, int]:
        role_request = lookup_query_to_proto(query.role_query(role), packed=False)
        try:
            return await _cluster_lookup(node, peers, None, role_request, context, method="RoutePd")
        except grpc.aio.AioRpcError as exc:  # name the role's field, as a lone server does
            details = (exc.details() or "").replace("Lookup: scope", f"RoutePd: {role}")
            raise PeerRefusedError(exc.code(), details.replace("scope.", f"{role}.")) from exc

    # Both roles at once: a replica that does not answer costs one deadline, not two.
    roles = await asyncio.gather(
        role_answer("prefill_scope"), role_answer("decode_scope"), return_exceptions=True
    )
    for result in roles:  # the prefill scope's refusal first, as a lone server checks it
        if isinstance(result, BaseException):
            raise result
    (prefill, prefill_asked), (decode, decode_asked) = roles  # type: ignore[misc]
    missed = {*prefill.missing_replicas, *decode.missing_replicas}
    asked = max(prefill_asked, decode_asked)
    held: tuple[str, int] | None = None
    if query.bidirectional and query.held and decode.pools:
        best = decode.pools[0].pool_id
        placement = node.get(best)
        owner = node.address if placement is None else placement.primary
        one = pd_route_query_to_proto(query)
        for scope in (one.prefill_scope, one.decode_scope):
            scope.Clear()
            scope.pool_ids.append(best)
        try:
            _, lookup = peers.stubs(owner)
            route = await lookup.RoutePd(
                one, timeout=_timeout(node, context), metadata=_peer_metadata(context)
            )
            held = (route.held_request_id, int(route.remote_num_tokens))
        except grpc.aio.AioRpcError:
            missed.add(owner)
    ranked = rank_pd(query, prefill, decode, held)
    return dataclasses.replace(ranked, missing_replicas=tuple(sorted(missed))), asked


_IN_FLIGHT: Final = frozenset({pd_pb2.TRANSFER_STATE_HELD, pd_pb2.TRANSFER_STATE_PLANNED})


async def fan_out_list_transfers(
    node: ClusterNode,
    peers: PeerChannels,
    behavior: Behavior,
    request: pd_pb2.ListTransfersRequest,
    context: Any,
) -> pd_pb2.ListTransfersResponse:
    """``ListTransfers`` of every pool over every live replica (see the module docstring)."""
    try:
        merged, missed, asked = await cluster_list_transfers(
            node, peers, request, context, local=behavior
        )
    except PeerRefusedError as exc:
        await context.abort(exc.code, exc.details)
        raise
    _say_missed(context, asked, missed)
    return merged


async def cluster_list_transfers(
    node: ClusterNode,
    peers: PeerChannels,
    request: pd_pb2.ListTransfersRequest,
    context: Any,
    *,
    local: Behavior | None = None,
) -> tuple[pd_pb2.ListTransfersResponse, list[str], int]:
    """Every replica's transfer records (of the pools it is the primary of) as one listing:
    the listing, the replicas missed, the replicas asked. ``local``: this replica's handler
    (``None``: asked over the loopback like a peer, for a :class:`CallerContext`).

    Raises:
        PeerRefusedError: A replica refused its part.
    """
    addresses = node.peers() if local is not None else [node.address, *node.peers()]

    def part(address: str) -> Callable[[float, Any], Awaitable[Any]]:
        def call(timeout: float, metadata: Any) -> Awaitable[Any]:
            stub = peers.transfers(address)
            return stub.ListTransfers(request, timeout=timeout, metadata=metadata)  # type: ignore[no-any-return]

        return call

    local_task = asyncio.ensure_future(local(request, context)) if local is not None else None
    try:
        answers, missed = await _ask(
            node, context, "ListTransfers", [(a, part(a)) for a in addresses]
        )
    except grpc.aio.AioRpcError as exc:
        if local_task is not None:
            local_task.cancel()
        raise PeerRefusedError(exc.code(), exc.details() or "") from exc
    if local_task is not None:
        answers.append((node.address, await local_task))
    in_flight: list[Any] = []
    ended: list[Any] = []
    for address, answer in answers:
        for transfer in answer.transfers:
            placement = node.get(transfer.pool_id)  # a standby's copy: its primary answers
            if placement is not None and placement.primary != address:
                continue
            (in_flight if transfer.state in _IN_FLIGHT else ended).append(transfer)
    in_flight.sort(key=lambda transfer: transfer.started_at)
    ended.sort(key=lambda transfer: transfer.ended_at, reverse=True)
    merged = pd_pb2.ListTransfersResponse(transfers=[*in_flight, *ended])
    return merged, missed, len(addresses) + (local is not None)
