"""The HTTP side of the server: metrics, probes and a read-only JSON view of the pools.

The app is served by uvicorn on the gRPC server's event loop. Every handler is ``async def`` on
purpose: FastAPI runs plain ``def`` handlers in a thread pool, and a thread reading a pool while
the loop mutates it could see half an RPC. On the loop, a handler runs between RPCs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel

from kvcm.common.errors import NotFoundError
from kvcm.core.lookup import LookupAnswer, LookupQuery
from kvcm.core.pd_route import PdRoute, PdRouteQuery
from kvcm.server.access import RefusalLog, may_read
from kvcm.server.http._cluster import (
    ClusterCallError,
    ClusterReadsLike,
    ClusterRedirect,
    fanned_headers,
    is_local_request,
)
from kvcm.server.http._collector import JournalStatsLike, KVCMCollector, kvcm_version
from kvcm.server.http._guard import TokenGuard, check_routes
from kvcm.server.http._inspector import add_inspector_routes
from kvcm.server.http._pd_route import add_pd_route
from kvcm.server.http._queries import answer_json_query
from kvcm.server.http._transfers import TransfersLike, add_transfer_routes
from kvcm.server.http._views import PoolLike, PoolRegistryLike, PoolSnapshotLike
from kvcm.server.telemetry import LoopLagMonitor, RpcStats, StepProgressBook

if TYPE_CHECKING:
    from kvcm.server.kv_events import KvEventCounters
    from kvcm.server.rpc import Principal

MAX_LOOKUP_BODY_BYTES = 16 * 1024 * 1024

__all__ = [
    "ErrorBody",
    "ErrorDetail",
    "GroupSummary",
    "HashingSummary",
    "PoolList",
    "PoolSummary",
    "PoolWiring",
    "PrefixCacheSummary",
    "StepProgressSummary",
    "Status",
    "ZmqEventsSummary",
    "build_app",
    "summarize",
]


class GroupSummary(BaseModel):
    """One KV-cache group of a pool."""

    group_id: int
    kind: str
    block_size: int
    num_layers: int


class PrefixCacheSummary(BaseModel):
    """Prefix-cache counters since the pool was created, and the hit rates they give.

    ``hit_rate`` is ``hits / queries`` over the pool's whole life (what PromQL computes from
    ``kvcm_prefix_cache_hits_total / kvcm_prefix_cache_queries_total``); ``recent_hit_rate`` is
    the same ratio over the most recent requests only. Both are 0 before any query.
    """

    requests: int
    queries: int
    hits: int
    hit_rate: float
    recent_hit_rate: float
    preempted_requests: int
    preempted_queries: int
    preempted_hits: int


class StepProgressSummary(BaseModel):
    """How far the pool's copy is behind its scheduler (``kvcm.v1.StepProgress``)."""

    last_step_seq: int
    last_step_age_s: float
    scheduler_step_seq: int
    steps_behind: int
    since_applied_s: float


class HashingSummary(BaseModel):
    """How the pool hashes blocks (never its seed: ``DescribePool`` gives it to callers that
    may hash for the pool)."""

    algorithm: str
    hash_block_size: int
    hash_length_bytes: int


class HostTierSummary(BaseModel):
    """The pool's host tier (docs/host-tier.md): its blocks and counters since creation.

    ``hit_rate`` is ``hit_tokens`` over the prefix cache's queried tokens (0 before any).
    """

    blocks: int
    used_blocks: int
    hit_tokens: int
    hit_rate: float
    demoted_blocks: int
    loaded_blocks: int
    evicted_blocks: int
    swap_outs: int
    swap_ins: int


class ZmqEventsSummary(BaseModel):
    """Where the pool's KV-event batches go out on vLLM's ZMQ wire (docs/kv-events.md)."""

    endpoint: str
    replay_endpoint: str
    topic: str
    last_seq: int
    data_parallel_rank: int
    dedicated: bool


class PoolWiring(BaseModel):
    """What a router operator needs to wire a consumer of the pool: hashing and ZMQ stream."""

    hashing: HashingSummary
    zmq_events: ZmqEventsSummary | None


