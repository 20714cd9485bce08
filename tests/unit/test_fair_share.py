"""Water-filling of a cluster capacity (quotas/fair_share.py): worked examples, then properties."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotas.fair_share import Claim, FairShareError, validate_share, water_fill

GREEDY = 1e12  # a demand far above any capacity in these examples


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-9)


# -- worked examples ----------------------------------------------------------------------------


def test_three_one_one_all_greedy() -> None:
    claims = [Claim("a", GREEDY, 3), Claim("b", GREEDY, 1), Claim("c", GREEDY, 1)]
    assert water_fill(100, claims) == pytest.approx({"a": 60, "b": 20, "c": 20})


def test_one_stops_the_others_take_its_part() -> None:
    claims = [Claim("a", GREEDY, 3), Claim("b", GREEDY, 1), Claim("c", 0, 1)]
    assert water_fill(100, claims) == pytest.approx({"a": 75, "b": 25, "c": 0})


def test_one_under_its_share_keeps_its_demand() -> None:
    claims = [Claim("a", GREEDY, 3), Claim("b", GREEDY, 1), Claim("c", 5, 1)]
    assert water_fill(100, claims) == pytest.approx({"a": 71.25, "b": 23.75, "c": 5})


def test_kafka_cap_below_the_share_still_caps() -> None:
    claims = [Claim("a", GREEDY, 3, cap=30), Claim("b", GREEDY, 1), Claim("c", GREEDY, 1)]
    assert water_fill(100, claims) == pytest.approx({"a": 30, "b": 35, "c": 35})


def test_under_capacity_nobody_is_throttled() -> None:
    claims = [Claim("a", 10, 3), Claim("b", 500, 1, cap=20), Claim("c", 30, 1)]
    assert water_fill(100, claims) == {"a": 10, "b": 20, "c": 30}


def test_zero_capacity() -> None:
    assert water_fill(0, [Claim("a", 10), Claim("b", 0)]) == {"a": 0, "b": 0}


def test_empty_claims() -> None:
    assert water_fill(100, []) == {}
    assert water_fill(0, []) == {}


def test_single_claim() -> None:
    assert water_fill(100, [Claim("a", GREEDY, 7)]) == {"a": 100}
    assert water_fill(100, [Claim("a", 40, 7)]) == {"a": 40}
    assert water_fill(100, [Claim("a", GREEDY, 7, cap=60)]) == {"a": 60}


def test_result_follows_the_claims_order() -> None:
    claims = [Claim("z", GREEDY), Claim("a", 1), Claim("m", GREEDY, 2)]
    assert list(water_fill(10, claims)) == ["z", "a", "m"]


# -- invalid values -----------------------------------------------------------------------------

BAD_SHARES = [0, -1, 0.0, math.nan, math.inf, -math.inf, "2", True, False, None]


@pytest.mark.parametrize("value", BAD_SHARES, ids=repr)
def test_validate_share_refuses(value: object) -> None:
    with pytest.raises(FairShareError) as info:
        validate_share(value, "user=alice")
    assert str(info.value) == f"user=alice: share = {value!r} must be a number > 0"


@pytest.mark.parametrize("value", [1, 0.5, 3.0, 1e-6, 10**6])
def test_validate_share_accepts(value: float) -> None:
    share = validate_share(value, "user=alice")
    assert share == value and type(share) is float


@pytest.mark.parametrize("value", BAD_SHARES, ids=repr)
def test_claim_refuses_bad_share(value: object) -> None:
    with pytest.raises(FairShareError, match=r"user=alice: share = .* must be a number > 0") as info:
        Claim("user=alice", 1.0, value)  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [-1, -1e-9, math.nan, math.inf, "5", True])
def test_claim_refuses_bad_demand(value: object) -> None:
    with pytest.raises(FairShareError, match="demand for user=bob") as info:
        Claim("user=bob", value)  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, "5", True])
def test_claim_refuses_bad_cap(value: object) -> None:
    with pytest.raises(FairShareError, match="cap for user=bob") as info:
        Claim("user=bob", 1.0, 1.0, value)  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, "100", True])
def test_water_fill_refuses_bad_capacity(value: object) -> None:
    with pytest.raises(FairShareError, match="capacity") as info:
        water_fill(value, [Claim("a", 1.0)])  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


def test_water_fill_refuses_duplicate_keys() -> None:
    with pytest.raises(FairShareError, match="'a' appears more than once"):
        water_fill(10, [Claim("a", 1.0), Claim("b", 1.0), Claim("a", 2.0)])


# -- properties ---------------------------------------------------------------------------------

demands = st.one_of(st.just(0.0), st.floats(0, 1e6), st.just(GREEDY))
weights = st.floats(0.01, 100)
caps = st.one_of(st.none(), st.floats(0.01, 1e6))
capacities = st.one_of(st.just(0.0), st.floats(0, 1e6))


@st.composite
def claim_lists(draw: st.DrawFn, min_size: int = 0) -> list[Claim[int]]:
    specs = draw(st.lists(st.tuples(demands, weights, caps), min_size=min_size, max_size=12))
    return [Claim(i, d, w, c) for i, (d, w, c) in enumerate(specs)]


def slack(capacity: float) -> float:
    return 1e-9 * max(capacity, 1.0)


@given(capacities, claim_lists())
def test_never_more_than_capacity_demand_or_cap(capacity: float, claims: list[Claim[int]]) -> None:
    alloc = water_fill(capacity, claims)
    assert sum(alloc.values()) <= capacity + slack(capacity)
    for c in claims:
        assert 0 <= alloc[c.key] <= c.demand
        assert c.cap is None or alloc[c.key] <= c.cap


@given(capacities, claim_lists())
def test_work_conserving(capacity: float, claims: list[Claim[int]]) -> None:
    alloc = water_fill(capacity, claims)
    wanted = math.fsum(c.bound for c in claims)
    if wanted > capacity:
        assert math.fsum(alloc.values()) == pytest.approx(capacity, rel=1e-9, abs=1e-9)
    else:
        assert alloc == {c.key: c.bound for c in claims}


@given(capacities, claim_lists(min_size=2))
def test_weighted_max_min_fair(capacity: float, claims: list[Claim[int]]) -> None:
    alloc = water_fill(capacity, claims)
    per_share = {c.key: alloc[c.key] / c.weight for c in claims}
    for i in claims:
        for j in claims:
            if per_share[i.key] < per_share[j.key] * (1 - 1e-9) - 1e-12:
                assert close(alloc[i.key], i.bound), (i, j, alloc)


@given(capacities, claim_lists(min_size=2), st.data())
def test_more_demand_never_raises_another(
    capacity: float, claims: list[Claim[int]], data: st.DataObject
) -> None:
    k = data.draw(st.integers(0, len(claims) - 1))
    extra = data.draw(st.floats(0, 1e6))
    raised = [Claim(c.key, c.demand + extra, c.weight, c.cap) if c.key == k else c for c in claims]
    before, after = water_fill(capacity, claims), water_fill(capacity, raised)
    for c in claims:
        if c.key != k:
            assert after[c.key] <= before[c.key] + slack(capacity)


@given(capacities, claim_lists(), st.floats(1e-3, 1e3))
def test_scaling_shares_changes_nothing(capacity: float, claims: list[Claim[int]], factor: float) -> None:
    scaled = [Claim(c.key, c.demand, c.weight * factor, c.cap) for c in claims]
    before, after = water_fill(capacity, claims), water_fill(capacity, scaled)
    for c in claims:
        assert after[c.key] == pytest.approx(before[c.key], rel=1e-9, abs=slack(capacity))


@settings(max_examples=200)
@given(capacities, claim_lists(), st.randoms(use_true_random=False))
def test_order_changes_nothing(capacity: float, claims: list[Claim[int]], rng: random.Random) -> None:
    shuffled = list(claims)
    rng.shuffle(shuffled)
    assert water_fill(capacity, shuffled) == water_fill(capacity, claims)  # exactly, not approximately


@given(capacities, claim_lists())
def test_deterministic(capacity: float, claims: list[Claim[int]]) -> None:
    assert water_fill(capacity, claims) == water_fill(capacity, list(claims))


@given(st.lists(st.floats(0.01, 100), min_size=1, max_size=12), st.floats(1, 1e6))
def test_all_greedy_split_by_share(shares: list[float], capacity: float) -> None:
    claims = [Claim(i, GREEDY, w) for i, w in enumerate(shares)]
    alloc = water_fill(capacity, claims)
    total = math.fsum(shares)
    for c in claims:
        assert alloc[c.key] == pytest.approx(capacity * c.weight / total, rel=1e-9)
