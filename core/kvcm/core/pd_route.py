"""P/D routing: the prefill and the decode engine for one prompt, on exact prefix hits.

A disaggregated prefill/decode (P/D) proxy sends each request first to a prefill engine (which
computes the prompt and holds its blocks) and then to a decode engine (which pulls the blocks it
lacks and generates). Both choices are made here from two exact lookups
(:mod:`kvcm.core.lookup`), one over the prefill pools and one over the decode pools:

* **decode**, ranked as Lookup ranks: ``num_hit_tokens / num_tokens - load_weight * usage``.
  The best decode engine's own hit is what it will not pull (vLLM's NIXL connector pulls the
  prompt minus the decode engine's local hit, as external tokens with delayed caching).
* **prefill**: ``max(num_hit_tokens, credit) / num_tokens - load_weight * usage``. Without
  bidirectional transfers ``credit`` is 0: the engine computes what it does not hold. With
  them (vLLM's ``bidirectional_kv_xfer``) a prefill engine pulls what the chosen decode engine
  already holds, so ``credit`` is that decode engine's hit (``remote_num_tokens``).

Ties, in both roles: the larger own hit, then fewer waiting requests, lower usage, the smaller
pool id.

``remote_num_tokens`` is what vLLM's prefill engine reads from the decode engine's held blocks
(``min(remote_num_tokens, prompt) - its own hit`` tokens, from the start of
``remote_block_ids``). The decode pool's hit is exact for the pool, but only the blocks of the
request the decode engine holds can be read; with ``held`` (the requests decode engines hold),
:func:`held_prefix` finds, on the best decode pool, the held request whose blocks match the
longest prefix of the prompt, hash by hash, and ``remote_num_tokens`` is that prefix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NamedTuple, TypeVar

from kvcm.common.errors import InvalidArgumentError, KVCMError
from kvcm.common.hashing import BlockHash
from kvcm.core.lookup import LookupAnswer, LookupQuery, PoolHit, Profile, hash_prompt
from kvcm.core.pool_types import PoolState

if TYPE_CHECKING:
    from kvcm.core.pool import Pool

__all__ = [
    "MAX_HELD_REQUESTS",
    "HeldRequest",
    "PdRoute",
    "PdRouteQuery",
    "PdScope",
    "by_role",
    "held_prefix",
    "rank_pd",
]

MAX_HELD_REQUESTS: Final = 1024
E = TypeVar("E", bound=KVCMError)


def by_role(error: E, role: str) -> E:
    """A role's lookup ``error`` naming the role's field (``prefill_scope.pool_ids[1]``)
    instead of Lookup's ``scope``; it always names a field (``""``: the call as a whole)."""
    renamed = error.rerooted("scope", role)
    if renamed.path is None:
        renamed.field = ""
    return renamed