class PoolSummary(BaseModel):
    """A pool at one instant, as ``/v1/pools`` shows it."""

    name: str
    state: str
    world_size: int
    registered_workers: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    num_requests: int
    groups: list[GroupSummary]
    prefix_cache: PrefixCacheSummary
    evicted_blocks_total: int
    events_emitted_total: int
    allocations_not_fit_total: int
    labels: dict[str, str]
    epoch: int
    last_event_sequence: int
    last_step_seq: int
    scheduler_lease_s: float
    step_progress: StepProgressSummary | None = None
    host_tier: HostTierSummary | None = None
    hashing: HashingSummary | None = None
    zmq_events: ZmqEventsSummary | None = None


class PoolList(BaseModel):
    """Every pool, in the registry's order."""

    pools: list[PoolSummary]


class ErrorDetail(BaseModel):
    """What went wrong: a gRPC-style code name and a message."""

    code: str
    message: str


class ErrorBody(BaseModel):
    """The body of every error kvcm's HTTP side answers itself."""

    error: ErrorDetail


class Status(BaseModel):
    """A probe's answer."""

    status: str


def summarize(snapshot: PoolSnapshotLike) -> PoolSummary:
    """Turn a pool snapshot into its JSON summary.

    Args:
        snapshot: the pool's snapshot.

    Returns:
        The summary, with the lifetime hit rate computed from the counters.
    """
    hit_rate = snapshot.hits / snapshot.queries if snapshot.queries else 0.0
    return PoolSummary(
        name=snapshot.name,
        state=str(snapshot.state),
        world_size=snapshot.world_size,
        registered_workers=snapshot.registered_workers,
        num_blocks=snapshot.num_blocks,
        num_free_blocks=snapshot.num_free_blocks,
        num_cached_blocks=snapshot.num_cached_blocks,
        usage=snapshot.usage,
        num_requests=snapshot.num_requests,
        groups=[
            GroupSummary(
                group_id=group_id, kind=str(kind), block_size=block_size, num_layers=num_layers
            )
            for group_id, kind, block_size, num_layers in snapshot.groups
        ],
        prefix_cache=PrefixCacheSummary(
            requests=snapshot.requests,
            queries=snapshot.queries,
            hits=snapshot.hits,
            hit_rate=hit_rate,
            recent_hit_rate=snapshot.recent_hit_rate,
            preempted_requests=snapshot.preempted_requests,
            preempted_queries=snapshot.preempted_queries,
            preempted_hits=snapshot.preempted_hits,
        ),
        evicted_blocks_total=snapshot.evicted_blocks_total,
        events_emitted_total=snapshot.events_emitted_total,
        allocations_not_fit_total=snapshot.allocations_not_fit_total,
        labels=dict(snapshot.labels),
        epoch=snapshot.epoch,
        last_event_sequence=snapshot.events_emitted_total,
        last_step_seq=snapshot.last_step_seq,
        scheduler_lease_s=snapshot.scheduler_lease_s,
        host_tier=_host_tier(snapshot),
    )


def _host_tier(snapshot: PoolSnapshotLike) -> HostTierSummary | None:
    if not snapshot.host_tier_blocks:
        return None
    return HostTierSummary(
        blocks=snapshot.host_tier_blocks,
        used_blocks=snapshot.host_tier_used_blocks,
        hit_tokens=snapshot.host_tier_hit_tokens,
        hit_rate=snapshot.host_tier_hit_tokens / snapshot.queries if snapshot.queries else 0.0,
        demoted_blocks=snapshot.host_tier_demoted_blocks,
        loaded_blocks=snapshot.host_tier_loaded_blocks,
        evicted_blocks=snapshot.host_tier_evicted_blocks,
        swap_outs=snapshot.host_tier_swap_outs,
        swap_ins=snapshot.host_tier_swap_ins,
    )


def _register_runtime_collectors(prometheus_registry: CollectorRegistry) -> None:
    """prometheus_client's process, platform and gc collectors, on this app's registry only.

    The library's default instances sit on its global registry; kvcm's app serves its own
    registry, so it registers fresh ones of the same classes (they read the same process, so
    the values agree).
    """
    ProcessCollector(registry=prometheus_registry)
    PlatformCollector(registry=prometheus_registry)
    GCCollector(registry=prometheus_registry)


