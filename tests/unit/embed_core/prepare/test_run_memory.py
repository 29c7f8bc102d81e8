"""Prepare streams: its peak memory does not grow with the size of a source (issue 20).

Each prepare runs in its own process, and its peak resident set size comes from the kernel
(``os.wait4``'s rusage of that child alone), so the two runs are measured alike.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

pytestmark = pytest.mark.slow

# Stated bound: growing a source 10x (5k -> 50k rows, 1 -> 10 MB) may add at most this much peak
# memory: the key store's page cache (32 MB, full only in the large run) and 32 MB of slack.
# Measured: 243 -> 277 MB (20k -> 200k: 230 -> 274 MB); before prepare streamed (418ab8e), 204 -> 408 MB
# at 5k -> 50k (20k -> 200k: 248 -> 988 MB), three times the bound.
SMALL_ROWS, LARGE_ROWS = 5_000, 50_000
GROWTH_BOUND_MB = 64


def write_sts_source(path: Path, rows: int) -> None:
    """A scored-pair CSV of distinct sentences (about 200 bytes a row), every 50th row a duplicate."""
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(rows):
            j = i - 1 if i % 50 == 49 else i
            fh.write(f'"Sentence number {j} says something about topic {j % 977} in {"many words " * 6}",'
                     f'"Another sentence {j} on subject {j % 613} with {"more words " * 6}",{(j % 50) / 10}\n')


def peak_rss_mb(config_path: Path, run_dir: Path) -> float:
    code = textwrap.dedent(f"""
        from embed_core.config import load_config
        from embed_core.prepare.run import run_prepare
        run_prepare(load_config({str(config_path)!r}), {str(run_dir)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert os.waitstatus_to_exitcode(status) == 0, err[-2000:]
    return usage.ru_maxrss / 1024  # kilobytes on Linux


def prepare_config(tmp_path: Path, name: str, rows: int) -> Path:
    source = tmp_path / f"{name}.csv"
    write_sts_source(source, rows)
    config = {"run_name": name, "run_root": str(tmp_path / "runs"), "data_root": str(tmp_path),
              "prepare": {"cleaning": {"dedupe": "normalized"},
                          "sources": [{"name": "pairs", "kind": "sts", "path": source.name, "header": False,
                                       "columns": {"text1": 0, "text2": 1, "score": 2}, "dev_fraction": 0.05}]}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_prepare_peak_memory_stays_flat_when_the_source_grows_tenfold(tmp_path):
    small = peak_rss_mb(prepare_config(tmp_path, "small", SMALL_ROWS), tmp_path / "run-small")
    large = peak_rss_mb(prepare_config(tmp_path, "large", LARGE_ROWS), tmp_path / "run-large")
    written = pq.read_metadata(tmp_path / "run-large" / "prepare" / "pairs.parquet")
    # every record really went through: 2 directions per row, less 5 % dev and the duplicate rows
    assert written.num_rows > 2 * LARGE_ROWS * 0.9
    assert written.num_row_groups > 1
    assert large - small < GROWTH_BOUND_MB, f"peak RSS {small:.0f} MB -> {large:.0f} MB"
