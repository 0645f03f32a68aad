"""vLLM 0.33's ``Scheduler`` and ``AsyncScheduler`` with kvcm managing the KV cache.

``SchedulerConfig.scheduler_cls`` names :class:`KvcmAsyncScheduler` (vLLM's default async
scheduling) or :class:`KvcmScheduler`; vLLM constructs it with its own arguments.

How the subclass ends up with kvcm's manager: vLLM's ``Scheduler.__init__`` always builds its
own ``KVCacheManager`` from the ``kv_cache_config`` it is given. The subclass hands it a copy of
that config with the same groups and a two-block pool (vLLM's manager then costs two block
objects, not a throw-away pool of the real size), and once vLLM's constructor returns, puts the
real config back and replaces ``kv_cache_manager`` with :class:`MirrorKVCacheManager`, which
answers every read the constructor's callers make afterwards (EngineCore reads
``coordinator.single_type_managers``). vLLM is not patched. Everything the constructor derived
from the config depends on the groups only, which the copy keeps.

Configurations kvcm does not manage are refused before anything is built, with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
import socket
from typing import TYPE_CHECKING, Any

from kvcm.client import TlsConfig
from kvcm.common.errors import ConfigError
from kvcm.integrations.vllm._convert import check_connector_groups
from kvcm.integrations.vllm._manager import MirrorKVCacheManager, MirrorManagerConfig
from kvcm.integrations.vllm._procship import ProcessStepShipper
from kvcm.integrations.vllm._settings import KvcmSettings
from kvcm.integrations.vllm._shipper import EngineTurns, GrpcStepShipper
from kvcm.integrations.vllm._sinks import NullSink
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from kvcm.integrations.vllm._sinks import StepSink

__all__ = [
    "KvcmAsyncScheduler",
    "KvcmScheduler",
    "check_supported",
    "default_labels",
    "default_pool_id",
]

# Blocks of the pool vLLM's constructor builds and the subclass throws away (null block + 1).
_PLACEHOLDER_NUM_BLOCKS = 2
_SCHEDULER_SIGNATURE = inspect.signature(Scheduler.__init__)
# vLLM's KV connectors whose every call into the KV-cache manager kvcm answers as vLLM's
# manager does: the pull-mode NIXL connector (tests/compat/test_pd_nixl*.py) and the
# offloading connector (tests/compat/test_offload_mirror.py).
SUPPORTED_KV_CONNECTORS = (
    "NixlConnector",
    "NixlPullConnector",
    "KvcmNixlConnector",
    "OffloadingConnector",
)


def _accepts_multimodal_inputs(model_config: Any) -> bool:
    """Whether vLLM lets multi-modal items into this engine's requests (a multi-modal model
    not limited to text; vLLM runs one without a multi-modal processor as text-only)."""
    if model_config is None or not model_config.is_multimodal_model:
        return False
    return bool(model_config.supports_multimodal_inputs)


def check_supported(vllm_config: Any) -> None:
    """Refuse configurations kvcm's integration does not manage.

    Raises:
        ConfigError: The message names the setting and why.
    """
    refusals = [
        (
            vllm_config.kv_transfer_config is not None
            and vllm_config.kv_transfer_config.kv_connector not in SUPPORTED_KV_CONNECTORS,
            "of the KV connectors (--kv-transfer-config) kvcm supports vLLM's pull-mode "
            f"NIXL connector and its offloading connector ({', '.join(SUPPORTED_KV_CONNECTORS)})",
        ),
        (
            getattr(vllm_config, "ec_transfer_config", None) is not None,
            "encoder-cache connectors (--ec-transfer-config) are not supported with kvcm",
        ),
        (
            # vLLM's own test of whether image/audio/video items can reach this engine; kvcm
            # does not hash their placeholders yet, so such a request would stop the engine
            # when first scheduled: refused here, before any request.
            _accepts_multimodal_inputs(getattr(vllm_config, "model_config", None)),
            "multi-modal inputs are not supported with kvcm yet (their placeholder tokens' "
            "block hashes are not mirrored); serve the model text-only (--language-model-only) "
            "or without kvcm",
        ),
        (
            bool(getattr(getattr(vllm_config, "model_config", None), "enable_prompt_embeds", 0)),
            "prompt embeddings (--enable-prompt-embeds) are not supported with kvcm yet (their "
            "block hashes are not mirrored); start without the flag or without kvcm",
        ),
        (
            vllm_config.aux_output_config.enabled,
            "aux output connectors are not supported with kvcm",
        ),
    ]
    for refused, reason in refusals:
        if refused:
            raise ConfigError(reason)


def default_pool_id(vllm_config: Any) -> str:
    """``vllm-<host>-dp<rank>``: one pool per engine (data-parallel rank) and host."""
    rank = 0
    if vllm_config is not None:
        rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    host = socket.gethostname().split(".")[0].lower() or "host"
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)
    return f"vllm-{safe}-dp{rank}"


def default_labels(vllm_config: Any) -> dict[str, str]:
    """The labels every engine's pool carries: ``model`` (the served name) and
    ``data_parallel_rank``, so routers can scope lookups to one model's engines."""
    if vllm_config is None:
        return {}
    labels = {
        "data_parallel_rank": str(
            int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        )
    }
    model_config = getattr(vllm_config, "model_config", None)
    served = getattr(model_config, "served_model_name", None) or getattr(
        model_config, "model", None
    )
    if isinstance(served, list | tuple):
        served = served[0] if served else None
    if isinstance(served, str) and served:
        labels["model"] = served[:256]
    return labels


