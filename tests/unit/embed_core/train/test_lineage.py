"""Lineage: the records each training step consumed, checked against the texts the loss saw, under
exact resume, and summed over the ranks of a global draw; the file it makes is small."""

from pathlib import Path

import numpy as np
import pytest
import yaml

from embed_core.config import parse_config
from embed_core.train.engine.lineage import consumed_positions, lineage_table, read_metadata, replay
from embed_core.train.engine.sampling import GroupedBatchSampler
from tests.helpers.repo import REPO


def _config(tmp_path, tiny_model, **stage):
    cfg = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    cfg["data_root"] = str(REPO / "data")
    cfg["run_root"] = str(tmp_path / "runs")
    for key in ("synthesize", "mine", "evaluate", "train"):
        cfg.pop(key, None)
    cfg["train"] = {"base_model": str(tiny_model), "max_length": 32, "precision": "fp32", "prefetch": True, "stages": [
        {"name": "stage1", "steps": 5, "lr": 1e-3, "warmup_steps": 1, "num_hard_negatives": 1, "query_max_length": 16,
         "passage_max_length": 24, "checkpoint_every": 100, "log_every": 100, "eta": 0.6,
         "batch_size": {"retrieval": 4, "classification": 4, "sts": 4, "nli": 4}, **stage}]}
    return parse_config(cfg)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_model):
    from embed_core.prepare.run import run_prepare

    tmp = tmp_path_factory.mktemp("lineage")
    run_dir = tmp / "runs/demo"
    run_prepare(_config(tmp, tiny_model), run_dir)
    return run_dir


def _trainer(config, run_dir: Path, ckpt: Path, seen: list | None = None):
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer

    class Watching(Trainer):  # the real trainer; it only notes the queries each step's loss got
        def _forward_backward(self, batch, scale, last=True):
            if seen is not None:
                first = batch.groups.get("query") or batch.groups["a"]  # pair tasks: (a, b)
                seen.append((self.step + 1, batch.dataset, list(first.texts)))
            return super()._forward_backward(batch, scale, last)

    stage = config.train.stages[0]
    datasets = load_datasets(run_dir, stage, "prepare")
    return Watching(config.train, stage, datasets, init_model=config.train.base_model, checkpoint_dir=ckpt,
                    seed=config.seed, log=lambda m: None), datasets


def test_each_step_records_the_positions_of_exactly_the_records_whose_queries_the_loss_trained_on(
        prepared, tiny_model, tmp_path):
    config = _config(tmp_path, tiny_model, grad_accum=2)
    seen: list = []
    trainer, datasets = _trainer(config, prepared, tmp_path / "ckpt", seen)
    trainer.fit()
    table = lineage_table(trainer.consumed, {"datasets": {}})
    rows = table.to_pylist()
    assert sorted({(r["step"], r["dataset"]) for r in rows}) == sorted({(s, d) for s, d, _ in seen})
    assert {r["step"] for r in rows} == {1, 2, 3, 4, 5}
    for row in rows:
        queries = [datasets[row["dataset"]].cols["query"][p] for p in row["positions"]]
        trained = [q for s, d, qs in seen if (s, d) == (row["step"], row["dataset"]) for q in qs]
        assert sorted(queries) == sorted(trained)
        assert row["positions"] == sorted(row["positions"])


def test_a_resumed_run_records_the_steps_before_its_checkpoint_as_the_uninterrupted_run_drew_them(
        prepared, tiny_model, tmp_path):
    whole, _ = _trainer(_config(tmp_path, tiny_model, steps=6), prepared, tmp_path / "whole")
    whole.fit()
    first, _ = _trainer(_config(tmp_path, tiny_model, steps=6, checkpoint_every=4), prepared, tmp_path / "cut")
    first.stage = first.stage.model_copy(update={"steps": 4})  # stops at its checkpoint, as a killed run would
    first.fit()
    assert [p.name for p in first.checkpoints()] == ["step-0000004"]
    resumed, _ = _trainer(_config(tmp_path, tiny_model, steps=6, checkpoint_every=4), prepared, tmp_path / "cut")
    resumed.fit(resume=True)
    assert resumed.step == 6
    assert [(s, d, p.tolist()) for s, d, p in resumed.consumed] == [(s, d, p.tolist()) for s, d, p in whole.consumed]


def test_a_replay_that_does_not_reach_the_checkpoints_sampler_state_is_refused():
    sampler = GroupedBatchSampler({"a": 10, "b": 7}, {"a": 3, "b": 2}, seed=1)
    for _ in range(5):
        sampler.next_batch()
    assert len(replay(sampler, 5, 1, 1)) == 5
    with pytest.raises(ValueError, match="checkpoint's sampler state"):
        replay(sampler, 4, 1, 1)


def test_ranks_together_consume_the_global_draw_less_the_tail_no_rank_gets():
    assert consumed_positions([5, 1, 9, 3, 7], world=2).tolist() == [5, 1, 9, 3]  # 2 ranks x 2, 7 unused
    assert consumed_positions([5, 1, 9, 3], world=1).tolist() == [5, 1, 9, 3]
    sampler = GroupedBatchSampler({"a": 40}, {"a": 8}, seed=3)  # batch_size 4 per rank x 2 ranks
    draws = replay(sampler.restarted(), 0, 1, 2)
    assert draws == []
    for _ in range(3):
        sampler.next_batch()
    steps = replay(sampler, 3, 1, 2)
    assert [len(p) for _, _, p in steps] == [8, 8, 8] and len(set(np.concatenate([p for *_, p in steps]))) == 24


def test_the_lineage_file_keeps_its_metadata_and_one_row_per_step_and_dataset(tmp_path):
    import pyarrow.parquet as pq

    consumed = [(1, "a", np.array([4, 2])), (1, "a", np.array([9])), (1, "b", np.array([0])), (2, "a", np.array([7]))]
    table = lineage_table(consumed, {"upstream": "prepare", "datasets": {"a": {"file": "a.parquet", "sha256": None,
                                     "records": 10}}, "steps": 2, "model_step": 2, "grad_accum": 1, "processes": 1})
    pq.write_table(table, tmp_path / "l.parquet", compression="zstd")
    back = pq.read_table(tmp_path / "l.parquet")
    assert back.to_pylist() == [{"step": 1, "dataset": "a", "positions": [2, 4, 9]},
                                {"step": 1, "dataset": "b", "positions": [0]},
                                {"step": 2, "dataset": "a", "positions": [7]}]
    assert read_metadata(back.schema)["upstream"] == "prepare"
