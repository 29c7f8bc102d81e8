"""gpu-run's report: the quality targets of issue 48 judged on the final model, the time budget's
rule for starting one more run, and a report that holds only the steps that finished (a cut-off)
written as JSON and markdown."""

from __future__ import annotations

import json

from embedpipe_tools.gpurun import fits
from embedpipe_tools.gpurun.report import targets, write


def test_the_quality_targets_need_every_score_and_nothing_below_the_base_model():
    base = {"STSBenchmark": 0.82, "SciFact": 0.645, "Banking77Classification": 0.80, "SICK-R": 0.776}
    good = {"STSBenchmark": 0.856, "SciFact": 0.701, "Banking77Classification": 0.851, "SICK-R": 0.78}
    assert targets({"base": base, "stage3": good}, "stage3")["all_met"] is True
    low_sick = targets({"base": base, "stage3": {**good, "SICK-R": 0.77}}, "stage3")
    assert low_sick["all_met"] is False and low_sick["none_below_base"]["below"] == ["SICK-R"]
    short = targets({"base": base, "stage3": {**good, "SciFact": 0.699}}, "stage3")
    assert short["SciFact"]["met"] is False and abs(short["SciFact"]["value"] - 69.9) < 1e-9
    assert short["all_met"] is False
    absent = targets({"base": {"STSBenchmark": 0.3}, "stage3": {"STSBenchmark": 0.4}}, "stage3")
    assert absent["SciFact"]["met"] is None and absent["all_met"] is False


def test_a_run_starts_only_while_the_budget_left_holds_its_measured_time():
    assert fits(remaining=300.0, estimate=240.0)
    assert not fits(remaining=200.0, estimate=240.0)
    assert fits(remaining=240.0, estimate=240.0)


def test_a_report_cut_off_after_its_first_step_is_readable_json_and_markdown(tmp_path):
    report = {"mode": "full", "status": "running", "started": "t0", "updated": "t1", "elapsed_s": 12.0, "budget_s": 1500,
              "machine": {"device": "NVIDIA H100 80GB HBM3", "verdict": "CUDA GPU", "cpu": "x", "cores": 16,
                          "cpu_bf16_flags": []},
              "versions": {"torch": "2.13.0", "flash-attn": None}, "steps": [{"name": "gpucheck", "status": "failed"}],
              "gpucheck": {"status": "failed", "error": "gpucheck: failed: decoder: out of memory"},
              "quality": {}, "ablation": {"rows": []}, "score": float("nan")}
    write(report, tmp_path)
    assert json.loads((tmp_path / "gpu-run.json").read_text())["score"] is None  # JSON has no NaN
    md = (tmp_path / "gpu-run.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in md and "out of memory" in md and "gpucheck failed" in md
    assert not list(tmp_path.glob(".*.tmp"))
