"""Typed flow parameters and the run-directory context shared by the flows (the Prefect UI renders
the parameters as a form)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from embed_core.config import RunConfig, load_config
from embed_core.rundir import append_history, run_dir_lock, save_config_snapshot


def resolve_run(config_path: str | None, config: RunConfig | None, run_dir: str | None,
                run_name: str | None = None) -> tuple[RunConfig, str]:
    """Inline ``config`` wins over ``config_path``; ``run_name`` overrides the config's;
    ``run_dir`` defaults to ``<run_root>/<run_name>``."""
    if config is None:
        if not config_path:
            raise ValueError("give config_path or an inline config")
        config = load_config(config_path)
    if run_name:
        config = config.model_copy(update={"run_name": run_name})
    return config, str(Path(run_dir) if run_dir else config.default_run_dir())


@contextmanager
def run_context(config: RunConfig, run_dir: str, purpose: str) -> Iterator[None]:
    """Hold the run directory's lock (a second run on it is refused, never interleaved) and record
    the config this run uses, for ``embedpipe <stage> --run-dir D`` and ``embedpipe status``."""
    with run_dir_lock(run_dir, purpose):
        save_config_snapshot(run_dir, config)
        yield


def run_stage(stage: str, run_task, summarize, config: RunConfig, run_dir: str, force: bool = False) -> dict:
    """Run a stage's task (``run_task(config, run_dir, force=...)`` returns its final state), report
    whether it was a cache hit (run log, returned summary, ``history.jsonl``) and publish a summary
    artifact that links the stage's files."""
    from prefect.logging import get_run_logger

    from tasks.common import publish_stage_outputs, was_cached

    t0 = time.perf_counter()
    state = run_task(config, run_dir, force=force)
    manifest = state.result()
    cached = was_cached(state, manifest)
    summary = summarize(manifest)
    seconds = round(time.perf_counter() - t0, 3)
    if cached:
        get_run_logger().info("%s: cache hit (inputs %s unchanged) — reusing %s/%s, nothing recomputed\n%s",
                              stage, manifest["input_fingerprint"][:12], run_dir, stage, summary)
    append_history(run_dir, {"stage": stage, "cached": cached, "seconds": seconds,
                             "input_fingerprint": manifest.get("input_fingerprint")})
    publish_stage_outputs(stage, manifest, run_dir, cached, summary, seconds)
    return {"stage": stage, "cached": cached, "seconds": seconds, "run_dir": run_dir, "manifest": manifest,
            "summary": summary}
