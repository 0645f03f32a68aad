"""A simulated vLLM 0.33 engine around its real Scheduler / AsyncScheduler, for kvcm's mirror.

Builds vLLM's ``VllmConfig`` on CPU from a tiny Llama ``config.json`` (nothing is downloaded),
a ``KVCacheConfig`` by hand (full attention, optionally a sliding-window group beside it), and
the scheduler exactly as ``EngineCore`` does (keywords only, ``scheduler_cls`` honoured). The
model step is simulated: every scheduled request that finished its prefill samples one token,
a deterministic function of the request id and the step. A seeded workload adds requests
(shared prefixes for prefix hits, LoRA adapters, cache salts, prompts long enough to chunk),
aborts a few, and runs until everything finished; every step's ``SchedulerOutput``, engine
outputs (stats included) and published KV events are reduced to plain values for comparison.

Used by tests/compat/test_vllm_scheduler.py and bench/vllm_scheduler.py. vLLM must already be
importable (tests/compat/conftest.py ``import_vllm``).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import tempfile
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

_SITE_HINT = "/root/.cache/kvcm/vllm-ref/lib/python3.11/site-packages"
VOCAB = 1000


@dataclass(frozen=True)
class Setup:
    """One scheduler configuration.

    Attributes:
        num_blocks: Blocks of the pool.
        block_size: Tokens per block.
        sliding_window: Add a sliding-window group of this window (0: full attention only).
        enable_caching: Prefix caching.
        async_scheduling: AsyncScheduler (True) or Scheduler.
        log_stats: Collect stats (prefix-cache stats in every engine output).
        max_num_seqs: Most running requests.
        max_num_batched_tokens: Token budget per step (chunked prefill).
        max_model_len: Longest sequence.
        lora: Configure LoRA (two adapters).
        watermark: Scheduler watermark.
    """

    num_blocks: int = 160
    block_size: int = 16
    sliding_window: int = 0
    enable_caching: bool = True
    async_scheduling: bool = False
    log_stats: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    lora: bool = False
    watermark: float = 0.0


@cache
def _model_dir() -> str:
    path = Path(tempfile.mkdtemp(prefix="kvcm-tiny-llama-"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
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


def vllm_config(setup: Setup, scheduler_cls: Any = None, additional_config: Any = None) -> Any:
    """vLLM's config for ``setup`` on CPU (``scheduler_cls``: None for vLLM's own)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        LoRAConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    _child_sees_vllm()
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
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=model,
        cache_config=CacheConfig(
            block_size=setup.block_size, enable_prefix_caching=setup.enable_caching
        ),
        scheduler_config=scheduler,
        lora_config=LoRAConfig(max_loras=2, max_lora_rank=8) if setup.lora else None,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        additional_config=additional_config or {},
    )


def kv_cache_config(setup: Setup) -> Any:
    """vLLM's KV-cache config: a full-attention group, and a sliding-window one if asked."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    attn = {
        "block_size": setup.block_size,
        "num_kv_heads": 2,
        "head_size": 8,
        "dtype": torch.float16,
    }
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn"], FullAttentionSpec(**attn))]
    if setup.sliding_window:
        groups.append(
            KVCacheGroupSpec(
                ["model.layers.1.self_attn"],
                SlidingWindowSpec(**attn, sliding_window=setup.sliding_window),
            )
        )
    return KVCacheConfig(num_blocks=setup.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


class _Recorder:
    # Stands in for the scheduler's KV event publisher and keeps what it would publish.
    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass

    def get_publisher_config(self) -> None:
        return None


def build_scheduler(setup: Setup, scheduler_cls: Any = None, additional_config: Any = None) -> Any:
    """Construct the scheduler as EngineCore does (``scheduler_cls`` None: vLLM's own)."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.structured_output import StructuredOutputManager

    config = vllm_config(setup, scheduler_cls, additional_config)
    kv_config = kv_cache_config(setup)
    config.cache_config.num_gpu_blocks = setup.num_blocks  # EngineCore sets it after profiling
    cls = config.scheduler_config.get_scheduler_cls()
    if scheduler_cls is None and setup.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        cls = AsyncScheduler
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
    scheduler = cls(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        include_finished_set=False,
        log_stats=setup.log_stats,
        block_size=block_size,
        hash_block_size=hash_block_size,
    )
    scheduler.kv_event_publisher = _Recorder()
    return scheduler


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
            )
        )
    return plans


