"""The cluster interceptor: pool-keyed calls go to the pool's primary, cluster-wide calls to all.

A call naming a pool (its request's ``pool_id``) that another replica serves is **redirected**:
it ends FAILED_PRECONDITION before anything runs, with the primary's advertise address in the
trailing metadata (``kvcm-owner``, and ``kvcm-epoch``); kvcm's clients resend it there and
remember the owner per pool, so in the steady state a scheduler talks to its pool's primary
with no extra hop. Redirect rather than forward: a forwarded call costs a second hop on every
call forever and makes the receiving replica a relay whose death fails calls for pools it
does not even own; a redirect costs one extra round trip per pool and client, once.

``CreatePool`` places the pool first (:meth:`ClusterNode.place`, an etcd transaction): when
the primary chosen is this replica it creates the pool, otherwise it redirects the caller to
the primary, which creates it. When etcd cannot be reached, ``CreatePool`` (and a
``ResyncPool`` of an unplaced pool) ends UNAVAILABLE with a message naming etcd; every other
call keeps being served from the local view. ``DeletePool`` removes the record after the pool.

``ListPools``, ``Lookup``, ``RoutePd`` and ``ListTransfers`` without a ``pool_id`` fan out
(:mod:`kvcm.server.cluster._fanout`). Calls
marked ``kvcm-cluster-local: 1`` are never redirected nor
fanned out. Only kvcm.v1's client-facing services are routed; other services (health,
reflection, replica-to-replica replication) pass through.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import grpc

from kvcm.common.errors import KVCMError
from kvcm.core.pool_types import check_pool_id
from kvcm.server.cluster._etcd import EtcdUnavailableError
from kvcm.server.cluster._fanout import (
    PeerChannels,
    fan_out_list_pools,
    fan_out_list_transfers,
    fan_out_lookup,
    fan_out_route_pd,
    is_local_call,
)
from kvcm.server.cluster._node import ClusterNode
from kvcm.server.rpc import MethodInterceptor, check_replication_mode
from kvcm.v1 import service_pb2

__all__ = ["EPOCH_KEY", "OWNER_KEY", "ClusterInterceptor"]

_LOG = logging.getLogger("kvcm.server.cluster")

#: Trailing metadata of a redirect: the advertise address of the pool's primary.
OWNER_KEY: Final = "kvcm-owner"
#: Trailing metadata of a redirect: the placement's epoch.
EPOCH_KEY: Final = "kvcm-epoch"

_ROUTED_SERVICES: Final = frozenset(
    {
        "AdminService",
        "WorkerService",
        "SchedulerService",
        "EventService",
        "LookupService",
        "TransferService",
    }
)
# Full method name -> whether its request names a pool (``pool_id``).
_POOL_KEYED: Final = {
    f"/{service.full_name}/{method.name}": "pool_id" in method.input_type.fields_by_name
    for service in service_pb2.DESCRIPTOR.services_by_name.values()
    if service.name in _ROUTED_SERVICES
    for method in service.methods
}
# Calls that may create a pool where none is placed.
_PLACING: Final = frozenset({"CreatePool", "ResyncPool"})


class ClusterInterceptor(MethodInterceptor):
    """Redirects, placement on create and delete, fan-out (see the module docstring)."""

    def __init__(
        self, node: ClusterNode, peers: PeerChannels, *, has_pool: Callable[[str], bool]
    ) -> None:
        """Route by ``node``'s view; ``has_pool(pool_id)``: whether this replica holds it."""
        super().__init__()
        self._node = node
        self._peers = peers
        self._has_pool = has_pool

    def _wrap_full(self, full_name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        pool_keyed = _POOL_KEYED.get(full_name)
        if pool_keyed is None:
            return handler
        method = full_name.rsplit("/", 1)[-1]
        serializers = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            if method == "ListPools":
                behavior = self._fanned(handler.unary_unary, fan_out_list_pools)
            elif method == "Lookup":
                behavior = self._fanned(handler.unary_unary, fan_out_lookup)
            elif method == "RoutePd":
                behavior = self._fanned(handler.unary_unary, fan_out_route_pd)
            elif method == "ListTransfers":  # one pool's: redirected; every pool's: fanned out
                behavior = self._by_pool(
                    self._routed(method, handler.unary_unary),
                    self._fanned(handler.unary_unary, fan_out_list_transfers),
                )
            elif pool_keyed:
                behavior = self._routed(method, handler.unary_unary)
            else:
                return handler
            return grpc.unary_unary_rpc_method_handler(behavior, **serializers)
        if handler.stream_unary is not None and pool_keyed:
            return grpc.stream_unary_rpc_method_handler(
                self._routed_stream_in(method, handler.stream_unary), **serializers
            )
        if handler.unary_stream is not None and pool_keyed:
            return grpc.unary_stream_rpc_method_handler(
                self._routed_stream_out(method, handler.unary_stream), **serializers
            )
        return handler

    # ------------------------------------------------------------------------ routing
    async def _redirect(self, method: str, pool_id: str, context: Any) -> None:
        """End the call with a redirect when another replica is the pool's primary."""
        if is_local_call(context):
            return
        placement = self._node.get(pool_id)
        if placement is None or placement.primary == self._node.address:
            return
        stats = self._node.stats.redirects
        stats[method] = stats.get(method, 0) + 1
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pool {pool_id!r} is served by replica {placement.primary} (placement epoch "
            f"{placement.epoch}); kvcm clients follow this redirect (trailing metadata "
            f"{OWNER_KEY})",
            ((OWNER_KEY, placement.primary), (EPOCH_KEY, str(placement.epoch))),
        )

    async def _place(self, method: str, pool_id: str, context: Any, mode: str = "") -> bool:
        """Place the pool (etcd) before it is created, with replication ``mode`` (a
        CreatePool's; ``""``: sync); redirect when another replica is its primary. Returns
        whether this call created the placement."""
        try:
            check_pool_id(pool_id)
            mode = check_replication_mode(mode)
        except KVCMError:
            return False  # the servicer refuses it, naming the field; nothing is placed
        if self._has_pool(pool_id) and method == "ResyncPool":
            await self._redirect(method, pool_id, context)
            return False
        try:
            placement, created = await self._node.place(pool_id, mode=mode)
        except EtcdUnavailableError as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{method} {pool_id!r}: placing a pool needs etcd, which cannot be reached "
                f"({exc}); pools already placed keep being served, placement resumes when "
                "etcd is back",
            )
            raise AssertionError("unreachable: abort raises") from exc
        if placement.primary != self._node.address:
            await self._redirect(method, pool_id, context)
        return created

    async def _unplace_if_absent(self, pool_id: str) -> None:
        """After a failed create (or a delete): drop the pool's record if it is not here."""
        if self._has_pool(pool_id):
            return
        placement = self._node.get(pool_id)
        if placement is None or placement.primary != self._node.address:
            return
        try:
            await self._node.replace(placement, None)
        except EtcdUnavailableError:
            _LOG.warning(
                "pool %s is gone but its placement stays until etcd is back (a new pool of "
                "that id goes to this replica)",
                pool_id,
                extra={"event": "placement_stale", "pool": pool_id},
            )

    def _routed(self, method: str, behavior: Any) -> Any:
        node = self._node

        async def routed(request: Any, context: Any) -> Any:
            pool_id: str = request.pool_id
            if method in _PLACING and not is_local_call(context):
                await self._place(
                    method, pool_id, context, getattr(request, "replication_mode", "")
                )
                try:
                    return await behavior(request, context)
                finally:
                    await self._unplace_if_absent(pool_id)
            await self._redirect(method, pool_id, context)
            if method == "DeletePool" and node.get(pool_id) is not None:
                try:
                    return await behavior(request, context)
                finally:
                    await self._unplace_if_absent(pool_id)
            return await behavior(request, context)

        return routed

    def _routed_stream_in(self, method: str, behavior: Any) -> Any:
        async def routed(request_iterator: Any, context: Any) -> Any:
            first = None
            async for item in request_iterator:
                first = item
                break
            if first is None:
                return await behavior(_chain(None, request_iterator), context)
            pool_id: str = first.pool_id
            if method in _PLACING and not is_local_call(context):
                await self._place(method, pool_id, context)
                try:
                    return await behavior(_chain(first, request_iterator), context)
                finally:
                    await self._unplace_if_absent(pool_id)
            await self._redirect(method, pool_id, context)
            return await behavior(_chain(first, request_iterator), context)

        return routed

    def _routed_stream_out(self, method: str, behavior: Any) -> Any:
        async def routed(request: Any, context: Any) -> AsyncIterator[Any]:
            await self._redirect(method, request.pool_id, context)
            async for item in behavior(request, context):
                yield item

        return routed

    # ------------------------------------------------------------------------ fan-out
    def _fanned(self, behavior: Any, fan_out: Any) -> Any:
        node, peers = self._node, self._peers

        async def fanned(request: Any, context: Any) -> Any:
            if is_local_call(context) or not node.peers():
                return await behavior(request, context)
            return await fan_out(node, peers, behavior, request, context)

        return fanned

    @staticmethod
    def _by_pool(routed: Any, fanned: Any) -> Any:
        async def either(request: Any, context: Any) -> Any:
            return await (routed if request.pool_id else fanned)(request, context)

        return either


async def _chain(first: Any, rest: Any) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for item in rest:
        yield item
