"""The one format of the numbers a user reads, in logs, reports and artifacts alike: a score (a
metric in [0, 1], as mteb and the dev evaluation compute it) × 100 with two decimals (``93.37``,
never ``0.9337`` beside it), a change of a score likewise with its sign (``+1.25``), and a loss
with four significant digits (``0.01552``, not ``0.015524939633905888``). A missing value is
``–``. Stored values (manifests, Parquet tables, JSON artifacts' raw fields) keep full precision.
"""

from __future__ import annotations

import math

MISSING = "–"


def score(value: float | None) -> str:
    """``0.93374`` → ``93.37``."""
    if value is None:
        return MISSING
    return f"{100 * value:.2f}" if math.isfinite(value) else str(value)


def score_change(value: float | None) -> str:
    """A difference of two scores, signed: ``0.0125`` → ``+1.25``."""
    if value is None:
        return MISSING
    return f"{100 * value:+.2f}" if math.isfinite(value) else str(value)


def loss(value: float | None) -> str:
    """``0.015524939633905888`` → ``0.01552``; ``2.0`` → ``2.000``."""
    if value is None:
        return MISSING
    if not math.isfinite(value):
        return str(value)
    rounded = float(f"{value:.4g}")  # its magnitude after rounding: 0.00099996 is 0.001000, not 0.0010000
    if rounded == 0:
        return "0.000"
    digits = 3 - math.floor(math.log10(abs(rounded)))  # decimals for four significant digits
    return f"{rounded:.{max(digits, 0)}f}" if digits <= 12 else f"{rounded:.3e}"
