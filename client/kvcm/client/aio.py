"""AsyncSchedulerClient: the asyncio SDK for schedulers and engine launchers.

One client talks to one server over one gRPC channel and may drive many pools. It covers the
scheduler service (``step`` and one method per ``KVCacheManager`` operation), pool
administration and the event stream. Every call has a deadline (the client's ``timeout`` unless
the call gives its own); failures raise ``ServiceError`` subclasses, never ``grpc.RpcError``.

This module is the source of both scheduler clients: ``kvcm.client.scheduler``
(``SchedulerClient``) is generated from it by ``scripts/gen_sync_client.py``, which drops the
``async``/``await`` keywords and swaps the asyncio names for their synchronous twins (its table
says which), so the two cannot drift. ``bash scripts/test.sh`` fails when the generated module
is stale. Edit this file, then run ``python scripts/gen_sync_client.py``.

::

    async with AsyncSchedulerClient("127.0.0.1:50051") as client:
        hasher = await client.block_hasher("engine-0")  # the pool's algorithm, seed, block size
        await client.add_request("engine-0", 1, prompt, hasher.hash_token_ids(prompt))
        hit = await client.get_computed_blocks("engine-0", 1)
        blocks = await client.allocate_slots(
            "engine-0", 1, len(prompt) - hit.num_computed_tokens, 0, hit=hit
        )
"""

from __future__ import annotations

import asyncio  # sync: import time
import random
import time  # async-only-line
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from kvcm.client import _base
from kvcm.client._base import RETRY_POLICY, AsyncChannelClient, RetryPolicy, Timeout, TlsConfig
from kvcm.client._lookup_port import AsyncLookupPortConnection
from kvcm.client._step import StepBuilder, StepResult
from kvcm.client._streams import AsyncEventStream
from kvcm.client._transfers import Transfer, TransferListing, TransferState, transfer_from_proto
from kvcm.client._types import (
    DEFAULT_TIMEOUT_S,
    USE_CLIENT_DEFAULT,
    CacheHit,
    FreeMode,
    HashingParameters,
    KVCacheBlocks,
    PoolConfig,
    PoolInfo,
    PoolListing,
    PrefixCacheStats,
    RequestBlocks,
    SlotOptions,
    Usage,
)
from kvcm.common.errors import InvalidArgumentError
from kvcm.core.lookup import LookupAnswer, LookupQuery
from kvcm.core.manager import DEFAULT_SLOT_OPTIONS
from kvcm.core.pd_route import PdRoute, PdRouteQuery
from kvcm.core.program import StepProgram
from kvcm.v1 import admin_pb2, events_pb2, pd_pb2, scheduler_pb2
from kvcm.wire import (
    fill_grouped,
    outcome_from_proto,
    pool_info_from_proto,
    pool_summaries_from_proto,
    prefix_cache_stats_from_proto,
    usage_from_proto,
)
from kvcm.wire.lookup import lookup_query_to_proto, lookup_result_from_proto
from kvcm.wire.pd import pd_route_from_proto, pd_route_query_to_proto

if TYPE_CHECKING:
    from kvcm.common.hashing import BlockHasher

__all__ = ["AsyncEventStream", "AsyncSchedulerClient"]