def _kvcm_offloading_manager(scheduler: Any) -> Any:
    # The offloading connector's index when it is kvcm's (KvcmOffloadingSpec), else None.
    connector = getattr(scheduler, "connector", None)
    manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
    if manager is None:
        return None
    from kvcm.integrations.vllm._offload import KvcmOffloadingManager

    return manager if isinstance(manager, KvcmOffloadingManager) else None


def _placeholder_config(kv_cache_config: Any) -> Any:
    # The config vLLM's constructor builds its throw-away manager from: the same groups, a
    # two-block pool. Each tensor keeps its bytes per block (a KV connector built there, e.g.
    # the offloading connector, sizes its host buffer in chunks from them).
    num_blocks = kv_cache_config.num_blocks
    placeholder = min(num_blocks, _PLACEHOLDER_NUM_BLOCKS)
    tensors = [
        dataclasses.replace(tensor, size=tensor.size // num_blocks * placeholder)
        for tensor in kv_cache_config.kv_cache_tensors
    ]
    return dataclasses.replace(kv_cache_config, num_blocks=placeholder, kv_cache_tensors=tensors)


class _KvcmSchedulerMixin:
    """What both kvcm schedulers add to vLLM's (see the module docstring).

    Attributes:
        kvcm_settings: The integration's settings.
        kv_cache_manager: kvcm's mirror with vLLM's manager surface.
    """

    kvcm_settings: KvcmSettings
    kv_cache_manager: MirrorKVCacheManager
    # Whether the class is meant for vLLM's async engine loop (AsyncScheduler's bookkeeping).
    _async_scheduling: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _SCHEDULER_SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        vllm_config = arguments["vllm_config"]
        kv_cache_config = arguments["kv_cache_config"]
        settings = KvcmSettings.from_sources(vllm_config.additional_config)
        # vLLM's own refusals for this model's groups first (their reasons are vLLM's).
        check_connector_groups(vllm_config, kv_cache_config)
        check_supported(vllm_config)
        self._check_loop(vllm_config)
        # Fail on unsupported specs, and on what EngineCore resolved that kvcm would compute
        # differently, before vLLM builds anything.
        from kvcm.integrations.vllm._convert import (
            check_engine_resolution,
            convert_kv_cache_config,
        )

        convert_kv_cache_config(kv_cache_config)
        block_size = arguments["block_size"]
        check_engine_resolution(
            kv_cache_config,
            scheduler_block_size=block_size,
            hash_block_size=arguments["hash_block_size"] or block_size,
            enable_caching=vllm_config.cache_config.enable_prefix_caching,
            dcp_world_size=vllm_config.parallel_config.decode_context_parallel_size,
        )
        arguments["kv_cache_config"] = _placeholder_config(kv_cache_config)
        super().__init__(**arguments)
        self.kvcm_settings = settings
        self.kv_cache_config = kv_cache_config
        scheduler: Any = self
        placeholder = scheduler.kv_cache_manager.coordinator
        self.kv_cache_manager = MirrorKVCacheManager(
            MirrorManagerConfig(
                kv_cache_config=kv_cache_config,
                max_model_len=scheduler.max_model_len,
                scheduler_block_size=scheduler.block_size,
                hash_block_size=scheduler.hash_block_size,
                max_in_flight_tokens=vllm_config.max_in_flight_tokens,
                enable_caching=scheduler.cache_config.enable_prefix_caching,
                log_stats=scheduler.log_stats,
                enable_kv_cache_events=scheduler.enable_kv_cache_events,
                watermark=scheduler.scheduler_config.watermark,
                hash_algorithm=scheduler.cache_config.prefix_caching_hash_algo,
                dcp_world_size=scheduler.dcp_world_size,
                defer_block_free=bool(scheduler.defer_block_free),
                # EAGLE/MTP as vLLM's constructor resolved them on its placeholder manager.
                eagle_group_ids=tuple(sorted(placeholder.eagle_group_ids)),
                eagle_block_drop_group_ids=tuple(sorted(placeholder.drop_eagle_group_ids)),
                num_hash_lookahead_tokens=scheduler.num_hash_lookahead_tokens,
                num_prefill_lookahead=scheduler.num_prefill_lookahead,
                enable_mamba_shared_prefix_checkpoint=bool(
                    scheduler.cache_config.enable_mamba_shared_prefix_checkpoint
                ),
            ),
        )
        # vLLM's constructor read the shared-prefix checkpoint off its placeholder manager;
        # the chunks end at junctions as the manager the scheduler runs on decides.
        scheduler.mamba_shared_prefix_checkpoint = (
            scheduler.mamba_partial_cache_hit
            and self.kv_cache_manager.mamba_shared_prefix_checkpoint
        )
        offloading = _kvcm_offloading_manager(self)
        if offloading is not None:
            self.kv_cache_manager.attach_host_tier(offloading)
        sink = self.make_step_sink(settings)
        self.kv_cache_manager.sink = sink
        # The shipping thread works while the engine is outside schedule() and
        # update_from_output() (GrpcStepShipper.turns); other sinks need no marks.
        self._kvcm_turns: EngineTurns | None = getattr(sink, "turns", None)

    def _check_loop(self, vllm_config: Any) -> None:
        # vLLM runs a scheduler_cls under the loop async_scheduling selects, whatever the
        # class; a synchronous scheduler under the async loop only gets a warning there.
        wants_async = bool(vllm_config.scheduler_config.async_scheduling)
        if wants_async != self._async_scheduling:
            name = type(self).__name__
            hint = (
                "use kvcm.integrations.vllm.KvcmAsyncScheduler, or pass --no-async-scheduling"
                if wants_async
                else "use kvcm.integrations.vllm.KvcmScheduler, or pass --async-scheduling"
            )
            raise ConfigError(
                f"{name} needs async_scheduling={self._async_scheduling}, but vLLM runs with "
                f"async_scheduling={wants_async}: {hint}"
            )

    def make_step_sink(self, settings: KvcmSettings) -> StepSink:
        """Where the scheduler's Step programs go: the sink the mode picks (called once the
        mirror is built; see :mod:`kvcm.integrations.vllm._sinks`).

        Without an address the mirror is the only copy (:class:`NullSink`); with one, a
        :class:`~kvcm.integrations.vllm._shipper.GrpcStepShipper` ships them to the server, in
        the background in mirror mode, acknowledging each answer in remote mode. Override to
        collect or inspect the programs.
        """
        if settings.address is None:
            return NullSink()
        vllm_config: Any = getattr(self, "vllm_config", None)
        pool_id = settings.pool_id or default_pool_id(vllm_config)
        manager = self.kv_cache_manager

        def pool_config() -> Any:
            return dataclasses.replace(
                manager.pool_config(),
                scheduler_lease_s=settings.lease_s,
                labels={**default_labels(vllm_config), **settings.labels},
            )

        if settings.mode == "mirror" and settings.shipper == "process":
            return ProcessStepShipper(
                address=settings.address,
                pool_id=pool_id,
                pool_config=pool_config,
                recorder_options=manager.recorder.options(),
                no_blocks=manager.core.empty_kv_cache_blocks,
                step_timeout_s=settings.step_timeout_s,
                max_backlog=settings.max_backlog,
                lease_s=settings.lease_s,
                tls_files=(
                    (settings.tls_ca, settings.tls_cert, settings.tls_key)
                    if settings.tls_ca or settings.tls_cert
                    else None
                ),
                token=settings.token,
            )
        return GrpcStepShipper(
            address=settings.address,
            pool_id=pool_id,
            pool_config=pool_config,
            step_timeout_s=settings.step_timeout_s,
            max_backlog=settings.max_backlog,
            synchronous=settings.mode == "remote",
            snapshot_source=lambda: (manager.recorder.num_steps, manager.snapshot()),
            lease_s=settings.lease_s,
            tls=(
                TlsConfig.from_files(settings.tls_ca, settings.tls_cert, settings.tls_key)
                if settings.tls_ca or settings.tls_cert
                else None
            ),
            token=settings.token,
        )

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``schedule()``; the step's mutations close as one Step program.

        What ``update_from_output()`` changes (frees of finished requests, cached blocks) is
        recorded into the program of the next ``schedule()``, so a step costs one Step RPC.
        """
        turns = self._kvcm_turns
        if turns is None:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
            self.kv_cache_manager.close_step()
            return output
        turns.enter()
        try:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
            self.kv_cache_manager.close_step()
        finally:
            turns.leave()
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``update_from_output()``, marked for the shipping thread (see
        :class:`~kvcm.integrations.vllm._shipper.EngineTurns`)."""
        turns = self._kvcm_turns
        if turns is None:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        turns.enter()
        try:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        finally:
            turns.leave()

    def shutdown(self) -> None:
        """Ship what is pending (up to ``shutdown_timeout_s``), close the sink, then shut
        vLLM's scheduler down."""
        manager = self.kv_cache_manager
        manager.flush(self.kvcm_settings.shutdown_timeout_s)
        manager.sink.close(0.0)
        super().shutdown()  # type: ignore[misc]


class KvcmScheduler(_KvcmSchedulerMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` on kvcm (use with ``--no-async-scheduling``)."""

    _async_scheduling = False


class KvcmAsyncScheduler(_KvcmSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` on kvcm (vLLM's default: async scheduling on)."""

    _async_scheduling = True
