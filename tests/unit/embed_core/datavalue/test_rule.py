"""The data-value decision rule on hand-computed deltas: a unit is dropped only when its loss of dev
score exceeds the noise, down-weighted when its mean is negative within the noise band, kept
otherwise, and never dropped on fewer than two seeds; the decisions table and its markdown."""

from __future__ import annotations

import math

import pytest

from embed_core.datavalue.rule import COLUMNS, decide, decisions_markdown, decisions_table
from embed_core.errors import ConfigError, EmbedpipeError

NOISE = 0.5
DELTAS = {
    "shuffled_copy": [-2.0, -1.5, -2.5],
    "llm_negatives": [-0.5, 0.3, -0.4],
    "paraphrase": [1.0, 2.0, 3.0],
    "one_seed": [-3.0],
}


def _by_unit(decisions):
    return {d.unit: d for d in decisions}


def test_a_loss_beyond_the_noise_is_dropped_with_the_mean_spread_and_standard_error_computed_by_hand():
    d = _by_unit(decide(DELTAS, NOISE))["shuffled_copy"]
    # mean = (-2.0 - 1.5 - 2.5) / 3 = -2.0; deviations 0, 0.5, -0.5 -> s² = 0.5 / 2 = 0.25, s = 0.5
    # se = sqrt((s² + noise²) / n) = sqrt((0.25 + 0.25) / 3) = sqrt(0.1666…) = 0.408248
    # bound = -2.0 + 1.0 * 0.408248 = -1.591752 < 0 -> drop
    assert (d.delta, d.spread, d.noise, d.seeds) == (pytest.approx(-2.0), pytest.approx(0.5), 0.5, 3)
    assert d.se == pytest.approx(0.408248, abs=1e-6) and d.bound == pytest.approx(-1.591752, abs=1e-6)
    assert (d.action, d.weight) == ("drop", 0.0) and "exceeds the noise" in d.reason


def test_a_negative_mean_within_the_noise_band_is_down_weighted_and_a_positive_one_is_kept():
    out = _by_unit(decide(DELTAS, NOISE, down_weight=0.3))
    d = out["llm_negatives"]
    # mean = (-0.5 + 0.3 - 0.4) / 3 = -0.2; deviations -0.3, 0.5, -0.2 -> s² = (0.09 + 0.25 + 0.04) / 2 = 0.19
    # se = sqrt((0.19 + 0.25) / 3) = sqrt(0.146667) = 0.382971; bound = -0.2 + 0.382971 = 0.182971 >= 0
    assert d.delta == pytest.approx(-0.2) and d.spread == pytest.approx(math.sqrt(0.19))
    assert d.se == pytest.approx(0.382971, abs=1e-6) and d.bound == pytest.approx(0.182971, abs=1e-6)
    assert (d.action, d.weight) == ("down-weight", 0.3) and "within the noise" in d.reason
    k = out["paraphrase"]
    # mean = 6 / 3 = 2.0; deviations -1, 0, 1 -> s² = 2 / 2 = 1
    assert (k.delta, k.spread, k.action, k.weight) == (pytest.approx(2.0), pytest.approx(1.0), "keep", 1.0)


def test_a_narrower_band_drops_what_the_default_band_only_down_weights():
    # z = 0: the bound is the mean itself, -0.2 < 0
    d = _by_unit(decide(DELTAS, NOISE, z=0.0))["llm_negatives"]
    assert d.action == "drop" and d.weight == 0.0
    # z = 1.645: bound = -0.2 + 1.645 * 0.382971 = 0.429988, still within the band
    assert _by_unit(decide(DELTAS, NOISE, z=1.645))["llm_negatives"].bound == pytest.approx(0.429988, abs=1e-6)


def test_the_reference_noise_widens_the_band_when_the_units_own_seeds_agree_by_chance():
    deltas = {"unit": [-0.6, -0.6, -0.6]}   # s = 0
    # noise 1.5: se = sqrt((0 + 2.25) / 3) = sqrt(0.75) = 0.866025; bound = -0.6 + 0.866025 = 0.266025 >= 0
    wide = decide(deltas, 1.5)[0]
    assert wide.action == "down-weight" and wide.bound == pytest.approx(0.266025, abs=1e-6)
    # noise 0: se = 0, bound = -0.6 < 0
    assert decide(deltas, 0.0)[0].action == "drop"


def test_a_stages_only_data_is_kept_where_it_would_be_down_weighted_and_still_dropped_past_the_noise():
    out = _by_unit(decide(DELTAS, NOISE, whole=frozenset({"llm_negatives", "shuffled_copy", "one_seed"})))
    # llm_negatives: bound 0.182971 >= 0 and mean -0.2 < 0 (see above): a down-weight, kept as the stage's only data
    kept = out["llm_negatives"]
    assert (kept.action, kept.weight) == ("keep", 1.0) and kept.bound == pytest.approx(0.182971, abs=1e-6)
    assert "within the noise" in kept.reason and "only data" in kept.reason
    assert (out["one_seed"].action, out["one_seed"].weight) == ("keep", 1.0)
    assert (out["shuffled_copy"].action, out["shuffled_copy"].weight) == ("drop", 0.0)
    # the same deltas without ``whole``: down-weighted as before
    assert _by_unit(decide(DELTAS, NOISE))["llm_negatives"].action == "down-weight"


def test_a_unit_on_fewer_than_two_seeds_or_with_unknown_noise_is_never_dropped_and_the_reason_says_why():
    d = _by_unit(decide(DELTAS, NOISE))["one_seed"]
    assert (d.action, d.weight, d.seeds, d.delta) == ("down-weight", 0.5, 1, -3.0)
    assert math.isnan(d.spread) and "1 seed" in d.reason and "never dropped" in d.reason
    unknown = _by_unit(decide(DELTAS, math.nan))["shuffled_copy"]
    assert unknown.action == "down-weight" and "reference noise unknown" in unknown.reason
    assert decide({"none": []}, NOISE)[0].action == "keep"


def test_bad_inputs_are_refused_with_one_line_naming_the_unit_or_setting():
    with pytest.raises(EmbedpipeError, match="unit 'u': delta of seed 1 is nan"):
        decide({"u": [0.1, math.nan]}, NOISE)
    with pytest.raises(EmbedpipeError, match="noise -1.0"):
        decide(DELTAS, -1.0)
    with pytest.raises(ConfigError, match="down_weight 1.0"):
        decide(DELTAS, NOISE, down_weight=1.0)
    with pytest.raises(ConfigError, match="z -1"):
        decide(DELTAS, NOISE, z=-1)


def test_the_decisions_become_a_table_and_a_markdown_report_with_two_decimals():
    decisions = decide(DELTAS, NOISE)
    table = decisions_table(decisions)
    assert table.column_names == list(COLUMNS) and table.num_rows == 4
    rows = {r["unit"]: r for r in table.to_pylist()}
    assert rows["shuffled_copy"]["action"] == "drop" and rows["shuffled_copy"]["seeds"] == 3
    assert math.isnan(rows["one_seed"]["spread"])
    md = decisions_markdown(decisions).splitlines()
    assert md[0].startswith("| unit | Δ dev ×100 |") and len(md) == 2 + 4
    assert md[2].startswith("| shuffled_copy | -2.00 | 0.50 | 0.50 | 3 | drop | 0 |")
    assert md[5].startswith("| one_seed | -3.00 | — | 0.50 | 1 | down-weight | 0.5 |")
