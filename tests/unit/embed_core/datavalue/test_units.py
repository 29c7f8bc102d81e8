"""The data-value gate's pieces that need no training: the records without a unit, the proxy
variants and the pairs a delta compares, the weights a decision applies, the budget and the config."""

import pyarrow as pa
import pytest

from embed_core.datavalue.apply import gated_stage
from embed_core.datavalue.config import DataValueConfig
from embed_core.datavalue.proxy import check_budget, unit_pairs, variants
from embed_core.datavalue.units import applied_weights, whole, without
from embed_core.errors import ConfigError
from embed_core.schema import RECORD_SCHEMA
from embed_core.train.config import TrainStageConfig

DEV = {"tasks": [{"name": "d", "type": "sts", "dataset": "a"}]}


def _record(i: int, origin: str, negatives: list[str]) -> dict:
    return {"id": f"a/{i}", "dataset": "a", "task": "retrieval", "instruction": "", "query": f"q{i}",
            "positives": [f"p{i}"], "positive_scores": [], "negatives": negatives,
            "negative_scores": [0.5] * len(negatives), "negative_labels": [], "weak_positives": [], "label": None,
            "origin": origin, "source_ref": f"a.jsonl:{i}"}


def _table() -> pa.Table:
    return pa.Table.from_pylist([_record(0, "original", ["n0"]), _record(1, "paraphrase", []),
                                 _record(2, "llm_negative", ["llm", "mined"]), _record(3, "synthetic", [])],
                                schema=RECORD_SCHEMA)


def test_a_dataset_unit_removes_its_whole_file_and_leaves_other_files_as_they_are():
    table = _table()
    assert without("a.parquet", table, frozenset({"dataset:a"})) is None
    assert without("b.parquet", table, frozenset({"dataset:a"})) is table


def test_an_origin_unit_removes_its_records_and_llm_negatives_are_taken_out_of_their_records():
    out = without("a.parquet", _table(), frozenset({"origin:paraphrase", "origin:llm_negative"})).to_pylist()
    assert [r["id"] for r in out] == ["a/0", "a/2", "a/3"]
    stripped = out[1]
    assert stripped["negatives"] == ["mined"] and stripped["negative_scores"] == [0.5]
    assert stripped["origin"] == "original"


def test_a_unit_is_the_stages_whole_data_only_when_nothing_is_left_without_it(tmp_path):
    import pyarrow.parquet as pq

    def files(**tables):
        for name, rows in tables.items():
            pq.write_table(pa.Table.from_pylist(rows, schema=RECORD_SCHEMA), tmp_path / f"{name}.parquet")
        return {f"{n}.parquet": (tmp_path / f"{n}.parquet", "sha") for n in tables}

    corpus = files(corpus=[_record(i, "synthetic", []) for i in range(3)])
    assert whole(corpus, ["origin:synthetic", "dataset:corpus"]) == {"origin:synthetic", "dataset:corpus"}
    # an original record beside the generated ones, or another file: the unit is not the whole data
    mixed = files(mixed=[_record(0, "original", []), _record(1, "synthetic", [])])
    assert whole(mixed, ["origin:synthetic", "dataset:mixed"]) == {"dataset:mixed"}
    two = files(a=[_record(0, "synthetic", [])], b=[_record(1, "original", [])])
    assert whole(two, ["origin:synthetic", "dataset:a"]) == frozenset()
    # taking out llm negatives leaves their records: never the whole data
    assert whole(files(n=[_record(0, "llm_negative", ["llm"])]), ["origin:llm_negative"]) == frozenset()


def test_leave_one_out_compares_the_reference_and_add_one_in_compares_with_the_base():
    cfg = DataValueConfig()  # sources leave_one_out, synthetic add_one_in
    units = ["dataset:a", "dataset:b", "origin:paraphrase", "origin:synthetic"]
    planned = {v.name: v.removed for v in variants(units, cfg)}
    assert planned["reference"] == frozenset()
    assert planned["base"] == {"origin:paraphrase", "origin:synthetic"}
    assert planned["minus-dataset=a"] == {"dataset:a"}
    assert planned["plus-origin=paraphrase"] == {"origin:synthetic"}
    pairs = unit_pairs(units, cfg)
    assert pairs["dataset:b"] == ("reference", "minus-dataset=b")
    assert pairs["origin:synthetic"] == ("plus-origin=synthetic", "base")


