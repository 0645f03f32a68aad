"""vLLM 0.33's own ``EngineCore`` on CPU, with a simulated executor, for kvcm's differential tests.

Nothing of the engine is assembled by hand: ``EngineCore(vllm_config, executor_class,
log_stats)`` profiles the executor (layer specs per rank, available memory, supported KV-cache
layouts), plans the KV cache, resolves the block sizes, the hash block size and the cache-hit
alignment, builds the scheduler named by ``SchedulerConfig.scheduler_cls`` (vLLM's own when
unset) and is driven by its own ``step()``, or ``step_with_batch_queue()`` when it runs more
than one batch at a time (async scheduling, pipeline parallelism). Requests go in as
``EngineCoreRequest`` through ``preprocess_add_request`` (the engine's block hasher) and
``add_request``.

The executor (:class:`SimulatedExecutor`) stands in for the GPU workers: one
:class:`SimulatedWorker` per rank reports that rank's attention layers (tensor parallelism
divides the KV heads, pipeline parallelism splits the layers), the memory it has for the KV
cache and its layouts, and "runs" the model: every scheduled request whose chunk reaches the
end of its known tokens samples one token, a deterministic function of the request id and the
position, so sync and async engines produce the same text. ``execute_model`` answers ``None``
(an empty batch: vLLM's empty output) and ``sample_tokens`` the output, both as futures when
the engine asks (``non_block``), as vLLM's executors do.

KV events come out through vLLM's own publisher factory (a ``"kvcm-recording"`` publisher
registered with ``EventPublisherFactory``), so the scheduler's ``kv_event_publisher`` is the one
vLLM's constructor made.

Used by tests/compat/test_vllm_scheduler.py, test_vllm_shipping.py and bench/vllm_scheduler.py.
vLLM must already be importable (tests/compat/conftest.py ``import_vllm``).

API (kept small for benchmarks)::

    engine = build_engine(Setup(...), scheduler_cls=None, additional_config=None)
    for record in run(engine, plan_workload(seed, n, setup)):  # one StepRecord per turn
        ...
    engine.shutdown()
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import tempfile
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

_SITE_HINT = "/root/.cache/kvcm/vllm-ref/lib/python3.11/site-packages"
VOCAB = 1000
NUM_LAYERS = 2
NUM_KV_HEADS = 4
HEAD_SIZE = 16
_RECORDING_PUBLISHER = "kvcm-recording"
# CacheConfig.prefix_cache_retention_interval left as vLLM's default.
DEFAULT = "default"


@dataclass(frozen=True)
class Setup:
    """One engine configuration.

    Attributes:
        num_blocks: Blocks of the pool (``cache_config.num_gpu_blocks_override``); ``None``:
            planned by vLLM from the memory the workers report (``memory_blocks``).
        memory_blocks: Pages of KV-cache memory each worker reports per layer it holds.
        block_size: Tokens per block (``--block-size``).
        sliding_window: Layer 1 is a sliding-window layer of this window (0: all full
            attention); hybrid models need vLLM's hybrid KV-cache manager (GPU default).
        retention_interval: ``--prefix-cache-retention-interval``; ``DEFAULT``: vLLM's.
        kv_cache_dtype: vLLM's ``--kv-cache-dtype`` (``"fp8"``: a quantized cache, whose
            layers report vLLM's storage dtype and quantization mode for it).
        sliding_window_dtype: The sliding-window layer's KV dtype (another than the full
            layers' makes a mixed-precision cache, whose new blocks workers must zero).
        enable_caching: Prefix caching.
        async_scheduling: vLLM's async scheduling (two batches in flight).
        log_stats: Collect stats (``--disable-log-stats`` off).
        max_num_seqs: Most running requests.
        max_num_batched_tokens: Token budget per step (chunked prefill).
        max_model_len: Longest sequence.
        lora: Configure LoRA (two adapters).
        watermark: Scheduler watermark.
        tensor_parallel_size: Ranks splitting each layer's KV heads.
        pipeline_parallel_size: Ranks splitting the layers.
        decode_context_parallel_size: ``--decode-context-parallel-size`` (DCP over the
            tensor-parallel ranks: attention blocks span this many ranks' blocks).
        serve_defaults: Build the config as ``vllm serve`` does (``AsyncEngineArgs`` for the
            OpenAI server); only the model, caching and ``scheduler_cls`` are given.
        kv_transfer: ``KVTransferConfig`` fields (``--kv-transfer-config``), e.g. vLLM's
            ``NixlConnector`` in the producer or consumer role; ``None``: no connector.
        fabric: The :class:`TransferFabric` the simulated workers move KV through (needed
            with ``kv_transfer``; one per set of engines that transfer to each other).
        num_speculative_tokens: vLLM's speculative decoding with this many draft tokens
            (``--speculative-config '{"method": ..., ...}'``; 0: off). The simulated drafter
            proposes tokens the simulated model accepts in part (see
            :meth:`SimulatedWorker.take_draft_token_ids`).
        speculative_method: ``"ngram"``, or ``"draft_model"`` (the same tiny model drafts;
            vLLM then reserves ``num_speculative_tokens`` lookahead slots per allocation),
            or a hidden-state drafter, ``"eagle"`` or ``"eagle3"`` (the tiny model stands in
            for the drafter's weights, which the simulated executor never loads).
        disable_lookahead_block_hashes: vLLM's speculative option of that name: EAGLE drops
            the trailing prefix-cache block instead of hashing lookahead tokens.
        report_full: Share of requests whose ``SamplingParams.extra_args`` ask for
            ``kv_cache_report_mode="full"`` (their prefix-cache hits reported as BlockStored).
    """

    num_blocks: int | None = 160
    memory_blocks: int = 200
    block_size: int = 16
    sliding_window: int = 0
    retention_interval: int | str | None = DEFAULT
    sliding_window_dtype: str = "float16"
    kv_cache_dtype: str = "auto"
    enable_caching: bool = True
    async_scheduling: bool = False
    log_stats: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    lora: bool = False
    watermark: float = 0.0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    serve_defaults: bool = False
    kv_transfer: dict[str, Any] | None = None
    fabric: Any = None
    num_speculative_tokens: int = 0
    speculative_method: str = "ngram"
    disable_lookahead_block_hashes: bool = False
    report_full: float = 0.0


@cache
def _model_dir() -> str:
    path = Path(tempfile.mkdtemp(prefix="kvcm-tiny-llama-"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 8192,
        "torch_dtype": "float16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _child_sees_vllm() -> None:
    # ModelConfig inspects the model class in a child interpreter; give it vLLM's site the
    # same way this process has it (appended to sys.path, never ahead of kvcm's pins).
    from vllm.model_executor.models import registry

    site = next(
        (
            p
            for p in sys.path
            if p.rstrip("/").endswith("site-packages") and Path(p, "vllm").is_dir()
        ),
        _SITE_HINT,
    )
    registry._SUBPROCESS_COMMAND = [
        sys.executable,
        "-c",
        f"import sys, runpy; sys.path.append({site!r}); "
        "runpy.run_module('vllm.model_executor.models.registry', run_name='__main__')",
    ]


class RecordingPublisher:
    """A KV event publisher (registered with vLLM's factory) that keeps what it is given."""

    def __init__(self, data_parallel_rank: int = 0, **config: Any) -> None:
        del data_parallel_rank, config
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def take(self) -> list[Any]:
        """The events published since the last call."""
        events, self.events = self.events, []
        return events

    def shutdown(self) -> None:
        pass


@cache
def _register_publisher() -> None:
    from vllm.distributed.kv_events import EventPublisherFactory

    EventPublisherFactory.register_publisher(_RECORDING_PUBLISHER, RecordingPublisher)


def vllm_config(setup: Setup, scheduler_cls: Any = None, additional_config: Any = None) -> Any:
    """vLLM's config for ``setup`` (``scheduler_cls``: None for vLLM's own)."""
    from vllm.config import KVEventsConfig

    _child_sees_vllm()
    _register_publisher()
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    # The field's type lists vLLM's two built-in publishers; the factory takes any registered
    # name, so name the recording one after validation.
    events.publisher = _RECORDING_PUBLISHER  # type: ignore[assignment]
    build = _serve_config if setup.serve_defaults else _explicit_config
    config = build(setup, scheduler_cls, additional_config, events)
    # vLLM turns its hybrid KV-cache manager on for GPU platforms; this CPU machine's platform
    # says no, which would flatten a hybrid model to full attention. Resolve it as on a GPU.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def _serve_config(setup: Setup, scheduler_cls: Any, additional_config: Any, events: Any) -> Any:
    # What `vllm serve MODEL --scheduler-cls ... --additional-config ...` builds.
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = AsyncEngineArgs(
        model=_model_dir(),
        skip_tokenizer_init=True,
        load_format="dummy",
        kv_cache_dtype=setup.kv_cache_dtype,
        scheduler_cls=scheduler_cls,
        additional_config=additional_config or {},
        kv_events_config=events,
        tensor_parallel_size=setup.tensor_parallel_size,
        pipeline_parallel_size=setup.pipeline_parallel_size,
        distributed_executor_backend=executor_class(setup),
    )
    # The CPU test machine's platform names no device, which EngineArgs turns into a
    # DeviceConfig; name the CPU for that call only (its other answers -- no device memory,
    # no device name -- give vLLM's defaults for a GPU it does not recognise).
    from vllm.platforms import current_platform

    device_type = current_platform.device_type
    current_platform.device_type = device_type or "cpu"
    try:
        return args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    finally:
        current_platform.device_type = device_type


def _explicit_config(setup: Setup, scheduler_cls: Any, additional_config: Any, events: Any) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model = ModelConfig(
        model=_model_dir(),
        skip_tokenizer_init=True,
        max_model_len=setup.max_model_len,
        dtype="float16",
    )
    scheduler = SchedulerConfig(
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=setup.async_scheduling,
        watermark=setup.watermark,
    )
    if scheduler_cls is not None:
        scheduler.scheduler_cls = scheduler_cls
    cache: dict[str, Any] = {
        "block_size": setup.block_size,
        "enable_prefix_caching": setup.enable_caching,
        "num_gpu_blocks_override": setup.num_blocks,
        "cache_dtype": setup.kv_cache_dtype,
    }
    if setup.retention_interval != DEFAULT:
        cache["prefix_cache_retention_interval"] = setup.retention_interval
    parallel = ParallelConfig(
        tensor_parallel_size=setup.tensor_parallel_size,
        pipeline_parallel_size=setup.pipeline_parallel_size,
        decode_context_parallel_size=setup.decode_context_parallel_size,
        distributed_executor_backend=executor_class(setup),
    )
    speculative = None
    if setup.num_speculative_tokens:
        drafter: dict[str, Any] = (
            {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
            if setup.speculative_method == "ngram"
            else {"model": _model_dir()}
        )
        speculative = SpeculativeConfig(
            method=setup.speculative_method,
            num_speculative_tokens=setup.num_speculative_tokens,
            target_model_config=model,
            target_parallel_config=parallel,
            disable_lookahead_block_hashes=setup.disable_lookahead_block_hashes,
            **drafter,
        )
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=model,
        cache_config=CacheConfig(**cache),
        scheduler_config=scheduler,
        parallel_config=parallel,
        speculative_config=speculative,
        lora_config=LoRAConfig(max_loras=2, max_lora_rank=8) if setup.lora else None,
        kv_events_config=events,
        kv_transfer_config=(
            KVTransferConfig(**setup.kv_transfer) if setup.kv_transfer is not None else None
        ),
        additional_config=additional_config or {},
    )


# ----------------------------------------------------------------------------- executor
def token_at(request_id: str, position: int) -> int:
    """The token the simulated model samples for ``request_id`` at ``position``."""
    return zlib.crc32(f"{request_id}/{position}".encode()) % VOCAB


class SimulatedWorker:
    """One rank of the simulated model: its layers' specs and memory, and a token sampler.

    Answers the worker methods EngineCore reaches through ``collective_rpc``.
    """

    def __init__(self, vllm_config: Any, rank: int, setup: Setup) -> None:
        self.vllm_config = vllm_config
        self.rank = rank
        self.setup = setup
        self.kv_cache_config: Any = None
        self.layout: tuple[str, int] | None = None
        self._prompt_lengths: dict[str, int] = {}
        self._pending: Any = None
        # Speculative decoding: the requests that sampled in the last step -> their length,
        # the drafts proposed for them, each request's computed and known token counts.
        self._drafts_for: dict[str, int] = {}
        self._proposed: dict[str, list[int]] = {}
        self._computed: dict[str, int] = {}
        self._length: dict[str, int] = {}
        # The rank whose output the executor returns moves the KV (one per engine).
        world = vllm_config.parallel_config.world_size
        connector = (setup.kv_transfer or {}).get("kv_connector")
        self.nixl: SimulatedNixl | None = (
            SimulatedNixl(vllm_config, setup.fabric)
            if setup.kv_transfer is not None
            and connector != "OffloadingConnector"
            and rank == world - 1
            else None
        )
        # vLLM's OffloadingConnector: its worker side finishes each step's jobs in the step.
        self.offload: Any = None
        if connector == "OffloadingConnector" and rank == world - 1:
            from _offload_sim import SimulatedOffloading

            self.offload = SimulatedOffloading()
        self._connector_output: Any = None

    def _layers(self) -> range:
        parallel = self.vllm_config.parallel_config
        stage = self.rank // parallel.tensor_parallel_size
        per_stage = NUM_LAYERS // parallel.pipeline_parallel_size
        return range(stage * per_stage, (stage + 1) * per_stage)

    def get_kv_cache_spec(self) -> dict[str, Any]:
        """This rank's attention layers (KV heads divided by tensor parallelism, replicated
        when there are more ranks than heads, as vLLM replicates them)."""
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        config = self.vllm_config
        attn: dict[str, Any] = {
            "block_size": config.cache_config.block_size,
            "num_kv_heads": max(1, NUM_KV_HEADS // config.parallel_config.tensor_parallel_size),
            "head_size": HEAD_SIZE,
            "dtype": torch.float16,
        }
        cache_dtype = config.cache_config.cache_dtype
        if cache_dtype != "auto":  # what an attention layer reports for a quantized cache
            from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
            from vllm.v1.kv_cache_interface import get_kv_quant_mode

            attn["dtype"] = STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
            attn["kv_quant_mode"] = get_kv_quant_mode(cache_dtype)
        specs: dict[str, Any] = {}
        for layer in self._layers():
            name = f"model.layers.{layer}.self_attn.attn"
            if self.setup.sliding_window and layer % 2 == 1:
                specs[name] = SlidingWindowSpec(
                    **{**attn, "dtype": getattr(torch, self.setup.sliding_window_dtype)},
                    sliding_window=self.setup.sliding_window,
                )
            else:
                specs[name] = FullAttentionSpec(**attn)
        return specs

    def get_supported_kv_cache_layouts(self) -> list[str]:
        """The layouts this rank's (simulated) attention backend takes, preferred first."""
        return ["LBNHC", "LBHNC"]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None:
        """Remember the layout EngineCore resolved."""
        self.layout = (layout_name, cp_kv_cache_interleave_size)

    def determine_available_memory(self) -> int:
        """Bytes for ``setup.memory_blocks`` pages of every layer this rank holds."""
        specs = self.get_kv_cache_spec().values()
        return self.setup.memory_blocks * sum(spec.page_size_bytes for spec in specs)

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        """Take this rank's planned KV-cache config (no tensors are allocated)."""
        self.kv_cache_config = kv_cache_configs[self.rank]

    def compile_or_warm_up_model(self) -> Any:
        """Nothing to compile."""
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        """Text generation only."""
        return ("generate",)

    def update_max_model_len(self, max_model_len: int) -> None:
        """EngineCore's auto-fit shrank the model length (not used by the simulation)."""
        del max_model_len

    def execute_model(self, scheduler_output: Any) -> Any:
        """Run the forward pass: remember the batch, ``sample_tokens`` answers (vLLM's split);
        an empty batch answers at once with vLLM's empty output, as its model runner does."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        if self.nixl is not None:
            # The connector's worker side runs every step, a batch or not (vLLM's runner).
            self._connector_output = self.nixl.step(scheduler_output.kv_connector_metadata)
        elif self.offload is not None:
            self._connector_output = self.offload.step(scheduler_output.kv_connector_metadata)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._forget(scheduler_output.finished_req_ids)
            output, self._connector_output = self._connector_output, None
            if output is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return dataclasses.replace(EMPTY_MODEL_RUNNER_OUTPUT, kv_connector_output=output)
        self._pending = scheduler_output
        return None

    def _forget(self, finished_req_ids: set[str]) -> None:
        for req_id in finished_req_ids:
            self._prompt_lengths.pop(req_id, None)
            self._computed.pop(req_id, None)
            self._length.pop(req_id, None)
            self._proposed.pop(req_id, None)

    def sample_tokens(self, grammar_output: Any) -> Any:
        """One token per request whose scheduled chunk reaches the end of its known tokens."""
        from vllm.v1.outputs import ModelRunnerOutput

        del grammar_output
        output, self._pending = self._pending, None
        self._forget(output.finished_req_ids)
        known: dict[str, tuple[int, int]] = {}
        for new in output.scheduled_new_reqs:
            self._prompt_lengths[new.req_id] = len(new.prompt_token_ids)
            known[new.req_id] = (new.num_computed_tokens, len(new.prompt_token_ids))
        cached = output.scheduled_cached_reqs
        for req_id, computed, num_output in zip(
            cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens, strict=True
        ):
            known[req_id] = (computed, self._prompt_lengths[req_id] + num_output)
        req_ids = list(output.num_scheduled_tokens)
        if self.setup.num_speculative_tokens:
            sampled = self._verify_drafts(output, known)
        else:
            sampled = []
            for req_id in req_ids:
                computed, num_tokens = known[req_id]
                end = computed + output.num_scheduled_tokens[req_id]
                sampled.append([token_at(req_id, end)] if end >= num_tokens else [])
        connector_output, self._connector_output = self._connector_output, None
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=connector_output,
        )

    def _verify_drafts(self, output: Any, known: dict[str, tuple[int, int]]) -> list[list[int]]:
        # Speculative decoding: the worker keeps each request's computed and known token
        # counts itself (under async scheduling the scheduler's are optimistic until it has
        # processed the previous step's rejections, as vLLM's model runner corrects them) and
        # the drafts it proposed (async scheduling schedules placeholders, -1, for them).
        resumed = output.scheduled_cached_reqs.resumed_req_ids
        for req_id, (computed, num_tokens) in known.items():
            if req_id not in self._computed or req_id in resumed:
                self._computed[req_id], self._length[req_id] = computed, num_tokens
        sampled = []
        self._drafts_for = {}
        for req_id, num_scheduled in output.num_scheduled_tokens.items():
            computed, length = self._computed[req_id], self._length[req_id]
            drafts = list(output.scheduled_spec_decode_tokens.get(req_id, ()))
            proposed = self._proposed.pop(req_id, [])
            for i, draft in enumerate(drafts):
                if draft < 0:  # a placeholder: this worker's own proposal, or a miss
                    right = token_at(req_id, length + i)
                    drafts[i] = proposed[i] if i < len(proposed) else (right + 1) % VOCAB
            tokens: list[int] = []
            end = computed + num_scheduled - len(drafts)
            if end >= length:
                # The target model verifies the drafts in order: each sampled token is the
                # model's own; the first draft that differs ends the accepted run.
                for index in range(len(drafts) + 1):
                    tokens.append(token_at(req_id, length + index))
                    if index == len(drafts) or drafts[index] != tokens[-1]:
                        break
                self._length[req_id] = length + len(tokens)
                self._drafts_for[req_id] = length + len(tokens)
            rejected = len(drafts) - max(len(tokens) - 1, 0) if tokens else 0
            self._computed[req_id] = computed + num_scheduled - rejected
            sampled.append(tokens)
        for req_id, length in self._drafts_for.items():
            self._proposed[req_id] = self._draft(req_id, length)
        return sampled

    def _draft(self, req_id: str, length: int) -> list[int]:
        # The simulated drafter: 0 to k tokens, a deterministic function of the request and
        # its length, right up to a deterministic miss (or all right).
        k = self.setup.num_speculative_tokens
        seed = zlib.crc32(f"draft/{req_id}/{length}".encode())
        count = seed % (k + 1)
        miss = (seed // (k + 1)) % (2 * k + 1)  # >= count: every draft right
        return [(token_at(req_id, length + i) + (i == miss)) % VOCAB for i in range(count)]

    def take_draft_token_ids(self) -> Any:
        """The simulated drafter's proposals for the requests that just sampled (see
        ``_draft``): 0 to ``num_speculative_tokens`` tokens each, some the model's own next
        tokens and some not, so steps accept every draft, a part, or none. EngineCore asks
        only without async scheduling; with it the worker fills the scheduler's placeholders."""
        from vllm.v1.outputs import DraftTokenIds

        if not self._drafts_for:
            return None
        req_ids = sorted(self._drafts_for)
        self._drafts_for = {}
        drafts = [self._proposed[req_id] for req_id in req_ids]
        return DraftTokenIds(req_ids=req_ids, draft_token_ids=drafts)

    def shutdown(self) -> None:
        """Nothing to release."""


class TransferFabric:
    """The wire between simulated engines' NIXL workers, deterministic and test-driven.

    Time is the driver's turn (``now``, set before each turn): a pull takes ``pull_turns``
    turns, and a lease of ``s`` seconds (``kv_lease_duration``, a heartbeat's extension) lasts
    ``s / seconds_per_turn`` turns. ``failures[req_id]`` makes the decode side's pull for
    ``req_id`` fail: ``"fail"`` (the whole load fails, as a NIXL transfer error reports it) or
    an index (the blocks from that one on come back invalid). ``log`` keeps what happened,
    ``(turn, event, engine_id, req_id)``.
    """

    def __init__(self, pull_turns: int = 1, seconds_per_turn: float = 1.0) -> None:
        self.now = 0
        self.pull_turns = pull_turns
        self.seconds_per_turn = seconds_per_turn
        self.failures: dict[str, str | int] = {}
        self.log: list[tuple[int, str, str, str]] = []
        self._notifs: dict[str, list[str]] = {}
        self._heartbeats: dict[str, set[str]] = {}
        # (engine id, request id) -> the turn the engine's lease on the request's blocks ends.
        self.deadlines: dict[tuple[str, str], int] = {}
        # Engines that died: pulls from them fail, notifications to them are lost.
        self.dead: set[str] = set()

    def notify(self, engine_id: str, request_id: str) -> None:
        """Tell the producer ``engine_id`` its request's blocks were read (or are not needed)."""
        self._notifs.setdefault(engine_id, []).append(request_id)

    def heartbeat(self, engine_id: str, request_ids: set[str]) -> None:
        """A consumer renews the leases of ``request_ids`` on ``engine_id``."""
        self._heartbeats.setdefault(engine_id, set()).update(request_ids)

    def take(self, engine_id: str) -> tuple[list[str], set[str]]:
        """The notifications and heartbeats addressed to ``engine_id`` since its last step."""
        return self._notifs.pop(engine_id, []), self._heartbeats.pop(engine_id, set())

    def turns(self, seconds: float) -> int:
        """``seconds`` of wall time in turns."""
        return max(0, round(seconds / self.seconds_per_turn))


class SimulatedNixl:
    """The worker side of vLLM's pull-mode ``NixlConnector``, over a :class:`TransferFabric`.

    What the scheduler side hands the workers each step (``NixlConnectorMetadata``) is acted
    on as NIXL's workers act on it: a consumer pulls the blocks of each request to receive and
    reports it in ``finished_recving`` (a failed pull also in ``failed_recving`` and its blocks
    in ``invalid_block_ids``), then notifies the producer, whose worker reports the request in
    ``finished_sending``; a full local hit or an abort only notifies. A producer keeps each
    finished request's blocks until notified or until its lease (renewed by heartbeats) runs
    out, then reports it in ``finished_sending``.
    """

    def __init__(self, vllm_config: Any, fabric: TransferFabric) -> None:
        transfer = vllm_config.kv_transfer_config
        self.engine_id: str = transfer.engine_id
        self.fabric = fabric
        self.lease_s = float(transfer.get_from_extra_config("kv_lease_duration", 30))
        self._recving: dict[str, tuple[int, Any]] = {}
        # A model of several KV-cache groups (a hybrid one): NIXL reports a failed pull in
        # failed_recving only (block ids are not unique across groups), never partly.
        self.hma_required = False
        self._to_process: set[str] = set()
        self._to_send: dict[str, int] = {}

    def step(self, metadata: Any) -> Any:
        """Act on the step's metadata; answer what finished (``KVConnectorOutput``) or None."""
        from vllm.v1.outputs import KVConnectorOutput

        fabric = self.fabric
        now = fabric.now
        if metadata is not None:
            self._start(metadata, now)
        notifs, heartbeats = fabric.take(self.engine_id)
        for req_id in heartbeats:
            if req_id in self._to_send:
                self._hold(req_id, max(self._to_send[req_id], now + fabric.turns(self.lease_s)))
        sending: set[str] = set()
        for req_id in notifs:
            if req_id in self._to_send or req_id in self._to_process:
                self._to_process.discard(req_id)
                self._to_send.pop(req_id, None)
                sending.add(req_id)
                fabric.log.append((now, "read", self.engine_id, req_id))
            else:
                fabric.log.append((now, "read-after-expiry", self.engine_id, req_id))
        for req_id, deadline in list(self._to_send.items()):
            if now >= deadline:
                del self._to_send[req_id]
                self._to_process.discard(req_id)
                sending.add(req_id)
                fabric.log.append((now, "lease-expired", self.engine_id, req_id))
        recving, failed, invalid = self._finish_pulls(now)
        output = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            invalid_block_ids=invalid,
            failed_recving=failed,
        )
        return None if output.is_empty() else output

    def _start(self, metadata: Any, now: int) -> None:
        fabric = self.fabric
        for req_id, meta in metadata.reqs_to_recv.items():
            remote = meta.remote
            if meta.awaiting_kvs or any(meta.local_block_ids):
                self._recving[req_id] = (now + fabric.pull_turns, meta)
                deadline = fabric.deadlines.get((remote.engine_id, remote.request_id))
                if deadline is not None and now >= deadline:
                    # NIXL declines a read of blocks whose holder's lease (a decode engine's
                    # TTL under bidirectional transfers) ran out: a failed load.
                    fabric.failures[req_id] = "fail"
                    fabric.log.append((now, "declined-expired", self.engine_id, req_id))
                    continue
                fabric.log.append((now, "pull", self.engine_id, req_id))
            else:
                # A full local hit or an abort: the producer may free its blocks.
                fabric.notify(remote.engine_id, remote.request_id)
                fabric.log.append((now, "release", self.engine_id, req_id))
        self._to_process |= set(metadata.reqs_in_batch)
        self._to_process -= set(metadata.reqs_not_processed)
        for req_id, expiry in metadata.reqs_to_send.items():
            if req_id in self._to_process:
                self._hold(req_id, now + fabric.turns(expiry - metadata.scheduler_clock))
        for engine_id, info in metadata.heartbeat_by_engine.items():
            fabric.heartbeat(engine_id, set(info.req_ids))

    def _hold(self, req_id: str, deadline: int) -> None:
        self._to_send[req_id] = deadline
        self.fabric.deadlines[(self.engine_id, req_id)] = deadline

    def _finish_pulls(self, now: int) -> tuple[set[str], set[str], set[int]]:
        fabric = self.fabric
        recving: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        for req_id, (done, meta) in list(self._recving.items()):
            if now < done:
                continue
            del self._recving[req_id]
            recving.add(req_id)
            failure = fabric.failures.get(req_id)
            if meta.remote.engine_id in fabric.dead:
                failure = "fail"  # the source engine is gone with its blocks
            blocks = list(meta.local_block_ids[0]) if meta.local_block_ids else []
            if self.hma_required and failure is not None:
                failure = "fail"
                blocks = []
            if failure == "fail":
                # NIXL's worker: the request fails, its blocks are invalid, and the
                # producer is not notified (its lease reclaims the blocks).
                failed.add(req_id)
                invalid.update(blocks)
                fabric.log.append((now, "pull-failed", self.engine_id, req_id))
                continue
            if isinstance(failure, int):
                invalid.update(blocks[failure:])
                fabric.log.append((now, "pull-partly-invalid", self.engine_id, req_id))
            else:
                fabric.log.append((now, "pulled", self.engine_id, req_id))
            fabric.notify(meta.remote.engine_id, meta.remote.request_id)
        return recving, failed, invalid


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


@cache
def _executor_base() -> type:
    from vllm.v1.executor.abstract import Executor

    class SimulatedExecutor(Executor):
        """vLLM's ``Executor`` over one :class:`SimulatedWorker` per rank."""

        supports_pp = True
        setup = Setup()

        def _init_executor(self) -> None:
            world = self.vllm_config.parallel_config.world_size
            self.workers = [SimulatedWorker(self.vllm_config, r, self.setup) for r in range(world)]
            # The batches the engine ran since Engine.take_scheduled last drained them (a
            # turn runs at most one; bounded for callers that never drain).
            self.scheduled: deque[Any] = deque(maxlen=16)

        def collective_rpc(  # type: ignore[override]
            self,
            method: Any,
            timeout: float | None = None,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
            non_block: bool = False,
        ) -> Any:
            del timeout
            kwargs = kwargs or {}
            try:
                results = [
                    method(worker, *args, **kwargs)
                    if callable(method)
                    else getattr(worker, method)(*args, **kwargs)
                    for worker in self.workers
                ]
            except Exception as exc:
                if not non_block:
                    raise
                failed: Future[Any] = Future()
                failed.set_exception(exc)
                return failed
            return _done(results) if non_block else results

        def execute_model(  # type: ignore[override]
            self, scheduler_output: Any, non_block: bool = False
        ) -> Any:
            self.scheduled.append(scheduler_output)
            return self._driver("execute_model", scheduler_output, non_block)

        def sample_tokens(  # type: ignore[override]
            self, grammar_output: Any, non_block: bool = False
        ) -> Any:
            return self._driver("sample_tokens", grammar_output, non_block)

        def _driver(self, method: str, argument: Any, non_block: bool) -> Any:
            # The output rank's answer (vLLM's last pipeline stage samples; every simulated
            # rank samples the same tokens).
            results = self.collective_rpc(method, args=(argument,))
            return _done(results[-1]) if non_block else results[-1]

        @classmethod
        def supports_async_scheduling(cls) -> bool:
            return True

        def check_health(self) -> None:
            return None

        def get_kv_connector_handshake_metadata(self) -> list[dict[Any, Any]]:
            # Simulated workers register no NIXL agent: nothing to serve, so the
            # connector's scheduler side opens no handshake listener.
            return []

        def shutdown(self) -> None:
            self.collective_rpc("shutdown")

    return SimulatedExecutor


def executor_class(setup: Setup) -> type:
    """The simulated executor class for ``setup`` (vLLM instantiates it with the config)."""
    return type("SimulatedExecutor", (_executor_base(),), {"setup": setup})


# ----------------------------------------------------------------------------- engine
class Engine:
    """vLLM's ``EngineCore`` and how to feed and step it.

    Attributes:
        core: vLLM's ``EngineCore``.
        setup: What it was built from.
    """

    def __init__(self, core: Any, setup: Setup) -> None:
        self.core = core
        self.setup = setup

    @property
    def scheduler(self) -> Any:
        """The scheduler EngineCore built."""
        return self.core.scheduler

    def add(self, plan: RequestPlan) -> None:
        """Add a request as the engine's input thread does (the engine's block hasher)."""
        request, wave = self.core.preprocess_add_request(_engine_request(plan))
        self.core.add_request(request, wave)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (the client's abort)."""
        self.core.abort_requests(request_ids)

    def step(self) -> tuple[dict[int, Any] | None, bool]:
        """One turn of the engine's busy loop: ``step()`` or ``step_with_batch_queue()``, then
        ``post_step`` (the draft tokens the executor proposed go to the scheduler)."""
        outputs, executed = self.core.step_fn()
        self.core.post_step(executed)
        return outputs, executed

    def has_work(self) -> bool:
        """Requests left, or batches in flight."""
        return bool(self.core.scheduler.has_requests() or self.core.batch_queue)

    def take_scheduled(self) -> list[Any]:
        """The ``SchedulerOutput`` of every batch the engine ran since the last call."""
        scheduled = self.core.model_executor.scheduled
        batches = list(scheduled)
        scheduled.clear()
        return batches

    def take_events(self) -> list[Any]:
        """KV events the scheduler published since the last call."""
        return self.core.scheduler.kv_event_publisher.take()

    def shutdown(self) -> None:
        """EngineCore's shutdown: the executor's, the scheduler's, the GC heap unfrozen."""
        try:
            self.core.shutdown()
        except RuntimeError as exc:
            # Its last act frees accelerator memory, which a CPU machine has none of;
            # everything before it (the scheduler's shutdown included) has run.
            if "accelerator" not in str(exc):
                raise


def build_engine(setup: Setup, scheduler_cls: Any = None, additional_config: Any = None) -> Engine:
    """vLLM's ``EngineCore`` for ``setup`` (``scheduler_cls`` None: vLLM's own scheduler)."""
    from vllm.v1.engine.core import EngineCore

    config = vllm_config(setup, scheduler_cls, additional_config)
    core = EngineCore(config, config.parallel_config.distributed_executor_backend, setup.log_stats)
    return Engine(core, setup)


# ----------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class RequestPlan:
    """One request of the workload."""

    arrival_step: int
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    lora: int = 0
    cache_salt: str | None = None
    abort_step: int = -1
    kv_transfer_params: dict[str, Any] | None = None
    report_full: bool = False
    resumable: bool = False
    """A streaming-input session's request: a later plan with the same ``request_id`` is its
    next input chunk (resumable) or ends the session (not resumable), as vLLM's client sends
    them."""


def plan_streaming_session(seed: int = 3) -> list[RequestPlan]:
    """A streaming-input session beside other requests: ``session``'s first chunk, two more
    (one applied when it pauses, one queued behind it), then its end; ``sharer`` shares the
    first chunk's prefix, ``late`` the whole first chunk."""
    rng = random.Random(seed)

    def tokens(count: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(count))

    first = tokens(40)
    return [
        RequestPlan(0, "session", first, 5, resumable=True),
        RequestPlan(1, "sharer", first[:32] + tokens(20), 30),
        RequestPlan(14, "session", tokens(23), 6, resumable=True),  # applied when it pauses
        RequestPlan(16, "session", tokens(17), 4, resumable=True),  # queued behind it
        RequestPlan(40, "session", tokens(5), 3),  # not resumable: the session ends
        RequestPlan(45, "late", first + tokens(8), 4),
    ]


def plan_workload(
    seed: int, num_requests: int, setup: Setup, mean_prompt: int = 160
) -> list[RequestPlan]:
    """A seeded mix: shared prefixes (hits), long prompts (chunking), LoRA, salts, aborts."""
    rng = random.Random(seed)
    prefixes = [
        tuple(rng.randrange(VOCAB) for _ in range(rng.choice((32, 48, 64, 100)))) for _ in range(4)
    ]
    plans = []
    step = 0
    for index in range(num_requests):
        step += rng.choice((0, 0, 1, 1, 2, 3))
        prefix = rng.choice(prefixes) if rng.random() < 0.7 else ()
        length = max(1, int(rng.expovariate(1 / mean_prompt)))
        prompt = prefix + tuple(rng.randrange(VOCAB) for _ in range(length))
        prompt = prompt[: setup.max_model_len // 2]
        plans.append(
            RequestPlan(
                arrival_step=step,
                request_id=f"r{index}",
                prompt=prompt,
                max_tokens=rng.choice((1, 4, 16, 40, 80)),
                lora=rng.choice((0, 0, 1, 2)) if setup.lora else 0,
                cache_salt=rng.choice((None, None, None, "tenant-a")),
                abort_step=step + rng.randrange(1, 30) if rng.random() < 0.08 else -1,
                # Drawn only when on, so the other workloads keep their random streams.
                report_full=bool(setup.report_full) and rng.random() < setup.report_full,
            )
        )
    return plans


def _extra_args(plan: RequestPlan) -> dict[str, Any] | None:
    extra: dict[str, Any] = {}
    if plan.kv_transfer_params is not None:
        # A copy: vLLM's connector rewrites the request's parameters in place.
        extra["kv_transfer_params"] = dict(plan.kv_transfer_params)
    if plan.report_full:
        extra["kv_cache_report_mode"] = "full"
    return extra or None


def _engine_request(plan: RequestPlan) -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    lora = (
        LoRARequest(f"adapter-{plan.lora}", plan.lora, f"/adapters/{plan.lora}")
        if plan.lora
        else None
    )
    return EngineCoreRequest(
        request_id=plan.request_id,
        prompt_token_ids=list(plan.prompt),
        mm_features=None,
        sampling_params=SamplingParams(
            max_tokens=plan.max_tokens,
            ignore_eos=True,
            # A copy: vLLM's connector rewrites the request's parameters in place.
            extra_args=_extra_args(plan),
        ),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=lora,
        cache_salt=plan.cache_salt,
        data_parallel_rank=None,
        resumable=plan.resumable,
    )


# ----------------------------------------------------------------------------- running
def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as nested plain data (timestamps and opaque objects dropped)."""
    if depth > 8:
        return "..."
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple, deque)):
        return [plain(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return {
            str(k): plain(v, depth + 1) for k, v in sorted(value.items(), key=lambda i: str(i[0]))
        }
    names: tuple[str, ...] = ()
    if dataclasses.is_dataclass(value):
        names = tuple(f.name for f in dataclasses.fields(value))
    elif hasattr(value, "__struct_fields__"):
        names = tuple(value.__struct_fields__)
    if names:
        return {
            name: plain(getattr(value, name), depth + 1)
            for name in names
            if "time" not in name and name not in {"ts", "sampling_params", "pooling_params"}
        }
    if hasattr(value, "value") and hasattr(value, "name"):  # enums
        return str(value.name)
    return type(value).__name__


@dataclass(frozen=True)
class StepRecord:
    """One turn of the engine loop.

    Attributes:
        step: The turn's index.
        scheduled: The ``SchedulerOutput`` of each batch the turn ran (block ids included).
        outputs: ``EngineCoreOutputs`` per client index (``None``: the batch queue only
            scheduled), stats included; plain values when recorded.
        executed: Whether the model ran.
        events: KV events published in the turn (plus a prefix-cache reset's answer).
    """

    step: int
    scheduled: Any
    outputs: Any
    executed: bool
    events: Any


def run(
    engine: Engine,
    plans: list[RequestPlan],
    *,
    record: bool = True,
    max_steps: int = 20000,
    resets: dict[int, bool] | None = None,
) -> Iterator[StepRecord]:
    """Drive ``engine`` through ``plans`` until every request finished.

    Before turn ``n``, the requests arriving at ``n`` are added and those aborted at ``n``
    are aborted; ``resets`` maps a turn to ``reset_prefix_cache(reset_running_requests)``,
    whose answer joins the turn's events. Values are plain data when ``record``.
    """
    resets = resets or {}
    arrivals: dict[int, list[RequestPlan]] = {}
    aborts: dict[int, list[str]] = {}
    for plan in plans:
        arrivals.setdefault(plan.arrival_step, []).append(plan)
        if plan.abort_step >= 0:
            aborts.setdefault(plan.abort_step, []).append(plan.request_id)
    last_arrival = max(arrivals, default=0)
    core = engine.core
    for step in range(max_steps):
        for plan in arrivals.get(step, ()):
            engine.add(plan)
        live = [rid for rid in aborts.get(step, ()) if rid in core.scheduler.requests]
        if live:
            engine.abort(live)
        reset = None
        if step in resets:
            reset = core.reset_prefix_cache(reset_running_requests=resets[step])
        outputs, executed = engine.step()
        scheduled = engine.take_scheduled()
        events = engine.take_events()
        if reset is not None:
            events = [*events, ("reset_prefix_cache", reset)]
        if record:
            yield StepRecord(step, plain(scheduled), plain(outputs), executed, plain(events))
        else:
            yield StepRecord(step, scheduled, outputs, executed, events)
        if step >= last_arrival and not engine.has_work():
            return


# ----------------------------------------------------------------------------- comparing
@dataclass
class Tally:
    """What a compared run covered."""

    turns: int = 0
    batches: int = 0
    events: int = 0
    preempted: int = 0
    hits: int = 0
    finished: int = 0
    zeroed: int = 0
    prefix_stats: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"requests": 0, "queries": 0, "hits": 0}
    )


def _count(tally: Tally, record: StepRecord) -> None:
    tally.turns += 1
    tally.batches += len(record.scheduled)
    tally.events += len(record.events)
    for batch in record.scheduled:
        tally.preempted += len(batch["preempted_req_ids"] or ())
        tally.hits += sum(r["num_computed_tokens"] > 0 for r in batch["scheduled_new_reqs"])
        tally.zeroed += len(batch["new_block_ids_to_zero"] or ())
    for outputs in (record.outputs or {}).values():
        tally.finished += sum(o["finish_reason"] is not None for o in outputs["outputs"])
        stats = (outputs["scheduler_stats"] or {}).get("prefix_cache_stats") or {}
        for name in tally.prefix_stats:
            tally.prefix_stats[name] += int(stats.get(name) or 0)


def assert_same_runs(
    reference: Engine,
    mirrored: Engine,
    plans: list[RequestPlan],
    *,
    resets: dict[int, bool] | None = None,
    max_steps: int = 20000,
    after_turn: Any = None,
) -> Tally:
    """Run both engines on ``plans`` turn by turn; every turn's batches (``SchedulerOutput``),
    ``EngineCoreOutputs`` (``SchedulerStats`` included) and KV events must be equal.

    ``after_turn(turns_done, mirrored)`` runs after each compared turn (faults, checks).
    """
    tally = Tally()
    for expected, actual in zip(
        run(reference, plans, resets=resets, max_steps=max_steps),
        run(mirrored, plans, resets=resets, max_steps=max_steps),
        strict=True,
    ):
        turn = expected.step
        assert actual.scheduled == expected.scheduled, f"turn {turn}: SchedulerOutput differs"
        assert actual.outputs == expected.outputs, f"turn {turn}: EngineCoreOutputs differ"
        assert actual.executed == expected.executed, f"turn {turn}: model execution differs"
        assert actual.events == expected.events, f"turn {turn}: KV events differ"
        _count(tally, expected)
        if after_turn is not None:
            after_turn(tally.turns, mirrored)
    return tally


def workload_scale() -> int:
    """How many times the CI workloads to run: 1, or ``KVCM_LONG`` (``1``: 4x; ``n``: n x)."""
    value = os.environ.get("KVCM_LONG", "0")
    scale = int(value) if value.isdigit() else 1
    return 4 if scale == 1 else max(scale, 1)
