"""A gate over a stage with one unit, measured add-one-in (the corpus recipe's shape: every record
is one dataset of generated queries): its base has no record, so the base proxy is the start model
scored untrained on the dev tasks; the unit's delta is the reference (the unit alone) minus that.
A harmful unit is dropped, and the stage, left without a record, keeps its start model untrained
instead of failing. Slow: the packaged all-MiniLM-L6-v2 trains 3 proxies of 10 steps (about a minute)."""

import pyarrow.parquet as pq
import pytest

from embed_core.config import parse_config
from tests.unit.embed_core.datavalue.test_gate import _data, _run, _run_logged

pytestmark = pytest.mark.slow


def _config(tmp):
    """The planted harmful source alone in the stage; the clean source gives the dev records only."""
    stage = {"name": "s1", "datasets": ["shuffled"], "steps": 10, "lr": 3e-4, "warmup_steps": 0,
             "batch_size": {"retrieval": 16}, "num_hard_negatives": 0, "query_max_length": 32,
             "passage_max_length": 32, "log_every": 1000, "checkpoint_every": 1000,
             "dev": {"eval_every": 1000, "max_rows": 200,
                     "tasks": [{"name": "CleanDev", "type": "retrieval", "dataset": "clean"}]},
             "data_value": {"steps": 10, "seeds": 3, "source_mode": "add_one_in"}}
    return parse_config({
        "run_name": "gate", "run_root": str(tmp / "runs"), "data_root": str(tmp / "data"), "seed": 42,
        "prepare": {"sources": [{"name": "clean", "kind": "flagembedding", "path": "clean.jsonl", "dev_fraction": 0.2},
                                {"name": "shuffled", "kind": "flagembedding", "path": "shuffled.jsonl"}]},
        "train": {"base_model": "default", "max_length": 128, "precision": "fp32", "use_instructions": False,
                  "stages": [stage]},
        "evaluate": {"models": ["base", "trained"], "tasks": [
            {"name": "LocalSTS", "type": "sts", "path": "stsb/test.csv", "header": False,
             "columns": {"text1": 0, "text2": 1, "score": 2}, "max_rows": 50}]}})


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    from embed_core.prepare.run import run_prepare

    import shutil

    from tests.helpers.repo import REPO

    tmp = tmp_path_factory.mktemp("gate-start")
    _data(tmp)
    (tmp / "data/stsb").mkdir()
    shutil.copy(REPO / "data/stsb/test.csv", tmp / "data/stsb/test.csv")
    config = _config(tmp)
    run_dir = tmp / "runs/gate"
    run_prepare(config, run_dir)
    return (config, run_dir, *_run_logged(config, run_dir, "value-s1"))


def test_the_base_without_any_record_is_the_start_model_scored_untrained_once_per_seed(gated):
    from embed_core.manifests import TrainManifest

    _, run_dir, manifest, records = gated
    proxies = pq.read_table(run_dir / "value-s1/proxies.parquet").to_pylist()
    assert sorted({p["variant"] for p in proxies}) == ["base", "reference"]  # no third copy of the reference
    base = [p for p in proxies if p["variant"] == "base"]
    assert len(base) == 3 and {p["steps"] for p in base} == {0} and len({p["score"] for p in base}) == 1
    trained = TrainManifest.read(run_dir / "proxies/s1/base", "train-s1-s1")
    assert trained.steps == 0 and "leaves out every record (dataset:shuffled)" in trained.untrained
    assert manifest["counts"]["proxy_runs"] == 6
    assert "data value: proxy base, seed 1: no record: scoring the start model untrained" in records
    assert "data value: proxy reference, seed 1: training" in records


def test_the_cost_said_before_it_starts_counts_the_untrained_base_as_no_steps(gated):
    *_, records = gated
    cost = [m for m in records if m.startswith("data value gate before stage s1:")]
    assert cost and ("6 proxy runs (2 variants for 1 unit × 3 seeds): 3 of 10 steps and 3 untrained scorings "
                     "of the start model (no record) = 30 steps; 0 cached, 6 to train") in cost[0]


def test_the_rate_of_earlier_proxies_leaves_out_the_untrained_scorings(gated):
    from embed_core.datavalue.proxy import proxy_root, seconds_per_step

    _, run_dir, *_ = gated
    rows = pq.read_table(run_dir / "value-s1/proxies.parquet").to_pylist()
    rates = [r["seconds"] / r["steps"] for r in rows if r["steps"] > 0]
    assert len(rates) == 3 and len(rows) == 6
    assert seconds_per_step(proxy_root(run_dir, "s1")) == pytest.approx(sum(rates) / len(rates))


def test_a_harmful_unit_alone_is_dropped_against_the_untrained_start_model(gated):
    _, run_dir, manifest, records = gated
    row = pq.read_table(run_dir / "value-s1/decision.parquet").to_pylist()[0]
    assert row["unit"] == "dataset:shuffled" and row["mode"] == "add_one_in"
    assert row["action"] == "drop", row
    assert not (run_dir / "value-s1/shuffled.parquet").exists()


def test_the_stage_left_without_records_keeps_its_start_model_untrained_and_says_why(gated):
    from safetensors.torch import load_file
    from transformers import AutoModel

    from embed_core.model.encoder import default_model_path
    from embed_core.runs.status import format_status, run_status

    config, run_dir, *_ = gated
    manifest = _run(config, run_dir, "train-s1")
    assert manifest["steps"] == 0 and manifest["datasets"] == {}
    assert manifest["untrained"].startswith("the data-value gate dropped every record (dropped dataset:shuffled")
    assert manifest["counts"]["selected_dev_score"] is not None
    saved = load_file(run_dir / "train-s1/model/model.safetensors")
    start = AutoModel.from_pretrained(default_model_path()).state_dict()
    assert saved.keys() <= start.keys() and all(saved[k].equal(start[k]) for k in saved)
    assert "dropped dataset:shuffled" in format_status(run_status(config, run_dir), run_dir)


def test_evaluate_scores_the_kept_start_model_like_the_base_and_releases_nothing(gated, caplog):
    import logging

    from embed_core.evaluate.run import run_evaluate

    config, run_dir, *_ = gated
    _run(config, run_dir, "train-s1")  # a cache hit after the test above
    caplog.set_level(logging.INFO, logger="embedpipe.evaluate")
    manifest = run_evaluate(config, run_dir)
    scores = {s["model"]: s["value"] for s in manifest["counts"]["main_scores"]}
    assert scores.keys() == {"base", "s1"} and scores["s1"] == pytest.approx(scores["base"], abs=1e-6)
    assert manifest["release"] is None  # nothing trained: nothing to release (not a refusal that fails the stage)
    assert any("s1 is not released: it was not trained (the data-value gate dropped every record"
               in r.getMessage() for r in caplog.records)


def test_a_stage_without_records_for_another_reason_is_still_an_error(gated, tmp_path):
    from embed_core.errors import ConfigError
    from embed_core.train.run import run_train_stage

    config, run_dir, *_ = gated
    raw = config.model_dump(mode="json")
    raw["train"]["stages"][0].update(tasks=["sts"], datasets=None, data_value=None)  # every record is retrieval
    with pytest.raises(ConfigError, match="no dataset matches"):
        run_train_stage(parse_config(raw), run_dir, "s1", upstream="prepare")
