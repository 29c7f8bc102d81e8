"""The pieces of ``make gpu-run``'s steps: a command run to its log with a time limit, and what a
finished run directory says: each train stage's device, precision, tokens/s, MFU and peak memory
(from its manifest.json and metrics.parquet) and the evaluate stage's main scores."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any


def run_command(cmd: list[str], log: Path, *, env: dict[str, str] | None = None,
                timeout: float | None = None, append: bool = False) -> dict[str, Any]:
    """Run ``cmd`` with its stdout and stderr in ``log`` (after what it holds, with ``append``);
    exit status, seconds, and the log's last line when it failed (the CLI's one-line error)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("a" if append else "w", encoding="utf-8") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    out: dict[str, Any] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "log": str(log)}
    if rc != 0:
        lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        out["error"] = "timed out" if rc == 124 else (lines[-1][:400] if lines else f"exit {rc}")
    return out


def train_summary(run_dir: Path, stage_names: list[str]) -> dict[str, Any]:
    """Per train stage (``train-<name>`` of ``stage_names`` that committed): device, precision, steps, tokens,
    training seconds, tokens/s over the timed steps, mean MFU over the steps that have one, peak
    memory (MB: CUDA allocated; on a CPU the process's peak resident memory)."""
    import pyarrow.parquet as pq  # here: the first-run script imports this module before pyarrow is checked

    from embed_core.stage_dirs import instance_name

    out = {}
    for name in stage_names:
        manifest_path = run_dir / instance_name(name) / "manifest.json"
        if not manifest_path.exists():
            continue
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        rows = pq.read_table(manifest_path.parent / "metrics.parquet").to_pylist()
        steps = {r["step"]: r for r in rows}  # a step's micro-batches share its seconds and telemetry
        tokens = sum(r["tokens"] for r in rows)
        seconds = sum(r["seconds"] for r in steps.values())
        mfu = [r["mfu"] for r in steps.values() if r.get("mfu") is not None]
        peak = [r["peak_memory_mb"] for r in steps.values() if r.get("peak_memory_mb") is not None]
        out[name] = {"device": manifest["hardware"]["device"],
                     "precision": manifest["hardware"]["precision"], "steps": manifest["steps"], "tokens": tokens,
                     "train_seconds": round(seconds, 3), "stage_seconds": manifest["timings_s"]["total"],
                     "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
                     "mfu": sum(mfu) / len(mfu) if mfu else None, "peak_memory_mb": max(peak) if peak else None}
    return out


def scores(run_dir: Path) -> dict[str, dict[str, float]]:
    """The evaluate stage's main scores: model (base, or a stage's name) -> task -> score."""
    from embed_core.evaluate.run import main_scores

    out: dict[str, dict[str, float]] = {}
    for r in main_scores(run_dir):
        out.setdefault(r["model"], {})[r["task"]] = r["value"]
    return out
