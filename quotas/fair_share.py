"""Weighted max-min fair sharing of a cluster capacity (water-filling), the pure arithmetic.

Kafka's quotas are static caps per entity. Above them sits an optional capacity C per direction
for the whole fleet (DESIGN.md "Cluster capacity"). While the active entities' demand fits in C,
nothing changes. Above it, C is shared by *water-filling*: raise a common water level L; entity i
gets min(demand_i, cap_i, share_i x L), and L is chosen so the allocations add up to C. An entity
whose demand (or its own Kafka quota) is under its weighted share keeps what it asks for; what it
leaves unused goes to the others, by their shares (work-conserving).

Guarantees (up to float rounding, and pinned by tests/unit/test_fair_share.py):
- nobody gets more than its demand or its cap; the allocations never add up to more than C;
- when the capped demand exceeds C, the allocations add up to C: nothing is left idle;
- weighted max-min fair: an entity with a lower allocation per share than another is satisfied;
- raising one demand never raises anyone else's allocation;
- scaling every share by one constant changes nothing; the order of the claims changes nothing
  (exactly: ties are summed with `math.fsum`); O(n log n).

Worked example, C = 100, shares 3:1:1 for a, b, c:
- all greedy: L = 20, so a gets 60, b 20, c 20;
- c stops (demand 0): L = 25, so a gets 75 and b 25;
- c only wants 5: c keeps 5, and a and b split the other 95 3:1 (71.25 and 23.75).
A Kafka quota stays a hard cap: with a capped at 30 in the first case, b and c get 35 each.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Generic, TypeVar

#: The entity setting that gives an entity its weight when the cluster capacity is shared
#: (`EntitySetting.SHARE`, whose one rule is `validate_share`).
SHARE_KEY = "share"

K = TypeVar("K", bound=Hashable)


class FairShareError(ValueError):
    """A capacity, demand, share or cap that water-filling cannot use; the message names it."""


def _number(value: object) -> float | None:
    """`value` as a float if it is a finite number, else None."""
    # bool is an int, but `share = true` is a config mistake, not a weight of 1
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def validate_share(value: object, where: str) -> float:
    """The `share` setting's one rule, wherever it is set: a finite number > 0 (bools and strings
    refused). `where` names the entity (and the source), first in the message.

    Shares are relative weights, so any positive scale works; 0 is refused rather than read as
    "never served", which would let one config line starve an entity.
    """
    share = _number(value)
    if share is None or share <= 0:
        raise FairShareError(f"{where}: {SHARE_KEY} = {value!r} must be a number > 0")
    return share


@dataclass(frozen=True, slots=True)
class Claim(Generic[K]):
    """One active entity's claim on the capacity, checked when built (a Claim is always usable).

    `demand` is the rate it would use unthrottled (units/s); `weight` its `share`; `cap` its own
    Kafka quota, a hard cap that sharing never lifts (None: no quota).
    """

    key: K
    demand: float
    weight: float = 1.0
    cap: float | None = None

    def __post_init__(self) -> None:
        validate_share(self.weight, str(self.key))
        demand = _number(self.demand)
        if demand is None or demand < 0:
            raise FairShareError(f"demand for {self.key}: {self.demand!r} must be a number >= 0")
        cap = _number(self.cap)
        if self.cap is not None and (cap is None or cap <= 0):
            raise FairShareError(f"cap for {self.key}: {self.cap!r} must be a number > 0 or None")

    @property
    def bound(self) -> float:
        """The most it can use: its demand, or its cap if lower."""
        return self.demand if self.cap is None else min(self.demand, self.cap)


def water_fill(capacity: float, claims: Sequence[Claim[K]]) -> dict[K, float]:
    """Each claim's fair allocation of `capacity` (see the module docstring for the rules).

    Claims are sorted by bound/weight, the water level at which each is satisfied, and walked
    once: a group of equal levels is satisfied if the water, spread over everyone not yet
    satisfied, reaches it; the first group it does not reach, and all after it, get weight x L.
    """
    if _number(capacity) is None or capacity < 0:
        raise FairShareError(f"capacity: {capacity!r} must be a number >= 0")
    seen: set[K] = set()
    for c in claims:
        if c.key in seen:  # the result is keyed by entity: two claims of one would overwrite
            raise FairShareError(f"claims: {c.key!r} appears more than once")
        seen.add(c.key)
    if math.fsum(c.bound for c in claims) <= capacity:
        return {c.key: c.bound for c in claims}  # capacity throttles nobody

    ordered = sorted(claims, key=lambda c: c.bound / c.weight)
    groups = [list(g) for _, g in groupby(ordered, key=lambda c: c.bound / c.weight)]
    group_bounds = [math.fsum(c.bound for c in g) for g in groups]
    # weight still unsatisfied from group i on; summed from the end, positives only, so accurate
    weight_from = [0.0] * (len(groups) + 1)
    for i in range(len(groups) - 1, -1, -1):
        weight_from[i] = weight_from[i + 1] + math.fsum(c.weight for c in groups[i])

    allocation: dict[K, float] = {}
    used = 0.0
    for i, group in enumerate(groups):
        level = max(capacity - used, 0.0) / weight_from[i]
        if group[0].bound / group[0].weight > level:
            for rest in groups[i:]:
                for c in rest:  # min(): w x (R/W) may round an ulp above the bound
                    allocation[c.key] = min(c.bound, c.weight * level)
            break
        for c in group:
            allocation[c.key] = c.bound
        used += group_bounds[i]
    return {c.key: allocation[c.key] for c in claims}
