"""The shipper's lag as Prometheus metrics of the engine process, served by vLLM's ``/metrics``.

The server's view of a pool's lag (``kvcm_pool_steps_behind``) is only as fresh as the last
Step it received: while the server is unreachable it is stale. The engine's view is exported
here, labelled by ``pool_id``, with ``prometheus_client`` (a dependency of vLLM; without it
nothing is exported):

* Without ``PROMETHEUS_MULTIPROC_DIR`` (vLLM's API server and engine core in one process) a
  collector registered in ``prometheus_client.REGISTRY``, the registry vLLM's ``/metrics``
  serves then, reads every live shipper at scrape time: the age of the oldest unshipped step
  is computed when scraped, so it grows while a stalled server holds the shipper.
* With ``PROMETHEUS_MULTIPROC_DIR`` (vLLM sets it before it starts the engine core in its own
  process; its ``/metrics`` then reads the directory with a ``MultiProcessCollector``) a
  registry in the engine process is never scraped: a thread copies the lag and the counters
  into the directory's files every :data:`PUBLISH_INTERVAL_S`, independent of the shipping
  thread (which may be waiting on a stalled server). A closed shipper's backlog and age are
  written as 0.

Nothing is added to the scheduler's step: the counters are the shipper's
:class:`~kvcm.integrations.vllm._shipper.ShipperStats`, read when the metrics are read.
:func:`register_engine_metrics` picks another registry (in-process mode only).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final, cast

if TYPE_CHECKING:
    from kvcm.integrations.vllm._shipper import GrpcStepShipper

__all__ = ["PUBLISH_INTERVAL_S", "register_engine_metrics"]

_LOG = logging.getLogger("kvcm.integrations.vllm")

PUBLISH_INTERVAL_S: Final = 1.0
"""How often the multiprocess mode writes the lag into ``PROMETHEUS_MULTIPROC_DIR``."""

# name, help; gauges read from ShipperLag, counters from ShipperStats.
_GAUGES: Final = (
    ("kvcm_engine_shipping_backlog_steps", "Closed steps the kvcm server has not acknowledged."),
    (
        "kvcm_engine_oldest_unshipped_step_age_seconds",
        "Seconds since the oldest step the kvcm server has not acknowledged was closed.",
    ),
    ("kvcm_engine_server_reachable", "1 when the shipper's last call reached the kvcm server."),
)
_COUNTERS: Final = (
    ("kvcm_engine_shipped_steps", "steps_shipped", "Steps the kvcm server ran."),
    ("kvcm_engine_shipping_resyncs", "resyncs", "Snapshots of the mirror uploaded."),
    (
        "kvcm_engine_shipping_errors",
        "retries",
        "Calls to the kvcm server repeated after a transient failure.",
    ),
    (
        "kvcm_engine_shipping_mismatches",
        "mismatches",
        "Shipped steps the server answered differently from the mirror.",
    ),
    ("kvcm_engine_dropped_steps", "steps_dropped", "Steps never shipped (a snapshot covers them)."),
)
_GAUGE_MODES: Final = ("livesum", "livemax", "livemin")

_lock = threading.Lock()
_publish_lock = threading.Lock()  # one writer of the multiprocess files at a time
_shippers: weakref.WeakSet[GrpcStepShipper] = weakref.WeakSet()
_registries: list[Any] = []  # registries the collector is in
# The publisher thread, the multiprocess metrics, the counts already written per shipper.
_state: dict[str, Any] = {"publisher": None, "objects": None, "published": {}}


def _gauge_values(shipper: GrpcStepShipper) -> tuple[float, float, float]:
    lag = shipper.lag()
    return float(lag.backlog_steps), lag.oldest_unshipped_age_s, float(lag.reachable)


class _Collector:
    """Reads every live shipper when scraped."""

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with _lock:
            shippers = list(_shippers)
        gauges = [GaugeMetricFamily(name, text, labels=["pool_id"]) for name, text in _GAUGES]
        counters = [
            CounterMetricFamily(name, text, labels=["pool_id"]) for name, _, text in _COUNTERS
        ]
        # Two shippers of one pool (an engine restarted in-process) are one series: backlogs
        # and counters add up, the age and reachability are the worst.
        pools: dict[str, list[float]] = {}
        for shipper in shippers:
            backlog, age, reachable = _gauge_values(shipper)
            values = [backlog, age, reachable]
            values += [float(getattr(shipper.stats, field)) for _, field, _ in _COUNTERS]
            known = pools.setdefault(shipper.pool_id, values)
            if known is not values:
                merged = [known[0] + backlog, max(known[1], age), min(known[2], reachable)]
                merged += [old + new for old, new in zip(known[3:], values[3:], strict=True)]
                known[:] = merged
        for pool_id, values in sorted(pools.items()):
            for gauge, value in zip(gauges, values, strict=False):
                gauge.add_metric([pool_id], value)
            for counter, value in zip(counters, values[len(gauges) :], strict=True):
                counter.add_metric([pool_id], value)
        yield from gauges
        yield from counters


def register_engine_metrics(registry: Any = None) -> bool:
    """Export the shippers' lag in ``registry`` (``None``: ``prometheus_client.REGISTRY``).

    Called with no argument when the first shipper starts; call it with another registry to
    serve the metrics from there too. With ``PROMETHEUS_MULTIPROC_DIR`` set, the metrics go to
    that directory instead and ``registry`` is ignored. Returns ``False`` when
    ``prometheus_client`` is not installed.
    """
    try:
        import prometheus_client
    except ImportError:
        return False
    with _lock:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            if _state["publisher"] is None:
                publisher = threading.Thread(
                    target=_publish, name="kvcm-engine-metrics", daemon=True
                )
                publisher.start()
                _state["publisher"] = publisher
            return True
        target = prometheus_client.REGISTRY if registry is None else registry
        if not any(known is target for known in _registries):
            target.register(_Collector())
            _registries.append(target)
    return True


def track(shipper: GrpcStepShipper) -> None:
    """Export ``shipper``'s lag until :func:`untrack` (or until it is garbage)."""
    with _lock:
        _shippers.add(shipper)
    try:
        register_engine_metrics()
    except Exception:  # a metrics failure must never stop the engine
        _LOG.exception("kvcm: registering the engine metrics failed")


