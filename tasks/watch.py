"""Prefect tasks for the data-change watch: fingerprint the sources, emit one event per change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.events import emit_event
from prefect.logging import get_run_logger

from embed_core.config import RunConfig
from embed_core.runs.watch import source_changes

SOURCE_CHANGED_EVENT = "embedpipe.source.changed"


# Never cached: its whole point is to look at the files again.
@task(name="fingerprint-sources", task_run_name="fingerprint-sources-{config.run_name}")
def fingerprint_sources_task(config: RunConfig, run_dir: str) -> dict[str, Any]:
    found = source_changes(config, run_dir)
    logger = get_run_logger()
    if found["changes"]:
        for c in found["changes"]:
            logger.info("source %s: %s (%s -> %s)", c["source"], c["change"], (c["old"] or "-")[:12], (c["new"] or "-")[:12])
    else:
        logger.info("no source changed (%d sources, content hashes as recorded)", len(found["current"]))
    return found


def emit_source_events(changes: list[dict[str, Any]], config: RunConfig, config_path: str | None, run_dir: str) -> None:
    """``embedpipe.source.changed`` per changed source; the payload carries what a deployment
    trigger needs to start the pipeline on the same config and run directory."""
    for c in changes:
        emit_event(
            event=SOURCE_CHANGED_EVENT,
            resource={"prefect.resource.id": f"embedpipe.source.{config.run_name}.{c['source']}",
                      "prefect.resource.name": c["source"], "embedpipe.run-name": config.run_name,
                      # the pipeline trigger debounces per run directory (one run for a burst of changes)
                      "embedpipe.run-dir": str(Path(run_dir).resolve())},
            payload={"source": c["source"], "change": c["change"], "old": c["old"], "new": c["new"],
                     "config_path": str(Path(config_path).resolve()) if config_path else None,
                     "run_dir": str(Path(run_dir).resolve())},
        )
