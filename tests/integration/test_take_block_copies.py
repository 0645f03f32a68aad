"""TAKE_BLOCK_COPIES: sub-block prefix hits of a hybrid full attention + align-mode Mamba pool
(hash block 64 under blocks of 256), their copies drained where the program says, through a
real server over gRPC and in process, one step at a time, coalesced, and with a drain left for
a later Step (docs/mamba.md)."""

from __future__ import annotations

from collections.abc import Callable

from kvcm.client import PoolConfig, SchedulerClient, StepBuilder, StepResult
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.hashing import BlockHasher
from kvcm.common.specs import FullAttentionSpec, MambaSpec
from kvcm.core.pool import Pool
from kvcm.v1 import scheduler_pb2
from kvcm.wire import outcome_from_proto, outcome_to_proto

BLOCK = 256
HASH_BLOCK = 64
SHARED = list(range(1000, 1200))  # 200 tokens: the last hash boundary (192) inside block 0
OTHER = SHARED[:192] + list(range(5000, 5100))  # a hit of 192 tokens: a sub-block hit


def _config() -> PoolConfig:
    f16 = DType("float16")
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=f16)
    mamba = MambaSpec(
        block_size=BLOCK, shapes=((2, 4), (4,)), dtypes=(f16, f16), mamba_cache_mode="align"
    )
    groups = tuple(
        KVCacheGroupSpec(layer_names=(f"l{i}",), kv_cache_spec=spec)
        for i, spec in enumerate((full, mamba))
    )
    layout = KVCacheConfig(num_blocks=16, kv_cache_tensors=(), kv_cache_groups=groups)
    return PoolConfig(
        max_model_len=2048,
        explicit_layout=layout,
        hash_block_size=HASH_BLOCK,
        scheduler_block_size=BLOCK,
    )


def _steps(hashing: BlockHasher, *, drain_last: bool = True) -> list[Callable[[StepBuilder], None]]:
    # vLLM's scheduler's order: request A's prefill split at its tail boundary (192), then the
    # rest (A's partial entry moves to its copy), then B hits A's 192 tokens (two copies).
    def first(s: StepBuilder) -> None:
        s.new_step_starts()
        s.add_request(1, SHARED, hashing.hash_token_ids(SHARED), request_id="a")
        s.allocate(1, 192, 0, lookup=True)
        s.take_block_copies()

    def second(s: StepBuilder) -> None:
        s.cache_blocks(1, 192)
        s.new_step_starts()
        s.allocate(1, 8, 192)
        s.take_block_copies()

    def third(s: StepBuilder) -> None:
        s.cache_blocks(1, 200)
        s.new_step_starts()
        s.add_request(2, OTHER, hashing.hash_token_ids(OTHER), request_id="b")
        s.allocate(2, len(OTHER), 0, lookup=True)
        if drain_last:
            s.take_block_copies()

    return [first, second, third]


def _hasher(pool: Pool) -> BlockHasher:
    return BlockHasher(HASH_BLOCK, pool.hashing.algorithm, pool.hashing.seed)


def test_drained_copies_over_grpc_equal_in_process_and_coalesced(client: SchedulerClient) -> None:
    client.create_pool("take-copies", _config())
    local = Pool("take-copies", _config())
    coalesced_pool = Pool("take-copies", _config())
    hashing = _hasher(local)
    drains: list[list[tuple[int, int]]] = []
    whole = StepBuilder(step_seq=3)
    for seq, build in enumerate(_steps(hashing), start=1):
        builder = StepBuilder(step_seq=seq)
        build(builder)
        build(whole)
        remote = client.step("take-copies", builder)
        in_process = StepResult.of(builder, local.run_step(builder.build()))
        assert remote.outcome == in_process.outcome
        assert remote.drained_copies == in_process.drained_copies
        drains += remote.drained_copies
    # A's continuation copies its partial block once; B's 192-token hit copies both groups'.
    assert [len(drain) for drain in drains] == [0, 1, 2]
    # The three steps as one program (a shipper catching up): the same drains, in order.
    program = whole.build()
    program.num_steps = 3
    result = StepResult.of(whole, coalesced_pool.run_step(program))
    assert result.drained_copies == drains
    # (An empty Step on each, so that the outcome each remembers for a retry is the same.)
    for pool in (local, coalesced_pool):
        pool.run_step(StepBuilder(step_seq=4).build())
    assert coalesced_pool.state_fingerprint() == local.state_fingerprint()


def test_copies_not_drained_stay_pending_until_a_later_drain() -> None:
    now = Pool("p", _config())
    later = Pool("p", _config())
    answers: dict[str, list[list[tuple[int, int]]]] = {"now": [], "later": []}
    for name, pool, drain_last in (("now", now, True), ("later", later, False)):
        for build in _steps(_hasher(pool), drain_last=drain_last):
            builder = StepBuilder()
            build(builder)
            answers[name] += StepResult.of(builder, pool.run_step(builder.build())).drained_copies
    # Undrained, B's copies keep their blocks' extra references: the pools differ ...
    assert now.state_fingerprint() != later.state_fingerprint()
    builder = StepBuilder()
    builder.take_block_copies()
    answers["later"] += StepResult.of(builder, later.run_step(builder.build())).drained_copies
    # ... until a later Step drains the same copies.
    assert answers["later"] == answers["now"]
    assert now.state_fingerprint() == later.state_fingerprint()


def test_the_wire_carries_each_drain_and_nothing_else_changes() -> None:
    pool = Pool("wire", _config())
    outcomes = []
    for build in _steps(_hasher(pool)):
        builder = StepBuilder()
        build(builder)
        outcomes.append(pool.run_step(builder.build()))
    last = outcomes[-1]
    assert last.drained_num_copies == [2]
    message = outcome_to_proto(last)
    decoded = outcome_from_proto(scheduler_pb2.StepResponse.FromString(message.SerializeToString()))
    assert decoded.drained_copy_block_ids == last.drained_copy_block_ids
    assert decoded.drained_num_copies == last.drained_num_copies
    # An answer without drains is encoded exactly as before the fields existed.
    last.drained_copy_block_ids = []
    last.drained_num_copies = []
    plain = outcome_to_proto(last)
    assert not plain.drained_num_copies
    assert plain.SerializeToString() == message.SerializeToString()[: plain.ByteSize()]
