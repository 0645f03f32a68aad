"""The server's settings, from four layers: flags > ``KVCM_*`` variables > TOML file > defaults.

Every setting has one name and three spellings, all derived from the name (docs/server.md
lists them)::

    grpc_address          --grpc-address          KVCM_GRPC_ADDRESS         [server] table
    max_blocks_per_pool   --max-blocks-per-pool   KVCM_MAX_BLOCKS_PER_POOL  [limits] table

The ``[server]`` table holds how the process runs, the ``[limits]`` table the service's hard
limits (:class:`~kvcm.core.limits.Limits`). The file itself comes from ``--config`` or
``KVCM_CONFIG``. A bad value, an unknown key or table is a :class:`ConfigError` whose one-line
message names the setting and where it came from.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Final

from kvcm.common.errors import ConfigError, InvalidArgumentError
from kvcm.core.limits import DEFAULT_LIMITS, Limits
from kvcm.core.pool_types import check_labels

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_GRPC_ADDRESS",
    "DEFAULT_HTTP_ADDRESS",
    "SETTINGS",
    "ServerSettings",
    "SettingSpec",
    "load_settings",
    "etcd_uses_tls",
    "parse_etcd_endpoints",
    "split_address",
]

DEFAULT_GRPC_ADDRESS: Final = "127.0.0.1:50051"
DEFAULT_HTTP_ADDRESS: Final = "127.0.0.1:8080"
CONFIG_ENV: Final = "KVCM_CONFIG"
DEFAULT_KV_EVENTS_TOPIC: Final = "kv@{pool}@{model}"
_GRPC_MAX_MESSAGE_BYTES: Final = 2**31 - 1
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS: Final = ("text", "json")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    """How ``kvcm serve`` runs.

    Attributes:
        grpc_address: ``host:port`` of the gRPC side (port 0: any free port).
        http_address: ``host:port`` of the HTTP side (/metrics, probes); ``""``: no HTTP.
        lookup_address: ``host:port`` of the lookup port (Lookup without gRPC, for routers;
            docs/lookup.md); ``""``: off.
        log_level: Python logging level name.
        log_format: ``"text"`` (one line per record) or ``"json"`` (one JSON object per line).
        shutdown_grace_s: Seconds in-flight RPCs get to finish on shutdown.
        shutdown_delay_s: Seconds between readiness going off (SIGTERM) and the server
            stopping to accept calls, for load balancers and endpoints to notice.
        tls_cert: PEM certificate chain of the server (with ``tls_key``: TLS on both sides).
        tls_key: PEM private key of the server.
        tls_client_ca: PEM CA whose certificates clients must present (mutual TLS).
        auth_tokens: TOML file of bearer tokens (SHA-256 digests) and their roles
            (``""``: no authentication).
        transfer_lease_s: Seconds a request allocated with ``delay_cache_blocks`` (a P/D KV
            transfer in flight) may stay neither cached nor freed before it is freed; 0: never.
        subscriber_lease_s: Seconds an event stream may wait for its reader to accept one
            message before the server ends it; every connection is also pinged after half
            of it without traffic and closed when the answer takes longer than half of it
            (0: forever, no pings).
        checkpoint_every_records: With ``data_dir``: take a checkpoint while serving after
            this many journal records (0: only at start-up and graceful stop).
        data_dir: Directory of the journal and checkpoints (``""``: pools live in memory only
            and a restart loses them).
        otlp_endpoint: OTLP/gRPC endpoint for traces (``""``: off unless OpenTelemetry's
            ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set); needs ``kvcm[tracing]``.
        trace_sample_ratio: Fraction of root spans sampled, in [0, 1].
        kv_events_endpoint: ZMQ endpoint of vLLM's KV-event stream (``""``: off); wildcard and
            ipc/inproc endpoints are bound, others connected to (vLLM's rule).
        kv_events_replay_endpoint: ZMQ endpoint the replay ROUTER binds (``""``: no replay).
        kv_events_topic: Topic of each pool's batches, over ``{pool}`` and ``{model}``.
        kv_events_port_label: A pool label whose integer value offsets the ports of the pool's
            stream (``data_parallel_rank``: vLLM's port + rank); ``""``: every pool on the
            one endpoint, told apart by topic.
        kv_events_hwm: The PUB socket's high-water mark (messages).
        kv_events_max_queue_size: Batches waiting for the publisher thread; beyond, dropped.
        kv_events_use_int_block_hashes: 1: hashes as vLLM's default 64-bit ints; 0: full
            digests (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
        etcd_endpoints: etcd's client endpoints, ``http://HOST:PORT`` (or all ``https://``)
            comma-separated: the server joins a cluster of replicas (docs/cluster.md); ``""``:
            a lone server.
        advertise_address: ``host:port`` other replicas and clients dial to reach this one
            (``""``: the bound gRPC address, unless it is a wildcard).
        etcd_prefix: The etcd key prefix of the cluster's keys.
        etcd_lease_ttl_s: TTL of the replica's etcd lease, in seconds.
        etcd_timeout_s: Deadline of each etcd call, in seconds.
        cluster_fanout_timeout_s: Deadline of each peer's part of a cluster-wide call.
        tls_peer_ca: PEM CA that signed the other replicas' certificates: with ``tls_cert``,
            replica-to-replica channels speak TLS and verify the peer with it (``""``:
            ``tls_client_ca``).
        etcd_ca: PEM CA that signed etcd's certificates (TLS to etcd; ``https://`` endpoints).
        etcd_cert: PEM client certificate this replica presents to etcd (with ``etcd_key``).
        etcd_key: PEM private key of ``etcd_cert``.
        limits: The service's hard limits.
    """

    grpc_address: str = DEFAULT_GRPC_ADDRESS
    http_address: str = DEFAULT_HTTP_ADDRESS
    lookup_address: str = ""
    log_level: str = "INFO"
    log_format: str = "text"
    shutdown_grace_s: float = 5.0
    shutdown_delay_s: float = 0.0
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_tokens: str = ""
    transfer_lease_s: float = 0.0
    subscriber_lease_s: float = 0.0
    checkpoint_every_records: int = 100_000
    data_dir: str = ""
    otlp_endpoint: str = ""
    trace_sample_ratio: float = 1.0
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = DEFAULT_KV_EVENTS_TOPIC
    kv_events_port_label: str = ""
    kv_events_hwm: int = 100_000
    kv_events_max_queue_size: int = 100_000
    kv_events_use_int_block_hashes: int = 1
    etcd_endpoints: str = ""
    advertise_address: str = ""
    etcd_prefix: str = "/kvcm"
    etcd_lease_ttl_s: int = 5
    etcd_timeout_s: float = 2.0
    cluster_fanout_timeout_s: float = 2.0
    tls_peer_ca: str = ""
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    limits: Limits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        for name in ("grpc_address", "http_address", "lookup_address"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"{name} must be 'host:port', got {value!r}")
            if value or name == "grpc_address":
                try:
                    split_address(value)
                except ConfigError as exc:
                    raise ConfigError(f"{name}: {exc}") from None
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if not self.shutdown_grace_s >= 0:
            raise ConfigError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.checkpoint_every_records < 0:
            raise ConfigError(
                f"checkpoint_every_records must be >= 0, got {self.checkpoint_every_records}"
            )
        if not self.subscriber_lease_s >= 0:
            raise ConfigError(f"subscriber_lease_s must be >= 0, got {self.subscriber_lease_s}")
        if not self.transfer_lease_s >= 0:
            raise ConfigError(f"transfer_lease_s must be >= 0, got {self.transfer_lease_s}")
        if not self.shutdown_delay_s >= 0:
            raise ConfigError(f"shutdown_delay_s must be >= 0, got {self.shutdown_delay_s}")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ConfigError(
                f"trace_sample_ratio must be in [0, 1], got {self.trace_sample_ratio}"
            )
        self._check_kv_events()
        self._check_cluster()
        if self.limits.max_message_bytes > _GRPC_MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"max_message_bytes must be <= {_GRPC_MAX_MESSAGE_BYTES} (gRPC's int32), "
                f"got {self.limits.max_message_bytes}"
            )

    def _check_kv_events(self) -> None:
        if self.kv_events_use_int_block_hashes not in (0, 1):
            raise ConfigError(
                "kv_events_use_int_block_hashes must be 0 or 1, got "
                f"{self.kv_events_use_int_block_hashes}"
            )
        for name in ("kv_events_hwm", "kv_events_max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(
                    f"{name} must be a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH), got {value!r}"
                )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.kv_events_port_label:
            self._check_kv_events_port_label()
        try:
            self.kv_events_topic.format(pool="p", model="m")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"kv_events_topic {self.kv_events_topic!r} may use only {{pool}} and {{model}}"
            ) from exc

    def _check_cluster(self) -> None:
        if self.etcd_endpoints:
            parse_etcd_endpoints(self.etcd_endpoints)
            if self.lookup_address:
                raise ConfigError(
                    "lookup_address: the lookup port answers about this server's pools only; "
                    "a cluster's Lookup fans out to every replica over gRPC: leave it '' with "
                    "etcd_endpoints (routers call the Lookup RPC)"
                )
            if self.tls_cert and not (self.tls_peer_ca or self.tls_client_ca):
                raise ConfigError(
                    "tls_peer_ca: a replica with tls_cert in a cluster (etcd_endpoints) speaks "
                    "TLS to its peers and must verify them: set tls_peer_ca (or tls_client_ca) "
                    "to the CA that signed the replicas' certificates"
                )
        if self.tls_peer_ca and not self.tls_cert:
            raise ConfigError("tls_peer_ca needs tls_cert: replicas speak TLS to peers with it")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise ConfigError("etcd_cert and etcd_key go together: set both or neither")
        etcd_tls = self.etcd_ca or self.etcd_cert
        if etcd_tls and not self.etcd_endpoints:
            raise ConfigError("etcd_ca, etcd_cert and etcd_key need etcd_endpoints")
        if etcd_tls and not etcd_uses_tls(self.etcd_endpoints):
            raise ConfigError(
                f"etcd_endpoints: TLS to etcd is set (etcd_ca, etcd_cert) but the endpoints are "
                f"not https://: write https://HOST:PORT, got {self.etcd_endpoints!r}"
            )
        if self.advertise_address:
            try:
                split_address(self.advertise_address)
            except ConfigError as exc:
                raise ConfigError(f"advertise_address: {exc}") from None
        if not self.etcd_prefix.startswith("/") or self.etcd_prefix.endswith("/"):
            raise ConfigError(
                f"etcd_prefix must start with '/' and not end with one, got {self.etcd_prefix!r}"
            )
        if not self.etcd_lease_ttl_s >= 2:
            raise ConfigError(f"etcd_lease_ttl_s must be >= 2, got {self.etcd_lease_ttl_s}")
        for name in ("etcd_timeout_s", "cluster_fanout_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    def _check_kv_events_port_label(self) -> None:
        try:
            check_labels({self.kv_events_port_label: ""}, "kv_events_port_label")
        except InvalidArgumentError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value.startswith("tcp://") and not value.rpartition(":")[2].isdigit():
                raise ConfigError(
                    f"{name} must end in a port number when kv_events_port_label is set "
                    f"(each stream adds its offset to it), got {value!r}"
                )

    @property
    def max_pools(self) -> int:
        """``limits.max_pools``."""
        return self.limits.max_pools

    @property
    def max_message_bytes(self) -> int:
        """``limits.max_message_bytes``."""
        return self.limits.max_message_bytes


@dataclass(frozen=True, slots=True)
class SettingSpec:
    """One setting: its name, its TOML table, its type and what it means.

    Attributes:
        name: The setting's name (the TOML key, the field of ServerSettings or Limits).
        table: ``"server"`` or ``"limits"``.
        kind: ``str``, ``int`` or ``float``.
        default: The default value.
        help: What it means (the flag's help and the docs table).
    """

    name: str
    table: str
    kind: type
    default: object
    help: str

    @property
    def flag(self) -> str:
        """The command-line flag, ``--grpc-address``."""
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """The environment variable, ``KVCM_GRPC_ADDRESS``."""
        return "KVCM_" + self.name.upper()


_HELP: Final = {
    "grpc_address": "gRPC host:port (port 0: any free port)",
    "http_address": "HTTP host:port for /metrics, /healthz, /readyz, /v1/pools ('': no HTTP)",
    "lookup_address": "host:port of the lookup port: Lookup over plain framed TCP on the "
    "server's event loop, without gRPC's per-call cost, for routers (docs/lookup.md; '': off; "
    "not in a cluster)",
    "log_level": f"logging level, one of {', '.join(LOG_LEVELS)}",
    "log_format": "log line format: text, or json (one object per line)",
    "shutdown_grace_s": "seconds in-flight RPCs get to finish on shutdown",
    "shutdown_delay_s": "seconds between readiness going off on SIGTERM and the server refusing "
    "new calls (for endpoints and load balancers to update)",
    "tls_cert": "PEM certificate chain of the server; with tls_key, gRPC and HTTP speak TLS "
    "only (reloaded on change for gRPC)",
    "tls_key": "PEM private key of the server",
    "tls_client_ca": "PEM CA file: clients must present a certificate it signed (mutual TLS)",
    "auth_tokens": "TOML file of bearer tokens (sha256 digests) with roles per pool glob; "
    "every call must then carry one ('': no authentication)",
    "transfer_lease_s": "seconds a request allocated with delay_cache_blocks (a P/D transfer) "
    "may stay neither cached nor freed before the server frees it (0: never)",
    "subscriber_lease_s": "seconds an event stream may wait for its reader to accept one "
    "message before the server ends it, freeing its resources; connections are pinged every "
    "half of it (0: forever, no pings)",
    "checkpoint_every_records": "with data_dir: checkpoint while serving after this many journal "
    "records, bounding the journal and the restart time (0: only at start-up and stop)",
    "data_dir": "directory for the write-ahead journal and checkpoints: every answered "
    "mutation survives a crash ('': in memory only)",
    "otlp_endpoint": "OTLP/gRPC endpoint for traces, e.g. http://otel-collector:4317 ('': off "
    "unless OTEL_EXPORTER_OTLP_ENDPOINT is set; needs kvcm[tracing])",
    "trace_sample_ratio": "fraction of root spans traced, in [0, 1] (traced callers always are)",
    "kv_events_endpoint": "ZMQ endpoint of vLLM's KV-event stream, e.g. tcp://*:5557 (bound; "
    "a tcp://HOST:PORT without a wildcard is connected to, as vLLM does; '': off)",
    "kv_events_replay_endpoint": "ZMQ endpoint the replay socket binds, e.g. tcp://*:5558 "
    "('': no replay)",
    "kv_events_topic": "ZMQ topic of each pool's batches; {pool} is the pool id, {model} its "
    "model label",
    "kv_events_port_label": "pool label whose integer value offsets the ports of the pool's "
    "KV-event stream and its replay socket, e.g. data_parallel_rank (vLLM's port + rank, one "
    "socket per pool for consumers that ignore topics); '': one socket for every pool",
    "kv_events_hwm": "high-water mark of the KV-event PUB socket (messages)",
    "kv_events_max_queue_size": "KV-event batches waiting to be sent; beyond, a batch is dropped "
    "(and counted) and subscribers replay the gap",
    "kv_events_use_int_block_hashes": "1: block hashes as vLLM's default 64-bit ints; 0: full "
    "digests (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)",
    "etcd_endpoints": "etcd client endpoints, http://HOST:PORT (or https:// for TLS) "
    "comma-separated: join a cluster of replicas that share pools through etcd "
    "(docs/cluster.md; '': a lone server)",
    "advertise_address": "host:port other replicas and clients dial to reach this replica ('': "
    "the bound gRPC address, unless it is a wildcard)",
    "etcd_prefix": "etcd key prefix of the cluster's keys (one cluster per prefix)",
    "etcd_lease_ttl_s": "TTL of the replica's etcd lease in seconds: a replica that stops "
    "refreshing it leaves the live set this long after",
    "etcd_timeout_s": "deadline of each etcd call in seconds",
    "cluster_fanout_timeout_s": "deadline of each peer's part of a cluster-wide call (ListPools, "
    "Lookup, RoutePd) in seconds; a peer that misses it is reported missing",
    "tls_peer_ca": "PEM CA file that signed the other replicas' certificates: with tls_cert, "
    "replicas speak TLS to each other and verify the peer's address with it ('': tls_client_ca)",
    "etcd_ca": "PEM CA file that signed etcd's certificates (TLS to etcd: https:// endpoints)",
    "etcd_cert": "PEM client certificate presented to etcd (etcd's --client-cert-auth)",
    "etcd_key": "PEM private key of etcd_cert",
    "max_pools": "pools the server holds; CreatePool answers RESOURCE_EXHAUSTED beyond",
    "max_blocks_per_pool": "blocks of one pool (explicit or planned, the null block included)",
    "max_total_blocks": "blocks of all pools together (the server's memory budget)",
    "max_step_ops": "ops in one Step program",
    "max_step_tokens": "token ids in one Step program (prompts plus appended tokens)",
    "max_message_bytes": "bytes of one gRPC message either way (grpc answers RESOURCE_EXHAUSTED)",
    "max_subscribers_per_pool": "live event subscriptions of one pool",
    "max_pending_registrations": "ranks waiting at one pool's RegisterWorker barrier",
    "registration_timeout_s": "seconds a rank waits for the other ranks at most",
}


def _specs() -> tuple[SettingSpec, ...]:
    server = ServerSettings()
    tables: tuple[tuple[str, object, list[str]], ...] = (
        ("server", server, [f.name for f in fields(ServerSettings) if f.name != "limits"]),
        ("limits", DEFAULT_LIMITS, [f.name for f in fields(Limits)]),
    )
    return tuple(
        SettingSpec(name, table, type(getattr(values, name)), getattr(values, name), _HELP[name])
        for table, values, names in tables
        for name in names
    )


def parse_etcd_endpoints(value: str) -> tuple[tuple[str, int], ...]:
    """``(host, port)`` of each comma-separated endpoint (``http://host:port`` or ``host:port``).

    ``https://host:port`` endpoints are the same; every endpoint must then be ``https://``
    (:func:`etcd_uses_tls`).

    Raises:
        ConfigError: An endpoint is not of that form, or ``https://`` and plaintext endpoints
            are mixed, naming ``etcd_endpoints``.
    """
    etcd_uses_tls(value)
    endpoints: list[tuple[str, int]] = []
    for raw in value.split(","):
        item = raw.strip().removeprefix("https://").removeprefix("http://").rstrip("/")
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                "etcd_endpoints: each endpoint must be http://HOST:PORT, https://HOST:PORT or "
                f"HOST:PORT, got {raw!r}"
            )
        endpoints.append((host.strip("[]"), int(port)))
    return tuple(endpoints)


def etcd_uses_tls(value: str) -> bool:
    """Whether the comma-separated etcd endpoints are ``https://`` (TLS to etcd).

    Raises:
        ConfigError: Some endpoints are ``https://`` and others not.
    """
    schemes = {raw.strip().startswith("https://") for raw in value.split(",")}
    if len(schemes) > 1:
        raise ConfigError(
            f"etcd_endpoints: mixes https:// and plaintext endpoints, got {value!r}: etcd is "
            "reached over TLS or not"
        )
    return schemes == {True}


def split_address(address: str) -> tuple[str, int]:
    """``("host", port)`` of ``host:port`` (IPv6 hosts in brackets).

    Raises:
        ConfigError: Not ``host:port`` with a port in [0, 65535].
    """
    host, _, port = address.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not host or not 0 <= number <= 65535:
        raise ConfigError(f"address must be 'host:port' with a port in [0, 65535], got {address!r}")
    return host.strip("[]"), number


SETTINGS: Final = _specs()
"""Every setting, in the order of the docs table."""
_BY_NAME: Final = {spec.name: spec for spec in SETTINGS}
_TABLES: Final = ("server", "limits")


def _coerce(spec: SettingSpec, value: object, source: str, *, parse: bool = True) -> object:
    """``value`` as the setting's type; strings are parsed when ``parse`` (flags, variables).

    A TOML file has types of its own: a string where a number belongs is a wrong type there.
    """
    kind = spec.kind
    if isinstance(value, str) and kind is not str and parse:
        text = value.strip()
        try:
            return kind(text)
        except ValueError:
            pass
    elif kind is str and isinstance(value, str):
        return value
    elif isinstance(value, bool):
        pass
    elif kind is int and isinstance(value, int):
        return value
    elif kind is float and isinstance(value, int | float):
        return float(value)
    noun = {str: "a string", int: "an integer", float: "a number"}[kind]
    raise ConfigError(f"{source}: {spec.name} must be {noun}, got {value!r}")


def _read_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """The tables of a TOML config file, checked for unknown tables and keys."""
    where = f"config file {str(path)!r}"
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    unknown_tables = sorted(set(document) - set(_TABLES))
    if unknown_tables:
        raise ConfigError(f"{where}: unknown table or key {unknown_tables[0]!r}")
    tables: dict[str, dict[str, Any]] = {}
    for table in _TABLES:
        values = document.get(table, {})
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: [{table}] must be a table")
        for key in values:
            spec = _BY_NAME.get(key)
            if spec is None:
                raise ConfigError(f"{where}: unknown key {key!r} in [{table}]")
            if spec.table != table:
                raise ConfigError(f"{where}: key {key!r} belongs in [{spec.table}]")
        tables[table] = values
    return tables


def load_settings(
    config_file: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ServerSettings:
    """Settings from defaults, the TOML file, ``KVCM_*`` variables, then ``overrides``.

    Args:
        config_file: The TOML file; ``None``: ``$KVCM_CONFIG`` if set, else none.
        environ: The environment (``os.environ`` when ``None``).
        **overrides: Settings by name, typed or as strings (flags); ``None`` is "not given".

    Raises:
        ConfigError: One line naming the setting and its source: an unknown key or table, a
            value of the wrong type or out of its domain, an unreadable file.
    """
    env = os.environ if environ is None else environ
    if config_file is None and env.get(CONFIG_ENV):
        config_file = env[CONFIG_ENV]
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    if config_file is not None:
        for table, entries in _read_file(config_file).items():
            for key, value in entries.items():
                source = f"config file {str(config_file)!r} [{table}] {key}"
                values[key] = _coerce(_BY_NAME[key], value, source, parse=False)
                sources[key] = source
    for spec in SETTINGS:
        if spec.env in env:
            source = f"environment {spec.env}"
            values[spec.name] = _coerce(spec, env[spec.env], source)
            sources[spec.name] = source
    for name, value in overrides.items():
        if value is None:
            continue
        known = _BY_NAME.get(name)
        if known is None:
            raise ConfigError(f"unknown setting {name!r}")
        source = f"flag {known.flag}"
        values[name] = _coerce(known, value, source)
        sources[name] = source
    return _build(values, sources)


def _build(values: Mapping[str, object], sources: Mapping[str, str]) -> ServerSettings:
    """ServerSettings of checked values; a domain error names the setting's source."""
    # _coerce gave every value its setting's type.
    limits_values: dict[str, Any] = {
        k: v for k, v in values.items() if _BY_NAME[k].table == "limits"
    }
    server_values: dict[str, Any] = {
        k: v for k, v in values.items() if _BY_NAME[k].table == "server"
    }
    try:
        limits = replace(DEFAULT_LIMITS, **limits_values)
    except ValueError as exc:
        raise ConfigError(_with_source(str(exc), sources)) from None
    if isinstance(server_values.get("log_level"), str):
        server_values["log_level"] = str(server_values["log_level"]).upper()
    if isinstance(server_values.get("log_format"), str):
        server_values["log_format"] = str(server_values["log_format"]).lower()
    try:
        return ServerSettings(**server_values, limits=limits)
    except ConfigError as exc:
        raise ConfigError(_with_source(str(exc), sources)) from None


def _with_source(message: str, sources: Mapping[str, str]) -> str:
    """Prefix a domain error with where its setting came from (default: no prefix)."""
    for name, source in sources.items():
        if message.startswith((f"{name} ", f"{name}:", f"limits.{name} ")):
            return f"{source}: {message.removeprefix('limits.')}"
    return message
