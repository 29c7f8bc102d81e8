"""Per-origin weights (``origin_weight: {synthetic: 0.5}``): a synthetic example's InfoNCE loss
counts half, by hand; a dataset's sampling weight is scaled by its records' mean origin weight, by
hand; the trainer puts each row's weight on its batch; unknown origins are refused."""

import math

import pyarrow as pa
import pytest
import torch

from embed_core.config import parse_config
from embed_core.losses.base import LossContext
from embed_core.losses.infonce import InfoNCE, infonce
from embed_core.schema import Record, records_to_table
from embed_core.train.engine.batches import DatasetRecords, TaskBatch, TextGroup
from embed_core.train.config import TrainStageConfig
from embed_core.train.engine.sampling import dataset_weights, origin_factors

Q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
P = torch.tensor([[1.0, 0.0], [0.6, 0.8]])


def test_origin_weight_halves_a_synthetic_examples_infonce_loss_by_hand():
    # tau 1, no hard negatives, no query-query term: query 0's logits [1, 0.6] (target 0), query 1's
    # [0, 0.8] (target 1); losses log(1 + e^-0.4) and log(1 + e^-0.8); query 1 is synthetic (0.5)
    l0, l1 = math.log(1 + math.exp(-0.4)), math.log(1 + math.exp(-0.8))
    plain = infonce(Q, P, tau=1.0, query_negatives=False)
    weighted = infonce(Q, P, tau=1.0, query_negatives=False, weights=torch.tensor([1.0, 0.5]))
    assert plain.item() == pytest.approx((l0 + l1) / 2, abs=1e-6)
    assert weighted.item() == pytest.approx((l0 + 0.5 * l1) / 2, abs=1e-6)
    loss = InfoNCE(InfoNCE.Params(tau=1.0, query_negatives=False))
    batch = TaskBatch("retrieval", "d", {"query": TextGroup(["a", "b"], [None, None], 8)}, weights=[1.0, 0.5])
    assert loss({"query": Q, "positive": P}, batch, LossContext()).item() == pytest.approx(weighted.item())


def test_a_datasets_sampling_weight_is_scaled_by_its_records_mean_origin_weight_by_hand():
    # "mixed": 2 original + 2 synthetic -> (2 * 1 + 2 * 0.5) / 4 = 0.75; "generated": 4 synthetic -> 0.5
    factors = origin_factors({"mixed": {"original": 2, "synthetic": 2}, "generated": {"synthetic": 4}},
                             {"synthetic": 0.5})
    assert factors == {"mixed": 0.75, "generated": 0.5}
    # alpha 0.5, both of size 4: 2 * 0.75 = 1.5 against 2 * 0.5 = 1.0 -> 0.6 and 0.4
    probs = dataset_weights({"mixed": 4, "generated": 4}, 0.5, multipliers=factors)
    assert probs == pytest.approx({"mixed": 0.6, "generated": 0.4})


def _records(origins: list[str]) -> pa.Table:
    return records_to_table([Record(id=f"r{i}", dataset="d", task="retrieval", query=f"query {i}",
                                    positives=[f"passage {i}"], origin=o) for i, o in enumerate(origins)])


def test_the_trainer_weights_each_row_by_its_origin_and_draws_datasets_by_the_mean(tmp_path, tiny_model):
    from embed_core.train.engine.sampling import Batch
    from embed_core.train.engine.trainer import Trainer

    config = parse_config({"prepare": {"sources": [{"name": "x", "kind": "sts", "path": "x"}]}, "train": {
        "base_model": str(tiny_model), "max_length": 32, "precision": "fp32", "stages": [{
            "name": "s", "steps": 1, "batch_size": {"retrieval": 4}, "num_hard_negatives": 0,
            "query_max_length": 16, "passage_max_length": 16, "origin_weight": {"synthetic": 0.5}}]}})
    stage = config.train.stages[0]
    datasets = {"mixed": DatasetRecords("mixed", _records(["original", "synthetic", "original", "synthetic"])),
                "generated": DatasetRecords("generated", _records(["synthetic"] * 4))}
    trainer = Trainer(config.train, stage, datasets, init_model=str(tiny_model), checkpoint_dir=tmp_path, seed=0)
    assert trainer.sampler.weights == pytest.approx({"mixed": 0.6, "generated": 0.4})
    assert trainer._build(Batch("mixed", [0, 1, 2, 3]), 0).weights == [1.0, 0.5, 1.0, 0.5]
    plain = TrainStageConfig(**{**stage.model_dump(), "origin_weight": {}})
    trainer = Trainer(config.train, plain, datasets, init_model=str(tiny_model), checkpoint_dir=tmp_path, seed=0)
    assert trainer.sampler.weights == pytest.approx({"mixed": 0.5, "generated": 0.5})
    assert trainer._build(Batch("mixed", [0, 1, 2, 3]), 0).weights == []


def test_an_unknown_origin_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown origin.*'human'.*synthetic"):
        TrainStageConfig(name="s", steps=1, origin_weight={"human": 1.0})


def test_the_stages_lineage_records_its_origin_weight(tmp_path):
    import torch

    from embed_core.train.commit import lineage_of
    from embed_core.train.engine.lineage import read_metadata
    from embed_core.train.engine.outcome import FitOutcome

    stage = TrainStageConfig(name="s", steps=1, origin_weight={"synthetic": 0.5})
    trained = FitOutcome(steps=1, metrics=[], dev_rows=[], best=None, selected_step=1, consumed=[(1, "d", [0])],
                         world=1, device=torch.device("cpu"), bf16=False, model=None, state=None)  # what a step leaves
    table = lineage_of(tmp_path, "synthesize", stage, {"d": DatasetRecords("d", _records(["synthetic"]))}, trained)
    assert read_metadata(table.schema)["origin_weight"] == {"synthetic": 0.5}
    plain = TrainStageConfig(name="s", steps=1)
    table = lineage_of(tmp_path, "synthesize", plain, {"d": DatasetRecords("d", _records(["synthetic"]))}, trained)
    assert "origin_weight" not in read_metadata(table.schema)
