"""``KvcmNixlConnector``: vLLM's pull-mode NIXL connector, recording each handoff in kvcm.

A subclass of vLLM 0.33's ``NixlPullConnector`` (``NixlConnector``) that changes nothing of
what NIXL moves or decides: every scheduler-side hook calls vLLM's first and returns its
answer; the worker side is vLLM's, untouched. Around them it records each handoff as a
*record-only* transfer of kvcm's ``TransferService`` (docs/pd.md), so an operator can list what
is pinned, where it goes, and how often a lease runs out; kvcm never frees a block for these
records (the engines' own protocol keeps authority over their blocks).

What is recorded, and when (``transfer_id``: the request id the source engine answered as
``remote_request_id``; the source pool travels in ``kv_transfer_params["kvcm_pool"]``):

* the source engine finishes a request whose blocks it keeps for a pull (``request_finished``
  delays the free): ``HoldSource`` with its blocks, computed tokens and lease
  (``kv_lease_duration``; ``decoder_kv_blocks_ttl`` on a decode engine's bidirectional side);
* the pulling engine allocates the tokens it lacks (``update_state_after_alloc``):
  ``PlanTransfer`` with its own prefix hit (tokens saved) and the tokens it pulls; a full local
  hit (nothing to pull) is committed at once;
* its worker reports the pull (``finished_recving``): ``CommitTransfer`` with the blocks
  pulled, or ``ReleaseTransfer`` when the load failed (wholly, or some blocks invalid: vLLM
  recomputes);
* the pulling engine aborts the request before its pull (``request_finished`` with
  ``do_remote_prefill`` still set): ``ReleaseTransfer``;
* the source engine frees the source (``finished_sending``: read, or its lease ran out):
  ``ExpireTransfer`` with ``source_freed``: a transfer nobody planned is EXPIRED; a planned
  one keeps its state (its destination reports how its pull ended) and an ended one answers
  as it is. The two engines' calls travel apart, so a destination whose report reaches kvcm
  after the source's can see its transfer expired first and then completed (both counted).

The calls go out from one background thread per engine, in order, through the SDK (retried on
UNAVAILABLE; a call on a pool or a transfer that is not there yet, because the engine's mirror
or the other engine has not shipped it yet, is retried for up to ``_NOT_YET_S``), so the
scheduler's step never waits for kvcm; a call that still fails is
logged and counted (``TransferLog.failures``), never raised into the engine.

Use it in place of ``NixlConnector``::

    --kv-transfer-config '{"kv_connector": "KvcmNixlConnector",
                           "kv_connector_module_path": "kvcm.integrations.vllm", ...}'

with the kvcm settings of the scheduler (``--additional-config '{"kvcm": {...}}'``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from kvcm.client import SchedulerClient, ServiceError, ServiceNotFoundError, TlsConfig
from kvcm.integrations.vllm._settings import KvcmSettings
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

__all__ = ["KVCM_POOL_PARAM", "KvcmNixlConnector", "TransferLog"]

_LOG = logging.getLogger("kvcm.integrations.vllm.nixl")
KVCM_POOL_PARAM: Final = "kvcm_pool"
"""The ``kv_transfer_params`` key naming the source engine's kvcm pool."""
_REMOTE_KEYS: Final = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
_NOT_YET_S: Final = 5.0
_RETRY_S: Final = 0.05


