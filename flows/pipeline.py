"""The end-to-end pipeline flow: runs the stages that exist, in order.

Stages: prepare, synthesize (when the config has a ``synthesize`` section), mine (``mine``), train
(its stages in order, ``train``) and evaluate (``evaluate``; the base model and every trained
stage's model).
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow

from embed_core.config import RunConfig
from embed_core.evaluate import pipeline_models
from flows.evaluate import run_evaluate_stage
from flows.mine import run_mine_stage
from flows.params import resolve_run, run_context
from flows.prepare import run_prepare_stage
from flows.synthesize import run_synthesize_stage
from flows.train import run_train_stages
from tasks.common import publish_run_summary

Stage = Literal["prepare", "synthesize", "mine", "train", "evaluate"]
STAGES: tuple[Stage, ...] = ("prepare", "synthesize", "mine", "train", "evaluate")


@flow(name="pipeline", log_prints=True)
def pipeline_flow(config_path: str = "deployments/configs/demo.yaml", run_dir: str | None = None,
                  config: RunConfig | None = None, run_name: str | None = None,
                  stages: list[Stage] | None = None) -> dict[str, Any]:
    """Run the pipeline end to end; stages whose inputs did not change are cache hits.

    Args:
        config_path: YAML run config (ignored when ``config`` is given).
        run_dir: output run directory; defaults to ``<run_root>/<run_name>``.
        config: inline run config.
        run_name: overrides the config's ``run_name`` (and so the default run directory).
        stages: subset of stages to run (default: all that the config defines).
    """
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    wanted = stages or list(STAGES)
    results: dict[str, Any] = {}
    with run_context(cfg, rdir, "pipeline"):
        if "prepare" in wanted:
            results["prepare"] = run_prepare_stage(cfg, rdir)
        if "synthesize" in wanted and cfg.synthesize is not None:
            results["synthesize"] = run_synthesize_stage(cfg, rdir)
        if "mine" in wanted and cfg.mine is not None:
            results["mine"] = run_mine_stage(cfg, rdir)
        if "train" in wanted and cfg.train is not None:
            for res in run_train_stages(cfg, rdir):
                results[res["stage"]] = res
        if "evaluate" in wanted and cfg.evaluate is not None:
            results["evaluate"] = run_evaluate_stage(cfg, rdir, pipeline_models(cfg))
        publish_run_summary(cfg.run_name, rdir, results)
    return results
