"""The worker side of vLLM 0.33's ``OffloadingConnector``, simulated for ``_engine_core``.

vLLM's offloading worker submits each step's store and load jobs to its transfer handlers and
reports every finished job back in ``kv_connector_worker_meta`` (an
``OffloadingWorkerMetadata``: job id -> count), and each finished asynchronous load's request
in ``finished_recving``. Here every job of a step finishes within that step (the copies take no
time): the scheduler side sees each store become loadable, and each load end, one step after
it asked for them. No bytes move; which chunks are stored, loaded and evicted is what the
scheduler side (its ``OffloadingManager``) decided, and that is what the tests compare.

The jobs are logged (``log``) for the tests: ``("store" | "load", job_id, req_id)``.
"""

from __future__ import annotations

from typing import Any


class SimulatedOffloading:
    """One engine's offloading worker side (world size 1)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, str]] = []

    def step(self, metadata: Any) -> Any:
        """Finish every job of the step's metadata; the ``KVConnectorOutput`` or ``None``."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        if metadata is None:
            return None
        done = OffloadingWorkerMetadata()
        recving: set[str] = set()
        for job_id, job in metadata.store_jobs.items():
            self.log.append(("store", job_id, job.req_id))
            done.mark_completed(job_id)
        for job_id in metadata.jobs_to_flush or ():
            done.mark_completed(job_id)
        for job_id, job in metadata.load_jobs.items():
            self.log.append(("load", job_id, job.req_id))
            done.mark_completed(job_id)
            if not job.sync:
                recving.add(job.req_id)
        if not done.completed_jobs:
            return None
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=done)
