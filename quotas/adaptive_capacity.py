"""Adaptive capacity: scale the cluster capacity with the brokers' health (AIMD), the pure half.

The proxy sees every response: how long each broker took for each Produce and Fetch, and the
errors a broker under strain answers with. Once per tick (a second) this controller compares them
with what is healthy and moves a factor in [min_fraction, 1] that scales the capacity
(capacity.py).

Strain is the brokers', never a client's (issue 27). The factor cuts what every tenant may use, so
only signals a client cannot make on its own move it:
- **Strain errors** are the broker's own trouble: REQUEST_TIMED_OUT (its purgatory expired the
  request), NOT_ENOUGH_REPLICAS[_AFTER_APPEND] (replication fell behind). A client's own mistakes
  are not strain: NOT_LEADER_OR_FOLLOWER after stale metadata or a misrouted request,
  UNKNOWN_TOPIC_OR_PARTITION, authorization errors. A broker answers those at once, whatever its
  load, so they say nothing of it.
- **More than one tenant.** A signal counts only when at least MIN_STRAINED_TENANTS tenants saw it
  in the tick: responses over the latency limit, or strain errors. One tenant's own large requests
  are slow for that tenant alone; a broker that is really strained is slow for everyone it serves.
  A tenant is what the capacity shares by (capacity.py), so one tenant's many client ids or
  connections count once.

How it judges:
- **Baseline.** Per (broker, API), the p99 response time of the ticks when the load is light
  (the caller says so: below half the capacity), smoothed: fast down, slowly up
  (BASELINE_ALPHA_DOWN / _UP). A baseline is only learned while light, and rises slowly, so a
  cluster that is slow because it is busy never teaches the controller that slow is normal.
- **Degraded** when some (broker, API) with at least MIN_SAMPLES responses in the tick has its p99
  above `latency_tolerance` x its baseline + LATENCY_SLACK_MS (the slack keeps a 2 ms baseline
  from calling 5 ms a storm), or when the strain errors reach ERROR_RATIO of the tick's responses.
- **AIMD.** Degraded for DEGRADED_TICKS seconds in a row: the factor is multiplied by
  `decrease_factor` (0.7), at most once per DECREASE_INTERVAL_TICKS, so the previous cut shows its
  effect first (one degraded second alone holds the factor). Healthy: it grows by
  `increase_step` (0.1) per tick back to 1, so from `min_fraction` (0.1) within 9 s (the issue's
  bound is 20 s). It converges like TCP's congestion control: cut fast
  on trouble, probe back slowly. A latency gradient (Netflix's Gradient2) was compared on the
  overload bed (docs/protecting-the-cluster.md).

Every change is returned as a FactorChange naming its signal, for the metric and the INFO log.
Lower-share tenants lose first by construction: a smaller capacity is water-filled by the same
weights, so the gold tenant (high share, small demand) keeps its whole demand longest.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

#: Kafka error codes that say the broker itself is under strain (its request purgatory, its
#: replication). Client mistakes (NOT_LEADER_OR_FOLLOWER = 6, UNKNOWN_TOPIC_OR_PARTITION = 3,
#: TOPIC_AUTHORIZATION_FAILED = 29, ...) are deliberately absent: see the module's docstring.
REQUEST_TIMED_OUT = 7
NOT_ENOUGH_REPLICAS = 19
NOT_ENOUGH_REPLICAS_AFTER_APPEND = 20
STRAIN_ERRORS: dict[int, str] = {
    REQUEST_TIMED_OUT: "REQUEST_TIMED_OUT",
    NOT_ENOUGH_REPLICAS: "NOT_ENOUGH_REPLICAS",
    NOT_ENOUGH_REPLICAS_AFTER_APPEND: "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
}

#: Failed connections to one broker in a tick that make it degraded. One is enough: clients back
#: off their reconnects (librdkafka up to 10 s), so a broker that is away yields few attempts, and
#: DEGRADED_TICKS still asks for two such seconds in a row before a cut.
MIN_UNREACHABLE = 1

#: A signal moves the factor only when this many tenants saw it in the tick (one tenant's own
#: slowness, or its own errors, must not cut everyone's capacity).
MIN_STRAINED_TENANTS = 2

#: API keys whose response times are judged (Produce, Fetch).
PRODUCE = 0
FETCH = 1
API_NAMES = {PRODUCE: "Produce", FETCH: "Fetch"}

#: A (broker, API) is judged in a tick only with this many responses (a p99 of 3 is noise).
MIN_SAMPLES = 10
#: Response times kept per (broker, API) per tick (a uniform reservoir beyond).
MAX_SAMPLES = 4096
#: Fewer responses than MIN_SAMPLES still judge a (broker, API) when at least this many came and
#: their median is over the limit (a stalled broker answers little, and slowly); fewer still, or a
#: median under it with one response over it, only hold the factor where it is.
MIN_SLOW_SAMPLES = 3
LATENCY_SLACK_MS = 5.0
#: A baseline falls fast towards a lower p99 and rises slowly (load creeping up is not health).
BASELINE_ALPHA_DOWN = 0.5
BASELINE_ALPHA_UP = 0.05
#: Strain errors in at least this share of a tick's responses (and at least MIN_ERRORS) degrade.
ERROR_RATIO = 0.01
MIN_ERRORS = 3
DECREASE_INTERVAL_TICKS = 2
#: Consecutive degraded ticks before a cut: a single bad second (a GC pause, a busy core on a small
#: machine: a 1 ms baseline met a 40 ms p99 once in a CI run) holds the factor, it does not cut it.
DEGRADED_TICKS = 2

#: The reasons a factor changes (the metric's label).
LATENCY = "latency"
ERRORS = "errors"
HEALTHY = "healthy"
REASONS = (LATENCY, ERRORS, HEALTHY)


#: The ways the capacity follows the signals (`[capacity] controller`). CONCURRENCY answers latency
#: with a limit on each broker's Produce requests in flight (broker_concurrency.py), not with the
#: factor: strain errors and an unreachable broker still cut the factor, as AIMD does.
AIMD = "aimd"
GRADIENT = "gradient"
CONCURRENCY = "concurrency"
CONTROLLERS = (AIMD, GRADIENT, CONCURRENCY)

#: The gradient controller's floor per tick (Netflix's Gradient2 clamps its gradient to [0.5, 1]).
MIN_GRADIENT = 0.5
#: Its smoothing: each tick moves the factor this share of the way to factor x gradient (Gradient2's
#: default smoothing, 0.2), so one slow second moves it at most 10 %.
GRADIENT_SMOOTHING = 0.2


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    min_fraction: float = 0.1
    latency_tolerance: float = 2.0
    decrease_factor: float = 0.7
    increase_step: float = 0.1
    #: AIMD (cut by decrease_factor on a clear signal) or GRADIENT (scale by the ratio of the
    #: latency limit to the tick's p99, every tick, as Gradient2 does; docs/protecting-the-cluster.md)
    controller: str = AIMD


class FactorChange(NamedTuple):
    old: float
    new: float
    #: LATENCY, ERRORS or HEALTHY
    reason: str
    #: what was seen, for the log line
    detail: str


class _Tick:
    """One (broker, API)'s responses in the current tick."""

    __slots__ = ("count", "samples", "slowest")

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.count = 0
        #: tenant -> its slowest response in the tick (who saw the slowness)
        self.slowest: dict[Hashable, float] = {}

    def strained(self, limit: float) -> int:
        """How many tenants had a response over `limit`."""
        return sum(1 for latency in self.slowest.values() if latency > limit)


