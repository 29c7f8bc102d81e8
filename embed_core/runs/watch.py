"""Data-change detection for scheduled re-runs: which configured sources changed since the run
directory last recorded them (``<run_dir>/sources.json``), by content hash; and the verdict of a
data-watch run (what changed, what the pipeline recomputed) for its log and its report."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embed_core.artifacts import atomic_write_json
from embed_core.config import RunConfig
from embed_core.prepare.run import source_fingerprints

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


@dataclass(frozen=True)
class WatchReport:
    """What a data-watch run did. ``stages``: each stage the pipeline ran here, ``computed`` or
    ``cache hit`` (empty when it did not run here); ``verdict``: one line; ``markdown``: the report."""

    stages: dict[str, str]
    verdict: str
    markdown: str

    @property
    def all_cached(self) -> bool:
        return bool(self.stages) and "computed" not in self.stages.values()


def watch_report(run_name: str, changes: list[dict[str, Any]], cached: dict[str, bool] | None,
                 seconds: float) -> WatchReport:
    """The report of a data-watch run: ``changes`` as :func:`source_changes` lists them;
    ``cached``: for each stage the pipeline ran, whether it was a cache hit (None: the pipeline
    did not run here, the changes went out as events only); ``seconds``: the run's wall time."""
    stages = {name: "cache hit" if hit else "computed" for name, hit in (cached or {}).items()}
    computed = [s for s, v in stages.items() if v == "computed"]
    changed = [f"{c['source']} ({c['change']})" for c in changes]
    if cached is None:
        verdict = f"{len(changed)} source change(s) emitted as events; pipeline not run here"
    elif not computed:
        verdict = f"no stage recomputed: all {len(stages)} stages were cache hits"
    else:
        verdict = f"recomputed {', '.join(computed)}; cache hits: {', '.join(s for s in stages if s not in computed) or 'none'}"
    markdown = (f"# data-watch: {run_name}\n\n**{verdict}** ({seconds} s)\n\n"
                f"Changed sources: {', '.join(changed) or 'none'}\n\n"
                "| stage | result |\n|---|---|\n" + "\n".join(f"| {s} | {v} |" for s, v in stages.items()) + "\n")
    return WatchReport(stages=stages, verdict=verdict, markdown=markdown)
