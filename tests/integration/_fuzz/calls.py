"""Hostile calls: Hypothesis draws of every RPC of kvcm.v1, most aimed at one fuzzed pool.

A draw reads the reference pool (``Target.reference``) so that a share of the calls is valid
(correct block hashes, live request keys, the real prefix hit) and the server gets past its
first checks; the rest carry the values the brief names: out-of-range numbers (negative
int64, 2**32-1, 2**64-1), unknown enum values, empty, huge and non-ASCII ids, wrong hash
lengths, foreign and repeated block ids in hits, Step columns too long or too short, and
undecodable bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from google.protobuf.message import Message
from hypothesis import strategies as st

from _fuzz.snapshots import draw_forgery
from kvcm.common.hashing import BlockHasher
from kvcm.core.pool import Pool
from kvcm.core.snapshot import encode_pool
from kvcm.v1 import admin_pb2, common_pb2, events_pb2, scheduler_pb2, worker_pb2

__all__ = [
    "BLOCK_SIZE",
    "warm_up_calls",
    "MAX_MODEL_LEN",
    "NUM_BLOCKS",
    "Call",
    "Target",
    "draw_call",
    "draw_garbage",
    "fuzz_pool_config",
]

BLOCK_SIZE = 4
NUM_BLOCKS = 17
MAX_MODEL_LEN = 48
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

_HUGE_ID = "p" * 20_000
_BAD_IDS = ["", "x" * 129, _HUGE_ID, "pööl-ü", "no-such-pool", "a b", "\x00"]
_BAD_KEYS = [2**63, U64_MAX, 2**32]
_BIG_U32 = [2**31 - 1, 2**31, U32_MAX]
_SERVICE = {
    "admin": "kvcm.v1.AdminService",
    "worker": "kvcm.v1.WorkerService",
    "scheduler": "kvcm.v1.SchedulerService",
    "events": "kvcm.v1.EventService",
}


@dataclass(frozen=True)
class Call:
    """One call to make.

    Attributes:
        service: ``admin``, ``worker``, ``scheduler`` or ``events``.
        method: The RPC name.
        request: The request message, or raw bytes to send undecoded.
        timeout_s: The call's deadline.
        first: A call made just before this one and left running while it is made (rank 0 of
            a registration pair, which waits for rank 1); its status is checked too.
    """

    service: str
    method: str
    request: Message | bytes
    timeout_s: float = 10.0
    first: Call | None = None

    @property
    def path(self) -> str:
        """The gRPC method path."""
        return f"/{_SERVICE[self.service]}/{self.method}"

    def describe(self, limit: int = 1500) -> str:
        """The call, readable (long values cut)."""
        from google.protobuf import text_format

        if isinstance(self.request, bytes):
            body = f"raw bytes {self.request[:200]!r} ({len(self.request)} bytes)"
        else:
            body = text_format.MessageToString(self.request, as_one_line=True)
        body = re.sub(r"(.)\1{39,}", lambda run: f"{run[1]}<x{len(run[0])}>", body)
        if len(body) > limit:
            body = body[:limit] + f"... ({len(body)} chars)"
        text = f"{self.method}({body})"
        return text if self.first is None else f"{self.first.describe(limit)} then {text}"


@dataclass
class Target:
    """What the draws aim at.

    Attributes:
        pool_id: The fuzzed (READY) pool.
        pending_pool_id: A pool waiting for 2 ranks (RegisterWorker's target).
        reference: The in-process reference pool (read for valid values).
        created: Pool ids the calls created (deleted after the example).
    """

    pool_id: str
    pending_pool_id: str
    reference: Pool
    created: set[str] = field(default_factory=set)

    def hasher(self) -> BlockHasher:
        """The pool's block hasher."""
        hashing = self.reference.hashing
        return BlockHasher(hashing.hash_block_size, hashing.algorithm, hashing.seed)


def fuzz_pool_config(*, world_size: int = 0) -> admin_pb2.PoolConfig:
    """The fuzzed pool: 17 blocks of 4 tokens, one full-attention group, events on."""
    config = admin_pb2.PoolConfig(max_model_len=MAX_MODEL_LEN, enable_kv_cache_events=True)
    if world_size:
        config.world_size = world_size
        return config
    layout = config.explicit_layout
    layout.num_blocks = NUM_BLOCKS
    group = layout.kv_cache_groups.add(layer_names=["layer.0"])
    group.kv_cache_spec.full_attention.attention.CopyFrom(_attention(BLOCK_SIZE))
    return config


def _attention(block_size: int) -> common_pb2.AttentionSpec:
    return common_pb2.AttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=common_pb2.DATA_TYPE_FLOAT16
    )


