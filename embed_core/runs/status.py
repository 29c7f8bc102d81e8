"""What each stage of a run directory would do on the next run, and what it did last.

For every stage the config defines, in pipeline order, compare the input fingerprint the stage
would have now (the same function its cache key uses) with the one recorded in its manifest
(``embed_core.stages.instance_state``: the same judgement a stage makes of its inputs before it runs):

``fresh``     intact outputs from these exact inputs: the next run is a cache hit
``stale``     intact outputs, but from other inputs (config, data or upstream outputs changed)
``damaged``   an output file is missing or its bytes differ from the manifest
``missing``   never produced (or its upstream is missing, so it cannot run yet)
``upstream``  its own inputs match, but an earlier stage will recompute first; it reruns only if
              that changes the outputs it reads (fingerprints are over content, not time)

A data-value gate (``value-<stage>``) adds to its note the units it dropped or down-weighted and why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from embed_core.artifacts import read_manifest
from embed_core.datavalue.apply import decision_line
from embed_core.manifests import Manifest
from embed_core.config import RunConfig
from embed_core.rundir import lock_holder, read_history
from embed_core.stages import instance_state, pipeline_instances


@dataclass
class StageStatus:
    stage: str
    state: str
    current_input: str | None      # fingerprint the stage would have now (None: cannot compute yet)
    recorded_input: str | None     # fingerprint in its manifest
    created_at: str | None
    compute_s: float | None        # how long its last computation took (history.jsonl)
    last_result: str | None        # from history.jsonl: "computed" / "cache hit", and when
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_status(config: RunConfig, run_dir: str | Path) -> list[StageStatus]:
    run_dir = Path(run_dir)
    last: dict[str, dict[str, Any]] = {}
    computed: dict[str, dict[str, Any]] = {}
    for entry in read_history(run_dir):
        last[entry.get("stage", "")] = entry
        if not entry.get("cached"):
            computed[entry.get("stage", "")] = entry
    out: list[StageStatus] = []
    upstream_pending: str | None = None
    for stage, name in pipeline_instances(config):
        manifest = read_manifest(run_dir, name)
        judged = instance_state(config, run_dir, stage, name)
        state, current, recorded, detail = judged.state, judged.current, judged.recorded, judged.detail
        if state == "fresh" and upstream_pending:
            state, detail = "upstream", f"inputs match, but {upstream_pending} recomputes first"
        if state != "fresh" and upstream_pending is None:
            upstream_pending = name
        if manifest is not None and manifest.get("step") == "datavalue" and state in ("fresh", "upstream"):
            detail = "; ".join(filter(None, [detail, decision_line(manifest)]))
        h = last.get(name)
        out.append(StageStatus(
            stage=name, state=state, current_input=current, recorded_input=recorded,
            created_at=Manifest.of(manifest).created_at if manifest else None,
            compute_s=computed.get(name, {}).get("seconds") if manifest else None,
            last_result=f"{'cache hit' if h.get('cached') else 'computed'} at {h.get('at')}" if h else None,
            detail=detail))
    return out


def format_status(rows: list[StageStatus], run_dir: str | Path) -> str:
    def short(h: str | None) -> str:
        return h[:12] if h else "-"

    head = f"{'stage':<18} {'state':<9} {'input now':<13} {'recorded':<13} {'took':>8}  {'last run':<36} note"
    holder = lock_holder(run_dir)
    lines = [f"run dir: {run_dir}" + (f"   (a run is working in it now: {holder})" if holder else ""), head, "-" * len(head)]
    for r in rows:
        took = f"{r.compute_s:.1f}s" if r.compute_s is not None else "-"
        lines.append(f"{r.stage:<18} {r.state:<9} {short(r.current_input):<13} {short(r.recorded_input):<13} "
                     f"{took:>8}  {(r.last_result or '-'):<36} {r.detail}")
    todo = [r.stage for r in rows if r.state != "fresh"]
    lines.append("next run: " + (f"recomputes {', '.join(todo)} (the rest are cache hits)" if todo
                                 else "every stage is a cache hit"))
    return "\n".join(lines)
