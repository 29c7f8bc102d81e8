"""Longest test files first: with pytest-xdist's ``--dist loadfile --no-loadscope-reorder`` each worker
takes whole files in collection order, so putting the files that took longest first (from
``tests/durations.json``, seconds per file as measured by ``pytest --store-durations``) keeps one
long file from starting last and running alone at the end (longest-processing-time-first
scheduling). Files the record does not know go last, in their usual order; within a file the
tests keep their order."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from tests.helpers.repo import REPO

DURATIONS = REPO / "tests" / "durations.json"


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def longest_files_first(items: list, seconds: dict[str, float]) -> None:
    """Reorder ``items`` in place: files by recorded seconds, longest first; unknown files after
    them in collection order; each file's tests in their own order (a stable sort)."""
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(file_of(item.nodeid), i)
    items.sort(key=lambda item: (-seconds.get(file_of(item.nodeid), -1.0), first_seen[file_of(item.nodeid)]))


class Recorder:
    """Seconds per test file (setup + call + teardown of its tests), summed from the reports the
    controlling process receives (each worker's, under pytest-xdist)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, report) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def store(self, path: Path = DURATIONS) -> None:
        """Merge into ``path``: this run's files replace their old figures, the others stay."""
        merged = {**load(path), **{k: round(v, 1) for k, v in self.seconds.items()}}
        path.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n", encoding="utf-8")
