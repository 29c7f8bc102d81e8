"""``embedpipe ablate``: the config and a variant, each with two seeds, run end to end in their own
run directories; the table's cells are the mean ± spread of the runs' own evaluation scores; an
unchanged rerun is all cache hits."""

import statistics

import pyarrow.parquet as pq
import pytest
import yaml

from embed_core.evaluate.run import main_scores
from embed_core.rundir import read_history
from tests.helpers.cli_run import in_process, in_subprocess
from tests.helpers.repo import tiny_demo_config


@pytest.fixture(scope="module")
def ablated(tmp_path_factory, tiny_model, prefect_harness):
    tmp = tmp_path_factory.mktemp("ablate")
    cfg = tiny_demo_config(tmp, tiny_model, "abl", [{"name": "stage1", "tasks": ["retrieval", "sts"], "steps": 3}],
                           keep=("evaluate",))
    cfg["prepare"]["sources"] = [s for s in cfg["prepare"]["sources"] if s["name"] in ("stsb", "scifact")]
    cfg["evaluate"] = {"base_model": str(tiny_model), "tasks": [cfg["evaluate"]["tasks"][0]]}  # STSBenchmark
    cfg["ablation"] = {"seeds": [1, 2], "variants": {"sts-only": {"train.stages[stage1].tasks": ["sts"]}}}
    path = tmp / "abl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = in_subprocess("ablate", "--config", path, timeout=900)  # own process, session's server
    assert result.rc == 0, result.err[-3000:]
    return path, tmp / "runs"


def test_each_row_and_seed_runs_in_its_own_directory_with_its_seed(ablated):
    _, root = ablated
    for row in ("base", "sts-only"):
        for seed in (1, 2):
            run_dir = root / f"abl-{row}-s{seed}"
            assert yaml.safe_load((run_dir / "config.yaml").read_text())["seed"] == seed
            assert [(r["model"], r["task"]) for r in main_scores(run_dir)] == [("base", "STSBenchmark"),
                                                                                ("stage1", "STSBenchmark")]
    tasks = yaml.safe_load((root / "abl-sts-only-s1/config.yaml").read_text())["train"]["stages"][0]["tasks"]
    assert tasks == ["sts"]


def test_the_table_is_the_mean_and_spread_of_the_runs_own_scores(ablated):
    _, root = ablated
    rows = pq.read_table(root / "abl-ablation/scores.parquet").to_pylist()
    assert len(rows) == 4
    report = (root / "abl-ablation/report.md").read_text()
    for row in ("base", "sts-only"):
        xs = [100 * main_scores(root / f"abl-{row}-s{s}")[1]["value"] for s in (1, 2)]  # stage1's, not base's
        assert xs[0] != xs[1]  # the seed changed the run
        assert f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs):.2f}" in report


def test_an_unchanged_rerun_is_all_cache_hits(ablated, capfd):
    path, root = ablated
    result = in_process(capfd, "ablate", "--config", path)
    assert result.rc == 0, result.err[-3000:]
    assert "| sts-only | `train.stages[stage1].tasks: ['sts']` |" in result.out
    for seed in (1, 2):
        last = read_history(root / f"abl-base-s{seed}")
        assert all(entry["cached"] for entry in last[-3:])  # prepare, train-stage1, evaluate of the rerun
