"""The evaluate flow: MTEB on the configured local tasks for the base model and trained models."""

from __future__ import annotations

from functools import partial
from typing import Any

from prefect import flow

from embed_core.config import RunConfig
from embed_core.evaluate import format_counts
from flows.params import resolve_run, run_context, run_stage
from tasks.evaluate import run_evaluate_task


def run_evaluate_stage(config: RunConfig, run_dir: str, models: list[str] | None = None,
                       tasks: list[str] | None = None, force: bool = False) -> dict[str, Any]:
    return run_stage("evaluate", partial(run_evaluate_task, models=models, tasks=tasks),
                     partial(format_counts, run_dir=run_dir), config, run_dir, force)


@flow(name="evaluate", log_prints=True)
def evaluate_flow(config_path: str = "deployments/configs/demo.yaml", run_dir: str | None = None,
                  config: RunConfig | None = None, run_name: str | None = None, models: list[str] | None = None,
                  tasks: list[str] | None = None, force: bool = False) -> dict[str, Any]:
    """Evaluate models with mteb into ``<run_dir>/evaluate``.

    Args:
        config_path: YAML run config with an ``evaluate`` section (ignored when ``config`` is given).
        run_dir: run directory; defaults to ``<run_root>/<run_name>``.
        config: inline run config.
        run_name: overrides the config's ``run_name``.
        models: 'base', 'trained' or local model paths (default: the config's ``evaluate.models``).
        tasks: task names from the config (default: all configured tasks).
        force: re-evaluate even when models, tasks and data are unchanged.
    """
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    with run_context(cfg, rdir, "evaluate"):
        return run_evaluate_stage(cfg, rdir, models, tasks, force)
