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