class TransferLog:
    """Ships transfer calls from one background thread, in order (see the module docstring).

    Attributes:
        sent: Calls the server answered.
        failures: Calls that failed for good (logged).
    """

    def __init__(self, client: Callable[[], SchedulerClient]) -> None:
        """Open a client with ``client()`` in the thread, on the first call."""
        self._make_client = client
        self._queue: queue.Queue[tuple[str, tuple[Any, ...], dict[str, Any]] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self.sent = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="kvcm-transfer-log", daemon=True)
        self._thread.start()

    def submit(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Queue ``SchedulerClient.<method>(*args, **kwargs)``."""
        with self._idle:
            self._pending += 1
        self._queue.put((method, args, kwargs))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued call was answered or failed; whether it was in time."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Ship what is queued (up to ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        client: SchedulerClient | None = None
        try:
            while (item := self._queue.get()) is not None:
                if client is None:
                    client = self._make_client()
                self._call(client, *item)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
        finally:
            if client is not None:
                client.close()

    def _call(
        self, client: SchedulerClient, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        give_up = time.monotonic() + _NOT_YET_S
        while True:
            try:
                getattr(client, method)(*args, **kwargs)
            except ServiceNotFoundError as exc:
                # The pool may not be created yet (the mirror ships it), or the source
                # engine's HoldSource may still be on its way from its own thread.
                if time.monotonic() < give_up:
                    time.sleep(_RETRY_S)
                    continue
                self._failed(method, args, exc)
            except ServiceError as exc:
                self._failed(method, args, exc)
            else:
                self.sent += 1
            return

    def _failed(self, method: str, args: tuple[Any, ...], exc: Exception) -> None:
        self.failures += 1
        _LOG.warning("kvcm transfer record %s%r not recorded: %s", method, args[:2], exc)


def _hashed_blocks(blocks: Any) -> int:
    """Blocks of the first KV-cache group served by the local prefix cache (vLLM's own count)."""
    groups = blocks.blocks
    if not groups:
        return 0
    return sum(block.block_hash is not None and not block.is_null for block in groups[0])


class KvcmNixlConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` recording each P/D handoff in kvcm (module docstring).

    Attributes:
        transfer_log: The scheduler side's :class:`TransferLog` (``None`` on a worker, or
            without a kvcm address).
        pool_id: This engine's kvcm pool (the scheduler's).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        """vLLM's connector; on the scheduler side also the transfer log."""
        super().__init__(vllm_config, role, kv_cache_config)
        self.transfer_log: TransferLog | None = None
        self.pool_id = ""
        # Pulls this engine planned, by its request id: (source pool, transfer id, local
        # block ids of the pull, tokens pulled).
        self._pulls: dict[str, tuple[str, str, tuple[int, ...], int]] = {}
        # Sources this engine holds, by request id: its transfer's id.
        self._held: set[str] = set()
        if role != KVConnectorRole.SCHEDULER:
            return
        settings = KvcmSettings.from_sources(vllm_config.additional_config)
        if not settings.address:
            _LOG.warning("KvcmNixlConnector: no kvcm address; handoffs are not recorded")
            return
        from kvcm.integrations.vllm._scheduler import default_pool_id

        self.pool_id = settings.pool_id or default_pool_id(vllm_config)
        groups = kv_cache_config.kv_cache_groups
        self._block_size = groups[0].kv_cache_spec.block_size if groups else 1
        transfer = vllm_config.kv_transfer_config
        self._lease_s = float(transfer.get_from_extra_config("kv_lease_duration", 30))
        self._decoder_ttl_s = float(transfer.get_from_extra_config("decoder_kv_blocks_ttl", 480))
        tls = (
            TlsConfig.from_files(settings.tls_ca, settings.tls_cert, settings.tls_key)
            if settings.tls_ca or settings.tls_cert
            else None
        )
        address, timeout, token = settings.address, settings.step_timeout_s, settings.token
        self.transfer_log = TransferLog(
            lambda: SchedulerClient(address, timeout=timeout, tls=tls, token=token)
        )

    # ------------------------------------------------------------------- the source side
    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's answer; a delayed free is recorded as a held source."""
        params = dict(request.kv_transfer_params or {})
        delay, answer = super().request_finished(request, block_ids)
        return delay, self._finished(request, params, delay, answer)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's answer; a delayed free is recorded as a held source."""
        params = dict(request.kv_transfer_params or {})
        delay, answer = super().request_finished_all_groups(request, block_ids)
        return delay, self._finished(request, params, delay, answer)

    def _finished(
        self, request: Any, params: dict[str, Any], delay: bool, answer: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        log = self.transfer_log
        if log is None:
            return answer
        if params.get("do_remote_prefill") and params.get(KVCM_POOL_PARAM):
            # Finished before its pull was scheduled (an abort): vLLM tells the source to free.
            pull = self._pulls.pop(request.request_id, None)
            if pull is None:
                log.submit(
                    "release_transfer",
                    params[KVCM_POOL_PARAM],
                    params["remote_request_id"],
                    "aborted before its pull",
                )
        if not delay or answer is None:
            return answer
        is_decode_side = bool(answer.get("do_remote_decode"))
        blocks: Sequence[Sequence[int]] = answer.get("remote_block_ids") or ()
        log.submit(
            "hold_source",
            self.pool_id,
            request.request_id,
            lease_s=self._decoder_ttl_s if is_decode_side else self._lease_s,
            record_only=True,
            request_id=request.request_id,
            num_tokens=int(answer.get("remote_num_tokens") or 0),
            source_blocks=[list(group) for group in blocks],
        )
        self._held.add(request.request_id)
        return {**answer, KVCM_POOL_PARAM: self.pool_id}

    # ------------------------------------------------------------------ the pulling side
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM's bookkeeping; a pull it starts is recorded as the transfer's plan."""
        params = dict(request.kv_transfer_params or {})
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        log = self.transfer_log
        source = params.get(KVCM_POOL_PARAM)
        if log is None or not source or not params.get("remote_block_ids"):
            return
        scheduler = self.connector_scheduler
        bidirectional = bool(getattr(scheduler, "is_bidirectional_kv_xfer_enabled", False))
        pulls = params.get("do_remote_prefill") or (
            params.get("do_remote_decode")
            and bidirectional
            and not params.get("_remote_blocks_processed")
        )
        if not pulls or not all(key in params for key in _REMOTE_KEYS):
            return
        transfer_id = params["remote_request_id"]
        hit_tokens = _hashed_blocks(blocks) * self._block_size
        log.submit(
            "plan_transfer",
            source,
            transfer_id,
            self.pool_id,
            hit_tokens=hit_tokens,
            pull_tokens=num_external_tokens,
        )
        if num_external_tokens == 0:  # a full local hit: nothing to pull
            log.submit("commit_transfer", source, transfer_id, blocks_pulled=0)
            return
        local = blocks.get_unhashed_block_ids_all_groups()
        first = tuple(local[0]) if local else ()
        self._pulls[request.request_id] = (source, transfer_id, first, num_external_tokens)

    # ------------------------------------------------------------------------ completions
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """vLLM's bookkeeping; finished pulls and freed sources end their records."""
        super().update_connector_output(connector_output)
        log = self.transfer_log
        if log is None:
            return
        failed = connector_output.failed_recving or set()
        invalid = connector_output.invalid_block_ids or set()
        for req_id in sorted(connector_output.finished_recving or ()):
            pull = self._pulls.pop(req_id, None)
            if pull is None:
                continue
            source, transfer_id, local, _ = pull
            bad = sum(block in invalid for block in local)
            if req_id in failed:
                log.submit("release_transfer", source, transfer_id, "load failed: recomputed")
            elif bad:
                reason = f"{bad} of {len(local)} blocks invalid: recomputed from the last valid"
                log.submit("release_transfer", source, transfer_id, reason)
            else:
                log.submit("commit_transfer", source, transfer_id, blocks_pulled=len(local))
        for req_id in sorted(connector_output.finished_sending or ()):
            if req_id in self._held:
                self._held.discard(req_id)
                log.submit(
                    "expire_transfer",
                    self.pool_id,
                    req_id,
                    "the engine freed the source before a completed pull",
                    source_freed=True,
                )

    def shutdown(self) -> None:
        """vLLM's shutdown, after the transfer log shipped what it holds."""
        if self.transfer_log is not None:
            self.transfer_log.close()
        super().shutdown()