class HeldRequest(NamedTuple):
    """A request a decode engine holds for a later pull (vLLM's bidirectional transfers).

    Attributes:
        pool_id: The decode pool.
        request_id: The request's id there (vLLM's ``remote_request_id``).
    """

    pool_id: str
    request_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PdScope:
    """The pools of one role: these ids and/or the pools whose labels include these.

    Attributes:
        pool_ids: These pools.
        labels: Pools whose labels include every one of these.
    """

    pool_ids: Sequence[str] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class PdRouteQuery:
    """One prompt and the prefill and decode pools to route it over.

    Attributes:
        prompt: The prompt, the load weight and the limit, as a :class:`LookupQuery` whose own
            scope is empty (``max_results`` applies to each role).
        prefill: The prefill engines' pools (an empty scope is refused: it would be every pool).
        decode: The decode engines' pools (likewise).
        bidirectional: Prefill engines may pull what the chosen decode engine holds (vLLM's
            ``bidirectional_kv_xfer``).
        held: Bidirectional only: the requests decode engines hold for a pull (at most
            ``MAX_HELD_REQUESTS``).
    """

    prompt: LookupQuery
    prefill: PdScope
    decode: PdScope
    bidirectional: bool = False
    held: Sequence[HeldRequest] = ()

    def __post_init__(self) -> None:
        if self.prompt.pool_ids or self.prompt.labels:
            raise InvalidArgumentError(
                "prompt: the scope is given per role (prefill_scope, decode_scope), not in the "
                "prompt's query",
                field="prompt",
            )
        for name, scope in (("prefill_scope", self.prefill), ("decode_scope", self.decode)):
            if not scope.pool_ids and not scope.labels:
                raise InvalidArgumentError(
                    f"{name} is empty: name the role's pools (pool_ids) or labels",
                    field=name,
                )
        self._check_held()
        # The per-role lookups validate the scopes themselves; name the role's field.
        for name in ("prefill_scope", "decode_scope"):
            try:
                self.role_query(name)
            except InvalidArgumentError as exc:
                raise by_role(exc, name) from None

    def _check_held(self) -> None:
        if not self.held:
            return
        if not self.bidirectional:
            raise InvalidArgumentError(
                "held is for bidirectional routes (set bidirectional)", field="held"
            )
        if len(self.held) > MAX_HELD_REQUESTS:
            raise InvalidArgumentError(
                f"held has {len(self.held)} requests, at most {MAX_HELD_REQUESTS} are allowed",
                field="held",
            )
        for index, item in enumerate(self.held):
            for name in ("pool_id", "request_id"):
                value = getattr(item, name, None)
                if not isinstance(value, str) or not value:
                    raise InvalidArgumentError(
                        f"held[{index}].{name} must be a non-empty string, got {value!r}",
                        field=f"held[{index}].{name}",
                    )

    def held_on(self, pool_id: str) -> list[str]:
        """The ids of the held requests on ``pool_id``."""
        return [item.request_id for item in self.held if item.pool_id == pool_id]

    def role_query(self, role: str) -> LookupQuery:
        """The lookup of one role (``"prefill_scope"`` or ``"decode_scope"``): the prompt over
        that role's scope.

        The prefill lookup of a bidirectional query answers every pool (its ranking depends on
        the decode answer); the limit is applied by :func:`rank_pd`.
        """
        scope = self.prefill if role == "prefill_scope" else self.decode
        limit = self.prompt.max_results
        if self.bidirectional and role == "prefill_scope":
            limit = 0
        return dataclasses.replace(
            self.prompt,
            pool_ids=tuple(scope.pool_ids),
            labels=dict(scope.labels),
            max_results=limit,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PdRoute:
    """The answer to a :class:`PdRouteQuery`.

    Attributes:
        prefill: Prefill pools, best first (``score`` is the prefill score; ``num_hit_tokens``
            the pool's own hit).
        decode: Decode pools, best first (Lookup's answer).
        skipped: Pools of either scope that could not be answered, and why.
        num_tokens: The prompt's length in tokens (0 when no pool answered).
        decode_hit_tokens: The best decode engine's own hit: tokens it will not pull.
        decode_pull_tokens: Tokens the best decode engine pulls from the prefill engine.
        remote_num_tokens: Bidirectional: what the best prefill engine may pull from the best
            decode engine (vLLM's ``kv_transfer_params["remote_num_tokens"]``); 0 otherwise.
        held_request_id: With ``held``: the held request ``remote_num_tokens`` reads from
            (``""``: none on the best decode pool).
        prefill_compute_tokens: Tokens the best prefill engine computes.
        num_prefill_pools_in_scope: Pools the prefill scope matched.
        num_decode_pools_in_scope: Pools the decode scope matched.
        missing_replicas: In a kvcm cluster, the replicas that did not answer their part in
            time (as :attr:`LookupAnswer.missing_replicas`; not compared).
    """

    prefill: tuple[PoolHit, ...]
    decode: tuple[PoolHit, ...]
    skipped: tuple[tuple[str, str], ...]
    num_tokens: int
    decode_hit_tokens: int
    decode_pull_tokens: int
    remote_num_tokens: int
    prefill_compute_tokens: int
    num_prefill_pools_in_scope: int
    num_decode_pools_in_scope: int
    held_request_id: str = ""
    missing_replicas: tuple[str, ...] = field(default=(), compare=False)


def _prefill_key(hit: PoolHit) -> tuple[float, int, int, float, str]:
    # Sorted ascending: the best first.
    return (-hit.score, -hit.num_hit_tokens, hit.load.num_waiting, hit.load.usage, hit.pool_id)


def held_prefix(
    pool: Pool,
    request_ids: Sequence[str],
    prompt: LookupQuery,
    hashed: Mapping[Profile, Sequence[BlockHash]] | None = None,
) -> tuple[str, int]:
    """Of ``request_ids`` held in ``pool``, the one whose blocks hold the longest prefix of the
    prompt, and that prefix in tokens (``("", 0)``: none holds any).

    A block counts when the request still holds it in its first KV-cache group, it is cached
    (its content is complete: ``block_hash`` set), and the request's block hash there equals
    the prompt's; the prefix stops at the first block that fails, and is capped, as a hit is, at
    ``num_tokens - 1`` in whole blocks. Pools whose block size differs from their hash block
    size, pools not READY and pools lent to a long call answer ``("", 0)``. Cost: one pass over
    the pool's request ids, then O(blocks matched) per held request.

    ``hashed``: the prompt's hashes by profile, from :func:`~kvcm.core.lookup.hash_prompt`
    (a server makes them once per call, off its event loop for long prompts); the pool's
    profile missing: hashed here.
    """
    manager = pool.manager
    if manager is None or pool.state is not PoolState.READY or pool.lent or not request_ids:
        return "", 0
    block_size = pool.hashing.hash_block_size
    config = pool.kv_cache_config
    if config is None or config.kv_cache_groups[0].kv_cache_spec.block_size != block_size:
        return "", 0
    hashing = pool.hashing
    # Profile's fields (kvcm.core.lookup): the parameters that give a prompt these hashes.
    profile: Profile = (
        hashing.algorithm,
        hashing.seed,
        hashing.hash_block_size,
        hashing.hash_length_bytes,
        hashing.num_lookahead_tokens,
    )
    if hashed is None or profile not in hashed:
        hashed = hash_prompt([pool], prompt)
    prompt_hashes = hashed.get(profile)
    if not prompt_hashes:
        return "", 0
    num_tokens = len(prompt.token_ids) if prompt.token_ids is not None else prompt.num_tokens
    if not num_tokens:
        num_tokens = len(prompt_hashes) * block_size + 1
    cap = min(len(prompt_hashes), (num_tokens - 1) // block_size)
    wanted = set(request_ids)
    best_id, best = "", 0
    for key, request_id in pool.request_ids.items():
        if request_id not in wanted:
            continue
        request = pool.requests.get(key)
        if request is None:
            continue
        # NOTE: the manager knows the request by the pool's key (Request.request_id), not by
        # the caller's id (pool.request_ids).
        blocks = manager.get_blocks(request.request_id).blocks[0]
        limit = min(cap, len(blocks), len(request.block_hashes))
        matched = 0
        while (
            matched < limit
            and request.block_hashes[matched] == prompt_hashes[matched]
            and not blocks[matched].is_null
            and blocks[matched].block_hash is not None
        ):
            matched += 1
        if matched > best or (matched == best and matched and request_id < best_id):
            best_id, best = request_id, matched
    return best_id, best * block_size


def rank_pd(
    query: PdRouteQuery,
    prefill: LookupAnswer,
    decode: LookupAnswer,
    held: tuple[str, int] | None = None,
) -> PdRoute:
    """Rank both roles from their lookups (``query.role_query`` of each role).

    Args:
        query: The routing query.
        prefill: The lookup answer over the prefill scope.
        decode: The lookup answer over the decode scope.
        held: With ``query.held``: :func:`held_prefix`'s answer on the best decode pool (the
            first of ``decode``) for :meth:`PdRouteQuery.held_on` that pool (``None``: none).

    Returns:
        Both rankings and the figures of the best pair.
    """
    best_decode = decode.pools[0] if decode.pools else None
    credit = 0
    held_id = ""
    if query.bidirectional and best_decode is not None:
        if query.held:
            if held is not None:
                held_id, credit = held
        else:
            credit = best_decode.num_hit_tokens
    weight = query.prompt.load_weight
    ranked = list(prefill.pools)
    if credit:
        ranked = [
            hit._replace(
                score=max(hit.num_hit_tokens, credit) / hit.num_tokens - weight * hit.load.usage
            )
            for hit in ranked
        ]
    ranked.sort(key=_prefill_key)
    if query.prompt.max_results:
        del ranked[query.prompt.max_results :]
    best_prefill = ranked[0] if ranked else None
    if best_decode is not None:
        num_tokens = best_decode.num_tokens
    elif best_prefill is not None:
        num_tokens = best_prefill.num_tokens
    else:
        num_tokens = 0
    decode_hit = best_decode.num_hit_tokens if best_decode is not None else 0
    prefill_hit = best_prefill.num_hit_tokens if best_prefill is not None else 0
    return PdRoute(
        prefill=tuple(ranked),
        decode=decode.pools,
        skipped=prefill.skipped + decode.skipped,
        num_tokens=num_tokens,
        decode_hit_tokens=decode_hit,
        decode_pull_tokens=num_tokens - decode_hit if best_decode is not None else 0,
        remote_num_tokens=credit,
        prefill_compute_tokens=num_tokens - max(prefill_hit, credit) if best_prefill else 0,
        num_prefill_pools_in_scope=prefill.num_pools_in_scope,
        num_decode_pools_in_scope=decode.num_pools_in_scope,
        held_request_id=held_id,
    )
