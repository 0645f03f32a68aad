"""Makes the calls against the served pool and checks each one (see ``Harness.check``)."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from google.protobuf import text_format
from google.protobuf.message import DecodeError, Message

from _fuzz.calls import Call, Target, fuzz_pool_config
from _fuzz.reference import REFERENCE_METHODS, Reference, RefusedError
from _fuzz.state import registry_state, untimed_fingerprint
from kvcm.common.errors import KVCMError
from kvcm.core.pool import Pool
from kvcm.core.snapshot import decode_pool
from kvcm.server.embedded import EmbeddedServer
from kvcm.v1 import admin_pb2, events_pb2, scheduler_pb2, service_pb2_grpc, worker_pb2
from kvcm.wire import pool_config_from_proto

__all__ = ["Finding", "FuzzStats", "Harness"]

_FORBIDDEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
# Outcome unknown by contract: the state may or may not have changed.
_UNDECIDED = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
_RESPONSES = {
    "admin": admin_pb2,
    "worker": worker_pb2,
    "scheduler": scheduler_pb2,
    "events": events_pb2,
}
_names = itertools.count()


@dataclass(frozen=True)
class Finding:
    """One failed check.

    Attributes:
        check: ``status`` (INTERNAL/UNKNOWN), ``state`` (changed after rejection),
            ``refused`` (accepted what the reference refuses), ``answer`` (answered
            differently) or ``diverged`` (the pools' states differ after the call).
        call: The call, readable.
        code: The status the server answered.
        detail: The status message, or what differs.
    """

    check: str
    call: str
    code: str
    detail: str

    @property
    def signature(self) -> tuple[str, str, str]:
        """What tells distinct failures apart: the check, the RPC and the status."""
        method = "raw bytes" if "(raw bytes" in self.call else self.call.split("(", 1)[0]
        if "metadata" in self.detail.lower():
            method = "any RPC with a huge pool_id"
        return (self.check, method, self.code)

    def __str__(self) -> str:
        return f"[{self.check}] {self.call}\n  -> {self.code}: {self.detail[:1500]}"


@dataclass
class FuzzStats:
    """Counters over every call made."""

    examples: int = 0
    calls: int = 0
    rejections: int = 0
    state_changes_after_rejection: int = 0
    internal_or_unknown: int = 0
    reference_mismatches: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    findings: dict[tuple[str, str, str], Finding] = field(default_factory=dict)

    def add(self, finding: Finding) -> None:
        """Keep the shortest repro of each distinct failure."""
        known = self.findings.get(finding.signature)
        if known is None or len(finding.call) < len(known.call):
            self.findings[finding.signature] = finding


def _decode(call: Call) -> Message | None:
    """The request raw bytes decode to (the server may accept those), or None."""
    request_type = getattr(_RESPONSES[call.service], f"{call.method}Request")
    try:
        return request_type.FromString(call.request)  # type: ignore[no-any-return]
    except DecodeError:
        return None


class Harness:
    """Calls a served pool through raw stubs and compares it with the reference."""

    def __init__(self, server: EmbeddedServer, channel: grpc.Channel, stats: FuzzStats) -> None:
        """Use ``server`` (read directly for its pools) through ``channel``."""
        self.server = server
        self.channel = channel
        self.stats = stats
        self.admin = service_pb2_grpc.AdminServiceStub(channel)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------------- pools
    def _registry_state(self) -> dict[str, bytes]:
        registry = self.server.server.state.registry

        async def read() -> dict[str, bytes]:
            return registry_state(registry)

        return self.server.call(read())

    def _served_pool(self, pool_id: str) -> Pool:
        return self.server.server.state.registry.get(pool_id)

    def new_target(self) -> Target:
        """Create a fresh fuzzed pool and a pending one; the reference follows the first."""
        name = f"fz{next(_names)}"
        self.admin.CreatePool(
            admin_pb2.CreatePoolRequest(pool_id=name, config=fuzz_pool_config()), timeout=10
        )
        self.admin.CreatePool(
            admin_pb2.CreatePoolRequest(pool_id=f"{name}-w", config=fuzz_pool_config(world_size=2)),
            timeout=10,
        )
        served = self._served_pool(name)
        return Target(name, f"{name}-w", Pool(name, served.options))

    def drop_target(self, target: Target) -> None:
        """Delete every pool the example created."""
        for pool_id in (target.pool_id, target.pending_pool_id, f"{target.pool_id}-new"):
            with contextlib.suppress(grpc.RpcError):
                self.admin.DeletePool(admin_pb2.DeletePoolRequest(pool_id=pool_id), timeout=10)

    # ------------------------------------------------------------------------- calls
    def invoke(self, call: Call) -> tuple[grpc.StatusCode, Message | None, str]:
        """Make the call; returns its status, response (OK unary calls) and message."""
        raw = isinstance(call.request, bytes)
        module = _RESPONSES[call.service]
        response_type = getattr(module, f"{call.method}Response")
        serializer = None if raw else type(call.request).SerializeToString
        try:
            if call.method == "SubscribeEvents":
                stream = self.channel.unary_stream(
                    call.path,
                    request_serializer=serializer,
                    response_deserializer=response_type.FromString,
                )(call.request, timeout=call.timeout_s)
                try:
                    next(iter(stream))
                finally:
                    stream.cancel()
                return grpc.StatusCode.OK, None, ""
            if call.method == "ResyncPool" and not raw:  # a client stream of one chunk
                response = self.channel.stream_unary(
                    call.path,
                    request_serializer=serializer,
                    response_deserializer=response_type.FromString,
                )(iter([call.request]), timeout=call.timeout_s)
                return grpc.StatusCode.OK, response, ""
            response = self.channel.unary_unary(
                call.path,
                request_serializer=serializer,
                response_deserializer=response_type.FromString,
            )(call.request, timeout=call.timeout_s)
            return grpc.StatusCode.OK, response, ""
        except grpc.RpcError as exc:
            return exc.code(), None, exc.details() or ""  # type: ignore[attr-defined]

    def check(self, call: Call, target: Target) -> list[Finding]:
        """Make ``call`` and run the three checks.

        1. The status is never INTERNAL or UNKNOWN.
        2. A rejected call leaves every pool fingerprint-identical.
        3. An accepted SchedulerService call on the fuzzed pool answers what the reference
           answers, and leaves the served pool in the reference's state.

        Returns:
            The failed checks (empty when all passed). After a ``state``, ``refused``,
            ``answer`` or ``diverged`` finding the reference no longer follows the pool.
        """
        before = self._registry_state()
        first = None
        if call.first is not None:
            first = self.channel.unary_unary(
                call.first.path,
                request_serializer=type(call.first.request).SerializeToString,
                response_deserializer=worker_pb2.RegisterWorkerResponse.FromString,
            ).future(call.first.request, timeout=call.first.timeout_s)
            time.sleep(0.02)  # rank 0 arrives first
        code, response, details = self.invoke(call)
        findings, first_rejected = [], True
        if first is not None:
            first_rejected = self._check_first(call, first, findings)
        after = self._registry_state()
        stats = self.stats
        stats.calls += 1
        stats.codes[f"{call.method}:{code.name}"] += 1
        text = call.describe()
        if code in _FORBIDDEN:
            stats.internal_or_unknown += 1
            findings.append(Finding("status", text, code.name, details))
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata" in details.lower():
            # The client, not the server, failed the call: the real answer never arrived.
            findings.append(Finding("status", text, code.name, details))
        if code != grpc.StatusCode.OK:
            stats.rejections += 1
            if code not in _UNDECIDED and first_rejected and before != after:
                stats.state_changes_after_rejection += 1
                changed = sorted(set(before) ^ set(after)) + [
                    name for name in before if name in after and before[name] != after[name]
                ]
                findings.append(
                    Finding("state", text, code.name, f"{details!r}; pools changed: {changed}")
                )
            return findings
        if isinstance(call.request, bytes):
            decoded = _decode(call)
            if decoded is None:
                findings.append(Finding("status", text, "OK", "undecodable bytes were accepted"))
                return findings
            call = Call(call.service, call.method, decoded, call.timeout_s)
        request_pool = getattr(call.request, "pool_id", None)
        if call.method == "DescribePool" and request_pool == target.pool_id:
            # Its answer's counters come from Pool.snapshot(), which drains the manager's
            # pending prefix-cache stats into the pool's totals (and its recent hit rate):
            # the reference is read the same way, at the same point.
            target.reference.snapshot()
            return findings
        if call.method == "ResyncPool" and request_pool == target.pool_id:
            findings.extend(self._follow_resync(call, target, text))
            return findings
        if call.method not in REFERENCE_METHODS or request_pool != target.pool_id:
            return findings
        findings.extend(self._compare(call, target, response, text))
        return findings

    def _check_first(self, call: Call, first: grpc.Future, findings: list[Finding]) -> bool:
        """Check the status of the pair's first call; whether that call was rejected.

        Only when both calls of a pair were rejected must every pool be left unchanged.
        """
        assert call.first is not None
        try:
            first.result()
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
        self.stats.calls += 1
        self.stats.codes[f"{call.first.method}:{code.name}"] += 1
        if code in _FORBIDDEN:
            self.stats.internal_or_unknown += 1
            findings.append(Finding("status", call.first.describe(), code.name, details))
        if code != grpc.StatusCode.OK:
            self.stats.rejections += 1
        return code != grpc.StatusCode.OK and code not in _UNDECIDED

    def _follow_resync(self, call: Call, target: Target, text: str) -> list[Finding]:
        """An accepted ResyncPool of the fuzzed pool: the core decodes the same bytes into the
        same pool (else ``refused``), which the reference follows from now on."""
        request = call.request
        assert isinstance(request, scheduler_pb2.ResyncPoolRequest)
        try:
            pool = decode_pool(request.data, target.pool_id, pool_config_from_proto(request.config))
        except KVCMError as exc:
            self.stats.reference_mismatches += 1
            return [Finding("refused", text, "OK", f"the core refuses it: {exc}")]
        pool.last_step_seq, pool.last_step_outcome = request.step_seq, None
        target.reference = pool
        served = self._served_pool(target.pool_id)

        async def read() -> bytes:
            return untimed_fingerprint(served)

        if self.server.call(read()) != untimed_fingerprint(pool):
            self.stats.reference_mismatches += 1
            return [Finding("diverged", text, "OK", "served and decoded pools differ")]
        return []

    def _compare(
        self, call: Call, target: Target, response: Message | None, text: str
    ) -> list[Finding]:
        reference = Reference(target.reference)
        assert isinstance(call.request, Message)
        try:
            expected = reference.answer(call.method, call.request)
        except RefusedError as exc:
            self.stats.reference_mismatches += 1
            return [Finding("refused", text, "OK", f"the core refuses it: {exc}")]
        target.reference = reference.pool
        findings = []
        if response != expected:
            self.stats.reference_mismatches += 1
            got = text_format.MessageToString(response, as_one_line=True) if response else ""
            want = text_format.MessageToString(expected, as_one_line=True)
            findings.append(Finding("answer", text, "OK", f"served {{{got}}} != core {{{want}}}"))
        served = self._served_pool(target.pool_id)

        async def read() -> bytes:
            return untimed_fingerprint(served)

        if self.server.call(read()) != untimed_fingerprint(target.reference):
            self.stats.reference_mismatches += 1
            findings.append(Finding("diverged", text, "OK", "served and reference pools differ"))
        return findings
