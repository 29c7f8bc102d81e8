"""``python -m embedpipe_tools.gpurun``: a config that does not load is one line and exit 2 before any
step has spent reservation time (the whole sequence: tests/integration/cli/test_gpu_run.py)."""

from __future__ import annotations

from embedpipe_tools.gpurun import main


def test_an_ablation_config_that_does_not_load_stops_the_run_with_one_line_before_the_gpu_check(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what --cpu sets, put back after the test
    missing = tmp_path / "missing.yaml"
    rc = main(["--cpu", "--out", str(tmp_path / "out"), "--ablation", str(missing)])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("embedpipe: error:")]
    assert rc == 2 and lines == [f"embedpipe: error: {missing}: config file not found"]
    assert not (tmp_path / "out" / "gpucheck.json").exists() and not (tmp_path / "out" / "logs").exists()
