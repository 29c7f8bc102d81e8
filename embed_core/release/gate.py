"""The gate: a candidate against the current release, task by task (main scores as mteb computes
them; tolerances in points, main score × 100, the unit a user reads).

A task fails when the candidate scores more than its tolerance below the current release; the
candidate passes when no guard task or probe fails. Pure functions over score tables, so the rule
is tested on hand-written numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


from embed_core.numbers import score, score_change


@dataclass(frozen=True)
class GateRow:
    task: str
    kind: str           # guard (an evaluate task) or probe
    current: float      # main score
    candidate: float
    tolerance: float    # points

    @property
    def delta(self) -> float:
        return self.candidate - self.current

    @property
    def passed(self) -> bool:
        return 100 * self.delta >= -self.tolerance - 1e-9


def compare(candidate: dict[str, float], current: dict[str, float], kinds: dict[str, str], tolerance: float,
            tolerances: dict[str, float] | None = None) -> list[GateRow]:
    """One row per task in ``kinds`` (task -> guard/probe), in its order."""
    tolerances = tolerances or {}
    missing = [t for t in kinds if t not in candidate or t not in current]
    if missing:
        raise ValueError(f"gate: no score for {missing[0]!r} "
                         f"({'candidate' if missing[0] not in candidate else 'current release'})")
    return [GateRow(task, kind, current[task], candidate[task], tolerances.get(task, tolerance))
            for task, kind in kinds.items()]


def failed(rows: list[GateRow]) -> list[GateRow]:
    return [r for r in rows if not r.passed]


def table(rows: list[GateRow]) -> str:
    """The rows as a markdown table (points with two decimals)."""
    lines = ["| task | current | candidate | change | tolerance | |", "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r.task}{' (probe)' if r.kind == 'probe' else ''} | {score(r.current)} | {score(r.candidate)} | "
              f"{score_change(r.delta)} | {r.tolerance:.2f} | {'ok' if r.passed else '**worse**'} |" for r in rows]
    return "\n".join(lines)


def verdict_line(rows: list[GateRow], candidate: int, current: int) -> str:
    """One line: the verdict of candidate version ``candidate`` against current version ``current``."""
    worse = failed(rows)
    if not worse:
        changes = ", ".join(f"{r.task} {score_change(r.delta)}" for r in rows)
        return f"release gate passed: v{candidate} against current v{current}: {changes}"
    parts = ", ".join(f"{r.task} {score_change(r.delta)} (tolerance {r.tolerance:.2f})" for r in worse)
    return f"release gate failed: v{candidate} scores below current v{current} on {len(worse)} of {len(rows)} tasks: {parts}"
