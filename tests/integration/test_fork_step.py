"""FORK as a Step op: the SDK's StepBuilder through a real server over gRPC, the same program
in process, the copies in the answer, and rejections that name the field and change nothing."""

from __future__ import annotations

import pytest
from test_sdk_trace import full_attention_layout

from kvcm.client import ItemStatus, PoolConfig, SchedulerClient, StepBuilder, StepResult
from kvcm.client._errors import ServiceError, ServiceNotFoundError
from kvcm.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from kvcm.core.pool import Pool
from kvcm.wire import program_from_proto


def _config() -> PoolConfig:
    return PoolConfig(max_model_len=1024, explicit_layout=full_attention_layout(num_blocks=64))


def _steps(block_size: int) -> list[StepBuilder]:
    prompt = list(range(block_size + 3))  # one full block and a partial one
    first = StepBuilder()
    first.add_request(1, prompt, request_id="a")
    first.allocate(1, len(prompt), 0)
    second = StepBuilder()
    second.fork(1, 2, len(prompt))
    second.fork(1, 3, len(prompt))
    for key in (1, 2, 3):
        second.append_tokens(key, [500 + key])
    second.decode([1, 2, 3], [1, 1, 1], [len(prompt)] * 3)
    return [first, second]


def test_fork_over_grpc_answers_the_copies_as_in_process(client: SchedulerClient) -> None:
    client.create_pool("fork-step", _config())
    local = Pool("fork-step", _config())
    block_size = local.hashing.hash_block_size
    results = []
    for builder in _steps(block_size):
        remote = client.step("fork-step", builder)
        in_process = StepResult.of(builder, local.run_step(builder.build()))
        assert remote.outcome == in_process.outcome
        assert remote.copies == in_process.copies
        results.append(remote)
    assert results[1].statuses == [ItemStatus.OK] * 3
    first = results[0].blocks(0)
    assert first is not None
    full, partial = first.get_block_ids()[0]
    # Three holders of the partial block: the first two writers (the parent, then the first
    # child) copy it, the last one keeps it.
    copies = results[1].copies
    assert [source for source, _ in copies] == [partial, partial]
    assert local.manager is not None
    tables = [local.manager.get_block_ids(str(key))[0] for key in (1, 2, 3)]
    assert tables == [[full, copies[0][1]], [full, copies[1][1]], [full, partial]]
    assert len({partial, copies[0][1], copies[1][1]}) == 3
    # The wire carries the op and its columns.
    program = program_from_proto(_steps(block_size)[1].to_proto("fork-step"))
    assert program.fork_child_keys == [2, 3]


@pytest.mark.parametrize(
    ("build", "error", "field"),
    [
        (lambda s: s.fork(1, 1, 3), AlreadyExistsError, "fork_child_keys[0]"),
        (lambda s: s.fork(1, 2, 99), InvalidArgumentError, "fork_num_computed_tokens[0]"),
        (lambda s: s.fork(9, 2, 1), Exception, "request_keys[0]"),
        # A FORK after an ALLOCATE of the parent in a Step that runs on after does-not-fit
        # (the ALLOCATE may not have fit: its slots are not known).
        (
            lambda s: (
                setattr(s, "continue_on_does_not_fit", True),
                s.allocate(1, 1, 3),
                s.fork(1, 2, 3),
            ),
            FailedPreconditionError,
            "request_keys[1]",
        ),
    ],
)
def test_bad_forks_name_the_field_and_change_nothing(
    client: SchedulerClient, build: object, error: type[Exception], field: str
) -> None:
    name = f"fork-bad-{field.replace('[', '-').replace(']', '')}"
    client.create_pool(name, _config())
    local = Pool(name, _config())
    setup = StepBuilder()
    setup.add_request(1, [1, 2, 3], request_id="a")
    setup.allocate(1, 3, 0)
    client.step(name, setup)
    local.run_step(setup.build())
    before = local.state_fingerprint()
    bad = StepBuilder()
    build(bad)  # type: ignore[operator]
    with pytest.raises(error) as raised:
        local.run_step(bad.build())
    assert getattr(raised.value, "field", None) == field
    assert local.state_fingerprint() == before
    with pytest.raises(ServiceError) as remote:
        client.step(name, bad)
    assert remote.value.field == field  # type: ignore[attr-defined]
    again = StepBuilder()
    again.fork(1, 2, 3)
    assert client.step(name, again).outcome.num_ops_executed == 1


def test_unary_fork_then_a_decode_answers_the_copy(client: SchedulerClient) -> None:
    client.create_pool("fork-unary", _config())
    setup = StepBuilder()
    setup.add_request(1, [1, 2, 3], request_id="a")
    setup.allocate(1, 3, 0)
    (blocks,) = client.step("fork-unary", setup).blocks(0).get_block_ids()  # type: ignore[union-attr]
    client.fork("fork-unary", 1, 2, 3)
    with pytest.raises(AlreadyExistsError):
        client.fork("fork-unary", 1, 2, 3)
    decode = StepBuilder()
    decode.append_tokens(2, [9])
    decode.decode([2], [1], [3])
    ((source, destination),) = client.step("fork-unary", decode).copies
    assert source == blocks[0]
    assert destination != source


def test_common_computed_blocks_over_grpc_equal_the_core_answer(client: SchedulerClient) -> None:
    """COMMON_BLOCKS (V0's get_common_computed_block_ids): the SDK call and a Step op answer
    what the core function answers in process; a key that is not live is NOT_FOUND naming
    its entry, and the Step changes nothing."""
    from kvcm.common.hashing import BlockHasher
    from kvcm.core.fork import pool_common_computed_block_ids

    client.create_pool("fork-common", _config())
    local = Pool("fork-common", _config())
    hashing = local.hashing
    block_size = hashing.hash_block_size
    hasher = BlockHasher(block_size, hashing.algorithm, hashing.seed)
    prompt = list(range(2 * block_size + 3))  # two full blocks (cached) and a partial one
    first = StepBuilder()
    first.add_request(1, prompt, list(hasher.hash_token_ids(prompt)), request_id="a")
    first.allocate(1, len(prompt), 0)
    second = StepBuilder()
    second.fork(1, 2, len(prompt))
    second.fork(1, 3, len(prompt))
    for builder in (first, second):
        client.step("fork-common", builder)
        local.run_step(builder.build())
    # The samples hold the prompt's two cached blocks in common (the partial one is not
    # computed in V0's sense: not promoted).
    expected = pool_common_computed_block_ids(local, [1, 2, 3])
    assert client.common_computed_blocks("fork-common", [1, 2, 3]) == expected
    assert len(expected[0]) == 2
    builder = StepBuilder()
    builder.common_computed_blocks([2])
    builder.common_computed_blocks([1, 3])
    remote = client.step("fork-common", builder)
    in_process = StepResult.of(builder, local.run_step(builder.build()))
    assert remote.common_blocks == in_process.common_blocks
    assert remote.common_blocks == [
        pool_common_computed_block_ids(local, [2]),
        pool_common_computed_block_ids(local, [1, 3]),
    ]
    before = local.state_fingerprint()
    bad = StepBuilder()
    bad.common_computed_blocks([1, 99])
    with pytest.raises(ServiceNotFoundError) as info:
        client.step("fork-common", bad)
    assert info.value.field == "common_keys[1]"
    with pytest.raises(NotFoundError) as local_info:
        local.run_step(bad.build())
    assert local_info.value.field == "common_keys[1]"
    assert local.state_fingerprint() == before
