"""The decision rule of the data-value gate: keep, down-weight or drop a unit from its per-seed
deltas, accounting for the noise the proxies measured.

A minimal version (the interface the gate uses): a unit's standard error is the larger of its
deltas' spread and the reference's noise times √2 (a delta is the difference of two proxies),
each over √seeds; a mean delta below −z standard errors drops the unit, a negative one within the
noise down-weights it, anything else keeps it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class UnitDecision:
    unit: str
    delta: float  # mean dev score ×100 with the unit minus without it
    spread: float  # sample standard deviation of the per-seed deltas
    noise: float  # the reference proxies' sample standard deviation
    seeds: int
    action: Literal["keep", "down-weight", "drop"]
    weight: float  # the multiplier of its sampling weight (0 dropped)
    reason: str


def decide(deltas: Mapping[str, Sequence[float]], noise: float, *, down_weight: float = 0.5,
           z: float = 1.0) -> list[UnitDecision]:
    """One decision per unit, in the order of ``deltas``."""
    out = []
    for unit, values in deltas.items():
        xs = [float(x) for x in values]
        n = len(xs)
        mean = statistics.fmean(xs)
        spread = statistics.stdev(xs) if n > 1 else 0.0
        se = max(spread, noise * math.sqrt(2)) / math.sqrt(n)
        if mean < -z * se:
            action, weight = "drop", 0.0
            reason = f"loses {-mean:.2f} dev points, more than {z:g} × its standard error {se:.2f}"
        elif mean < 0:
            action, weight = "down-weight", down_weight
            reason = f"loses {-mean:.2f} dev points, within {z:g} × its standard error {se:.2f}"
        else:
            action, weight = "keep", 1.0
            reason = f"gains {mean:.2f} dev points (standard error {se:.2f})"
        out.append(UnitDecision(unit, mean, spread, noise, n, action, weight, reason))
    return out