def build_app(
    registry: PoolRegistryLike,
    rpc_stats: RpcStats,
    is_ready: Callable[[], bool],
    *,
    loop_lag: LoopLagMonitor | None = None,
    reclaims: Mapping[tuple[str, str], int] | None = None,
    zmq_counters: KvEventCounters | None = None,
    lookup: Callable[[LookupQuery, Principal | None], Awaitable[LookupAnswer]] | None = None,
    authenticate: Callable[[str], Principal | None] | None = None,
    refusals: RefusalLog | None = None,
    progress: StepProgressBook | None = None,
    journal: Callable[[], JournalStatsLike | None] | None = None,
    wiring: Callable[[Sequence[str]], Mapping[str, PoolWiring]] | None = None,
    pd_route: Callable[[PdRouteQuery, Principal | None], Awaitable[PdRoute]] | None = None,
    pd_routes: Mapping[str, int] | None = None,
    transfers: TransfersLike | None = None,
    cluster: ClusterReadsLike | None = None,
) -> FastAPI:
    """Build the HTTP app over the server's pools and RPC statistics.

    Routes: ``GET /metrics`` (Prometheus text, or OpenMetrics when the scraper asks for it),
    ``GET /healthz`` (200 while the process serves HTTP), ``GET /readyz`` (200 once
    ``is_ready()`` is true, 503 before), ``GET /v1/pools`` and ``GET /v1/pools/{pool}`` (JSON
    summaries; 404 with an :class:`ErrorBody` for an unknown pool), and with ``lookup``
    ``POST /v1/lookup`` (a ``kvcm.v1.LookupRequest`` in protobuf's JSON mapping, answered as a
    ``LookupResponse``; errors as :class:`ErrorBody` with 400, 401, 403, 404, 413 or 429).

    With ``authenticate``, every route but the probes needs an ``Authorization: Bearer``
    token whose roles allow it (:data:`kvcm.server.access.RULES`, the table the gRPC side
    uses): 401 without a valid token, 403 without the role, both audited; ``/v1/pools`` and
    ``/v1/lookup`` answer about the pools the token may read only.

    Each app gets its own ``CollectorRegistry``, so two servers in one process (tests) do not
    share or clash over metrics. Beside kvcm's own families it holds prometheus_client's
    standard process (``process_*``: memory, CPU, open files), platform (``python_info``) and
    garbage-collector (``python_gc_*``) collectors.

    Args:
        registry: the server's pool registry.
        rpc_stats: the statistics the gRPC side records.
        is_ready: answers whether the gRPC side is serving.
        loop_lag: the server's event-loop lag monitor (``None``: exported empty).
        reclaims: lease reclaims by (pool, lease kind) (``None``: exported empty).
        zmq_counters: the ZMQ KV-event stream's counters (``None``: the stream is off).
        lookup: answers a lookup as a principal (``None``: no ``/v1/lookup`` route).
        authenticate: the principal of a bearer token, ``None`` for an unknown one (``None``:
            authentication is off and no route needs a token).
        refusals: where refused requests are audited (``None``: a log of the app's own).
        progress: each pool's step progress (``None``: exported empty; ``GET
            /v1/pools/{pool}`` shows it as ``step_progress``).
        journal: the data directory's journal, read at each scrape (``kvcm_journal_*``;
            ``None``: exported empty).
        wiring: the hashing parameters (no seed) and ZMQ stream of the pools named, by pool
            id, shown in ``/v1/pools`` as ``hashing`` and ``zmq_events`` (``None``, or a pool
            missing from the answer: left out).
        pd_route: routes a P/D query as a principal (``None``: no ``/v1/pd/route`` route).
        pd_routes: the P/D routing calls' counters by metric name (``None``: exported as 0).
        transfers: the P/D transfer records (``GET /v1/transfers``, the ``kvcm_transfer*``
            metrics; ``None``: no routes, the metrics exported empty).
        cluster: this replica's cluster (``kvcm serve --etcd-endpoints``): ``/v1/lookup``,
            ``/v1/pd/route`` and ``/v1/pools`` fan out to every replica and merge, per-pool
            reads of a pool served elsewhere are redirected (:mod:`kvcm.server.http._cluster`;
            ``None``: one server).

    Returns:
        The FastAPI app; ``app.state.prometheus_registry`` holds its collector registry,
        ``app.state.collector`` kvcm's collector.
    """
    if refusals is None:
        refusals = RefusalLog()
    prometheus_registry = CollectorRegistry(auto_describe=False)
    collector = KVCMCollector(
        registry,
        rpc_stats,
        loop_lag,
        reclaims,
        zmq_counters,
        progress=progress,
        journal=journal,
        pd_routes=pd_routes,
        transfers=transfers.samples if transfers is not None else None,
    )
    prometheus_registry.register(collector)
    _register_runtime_collectors(prometheus_registry)

    app = FastAPI(
        title="kvcm",
        version=kvcm_version(),
        summary="Metrics, probes and pool summaries of a kvcm server.",
        docs_url=None,
        redoc_url=None,
    )
    app.state.prometheus_registry = prometheus_registry
    app.state.collector = collector

    @app.get(
        "/metrics",
        response_class=Response,
        tags=["operations"],
        responses={
            401: {"model": ErrorBody, "description": "authentication is on: no valid token"},
            403: {"model": ErrorBody, "description": "the token has no scrape:* (or admin:*)"},
        },
    )
    async def metrics(request: Request) -> Response:
        """Prometheus exposition of every kvcm metric, read from the pools now."""
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(content=encode(prometheus_registry), headers={"Content-Type": content_type})

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> Status:
        """Liveness: the process is up and its event loop answers."""
        return Status(status="ok")

    @app.get(
        "/readyz",
        tags=["operations"],
        responses={503: {"model": Status, "description": "the gRPC side is not serving yet"}},
    )
    async def readyz() -> Response:
        """Readiness: 200 once the gRPC side serves, 503 before (and while shutting down)."""
        if is_ready():
            return JSONResponse(Status(status="ready").model_dump())
        return JSONResponse(Status(status="not ready").model_dump(), status_code=503)

    def summarize_wired(pools: list[PoolLike]) -> list[PoolSummary]:
        wired = wiring([pool.name for pool in pools]) if wiring is not None else {}

        def convert(snapshot: PoolSnapshotLike) -> PoolSummary:
            summary = summarize(snapshot)
            found = wired.get(snapshot.name)
            if found is not None:
                summary.hashing = found.hashing
                summary.zmq_events = found.zmq_events
            return summary

        return collector.reader.read(pools, convert)

    @app.get(
        "/v1/pools",
        tags=["pools"],
        response_model=PoolList,
        responses={
            401: {"model": ErrorBody, "description": "authentication is on: no valid token"},
        },
    )
    async def list_pools(request: Request) -> PoolList | Response:
        """The summary of every pool the token may read (a pool busy with a long call is left
        out until it ends). In a cluster: every replica's pools, sorted by id, with
        ``missing_replicas`` and ``replicas`` (docs/cluster.md)."""
        principal = getattr(request.state, "principal", None)
        readable = [pool for pool in registry.list() if may_read(principal, pool.name)]
        listed = PoolList(pools=summarize_wired(readable))
        if cluster is None or is_local_request(request.headers):
            return listed
        try:
            pools, missing, asked = await cluster.pools(
                [summary.model_dump() for summary in listed.pools],
                request.headers.get("authorization"),
            )
        except ClusterCallError as exc:  # a replica's refusal, with its status
            refused = ErrorBody(error=ErrorDetail(code=exc.code, message=str(exc)))
            return JSONResponse(refused.model_dump(), status_code=exc.status)
        return JSONResponse(
            {"pools": pools, "missing_replicas": list(missing), "replicas": asked},
            headers=fanned_headers(asked, missing),
        )

    @app.get(
        "/v1/pools/{pool}",
        tags=["pools"],
        response_model=PoolSummary,
        responses={
            401: {"model": ErrorBody, "description": "authentication is on: no valid token"},
            403: {"model": ErrorBody, "description": "the token may not read this pool"},
            404: {"model": ErrorBody, "description": "no pool has this name"},
            500: {"model": ErrorBody, "description": "the pool's state could not be read"},
        },
    )
    async def get_pool(pool: str) -> Response | PoolSummary:
        """One pool's summary."""
        try:
            found = registry.get(pool)
        except NotFoundError as exc:
            body = ErrorBody(error=ErrorDetail(code="NOT_FOUND", message=str(exc)))
            return JSONResponse(body.model_dump(), status_code=404)
        if found.lent:
            busy = ErrorBody(
                error=ErrorDetail(code="UNAVAILABLE", message=f"pool {pool!r} is busy; retry")
            )
            return JSONResponse(busy.model_dump(), status_code=503)
        summaries = summarize_wired([found])
        if not summaries:  # logged and counted (kvcm_pool_read_errors_total)
            broken = ErrorDetail(code="INTERNAL", message=f"pool {pool!r} could not be read")
            return JSONResponse(ErrorBody(error=broken).model_dump(), status_code=500)
        summary = summaries[0]
        noted = progress.get(pool, found.last_step_seq) if progress is not None else None
        if noted is not None:
            summary.step_progress = StepProgressSummary(
                last_step_seq=noted.last_step_seq,
                last_step_age_s=noted.last_step_age_s,
                scheduler_step_seq=noted.scheduler_step_seq,
                steps_behind=noted.steps_behind,
                since_applied_s=noted.since_applied_s,
            )
        return summary

    if lookup is not None:
        _add_lookup_route(app, lookup, refusals, cluster)
    if pd_route is not None:
        add_pd_route(
            app,
            pd_route,
            refusals,
            max_body_bytes=MAX_LOOKUP_BODY_BYTES,
            error_model=ErrorBody,
            cluster=cluster,
        )
    if transfers is not None:
        add_transfer_routes(app, transfers, ErrorBody, cluster)
    add_inspector_routes(app, registry)
    check_routes(app.routes)
    if cluster is not None:  # inside the token guard (added after it)
        app.add_middleware(ClusterRedirect, cluster=cluster)
    if authenticate is not None:
        app.add_middleware(
            TokenGuard,
            routes=app.router.routes,
            authenticate=authenticate,
            refusals=refusals,
        )
    return app


