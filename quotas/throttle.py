"""Kafka's throttle-time arithmetic (QuotaUtils), for a rate quota that was just violated.

If O is the observed rate, T the bound and W the measuring window, delaying by X brings the
average back to T when O*W / (W + X) = T, so X = (O - T) / T * W, rounded half up.
"""

from __future__ import annotations

import math


def throttle_time_ms(observed: float, bound: float, window_ms: int) -> int:
    """The delay that brings `observed` down to `bound`; 0 unless strictly over the bound."""
    if observed <= bound:
        return 0
    return math.floor((observed - bound) / bound * window_ms + 0.5)


def bounded_throttle_time_ms(observed: float, bound: float, window_ms: int, cap_ms: int) -> int:
    """The request-time quota's variant: never more than one quota window."""
    return min(throttle_time_ms(observed, bound, window_ms), cap_ms)
