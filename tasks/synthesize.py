"""Prefect task for the synthesize stage (cache key: prepare's output hashes + synthesize config,
which names the LLM, + prompt template versions and bytes + filter model)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.logging import get_run_logger

from embed_core.config import RunConfig
from embed_core.synthesize import STAGE, format_counts, input_fingerprint, run_synthesize
from tasks.common import artifact_key, call_stage_task, input_key_cache_key, reuse_intact


# One task-level retry on top of the client's per-request retries: the request cache makes a
# retry repeat only the calls that had not finished.
@task(name="synthesize", cache_key_fn=input_key_cache_key(STAGE), persist_result=True,
      cache_expiration=timedelta(days=30), retries=1, retry_delay_seconds=30,
      task_run_name="synthesize-{config.run_name}")
def synthesize_task(config: RunConfig, run_dir: str, input_key: str, reuse: bool = True) -> dict[str, Any]:
    if reuse and (reused := reuse_intact(STAGE, run_dir, input_key)):
        return reused
    manifest = run_synthesize(config, run_dir)
    get_run_logger().info("synthesize counts:\n%s", format_counts(manifest))
    rows = [{"strategy": name, **{k: v for k, v in s.items()}} for name, s in manifest["counts"]["strategies"].items()]
    if rows:
        create_table_artifact(key=artifact_key("synthesize-stats-", config.run_name), table=rows,
                              description="synthesize stage: requests, failures and filters per strategy")
    create_markdown_artifact(markdown=f"# synthesize: {config.run_name}\n\n```\n{format_counts(manifest)}\n```\n\n"
                                      f"Samples: `{run_dir}/{STAGE}/_samples.parquet`, failures with raw replies: "
                                      f"`_failures.parquet`, filtered answers: `_filtered.parquet`.\n",
                             description="synthesize stage outputs")
    return manifest


def run_synthesize_task(config: RunConfig, run_dir: str, force: bool = False):
    return call_stage_task(synthesize_task, STAGE, input_fingerprint(config, run_dir)["key"], force,
                           config=config, run_dir=run_dir)
