"""Prefect tasks for the registered stages: one factory makes each stage's task, one runner calls
it for a stage instance (cache key from the instance's fingerprint, computed once, and reuse of
an intact artifact), records the result in the run directory's history and publishes the
stage's artifacts.

Cache key: the instance's input fingerprint (data, upstream outputs, config, code identity;
``embed_core.fingerprint``) plus the run directory. A hit is only allowed while the artifact it
stands for is still on disk and intact: the runner checks that and refreshes the cache
otherwise, so a deleted or tampered run dir never yields a stale "cached" result.
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.logging import get_run_logger

from embed_core import stages
from embed_core.artifacts import stage_is_intact
from embed_core.config import RunConfig
from embed_core.fingerprint import Fingerprint
from embed_core.rundir import append_history, save_config_snapshot
from tasks.common import publish_stage_outputs, reuse_intact, stage_cache_key, was_cached


def _cache_key(context, parameters: dict[str, Any]) -> str:
    return stage_cache_key(parameters["instance"], parameters["fingerprint"].key, parameters["run_dir"])


@functools.cache
def stage_task(name: str) -> Task:
    """The Prefect task of the registered stage ``name`` (retries and print capture per stage)."""
    stage = stages.get(name)

    @task(name=stage.name, cache_key_fn=_cache_key, persist_result=True, cache_expiration=timedelta(days=30),
          retries=stage.retries, retry_delay_seconds=30 if stage.retries else 0,
          task_run_name="{instance}-{config.run_name}", log_prints=stage.log_prints)
    def run_stage_task(config: RunConfig, run_dir: str, instance: str, options: Any, fingerprint: Fingerprint,
                       reuse: bool = True) -> dict[str, Any]:
        if reuse and (reused := reuse_intact(instance, run_dir, fingerprint.key)):
            return reused
        manifest = stage.run(config, Path(run_dir), instance, options, fingerprint)
        get_run_logger().info("%s:\n%s", instance, stage.summarize(manifest, Path(run_dir)))
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


def run_stage_instance(stage: stages.Stage, config: RunConfig, run_dir: str, instance: str, options: Any = None,
                       force: bool = False, snapshot: bool = True) -> dict[str, Any]:
    """Run one stage instance through its task; report whether it was a cache hit (run log,
    returned summary, ``history.jsonl``) and publish its artifacts. ``snapshot``: record ``config``
    as the run directory's config (off for sweep variants, whose configs are not the run's)."""
    with library_logs_to_prefect():
        return _run_stage_instance(stage, config, run_dir, instance, options, force, snapshot)


def _run_stage_instance(stage: stages.Stage, config: RunConfig, run_dir: str, instance: str, options: Any,
                        force: bool, snapshot: bool = True) -> dict[str, Any]:
    options = options if options is not None else stage.options()
    t0 = time.perf_counter()
    fingerprint = stage.fingerprint(config, Path(run_dir), instance, options)  # once per run
    intact = not force and stage_is_intact(Path(run_dir), instance, fingerprint.key)
    fn = stage_task(stage.name) if intact else stage_task(stage.name).with_options(refresh_cache=True)
    state = fn(config=config, run_dir=run_dir, instance=instance, options=options, fingerprint=fingerprint,
               reuse=not force, return_state=True)
    manifest = state.result()
    cached = was_cached(state, manifest)
    summary = stage.summarize(manifest, Path(run_dir))
    seconds = round(time.perf_counter() - t0, 3)
    if cached:
        get_run_logger().info("%s: cache hit (inputs %s unchanged) — reusing %s/%s, nothing recomputed\n%s",
                              instance, fingerprint.key[:12], run_dir, instance, summary)
    if snapshot:
        save_config_snapshot(run_dir, config)  # after the stage stands: a failed run keeps the last good snapshot
    if config.tracking is not None:  # once per stage result: a cache hit that was logged before adds nothing
        from embed_core.tracking import log_stage

        log_stage(config, run_dir, instance, manifest)
    append_history(run_dir, {"stage": instance, "cached": cached, "seconds": seconds,
                             "input_fingerprint": manifest.get("input_fingerprint")})
    publish_stage_outputs(instance, manifest, run_dir, cached, summary, seconds,
                          stage.report(config, Path(run_dir), manifest), config.run_name)
    return {"stage": instance, "cached": cached, "seconds": seconds, "run_dir": run_dir, "manifest": manifest,
            "summary": summary}
