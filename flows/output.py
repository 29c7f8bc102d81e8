"""What the ``embedpipe`` commands print about their results (on stdout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embed_core import numbers


def print_result(result: dict[str, Any]) -> None:
    state = "cache hit" if result["cached"] else "computed"
    print(f"\n{result['stage']} ({state}): {Path(result['run_dir']) / result['stage']}")
    print(result["summary"])


def wall_times(results: dict[str, dict[str, Any]], total: float) -> str:
    """The wall time of every stage of a pipeline run, and the run's (Prefect and server overhead included)."""
    lines = ["", "wall time per stage:"]
    for name, res in results.items():
        lines.append(f"  {name:<24}{res['seconds']:>9.1f} s{'  (cache hit)' if res['cached'] else ''}")
    lines.append(f"  {'total (whole command)':<24}{total:>9.1f} s")
    return "\n".join(lines)


def print_downstream(config, result: dict[str, Any]) -> None:
    """After one stage recomputed: which later stages no longer match their inputs."""
    from embed_core.stages import downstream_of
    from embed_core.runs.status import run_status

    if result["cached"]:
        return
    later = set(downstream_of(config, result["stage"]))
    rows = [r for r in run_status(config, result["run_dir"]) if r.stage in later]
    stale = [r.stage for r in rows if r.state != "fresh"]
    if stale:
        print(f"downstream now out of date: {', '.join(stale)} — `embedpipe run --run-dir {result['run_dir']}` "
              "recomputes them (stages whose inputs still match are cache hits)")
    elif rows:
        print("downstream stages still match their inputs (this stage's outputs did not change what they read)")


def print_sweep(out: dict[str, Any]) -> None:
    for variant in out["variants"]:
        state = "cache hit" if variant["cached"] else "trained"
        print(f"{variant['variant']} ({state}): dev {numbers.score(out['dev_scores'][variant['variant']])}  {variant['overrides']}")
    print(f"winner: {out['winner']} {out['settings']}")
    for score in out["test"]:
        print(f"  {score['task']}: {score['metric']} {numbers.score(score['value'])}")
    print(f"report: {out['report']}")