# ------------------------------------------------------------------------------ values
def _u32(data: st.DataObject, low: int = 0, high: int = MAX_MODEL_LEN + 4) -> int:
    return data.draw(st.one_of(st.integers(low, high), st.sampled_from(_BIG_U32)))


def _pool_id(data: st.DataObject, target: Target) -> str:
    return data.draw(st.sampled_from([target.pool_id] * 12 + _BAD_IDS))


def _key(data: st.DataObject, target: Target) -> int:
    live = sorted(target.reference.requests)
    if live and data.draw(st.integers(0, 9)) < 8:
        return data.draw(st.sampled_from(live))
    return data.draw(st.one_of(st.integers(0, 3), st.sampled_from(_BAD_KEYS)))


def _new_key(data: st.DataObject, target: Target) -> int:
    free = [key for key in range(4) if key not in target.reference.requests]
    if free and data.draw(st.integers(0, 9)) < 8:
        return data.draw(st.sampled_from(free))
    return _key(data, target)


def _tokens(data: st.DataObject, max_size: int) -> list[int]:
    token = st.one_of(st.integers(0, 50), st.sampled_from([U32_MAX, 2**31]))
    return data.draw(st.lists(token, max_size=max_size))


def _hashes(data: st.DataObject, target: Target, before: list[int], tokens: list[int]) -> bytes:
    """Hashes of the hash blocks ``tokens`` complete after ``before``: right or wrong."""
    size = target.reference.hashing.hash_length_bytes
    full = target.hasher().hash_token_ids(before + tokens)
    right = b"".join(full[len(before) // BLOCK_SIZE :])
    mode = data.draw(st.sampled_from(["right"] * 6 + ["none", "short", "long", "junk"]))
    if mode == "right":
        return right
    if mode == "short":
        return right[:-1]
    if mode == "long":
        return right + b"\x01" * size
    if mode == "junk":
        return data.draw(st.binary(max_size=3 * size))
    return b""


# ------------------------------------------------------------------------- scheduler
def _new_request(data: st.DataObject, target: Target) -> scheduler_pb2.NewRequest:
    tokens = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=24))
    if data.draw(st.integers(0, 3)) == 0:
        tokens = _tokens(data, MAX_MODEL_LEN + 2)
    if data.draw(st.integers(0, 5)) == 0:
        tokens = tokens or [1]
        tokens = tokens * (data.draw(st.integers(1, 3)))
        tokens = tokens[: data.draw(st.sampled_from([MAX_MODEL_LEN, MAX_MODEL_LEN + 1]))]
    new = scheduler_pb2.NewRequest(
        request_key=_new_key(data, target),
        request_id=data.draw(st.sampled_from(["r", "", "rëq-✓", "r" * 5000])),
        prompt_token_ids=tokens,
        block_hashes=_hashes(data, target, [], tokens),
        skip_reading_prefix_cache=data.draw(st.booleans()),
    )
    if data.draw(st.booleans()):
        new.lora_id = data.draw(st.sampled_from([-(2**63), -1, 0, 7, 2**63 - 1]))
    if data.draw(st.booleans()):
        new.lora_name = data.draw(st.sampled_from(["", "lörä", "x" * 3000]))
    return new


def _request_tokens(target: Target, key: int) -> list[int]:
    request = target.reference.requests.get(key)
    return list(request.all_token_ids) if request is not None else []


def _append(data: st.DataObject, target: Target) -> scheduler_pb2.AppendTokensRequest:
    key = _key(data, target)
    tokens = _tokens(data, 10)
    return scheduler_pb2.AppendTokensRequest(
        pool_id=_pool_id(data, target),
        request_key=key,
        token_ids=tokens,
        block_hashes=_hashes(data, target, _request_tokens(target, key), tokens),
    )


