"""The synthesize flow: LLM paraphrase, augmentation and hard negatives over prepare's records."""

from __future__ import annotations

from typing import Any

from prefect import flow

from embed_core.config import RunConfig
from embed_core.synthesize import format_counts
from flows.params import resolve_run, run_context, run_stage
from tasks.synthesize import run_synthesize_task


def run_synthesize_stage(config: RunConfig, run_dir: str, force: bool = False) -> dict[str, Any]:
    return run_stage("synthesize", run_synthesize_task, format_counts, config, run_dir, force)


@flow(name="synthesize", log_prints=True)
def synthesize_flow(config_path: str = "deployments/configs/demo.yaml", run_dir: str | None = None,
                    config: RunConfig | None = None, run_name: str | None = None,
                    force: bool = False) -> dict[str, Any]:
    """Synthesize records from ``<run_dir>/prepare`` into ``<run_dir>/synthesize``.

    Args:
        config_path: YAML run config with a ``synthesize`` section (ignored when ``config`` is given).
        run_dir: run directory; defaults to ``<run_root>/<run_name>``.
        config: inline run config.
        run_name: overrides the config's ``run_name``.
        force: recompute even when the inputs are unchanged (cached LLM answers are still reused).
    """
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    with run_context(cfg, rdir, "synthesize"):
        return run_synthesize_stage(cfg, rdir, force)
