"""Typed flow parameters and the run-directory context shared by the flows (the Prefect UI renders
the parameters as a form)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from embed_core.config import RunConfig, load_config
from embed_core.rundir import run_dir_lock, save_config_snapshot

DEFAULT_CONFIG = "deployments/configs/demo.yaml"


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
