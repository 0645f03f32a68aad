"""P/D transfer records across a failover (docs/replication.md, docs/pd.md).

A standby seeded after a transfer was held gets the pool's transfer records in its seed, so
the transfer's later calls apply there too; in a ``sync`` pool a transfer call's answer waits
for the standby (a paused standby: UNAVAILABLE, not OK), so after ``kill -9`` of the primary
the promoted standby holds every transfer answered OK, and the source pool exactly as the old
primary left it (the committed transfer gave its request back there as on the primary).
"""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path

import grpc
import pytest
from _replication import HttpServer, place, replica_state

from kvcm.client import SchedulerClient, StepBuilder, Transfer, TransferState
from kvcm.common.config import KVCacheConfig, KVCacheGroupSpec
from kvcm.common.dtypes import DType
from kvcm.common.specs import FullAttentionSpec
from kvcm.core.pool import PoolConfig
from kvcm.v1 import pd_pb2, replica_pb2, service_pb2_grpc

ENV = {"KVCM_REPLICA_DIGEST_EVERY": "4", "KVCM_REPLICA_SYNC_TIMEOUT_S": "0.5"}
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=DType.BFLOAT16)
CONFIG = PoolConfig(
    max_model_len=512,
    hash_seed="pd",
    explicit_layout=KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=SPEC),),
    ),
)
PROMPTS = {key: list(range(1000 * key, 1000 * key + 100)) for key in (1, 2, 3)}


def _computed(client: SchedulerClient, pool_id: str, key: int, prompt: list[int]) -> None:
    step = StepBuilder()
    step.add_request(key, prompt, client.block_hasher(pool_id).hash_token_ids(prompt))
    step.allocate(key, len(prompt), 0, lookup=True)
    step.cache_blocks(key, len(prompt))
    client.step(pool_id, step)


def _same(a: Transfer, b: Transfer) -> bool:
    """Equal but for the lease left (it runs; a restored lease starts again)."""
    return dataclasses.replace(a, lease_remaining_s=0.0) == dataclasses.replace(
        b, lease_remaining_s=0.0
    )


def _caught_up(primary: str, standby: str, pool_id: str) -> replica_pb2.GetReplicaStateResponse:
    deadline = time.monotonic() + 10
    while True:
        on_primary, on_standby = replica_state(primary, pool_id), replica_state(standby, pool_id)
        if (
            on_standby.has_copy
            and on_primary.acked_seq == on_primary.seq
            and on_standby.seq == on_primary.seq
        ):
            return on_primary
        assert time.monotonic() < deadline, f"{standby} never caught up on {pool_id}"
        time.sleep(0.05)


def test_a_standby_seeded_after_a_hold_takes_over_every_transfer_answered_ok(
    tmp_path: Path,
) -> None:
    a = HttpServer(tmp_path / "a", ENV)
    a.start()
    b: HttpServer | None = None
    try:
        place(a.address, "prefill", a.address, None, 1)  # no standby yet
        with SchedulerClient(a.address, timeout=10.0) as client:
            client.create_pool("prefill", CONFIG)
            client.create_pool("decode", CONFIG)
            for key, prompt in PROMPTS.items():
                _computed(client, "prefill", key, prompt)
            _computed(client, "decode", 9, [*PROMPTS[1][:48], 7])
            client.free("decode", 9)
            client.hold_source("prefill", "t1", 1, lease_s=60.0)
            planned = client.plan_transfer("prefill", "t1", "decode")
            assert (planned.state, planned.hit_tokens) == (TransferState.PLANNED, 48)

            # A standby seeded after the hold and the plan: the seed carries the records.
            b = HttpServer(tmp_path / "b", ENV)
            b.start()
            place(b.address, "prefill", a.address, b.address, 1)
            place(a.address, "prefill", a.address, b.address, 1)
            _caught_up(a.address, b.address, "prefill")
            done = client.commit_transfer("prefill", "t1")  # gives request 1 back, on both
            assert done.state is TransferState.COMPLETED
            with SchedulerClient(b.address, timeout=10.0) as standby:  # sync: it has it now
                assert _same(standby.describe_transfer("prefill", "t1"), done)
            with grpc.insecure_channel(b.address) as channel:  # a standby refuses, naming A
                stub = service_pb2_grpc.TransferServiceStub(channel)  # type: ignore[no-untyped-call]
                with pytest.raises(grpc.RpcError) as on_standby:
                    stub.ReleaseTransfer(
                        pd_pb2.ReleaseTransferRequest(pool_id="prefill", transfer_id="t1"),
                        timeout=10,
                    )
            assert on_standby.value.code() is grpc.StatusCode.UNAVAILABLE
            assert f"its primary is {a.address}" in on_standby.value.details()
            held = client.hold_source("prefill", "t2", 2, lease_s=60.0)  # answered OK

            # A sync transfer call is answered only once the standby has its record.
            assert b.process is not None
            b.process.send_signal(signal.SIGSTOP)
            try:
                with grpc.insecure_channel(a.address) as channel:
                    stub = service_pb2_grpc.TransferServiceStub(channel)  # type: ignore[no-untyped-call]
                    with pytest.raises(grpc.RpcError) as refused:
                        stub.HoldSource(
                            pd_pb2.HoldSourceRequest(
                                pool_id="prefill", transfer_id="t3", request_key=3, lease_s=60.0
                            ),
                            timeout=10,
                        )
            finally:
                b.process.send_signal(signal.SIGCONT)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "did not confirm the record within 0.5 s" in refused.value.details()

            on_a = _caught_up(a.address, b.address, "prefill")
            old = (
                client.describe_pool("prefill").num_requests,
                client.get_usage("prefill").usage,
                [t.transfer_id for t in client.list_transfers(pool_id="prefill")],
            )
            assert old[0] == 2  # request 1 finished by the commit; 2 and 3 held
        a.kill()
        assert place(b.address, "prefill", b.address, None, 2) == "primary"
        on_b = replica_state(b.address, "prefill")
        assert on_b.digest == on_a.digest  # the same pool, event log included
        with SchedulerClient(b.address, timeout=10.0) as client:
            assert _same(client.describe_transfer("prefill", "t1"), done)
            assert _same(client.describe_transfer("prefill", "t2"), held)
            assert client.describe_transfer("prefill", "t3").state is TransferState.HELD
            new = (
                client.describe_pool("prefill").num_requests,
                client.get_usage("prefill").usage,
                [t.transfer_id for t in client.list_transfers(pool_id="prefill")],
            )
            assert new == old
            # The promoted primary goes on with the held transfer (decode is not replicated).
            released = client.release_transfer("prefill", "t2", "decode went away")
            assert released.state is TransferState.RELEASED
            assert client.describe_pool("prefill").num_requests == 1
    finally:
        a.stop()
        if b is not None:
            b.stop()
