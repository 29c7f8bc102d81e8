"""The gate stage, as the pipeline sees it: after evaluate, the model it released is registered and
compared with the current release (the body is ``run.py``; the registry ``registry.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embed_core.manifests import GateManifest
from embed_core.stage_api import Report, Stage, StageContext, lazy
from embed_core.stage_dirs import GATE

NAME = GATE
BODY = "embed_core.release.run"


def format_counts(manifest: GateManifest | dict[str, Any]) -> str:
    return GateManifest.of(manifest).line


def _report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    import pyarrow.parquet as pq

    path = ctx.stage_dir / "gate.parquet"
    table = pq.read_table(path).to_pylist() if path.exists() else []
    return Report(markdown=(ctx.stage_dir / "report.md").read_text(encoding="utf-8"), markdown_key="release-gate-",
                  table=[{k: round(100 * v, 2) if k in ("current", "candidate", "change") else v
                          for k, v in row.items()} for row in table],
                  table_key="release-gate-table-",
                  table_description="release gate: the candidate against the current release, points (score × 100)")


def _fingerprint(ctx: StageContext):
    return lazy(BODY, "input_fingerprint")(ctx.config, ctx.run_dir)


def _inputs(ctx: StageContext) -> list[Path]:
    return lazy(BODY, "input_dirs")(ctx.config, ctx.run_dir)


def _run(ctx: StageContext, fingerprint) -> dict[str, Any]:
    return lazy(BODY, "run_gate")(ctx.config, ctx.run_dir, fingerprint)


STAGE = Stage(name=NAME, help="register the evaluated model as a release; it becomes current if it scores no worse "
              "than the current release on the guard tasks", enabled=lambda c: c.release is not None and
              c.evaluate is not None, fingerprint=_fingerprint, run=_run, summarize=format_counts, report=_report,
              inputs=_inputs, log_prints=False)
