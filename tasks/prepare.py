"""Prefect task for the prepare stage.

Cache key: the content hash of every input file + the prepare config + code version
(``embed_core.prepare.input_fingerprint``) + the run directory. A hit is only allowed while the
artifact it stands for is still on disk and intact: ``run_prepare_task`` checks that and refreshes
the cache otherwise, so a deleted or tampered run dir never yields a stale "cached" result.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.logging import get_run_logger

from embed_core.config import RunConfig
from tasks.common import artifact_key, call_stage_task, input_key_cache_key, reuse_intact
from embed_core.prepare import STAGE, counts_table, format_counts, input_fingerprint, run_prepare


@task(name="prepare", cache_key_fn=input_key_cache_key(STAGE), persist_result=True,
      cache_expiration=timedelta(days=30), task_run_name="prepare-{config.run_name}")
def prepare_task(config: RunConfig, run_dir: str, input_key: str, reuse: bool = True) -> dict[str, Any]:
    if reuse and (reused := reuse_intact(STAGE, run_dir, input_key)):
        return reused
    logger = get_run_logger()
    manifest = run_prepare(config, run_dir)
    logger.info("prepare counts:\n%s", format_counts(manifest))
    publish_prepare_artifacts(manifest, run_dir)
    return manifest


def run_prepare_task(config: RunConfig, run_dir: str, force: bool = False):
    """Call ``prepare_task`` and return its final state; recompute if asked or if the artifact on
    disk is not the one the cache entry stands for."""
    return call_stage_task(prepare_task, STAGE, input_fingerprint(config)["key"], force, config=config, run_dir=run_dir)


def publish_prepare_artifacts(manifest: dict[str, Any], run_dir: str) -> None:
    create_table_artifact(key=artifact_key("prepare-counts-", manifest["run_name"]), table=counts_table(manifest),
                          description=f"prepare stage counts for run '{manifest['run_name']}'")
    files = "\n".join(f"- `{Path(run_dir) / 'prepare' / n}` ({i.get('rows', '?')} rows)"
                      for n, i in manifest["outputs"].items())
    t = manifest["counts"]["totals"]
    create_markdown_artifact(
        markdown=(f"# prepare: {manifest['run_name']}\n\n"
                  f"{t['records_written']} records written, {t['quarantined']} quarantined "
                  f"{t['quarantined_by_reason']}, {t['deduped']} deduped, "
                  f"{t['excluded_contamination']} excluded by contamination.\n\n## Files\n{files}\n"),
        description="prepare stage outputs")
