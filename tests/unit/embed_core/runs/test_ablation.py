"""Ablation rows (``embed_core.runs.ablation``): settings changed by path, one run per row and seed
under its own name and seed, evaluated with its last stage's model; the table's mean ± spread."""

import math

import pytest
import yaml

from embed_core.runs.ablation import report_markdown, row_configs, set_path, summary
from embed_core.config import parse_config
from embed_core.errors import ConfigError
from tests.helpers.repo import REPO


def _config(**ablation):
    raw = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    raw.update(data_root=str(REPO / "data"), ablation=ablation)
    return parse_config(raw)


def test_a_path_reaches_into_mappings_and_picks_list_items_by_name():
    raw = {"train": {"stages": [{"name": "a", "lr": 1}, {"name": "b", "lr": 2}]}}
    set_path(raw, "train.stages[b].lr", 5)
    set_path(raw, "train.stages[a].losses.sts", "cosent")
    assert raw["train"]["stages"] == [{"name": "a", "lr": 1, "losses": {"sts": "cosent"}}, {"name": "b", "lr": 5}]
    with pytest.raises(ConfigError, match=r"train.stages\[c\].lr: no item named 'c' in stages"):
        set_path(raw, "train.stages[c].lr", 1)


def test_every_row_runs_with_every_seed_under_its_own_name_and_its_last_stages_model():
    config = _config(seeds=[1, 2], variants={"remine": {"train.stages[stage2].remine": {"num_negatives": 2}}})
    runs = row_configs(config)
    assert [(row, seed, c.run_name, c.seed) for row, seed, c in runs] == [
        ("base", 1, "demo-base-s1", 1), ("base", 2, "demo-base-s2", 2),
        ("remine", 1, "demo-remine-s1", 1), ("remine", 2, "demo-remine-s2", 2)]
    assert runs[0][2].train.stages[1].remine is None and runs[2][2].train.stages[1].remine == {"num_negatives": 2}
    assert runs[3][2].evaluate.models == ["base", "runs/demo-remine-s2/train-stage2/model"]
    assert all(c.ablation is None for _, _, c in runs)


def test_a_variant_that_makes_a_bad_config_is_refused_with_its_row_name():
    config = _config(variants={"typo": {"train.stages[stage2].setps": 3}})
    with pytest.raises(ConfigError, match=r"ablation.variants.typo: .*setps"):
        row_configs(config)


def test_the_table_holds_mean_and_sample_spread_over_seeds_and_the_difference_to_base():
    config = _config(seeds=[1, 2], variants={"x": {"train.stages[stage2].steps": 5}})
    rows = [{"row": "base", "seed": 1, "task": "T", "score": 0.80}, {"row": "base", "seed": 2, "task": "T", "score": 0.82},
            {"row": "x", "seed": 1, "task": "T", "score": 0.85}, {"row": "x", "seed": 2, "task": "T", "score": 0.85}]
    stats = {(s["row"], s["task"]): s for s in summary(rows)}
    assert stats[("base", "T")]["mean"] == pytest.approx(81.0) and stats[("base", "T")]["std"] == pytest.approx(2 ** 0.5)
    table = report_markdown(config, summary(rows))
    assert "| base | the config | 81.00 ± 1.41 |" in table
    assert "| x | `train.stages[stage2].steps: 5` | 85.00 ± 0.00 (+4.00) |" in table


def test_one_seed_shows_no_spread_rather_than_a_spread_of_zero():
    config = _config(seeds=[1], variants={"x": {"train.stages[stage2].steps": 5}})
    rows = [{"row": "base", "seed": 1, "task": "T", "score": 0.80}, {"row": "x", "seed": 1, "task": "T", "score": 0.85}]
    assert math.isnan(summary(rows)[0]["std"])
    table = report_markdown(config, summary(rows))
    assert "| base | the config | 80.00 (1 seed: no spread) |" in table
    assert "| x | `train.stages[stage2].steps: 5` | 85.00 (1 seed: no spread) (+5.00) |" in table


@pytest.mark.parametrize("path", ["seed", "run_name", "run_root", "evaluate.models"])
def test_a_variant_that_sets_what_the_ablation_sets_is_refused_at_load(path):
    with pytest.raises(ConfigError) as refused:
        _config(seeds=[1, 2], variants={"s5": {path: 5}})
    message = str(refused.value)
    assert message.startswith(f"<config>: ablation.variants: variant 's5': {path!r} is set by the ablation, not by a "
                              "variant (") and message.endswith("); the row would repeat base")
    assert "\n" not in message


def test_a_variant_that_sets_seed_is_told_to_list_the_seeds_in_ablation_seeds():
    with pytest.raises(ConfigError, match=r"variant 's5': 'seed' is set by the ablation, not by a variant \(each row "
                                          r"runs once per seed of ablation.seeds: list the seeds there\)"):
        _config(variants={"s5": {"seed": 5}})


def test_a_seed_listed_twice_is_refused_at_load_instead_of_a_spread_of_zero():
    with pytest.raises(ConfigError) as refused:
        _config(seeds=[1, 2, 1])
    assert str(refused.value) == ("<config>: ablation.seeds: seed 1 is listed more than once ([1, 2, 1]): repeated "
                                  "seeds are the same runs, and their spread (± 0.00) would say nothing; list "
                                  "distinct seeds")