def untrack(shipper: GrpcStepShipper) -> None:
    """Stop exporting ``shipper`` (it was closed)."""
    with _lock:
        _shippers.discard(shipper)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and _state["objects"] is not None:
        with _publish_lock:  # its last counts; its backlog and age no longer count
            _write(_metric_objects(), [shipper], closed=True)


def _metric_objects() -> dict[str, Any]:
    # Unregistered metrics: in multiprocess mode their values live in the directory's files.
    from prometheus_client import Counter, Gauge

    with _lock:
        if _state["objects"] is None:
            objects: dict[str, Any] = {}
            for (name, text), mode in zip(_GAUGES, _GAUGE_MODES, strict=True):
                objects[name] = Gauge(
                    name, text, ["pool_id"], registry=None, multiprocess_mode=cast("Any", mode)
                )
            for name, _, text in _COUNTERS:
                objects[name] = Counter(name, text, ["pool_id"], registry=None)
            _state["objects"] = objects
        result: dict[str, Any] = _state["objects"]
        return result


def _write(objects: dict[str, Any], shippers: list[GrpcStepShipper], *, closed: bool) -> None:
    published: dict[tuple[int, str], int] = _state["published"]
    for shipper in shippers:
        gauges = (0.0, 0.0, 1.0) if closed else _gauge_values(shipper)
        for (name, _), value in zip(_GAUGES, gauges, strict=True):
            objects[name].labels(shipper.pool_id).set(value)
        for name, field, _ in _COUNTERS:
            key = (id(shipper), field)
            value = int(getattr(shipper.stats, field))
            delta = value - published.get(key, 0)
            if delta > 0:
                objects[name].labels(shipper.pool_id).inc(delta)
            if closed:
                published.pop(key, None)
            else:
                published[key] = value


def _publish() -> None:
    objects = _metric_objects()
    wake = threading.Event()
    while True:
        try:
            with _publish_lock:  # reads the shippers under it: untrack() writes after
                with _lock:
                    shippers = list(_shippers)
                _write(objects, shippers, closed=False)
        except Exception:  # a metrics failure must never reach the engine
            _LOG.exception("kvcm: writing the engine metrics failed")
        wake.wait(PUBLISH_INTERVAL_S)