def _hit(data: st.DataObject, target: Target, key: int) -> scheduler_pb2.ComputedBlocks | None:
    """A prefix hit to hand back: the real one, cut, foreign, repeated or out of range."""
    mode = data.draw(st.sampled_from(["none", "none", "real", "cut", "foreign", "repeat", "range"]))
    if mode == "none":
        return None
    pool = target.reference
    request = pool.requests.get(key)
    ids: list[int] = []
    if request is not None and pool.manager is not None:
        hit = pool.manager.get_computed_blocks(request)
        ids = list(hit.blocks.get_block_ids()[0])
    if mode == "cut":
        ids = ids[:-1]
    elif mode == "foreign":
        cached = [b.block_id for b in pool.manager.block_pool.blocks if b.block_hash] or [1]  # type: ignore[union-attr]
        ids = data.draw(st.lists(st.sampled_from(cached), min_size=1, max_size=3))
    elif mode == "repeat":
        ids = (ids or [1])[:1] * 2
    elif mode == "range":
        ids = [data.draw(st.sampled_from([0, NUM_BLOCKS, U32_MAX]))]
    counts = [len(ids)]
    if data.draw(st.integers(0, 5)) == 0:
        counts = data.draw(st.lists(st.integers(0, 3), max_size=3))
    return scheduler_pb2.ComputedBlocks(
        num_new_computed_tokens=data.draw(
            st.one_of(st.just(len(ids) * BLOCK_SIZE), st.sampled_from([1, U32_MAX]))
        ),
        blocks=common_pb2.GroupedBlockIds(block_ids=ids, num_block_ids=counts),
    )


def _slot_options(data: st.DataObject) -> scheduler_pb2.SlotOptions:
    options = scheduler_pb2.SlotOptions()
    for name in data.draw(
        st.lists(
            st.sampled_from(
                [
                    "num_lookahead_tokens",
                    "num_external_computed_tokens",
                    "num_encoder_tokens",
                    "reserved_blocks",
                    "num_in_flight_tokens",
                ]
            ),
            max_size=2,
            unique=True,
        )
    ):
        setattr(options, name, _u32(data))
    options.delay_cache_blocks = data.draw(st.booleans())
    options.full_sequence_must_fit = data.draw(st.booleans())
    if data.draw(st.booleans()):
        options.has_scheduled_reqs = data.draw(st.booleans())
    return options


def _allocate(data: st.DataObject, target: Target) -> scheduler_pb2.AllocateSlotsRequest:
    key = _key(data, target)
    request = target.reference.requests.get(key)
    left = request.num_tokens - request.num_computed_tokens if request is not None else 4
    message = scheduler_pb2.AllocateSlotsRequest(
        pool_id=_pool_id(data, target),
        request_key=key,
        num_new_tokens=data.draw(
            st.one_of(st.just(left), st.just(1), st.just(0), st.just(U32_MAX))
        ),
        num_computed_tokens=data.draw(
            st.one_of(
                st.just(request.num_computed_tokens if request is not None else 0),
                st.just(0),
                st.sampled_from(_BIG_U32),
            )
        ),
    )
    hit = _hit(data, target, key)
    if hit is not None:
        message.new_computed.CopyFrom(hit)
    if data.draw(st.booleans()):
        message.options.CopyFrom(_slot_options(data))
    return message


def _keyed(
    data: st.DataObject, target: Target, message: type[Message], **fields: object
) -> Message:
    return message(pool_id=_pool_id(data, target), request_key=_key(data, target), **fields)


