"""Prefect task for the mine stage (cache key: prepare's output hashes + mine config + model fingerprint)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.logging import get_run_logger

from embed_core.config import RunConfig
from embed_core.mine import STAGE, format_counts, input_fingerprint, run_mine
from tasks.common import artifact_key, call_stage_task, inline_images, input_key_cache_key, reuse_intact


@task(name="mine", cache_key_fn=input_key_cache_key(STAGE), persist_result=True, cache_expiration=timedelta(days=30),
      task_run_name="mine-{config.run_name}")
def mine_task(config: RunConfig, run_dir: str, input_key: str, reuse: bool = True) -> dict[str, Any]:
    if reuse and (reused := reuse_intact(STAGE, run_dir, input_key)):
        return reused
    manifest = run_mine(config, run_dir)
    get_run_logger().info("mine counts:\n%s", format_counts(manifest))
    rows = [{k: d.get(k) for k in ("dataset", "records", "mined", "negatives_added", "too_few", "filtered_by_margin")}
            | {"index": (d.get("index") or {}).get("type"), "positive_p50": (d.get("positive_score") or {}).get("p50"),
               "kept_p50": (d.get("kept_score") or {}).get("p50")} for d in manifest["counts"]["datasets"]]
    create_table_artifact(key=artifact_key("mine-stats-", config.run_name), table=rows, description="mine stage: negatives per dataset and score medians")
    plot = Path(run_dir) / STAGE / "score_hist.png"
    create_markdown_artifact(markdown=inline_images(f"# mine: {config.run_name}\n\n```\n{format_counts(manifest)}\n```\n\n"
                                                    f"![score histogram]({plot.name})\n", plot.parent),
                             description="mine stage outputs")
    return manifest


def run_mine_task(config: RunConfig, run_dir: str, force: bool = False):
    return call_stage_task(mine_task, STAGE, input_fingerprint(config, run_dir)["key"], force,
                           config=config, run_dir=run_dir)
