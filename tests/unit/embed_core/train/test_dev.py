"""Evaluation during training: dev tasks scored every eval_every steps, the best weights kept, and
evaluate's test sets never encoded while training."""

import csv

import pyarrow.parquet as pq
import pytest

from embed_core.stages import records_upstream
from embed_core.config import parse_config
from embed_core.prepare.cleaning import normalize_text
from tests.helpers.repo import REPO
from tests.unit.embed_core.train.test_training import _config_dict

pytestmark = pytest.mark.slow  # trains or reads real data: make test, not make test-fast


@pytest.fixture(scope="module")
def trained_with_dev(tmp_path_factory, tiny_model):
    import embed_core.train.dev as dev
    from embed_core.prepare.run import run_prepare
    from embed_core.train.run import run_train_stage

    tmp = tmp_path_factory.mktemp("dev")
    raw = _config_dict(tmp, tiny_model)
    for source in raw["prepare"]["sources"]:
        if source["name"] == "stsb":
            source["dev_fraction"] = 0.2
    stage = dict(raw["train"]["stages"][1], name="devstage", steps=6, lr=5e-3, checkpoint_every=2, init_from="base",
                 dev={"eval_every": 2, "max_rows": 40, "select": "best",
                      "tasks": [{"name": "StsDev", "type": "sts", "dataset": "stsb"}]})
    raw["train"]["stages"] = [stage]
    config = parse_config(raw)
    run_dir = tmp / "runs/demo"
    run_prepare(config, run_dir)
    encoded: list[str] = []
    original = dev.LiveModel._encode_texts

    def recording(self, texts):
        encoded.extend(texts)
        return original(self, texts)

    dev.LiveModel._encode_texts = recording
    try:
        manifest = run_train_stage(config, run_dir, "devstage", upstream=records_upstream(config, "train"))
    finally:
        dev.LiveModel._encode_texts = original
    return config, run_dir, manifest, encoded


def test_dev_tasks_are_scored_every_eval_every_steps_and_the_best_weights_are_kept(trained_with_dev):
    from embed_core.model.embedder import Embedder
    from embed_core.model.settings import read_model_settings
    from embed_core.train.dev import DevEvaluator

    config, run_dir, manifest, _ = trained_with_dev
    rows = pq.read_table(run_dir / "train-devstage/dev.parquet").to_pylist()
    assert [r["step"] for r in rows] == [2, 4, 6] and {r["task"] for r in rows} == {"StsDev"}
    best = max(rows, key=lambda r: r["selection"])
    assert manifest["selected"]["step"] == best["step"] == manifest["counts"]["selected_step"]
    # the saved model is the best step's: it scores what was recorded for that step
    model_dir = run_dir / "train-devstage/model"
    settings = read_model_settings(model_dir)
    stage = config.train.stages[0]
    evaluator = DevEvaluator(stage.dev, config, run_dir, run_dir / "dev-check", settings)
    embedder = Embedder(str(model_dir), pooling=settings.pooling, max_length=settings.max_length)
    assert evaluator.score(embedder)["StsDev"] == pytest.approx(best["score"], abs=1e-5)
    assert f"| weights kept | step {best['step']}" in (model_dir / "README.md").read_text()


def test_no_test_text_is_encoded_during_training(trained_with_dev):
    _, _, _, encoded = trained_with_dev
    assert encoded  # the dev tasks were encoded
    with open(REPO / "data/stsb/test.csv", newline="", encoding="utf-8") as fh:
        test_texts = {normalize_text(t) for row in csv.reader(fh) for t in row[:2]}
    # an encoded text is the instruction template around the text: its last line after "Query: "
    texts = {normalize_text(t.split("\n")[-1].removeprefix("Query: ")) for t in encoded}
    assert len(test_texts) > 100 and not texts & test_texts


def test_dev_evaluation_does_not_change_what_is_trained(tmp_path, tiny_model):
    """mteb seeds the global RNGs when it evaluates; the trainer restores them, so a stage with dev
    evaluation (select: last) ends with exactly the weights of the same stage without it."""
    import torch
    from safetensors.torch import load_file

    from embed_core.prepare.run import run_prepare
    from embed_core.train.run import run_train_stage

    weights = []
    for with_dev in (False, True):
        raw = _config_dict(tmp_path / str(with_dev), tiny_model)
        for source in raw["prepare"]["sources"]:
            if source["name"] == "stsb":
                source["dev_fraction"] = 0.2
        stage = dict(raw["train"]["stages"][1], name="s", steps=4, lr=5e-3, init_from="base")
        if with_dev:
            stage["dev"] = {"eval_every": 1, "max_rows": 20, "select": "last",
                            "tasks": [{"name": "StsDev", "type": "sts", "dataset": "stsb"}]}
        raw["train"]["stages"] = [stage]
        config = parse_config(raw)
        run_dir = tmp_path / str(with_dev) / "run"
        run_prepare(config, run_dir)
        run_train_stage(config, run_dir, "s", upstream=records_upstream(config, "train"))
        weights.append(load_file(run_dir / "train-s/model/model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