def _scheduler_call(data: st.DataObject, target: Target) -> Call:
    method = data.draw(
        st.sampled_from(
            ["AddRequest"] * 4
            + ["AppendTokens"] * 2
            + ["AllocateSlots"] * 4
            + ["Free"] * 2
            + ["Step"] * 5
            + [
                "GetComputedBlocks",
                "CacheBlocks",
                "RemoveSkippedBlocks",
                "EvictBlocks",
                "ResetPrefixCache",
                "GetBlocks",
                "GetBlockIds",
                "GetNumCommonPrefixBlocks",
                "TakeNewBlockIds",
                "NewStepStarts",
                "GetUsage",
                "TakePrefixCacheStats",
            ]
        )
    )
    pool_id = _pool_id(data, target)
    message: Message
    if method == "AddRequest":
        message = scheduler_pb2.AddRequestRequest(
            pool_id=pool_id, request=_new_request(data, target)
        )
    elif method == "AppendTokens":
        message = _append(data, target)
    elif method == "AllocateSlots":
        message = _allocate(data, target)
    elif method == "Free":
        mode = data.draw(st.sampled_from([1, 1, 2, 2, 0, 3, 99, 2**31 - 1, -1]))
        message = _keyed(data, target, scheduler_pb2.FreeRequest, mode=mode)
    elif method == "Step":
        from _fuzz.steps import draw_step

        message = draw_step(data, target)
    elif method == "GetComputedBlocks":
        message = _keyed(data, target, scheduler_pb2.GetComputedBlocksRequest)
        if data.draw(st.booleans()):
            message.lookup.max_cache_hit_length = _u32(data)  # type: ignore[attr-defined]
    elif method == "CacheBlocks":
        message = _keyed(data, target, scheduler_pb2.CacheBlocksRequest)
        message.num_computed_tokens = _u32(data)  # type: ignore[attr-defined]
    elif method == "RemoveSkippedBlocks":
        message = _keyed(data, target, scheduler_pb2.RemoveSkippedBlocksRequest)
        message.total_computed_tokens = _u32(data)  # type: ignore[attr-defined]
    elif method == "EvictBlocks":
        ids = data.draw(
            st.lists(st.one_of(st.integers(0, NUM_BLOCKS), st.just(U32_MAX)), max_size=4)
        )
        message = scheduler_pb2.EvictBlocksRequest(pool_id=pool_id, block_ids=ids)
    elif method in ("GetBlocks", "GetBlockIds"):
        message = _keyed(data, target, getattr(scheduler_pb2, f"{method}Request"))
    elif method == "GetNumCommonPrefixBlocks":
        message = scheduler_pb2.GetNumCommonPrefixBlocksRequest(
            pool_id=pool_id, running_request_key=_key(data, target)
        )
    else:
        message = getattr(scheduler_pb2, f"{method}Request")(pool_id=pool_id)
    return Call("scheduler", method, message)


# ----------------------------------------------------------------- admin, worker, events
def _create_pool(data: st.DataObject, target: Target) -> Call:
    pool_id = data.draw(st.sampled_from([*_BAD_IDS, "fz-new", target.pool_id]))
    config = fuzz_pool_config()
    mutation = data.draw(
        st.sampled_from(
            ["none", "blocks", "block_size", "world", "algo", "watermark", "len", "groups", "seed"]
        )
    )
    layout = config.explicit_layout
    if mutation == "blocks":
        layout.num_blocks = data.draw(st.sampled_from([0, 1, 2, 2**20, U32_MAX]))
    elif mutation == "block_size":
        spec = layout.kv_cache_groups[0].kv_cache_spec.full_attention.attention
        spec.block_size = data.draw(st.sampled_from([0, 3, U32_MAX]))
    elif mutation == "world":
        config.world_size = data.draw(st.sampled_from([1, 2**16, U32_MAX]))
        if data.draw(st.booleans()):
            config.ClearField("explicit_layout")
    elif mutation == "algo":
        config.hash_algorithm = data.draw(st.sampled_from([3, 5, 99, -1]))
    elif mutation == "watermark":
        config.watermark = data.draw(st.sampled_from([float("nan"), -0.5, 1.0, 1e300]))
    elif mutation == "len":
        config.max_model_len = data.draw(st.sampled_from([0, U32_MAX]))
    elif mutation == "groups":
        layout.ClearField("kv_cache_groups")
    elif mutation == "seed":
        config.hash_seed = data.draw(st.sampled_from(["", "sëed", "s" * 10_000]))
    if pool_id == "fz-new":
        pool_id = f"{target.pool_id}-new"
    return Call("admin", "CreatePool", admin_pb2.CreatePoolRequest(pool_id=pool_id, config=config))


