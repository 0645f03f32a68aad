"""The server's lifecycle log lines: one INFO line per pool change, DEBUG per rejected call.

Each line's facts are ``extra`` fields (``event``, ``pool`` ...) that kvcm.server.logs writes as
``key=value`` or JSON keys, so a log pipeline can select ``event=pool_deleted`` without parsing
the message. Nothing here runs per successful call: a pool's life has a handful of lines, and a
rejected call's line is built only when DEBUG is on.
"""

from __future__ import annotations

import logging

from kvcm.common.errors import KVCMError
from kvcm.core.pool import Pool

__all__ = [
    "log_call_rejected",
    "log_pool_created",
    "log_pool_deleted",
    "log_pool_ready",
    "log_pool_resynced",
    "log_worker_registered",
]

POOLS_LOG = logging.getLogger("kvcm.server.pools")
CALLS_LOG = logging.getLogger("kvcm.server.rpc")


def _num_blocks(pool: Pool) -> int:
    manager = pool.manager
    return 0 if manager is None else manager.block_pool.num_gpu_blocks


def log_pool_created(pool: Pool) -> None:
    """INFO ``pool created`` (and ``pool ready`` at once for an explicit layout)."""
    POOLS_LOG.info(
        "pool created",
        extra={
            "event": "pool_created",
            "pool": pool.name,
            "state": str(pool.state),
            "world_size": pool.options.world_size,
        },
    )
    if pool.manager is not None:
        log_pool_ready(pool)


def log_pool_ready(pool: Pool) -> None:
    """INFO ``pool ready``: planned (or laid out), blocks allocated, serving requests."""
    POOLS_LOG.info(
        "pool ready",
        extra={"event": "pool_ready", "pool": pool.name, "num_blocks": _num_blocks(pool)},
    )


def log_pool_resynced(pool: Pool, *, replaced: bool) -> None:
    """INFO ``pool resynced``: a scheduler uploaded its copy of the pool (a new epoch)."""
    POOLS_LOG.info(
        "pool resynced",
        extra={
            "event": "pool_resynced",
            "pool": pool.name,
            "epoch": pool.epoch,
            "replaced": replaced,
            "step_seq": pool.last_step_seq,
            "num_blocks": _num_blocks(pool),
            "num_requests": len(pool.requests),
        },
    )


def log_worker_registered(pool: Pool, rank: int, world_size: int) -> None:
    """INFO ``worker registered``: one rank joined the pool's registration barrier."""
    POOLS_LOG.info(
        "worker registered",
        extra={
            "event": "worker_registered",
            "pool": pool.name,
            "rank": rank,
            "world_size": world_size,
            "registered": len(pool.registrations),
        },
    )


def log_pool_deleted(pool: Pool) -> None:
    """INFO ``pool deleted``, with what it held."""
    POOLS_LOG.info(
        "pool deleted",
        extra={
            "event": "pool_deleted",
            "pool": pool.name,
            "num_blocks": _num_blocks(pool),
            "num_requests": len(pool.requests),
        },
    )


def log_call_rejected(method: str, code: str, exc: BaseException) -> None:
    """DEBUG ``call rejected`` with the status and, where the error names them, field and op.

    The metrics already count every rejection (``kvcm_rpc_requests_total{code}``); this line
    says which field a client got wrong.
    """
    if not CALLS_LOG.isEnabledFor(logging.DEBUG):
        return
    extra: dict[str, object] = {"event": "call_rejected", "method": method, "code": code}
    if isinstance(exc, KVCMError):  # StepRejectedError included: it names field and op
        if exc.field is not None:
            extra["field"] = exc.field
        if exc.op_index is not None:
            extra["op_index"] = exc.op_index
    CALLS_LOG.debug("call rejected: %s", exc, extra=extra)
