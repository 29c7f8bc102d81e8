"""Typed flow parameters and the run-directory context shared by the flows (the Prefect UI renders
the parameters as a form)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from embed_core.config import RunConfig, load_config
from embed_core.rundir import check_delegated, run_dir_lock
from flows.env import apply_defaults

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
        config = config.with_run_name(run_name)
    return config, str(Path(run_dir) if run_dir else config.default_run_dir())


@contextmanager
def run_context(config: RunConfig, run_dir: str, purpose: str, parent_lock: str | None = None) -> Iterator[None]:
    """Hold the run directory's lock (a second run on it is refused, never interleaved): the one
    place it is taken, for a run started from the CLI and from the UI alike (the CLI only checks
    beforehand that it is free, ``raise_if_busy``). The config snapshot (for ``embedpipe <stage>
    --run-dir D`` and ``embedpipe status``) is written by each stage that completes, so a run that
    fails before any stage leaves the last good one. The environment defaults (``flows.env``) are
    applied first, for a flow run in a worker whose environment lacks them.

    ``parent_lock``: this run was started on another work pool by the run that holds the lock (its
    flow run id); it works under that lock after checking the directory is visible and held by it."""
    apply_defaults()
    if parent_lock:
        check_delegated(run_dir, parent_lock)
        yield
        return
    from prefect.runtime import flow_run

    with run_dir_lock(run_dir, purpose, token=flow_run.id):
        yield


def run_name_of(parameters: dict) -> str:
    """The run name a flow run's parameters give: ``run_name``, else the config's."""
    if parameters.get("run_name"):
        return parameters["run_name"]
    config = parameters.get("config")
    if config is not None:
        return config.run_name if isinstance(config, RunConfig) else dict(config).get("run_name", "run")
    try:
        return load_config(parameters.get("config_path") or DEFAULT_CONFIG).run_name
    except Exception:  # the flow itself reports a bad config; the name must not fail first
        return "run"


def flow_run_name() -> str:
    """Prefect flow-run name: the embedpipe run name (the UI then lists runs by what they write)."""
    from prefect.runtime import flow_run

    return run_name_of(flow_run.parameters)
