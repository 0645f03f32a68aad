"""Where the mirror's closed steps go: the sink protocol, and the sinks that ship nothing.

The vLLM integration has one KV-cache manager, :class:`~kvcm.integrations.vllm._manager.
MirrorKVCacheManager`: kvcm's core in the scheduler process decides every answer, and a
:class:`~kvcm.integrations.vllm._recorder.StepRecorder` records each step's mutations as one
Step program. What happens to the programs is the sink's, and the sink is what the mode picks:

==========================  =========================================  ==========================
mode                        sink                                       the server's copy
==========================  =========================================  ==========================
no ``address``              :class:`NullSink`                          none: the mirror is alone
``mirror``                  ``GrpcStepShipper``                        shipped in the background,
                                                                       coalesced, verified
``remote``                  ``GrpcStepShipper(synchronous=True)``      acknowledges each answer
                                                                       before vLLM sees it
==========================  =========================================  ==========================

Remote mode is the mirror whose sink says ``acknowledges_each_answer``: the manager closes a
program after every ``allocate_slots``, and ``submit`` returns only once the server ran it and
answered what the mirror answered (a different answer repairs the server from the mirror
before ``submit`` returns; an unreachable server raises). Decisions are the core's in every
mode, so vLLM sees the same schedule in all three.

Every method the manager and the schedulers call is declared on :class:`StepSink`; the local
sinks inherit what shipping needs (nothing to flush, no snapshot, no lag) from
:class:`LocalSink`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvcm.integrations.vllm._recorder import RecordedStep
    from kvcm.integrations.vllm._shipper import ShippingLag

__all__ = ["CollectingSink", "LocalSink", "NullSink", "StepSink"]


class StepSink(Protocol):
    """Where closed steps go: what :class:`MirrorKVCacheManager` and the schedulers call.

    The manager calls ``submit`` on the scheduler thread at every step close, reads
    ``wants_snapshot`` right after it (and answers with ``submit_snapshot``), and ``flush``,
    ``lag`` and ``close`` at step boundaries (``shutdown()``, tests, metrics).
    """

    @property
    def acknowledges_each_answer(self) -> bool:
        """Remote mode: the manager closes a step after every ``allocate_slots``, and
        ``submit`` returns once the server acknowledged it (read once, when the sink is set)."""
        ...

    @property
    def wants_snapshot(self) -> bool:
        """Whether the sink needs a snapshot of the mirror (the server's copy is lost)."""
        ...

    def submit(self, step: RecordedStep) -> None:
        """Take one closed step (mirror mode: must not block the scheduler for long)."""
        ...

    def submit_snapshot(self, step_seq: int, data: bytes) -> None:
        """The mirror's snapshot after step ``step_seq``, asked for by ``wants_snapshot``."""
        ...

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted step was shipped; ``False`` after ``timeout_s``."""
        ...

    def lag(self) -> ShippingLag | None:
        """How far the server's copy is behind the mirror (``None``: nothing is shipped)."""
        ...

    def close(self, timeout_s: float = 5.0) -> None:
        """Ship what is pending (up to ``timeout_s``) and release resources."""
        ...


class LocalSink:
    """A sink that ships nothing: no server to acknowledge, flush, repair or lag behind.

    Subclasses implement :meth:`submit` (tests' sinks too).
    """

    __slots__ = ()

    acknowledges_each_answer = False
    wants_snapshot = False

    def submit(self, step: RecordedStep) -> None:
        """Take one closed step."""
        raise NotImplementedError

    def submit_snapshot(self, step_seq: int, data: bytes) -> None:
        """Never asked for (``wants_snapshot`` is ``False``): ignored."""
        del step_seq, data

    def flush(self, timeout_s: float) -> bool:
        """Nothing is queued: done."""
        del timeout_s
        return True

    def lag(self) -> ShippingLag | None:
        """Nothing is shipped: ``None``."""
        return None

    def close(self, timeout_s: float = 5.0) -> None:
        """Nothing to release."""
        del timeout_s


class NullSink(LocalSink):
    """Drops every step (no server: the mirror is the only copy; the recorder notes nothing)."""

    __slots__ = ()

    def submit(self, step: RecordedStep) -> None:
        """Drop ``step``."""
        del step


@dataclass(slots=True)
class CollectingSink(LocalSink):
    """Keeps every step in memory (tests and debugging).

    Attributes:
        steps: The steps, in submission order.
        closed: Whether ``close`` was called.
    """

    steps: list[RecordedStep] = field(default_factory=list)
    closed: bool = False

    def submit(self, step: RecordedStep) -> None:
        """Keep ``step``."""
        self.steps.append(step)

    def close(self, timeout_s: float = 5.0) -> None:
        """Mark the sink closed."""
        del timeout_s
        self.closed = True