def p99(samples: list[float]) -> float:
    """The 99th percentile (nearest rank)."""
    ordered = sorted(samples)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


class AdaptiveCapacity:
    """The factor and the signals behind it; `observe` per response, `tick` once a second."""

    def __init__(self, config: AdaptiveConfig | None = None, *, seed: int = 0) -> None:
        self.config = config or AdaptiveConfig()
        self.factor = 1.0
        #: the latest change's reason and detail ("" before any)
        self.reason = ""
        self.detail = ""
        #: (broker, API) -> baseline p99 in ms
        self.baselines: dict[tuple[int, int], float] = {}
        #: (broker, API) -> the latest tick's p99 (for the metrics)
        self.latest_p99: dict[tuple[int, int], float] = {}
        self._ticks: dict[tuple[int, int], _Tick] = {}
        self._responses = 0
        self._errors: dict[tuple[int, int], int] = {}
        #: tenants that got a strain error in the tick
        self._error_tenants: set[Hashable] = set()
        #: broker -> the proxy's failed connection attempts to it in the tick
        self._unreachable: dict[int, int] = {}
        self._since_decrease = DECREASE_INTERVAL_TICKS
        self._degraded_ticks = 0
        self._random = random.Random(seed)

    def observe(self, broker: int, api_key: int, latency_ms: float, errors: list[int] | None = None,
                tenant: Hashable = None) -> None:
        """One response from `broker` to `tenant`: its time, and its partition error codes (Produce).

        A response whose every partition failed with a client's mistake (not strain) is not
        timed: the broker answered it without doing the work, so it says nothing of its load.
        """
        if errors and all(code != 0 and code not in STRAIN_ERRORS for code in errors):
            return
        key = (broker, api_key)
        tick = self._ticks.get(key)
        if tick is None:
            tick = self._ticks[key] = _Tick()
        tick.count += 1
        slowest = tick.slowest.get(tenant)
        if slowest is None or latency_ms > slowest:
            tick.slowest[tenant] = latency_ms
        if len(tick.samples) < MAX_SAMPLES:
            tick.samples.append(latency_ms)
        else:
            slot = self._random.randrange(tick.count)
            if slot < MAX_SAMPLES:
                tick.samples[slot] = latency_ms
        self._responses += 1
        if errors:
            for code in errors:
                if code in STRAIN_ERRORS:
                    pair = (broker, code)
                    self._errors[pair] = self._errors.get(pair, 0) + 1
                    self._error_tenants.add(tenant)

    def observe_unreachable(self, broker: int) -> None:
        """The proxy could not connect to `broker` (refused, timed out). Its own attempt, so no
        client can fake it, and it needs no second tenant: a broker going away is strain."""
        self._unreachable[broker] = self._unreachable.get(broker, 0) + 1

    def tick(self, light: bool) -> FactorChange | None:
        """Judge the tick that ends now and move the factor; the change, if any.

        `light`: the load was light this tick (the baselines may learn from it).
        """
        config = self.config
        worst: tuple[float, str] | None = None
        hold = False
        for key, tick in self._ticks.items():
            samples = tick.samples
            base = self.baselines.get(key)
            if len(samples) < MIN_SAMPLES:
                if base is None or not samples:
                    continue
                limit = base * config.latency_tolerance + LATENCY_SLACK_MS
                median = sorted(samples)[len(samples) // 2]
                if len(samples) >= MIN_SLOW_SAMPLES and median > limit \
                        and tick.strained(limit) >= MIN_STRAINED_TENANTS:
                    latest = self.latest_p99[key] = max(samples)
                    broker, api = key
                    ratio = median / limit
                    if worst is None or ratio > worst[0]:
                        worst = (ratio, f"broker {broker} {API_NAMES.get(api, api)}: {len(samples)} "
                                        f"responses, median {median:.0f} ms > {config.latency_tolerance:g} "
                                        f"x baseline {base:.0f} ms + {LATENCY_SLACK_MS:g} ms")
                elif max(samples) > limit:
                    hold = True
                continue
            latest = self.latest_p99[key] = p99(samples)
            if base is None:
                if light:
                    self.baselines[key] = latest
                continue
            limit = base * config.latency_tolerance + LATENCY_SLACK_MS
            if latest > limit and tick.strained(limit) < MIN_STRAINED_TENANTS:
                hold = True  # slow for one tenant alone: its own requests, not the broker
            elif latest > limit:
                ratio = latest / limit
                if worst is None or ratio > worst[0]:
                    broker, api = key
                    worst = (ratio, f"broker {broker} {API_NAMES.get(api, api)} p99 {latest:.0f} ms > "
                                    f"{config.latency_tolerance:g} x baseline {base:.0f} ms + "
                                    f"{LATENCY_SLACK_MS:g} ms")
            elif light:
                alpha = BASELINE_ALPHA_DOWN if latest < base else BASELINE_ALPHA_UP
                self.baselines[key] = base + alpha * (latest - base)
        error_count = sum(self._errors.values())
        error_detail = ""
        if error_count >= MIN_ERRORS and error_count >= ERROR_RATIO * self._responses \
                and len(self._error_tenants) >= MIN_STRAINED_TENANTS:
            broker, code = max(self._errors, key=lambda pair: self._errors[pair])
            error_detail = (f"{error_count} strain errors in {self._responses} responses "
                            f"(most: {STRAIN_ERRORS[code]} from broker {broker})")
        if not error_detail and self._unreachable:
            broker = max(self._unreachable, key=lambda b: self._unreachable[b])
            if self._unreachable[broker] >= MIN_UNREACHABLE:
                error_detail = f"broker {broker} unreachable ({self._unreachable[broker]} connections failed)"
        self._ticks = {}
        self._errors = {}
        self._error_tenants = set()
        self._unreachable = {}
        self._responses = 0
        self._since_decrease += 1

        old = self.factor
        if config.controller == CONCURRENCY and worst is not None:
            worst, hold = None, True  # the brokers' concurrency limits answer it; the factor holds
        if config.controller == GRADIENT:
            return self._gradient(old, worst, error_detail, hold)
        if worst is not None or error_detail:
            self._degraded_ticks += 1
            if self._degraded_ticks < DEGRADED_TICKS or self._since_decrease < DECREASE_INTERVAL_TICKS:
                return None  # one bad second alone (a GC pause, a busy core) only holds the factor
            new = max(config.min_fraction, old * config.decrease_factor)
            reason, detail = (LATENCY, worst[1]) if worst is not None else (ERRORS, error_detail)
            if new == old:
                return None
            self._since_decrease = 0
        else:
            self._degraded_ticks = 0
            new = min(1.0, round(old + config.increase_step, 9))  # 0.7 + 3 x 0.1 is 0.999...
            if new == old or hold:
                return None
            reason, detail = HEALTHY, "no broker above its baseline, no strain errors"
        return self._change(old, new, reason, detail)

    def _gradient(self, old: float, worst: tuple[float, str] | None, error_detail: str,
                  hold: bool) -> FactorChange | None:
        """Gradient2's rule on the factor: every tick, move it towards factor x gradient, where the
        gradient is the latency limit over the p99 seen (clamped to [MIN_GRADIENT, 1]); strain
        errors count as the steepest gradient. Healthy ticks add `increase_step`, as Gradient2's
        queue allowance grows its limit. No waiting for a second bad tick: the smoothing is what
        keeps one slow second from moving it far."""
        config = self.config
        if worst is not None or error_detail:
            gradient = MIN_GRADIENT if error_detail else max(MIN_GRADIENT, 1.0 / worst[0])  # type: ignore[index]
            target = old * gradient
            new = max(config.min_fraction, old + GRADIENT_SMOOTHING * (target - old))
            reason, detail = (ERRORS, error_detail) if error_detail else (LATENCY, worst[1])  # type: ignore[index]
            if new == old:
                return None
            return self._change(old, new, reason, f"{detail} (gradient {gradient:.2f})")
        new = min(1.0, round(old + config.increase_step, 9))  # 0.7 + 3 x 0.1 is 0.999...
        if new == old or hold:
            return None
        return self._change(old, new, HEALTHY, "no broker above its baseline, no strain errors")

    def _change(self, old: float, new: float, reason: str, detail: str) -> FactorChange:
        self.factor = new
        self.reason, self.detail = reason, detail
        return FactorChange(old, new, reason, detail)


__all__ = [
    "AIMD", "API_NAMES", "CONCURRENCY", "CONTROLLERS", "ERRORS", "GRADIENT", "HEALTHY", "LATENCY",
    "MIN_STRAINED_TENANTS", "PRODUCE", "REASONS", "STRAIN_ERRORS", "AdaptiveCapacity", "AdaptiveConfig",
    "FactorChange", "p99",
]
