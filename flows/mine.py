"""The mine flow: FAISS hard-negative mining over prepare's records (one stage)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from embed_core.config import RunConfig
from embed_core.mine import format_counts
from flows.params import resolve_run, run_context, run_stage
from tasks.mine import run_mine_task


def run_mine_stage(config: RunConfig, run_dir: str, force: bool = False) -> dict[str, Any]:
    return run_stage("mine", run_mine_task, format_counts, config, run_dir, force)


@flow(name="mine", log_prints=True)
def mine_flow(config_path: str = "deployments/configs/demo.yaml", run_dir: str | None = None,
              config: RunConfig | None = None, run_name: str | None = None, force: bool = False) -> dict[str, Any]:
    """Mine hard negatives for the records under ``<run_dir>/prepare`` into ``<run_dir>/mine``.

    Args:
        config_path: YAML run config with a ``mine`` section (ignored when ``config`` is given).
        run_dir: run directory; defaults to ``<run_root>/<run_name>``.
        config: inline run config.
        run_name: overrides the config's ``run_name``.
        force: recompute even when the inputs are unchanged.
    """
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    with run_context(cfg, rdir, "mine"):
        return run_mine_stage(cfg, rdir, force)