def _register(data: st.DataObject, target: Target) -> Call:
    pool_id = data.draw(
        st.sampled_from([target.pending_pool_id, target.pending_pool_id, target.pool_id, *_BAD_IDS])
    )
    message = worker_pb2.RegisterWorkerRequest(
        pool_id=pool_id,
        rank=data.draw(st.sampled_from([0, 1, 0, 2, U32_MAX])),
        world_size=data.draw(st.sampled_from([2, 2, 2, 1, 0, U32_MAX])),
        available_memory_bytes=data.draw(st.sampled_from([2**20, 0, 1, 2**63, U64_MAX])),
    )
    names = data.draw(st.sampled_from([["l0"], ["l0"], ["l0"], [], ["l0", "l0"], [""], ["lä"]]))
    for name in names:
        layer = message.layer_specs.add(layer_name=name)
        if data.draw(st.integers(0, 4)):
            block_size = data.draw(st.sampled_from([BLOCK_SIZE, BLOCK_SIZE, 0, U32_MAX]))
            layer.spec.full_attention.attention.CopyFrom(_attention(block_size))
    # A registration that is accepted waits for the other rank: the deadline ends it.
    return Call("worker", "RegisterWorker", message, timeout_s=0.3)


# 2**12 fits (128 or 1024 blocks): small enough to fingerprint every pool after every call.
_MEMORY = [2**64 - 1, 0, 1, 2**63, 2**12, 2**12, 2**12, 2**12]
# (block_size, num_kv_heads, head_size): pages of 32 and 4 bytes, huge and over a uint64.
_PAGES = [(BLOCK_SIZE, 1, 8), (BLOCK_SIZE, 1, 8), (1, 1, 1), (U32_MAX, 1, 8), (16, 2**31, 2**31)]


def _register_pair(data: st.DataObject, target: Target) -> Call:
    """Rank 0 then rank 1 of the 2-rank pool, both well formed, with extreme memory and pages."""
    pages = data.draw(st.sampled_from(_PAGES))

    def rank(number: int) -> worker_pb2.RegisterWorkerRequest:
        message = worker_pb2.RegisterWorkerRequest(
            pool_id=target.pending_pool_id,
            rank=number,
            world_size=2,
            available_memory_bytes=data.draw(st.sampled_from(_MEMORY)),
        )
        block_size, heads, head_size = data.draw(st.sampled_from([pages, pages, *_PAGES]))
        attention = common_pb2.AttentionSpec(
            block_size=block_size,
            num_kv_heads=heads,
            head_size=head_size,
            dtype=common_pb2.DATA_TYPE_FLOAT16,
        )
        layer = message.layer_specs.add(layer_name="l0")
        layer.spec.full_attention.attention.CopyFrom(attention)
        return message

    first = Call("worker", "RegisterWorker", rank(0), timeout_s=0.5)
    return Call("worker", "RegisterWorker", rank(1), timeout_s=0.5, first=first)


def _subscribe(data: st.DataObject, target: Target) -> Call:
    message = events_pb2.SubscribeEventsRequest(
        pool_id=_pool_id(data, target),
        max_events_per_message=data.draw(st.sampled_from([0, 1, 1024, 1025, U32_MAX])),
    )
    if data.draw(st.booleans()):
        message.start_sequence = data.draw(st.sampled_from([0, 1, 2, 2**63, U64_MAX]))
    return Call("events", "SubscribeEvents", message, timeout_s=0.3)


def _other_call(data: st.DataObject, target: Target) -> Call:
    method = data.draw(
        st.sampled_from(
            [
                "CreatePool",
                "DescribePool",
                "ListPools",
                "DeletePool",
                "RegisterWorker",
                "RegisterPair",
                "SubscribeEvents",
            ]
        )
    )
    if method == "CreatePool":
        return _create_pool(data, target)
    if method == "RegisterWorker":
        return _register(data, target)
    if method == "RegisterPair":
        return _register_pair(data, target)
    if method == "SubscribeEvents":
        return _subscribe(data, target)
    if method == "ListPools":
        return Call("admin", method, admin_pb2.ListPoolsRequest())
    pool_id = data.draw(st.sampled_from([*_BAD_IDS, f"{target.pool_id}-new"]))
    if method == "DescribePool" and data.draw(st.booleans()):
        pool_id = target.pool_id
    return Call("admin", method, getattr(admin_pb2, f"{method}Request")(pool_id=pool_id))


