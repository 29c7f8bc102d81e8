"""Prefect tasks for the registered stages: one factory makes each stage's task, one runner calls
it for a stage instance, records the result in the run directory's history and publishes the
stage's artifacts.

One cache: the run directory. The runner computes the instance's input fingerprint once and asks
the run directory whether an intact artifact of those inputs is there (``stages.cache_decision``) —
that decides hit or miss, before the task. On a hit the task reads the manifest and ends in a
``Cached`` state (the UI shows it); on a miss it runs the stage. Prefect keeps no results and no
cache keys of its own: it gives the stage retries, logs and UI state.
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.states import Completed

from embed_core import stages
from embed_core.artifacts import read_manifest
from embed_core.config import RunConfig
from embed_core.manifests import Manifest, StageResult, stage_result
from embed_core.rundir import append_history, save_config_snapshot
from embed_core.stage_api import Stage, StageContext
from tasks.common import no_retry_on_input_errors, publish_stage_outputs


@functools.cache
def stage_task(name: str) -> Task:
    """The Prefect task of the registered stage ``name`` (retries and print capture per stage)."""
    stage = stages.get(name)

    @task(name=stage.name, cache_policy=NO_CACHE, persist_result=False, retries=stage.retries,
          retry_delay_seconds=30 if stage.retries else 0, task_run_name="{instance}-{run_name}",
          log_prints=stage.log_prints, retry_condition_fn=no_retry_on_input_errors)
    def run_stage_task(ctx: StageContext, instance: str, run_name: str, fingerprint, hit: bool):
        if hit:
            manifest = read_manifest(ctx.run_dir, instance)
            get_run_logger().info("%s: cache hit (inputs %s unchanged) — reusing %s/%s, nothing recomputed\n%s",
                                  instance, fingerprint.key[:12], ctx.run_dir, instance, stage.summarize(manifest))
            return Completed(name="Cached", message=f"inputs {fingerprint.key[:12]} unchanged: the run directory "
                                                    "holds this artifact", data=manifest)
        manifest = stage.run(ctx, fingerprint)
        get_run_logger().info("%s:\n%s", instance, stage.summarize(manifest))
        return manifest

    return run_stage_task


@contextmanager
def library_logs_to_prefect():
    """The library's loggers (``embedpipe.*``: progress, counts, warnings) at INFO into the Prefect
    run logs for the block, whatever the worker's logging settings; nothing is added twice."""
    from prefect.logging.handlers import APILogHandler

    logger = logging.getLogger("embedpipe")
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel (not .level =) also clears the child loggers' level caches
    handler = None
    if not any(isinstance(h, APILogHandler) for h in logger.handlers):
        handler = APILogHandler()
        logger.addHandler(handler)
    try:
        yield
    finally:
        if handler is not None:
            logger.removeHandler(handler)
        logger.setLevel(level)


def run_stage_instance(stage: Stage, config: RunConfig, run_dir: str, instance: str, options: Any = None,
                       force: bool = False, snapshot: bool = True) -> StageResult:
    """Run one stage instance through its task; report whether it was a cache hit (run log,
    returned summary, ``history.jsonl``) and publish its artifacts. ``snapshot``: record ``config``
    as the run directory's config (off for sweep variants, whose configs are not the run's)."""
    with library_logs_to_prefect():
        return _run_stage_instance(stage, stages.context(config, run_dir, stage, instance, options), force, snapshot)


def _run_stage_instance(stage: Stage, ctx: StageContext, force: bool, snapshot: bool) -> StageResult:
    t0 = time.perf_counter()
    fingerprint, hit = stages.cache_decision(stage, ctx, force)  # once per run
    stage_run = stage_task(stage.name)
    if stage.retries and stage.retry_delay_s is not None:
        stage_run = stage_run.with_options(retry_delay_seconds=stage.retry_delay_s(ctx.config))
    state = stage_run(ctx=ctx, instance=ctx.instance, run_name=ctx.config.run_name,
                                   fingerprint=fingerprint, hit=hit, return_state=True)
    manifest = state.result()  # the manifest, held in memory (no result persistence)
    summary = stage.summarize(manifest)
    seconds = round(time.perf_counter() - t0, 3)
    run_dir = str(ctx.run_dir)
    if snapshot:
        save_config_snapshot(run_dir, ctx.config)  # after the stage stands: a failed run keeps the last good snapshot
    if ctx.config.tracking is not None:  # once per stage result: a cache hit that was logged before adds nothing
        from embed_core.runs.tracking import log_stage

        log_stage(ctx.config, run_dir, ctx.instance, manifest)
    append_history(run_dir, {"stage": ctx.instance, "cached": hit, "seconds": seconds,
                             "input_fingerprint": Manifest.of(manifest).input_fingerprint})
    publish_stage_outputs(ctx.instance, manifest, run_dir, hit, summary, seconds, stage.report(ctx, manifest),
                          ctx.config.run_name)
    return stage_result(ctx.instance, manifest, cached=hit, seconds=seconds, run_dir=run_dir, summary=summary)
