"""Run configs: every shipped config validates; ``extends`` merges mappings and replaces lists."""

from pathlib import Path

import pytest

from embed_core.config import load_config
from embed_core.errors import ConfigError
from tests.helpers.repo import REPO


@pytest.mark.parametrize("path", sorted((REPO / "deployments/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path):
    assert load_config(path).prepare.sources


def test_the_gated_demo_is_the_demo_with_dev_records_a_dev_section_and_the_gate_on_stage_2():
    """demo-gated.yaml restates the demo's lists (extends replaces them): it must not drift from demo.yaml."""
    demo = load_config(REPO / "deployments/configs/demo.yaml").model_dump()
    gated = load_config(REPO / "deployments/configs/demo-gated.yaml").model_dump()
    dev = {s["name"]: s.pop("dev_fraction") for s in gated["prepare"]["sources"]}
    for source in demo["prepare"]["sources"]:
        source.pop("dev_fraction")
    assert {name for name, fraction in dev.items() if fraction} == {"stsb", "scifact", "banking77"}
    stage2 = gated["train"]["stages"][1]
    assert stage2["data_value"] is not None and stage2["dev"]["select"] == "last"
    # a dev task for each of evaluate's test tasks: the gate decides on what the run is scored on
    assert len(stage2["dev"]["tasks"]) == len(demo["evaluate"]["tasks"])
    assert sorted(t["type"] for t in stage2["dev"]["tasks"]) == sorted(t["type"] for t in demo["evaluate"]["tasks"])
    stage2["data_value"] = stage2["dev"] = None
    assert (gated.pop("run_name"), gated.pop("release")) == ("demo-gated", None)
    assert {k: v for k, v in demo.items() if k not in ("run_name", "release")} == gated


def test_extends_merges_mappings_and_replaces_lists(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "run_name: base\nseed: 1\nprepare:\n  cleaning: {max_chars: 100, dedupe: exact}\n"
        "  sources: [{name: a, kind: sts, path: a.csv}, {name: b, kind: sts, path: b.csv}]\n")
    (tmp_path / "child.yaml").write_text(
        "extends: base.yaml\nrun_name: child\nprepare:\n  cleaning: {max_chars: 50}\n"
        "  sources: [{name: c, kind: sts, path: c.csv}]\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.run_name == "child" and cfg.seed == 1
    assert cfg.prepare.cleaning.max_chars == 50 and cfg.prepare.cleaning.dedupe == "exact"
    assert [s.name for s in cfg.prepare.sources] == ["c"]


def test_extends_loop_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "a.yaml")


def _config_with(**sections) -> dict:
    return {"prepare": {"sources": [{"name": "scifact", "kind": "beir", "path": "beir/scifact"},
                                    {"name": "stsb", "kind": "sts", "path": "stsb/train.csv"}]}, **sections}


@pytest.mark.parametrize("sections, key, name", [
    ({"mine": {"datasets": ["scifcat"]}}, "mine.datasets", "scifcat"),
    ({"mine": {"corpora": {"scifakt": "beir/scifact"}}}, "mine.corpora", "scifakt"),
    ({"synthesize": {"datasets": ["stsb", "stbs"]}}, "synthesize.datasets", "stbs"),
    ({"train": {"stages": [{"name": "s1"}, {"name": "s2", "datasets": ["scifact", "sts-b"]}]}},
     "train.stages[s2].datasets", "sts-b"),
    ({"train": {"stages": [{"name": "s1", "dataset_weight": {"scifactt": 2.0}}]}}, "train.stages[s1].dataset_weight",
     "scifactt"),
    ({"train": {"stages": [{"name": "s1", "dev": {"tasks": [{"name": "d", "type": "sts", "dataset": "stsbb"}]}}]}},
     "train.stages[s1].dev.tasks[d].dataset", "stsbb"),
])
def test_a_dataset_filter_naming_no_source_is_a_config_error_with_a_suggestion(sections, key, name):
    from embed_core.config import parse_config

    with pytest.raises(ConfigError) as refused:
        parse_config(_config_with(**sections), origin="c.yaml")
    assert str(refused.value).startswith(f"c.yaml: {key}: no dataset {name!r} (did you mean '")
    assert str(refused.value).endswith("datasets are the names of prepare.sources: scifact, stsb)")


def test_a_dataset_name_unlike_any_source_gets_no_suggestion():
    from embed_core.config import parse_config

    with pytest.raises(ConfigError, match=r"^c.yaml: mine.datasets: no dataset 'quora' \(datasets are the names"):
        parse_config(_config_with(mine={"datasets": ["quora"]}), origin="c.yaml")
    assert parse_config(_config_with(mine={"datasets": ["stsb"]})).mine.datasets == ["stsb"]


def test_a_misspelt_key_in_a_training_stage_names_the_stage_and_the_key_it_meant():
    from embed_core.config import parse_config

    with pytest.raises(ConfigError) as refused:
        parse_config(_config_with(train={"stages": [{"name": "s1"}, {"name": "s2", "setps": 3}]}), origin="c.yaml")
    assert str(refused.value) == ("c.yaml: train.stages[s2].setps: Extra inputs are not permitted "
                                  "(did you mean 'steps'?)")


def test_an_unknown_key_far_from_any_known_one_gets_no_suggestion():
    from embed_core.config import parse_config

    with pytest.raises(ConfigError) as refused:
        parse_config(_config_with(mine={"zzzzqqq": 1}), origin="c.yaml")
    assert str(refused.value) == "c.yaml: mine.zzzzqqq: Extra inputs are not permitted"


def test_an_inline_config_is_merged_over_the_config_file_like_extends(tmp_path):
    import yaml

    from embed_core.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_config_with(train={"stages": [{"name": "s1", "steps": 5}]})))
    merged = load_config(path, overrides={"run_name": "other", "train": {"work_pool": "gpu"}})
    assert (merged.run_name, merged.train.work_pool) == ("other", "gpu")
    assert [s.steps for s in merged.train.stages] == [5]  # untouched keys keep the file's values
    with pytest.raises(ConfigError) as refused:
        load_config(path, overrides={"train": {"work_pol": "gpu"}})
    assert str(refused.value) == (f"{path} (with the inline config): train.work_pol: Extra inputs are not permitted "
                                  "(did you mean 'work_pool'?)")