class AsyncSchedulerClient(AsyncChannelClient):
    """Asyncio client of a kvcm server (scheduler, admin and event services).

    Create it inside the event loop that uses it.

    The constructor's arguments but ``lookup_address`` (``target``, ``timeout``,
    ``retry_policy``, ``channel_options``, ``tls``, ``token``), ``close`` and the context
    manager are the channel client's (``_base``).

    Attributes:
        target: The server's address.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_policy: RetryPolicy = RETRY_POLICY,
        channel_options: Sequence[tuple[str, Any]] = (),
        tls: TlsConfig | None = None,
        token: str | None = None,
        lookup_address: str | None = None,
    ) -> None:
        """Open a channel to ``target`` (connecting lazily, on the first call).

        Args:
            target: ``host:port`` of the server (``"a:1,b:2"``: a kvcm cluster's seeds).
            timeout: Deadline of every call that does not give its own, in seconds.
            retry_policy: Retries of idempotent calls on UNAVAILABLE.
            channel_options: Extra gRPC channel options (``("grpc.keepalive_time_ms", ...)``).
            tls: TLS (server roots; a client certificate for mutual TLS); ``None``: plaintext.
                The lookup port, when used, speaks TLS with the same roots and certificate.
            token: A bearer token sent with every call (a server with ``auth_tokens``).
            lookup_address: ``host:port`` of the server's lookup port (its
                ``lookup_address``): :meth:`lookup` goes there, over one persistent
                connection, instead of the Lookup RPC (docs/lookup.md#the-lookup-port);
                every other call stays on gRPC. ``None``: the RPC. Not with a cluster.

        Raises:
            InvalidArgumentError: ``target`` is empty, ``timeout`` is not positive, or
                ``lookup_address`` is not ``host:port`` or comes with a cluster's seeds.
        """
        super().__init__(
            target,
            timeout=timeout,
            retry_policy=retry_policy,
            channel_options=channel_options,
            tls=tls,
            token=token,
        )
        if lookup_address is not None:
            if len(self._seeds) > 1:
                raise InvalidArgumentError(
                    "lookup_address: a kvcm cluster's Lookup fans out over gRPC (servers with "
                    "etcd_endpoints have no lookup port)",
                    field="lookup_address",
                )
            self._lookup_port = AsyncLookupPortConnection(lookup_address, token=token, tls=tls)

    # ----------------------------------------------------------------------------- admin
    async def create_pool(
        self,
        pool_id: str,
        config: PoolConfig,
        *,
        replication_mode: str | None = None,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> PoolInfo:
        """Create a pool (one per engine instance).

        Args:
            pool_id: The new pool's id.
            config: Its configuration.
            replication_mode: In a kvcm cluster, when its mutations are acknowledged:
                ``"sync"`` (after its hot standby has them; ``None`` means it) or ``"async"``
                (after the primary's journal; a failover may lose the last ones). Kept for
                the pool's life, across failovers and moves (docs/replication.md).
            timeout: Deadline in seconds.

        Raises:
            ServiceAlreadyExistsError: The id is taken.
            ServiceInvalidArgumentError: The config is inconsistent.
            ServiceResourceExhaustedError: The server's pool limit is reached.
        """
        request = _base.build_create_pool(pool_id, config, replication_mode)
        response = await self._unary("CreatePool", self._stubs.admin.CreatePool, request, timeout)
        return pool_info_from_proto(response.pool)

    async def lookup(
        self, query: LookupQuery, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> LookupAnswer:
        """Where ``query``'s prompt is cached across pools: each pool's hit, load and rank.

        Read-only and idempotent (retried on UNAVAILABLE). See docs/lookup.md. With the
        client's ``lookup_address``, sent over the lookup port instead (the same answer; a
        broken connection is opened again once).

        Raises:
            ServiceInvalidArgumentError: A field is out of its domain.
            ServiceNotFoundError: ``query.pool_ids`` names an unknown pool.
            PermissionDeniedError: It names a pool this token may not read (or, on the
                lookup port, the token is not valid).
            ServiceResourceExhaustedError: Hashing the token prompt for the scope would take
                more than 1,048,576 block hashes (send hashes or narrow the scope).
            UnavailableError: The server (or its lookup port) cannot be reached.
        """
        request = lookup_query_to_proto(query)
        if self._lookup_port is not None:
            deadline = self._settings.deadline(timeout)
            return lookup_result_from_proto(await self._lookup_port.lookup(request, deadline))
        trailers: list[tuple[str, str]] = []
        stub = self._stubs.lookup.Lookup
        response = await self._unary("Lookup", stub, request, timeout, trailers)
        return _base.with_missing(lookup_result_from_proto(response), trailers)

    async def route_pd(
        self, query: PdRouteQuery, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> PdRoute:
        """The prefill and the decode engine for ``query``'s prompt, ranked by exact prefix
        hit and load, with the decode engine's own hit and vLLM's ``remote_num_tokens``.

        Read-only and idempotent (retried on UNAVAILABLE). See docs/pd.md.

        Raises:
            ServiceInvalidArgumentError: A field is out of its domain (named, by role).
            ServiceNotFoundError: A scope names an unknown pool.
            PermissionDeniedError: A scope names a pool this token may not read.
            ServiceResourceExhaustedError: As :meth:`lookup`.
        """
        request = pd_route_query_to_proto(query)
        trailers: list[tuple[str, str]] = []
        stub = self._stubs.lookup.RoutePd
        response = await self._unary("RoutePd", stub, request, timeout, trailers)
        return _base.with_missing(pd_route_from_proto(response), trailers)

    # ------------------------------------------------------------------------- transfers
    async def hold_source(
        self,
        pool_id: str,
        transfer_id: str,
        request_key: int = 0,
        *,
        lease_s: float,
        record_only: bool = False,
        request_id: str = "",
        num_tokens: int = 0,
        source_blocks: Sequence[Sequence[int]] = (),
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> Transfer:
        """Hold a P/D transfer's source: request ``request_key`` of ``pool_id`` keeps its
        blocks until the transfer is committed, released or expired (after ``lease_s``), when
        kvcm finishes it. ``record_only``: only record an engine's own handoff (give
        ``request_id``, ``num_tokens`` and ``source_blocks``; kvcm changes no pool).

        Idempotent (retried on UNAVAILABLE): the same hold again answers the record as it is.
        See docs/pd.md.

        Raises:
            ServiceAlreadyExistsError: ``transfer_id`` names another source, or the request
                is held by another transfer.
            ServiceNotFoundError: No such pool or request.
            ServiceFailedPreconditionError: The request holds no blocks.
            ServiceInvalidArgumentError: A field is out of its domain (named).
        """
        request = pd_pb2.HoldSourceRequest(
            pool_id=pool_id,
            transfer_id=transfer_id,
            request_key=request_key,
            lease_s=lease_s,
            record_only=record_only,
            request_id=request_id,
            num_tokens=num_tokens,
        )
        if source_blocks:
            fill_grouped(source_blocks, request.source_blocks)
        stub = self._stubs.transfers.HoldSource
        response = await self._unary("HoldSource", stub, request, timeout)
        return transfer_from_proto(response.transfer)

    async def plan_transfer(
        self,
        pool_id: str,
        transfer_id: str,
        destination_pool_id: str,
        *,
        hit_tokens: int | None = None,
        pull_tokens: int | None = None,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> Transfer:
        """Plan the pull into ``destination_pool_id`` (the lease renewed): kvcm answers the
        destination's exact hit for the source's blocks (``hit_tokens``, not pulled) and
        ``pull_tokens``. A record-only transfer gives both itself.

        Idempotent: the same destination again answers the record.

        Raises:
            ServiceNotFoundError: No such transfer or destination pool.
            ServiceFailedPreconditionError: Planned against another pool, ended, or pools
                that hash differently.
        """
        request = pd_pb2.PlanTransferRequest(
            pool_id=pool_id, transfer_id=transfer_id, destination_pool_id=destination_pool_id
        )
        if hit_tokens is not None:
            request.hit_tokens = hit_tokens
        if pull_tokens is not None:
            request.pull_tokens = pull_tokens
        stub = self._stubs.transfers.PlanTransfer
        response = await self._unary("PlanTransfer", stub, request, timeout)
        return transfer_from_proto(response.transfer)

    async def commit_transfer(
        self,
        pool_id: str,
        transfer_id: str,
        *,
        blocks_pulled: int | None = None,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> Transfer:
        """The destination has its blocks: COMPLETED, the source given back to its pool.

        Idempotent: a completed transfer answers as it is.

        Raises:
            ServiceFailedPreconditionError: Not planned, or released or expired.
        """
        request = pd_pb2.CommitTransferRequest(pool_id=pool_id, transfer_id=transfer_id)
        if blocks_pulled is not None:
            request.blocks_pulled = blocks_pulled
        stub = self._stubs.transfers.CommitTransfer
        response = await self._unary("CommitTransfer", stub, request, timeout)
        return transfer_from_proto(response.transfer)

    async def release_transfer(
        self,
        pool_id: str,
        transfer_id: str,
        reason: str = "",
        *,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> Transfer:
        """Let the transfer go (RELEASED), the source given back; an ended one answers as is."""
        request = pd_pb2.ReleaseTransferRequest(
            pool_id=pool_id, transfer_id=transfer_id, reason=reason
        )
        stub = self._stubs.transfers.ReleaseTransfer
        response = await self._unary("ReleaseTransfer", stub, request, timeout)
        return transfer_from_proto(response.transfer)

    async def expire_transfer(
        self,
        pool_id: str,
        transfer_id: str,
        reason: str = "",
        *,
        source_freed: bool = False,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> Transfer:
        """End the lease now (EXPIRED), the source given back; an ended one answers as is.
        ``source_freed`` (record-only): the engine freed the source itself (its own lease)."""
        request = pd_pb2.ExpireTransferRequest(
            pool_id=pool_id, transfer_id=transfer_id, reason=reason, source_freed=source_freed
        )
        stub = self._stubs.transfers.ExpireTransfer
        response = await self._unary("ExpireTransfer", stub, request, timeout)
        return transfer_from_proto(response.transfer)

    async def describe_transfer(
        self, pool_id: str, transfer_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> Transfer:
        """One transfer (read-only).

        Raises:
            ServiceNotFoundError: No such transfer (or it ended long ago).
        """
        request = pd_pb2.DescribeTransferRequest(pool_id=pool_id, transfer_id=transfer_id)
        stub = self._stubs.transfers.DescribeTransfer
        response = await self._unary("DescribeTransfer", stub, request, timeout)
        return transfer_from_proto(response.transfer)

    async def list_transfers(
        self,
        pool_id: str = "",
        *,
        states: Sequence[TransferState] = (),
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> TransferListing:
        """Transfers in flight (oldest first), then recently ended ones (latest first), of
        ``pool_id`` or of every pool this token may read; ``states``: only these. In a kvcm
        cluster every pool's listing asks every replica; ``missing_replicas`` names those
        that did not answer in time."""
        wanted = [pd_pb2.TransferState.Value(f"TRANSFER_STATE_{s.name}") for s in states]
        request = pd_pb2.ListTransfersRequest(pool_id=pool_id, states=wanted)
        stub = self._stubs.transfers.ListTransfers
        trailers: list[tuple[str, str]] = []
        response = await self._unary("ListTransfers", stub, request, timeout, trailers)
        return TransferListing(
            (transfer_from_proto(message) for message in response.transfers),
            _base.missing_replicas(trailers),
        )

    async def list_pools(self, *, timeout: Timeout = USE_CLIENT_DEFAULT) -> PoolListing:
        """Every pool, sorted by id; in a kvcm cluster, every replica's, and
        ``missing_replicas`` names the replicas that did not answer in time."""
        request = admin_pb2.ListPoolsRequest()
        trailers: list[tuple[str, str]] = []
        stub = self._stubs.admin.ListPools
        response = await self._unary("ListPools", stub, request, timeout, trailers)
        return PoolListing(pool_summaries_from_proto(response), _base.missing_replicas(trailers))

    async def describe_pool(
        self, pool_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> PoolInfo:
        """Everything about a pool, its hashing parameters included.

        Raises:
            ServiceNotFoundError: No such pool.
        """
        request = admin_pb2.DescribePoolRequest(pool_id=pool_id)
        response = await self._unary(
            "DescribePool", self._stubs.admin.DescribePool, request, timeout
        )
        return pool_info_from_proto(response.pool)

    async def delete_pool(self, pool_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT) -> None:
        """Delete a pool and its requests.

        Raises:
            ServiceNotFoundError: No such pool.
        """
        request = admin_pb2.DeletePoolRequest(pool_id=pool_id)
        await self._unary("DeletePool", self._stubs.admin.DeletePool, request, timeout)

    async def hashing(
        self, pool_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> HashingParameters:
        """The pool's hashing parameters (algorithm, seed, hash block size)."""
        info = await self.describe_pool(pool_id, timeout=timeout)
        return info.hashing

    async def block_hasher(
        self, pool_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> BlockHasher:
        """A ``BlockHasher`` whose hashes equal the pool's, for hashing requests client-side."""
        hashing = await self.hashing(pool_id, timeout=timeout)
        return hashing.block_hasher()

    # ------------------------------------------------------------------------------ step
    async def step(
        self,
        pool_id: str,
        step: StepBuilder | StepProgram,
        *,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> StepResult:
        """Run a whole scheduler step in one round trip.

        A Step with a ``step_seq`` is retried on UNAVAILABLE (the server runs it once), and
        in a cluster also when an attempt gets no answer within the retry policy's
        ``attempt_timeout_s`` (a paused primary: the seeds name its promoted standby); the
        retries share the call's deadline. A Step without one is never sent twice.

        Args:
            pool_id: The pool.
            step: The recorded operations: a ``StepBuilder`` or a core ``StepProgram``.
            timeout: Deadline for the call and its retries, in seconds.

        Returns:
            One outcome per allocation.

        Raises:
            ServiceInvalidArgumentError: An op failed validation (``rejection`` names it);
                nothing ran. Also ServiceNotFoundError / ServiceAlreadyExistsError.
            ServiceFailedPreconditionError: step_seq out of sequence, or the pool not READY.
        """
        if isinstance(step, StepProgram):
            step = StepBuilder.from_program(step)
        request = step.to_proto(pool_id)
        total_s = self._settings.deadline(timeout)
        policy = self._settings.retry_policy
        give_up_at = time.monotonic() + total_s
        attempt = 1
        reroutes = 0
        resendable = step.step_seq is not None
        while True:
            stub = self._stubs_for(pool_id).scheduler.Step
            try:
                response = await stub(
                    request, timeout=self._attempt_s(pool_id, give_up_at, resendable)
                )
            except grpc.RpcError as exc:
                if self._timed_out(exc, pool_id, give_up_at, resendable):
                    continue  # a cluster's replica that did not answer: ask the seeds again
                if reroutes < _base.MAX_REROUTES and self._rerouted(exc, pool_id, resendable):
                    reroutes += 1
                    continue
                error = _base.unrouted_error(exc, "Step")
                if not _base.should_retry(
                    error,
                    attempt,
                    resendable=resendable,
                    clustered=self._clustered(pool_id),
                    policy=policy,
                    give_up_at=give_up_at,
                ):
                    raise error from exc
                await asyncio.sleep(random.uniform(0.0, policy.backoff_s(attempt)))
                # The next attempt starts over from the seeds: redirects followed, dead
                # routes forgotten, as the first did.
                attempt, reroutes = attempt + 1, 0
                continue
            return StepResult.of(step, outcome_from_proto(response))

    async def resync_pool(
        self,
        pool_id: str,
        snapshot: bytes,
        config: PoolConfig,
        *,
        step_seq: int,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> int:
        """Replace a pool's state with ``snapshot`` (``kvcm.core.snapshot``'s format).

        Creates the pool with ``config`` when it is missing. The pool's last step_seq becomes
        ``step_seq``; it is a new incarnation (its event streams end).

        Returns:
            The pool's new epoch.

        Raises:
            ServiceInvalidArgumentError: A damaged snapshot, or one ``config`` does not
                describe; nothing changed.
            ServiceResourceExhaustedError: Beyond the server's snapshot or block limits.
        """
        chunks = _base.build_resync_chunks(pool_id, snapshot, config, step_seq)
        response = await self._unary(
            "ResyncPool", self._stubs.scheduler.ResyncPool, chunks, timeout
        )
        return int(response.epoch)

    # ------------------------------------------------------------------ request lifecycle
    async def add_request(
        self,
        pool_id: str,
        request_key: int,
        prompt_token_ids: Sequence[int],
        block_hashes: Sequence[bytes] | bytes = b"",
        *,
        request_id: str = "",
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
        report_cached_blocks: bool = False,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> None:
        """Start tracking a request under ``request_key``.

        Args:
            pool_id: The pool.
            request_key: The scheduler's key (unique among the pool's live requests).
            prompt_token_ids: The prompt.
            block_hashes: The prompt's full hash-block hashes (``BlockHasher``), in order.
            request_id: vLLM's request id, for logs.
            lora_id: LoRA id (events).
            lora_name: LoRA name (events).
            cache_salt: Only used by pools that verify hashes.
            skip_reading_prefix_cache: Never look the request up in the prefix cache.
            report_cached_blocks: Report its prefix-cache hits in KV events as BlockStored
                (vLLM's per-request ``kv_cache_report_mode="full"``).
            timeout: Deadline in seconds.

        Raises:
            InvalidArgumentError: ``report_cached_blocks`` is not a bool (nothing is sent).
            ServiceAlreadyExistsError: The key is live.
            ServiceInvalidArgumentError: Empty or too long prompt, wrong hashes.
        """
        request = _base.build_add_request(
            pool_id,
            request_key,
            prompt_token_ids,
            block_hashes,
            request_id=request_id,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
            report_cached_blocks=report_cached_blocks,
        )
        await self._unary("AddRequest", self._stubs.scheduler.AddRequest, request, timeout)

    async def append_tokens(
        self,
        pool_id: str,
        request_key: int,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes] | bytes = b"",
        *,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> None:
        """Append produced tokens and the hashes of the hash blocks they completed."""
        request = _base.build_append_tokens(pool_id, request_key, token_ids, block_hashes)
        await self._unary("AppendTokens", self._stubs.scheduler.AppendTokens, request, timeout)

    async def free(
        self,
        pool_id: str,
        request_key: int,
        mode: FreeMode = FreeMode.FINISHED,
        *,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> None:
        """Free a request's blocks, finishing (forgetting) or preempting (keeping) it."""
        request = _base.build_free(pool_id, request_key, mode)
        await self._unary("Free", self._stubs.scheduler.Free, request, timeout)

    # -------------------------------------------------------------------- manager calls
    async def get_computed_blocks(
        self,
        pool_id: str,
        request_key: int,
        max_cache_hit_length: int | None = None,
        *,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> CacheHit:
        """The request's longest prefix-cache hit.

        It changes nothing but the hit statistics, and publishes the hit as BlockStored events
        when the request was added with ``report_cached_blocks``.
        """
        request = _base.build_get_computed_blocks(pool_id, request_key, max_cache_hit_length)
        response = await self._unary(
            "GetComputedBlocks", self._stubs.scheduler.GetComputedBlocks, request, timeout
        )
        return _base.decode_cache_hit(response)

    async def allocate_slots(
        self,
        pool_id: str,
        request_key: int,
        num_new_tokens: int,
        num_computed_tokens: int,
        *,
        hit: CacheHit | None = None,
        options: SlotOptions = DEFAULT_SLOT_OPTIONS,
        num_in_flight_tokens: int = 0,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> KVCacheBlocks | None:
        """``allocate_slots``: the newly allocated blocks, or ``None`` when they do not fit.

        Args:
            pool_id: The pool.
            request_key: A live request.
            num_new_tokens: Tokens to allocate slots for and compute this step.
            num_computed_tokens: The request's computed tokens before this call.
            hit: The prefix hit of a waiting request (from ``get_computed_blocks``).
            options: The rarely used knobs (``kvcm.core.SlotOptions``).
            num_in_flight_tokens: The request's tokens scheduled but not settled (async
                scheduling; vLLM's ``request.num_in_flight_tokens``).
            timeout: Deadline in seconds.
        """
        request = _base.build_allocate_slots(
            pool_id,
            request_key,
            num_new_tokens=num_new_tokens,
            num_computed_tokens=num_computed_tokens,
            hit=hit,
            options=options,
            num_in_flight_tokens=num_in_flight_tokens,
        )
        response = await self._unary(
            "AllocateSlots", self._stubs.scheduler.AllocateSlots, request, timeout
        )
        return _base.decode_allocation(response)

    async def cache_blocks(
        self,
        pool_id: str,
        request_key: int,
        num_computed_tokens: int,
        *,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> None:
        """Cache the request's full blocks within its first ``num_computed_tokens`` tokens."""
        request = scheduler_pb2.CacheBlocksRequest(
            pool_id=pool_id, request_key=request_key, num_computed_tokens=num_computed_tokens
        )
        await self._unary("CacheBlocks", self._stubs.scheduler.CacheBlocks, request, timeout)

    async def remove_skipped_blocks(
        self,
        pool_id: str,
        request_key: int,
        total_computed_tokens: int,
        *,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> None:
        """Free the request's blocks outside the attention window (block 0 in their place)."""
        request = scheduler_pb2.RemoveSkippedBlocksRequest(
            pool_id=pool_id, request_key=request_key, total_computed_tokens=total_computed_tokens
        )
        await self._unary(
            "RemoveSkippedBlocks", self._stubs.scheduler.RemoveSkippedBlocks, request, timeout
        )

    async def fork(
        self,
        pool_id: str,
        request_key: int,
        child_key: int,
        num_computed_tokens: int,
        *,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> None:
        """Fork a running request: ``child_key`` shares every block holding its first
        ``num_computed_tokens`` tokens, the partial last block included (a Step with one
        FORK; docs/fork-cow.md). The copies come later, in the answers of the allocations
        that write into a shared partial block (``StepResult.copies``).

        Raises:
            ServiceFailedPreconditionError: The pool cannot fork, or the request is not
                running with blocks.
            ServiceAlreadyExistsError: ``child_key`` is live.
            ServiceInvalidArgumentError: ``num_computed_tokens`` is beyond the request's
                tokens or slots.
        """
        step = StepBuilder()
        step.fork(request_key, child_key, num_computed_tokens)
        await self.step(pool_id, step, timeout=timeout)

    async def common_computed_blocks(
        self,
        pool_id: str,
        request_keys: Iterable[int],
        *,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> tuple[list[int], ...]:
        """Per KV-cache group, the leading cached blocks every one of the requests holds at
        the same positions (V0's ``get_common_computed_block_ids``; a Step with one
        COMMON_BLOCKS; docs/fork-cow.md); empty lists when one holds no blocks.

        Raises:
            ServiceNotFoundError: A request is not live (the field names it).
            ServiceInvalidArgumentError: No request given.
        """
        step = StepBuilder()
        step.common_computed_blocks(list(request_keys))
        result = await self.step(pool_id, step, timeout=timeout)
        (answer,) = result.common_blocks
        return answer

    async def evict_blocks(
        self, pool_id: str, block_ids: Iterable[int], *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> None:
        """Drop blocks from the prefix cache (e.g. blocks a KV connector failed to load)."""
        request = scheduler_pb2.EvictBlocksRequest(pool_id=pool_id, block_ids=list(block_ids))
        await self._unary("EvictBlocks", self._stubs.scheduler.EvictBlocks, request, timeout)

    async def keep_alive(self, pool_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT) -> float:
        """Renew the pool's scheduler lease (every scheduler call does; this is for a
        scheduler with nothing to send); returns the lease in seconds (0: the pool has none).

        Raises:
            ServiceNotFoundError: No such pool.
        """
        request = scheduler_pb2.KeepAliveRequest(pool_id=pool_id)
        response = await self._unary("KeepAlive", self._stubs.scheduler.KeepAlive, request, timeout)
        return float(response.scheduler_lease_s)

    async def reset_prefix_cache(
        self, pool_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> bool:
        """Forget every cached block; ``False`` (nothing changed) while blocks are in use."""
        request = scheduler_pb2.ResetPrefixCacheRequest(pool_id=pool_id)
        response = await self._unary(
            "ResetPrefixCache", self._stubs.scheduler.ResetPrefixCache, request, timeout
        )
        return bool(response.reset)

    async def get_blocks(
        self, pool_id: str, request_key: int, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> RequestBlocks:
        """The request's blocks with their reference counts and cache state."""
        request = scheduler_pb2.GetBlocksRequest(pool_id=pool_id, request_key=request_key)
        response = await self._unary("GetBlocks", self._stubs.scheduler.GetBlocks, request, timeout)
        return _base.decode_request_blocks(response)

    async def get_block_ids(
        self, pool_id: str, request_key: int, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> tuple[list[int], ...]:
        """The request's block ids per group."""
        request = scheduler_pb2.GetBlockIdsRequest(pool_id=pool_id, request_key=request_key)
        response = await self._unary(
            "GetBlockIds", self._stubs.scheduler.GetBlockIds, request, timeout
        )
        return _base.grouped_to_blocks(response.blocks).block_ids

    async def get_num_common_prefix_blocks(
        self, pool_id: str, running_request_key: int, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> list[int]:
        """Per group, the leading blocks every running request shares."""
        request = scheduler_pb2.GetNumCommonPrefixBlocksRequest(
            pool_id=pool_id, running_request_key=running_request_key
        )
        response = await self._unary(
            "GetNumCommonPrefixBlocks",
            self._stubs.scheduler.GetNumCommonPrefixBlocks,
            request,
            timeout,
        )
        return list(response.num_common_prefix_blocks)

    async def take_new_block_ids(
        self, pool_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> list[int]:
        """Drain the attention blocks allocated since the last take (for zeroing)."""
        request = scheduler_pb2.TakeNewBlockIdsRequest(pool_id=pool_id)
        response = await self._unary(
            "TakeNewBlockIds", self._stubs.scheduler.TakeNewBlockIds, request, timeout
        )
        return list(response.block_ids)

    async def new_step_starts(self, pool_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT) -> None:
        """Tell the pool's managers a scheduler step starts."""
        request = scheduler_pb2.NewStepStartsRequest(pool_id=pool_id)
        await self._unary("NewStepStarts", self._stubs.scheduler.NewStepStarts, request, timeout)

    async def get_usage(self, pool_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT) -> Usage:
        """The pool's usage and block counts."""
        request = scheduler_pb2.GetUsageRequest(pool_id=pool_id)
        response = await self._unary("GetUsage", self._stubs.scheduler.GetUsage, request, timeout)
        return usage_from_proto(response)

    async def take_prefix_cache_stats(
        self, pool_id: str, *, timeout: Timeout = USE_CLIENT_DEFAULT
    ) -> PrefixCacheStats | None:
        """Drain the prefix-cache counters (``None`` when the pool's log_stats is off)."""
        request = scheduler_pb2.TakePrefixCacheStatsRequest(pool_id=pool_id)
        response = await self._unary(
            "TakePrefixCacheStats", self._stubs.scheduler.TakePrefixCacheStats, request, timeout
        )
        return prefix_cache_stats_from_proto(response)

    # ----------------------------------------------------------------------------- events
    def subscribe_events(
        self,
        pool_id: str,
        *,
        start_sequence: int | None = None,
        max_events_per_message: int = 0,
        timeout: float | None = None,
        expected_epoch: int | None = None,
    ) -> AsyncEventStream:
        """Open the pool's KV-event stream.

        Args:
            pool_id: The pool.
            start_sequence: First sequence wanted (resume: last seen + 1); ``None``: only
                events published from now on.
            max_events_per_message: Events per batch at most; 0: the server's choice.
            timeout: Deadline of the whole stream in seconds; ``None``: none (a stream is
                meant to last; close it to stop).
            expected_epoch: The pool epoch ``start_sequence`` belongs to (an earlier
                batch's ``pool_epoch``, or ``PoolInfo.epoch``); ``None``: any. When the pool
                was re-created since, iteration raises ``FailedPreconditionError`` naming
                both epochs: drop the pool's index and subscribe from the live edge.

        Returns:
            The stream; its iteration raises ``OutOfRangeError`` when ``start_sequence`` is
            no longer kept, ``ServiceNotFoundError`` when the pool is deleted (also when it
            is deleted while the reader lags behind), ``ResourceExhaustedError`` beyond the
            server's subscriptions per pool.
        """
        if timeout is not None:
            _base.check_timeout("timeout", timeout)
        request = events_pb2.SubscribeEventsRequest(
            pool_id=pool_id, max_events_per_message=max_events_per_message
        )
        if start_sequence is not None:
            request.start_sequence = start_sequence
        if expected_epoch is not None:
            request.expected_epoch = expected_epoch
        # A stream opens on the pool's replica as last learned; a redirect (before any
        # batch) reopens it on the owner the redirect names.
        call = self._stubs_for(pool_id).events.SubscribeEvents(request, timeout=timeout)
        return AsyncEventStream(
            pool_id, call, self._reopener(request, timeout), self._stream_lost(pool_id)
        )
