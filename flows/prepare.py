"""The prepare flow: raw sources → unified records (one stage)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from embed_core.config import RunConfig
from embed_core.prepare import format_counts
from flows.params import resolve_run, run_context, run_stage
from tasks.prepare import run_prepare_task


def run_prepare_stage(config: RunConfig, run_dir: str, force: bool = False) -> dict[str, Any]:
    return run_stage("prepare", run_prepare_task, format_counts, config, run_dir, force)


@flow(name="prepare", log_prints=True)
def prepare_flow(config_path: str = "deployments/configs/demo.yaml", run_dir: str | None = None,
                 config: RunConfig | None = None, run_name: str | None = None, force: bool = False) -> dict[str, Any]:
    """Convert the configured raw sources into unified records under ``<run_dir>/prepare``.

    Args:
        config_path: YAML run config (ignored when ``config`` is given).
        run_dir: output run directory; defaults to ``<run_root>/<run_name>`` from the config.
        config: inline run config, as an alternative to ``config_path``.
        run_name: overrides the config's ``run_name`` (and so the default run directory).
        force: recompute even when the inputs are unchanged (a cache hit otherwise).
    """
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    with run_context(cfg, rdir, "prepare"):
        return run_prepare_stage(cfg, rdir, force)
