"""The server process: gRPC (grpc.aio) and HTTP (uvicorn) on one asyncio event loop.

::

    KVCMServer.start()  gRPC: kvcm.v1 services + grpc.health.v1 + reflection, bound first
                        HTTP: build_app(registry, rpc_stats, is_ready) on uvicorn, same loop
                        lookup port (lookup_address): Lookup without gRPC, same loop
    KVCMServer.stop()   health NOT_SERVING and /readyz 503 first, then the lookup port and
                        the gRPC side drain in-flight calls for shutdown_grace_s, then HTTP
                        stops

``serve(settings)`` runs a server until SIGINT or SIGTERM. uvicorn's own signal handlers are
disabled: the process has one shutdown path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import socket
import ssl
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvcm.common.errors import ConfigError, NotFoundError
from kvcm.core.pool import PoolRegistry
from kvcm.server.auth import AuthInterceptor, TokenTable
from kvcm.server.cluster import add_replica_servicer
from kvcm.server.cluster.replication import Replication
from kvcm.server.http import HashingSummary, PoolWiring, ZmqEventsSummary, build_app
from kvcm.server.journal import Journal
from kvcm.server.kv_events import (
    KvEventNumbering,
    KvEventStream,
    collect_batches,
    loop_collector,
)
from kvcm.server.logs import configure_logging
from kvcm.server.rpc import (
    SERVICE_NAMES,
    JournalInterceptor,
    LeaseMonitor,
    LookupPort,
    ServerState,
    TelemetryInterceptor,
    TransferView,
    add_servicers,
    checkpoint_of,
    lookup_as,
    recover,
    route_pd_as,
    subscriber_keepalive,
)
from kvcm.server.settings import ServerSettings, split_address
from kvcm.server.telemetry import LoopLagMonitor, RpcStats
from kvcm.server.tls import (
    TlsFiles,
    grpc_server_credentials,
    peer_credentials,
    reload_ssl_context,
    server_ssl_context,
    tls_files,
    uvicorn_ssl_options,
)
from kvcm.server.tracing import build_tracing

if TYPE_CHECKING:
    from kvcm.server.cluster import ClusterRuntime

__all__ = ["KVCMServer", "run_until_signalled", "serve"]

_LOG = logging.getLogger("kvcm.server")


# How often the HTTP side looks at its TLS files (the gRPC side checks at each handshake).
_TLS_WATCH_S = 2.0


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its signal handlers (the kvcm server owns shutdown)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class KVCMServer:
    """One kvcm server: its pools, its gRPC and HTTP sides.

    Attributes:
        settings: How it runs.
        state: What the servicers share (registry, RPC stats, per-pool wake-ups).
        grpc_port: The bound gRPC port (after ``start``).
        http_port: The bound HTTP port (after ``start``; 0 without HTTP).
        lookup_port: The lookup port (after ``start``; ``None`` without ``lookup_address``).
        interceptors: The gRPC server interceptors (after ``start``): tracing's, when on,
            then the telemetry one.
        leases: The scheduler-lease monitor (reclaims what dead schedulers left).
        journal: The data directory's journal (``None`` without ``data_dir``).
        loop_lag: The event-loop lag monitor (``kvcm_event_loop_lag_seconds``), ticking from
            ``start`` to ``stop``.
    """

    def __init__(self, settings: ServerSettings, *, span_exporter: Any = None) -> None:
        """Prepare a server; nothing is bound until ``start``.

        Args:
            settings: How it runs.
            span_exporter: An OpenTelemetry span exporter that turns tracing on in place of
                OTLP (tests); ``None``: tracing follows the settings.

        Raises:
            ConfigError: Tracing is configured but ``kvcm[tracing]`` is not installed, or
                the TLS settings are incomplete or name unreadable files.
        """
        self.settings = settings
        self.tracing = build_tracing(settings, span_exporter)
        self.tls = tls_files(settings)
        self.tokens = TokenTable(settings.auth_tokens) if settings.auth_tokens else None
        self.state = ServerState(
            registry=PoolRegistry(limits=settings.limits),
            rpc_stats=RpcStats(),
            limits=settings.limits,
            tracing=self.tracing,
            transfer_lease_s=settings.transfer_lease_s,
            subscriber_lease_s=settings.subscriber_lease_s,
            kv_events_topic=settings.kv_events_topic,
            kv_numbering=KvEventNumbering(settings.kv_events_port_label),
        )
        self.kv_events: KvEventStream | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.lookup_port: LookupPort | None = None
        self.interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
        self.journal: Journal | None = None
        # With etcd_endpoints: membership, placement, redirects (docs/cluster.md).
        self.cluster: ClusterRuntime | None = None
        # With data_dir: pools' standbys and placements (docs/replication.md).
        self.replication: Replication | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._http: _EmbeddedUvicorn | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._draining = False
        self._tls_watch: asyncio.Task[None] | None = None
        self._lookup_tls_watch: asyncio.Task[None] | None = None
        self.loop_lag = LoopLagMonitor()
        self.leases = LeaseMonitor(self.state)

    @property
    def grpc_address(self) -> str:
        """``host:port`` the gRPC side listens on."""
        host, _ = split_address(self.settings.grpc_address)
        return f"{host}:{self.grpc_port}"

    @property
    def http_address(self) -> str:
        """``host:port`` the HTTP side listens on (``""`` without HTTP)."""
        if not self.settings.http_address:
            return ""
        host, _ = split_address(self.settings.http_address)
        return f"{host}:{self.http_port}"

    @property
    def lookup_address(self) -> str:
        """``host:port`` the lookup port listens on (``""`` without one)."""
        if not self.settings.lookup_address or self.lookup_port is None:
            return ""
        host, _ = split_address(self.settings.lookup_address)
        return f"{host}:{self.lookup_port.port}"

    async def start(self) -> None:
        """Bind and start both sides; the gRPC side reports SERVING once started.

        Raises:
            ConfigError: An address cannot be listened on (the message names the setting).
        """
        settings = self.settings
        # Probed first: gRPC's own bind failure also writes a C-core log line to stderr.
        _bind("grpc_address", settings.grpc_address).close()
        http_socket = (
            _bind("http_address", settings.http_address) if settings.http_address else None
        )
        lookup_socket = (
            _bind("lookup_address", settings.lookup_address) if settings.lookup_address else None
        )
        max_message_bytes = settings.limits.max_message_bytes
        interceptors: list[grpc.aio.ServerInterceptor] = [
            TelemetryInterceptor(self.state.rpc_stats)
        ]
        if self.tokens is not None:  # inside telemetry: refusals are counted and mapped
            interceptors.append(
                AuthInterceptor(self.tokens, pool_exists=self.state.registry.__contains__)
            )
        else:
            _LOG.warning(
                "authentication is off: any client that reaches the ports may call every RPC "
                "(set auth_tokens)",
                extra={"event": "auth_off"},
            )
        if settings.etcd_endpoints:  # before the journal: a redirected call is not journaled
            from kvcm.server.cluster import ClusterRuntime

            registry = self.state.registry
            self.cluster = ClusterRuntime(
                settings,
                pool_ids=lambda: [pool.name for pool in registry.list()],
                has_pool=registry.__contains__,
            )
            interceptors.append(self.cluster.interceptor)
        if settings.data_dir:  # innermost: only calls that returned normally are journaled
            self.journal = await recover(self.state, settings.data_dir)
            journaling = JournalInterceptor(
                self.journal, self.state, settings.checkpoint_every_records
            )
            interceptors.append(journaling)
            self.replication = replication = Replication(
                self.state, "", directory=self.journal.directory
            )
            replication.credentials = peer_credentials(settings)  # TLS to peers with tls_cert
            journaling.replication = replication
            self.journal.on_change = replication.changed
            self.journal.on_call = replication.call_applied
            self.journal.admit = replication.admit
        if self.tracing is not None:  # outermost: its span covers the whole call
            interceptors.insert(0, self.tracing.interceptor())
        if settings.kv_events_endpoint:  # after recovery: replayed batches are not re-sent
            self.kv_events = KvEventStream(
                settings,
                collect=loop_collector(asyncio.get_running_loop(), self._kept_batches),
                numbering=self.state.kv_numbering,
            )
            self.state.kv_events = self.kv_events
        self.interceptors = tuple(interceptors)
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
                *subscriber_keepalive(settings.subscriber_lease_s),
            ],
        )
        add_servicers(server, self.state)
        if self.replication is not None:
            add_replica_servicer(server, self.replication)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (
                *SERVICE_NAMES,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        host, port = split_address(settings.grpc_address)
        listen = f"{_bracket(host)}:{port}"
        if self.tls is not None:
            bound = server.add_secure_port(listen, grpc_server_credentials(self.tls))
        else:
            bound = server.add_insecure_port(listen)
        if bound == 0:
            raise ConfigError(f"grpc_address: cannot listen on {settings.grpc_address!r}")
        self.grpc_port = bound
        if self.replication is not None:  # its identity in placements
            advertised = str(getattr(settings, "advertise_address", "") or "")
            self.replication.address = advertised or f"{host}:{bound}"
        self._grpc = server
        if self.cluster is not None and self.replication is not None:
            # Before anything is served: a pool deleted while this replica was down never is.
            await self.cluster.drop_deleted(self.replication)
        await server.start()
        if http_socket is not None:
            await self._start_http(http_socket)
        if lookup_socket is not None:
            await self._start_lookup_port(lookup_socket)
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.cluster is not None:  # joins once its calls can be answered
            if self.replication is not None:  # etcd's placements drive it; failover on
                self.cluster.attach(self.replication)
            await self.cluster.start(self.grpc_address, self.http_address)
        self.state.serving = True
        self.loop_lag.start(asyncio.get_running_loop())
        self.leases.start()
        _LOG.info(
            "kvcm serving gRPC on %s, HTTP on %s, lookup port on %s",
            self.grpc_address,
            self.http_address if settings.http_address else "(off)",
            self.lookup_address or "(off)",
            extra={
                "event": "serving",
                "grpc_address": self.grpc_address,
                "http_address": self.http_address,
                "lookup_address": self.lookup_address,
            },
        )

    async def _kept_batches(self, start: int, topic: str | None, offset: int) -> list[Any]:
        """Every kept ZMQ batch of stream ``offset`` whose wire ``seq`` is ``start`` or later,
        of the pool id whose topic is ``topic`` or of all (a replay request): the cleared
        batches of ended incarnations first, then the live pools'."""
        state = self.state
        stream = self.kv_events
        numbering = state.kv_numbering
        out: list[Any] = numbering.cleared_batches(start, topic, offset)
        for listed in state.registry.list():
            if not listed.options.enable_kv_cache_events:
                continue
            if stream is not None and stream.stream_offset(listed) != offset:
                continue
            if listed.name in state.standby_pools:  # a standby's copy publishes nothing here
                continue
            try:
                pool = await state.pool(listed.name)  # waits while a worker thread holds it
            except NotFoundError:
                continue
            held = state.first_held_batch(pool)  # not out yet: its standby lacks its record
            out.extend(collect_batches(pool, state.topic(pool), numbering, start, topic, held=held))
        return out

    def _pool_wiring(self, pool_ids: Sequence[str]) -> dict[str, PoolWiring]:
        """``/v1/pools``' hashing (never the seed: the route is open to readers) and ZMQ
        stream of the pools named."""
        pools = []
        for pool_id in pool_ids:
            with contextlib.suppress(NotFoundError):
                pools.append(self.state.registry.get(pool_id))
        streams = self.state.zmq_events_of(pools)
        out = {}
        for pool in pools:
            hashing = pool.hashing
            stream = streams.get(pool.name)
            out[pool.name] = PoolWiring(
                hashing=HashingSummary(
                    algorithm=str(hashing.algorithm),
                    hash_block_size=hashing.hash_block_size,
                    hash_length_bytes=hashing.hash_length_bytes,
                ),
                zmq_events=None if stream is None else ZmqEventsSummary(
                    endpoint=stream.endpoint,
                    replay_endpoint=stream.replay_endpoint,
                    topic=stream.topic,
                    last_seq=stream.last_seq,
                    data_parallel_rank=stream.data_parallel_rank,
                    dedicated=stream.dedicated,
                ),
            )  # fmt: skip
        return out

    async def _start_lookup_port(self, sock: socket.socket) -> None:
        """Serve Lookup on ``sock`` without gRPC (docs/lookup.md), with the gRPC side's TLS
        files (reloaded when they change, as the HTTP side's are) and tokens."""
        context = server_ssl_context(self.tls) if self.tls is not None else None
        self.lookup_port = LookupPort(
            self.state,
            max_message_bytes=self.settings.limits.max_message_bytes,
            authenticate=self.tokens.principal if self.tokens is not None else None,
            refusals=self.tokens.refusals if self.tokens is not None else None,
            ssl_context=context,
        )
        await self.lookup_port.start(sock)
        if self.tls is not None and context is not None:
            self._lookup_tls_watch = asyncio.create_task(
                self._watch_http_tls(context, self.tls, self.tls.stamp()),
                name="kvcm-lookup-tls",
            )

    async def _start_http(self, sock: socket.socket) -> None:
        host, port = split_address(self.settings.http_address)
        app = build_app(
            self.state.registry,
            self.state.rpc_stats,
            lambda: self.state.serving and not self._draining,
            loop_lag=self.loop_lag,
            reclaims=self.state.reclaims,
            progress=self.state.progress,
            journal=lambda: self.state.journal,
            zmq_counters=self.kv_events.counters if self.kv_events is not None else None,
            lookup=functools.partial(lookup_as, self.state.registry, state=self.state),
            authenticate=self.tokens.principal if self.tokens is not None else None,
            refusals=self.tokens.refusals if self.tokens is not None else None,
            wiring=self._pool_wiring,
            pd_route=functools.partial(route_pd_as, self.state),
            pd_routes=self.state.pd_routes,
            transfers=TransferView(self.state),
            cluster=self.cluster.reads if self.cluster is not None else None,
        )
        if self.cluster is not None:
            app.state.collector.cluster = self.cluster.samples
        if self.replication is not None:
            app.state.collector.replication = self.replication.samples
        app.state.collector.lookup_port = lambda: (
            self.lookup_port.samples() if self.lookup_port is not None else {}
        )
        app.state.collector.lookup_port_latency = lambda: (
            self.lookup_port.latency if self.lookup_port is not None else None
        )
        # Taken before uvicorn reads the files: a change after it is seen (a change before
        # only costs a reload of what is already loaded).
        tls_stamp = self.tls.stamp() if self.tls is not None else ()
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=self.settings.log_level.lower(),
            # None: uvicorn installs no handlers or formats of its own; its records reach the
            # root logger that kvcm.server.logs configured, so every line has one format.
            log_config=None,
            lifespan="off",
            access_log=False,
            **(uvicorn_ssl_options(self.tls) if self.tls is not None else {}),
        )
        http = _EmbeddedUvicorn(config)
        self._http = http
        self._http_task = asyncio.create_task(http.serve(sockets=[sock]), name="kvcm-http")
        while not http.started:
            if self._http_task.done():
                self._http_task.result()  # raises what stopped it
                raise RuntimeError(f"the HTTP side did not start on {self.settings.http_address!r}")
            await asyncio.sleep(0.005)
        self.http_port = http.servers[0].sockets[0].getsockname()[1]
        if self.tls is not None and isinstance(config.ssl, ssl.SSLContext):
            self._tls_watch = asyncio.create_task(
                self._watch_http_tls(config.ssl, self.tls, tls_stamp), name="kvcm-http-tls"
            )

    async def _watch_http_tls(
        self, context: ssl.SSLContext, files: TlsFiles, stamp: tuple[float, ...]
    ) -> None:
        """Reload the HTTP side's certificates when their files change."""
        while True:
            await asyncio.sleep(_TLS_WATCH_S)
            fresh = files.stamp()
            if fresh != stamp and reload_ssl_context(context, files):
                stamp = fresh

    async def stop(self, grace_s: float | None = None, delay_s: float = 0.0) -> None:
        """Stop gracefully: NOT_SERVING and /readyz 503 at once, keep serving ``delay_s``
        (endpoints update), then refuse new calls and give in-flight ones ``grace_s``, then
        stop HTTP."""
        if self._stopped.is_set():
            return
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        await self._health.enter_graceful_shutdown()
        self._draining = True  # /readyz answers 503 from now on
        if delay_s:  # calls are still served while endpoints take the server out
            await asyncio.sleep(delay_s)
        self.state.begin_shutdown()
        if self.lookup_port is not None:  # its in-flight lookups get the same grace
            await self.lookup_port.stop(grace)
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self.cluster is not None:  # leaves: its lease revoked, peers see it gone at once
            await self.cluster.stop()
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            await self._http_task
        self.loop_lag.stop()
        await self.leases.stop()
        if self.replication is not None:
            await self.replication.close()
        for watch in (self._tls_watch, self._lookup_tls_watch):
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
        if self.kv_events is not None:  # after the last call: every published batch is sent
            await asyncio.to_thread(self.kv_events.close)
            self.state.kv_events = None
            self.kv_events = None
        if self.journal is not None:  # compact: a checkpoint of every pool, an empty journal
            journal = self.journal
            journal.reset(checkpoint_of(self.state, journal.last_seq))
            journal.close()
            self.journal = None
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        """Wait until ``stop`` has finished."""
        await self._stopped.wait()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _bind(setting: str, address: str) -> socket.socket:
    """A socket bound to ``address`` (not yet listening).

    Raises:
        ConfigError: The address does not resolve or is in use (names ``setting``).
    """
    host, port = split_address(address)
    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot listen on {address!r}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"{setting}: cannot listen on {address!r}: {exc.strerror or exc}"
        ) from exc
    return sock


