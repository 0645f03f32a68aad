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
pool id. Nothing here reads a clock or a pool: the inputs are two :class:`LookupAnswer`\\ s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvcm.common.errors import InvalidArgumentError
from kvcm.core.lookup import LookupAnswer, LookupQuery, PoolHit

__all__ = ["PdRoute", "PdRouteQuery", "PdScope", "rank_pd"]


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
    """

    prompt: LookupQuery
    prefill: PdScope
    decode: PdScope
    bidirectional: bool = False

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
        # The per-role lookups validate the scopes themselves; name the role's field.
        for name in ("prefill_scope", "decode_scope"):
            try:
                self.role_query(name)
            except InvalidArgumentError as exc:
                where = (exc.field or "").replace("scope.", f"{name}.", 1)
                message = str(exc.args[0] if exc.args else exc).replace("scope.", f"{name}.", 1)
                raise InvalidArgumentError(message, field=where) from None

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
        prefill_compute_tokens: Tokens the best prefill engine computes.
        num_prefill_pools_in_scope: Pools the prefill scope matched.
        num_decode_pools_in_scope: Pools the decode scope matched.
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


def _prefill_key(hit: PoolHit) -> tuple[float, int, int, float, str]:
    # Sorted ascending: the best first.
    return (-hit.score, -hit.num_hit_tokens, hit.load.num_waiting, hit.load.usage, hit.pool_id)


def rank_pd(query: PdRouteQuery, prefill: LookupAnswer, decode: LookupAnswer) -> PdRoute:
    """Rank both roles from their lookups (``query.role_query`` of each role).

    Args:
        query: The routing query.
        prefill: The lookup answer over the prefill scope.
        decode: The lookup answer over the decode scope.

    Returns:
        Both rankings and the figures of the best pair.
    """
    best_decode = decode.pools[0] if decode.pools else None
    credit = 0
    if query.bidirectional and best_decode is not None:
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
    )
