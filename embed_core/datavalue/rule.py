"""The data-value decision rule: keep, down-weight or drop each unit (a data source, a synthetic
strategy, a filter setting) from its measured marginal value on the dev score.

Inputs. ``deltas[unit]`` are the unit's per-seed marginal values d_1..d_n: the dev score ×100 of a
proxy run WITH the unit minus the one WITHOUT it, the two runs of a pair sharing their seed (for
leave-one-out: the reference run minus the run without the unit; for add-one-in: the run with the
unit minus the reference). ``noise`` is sigma_ref, the sample standard deviation (n - 1) over seeds
of the reference proxy run's dev score (all units in).

The statistic. With n seeds, d̄ the mean of the deltas and s the sample standard deviation of
the deltas (n - 1 in the denominator; its ``spread``), the standard error of d̄ is

    se = sqrt((s² + sigma_ref²) / n)

``s²`` estimates the variance of a paired difference; ``sigma_ref²`` is added because with the few
seeds a gate can afford (3 give a standard deviation with about 50 % relative error) ``s`` may come
out small by chance, and a drop should need at least the evidence the reference's own seed noise
asks for. The sum is conservative: it can only widen the band (an unpaired difference of two runs
with the reference's noise would have variance 2·sigma_ref²; pairing by seed usually removes part
of it, which ``s`` measures).

The decision, with ``z`` the one-sided width of the band (1.0: about 84 % one-sided; 1.645: 95 %):

* **drop** (weight 0) when the upper bound d̄ + z·se < 0: the unit's loss of dev score exceeds the
  noise;
* **down-weight** (weight ``down_weight``) when d̄ < 0 but d̄ + z·se >= 0: it may hurt, within the
  noise band;
* **keep** (weight 1) when d̄ >= 0.

A unit the stage has nothing without (``whole``: its only data, e.g. a corpus recipe's generated
queries) is kept where it would be down-weighted: a weight on all of a stage's records scales its
loss and nothing else, which AdamW's per-parameter normalisation undoes, so down-weighting it would
report an action that does not act. Such a unit is still dropped past the noise (the stage then
keeps its start model).

Fewer than two seeds give no spread to test against: such a unit is never dropped (one negative
delta is down-weighted, the reason says why), and neither is any unit when ``noise`` is not a number
(the reference ran on fewer than two seeds). A delta that is not finite, a negative noise, a
``down_weight`` outside (0, 1) or a negative ``z`` is refused with one line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from embed_core.errors import ConfigError, EmbedpipeError

Action = Literal["keep", "down-weight", "drop"]
COLUMNS = ("unit", "delta", "spread", "noise", "seeds", "action", "weight", "reason")


@dataclass(frozen=True)
class UnitDecision:
    unit: str
    delta: float        # mean per-seed marginal value (dev score ×100, with minus without)
    spread: float       # sample std of the per-seed deltas (NaN below two seeds)
    noise: float        # the reference runs' seed std (sigma_ref)
    seeds: int
    action: Action
    weight: float       # 1 keep, down_weight, 0 drop: what the training stage multiplies the unit's weight by
    reason: str
    se: float = math.nan     # standard error of ``delta`` (see the module docstring)
    bound: float = math.nan  # delta + z·se: dropped when below 0


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, math.nan
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))


def _check(deltas: Mapping[str, Sequence[float]], noise: float, down_weight: float, z: float) -> None:
    if not 0.0 < down_weight < 1.0:
        raise ConfigError(f"data value: down_weight {down_weight} is outside (0, 1)")
    if not (math.isfinite(z) and z >= 0):
        raise ConfigError(f"data value: z {z} is not a finite number >= 0")
    if noise < 0 or math.isinf(noise):
        raise EmbedpipeError(f"data value: the reference noise {noise} is not a finite number >= 0")
    for unit, values in deltas.items():
        bad = next((i for i, v in enumerate(values) if not math.isfinite(float(v))), None)
        if bad is not None:
            raise EmbedpipeError(f"data value: unit {unit!r}: delta of seed {bad} is {values[bad]}, not a finite number")


WHOLE = "; the stage's only data: a weight would scale its whole loss and nothing else, so it is kept"


def _decide_one(unit: str, values: Sequence[float], noise: float, down_weight: float, z: float,
                whole: bool = False) -> UnitDecision:
    d = _band_decision(unit, values, noise, down_weight, z)
    if whole and d.action == "down-weight":
        return replace(d, action="keep", weight=1.0, reason=d.reason + WHOLE)
    return d


def _band_decision(unit: str, values: Sequence[float], noise: float, down_weight: float, z: float) -> UnitDecision:
    n = len(values)
    if n == 0:
        return UnitDecision(unit, math.nan, math.nan, noise, 0, "keep", 1.0, "not measured: no proxy run")
    mean, spread = _mean_std([float(v) for v in values])
    if n < 2 or math.isnan(noise):
        why = (f"{n} seed: no spread to test against, never dropped" if n < 2
               else "reference noise unknown (fewer than 2 reference seeds): never dropped")
        if mean < 0:
            return UnitDecision(unit, mean, spread, noise, n, "down-weight", down_weight, f"mean < 0; {why}")
        return UnitDecision(unit, mean, spread, noise, n, "keep", 1.0, f"mean >= 0; {why}")
    se = math.sqrt((spread ** 2 + noise ** 2) / n)
    bound = mean + z * se
    band = f"mean {mean:.2f} + {z:g}·se {se:.2f} = {bound:.2f}"
    if bound < 0:
        return UnitDecision(unit, mean, spread, noise, n, "drop", 0.0, f"loss exceeds the noise: {band} < 0", se, bound)
    if mean < 0:
        return UnitDecision(unit, mean, spread, noise, n, "down-weight", down_weight,
                            f"loss within the noise: {band} >= 0", se, bound)
    return UnitDecision(unit, mean, spread, noise, n, "keep", 1.0, f"mean {mean:.2f} >= 0", se, bound)


def decide(deltas: Mapping[str, Sequence[float]], noise: float, *, down_weight: float = 0.5,
           z: float = 1.0, whole: frozenset[str] = frozenset()) -> list[UnitDecision]:
    """One decision per unit, in the order of ``deltas``; ``whole``: the units the stage has no record
    without (see the module docstring for the rule)."""
    noise = float(noise)
    _check(deltas, noise, down_weight, z)
    return [_decide_one(unit, values, noise, down_weight, z, unit in whole) for unit, values in deltas.items()]


def decisions_table(decisions: Sequence[UnitDecision]):
    """The decisions as a pyarrow table (columns ``COLUMNS``), the gate's Parquet artifact."""
    import pyarrow as pa

    schema = pa.schema([("unit", pa.string()), ("delta", pa.float64()), ("spread", pa.float64()),
                        ("noise", pa.float64()), ("seeds", pa.int64()), ("action", pa.string()),
                        ("weight", pa.float64()), ("reason", pa.string())])
    return pa.table({c: [getattr(d, c) for d in decisions] for c in COLUMNS}, schema=schema)


def _num(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.2f}"


def decisions_markdown(decisions: Sequence[UnitDecision]) -> str:
    """The decisions as a markdown table (scores ×100 with two decimals), for the stage report."""
    lines = ["| unit | Δ dev ×100 | ± spread | noise | seeds | action | weight | reason |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    for d in decisions:
        reason = d.reason.replace("|", "\\|")
        lines.append(f"| {d.unit} | {_num(d.delta)} | {_num(d.spread)} | {_num(d.noise)} | {d.seeds} | {d.action} "
                     f"| {d.weight:g} | {reason} |")
    return "\n".join(lines) + "\n"