def _resync(data: st.DataObject, target: Target) -> Call:
    """ResyncPool of the fuzzed pool (or a new one) with a forged snapshot of the reference
    (valid frame and CRC, hostile content: see ``_fuzz.snapshots``), sometimes an unforged one
    or one under a config it does not match."""
    snapshot = encode_pool(target.reference)
    if data.draw(st.integers(0, 5), label="forge?"):
        snapshot, _ = draw_forgery(data, snapshot)
    config = fuzz_pool_config()
    if not data.draw(st.integers(0, 7), label="config?"):
        config.max_model_len = data.draw(st.sampled_from([MAX_MODEL_LEN - 4, U32_MAX]))
    pool_id = data.draw(st.sampled_from([target.pool_id] * 3 + [f"{target.pool_id}-new"]))
    message = scheduler_pb2.ResyncPoolRequest(
        pool_id=pool_id,
        config=config,
        step_seq=data.draw(st.sampled_from([0, 1, 7, U64_MAX]), label="step_seq"),
        data=snapshot,
    )
    return Call("scheduler", "ResyncPool", message)


def draw_call(data: st.DataObject, target: Target) -> Call:
    """One hostile or valid call (scheduler calls most often)."""
    kind = data.draw(st.sampled_from(["scheduler"] * 12 + ["other", "other", "garbage", "resync"]))
    if kind == "scheduler":
        return _scheduler_call(data, target)
    if kind == "other":
        return _other_call(data, target)
    if kind == "resync":
        return _resync(data, target)
    return draw_garbage(data, target)


def warm_up_calls(data: st.DataObject, target: Target, key: int) -> list[Call]:
    """Valid calls that leave request ``key`` running with cached blocks (a shared prefix)."""
    tokens = list(range(8)) + data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=12))
    hashes = b"".join(target.hasher().hash_token_ids(tokens))
    add = scheduler_pb2.AddRequestRequest(
        pool_id=target.pool_id,
        request=scheduler_pb2.NewRequest(
            request_key=key, request_id=f"warm{key}", prompt_token_ids=tokens, block_hashes=hashes
        ),
    )
    allocate = scheduler_pb2.AllocateSlotsRequest(
        pool_id=target.pool_id, request_key=key, num_new_tokens=len(tokens)
    )
    return [Call("scheduler", "AddRequest", add), Call("scheduler", "AllocateSlots", allocate)]


# ---------------------------------------------------------------------------- garbage
_METHODS = (
    [("admin", name) for name in ("CreatePool", "ListPools", "DescribePool", "DeletePool")]
    + [("worker", "RegisterWorker"), ("events", "SubscribeEvents")]
    + [
        ("scheduler", name)
        for name in [
            "Step",
            "AddRequest",
            "AppendTokens",
            "Free",
            "GetComputedBlocks",
            "AllocateSlots",
            "CacheBlocks",
            "RemoveSkippedBlocks",
            "EvictBlocks",
            "ResetPrefixCache",
            "GetBlocks",
            "GetBlockIds",
            "GetNumCommonPrefixBlocks",
            "TakeNewBlockIds",
            "NewStepStarts",
            "GetUsage",
            "TakePrefixCacheStats",
            "ResyncPool",
        ]
    ]
)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def draw_garbage(data: st.DataObject, target: Target) -> Call:
    """Bytes no message decodes from, or a valid prefix with an out-of-range tail."""
    service, method = data.draw(st.sampled_from(_METHODS))
    pool = target.pool_id.encode()
    prefix = b"\x0a" + _varint(len(pool)) + pool  # field 1: pool_id
    body = data.draw(
        st.one_of(
            st.binary(min_size=1, max_size=40),
            # A field-1 string whose length runs past the end of the message.
            st.just(b"\x0a\x7f" + pool),
            # Invalid UTF-8 in the pool_id string.
            st.just(b"\x0a\x02\xff\xfe"),
            # A varint of 11 bytes (longer than any varint).
            st.just(prefix + b"\x10" + b"\xff" * 10 + b"\x01"),
            # Field 2 (a uint32 or uint64 in most requests) as 2**64-1 and as a negative int64.
            st.just(prefix + b"\x10" + _varint(U64_MAX)),
            st.just(prefix + b"\x18" + _varint(2**64 - 5)),
            # Wire type 7 (undefined) and a group-end tag without a start.
            st.just(prefix + b"\x17"),
            st.just(prefix + b"\x0c"),
        )
    )
    timeout = 0.3 if method in ("RegisterWorker", "SubscribeEvents") else 10.0
    return Call(service, method, body, timeout_s=timeout)
