"""kvcm.core.pd_route: the P/D ranking from two lookup answers, and the query's checks."""

from __future__ import annotations

import pytest

from kvcm.common.errors import InvalidArgumentError
from kvcm.core.lookup import LookupAnswer, LookupQuery, PoolHit, PoolLoad
from kvcm.core.pd_route import HeldRequest, PdRouteQuery, PdScope, rank_pd

N = 100  # prompt tokens


def _hit(
    pool_id: str, hit: int, usage: float = 0.0, waiting: int = 0, weight: float = 0.5
) -> PoolHit:
    load = PoolLoad(usage=usage, num_free_blocks=10, num_running=0, num_waiting=waiting)
    return PoolHit(pool_id, hit, (hit,), {"GPU": hit}, N, load, hit / N - weight * usage)


def _answer(*hits: PoolHit) -> LookupAnswer:
    ranked = sorted(hits, key=lambda h: (-h.score, h.load.num_waiting, h.load.usage, h.pool_id))
    return LookupAnswer(tuple(ranked), (), len(hits))


def _query(bidirectional: bool = False, max_results: int = 0, **extra: object) -> PdRouteQuery:
    return PdRouteQuery(
        prompt=LookupQuery(token_ids=list(range(N)), max_results=max_results),
        prefill=PdScope(labels={"role": "prefill"}),
        decode=PdScope(labels={"role": "decode"}),
        bidirectional=bidirectional,
        **extra,  # type: ignore[arg-type]
    )


def test_without_bidirectional_each_role_ranks_on_its_own_hit_and_load() -> None:
    prefill = _answer(_hit("p0", 16), _hit("p1", 48, usage=0.2), _hit("p2", 48))
    decode = _answer(_hit("d0", 32), _hit("d1", 64, usage=0.1))
    route = rank_pd(_query(), prefill, decode)
    assert [h.pool_id for h in route.prefill] == ["p2", "p1", "p0"]
    assert [h.pool_id for h in route.decode] == ["d1", "d0"]
    assert (route.decode_hit_tokens, route.decode_pull_tokens) == (64, N - 64)
    assert route.remote_num_tokens == 0
    assert route.prefill_compute_tokens == N - 48


def test_bidirectional_credits_every_prefill_with_the_decode_hit_and_breaks_ties_on_own_hit() -> (
    None
):
    prefill = _answer(_hit("p0", 0), _hit("p1", 16), _hit("p2", 80, usage=0.3))
    decode = _answer(_hit("d0", 64))
    route = rank_pd(_query(bidirectional=True), prefill, decode)
    # p0 and p1 both reach 64 tokens (pulled); p1 holds 16 itself; p2 holds 80 but is busy:
    # 0.8 - 0.15 = 0.65 > 0.64.
    assert [h.pool_id for h in route.prefill] == ["p2", "p1", "p0"]
    assert route.prefill[1].score == route.prefill[2].score == pytest.approx(0.64)
    assert route.remote_num_tokens == 64
    assert route.prefill_compute_tokens == N - 80
    cut = rank_pd(_query(bidirectional=True, max_results=1), prefill, decode)
    assert [h.pool_id for h in cut.prefill] == ["p2"]


def test_held_answers_replace_the_pool_hit_as_the_credit() -> None:
    prefill = _answer(_hit("p0", 0))
    decode = _answer(_hit("d0", 64))
    query = _query(bidirectional=True, held=(HeldRequest("d0", "r1"), HeldRequest("d1", "r2")))
    assert query.held_on("d0") == ["r1"]
    route = rank_pd(query, prefill, decode, ("r1", 32))
    assert (route.held_request_id, route.remote_num_tokens) == ("r1", 32)
    assert route.prefill_compute_tokens == N - 32
    none = rank_pd(query, prefill, decode, None)
    assert (none.held_request_id, none.remote_num_tokens) == ("", 0)


def test_empty_roles_answer_zeros() -> None:
    route = rank_pd(_query(), _answer(), _answer())
    assert route.prefill == route.decode == ()
    assert (route.num_tokens, route.decode_pull_tokens, route.prefill_compute_tokens) == (0, 0, 0)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"prefill": PdScope()}, "prefill_scope"),
        ({"decode": PdScope(pool_ids=[""])}, "decode_scope.pool_ids[0]"),
        ({"decode": PdScope(labels={"bad key": "v"})}, "decode_scope.labels"),
        ({"held": (HeldRequest("d0", "r"),)}, "held"),
        ({"bidirectional": True, "held": (HeldRequest("", "r"),)}, "held[0].pool_id"),
        ({"bidirectional": True, "held": (HeldRequest("d", "r"),) * 1025}, "held"),
        ({"prompt": LookupQuery(token_ids=[1], pool_ids=["x"])}, "prompt"),
    ],
)
def test_bad_queries_name_the_field(extra: dict[str, object], field: str) -> None:
    fields: dict[str, object] = {
        "prompt": LookupQuery(token_ids=[1, 2]),
        "prefill": PdScope(pool_ids=["p"]),
        "decode": PdScope(pool_ids=["d"]),
        **extra,
    }
    with pytest.raises(InvalidArgumentError) as caught:
        PdRouteQuery(**fields)  # type: ignore[arg-type]
    assert caught.value.field == field
