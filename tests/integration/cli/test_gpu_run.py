"""``make gpu-run CPU=1``: the GPU reservation's sequence (GPU check, quality.yaml at precision
auto through the CLI, the quality-scale ablation) with tiny models, as the suite runs it, so the
runner and its report cannot rot before a GPU appears. One ablation run (GPU_RUN_MAX_ROWS=1), the
CLI commands on the session's Prefect server (no temporary server per command)."""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.repo import REPO

pytestmark = pytest.mark.prefect  # (so slow) the session's Prefect server for the runner's CLI commands


def nulls(value, path=""):
    """The paths of every empty (None) leaf."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nulls(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in nulls(v, f"{path}.{i}")]
    return [path] if value is None else []


def test_make_gpu_run_cpu_runs_the_whole_sequence_on_tiny_models_and_fills_every_field_of_the_report(
        tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    out = tmp_path / "gpu-run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": PREFECT_API_URL.value(), "GPU_RUN_MAX_ROWS": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["make", "-s", "gpu-run", "CPU=1", f"PY={sys.executable}", f"GPU_RUN_OUT={out}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu-run.json").read_text())
    machine = report["machine"]
    assert f"gpu-run: {machine['device']}: {machine['verdict']}" in done.stdout  # it says what it found
    assert report["mode"] == "cpu-tiny" and report["status"] == "done"
    assert [(s["name"], s["status"]) for s in report["steps"]] == [("gpucheck", "ok"), ("quality", "ok"),
                                                                   ("ablation", "ok")]
    # the tiny run evaluates quality.yaml's STS-B and SciFact on data/ (not Banking77: its classifier fits)
    allowed = report["cuda_only"] + report["never_filled"] + ["quality.targets.Banking77Classification.*"]
    empty = [p for p in nulls(report) if not any(fnmatch.fnmatch(p, pattern) for pattern in allowed)]
    assert not empty, f"report fields the tiny run left empty: {empty}"

    check = report["gpucheck"]["summary"]
    assert check["ok"] and check["parts"]["encoder"]["tokens_per_s"] > 0 and check["st_ratio"] > 0
    quality = report["quality"]
    assert list(quality["train"]) == ["stage1", "stage2", "stage3"]
    precision = "bf16 autocast" if machine["kind"] == "bf16" else "fp32"  # precision: auto
    for stage in quality["train"].values():
        assert stage["precision"] == precision and stage["device"] == "cpu"
        assert stage["tokens_per_s"] > 0 and stage["mfu"] > 0 and stage["peak_memory_mb"] > 0
    assert set(quality["scores"]) == {"base", "stage3"}  # what quality.yaml's evaluate.models names
    assert set(quality["targets"]) >= {"STSBenchmark", "SciFact", "Banking77Classification", "none_below_base"}
    assert quality["targets"]["SciFact"]["met"] is False  # a random-init BERT after 6 steps: far below 70

    ablation = report["ablation"]
    assert [(r["row"], r["seed"], r["status"]) for r in ablation["rows"]] == [("base", 42, "ok")]
    assert ablation["rows"][0]["scores"]["STSBenchmark"] > -1 and ablation["rows"][0]["train"]["stage3"]["tokens_per_s"]
    assert ablation["not_started"] == ablation["order"][1:] and len(ablation["order"]) == 18
    # the base row at seed 42 is the quality run's settings: its directory, only evaluate computed again
    assert quality["shared_with_ablation_run"] == "ablation-quality-gpu-base-s42"
    assert ablation["rows"][0]["run_dir"] == quality["run_dir"]
    assert "train-stage1: cache hit" in (out / "logs" / "ablation-base-s42.log").read_text()
    assert (out / "runs" / "ablation-quality-gpu-ablation" / "report.md").exists()
    md = (out / "gpu-run.md").read_text()
    for heading in ("## GPU check", "## quality.yaml (precision: auto)", "## Ablation"):
        assert heading in md
    assert machine["verdict"] in md and "| stage3 |" in md and "| base | 42 | ok |" in md
