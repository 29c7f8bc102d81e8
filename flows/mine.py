"""The mine flow: FAISS hard-negative mining over prepare's records (one stage)."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.logging import get_run_logger

from embed_core.config import RunConfig
from embed_core.mine import format_counts
from flows.params import resolve_run
from tasks.mine import run_mine_task


def run_mine_stage(config: RunConfig, run_dir: str) -> dict[str, Any]:
    logger = get_run_logger()
    state = run_mine_task(config, run_dir)
    manifest = state.result()
    cached = state.name == "Cached"
    if cached:
        logger.info("mine: cache hit (inputs %s unchanged) — reusing %s/mine, nothing encoded",
                    manifest["input_fingerprint"][:12], run_dir)
    return {"stage": "mine", "cached": cached, "run_dir": run_dir, "manifest": manifest,
            "summary": format_counts(manifest)}


@flow(name="mine", log_prints=True)
def mine_flow(config_path: str = "deployments/configs/demo.yaml", run_dir: str | None = None,
              config: RunConfig | None = None) -> dict[str, Any]:
    """Mine hard negatives for the records under ``<run_dir>/prepare`` into ``<run_dir>/mine``."""
    cfg, rdir = resolve_run(config_path, config, run_dir)
    return run_mine_stage(cfg, rdir)
