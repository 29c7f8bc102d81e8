"""Dev tasks built from the dev records prepare sets aside, one per record task type."""

import csv

import pytest

from embed_core.config import parse_config
from embed_core.errors import ConfigError
from embed_core.train.config import DevTaskSpec
from embed_core.train.dev import materialize
from tests.helpers.repo import REPO

BANKING77 = {"name": "banking77", "kind": "classification", "path": "banking77/train.csv", "multiline": True,
             "columns": {"text": "text", "label": "category"}, "params": {"num_negatives": 4}, "dev_fraction": 0.1}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from embed_core.prepare.run import run_prepare

    tmp = tmp_path_factory.mktemp("devrec")
    config = parse_config({"run_name": "r", "run_root": str(tmp / "runs"), "data_root": str(REPO / "data"),
                           "prepare": {"sources": [BANKING77]}})
    run_prepare(config, tmp / "runs/r")
    return config, tmp / "runs/r"


def _rows(path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_classification_dev_records_become_a_probe_task_fitted_on_texts_it_never_evaluates(prepared, tmp_path,
                                                                                             tiny_model):
    import mteb

    from embed_core.artifacts import read_records
    from embed_core.scoring.model import EvalModel
    from embed_core.scoring.tasks import build_task
    from embed_core.stage_dirs import PREPARE

    config, run_dir = prepared
    spec = DevTaskSpec(name="Banking77Dev", type="classification", dataset="banking77")
    task_spec = materialize(spec, run_dir, tmp_path)
    dev = read_records(run_dir, PREPARE, kind="dev_records")["dev/banking77.parquet"].to_pylist()
    evaluated, fitted = _rows(task_spec.path), _rows(task_spec.train_path)
    assert [(r["text"], r["label"]) for r in evaluated] == [(r["query"], r["label"]) for r in dev]
    assert len(dev) >= 50 and len({r["label"] for r in evaluated}) > 20
    assert not {r["text"] for r in fitted} & {r["text"] for r in evaluated}
    carried = {t: r["label"] for r in dev for t in r["positives"]}
    carried.update((t, lab) for r in dev for t, lab in zip(r["negatives"], r["negative_labels"]))
    assert fitted and all(carried[r["text"]] == r["label"] for r in fitted)  # each with the label it came with

    task = build_task(task_spec, config.resolve, seed=0)
    model = EvalModel(str(tiny_model), label="tiny", cache_root=tmp_path / "cache", precision="fp32")
    result = mteb.evaluate(model, task, cache=None, show_progress_bar=False)
    assert 0.0 <= result.task_results[0].get_score() <= 1.0


def test_a_dev_task_of_a_type_dev_records_cannot_make_is_refused_in_one_line(prepared, tmp_path):
    _, run_dir = prepared
    spec = DevTaskSpec(name="PairDev", type="pair_classification", dataset="banking77")
    with pytest.raises(ConfigError, match="dev records make sts, retrieval, classification tasks, not "
                                          "pair_classification"):
        materialize(spec, run_dir, tmp_path)