async def serve(settings: ServerSettings) -> None:
    """Run a server until SIGINT or SIGTERM, then shut it down gracefully."""
    server = KVCMServer(settings)
    await server.start()
    await run_until_signalled(server)


async def run_until_signalled(
    server: KVCMServer, reload: Callable[[], ServerSettings] | None = None
) -> None:
    """Wait for SIGINT or SIGTERM, then shut a started server down gracefully.

    SIGTERM keeps serving ``shutdown_delay_s`` with readiness off first (SIGINT stops at
    once). SIGHUP calls ``reload`` (the settings from their sources again) and applies what
    can change while serving: the log level and format; other changes are logged as needing
    a restart.
    """
    settings = server.settings
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    signals: list[int] = []

    def requested(sig: int) -> None:
        signals.append(sig)
        stop_requested.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, requested, sig)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, _reload, server, reload)
    try:
        await stop_requested.wait()
        _LOG.info(
            "kvcm shutting down (delay %.1fs, grace %.1fs)",
            settings.shutdown_delay_s if signals[0] == signal.SIGTERM else 0.0,
            settings.shutdown_grace_s,
            extra={"event": "shutting_down", "signal": signal.Signals(signals[0]).name},
        )
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        delay = settings.shutdown_delay_s if signals and signals[0] == signal.SIGTERM else 0.0
        await server.stop(delay_s=delay)


