"""The task that trains one sweep variant (a train stage instance with the variant's config)."""

from __future__ import annotations

from typing import Any

from prefect import task

from embed_core import stages
from embed_core.config import RunConfig
from embed_core.stage_dirs import TRAIN, instance_name
from tasks.stage import run_stage_instance


@task(name="sweep-variant", task_run_name="variant-{variant}")
def train_variant(config: RunConfig, run_dir: str, variant: str, force: bool = False) -> dict[str, Any]:
    """Train (or reuse) the variant's train instance; the run directory's config snapshot stays the run's own."""
    stage = stages.get(TRAIN)
    options = stage.options(stage=variant)
    result = run_stage_instance(stage, config, run_dir, instance_name(variant), options, force, snapshot=False)
    return {k: result[k] for k in ("stage", "cached", "seconds")}