def test_one_add_one_in_unit_is_measured_by_the_reference_against_the_base_without_a_third_variant():
    cfg = DataValueConfig()
    for units in (["origin:synthetic"], ["dataset:a", "origin:synthetic"]):
        planned = {v.name: v.removed for v in variants(units, cfg)}
        assert "plus-origin=synthetic" not in planned and planned["base"] == {"origin:synthetic"}
        assert unit_pairs(units, cfg)["origin:synthetic"] == ("reference", "base")


def test_the_stage_applies_down_weights_and_forgets_the_weight_of_a_dropped_dataset(tmp_path):
    from embed_core.artifacts import StageWriter
    from embed_core.manifests import DataValueManifest

    decisions = [{"unit": "dataset:a", "action": "drop", "weight": 0.0},
                 {"unit": "dataset:b", "action": "down-weight", "weight": 0.5},
                 {"unit": "origin:paraphrase", "action": "down-weight", "weight": 0.25},
                 {"unit": "dataset:c", "action": "keep", "weight": 1.0}]
    with StageWriter(tmp_path, "value-s", DataValueManifest, fingerprint="k") as writer:
        writer.commit({"stage_name": "s", "units": {}, "weights": applied_weights(decisions), "noise": 1.0,
                       "reference_score": 50.0, "counts": {}})
    stage = TrainStageConfig(name="s", dev=DEV, data_value={}, dataset_weight={"a": 3.0, "b": 2.0},
                             origin_weight={"paraphrase": 0.5})
    gated = gated_stage(tmp_path, stage)
    assert gated.dataset_weight == {"b": 1.0}
    assert gated.origin_weight == {"paraphrase": 0.125}


def test_a_gate_over_its_budget_is_refused_with_one_line():
    with pytest.raises(ConfigError) as err:
        check_budget("s", 12, DataValueConfig(max_proxy_runs=9))
    assert "12 proxy runs" in str(err.value) and "max_proxy_runs 9" in str(err.value)
    assert "\n" not in str(err.value)
    check_budget("s", 9, DataValueConfig(max_proxy_runs=9))


def test_a_gate_needs_the_stage_dev_tasks_and_names_its_units_by_kind():
    with pytest.raises(ValueError, match="dev section"):
        TrainStageConfig(name="s", data_value={})
    with pytest.raises(ValueError, match="'dataset:NAME' or 'origin:ORIGIN'"):
        DataValueConfig(units=["msmarco"])
    with pytest.raises(ValueError, match="synthetic origin"):
        DataValueConfig(units=["origin:mined"])
    assert TrainStageConfig(name="s", dev=DEV, data_value={"units": ["dataset:a"]}).data_value.seeds == 3


def test_a_misspelt_data_value_key_is_refused():
    with pytest.raises(ValueError, match="max_proxy_run"):
        TrainStageConfig(name="s", dev=DEV, data_value={"max_proxy_run": 5})


def test_a_leave_one_out_proxy_drops_the_left_out_datasets_weight_and_keeps_the_others():
    """demo-gated weights stsb 3.0: the proxy without stsb must not name it (training refuses a weight
    for a dataset it does not have), and every other proxy keeps the stage's weights."""
    from embed_core.config import load_config
    from embed_core.datavalue.proxy import proxy_config
    from tests.helpers.repo import REPO

    config = load_config(REPO / "deployments/configs/demo-gated.yaml")
    without_stsb = proxy_config(config, "stage2", "base", "minus-dataset=stsb", 1, frozenset({"dataset:stsb"}))
    without_sick = proxy_config(config, "stage2", "base", "minus-dataset=sick-e", 1, frozenset({"dataset:sick-e"}))
    base = proxy_config(config, "stage2", "base", "base", 1, frozenset({"origin:paraphrase"}))
    assert without_stsb.train.stages[0].dataset_weight == {}
    assert without_sick.train.stages[0].dataset_weight == base.train.stages[0].dataset_weight == {"stsb": 3.0}
