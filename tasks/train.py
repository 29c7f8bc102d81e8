"""Prefect task for one training stage (cache key: upstream records + train config + init model)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger

from embed_core.config import RunConfig
from embed_core.train import format_counts, input_fingerprint, run_train_stage, stage_dir_name, get_stage
from tasks.common import call_stage_task, inline_images, input_key_cache_key, reuse_intact


@task(name="train", cache_key_fn=input_key_cache_key("train-{stage_name}"), persist_result=True, cache_expiration=timedelta(days=30),
      task_run_name="train-{stage_name}-{config.run_name}")
def train_task(config: RunConfig, run_dir: str, stage_name: str, input_key: str, reuse: bool = True, resume: bool = True) -> dict[str, Any]:
    if reuse and (reused := reuse_intact(f"train-{stage_name}", run_dir, input_key)):
        return reused
    import logging

    logging.getLogger("embedpipe.train").setLevel(logging.INFO)
    manifest = run_train_stage(config, run_dir, stage_name, resume=resume)
    get_run_logger().info("train %s:\n%s", stage_name, format_counts(manifest))
    out = Path(run_dir) / f"train-{stage_name}"
    create_markdown_artifact(markdown=inline_images(f"# train {stage_name}: {config.run_name}\n\n```\n{format_counts(manifest)}"
                                                    f"\n```\n\nModel: `{out / 'model'}`\n\n![loss curve](loss.png)\n", out),
                             description=f"train stage {stage_name}")
    return manifest


def run_train_task(config: RunConfig, run_dir: str, stage_name: str, resume: bool = True, force: bool = False):
    _, stage = get_stage(config, stage_name)
    fp = input_fingerprint(config, run_dir, stage_name)["key"]
    return call_stage_task(train_task, stage_dir_name(stage), fp, force, config=config, run_dir=run_dir,
                           stage_name=stage_name, resume=resume)
