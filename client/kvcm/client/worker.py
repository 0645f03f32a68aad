"""WorkerClient: a GPU worker registers its rank and allocates its KV-cache tensors.

Every rank of a pool calls ``register`` with its layers' specs and the memory it can give the
KV cache. The call returns once every rank has registered, with the same unified
``KVCacheConfig`` for all (groups, ``num_blocks`` = the minimum over ranks) and this rank's
tensors; ``allocate`` then builds the torch tensors locally (``kvcm.client.tensors``). The
engine settings planning reads (the hybrid manager's switch, the encoder budget,
``kv_cache_memory_bytes``, auto-fit, the layout) are the pool's, set when the launcher
creates it (``PoolConfig``; docs/planning.md, "Planning inputs").

::

    with WorkerClient("kvcm:50051") as worker:
        registration = worker.register("engine-0", rank, world_size, layer_specs, free_bytes)
        kv_caches = worker.allocate(registration, device="cuda:0")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcm.client._base import RETRY_POLICY, ChannelClient, RetryPolicy, Timeout, TlsConfig
from kvcm.client._types import REGISTER_WORKER_TIMEOUT_S, USE_CLIENT_DEFAULT, HashingParameters
from kvcm.common.errors import InvalidArgumentError
from kvcm.common.specs import check_plannable_spec
from kvcm.v1 import worker_pb2
from kvcm.wire import hashing_from_proto, kv_cache_config_from_proto, layer_specs_to_proto

if TYPE_CHECKING:
    import torch

    from kvcm.common.config import KVCacheConfig
    from kvcm.common.specs import KVCacheSpec

__all__ = ["WorkerClient", "WorkerRegistration"]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerRegistration:
    """What a rank learns from registering.

    Attributes:
        pool_id: The pool.
        rank: This worker's rank.
        kv_cache_config: The unified config; ``kv_cache_tensors`` are this rank's.
        hashing: How the pool hashes blocks (for KV connectors).
        max_model_len: The pool's context length, in tokens.
    """

    pool_id: str
    rank: int
    kv_cache_config: KVCacheConfig
    hashing: HashingParameters
    max_model_len: int


class WorkerClient(ChannelClient):
    """Synchronous client of a kvcm server's worker service.

    ``close`` and the context manager are the channel client's (``kvcm.client._base``).

    Attributes:
        target: The server's address.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = REGISTER_WORKER_TIMEOUT_S,
        retry_policy: RetryPolicy = RETRY_POLICY,
        channel_options: Sequence[tuple[str, Any]] = (),
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        """Open a channel to ``target`` (connecting lazily, on the first call).

        Args:
            target: ``host:port`` of the server.
            timeout: Deadline of ``register``, in seconds: how long to wait for the other
                ranks (the server drops a registration whose call ends before every rank
                registered: calling again registers anew).
            retry_policy: Retries of ``RegisterWorker`` (idempotent) on UNAVAILABLE.
            channel_options: Extra gRPC channel options.
            tls: TLS (server roots; a client certificate for mutual TLS); ``None``: plaintext.
            token: A bearer token sent with every call (a server with ``auth_tokens``).

        Raises:
            InvalidArgumentError: ``target`` is empty or ``timeout`` is not positive.
        """
        super().__init__(
            target,
            timeout=timeout,
            retry_policy=retry_policy,
            channel_options=channel_options,
            tls=tls,
            token=token,
        )

    def register(
        self,
        pool_id: str,
        rank: int,
        world_size: int,
        layer_specs: Mapping[str, KVCacheSpec],
        available_memory_bytes: int,
        *,
        timeout: Timeout = USE_CLIENT_DEFAULT,
    ) -> WorkerRegistration:
        """Register this rank and wait until every rank of the pool has.

        Args:
            pool_id: The pool (created by the launcher with ``world_size`` ranks).
            rank: This worker's rank, in ``[0, world_size)``.
            world_size: Ranks of the pool.
            layer_specs: Every layer this rank holds KV cache for (vLLM's
                ``get_kv_cache_spec()``), by layer name, in the model runner's order (the
                mapping's order is kept: it decides groups, tensor order and offsets).
            available_memory_bytes: Bytes this rank can give the KV cache.
            timeout: How long to wait for the other ranks, in seconds.

        Returns:
            The unified config, this rank's tensors and the pool's hashing parameters.

        Raises:
            InvalidArgumentError: No layers, or a spec kvcm cannot plan (a Mamba cache mode
                other than "none" or "align", a page larger than a uint64), checked before
                anything is sent.
            DeadlineExceededError: Not every rank registered in time, or within the server's
                registration timeout (this registration is dropped: call again).
            ServiceAlreadyExistsError: This rank registered before with other specs, layer
                order or memory.
            ServiceInvalidArgumentError: Bad rank, world size, memory or specs, or the ranks'
                specs cannot be planned together, or not with the pool's planning inputs
                (e.g. cross attention in a pool without an encoder budget): every waiting
                rank gets the error and must register again.
            ServiceFailedPreconditionError: The specs disagree with the pool's layout or other
                ranks.
            ServiceResourceExhaustedError: The memory holds fewer than 2 blocks or more than
                the server's block limit (every waiting rank gets it), or the pool holds its
                limit of pending registrations.
        """
        if not layer_specs:
            raise InvalidArgumentError("layer_specs must not be empty", field="layer_specs")
        for name, spec in layer_specs.items():
            check_plannable_spec(name, spec)
        request = worker_pb2.RegisterWorkerRequest(
            pool_id=pool_id,
            rank=rank,
            world_size=world_size,
            layer_specs=layer_specs_to_proto(layer_specs),
            available_memory_bytes=available_memory_bytes,
        )
        stub = self._stubs.worker.RegisterWorker
        response = self._unary("RegisterWorker", stub, request, timeout)
        return WorkerRegistration(
            pool_id=pool_id,
            rank=rank,
            kv_cache_config=kv_cache_config_from_proto(response.kv_cache_config),
            hashing=hashing_from_proto(response.hashing),
            max_model_len=response.max_model_len,
        )

    def allocate(
        self, registration: WorkerRegistration, *, device: torch.device | str = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Allocate this rank's KV-cache tensors for a registration (imports torch).

        Args:
            registration: What ``register`` answered.
            device: The torch device (``"cpu"``, ``"cuda:0"``, ...).

        Returns:
            ``{layer name: tensor}``: views of one zeroed backing buffer, placed as the config
            says (``kvcm.client.tensors.allocate_kv_cache_tensors``).
        """
        from kvcm.client.tensors import allocate_kv_cache_tensors

        return allocate_kv_cache_tensors(registration.kv_cache_config, device=device)

    @staticmethod
    def apply_block_mappings(
        kv_caches: Mapping[str, torch.Tensor],
        *,
        copies: Sequence[tuple[int, int]] = (),
        host_blocks: Mapping[str, torch.Tensor] | None = None,
        device_to_host: Sequence[tuple[int, int]] = (),
        host_to_device: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Run one step's block mappings on this worker's tensors, before its forward pass.

        The order is the one the core's decisions need: device-to-host copies (a demoted or
        swapped-out block may be the block a load or a copy of the same step writes into),
        then host-to-device loads, then copy-on-write copies within the device (a copy may
        read a block loaded in the same step). Each stage is one gather and one scatter per
        layer (``kvcm.client.tensors.copy_block_pages``).

        Args:
            kv_caches: The device layers (``allocate`` answered them).
            copies: ``(source, destination)`` device block ids (fork copy-on-write).
            host_blocks: The host tier's layers (``kvcm.client.tensors.allocate_host_blocks``);
                needed with swaps.
            device_to_host: ``(device_block_id, host_block_id)`` pairs.
            host_to_device: ``(host_block_id, device_block_id)`` pairs.

        Raises:
            InvalidArgumentError: A block id is out of range, a destination appears twice in
                a stage, or swaps come without host blocks.
        """
        from kvcm.client.tensors import copy_block_pages

        if (device_to_host or host_to_device) and host_blocks is None:
            raise InvalidArgumentError("host_blocks: swaps need the host tier's layers")
        if host_blocks is not None:
            copy_block_pages(kv_caches, host_blocks, device_to_host, field="device_to_host")
            copy_block_pages(host_blocks, kv_caches, host_to_device, field="host_to_device")
        copy_block_pages(kv_caches, kv_caches, copies)