def _make_request(plan: RequestPlan, hash_block_size: int) -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    lora = (
        LoRARequest(f"adapter-{plan.lora}", plan.lora, f"/adapters/{plan.lora}")
        if plan.lora
        else None
    )
    return Request(
        request_id=plan.request_id,
        prompt_token_ids=list(plan.prompt),
        sampling_params=SamplingParams(max_tokens=plan.max_tokens, ignore_eos=True),
        pooling_params=None,
        lora_request=lora,
        cache_salt=plan.cache_salt,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )


def _token(request_id: str, step: int) -> int:
    return zlib.crc32(f"{request_id}/{step}".encode()) % VOCAB


def _model_output(scheduler: Any, output: Any, step: int) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        partial = request is not None and request.num_computed_tokens < request.num_tokens
        sampled.append([] if partial else [_token(req_id, step)])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


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


@dataclass
class Trace:
    """What a run produced, one entry per step."""

    outputs: list[Any] = field(default_factory=list)
    engine: list[Any] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)


def run(
    scheduler: Any,
    plans: list[RequestPlan],
    *,
    record: bool = True,
    max_steps: int = 20000,
    resets: dict[int, bool] | None = None,
) -> Iterator[tuple[int, Any, Any, list[Any]]]:
    """Drive ``scheduler`` through ``plans``; yield (step, scheduler output, engine outputs,
    events) per step (plain values when ``record``).

    ``resets`` maps a step to a ``reset_prefix_cache(reset_running_requests=...)`` call made
    before that step's ``schedule()``; its answer is appended to the step's events.
    """
    resets = resets or {}
    by_step: dict[int, list[RequestPlan]] = {}
    for plan in plans:
        by_step.setdefault(plan.arrival_step, []).append(plan)
    aborts: dict[int, list[str]] = {}
    for plan in plans:
        if plan.abort_step >= 0:
            aborts.setdefault(plan.abort_step, []).append(plan.request_id)
    from vllm.v1.request import RequestStatus

    last_arrival = max(by_step, default=0)
    queue: deque[tuple[int, Any]] = deque()
    depth = 2 if _is_async(scheduler) else 1
    step = 0
    publisher = scheduler.kv_event_publisher
    while step < max_steps:
        for plan in by_step.get(step, ()):
            scheduler.add_request(_make_request(plan, scheduler.hash_block_size))
        for request_id in aborts.get(step, ()):
            if request_id in scheduler.requests:
                scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        reset = None
        if step in resets:
            reset = scheduler.reset_prefix_cache(reset_running_requests=resets[step])
        output = scheduler.schedule()
        queue.append((step, output))
        engine = None
        if len(queue) >= depth or output.total_num_scheduled_tokens == 0:
            done_step, done = queue.popleft()
            engine = scheduler.update_from_output(done, _model_output(scheduler, done, done_step))
        events = publisher.events
        publisher.events = []
        if reset is not None:
            events = [*events, ("reset_prefix_cache", reset)]
        if record:
            yield step, plain(output), plain(engine), plain(events)
        else:
            yield step, output, engine, events
        step += 1
        if step > last_arrival and not scheduler.has_requests():
            break
    while queue:
        done_step, done = queue.popleft()
        scheduler.update_from_output(done, _model_output(scheduler, done, done_step))


def _is_async(scheduler: Any) -> bool:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    return isinstance(scheduler, AsyncScheduler)