# Settings a running server cannot take up: SIGHUP names them when they changed.
_RESTART_SETTINGS = (
    "grpc_address",
    "http_address",
    "lookup_address",
    "data_dir",
    "otlp_endpoint",
    "limits",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "tls_peer_ca",
    "etcd_ca",
    "etcd_cert",
    "etcd_key",
    "auth_tokens",
)


def _reload(server: KVCMServer, reload: Callable[[], ServerSettings]) -> None:
    """SIGHUP: re-read the settings; apply the log settings, name what needs a restart."""
    try:
        fresh = reload()
    except ConfigError as exc:
        _LOG.error("configuration not reloaded: %s", exc, extra={"event": "config_reload_failed"})
        return
    current = server.settings
    configure_logging(fresh.log_level, fresh.log_format)
    if server.tokens is not None:
        try:
            server.tokens.reload()
        except ConfigError as exc:
            _LOG.error("auth tokens not reloaded: %s", exc, extra={"event": "auth_reload_failed"})
    live = {"log_level", "log_format"}
    pending = sorted(
        name
        for name in _RESTART_SETTINGS
        if getattr(fresh, name) != getattr(current, name) and name not in live
    )
    server.settings = dataclasses.replace(
        current, log_level=fresh.log_level, log_format=fresh.log_format
    )
    _LOG.info(
        "configuration reloaded",
        extra={
            "event": "config_reloaded",
            "log_level": fresh.log_level,
            "log_format": fresh.log_format,
            "needs_restart": pending,
        },
    )
