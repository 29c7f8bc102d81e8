"""The ablation flow: every row of the config's ``ablation`` section (the config, and each variant)
with every seed, run end to end as a pipeline subflow in its own run directory (cache hits when
unchanged), then the table of test scores (``embed_core.runs.ablation``)."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.logging import get_run_logger

from embed_core.runs import ablation
from embed_core.evaluate.run import main_scores
from flows.failures import reports_user_errors
from flows.params import DEFAULT_CONFIG, flow_run_name, resolve_run, with_run_args_doc
from flows.pipeline import pipeline_flow


@flow(name="ablation", log_prints=True, flow_run_name=flow_run_name)
@reports_user_errors
@with_run_args_doc
def ablation_flow(config_path: str | None = DEFAULT_CONFIG, config: dict[str, Any] | None = None,
                  run_name: str | None = None, run_dir: str | None = None, force: bool = False) -> dict[str, Any]:
    """Run the config and each of its ``ablation.variants`` with every seed (each its own run
    directory ``{run_root}/{run_name}-{row}-s{seed}``), and write the table of test scores (mean ±
    spread over the seeds) to ``{run_root}/{run_name}-ablation/report.md``.

    Args:
        {run_args}
        force: recompute every stage of every run even when its inputs are unchanged.
    """
    cfg, _ = resolve_run(config_path, config, run_dir, run_name)
    runs = ablation.row_configs(cfg)
    logger = get_run_logger()
    scores: list[dict[str, Any]] = []
    for i, (row, seed, run_cfg) in enumerate(runs, 1):
        logger.info("ablation: run %d of %d: %s, seed %d", i, len(runs), row, seed)
        rdir = str(run_cfg.default_run_dir())
        pipeline_flow(config_path=None, config=run_cfg.model_dump(mode="json"), run_dir=rdir, force=force)
        scores += ablation.run_scores(row, seed, rdir, run_cfg, main_scores(rdir))
    out = ablation.write_report(cfg, scores)
    logger.info("ablation: %s", out / "report.md")
    return {"report": str(out / "report.md"), "runs": len(runs), "scores": scores}
