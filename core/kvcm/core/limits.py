"""The service's hard limits, checked before any work starts.

One frozen value, built by the server from its settings (``kvcm serve`` flags, ``KVCM_*``
variables, the TOML file; docs/server.md lists them) and handed to the
:class:`~kvcm.core.pool.PoolRegistry`, which passes it to every pool. A call beyond a limit is
``ResourceExhaustedError`` (a capacity) or ``InvalidArgumentError`` (a size of the call itself),
naming the limit, and changes nothing.

The defaults bound any one call's work on the event loop and a server's memory, while leaving
room for the largest real deployments (a 4M-block pool is a 1M-token context on 64 concurrent
sequences of 16-token blocks; a block costs the server about 140 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvcm.common.errors import ResourceExhaustedError

__all__ = ["DEFAULT_LIMITS", "Limits", "check_pool_blocks"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Hard limits of one server (see the module docstring).

    Attributes:
        max_pools: Pools one server holds.
        max_blocks_per_pool: Blocks of one pool (planned or explicit), the null block included.
        max_total_blocks: Blocks of all pools together (the server's memory budget).
        max_step_ops: Ops in one Step program.
        max_step_tokens: Token ids in one Step program (prompts plus appended tokens).
        max_message_bytes: Size of one gRPC message, either direction.
        max_subscribers_per_pool: Live event subscriptions of one pool.
        max_pending_registrations: Ranks waiting at one pool's RegisterWorker barrier.
        registration_timeout_s: How long a rank waits for the other ranks at most (the
            client's deadline may end it sooner).
    """

    max_pools: int = 1024
    max_blocks_per_pool: int = 16 * 1024 * 1024
    max_total_blocks: int = 64 * 1024 * 1024
    # What a Step costs the event loop (bench/loop_fairness.py, docs/server.md): about 0.4 us
    # per prompt token and 100-250 us per admitted request on a busy 2-core machine. 8192 ops
    # leave 4x room over a 1024-sequence decode step (2048 ops); 128k tokens hold one prompt
    # of a 128k-context model. Going lower would refuse real steps: the rest is for a lane
    # that runs big programs off the loop (docs/server.md, "Event-loop fairness").
    max_step_ops: int = 8192
    max_step_tokens: int = 128 * 1024
    max_message_bytes: int = 16 * 1024 * 1024
    max_subscribers_per_pool: int = 64
    max_pending_registrations: int = 1024
    registration_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in (
            "max_pools",
            "max_blocks_per_pool",
            "max_total_blocks",
            "max_step_ops",
            "max_step_tokens",
            "max_message_bytes",
            "max_subscribers_per_pool",
            "max_pending_registrations",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"limits.{name} must be an int >= 1, got {value!r}")
        if not self.registration_timeout_s > 0:
            raise ValueError(
                f"limits.registration_timeout_s must be > 0, got {self.registration_timeout_s!r}"
            )


DEFAULT_LIMITS: Final = Limits()


def check_pool_blocks(limits: Limits, pool_id: str, num_blocks: int, blocks_in_use: int) -> None:
    """Check that a pool of ``num_blocks`` blocks fits the server's block limits.

    Called before a pool's blocks are built (an explicit layout at creation, a planned count
    once every rank registered), so a refused pool costs nothing.

    Args:
        limits: The server's limits.
        pool_id: The pool (for the message).
        num_blocks: The pool's blocks, the null block included.
        blocks_in_use: Blocks every other pool of the server holds or is building.

    Raises:
        ResourceExhaustedError: Over ``max_blocks_per_pool`` or ``max_total_blocks`` (the
            message names the limit).
    """
    if num_blocks > limits.max_blocks_per_pool:
        raise ResourceExhaustedError(
            f"pool {pool_id!r}: {num_blocks} blocks exceed max_blocks_per_pool "
            f"{limits.max_blocks_per_pool}"
        )
    if blocks_in_use + num_blocks > limits.max_total_blocks:
        raise ResourceExhaustedError(
            f"pool {pool_id!r}: {num_blocks} blocks on top of the {blocks_in_use} the server "
            f"holds exceed max_total_blocks {limits.max_total_blocks}"
        )
