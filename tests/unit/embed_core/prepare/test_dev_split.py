"""Dev splits: a seeded fraction of a source, or its own dev file, set aside in prepare; dev records
never reach the training records (nor mining, which reads them)."""

from pathlib import Path

import pytest

from embed_core.artifacts import read_manifest, read_records
from embed_core.config import parse_config
from embed_core.prepare.run import run_prepare

ROWS = "".join(f"Sentence number {i} is here.,Another sentence {i} is there.,{i % 6}\n" for i in range(200))


def _prepare(tmp_path, **source):
    cfg = parse_config({"data_root": str(tmp_path), "seed": 7, "prepare": {"sources": [
        {"name": "sts", "kind": "sts", "path": "train.csv", **source}]}})
    run_prepare(cfg, tmp_path / "run")
    train = read_records(tmp_path / "run", "prepare")["sts.parquet"].to_pylist()
    dev = read_records(tmp_path / "run", "prepare", kind="dev_records").get("dev/sts.parquet")
    return train, (dev.to_pylist() if dev is not None else []), read_manifest(tmp_path / "run", "prepare")


def test_a_dev_fraction_sets_aside_whole_rows_reproducibly_and_never_trains_on_them(tmp_path):
    (tmp_path / "train.csv").write_text("sentence1,sentence2,score\n" + ROWS)
    train, dev, manifest = _prepare(tmp_path, dev_fraction=0.1)
    dev_rows = {r["source_ref"] for r in dev}
    assert 8 <= len(dev_rows) <= 35  # about 10 % of 200 rows
    assert len(dev) == 2 * len(dev_rows)  # both directions of each dev pair went together
    assert not dev_rows & {r["source_ref"] for r in train}
    assert len(train) + len(dev) == 400
    assert manifest["counts"]["datasets"][0]["dev_records"] == len(dev)
    again, dev_again, _ = _prepare(tmp_path, dev_fraction=0.1)
    assert {r["source_ref"] for r in dev_again} == dev_rows  # seeded: the same split every run


def test_a_dev_file_is_read_like_the_source_and_its_pairs_leave_training(tmp_path):
    (tmp_path / "train.csv").write_text("sentence1,sentence2,score\n" + ROWS)
    (tmp_path / "dev.csv").write_text("sentence1,sentence2,score\n"
                                      "Another sentence 3 is there.,Sentence number 3 is here.,3\n"  # a training pair, reversed
                                      "A dev-only sentence.,Another dev-only one.,4\n")
    train, dev, manifest = _prepare(tmp_path, dev_path="dev.csv")
    assert {r["source_ref"] for r in dev} == {"dev.csv:2", "dev.csv:3"}
    assert "train.csv:5" not in {r["source_ref"] for r in train}  # row 5 holds pair 3: it is a dev pair now
    assert manifest["counts"]["datasets"][0]["excluded_dev_overlap"] == 2


def test_dev_path_and_dev_fraction_are_exclusive():
    with pytest.raises(Exception, match="give dev_path or dev_fraction, not both"):
        parse_config({"prepare": {"sources": [{"name": "s", "kind": "sts", "path": "a.csv", "dev_path": "b.csv",
                                               "dev_fraction": 0.1}]}})


def test_a_dev_task_made_from_prepares_dev_records_works_from_a_relative_run_directory(tmp_path, monkeypatch):
    from embed_core.train.config import DevTaskSpec
    from embed_core.scoring.data import _read_pairs
    from embed_core.train.dev import materialize

    (tmp_path / "train.csv").write_text("sentence1,sentence2,score\n" + ROWS)
    cfg = parse_config({"data_root": str(tmp_path / "data-elsewhere"), "prepare": {"sources": [
        {"name": "sts", "kind": "sts", "path": str(tmp_path / "train.csv"), "dev_fraction": 0.2}]}})
    monkeypatch.chdir(tmp_path)
    run_prepare(cfg, "runs/r")  # relative, as `run_root: runs` gives
    spec = materialize(DevTaskSpec(name="StsDev", type="sts", dataset="sts"), Path("runs/r"), Path("runs/r/dev-data"))
    # the task's file is found although data_root (where relative task paths resolve) is elsewhere
    assert len(_read_pairs(spec, cfg.resolve)) > 10
