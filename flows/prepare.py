"""The prepare flow: raw sources → unified records (one stage)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from embed_core.config import RunConfig
from embed_core.prepare import format_counts
from flows.params import resolve_run, run_stage
from tasks.prepare import run_prepare_task


def run_prepare_stage(config: RunConfig, run_dir: str) -> dict[str, Any]:
    return run_stage("prepare", run_prepare_task, format_counts, config, run_dir)


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
