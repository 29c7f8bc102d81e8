"""The Prefect spine against a real (temporary) Prefect server: caching by content hash, artifacts, CLI."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.repo import REPO

pytestmark = pytest.mark.prefect


def _output_hashes(manifest):
    return {name: info["sha256"] for name, info in manifest["outputs"].items()}


def test_prepare_flow_caches_on_content_and_recomputes_on_change(prefect_harness, demo_copy):
    from prefect.artifacts import Artifact

    from flows.pipeline import pipeline_flow
    from flows.stage import prepare_flow

    first = pipeline_flow(config_path=str(demo_copy))["prepare"]
    assert not first["cached"]
    run_dir = Path(first["run_dir"])
    assert (run_dir / "prepare/manifest.json").exists() and (run_dir / "prepare/stsb.parquet").exists()
    totals = first["manifest"]["counts"]["totals"]
    assert totals["records_written"] > 2000 and totals["excluded_contamination"] > 0

    second = pipeline_flow(config_path=str(demo_copy))["prepare"]
    assert second["cached"]
    assert _output_hashes(second["manifest"]) == _output_hashes(first["manifest"])

    # touching a file without changing its bytes is still a hit (content hash, not mtime)
    (demo_copy.parent / "data/stsb/train.csv").touch()
    assert prepare_flow(config_path=str(demo_copy))["prepare"]["cached"]

    # editing one source row recomputes
    sts = demo_copy.parent / "data/stsb/train.csv"
    lines = sts.read_text().splitlines(keepends=True)
    lines[0] = "A kitten naps in the sun.,A small cat sleeps in sunlight.,4.4\n"
    sts.write_text("".join(lines))
    third = prepare_flow(config_path=str(demo_copy))["prepare"]
    assert not third["cached"]
    assert _output_hashes(third["manifest"])["stsb.parquet"] != _output_hashes(first["manifest"])["stsb.parquet"]
    assert _output_hashes(third["manifest"])["banking77.parquet"] == _output_hashes(first["manifest"])["banking77.parquet"]

    # a deleted artifact is never served from cache
    shutil.rmtree(run_dir / "prepare")
    fourth = prepare_flow(config_path=str(demo_copy))["prepare"]
    assert not fourth["cached"] and (run_dir / "prepare/manifest.json").exists()

    assert Artifact.get(key="prepare-counts-demo") is not None


def test_the_corpus_recipe_reads_the_folder_given_as_corpus_path_like_a_ui_run(prefect_harness, tmp_path):
    import pyarrow.parquet as pq

    from flows.pipeline import pipeline_flow

    docs = tmp_path / "my_documents"
    docs.mkdir()
    (docs / "heart.md").write_text("# Heart\n\nThe heart pumps blood through the arteries of the body.\n")
    (docs / "kidneys.txt").write_text("Kidneys filter waste from the blood and make urine.\n")
    # what a UI user types in the embedpipe-pipeline form (the inline config only moves this test's
    # data and runs, and drops the recipe's SciFact contamination set, which needs ../shared/data)
    out = pipeline_flow(config_path=str(REPO / "deployments/configs/corpus.yaml"), corpus_path="my_documents",
                        config={"data_root": str(tmp_path), "run_root": str(tmp_path / "runs"),
                                "prepare": {"contamination": []}}, stages=["prepare"])
    assert list(out) == ["prepare"]
    run_dir = Path(out["prepare"]["run_dir"])
    corpus = pq.read_table(run_dir / "prepare/corpus-scifact-corpus.parquet").to_pylist()
    assert sorted(p["text"] for p in corpus) == ["# Heart\n\nThe heart pumps blood through the arteries of the body.",
                                                 "Kidneys filter waste from the blood and make urine."]
    assert {p["source_ref"].split(":")[0] for p in corpus} == {"my_documents/heart.md", "my_documents/kidneys.txt"}


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prepare:\n  sources:\n    - {name: x, kind: nope, path: a.csv}\n")
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "prepare", "--config", str(bad)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "prepare.sources[x].kind" in proc.stderr


def test_cli_inspect(tmp_path):
    from embed_core.config import load_config
    from embed_core.prepare.run import run_prepare

    cfg = load_config(REPO / "deployments/configs/demo.yaml")
    cfg = cfg.model_copy(update={"data_root": str(REPO / "data")})
    run_prepare(cfg, tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "inspect", str(tmp_path / "run/prepare")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "banking77 / classification / original" in proc.stdout and "schema version 1.0" in proc.stdout


def test_embed_core_never_imports_prefect():
    proc = subprocess.run(["grep", "-rE", r"import prefect|from prefect", str(REPO / "embed_core")],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout


def test_pipeline_mines_and_reruns_from_cache(prefect_harness, demo_copy, tmp_path):
    from flows.pipeline import pipeline_flow
    from tests.helpers.repo import add_tiny_stages

    add_tiny_stages(demo_copy, tmp_path, evaluate=True)
    cfg = yaml.safe_load(demo_copy.read_text())
    cfg["tracking"] = {"uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "test"}  # a real MLflow store
    demo_copy.write_text(yaml.safe_dump(cfg))

    first = pipeline_flow(config_path=str(demo_copy))
    assert not first["evaluate"]["cached"] and not first["train-stage2"]["cached"]
    summary = first["evaluate"]["summary"]
    assert "STSBenchmark" in summary and "stage1" in summary and "stage2" in summary  # base -> stage 1 -> stage 2
    assert not first["mine"]["cached"]
    mined = {d["dataset"]: d for d in first["mine"]["manifest"]["counts"]["datasets"]}
    assert mined["scifact"]["mined"] and mined["scifact"]["negatives_added"] > 0
    assert not mined["stsb"]["mined"]  # STS pairs are not mined
    run_dir = Path(first["mine"]["run_dir"])
    assert (run_dir / "mine/score_hist.png").exists() and (run_dir / "mine/scifact.parquet").exists()

    tracked = _tracked_runs(tmp_path / "mlflow.db")
    assert set(tracked) == {"prepare", "mine", "train-stage1", "train-stage2", "evaluate", "gate"}

    second = pipeline_flow(config_path=str(demo_copy))
    assert all(second[k]["cached"] for k in ("prepare", "mine", "train-stage1", "train-stage2", "evaluate"))
    assert _tracked_runs(tmp_path / "mlflow.db").keys() == tracked.keys()  # cache hits were logged already

    sts = demo_copy.parent / "data/stsb/train.csv"
    sts.write_text("A kitten naps in the sun.,A small cat sleeps in sunlight.,4.4\n" + sts.read_text())
    third = pipeline_flow(config_path=str(demo_copy))
    assert not third["prepare"]["cached"] and not third["mine"]["cached"]
    assert third["mine"]["manifest"]["counts"]["texts_encoded"] == 0  # embeddings came from the cache
    # an STS source changed: retrieval-only stage 1 is a cache hit; stage 2 retrains; evaluation is
    # keyed by model content, so it recomputes exactly when stage 2's weights changed
    assert third["train-stage1"]["cached"]
    assert not third["train-stage2"]["cached"]
    weights = [r["train-stage2"]["manifest"]["outputs"]["model/model.safetensors"]["sha256"] for r in (second, third)]
    assert third["evaluate"]["cached"] == (weights[0] == weights[1])
    after = _tracked_runs(tmp_path / "mlflow.db", every=True)
    assert sorted(stage for stage, _ in after) == sorted(
        [*tracked, "prepare", "mine", "train-stage2", *([] if third["evaluate"]["cached"] else ["evaluate"])])


def _tracked_runs(db: Path, every: bool = False):
    """The MLflow store read back: stage -> nested run (checked for what each stage logs)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("test")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.run_name == "demo"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(children) == len(runs) - 1
    if every:
        return [(r.data.tags["embedpipe.stage"], r) for r in children]
    by_stage = {r.data.tags["embedpipe.stage"]: r for r in children}
    train = by_stage["train-stage2"]
    assert train.data.params["stage.steps"] == "2" and train.data.params["loss.sts"].startswith("cosent(")
    assert train.data.params["stage.eta"] == "0.72" and "dataset.scifact" in train.data.params
    assert [m.step for m in client.get_metric_history(train.info.run_id, "train.loss")] == [1, 2]
    assert "model/model.safetensors" in [a.path for a in client.list_artifacts(train.info.run_id, "model")]
    scores = {k: v for k, v in parents[0].data.metrics.items() if k.endswith(".STSBenchmark")}
    assert set(scores) == {"base.STSBenchmark", "stage1.STSBenchmark", "stage2.STSBenchmark"}
    assert by_stage["evaluate"].data.metrics["stage2.STSBenchmark"] == scores["stage2.STSBenchmark"]
    assert by_stage["prepare"].data.metrics["counts.totals.records_written"] > 0
    return by_stage
