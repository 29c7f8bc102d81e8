"""The prepare flow: raw sources → unified records (one stage)."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.logging import get_run_logger

from embed_core.config import RunConfig
from embed_core.prepare import format_counts
from flows.params import resolve_run
from tasks.prepare import run_prepare_task


def run_prepare_stage(config: RunConfig, run_dir: str) -> dict[str, Any]:
    """Submit the prepare task and report whether it was a cache hit."""
    logger = get_run_logger()
    state = run_prepare_task(config, run_dir)
    manifest = state.result()
    cached = state.name == "Cached"
    if cached:
        logger.info("prepare: cache hit (inputs %s unchanged) — reusing %s/prepare",
                    manifest["input_fingerprint"][:12], run_dir)
        logger.info("prepare counts (cached):\n%s", format_counts(manifest))
    return {"stage": "prepare", "cached": cached, "run_dir": run_dir, "manifest": manifest,
            "summary": format_counts(manifest)}


@flow(name="prepare", log_prints=True)
def prepare_flow(config_path: str = "deployments/configs/demo.yaml", run_dir: str | None = None,
                 config: RunConfig | None = None) -> dict[str, Any]:
    """Convert the configured raw sources into unified records under ``<run_dir>/prepare``.

    Args:
        config_path: YAML run config (ignored when ``config`` is given).
        run_dir: output run directory; defaults to ``<run_root>/<run_name>`` from the config.
        config: inline run config, as an alternative to ``config_path``.
    """
    cfg, rdir = resolve_run(config_path, config, run_dir)
    return run_prepare_stage(cfg, rdir)
