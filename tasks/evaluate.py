"""Prefect task for the evaluate stage (cache key: model fingerprints + task specs + data hashes)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.logging import get_run_logger

from embed_core.config import RunConfig
from embed_core.evaluate import STAGE, format_counts, input_fingerprint, main_scores, run_evaluate
from tasks.common import artifact_key, call_stage_task, inline_images, input_key_cache_key, reuse_intact


# log_prints off: `datasets` fingerprints functions with dill, which disassembles code with print()
# while capturing sys.stdout; Prefect's print patch would turn that bytecode into log lines.
@task(name="evaluate", cache_key_fn=input_key_cache_key(STAGE), persist_result=True, cache_expiration=timedelta(days=30),
      task_run_name="evaluate-{config.run_name}", log_prints=False)
def evaluate_task(config: RunConfig, run_dir: str, input_key: str, reuse: bool = True, models: list[str] | None = None,
                  tasks: list[str] | None = None) -> dict[str, Any]:
    if reuse and (reused := reuse_intact(STAGE, run_dir, input_key)):
        return reused
    manifest = run_evaluate(config, run_dir, models=models, tasks=tasks)
    get_run_logger().info("evaluate:\n%s", format_counts(manifest, run_dir))
    create_table_artifact(key=artifact_key("evaluate-scores-", config.run_name),
                          table=[{k: r[k] for k in ("model", "task", "metric", "value")} for r in main_scores(run_dir)],
                          description="evaluate stage: main score per model and task (mteb)")
    report = Path(run_dir) / STAGE / "report.md"
    create_markdown_artifact(key=artifact_key("evaluate-report-", config.run_name),
                             markdown=inline_images(report.read_text(encoding="utf-8"), report.parent)
                             + f"\n\nReport file: `{report}`\n",
                             description="evaluate stage report")
    return manifest


def run_evaluate_task(config: RunConfig, run_dir: str, models: list[str] | None = None,
                      tasks: list[str] | None = None, force: bool = False):
    fp = input_fingerprint(config, run_dir, models, tasks)["key"]
    return call_stage_task(evaluate_task, STAGE, fp, force, config=config, run_dir=run_dir, models=models, tasks=tasks)
