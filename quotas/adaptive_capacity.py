"""Adaptive capacity: scale the cluster capacity with the brokers' health (AIMD), the pure half.

The proxy sees every response: how long each broker took for each Produce and Fetch, and the
errors a broker under strain answers with (REQUEST_TIMED_OUT, NOT_ENOUGH_REPLICAS[_AFTER_APPEND],
NOT_LEADER_OR_FOLLOWER). Once per tick (a second) this controller compares them with what is
healthy and moves a factor in [min_fraction, 1] that scales the capacity (capacity.py):

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
  `increase_step` (0.05) per tick back to 1. Chosen over a latency gradient (Netflix's
  Gradient2): a gradient keeps moving with every wobble of the latency, which moves every tenant's
  share; AIMD moves only on a clear signal, and each move has a reason to log. It converges like
  TCP's congestion control: cut fast on trouble, probe back slowly.

Every change is returned as a FactorChange naming its signal, for the metric and the INFO log.
Lower-share tenants lose first by construction: a smaller capacity is water-filled by the same
weights, so the gold tenant (high share, small demand) keeps its whole demand longest.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple

#: Kafka error codes that say a broker is under strain (its replicas, its request queue, its leadership).
REQUEST_TIMED_OUT = 7
NOT_LEADER_OR_FOLLOWER = 6
NOT_ENOUGH_REPLICAS = 19
NOT_ENOUGH_REPLICAS_AFTER_APPEND = 20
STRAIN_ERRORS: dict[int, str] = {
    REQUEST_TIMED_OUT: "REQUEST_TIMED_OUT",
    NOT_LEADER_OR_FOLLOWER: "NOT_LEADER_OR_FOLLOWER",
    NOT_ENOUGH_REPLICAS: "NOT_ENOUGH_REPLICAS",
    NOT_ENOUGH_REPLICAS_AFTER_APPEND: "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
}

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


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    min_fraction: float = 0.1
    latency_tolerance: float = 2.0
    decrease_factor: float = 0.7
    increase_step: float = 0.05


class FactorChange(NamedTuple):
    old: float
    new: float
    #: LATENCY, ERRORS or HEALTHY
    reason: str
    #: what was seen, for the log line
    detail: str


class _Tick:
    """One (broker, API)'s responses in the current tick."""

    __slots__ = ("count", "samples")

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.count = 0


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
        self._since_decrease = DECREASE_INTERVAL_TICKS
        self._degraded_ticks = 0
        self._random = random.Random(seed)

    def observe(self, broker: int, api_key: int, latency_ms: float, errors: list[int] | None = None) -> None:
        """One response from `broker`: its time, and its partition error codes (Produce)."""
        key = (broker, api_key)
        tick = self._ticks.get(key)
        if tick is None:
            tick = self._ticks[key] = _Tick()
        tick.count += 1
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
                if len(samples) >= MIN_SLOW_SAMPLES and median > limit:
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
            if latest > limit:
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
        if error_count >= MIN_ERRORS and error_count >= ERROR_RATIO * self._responses:
            broker, code = max(self._errors, key=lambda pair: self._errors[pair])
            error_detail = (f"{error_count} strain errors in {self._responses} responses "
                            f"(most: {STRAIN_ERRORS[code]} from broker {broker})")
        self._ticks = {}
        self._errors = {}
        self._responses = 0
        self._since_decrease += 1

        old = self.factor
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
            new = min(1.0, old + config.increase_step)
            if new == old or hold:
                return None
            reason, detail = HEALTHY, "no broker above its baseline, no strain errors"
        self.factor = new
        self.reason, self.detail = reason, detail
        return FactorChange(old, new, reason, detail)


__all__ = [
    "API_NAMES", "ERRORS", "HEALTHY", "LATENCY", "REASONS", "STRAIN_ERRORS", "AdaptiveCapacity",
    "AdaptiveConfig", "FactorChange", "p99",
]
