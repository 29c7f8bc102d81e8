"""The data-value gate end to end: a planted harmful source (a copy of a training set with its
positives shuffled) is dropped and the clean source kept; the cost line comes before any proxy
trains; a second gate run with unchanged inputs trains no proxy, and an interrupted one trains only
what it had not committed; the stage then trains on the gated records and names the decision.

A tiny random-init model cannot tell the shuffled copy from the clean set (any contrastive data
spreads its collapsed embeddings, so both help it: measured 2026-12-06), so this trains the packaged
all-MiniLM-L6-v2 for a few proxy steps: slow (about 3 minutes on 2 cores)."""

import csv
import json
import logging
import random

import pyarrow.parquet as pq
import pytest

from embed_core import stages
from embed_core.config import parse_config
from tests.helpers.repo import REPO

pytestmark = pytest.mark.slow


def _data(tmp) -> None:
    """clean.jsonl: STS-B train pairs scored 3 or more as (query, positive); shuffled.jsonl: the same
    queries with the positives shuffled among them."""
    with open(REPO / "data/stsb/train.csv", newline="", encoding="utf-8") as fh:
        rows = [r for r in csv.reader(fh) if float(r[2]) >= 3.0]
    shuffled = [r[1] for r in rows]
    random.Random(0).shuffle(shuffled)
    (tmp / "data").mkdir()
    (tmp / "data/clean.jsonl").write_text("".join(json.dumps({"query": a, "pos": [b]}) + "\n" for a, b, _ in rows))
    (tmp / "data/shuffled.jsonl").write_text(
        "".join(json.dumps({"query": a, "pos": [b]}) + "\n" for (a, _, _), b in zip(rows, shuffled)))


def _config(tmp):
    return parse_config({
        "run_name": "gate", "run_root": str(tmp / "runs"), "data_root": str(tmp / "data"), "seed": 42,
        "prepare": {"sources": [{"name": "clean", "kind": "flagembedding", "path": "clean.jsonl", "dev_fraction": 0.2},
                                {"name": "shuffled", "kind": "flagembedding", "path": "shuffled.jsonl"}]},
        "train": {"base_model": "default", "max_length": 32, "precision": "fp32", "stages": [
            {"name": "s1", "steps": 10, "lr": 3e-4, "warmup_steps": 0, "batch_size": {"retrieval": 16},
             "num_hard_negatives": 0, "query_max_length": 32, "passage_max_length": 32, "log_every": 1000,
             "checkpoint_every": 1000,
             "dev": {"eval_every": 1000, "max_rows": 200,
                     "tasks": [{"name": "CleanDev", "type": "retrieval", "dataset": "clean"}]},
             "data_value": {"steps": 10, "seeds": 3}}]}})


def _run(config, run_dir, instance, *, force=False):
    stage = stages.get("train")
    ctx = stages.context(config, run_dir, stage, instance)
    fingerprint, hit = stages.cache_decision(stage, ctx, force)
    return None if hit else stage.run(ctx, fingerprint)


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    from embed_core.prepare.run import run_prepare

    tmp = tmp_path_factory.mktemp("gate")
    _data(tmp)
    config = _config(tmp)
    run_dir = tmp / "runs/gate"
    run_prepare(config, run_dir)
    return (config, run_dir, *_run_logged(config, run_dir, "value-s1"))


def _run_logged(config, run_dir, instance):
    """``_run`` with the data-value step's log lines kept: (its manifest, the lines)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, logger = Keep(), logging.getLogger("embedpipe.datavalue")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        return _run(config, run_dir, instance), records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def test_a_planted_harmful_source_is_dropped_and_the_clean_source_kept(gated):
    _, run_dir, manifest, _ = gated
    rows = {r["unit"]: r for r in pq.read_table(run_dir / "value-s1/decision.parquet").to_pylist()}
    assert rows["dataset:shuffled"]["action"] == "drop", rows
    assert rows["dataset:clean"]["action"] == "keep", rows
    assert rows["dataset:shuffled"]["delta"] < 0 < rows["dataset:clean"]["delta"]
    assert len(rows["dataset:shuffled"]["deltas"]) == 3
    # the gated records: the shuffled file is gone, the clean one is the same bytes as upstream
    assert not (run_dir / "value-s1/shuffled.parquet").exists()
    assert (run_dir / "value-s1/clean.parquet").read_bytes() == (run_dir / "prepare/clean.parquet").read_bytes()
    assert manifest["counts"]["proxy_runs"] == 9 and manifest["counts"]["trained"] == 9


def test_the_cost_is_printed_before_any_proxy_trains(gated):
    *_, records = gated
    cost = [i for i, m in enumerate(records) if m.startswith("data value gate before stage s1: 9 proxy runs")]
    trained = [i for i, m in enumerate(records) if m.startswith("data value: proxy")]
    assert cost and trained and cost[0] < trained[0]
    assert "× 10 steps = 90 steps" in records[cost[0]] and "9 to train" in records[cost[0]]


def test_a_second_gate_run_trains_no_proxy_and_an_interrupted_one_trains_only_what_is_missing(gated):
    import shutil

    config, run_dir, first, _ = gated
    again = _run(config, run_dir, "value-s1", force=True)
    assert again["counts"]["trained"] == 0 and again["counts"]["cached"] == 9
    assert again["units"] == first["units"]
    # a gate killed before its last proxy committed: that proxy alone trains on the next run
    shutil.rmtree(run_dir / "proxies/s1/minus-dataset=clean/train-s1-s3")
    resumed = _run(config, run_dir, "value-s1", force=True)
    assert resumed["counts"]["trained"] == 1 and resumed["counts"]["cached"] == 8


def test_the_stage_trains_on_the_gated_records_and_names_the_decision(gated):
    from embed_core.runs.status import format_status, run_status

    config, run_dir, _, _ = gated
    manifest = _run(config, run_dir, "train-s1")
    value = json.loads((run_dir / "value-s1/manifest.json").read_text())
    assert set(manifest["datasets"]) == {"clean"}
    assert manifest["data_value"]["decision"] == value["input_fingerprint"]
    assert "dropped dataset:shuffled" in manifest["data_value"]["summary"]
    assert "dropped dataset:shuffled" in format_status(run_status(config, run_dir), run_dir)


def test_the_gated_stage_trains_the_same_model_as_a_run_without_the_planted_source(gated, tmp_path):
    """The issue's "within the seed spread of the model trained without it", met exactly: dropping
    the source leaves the stage the records, weights and seed of a run that never had it."""
    from safetensors.torch import load_file

    from embed_core.prepare.run import run_prepare

    config, run_dir, _, _ = gated
    _run(config, run_dir, "train-s1")  # a cache hit after the test above
    raw = config.model_dump(mode="json")
    raw["prepare"]["sources"] = [s for s in raw["prepare"]["sources"] if s["name"] != "shuffled"]
    raw["train"]["stages"][0]["data_value"] = None
    raw["run_root"] = str(tmp_path / "runs")
    without = parse_config(raw)
    run_prepare(without, tmp_path / "runs/gate")
    manifest = _run(without, tmp_path / "runs/gate", "train-s1")
    assert set(manifest["datasets"]) == {"clean"}
    gated_weights = load_file(run_dir / "train-s1/model/model.safetensors")
    plain_weights = load_file(tmp_path / "runs/gate/train-s1/model/model.safetensors")
    assert gated_weights.keys() == plain_weights.keys()
    assert all(gated_weights[k].equal(plain_weights[k]) for k in gated_weights)
