"""Data-change detection for scheduled re-runs: which configured sources changed since the run
directory last recorded them (``<run_dir>/sources.json``), by content hash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from embed_core.artifacts import atomic_write_json
from embed_core.config import RunConfig
from embed_core.prepare.stage import source_fingerprints

SOURCES_FILE = "sources.json"


def recorded_sources(run_dir: str | Path) -> dict[str, str]:
    path = Path(run_dir) / SOURCES_FILE
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("sources", {})
    except (json.JSONDecodeError, AttributeError):
        return {}  # unreadable: every source counts as new, the pipeline's own caches still apply


def source_changes(config: RunConfig, run_dir: str | Path) -> dict[str, Any]:
    """``{"current": {name: hash}, "changes": [{source, change, old, new}]}``; change is one of
    ``new`` (not recorded yet), ``changed`` or ``removed`` (recorded, no longer configured)."""
    current = source_fingerprints(config)
    before = recorded_sources(run_dir)
    changes = []
    for name, new in current.items():
        if name not in before:
            changes.append({"source": name, "change": "new", "old": None, "new": new})
        elif before[name] != new:
            changes.append({"source": name, "change": "changed", "old": before[name], "new": new})
    for name in sorted(set(before) - set(current)):
        changes.append({"source": name, "change": "removed", "old": before[name], "new": None})
    return {"current": current, "changes": changes}


def record_sources(run_dir: str | Path, current: dict[str, str]) -> None:
    atomic_write_json(Path(run_dir) / SOURCES_FILE, {"sources": current})
