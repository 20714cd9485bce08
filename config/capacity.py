"""The `[capacity]` table: what the whole fleet may send the cluster, shared by `share`.

```toml
[capacity]
produce_byte_rate = 50000000     # bytes/s of Produce requests, fleet-wide
fetch_byte_rate = 100000000      # bytes/s of Fetch responses, fleet-wide
request_percentage = 400.0       # upstream request-thread time, as Kafka's request quota counts it
adaptive = true                  # scale it with the brokers' health (AIMD); default false
min_fraction = 0.1               # adaptive mode never goes below this share of the capacity
latency_tolerance = 2.0          # degraded: a broker's p99 above this x its healthy baseline
decrease_factor = 0.7            # multiplicative decrease per degraded tick
increase_step = 0.1              # additive increase per healthy tick
controller = "aimd"              # or "gradient" (Gradient2's rule on the factor), or "concurrency"
                                 # (latency limits each broker's Produce requests in flight instead)
```

Each direction is optional; with `adaptive = true` and none given, the capacity is learned from the
throughput of the last healthy second (quotas/capacity.py). Tenants' weights are the `share` entity
setting (quotas/types.py `EntitySetting`). Read at start; with the quota topic the fleet's capacity
can also be set there while it runs (`kthrottle capacity`, kept in the config form:
`capacity_from_config_form`). Every value is
checked and an error names the key and the value. The reference is docs/protecting-the-cluster.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from quotas.adaptive_capacity import AdaptiveConfig
from quotas.capacity import CapacityConfig, CapacityError, check_tuning

from .common import SettingsError

_RATES = ("produce_byte_rate", "fetch_byte_rate", "request_percentage")
_FRACTIONS = ("min_fraction", "latency_tolerance", "decrease_factor", "increase_step")


def parse_capacity_table(table: object) -> CapacityConfig:
    """A `[capacity]` table, validated (SettingsError names the key and the value)."""
    if not isinstance(table, Mapping):
        raise SettingsError("`capacity` must be a table: write [capacity]")
    values: dict[str, float] = {}
    tuning: dict[str, float | str] = {}
    adaptive = False
    for key, value in table.items():
        if key in _RATES or key in _FRACTIONS:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise SettingsError(f"capacity.{key} = {value!r} must be a number")
            if key in ("produce_byte_rate", "fetch_byte_rate") and not float(value).is_integer():
                raise SettingsError(f"capacity.{key} = {value!r} must be a whole number of bytes per second")
            (values if key in _RATES else tuning)[key] = float(value)
        elif key == "adaptive":
            if not isinstance(value, bool):
                raise SettingsError(f"capacity.adaptive = {value!r} must be true or false")
            adaptive = value
        elif key == "controller":
            if not isinstance(value, str):
                raise SettingsError(f"capacity.controller = {value!r} must be \"aimd\", \"gradient\" "
                                    f"or \"concurrency\"")
            tuning[key] = value  # the choice is checked with the rest of the tuning
        else:
            raise SettingsError(f"unknown setting capacity.{key} (known: adaptive, controller, "
                                f"{', '.join(_RATES + _FRACTIONS)})")
    try:
        # the tuning is checked even while adaptive is off: a wrong value is refused, not kept
        checked = check_tuning(AdaptiveConfig(**tuning))  # type: ignore[arg-type]
        return CapacityConfig(values.get("produce_byte_rate"), values.get("fetch_byte_rate"),
                              values.get("request_percentage"), checked if adaptive else None)
    except CapacityError as exc:
        raise SettingsError(str(exc)) from exc


def capacity_from_config_form(values: Mapping[str, str]) -> CapacityConfig:
    """The capacity kept in a quota store (Kafka's config form: every value a string), checked as
    a `[capacity]` table is: "true"/"false" for `adaptive`, numbers for the rest."""
    table: dict[str, object] = {}
    for key, text in values.items():
        if key == "adaptive":
            if text not in ("true", "false"):
                raise SettingsError(f"capacity.adaptive = {text!r} must be true or false")
            table[key] = text == "true"
            continue
        if key == "controller":
            table[key] = text
            continue
        try:
            number = float(text)
        except (TypeError, ValueError):
            raise SettingsError(f"capacity.{key} = {text!r} must be a number") from None
        table[key] = int(number) if number.is_integer() else number
    return parse_capacity_table(table)


__all__ = ["capacity_from_config_form", "parse_capacity_table"]
