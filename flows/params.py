"""Typed flow parameters shared by the stage flows (the Prefect UI renders them as a form)."""

from __future__ import annotations

from pathlib import Path

from embed_core.config import RunConfig, load_config


def resolve_run(config_path: str | None, config: RunConfig | None, run_dir: str | None) -> tuple[RunConfig, str]:
    """Inline ``config`` wins over ``config_path``; ``run_dir`` defaults to ``<run_root>/<run_name>``."""
    if config is None:
        if not config_path:
            raise ValueError("give config_path or an inline config")
        config = load_config(config_path)
    return config, str(Path(run_dir) if run_dir else config.default_run_dir())


def run_stage(stage: str, run_task, summarize, config: RunConfig, run_dir: str) -> dict:
    """Run a stage's task (``run_task(config, run_dir)`` returns its final state) and report
    whether it was a cache hit, in the run log and in the returned summary."""
    from prefect.logging import get_run_logger

    state = run_task(config, run_dir)
    manifest = state.result()
    cached = state.name == "Cached"
    summary = summarize(manifest)
    if cached:
        get_run_logger().info("%s: cache hit (inputs %s unchanged) — reusing %s/%s, nothing recomputed\n%s",
                              stage, manifest["input_fingerprint"][:12], run_dir, stage, summary)
    return {"stage": stage, "cached": cached, "run_dir": run_dir, "manifest": manifest, "summary": summary}
