"""RemoteKVCacheManager answers what the in-process core answers for vLLM's call pattern.

A small vLLM-shaped scheduler drives two managers side by side with the same calls: the remote
one (over a real server) and kvcm's in-process ``KVCacheManager``. Every answer (hits, new
blocks, "does not fit", block tables, usage, events) must be the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from workload import TraceRequest, WorkloadOptions, make_workload

from kvcm.client import KVCacheBlocks, PoolConfig, RemoteKVCacheManager, SchedulerClient
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.errors import NotFoundError
from kvcm.common.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcm.common.specs import FullAttentionSpec
from kvcm.core import KVCacheBlocks as CoreBlocks
from kvcm.core import KVCacheManager, KVCacheManagerConfig, Request, RequestStatus

MAX_MODEL_LEN = 4096
BUDGET = 768


def _layout(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("layer.0",), kv_cache_spec=spec),),
    )


@dataclass
class _Pair:
    """One trace request as both managers see it (two records, updated alike)."""

    trace: TraceRequest
    remote: Request
    local: Request
    num_output: int = 0

    @property
    def both(self) -> tuple[Request, Request]:
        return self.remote, self.local


@dataclass
class _Scheduler:
    remote: RemoteKVCacheManager
    local: KVCacheManager
    batched: bool
    waiting: list[_Pair] = field(default_factory=list)
    running: list[_Pair] = field(default_factory=list)
    preemptions: int = 0
    admitted: int = 0
    checks: int = 0

    def _same(self, remote: object, local: object, what: str) -> None:
        assert remote == local, what
        self.checks += 1

    def step(self) -> None:
        self.remote.new_step_starts()
        self.local.new_step_starts()
        budget = self._running(BUDGET)
        self._waiting(budget)
        self._sample()

    def _running(self, budget: int) -> int:
        if self.batched:
            return self._running_batched(budget)
        index = 0
        while index < len(self.running):
            pair = self.running[index]
            num_new = min(pair.local.num_tokens - pair.local.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            remote = self.remote.allocate_slots(pair.remote, num_new)
            local = self.local.allocate_slots(pair.local, num_new)
            self._same_blocks(remote, local, pair)
            if remote is None:
                if not self._preempt_last(pair):
                    return budget
                continue  # retry the same request
            self._advance(pair, num_new)
            budget -= num_new
            index += 1
        return budget

    def _running_batched(self, budget: int) -> int:
        # The same decisions, with the rest of the running requests in one Step each time.
        start = 0
        while True:
            plan = []
            left = budget
            for pair in self.running[start:]:
                num_new = min(pair.local.num_tokens - pair.local.num_computed_tokens, left)
                if num_new > 0:
                    plan.append((pair, num_new))
                    left -= num_new
            if not plan:
                return budget
            answers = self.remote.allocate_slots_many(
                [pair.remote for pair, _ in plan], [num_new for _, num_new in plan]
            )
            failed = None
            for (pair, num_new), answer in zip(plan, answers, strict=False):
                self._same_blocks(answer, self.local.allocate_slots(pair.local, num_new), pair)
                if answer is None:
                    failed = pair
                    break
                self._advance(pair, num_new)
                budget -= num_new
            if failed is None:
                assert len(answers) == len(plan)
                return budget
            start = self.running.index(failed)
            if not self._preempt_last(failed):
                return budget

    def _same_blocks(
        self, remote: KVCacheBlocks | None, local: CoreBlocks | None, pair: _Pair
    ) -> None:
        self._same(
            None if remote is None else remote.get_block_ids(),
            None if local is None else local.get_block_ids(),
            f"allocation of {pair.trace.request_id}",
        )

    def _advance(self, pair: _Pair, num_new: int) -> None:
        for request in pair.both:
            request.num_computed_tokens += num_new

    def _preempt_last(self, failed: _Pair) -> bool:
        """Preempt the last running request; False when that was the failed one."""
        victim = self.running.pop()
        for request, manager in ((victim.remote, self.remote), (victim.local, self.local)):
            manager.free(request)  # status RUNNING: a preemption
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_preemptions += 1
        self.waiting.insert(0, victim)
        self.preemptions += 1
        return victim is not failed

    def _waiting(self, budget: int) -> None:
        while self.waiting and budget > 0:
            pair = self.waiting[0]
            remote_hit = self.remote.get_computed_blocks(pair.remote)
            local_hit = self.local.get_computed_blocks(pair.local)
            self._same(
                (remote_hit.blocks.get_block_ids(), remote_hit.num_computed_tokens),
                (local_hit.blocks.get_block_ids(), local_hit.num_computed_tokens),
                f"hit of {pair.trace.request_id}",
            )
            num_new = min(pair.local.num_tokens - local_hit.num_computed_tokens, budget)
            remote = self.remote.allocate_slots(
                pair.remote, num_new, remote_hit.num_computed_tokens, remote_hit.blocks
            )
            local = self.local.allocate_slots(pair.local, num_new, local_hit)
            self._same_blocks(remote, local, pair)
            if remote is None:
                return
            self.local.record_prefix_cache_stats(pair.local, local_hit.num_computed_tokens)
            for request in pair.both:
                request.num_computed_tokens = local_hit.num_computed_tokens + num_new
                request.status = RequestStatus.RUNNING
            self.waiting.pop(0)
            self.running.append(pair)
            self.admitted += 1
            budget -= num_new

    def _sample(self) -> None:
        for pair in list(self.running):
            if pair.local.num_computed_tokens < pair.local.num_tokens:
                continue
            token = pair.trace.output_token_ids[pair.num_output]
            pair.num_output += 1
            if pair.num_output == len(pair.trace.output_token_ids):
                self.running.remove(pair)
                for request, manager in ((pair.remote, self.remote), (pair.local, self.local)):
                    request.status = RequestStatus.FINISHED_STOPPED
                    manager.free(request)
                continue
            for request in pair.both:
                request.append_output_token_ids(token)


def _event_view(event: KVCacheEvent) -> tuple[object, ...]:
    if isinstance(event, BlockStored):
        return (
            "stored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.group_idx,
        )
    if isinstance(event, BlockRemoved):
        return ("removed", event.block_hashes, event.group_idx)
    assert isinstance(event, AllBlocksCleared)
    return ("cleared",)


@pytest.mark.parametrize("batched", [False, True], ids=["per-call", "allocate_slots_many"])
def test_remote_manager_answers_like_the_core(client: SchedulerClient, batched: bool) -> None:
    pool_id = f"remote-manager-{'batched' if batched else 'per-call'}"
    layout = _layout(num_blocks=360)
    client.create_pool(
        pool_id,
        PoolConfig(
            max_model_len=MAX_MODEL_LEN,
            explicit_layout=layout,
            hash_algorithm="sha256_cbor",
            enable_kv_cache_events=True,
        ),
    )
    remote = RemoteKVCacheManager(client, pool_id, last_step_seq=0)
    local = KVCacheManager(
        KVCacheManagerConfig(
            kv_cache_config=layout, max_model_len=MAX_MODEL_LEN, enable_kv_cache_events=True
        )
    )
    hasher = remote.block_hasher
    scheduler = _Scheduler(remote, local, batched)
    trace = make_workload(WorkloadOptions(num_requests=70, seed=5))
    events_remote: list[KVCacheEvent] = []
    events_local: list[KVCacheEvent] = []
    step = 0
    while trace or scheduler.waiting or scheduler.running:
        while trace and trace[0].arrival_step <= step:
            item = trace.pop(0)
            scheduler.waiting.append(
                _Pair(
                    item,
                    Request(item.request_id, list(item.prompt_token_ids), block_hasher=hasher),
                    Request(item.request_id, list(item.prompt_token_ids), block_hasher=hasher),
                )
            )
        scheduler.step()
        if step % 25 == 0 and scheduler.running:
            request_id = scheduler.running[0].trace.request_id
            assert remote.get_block_ids(request_id) == local.get_block_ids(request_id)
            assert remote.get_num_common_prefix_blocks(
                request_id
            ) == local.get_num_common_prefix_blocks(request_id)
            assert remote.usage == pytest.approx(local.usage)
            events_remote.extend(remote.take_events())
            events_local.extend(local.take_events())
        step += 1
    remote.flush()
    events_remote.extend(remote.take_events())
    events_local.extend(local.take_events())
    assert scheduler.admitted >= 70
    assert scheduler.preemptions > 0
    assert remote.usage == pytest.approx(local.usage)
    assert [_event_view(e) for e in events_remote] == [_event_view(e) for e in events_local]
    assert any(isinstance(e, BlockRemoved) for e in events_local)  # evictions happened
    assert remote.reset_prefix_cache() == local.reset_prefix_cache()
    stats = remote.make_prefix_cache_stats()
    assert stats is not None
    assert stats.hits > 0
    with pytest.raises(NotFoundError):
        remote.get_block_ids("never-seen")
    remote.close()
    client.delete_pool(pool_id)


def test_a_new_manager_gets_what_the_pool_cached_before_it(client: SchedulerClient) -> None:
    """The server decides, so a manager attaches to a pool in any state: a prefix an earlier
    manager cached is a hit for the next one (a fresh local copy of the pool, which a mirror
    would start from, has no such hit). Why this class is not the vLLM integration's mirror."""
    pool_id = "remote-manager-reattach"
    layout = _layout(num_blocks=64)
    client.create_pool(pool_id, PoolConfig(max_model_len=MAX_MODEL_LEN, explicit_layout=layout))
    prompt = list(range(1000, 1064))  # four full blocks
    with RemoteKVCacheManager(client, pool_id) as first:
        request = Request("first", prompt, block_hasher=first.block_hasher)
        assert first.allocate_slots(request, len(prompt)) is not None
        request.num_computed_tokens = len(prompt)
        request.status = RequestStatus.FINISHED_STOPPED
        first.free(request)
    with RemoteKVCacheManager(client, pool_id) as second:
        request = Request("second", [*prompt, 7, 8, 9], block_hasher=second.block_hasher)
        hit = second.get_computed_blocks(request)
        assert hit.num_computed_tokens == len(prompt)
        fresh = KVCacheManager(
            KVCacheManagerConfig(kv_cache_config=layout, max_model_len=MAX_MODEL_LEN)
        )
        local = Request("second", [*prompt, 7, 8, 9], block_hasher=second.block_hasher)
        assert fresh.get_computed_blocks(local).num_computed_tokens == 0
        blocks = second.allocate_slots(request, 3, hit.num_computed_tokens, hit.blocks)
        assert blocks is not None
        assert second.get_block_ids("second")[0][:4] == list(hit.blocks.get_block_ids()[0])
    client.delete_pool(pool_id)
