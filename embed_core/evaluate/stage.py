"""The evaluate stage, as the pipeline sees it: MTEB on the configured tasks for the base and
trained models (the body is ``run.py``; task data, the model adapter, report and geometry beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from embed_core import numbers
from embed_core.stage_dirs import EVALUATE
from embed_core.manifests import EvaluateManifest
from embed_core.stage_api import Report, Stage, StageContext, StageOptions, lazy

NAME = EVALUATE
BODY = "embed_core.evaluate.run"


class EvaluateOptions(StageOptions):
    models: list[str] | None = Field(None, description="'base', 'trained' or local model paths (default: what the "
                                                       "pipeline scores: evaluate.models, else the base and every "
                                                       "trained stage's model)",
                                     json_schema_extra={"cli_flag": "--model"})
    tasks: list[str] | None = Field(None, description="Task names from the config (default: all configured tasks).")


def format_counts(manifest: EvaluateManifest | dict[str, Any]) -> str:
    evaluated = EvaluateManifest.of(manifest)
    lines = []
    for m in evaluated.models:
        lines.append(f"{m.label}: {m.path} (fingerprint {m.fingerprint}, pooling {m.settings['pooling']}, "
                     f"max_length {m.settings['max_length']}), texts encoded {m.texts_encoded}")
    scores = evaluated.counts.main_scores
    labels = list(dict.fromkeys(r.model for r in scores))
    if scores:
        lines.append(f"{'task':<38}" + "".join(f"{lab:>14}" for lab in labels))
    for t in dict.fromkeys(r.task for r in scores):
        vals = {r.model: r.value for r in scores if r.task == t}
        lines.append(f"{t:<38}" + "".join(f"{numbers.score(vals[lab]):>14}" if lab in vals else f"{'-':>14}"
                                          for lab in labels))
    return "\n".join(lines)


def _report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    report_md = (ctx.stage_dir / "report.md").read_text(encoding="utf-8")
    table = [{"task": r.task, "metric": r.metric, "model": r.model, "score ×100": round(100 * r.value, 2)}
             for r in EvaluateManifest.of(manifest).counts.main_scores]  # ×100, as in the report and the summary
    return Report(markdown=report_md, markdown_key="evaluate-report-", table=table, table_key="evaluate-scores-",
                  table_description="evaluate stage: mteb's main score per task and model, × 100")


def _fingerprint(ctx: StageContext):
    return lazy(BODY, "input_fingerprint")(ctx.config, ctx.run_dir, ctx.options.models, ctx.options.tasks)


def _inputs(ctx: StageContext) -> list[Path]:
    return lazy(BODY, "input_dirs")(ctx.config, ctx.run_dir, ctx.options.models)


def _run(ctx: StageContext, fingerprint) -> dict[str, Any]:
    return lazy(BODY, "run_evaluate")(ctx.config, ctx.run_dir, ctx.options.models, ctx.options.tasks,
                                      fingerprint=fingerprint)


# log_prints off: `datasets` fingerprints functions with dill, which disassembles code with
# print() while capturing sys.stdout; Prefect's print patch would turn that into log lines.
STAGE = Stage(name=NAME, help="MTEB on the configured tasks for the base and trained models",
              enabled=lambda c: c.evaluate is not None, fingerprint=_fingerprint, run=_run, summarize=format_counts,
              report=_report, options=EvaluateOptions, log_prints=False,
              inputs=_inputs)
