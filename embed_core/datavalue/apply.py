"""What a gated training stage takes from its data-value step: the step's records (read as its
upstream) and, here, its weights: the stage's ``dataset_weight`` and ``origin_weight`` multiplied by
the down-weighted units' weights (a dropped dataset's entry removed: its records are gone). Also the
lines ``embedpipe status``, ``lineage`` and the stage's summary show. Light: JSON manifests only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embed_core.artifacts import read_manifest
from embed_core.manifests import DataValueManifest
from embed_core.stage_dirs import value_instance_name


def gated_stage(run_dir: Path, stage: Any) -> Any:
    """``stage`` (a TrainStageConfig) with the decision of ``value-<stage>`` applied to its weights;
    as it is while that step has not committed (the stage's input check refuses to train then)."""
    raw = read_manifest(run_dir, value_instance_name(stage.name))
    if raw is None:
        return stage
    weights = DataValueManifest.of(raw).weights
    dataset_weight = dict(stage.dataset_weight)
    for name, w in weights.get("dataset", {}).items():
        if w == 0:
            dataset_weight.pop(name, None)
        else:
            dataset_weight[name] = dataset_weight.get(name, 1.0) * w
    origin_weight = dict(stage.origin_weight)
    for name, w in weights.get("origin", {}).items():
        if w > 0:  # a dropped origin's records are gone (LLM negatives: taken out of their records)
            origin_weight[name] = origin_weight.get(name, 1.0) * w
    return stage.model_copy(update={"dataset_weight": dataset_weight, "origin_weight": origin_weight})


def decision_line(manifest: dict[str, Any]) -> str:
    """One line: the units dropped and down-weighted, and why."""
    m = DataValueManifest.of(manifest)
    parts = []
    for action in ("drop", "down-weight"):
        units = [f"{u} ({d['reason']})" for u, d in m.units.items() if d["action"] == action]
        if units:
            parts.append(f"{'dropped' if action == 'drop' else 'down-weighted'} " + "; ".join(units))
    kept = sum(d["action"] == "keep" for d in m.units.values())
    return ", ".join(parts + [f"kept {kept} of {len(m.units)} units"])


def format_counts(manifest: dict[str, Any]) -> str:
    """The step's summary lines (``embedpipe status``, the run logs)."""
    m = DataValueManifest.of(manifest)
    c = m.counts
    lines = [f"data value of stage {m.stage_name}: {c['proxy_runs']} proxy runs of {c['steps']} steps "
             f"({c['trained']} trained, {c['cached']} cached); reference dev {m.reference_score:.2f} ± {m.noise:.2f}"]
    lines += [f"  {u}: {d['action']} (weight {d['weight']:g}), delta {d['delta']:+.2f} ± {d['spread']:.2f}: "
              f"{d['reason']}" for u, d in m.units.items()]
    return "\n".join(lines)


def gate_note(run_dir: Path, upstream: str) -> dict[str, Any] | None:
    """What a training stage's manifest records of the gate whose records it read: the decision's
    fingerprint and its line; None when ``upstream`` is no data-value step."""
    raw = read_manifest(Path(run_dir), upstream)
    if raw is None or raw.get("step") != DataValueManifest.STEP:
        return None
    return {"step": upstream, "decision": raw["input_fingerprint"], "summary": decision_line(raw)}


def emptied_by_gate(run_dir: Path, upstream: str) -> str | None:
    """Why ``upstream`` holds no record for the stage, when a data-value decision took them all out:
    the gate dropped every unit (``value-<stage>``), or a proxy variant left every unit out (its
    ``prepare``: the base of an add-one-in gate over one all-synthetic dataset). None otherwise (a
    stage without records for another reason stays an error)."""
    raw = read_manifest(Path(run_dir), upstream)
    if raw is None:
        return None
    counts = raw.get("counts") or {}
    if raw.get("step") == DataValueManifest.STEP:
        after = [r.get("after", 0) for r in (counts.get("records") or {}).values()]
        if after and not any(after):
            return f"the data-value gate dropped every record ({decision_line(raw)})"
        return None
    removed, records = counts.get("removed"), counts.get("records")
    if removed and isinstance(records, dict) and records and not any(records.values()):
        return f"this proxy variant leaves out every record ({', '.join(removed)})"
    return None
