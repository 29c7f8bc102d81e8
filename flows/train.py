"""The train flow: the configured stages in order (QZhou: stage 1 retrieval, stage 2 all tasks)."""

from __future__ import annotations

from functools import partial
from typing import Any

from prefect import flow

from embed_core.config import RunConfig
from embed_core.errors import ConfigError
from embed_core.train import format_counts
from flows.params import resolve_run, run_context, run_stage


def stage_names(config: RunConfig, stage: str | None) -> list[str]:
    if config.train is None:
        raise ConfigError("the run config has no 'train' section")
    names = [s.name for s in config.train.stages]
    if stage is None:
        return names
    if stage.isdigit() and 1 <= int(stage) <= len(names):  # --stage 1 | 2
        return [names[int(stage) - 1]]
    if stage not in names:
        raise ConfigError(f"train: no stage {stage!r} (configured: {', '.join(names)})")
    return [stage]


def run_train_stages(config: RunConfig, run_dir: str, stage: str | None = None, resume: bool = True,
                     force: bool = False) -> list[dict[str, Any]]:
    from tasks.train import run_train_task

    out = []
    for name in stage_names(config, stage):
        out.append(run_stage(f"train-{name}", partial(run_train_task, stage_name=name, resume=resume),
                             format_counts, config, run_dir, force))
    return out


@flow(name="train", log_prints=True)
def train_flow(config_path: str = "deployments/configs/demo.yaml", run_dir: str | None = None,
               config: RunConfig | None = None, run_name: str | None = None, stage: str | None = None,
               resume: bool = True, force: bool = False) -> list[dict[str, Any]]:
    """Train the configured stages (or one: ``stage`` = name or 1-based number) into ``<run_dir>/train-<name>``.

    Args:
        config_path: YAML run config with a ``train`` section (ignored when ``config`` is given).
        run_dir: run directory; defaults to ``<run_root>/<run_name>``.
        config: inline run config.
        run_name: overrides the config's ``run_name``.
        stage: one stage to run (name or number); default all, in order.
        resume: continue from the newest checkpoint of an interrupted run of the same inputs.
        force: retrain even when the inputs are unchanged.
    """
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    with run_context(cfg, rdir, "train"):
        return run_train_stages(cfg, rdir, stage, resume, force)