def _add_lookup_route(
    app: FastAPI,
    lookup: Callable[[LookupQuery, Principal | None], Awaitable[LookupAnswer]],
    refusals: RefusalLog,
    cluster: ClusterReadsLike | None,
) -> None:
    from kvcm.wire.lookup import lookup_query_from_json, lookup_result_to_json

    @app.post(
        "/v1/lookup",
        tags=["routing"],
        responses={
            400: {"model": ErrorBody, "description": "a field is out of its domain"},
            401: {"model": ErrorBody, "description": "authentication is on: no valid token"},
            403: {"model": ErrorBody, "description": "scope names a pool the token may not read"},
            404: {"model": ErrorBody, "description": "scope names an unknown pool"},
            413: {"model": ErrorBody, "description": "the body exceeds 16 MiB"},
            429: {
                "model": ErrorBody,
                "description": "hashing the prompt for the scope is too much",
            },
        },
    )
    async def lookup_route(request: Request) -> Response:
        """Each pool's prefix hit for a prompt, its load and a ranking (see docs/lookup.md).

        The body is a ``kvcm.v1.LookupRequest`` in protobuf's JSON mapping; the answer a
        ``LookupResponse`` (snake_case names, every field present). In a cluster it asks
        every replica and merges as the gRPC ``Lookup`` does, adding ``missing_replicas`` and
        ``replicas`` (docs/cluster.md).
        """
        if cluster is not None and not is_local_request(request.headers):
            authorization = request.headers.get("authorization")

            async def fanned(
                query: LookupQuery, principal: Principal | None
            ) -> tuple[LookupAnswer, int]:
                return await cluster.lookup(query, authorization)

            return await answer_json_query(
                request,
                method="POST /v1/lookup",
                max_body_bytes=MAX_LOOKUP_BODY_BYTES,
                decode=lookup_query_from_json,
                answer=fanned,
                encode=lambda found: {
                    **lookup_result_to_json(found[0]),
                    "missing_replicas": list(found[0].missing_replicas),
                    "replicas": found[1],
                },
                refusals=refusals,
                headers=lambda found: fanned_headers(found[1], found[0].missing_replicas),
            )
        return await answer_json_query(
            request,
            method="POST /v1/lookup",
            max_body_bytes=MAX_LOOKUP_BODY_BYTES,
            decode=lookup_query_from_json,
            answer=lookup,
            encode=lookup_result_to_json,
            refusals=refusals,
        )
