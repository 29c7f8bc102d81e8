"""The mine flow: FAISS hard-negative mining over prepare's records (one stage)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from embed_core.config import RunConfig
from embed_core.mine import format_counts
from flows.params import resolve_run, run_stage
from tasks.mine import run_mine_task


def run_mine_stage(config: RunConfig, run_dir: str) -> dict[str, Any]:
    return run_stage("mine", run_mine_task, format_counts, config, run_dir)


@flow(name="mine", log_prints=True)
def mine_flow(config_path: str = "deployments/configs/demo.yaml", run_dir: str | None = None,
              config: RunConfig | None = None) -> dict[str, Any]:
    """Mine hard negatives for the records under ``<run_dir>/prepare`` into ``<run_dir>/mine``."""
    cfg, rdir = resolve_run(config_path, config, run_dir)
    return run_mine_stage(cfg, rdir)
