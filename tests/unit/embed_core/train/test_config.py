"""The train section's checks across stages (``embed_core.train.config``): a stage starts from an
earlier stage's model, so an ``init_from`` that names itself, a later stage or a cycle is refused
when the config loads, with the chain of stages in the one-line message."""

import pytest

from embed_core.config import parse_config
from embed_core.errors import ConfigError


def _parse(stages: list[dict]):
    raw = {"prepare": {"sources": [{"name": "stsb", "kind": "sts", "path": "stsb/train.csv"}]},
           "train": {"stages": stages}}
    return parse_config(raw, origin="c.yaml")


def _refusal(stages: list[dict]) -> str:
    with pytest.raises(ConfigError) as refused:
        _parse(stages)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_a_stage_that_starts_from_itself_is_refused_at_load_with_its_chain():
    assert _refusal([{"name": "s1"}, {"name": "s2", "init_from": "s2"}]) == (
        "c.yaml: train.stages: stages[s2].init_from: 's2' is the stage itself (s2 → s2): a stage starts from an "
        "earlier stage's model, 'base', or by default the previous stage's; reorder the stages or name an earlier one")


def test_two_stages_that_start_from_each_other_are_refused_with_the_cycle():
    message = _refusal([{"name": "a", "init_from": "b"}, {"name": "b", "init_from": "a"}])
    assert message.startswith("c.yaml: train.stages: stages[a].init_from: 'b' is a later stage, and the chain loops "
                              "(a → b → a)")


def test_a_cycle_through_a_default_previous_stage_is_refused_with_every_stage_in_it():
    message = _refusal([{"name": "a", "init_from": "c"}, {"name": "b"}, {"name": "c"}])
    assert "stages[a].init_from: 'c' is a later stage, and the chain loops (a → c → b → a)" in message


def test_a_stage_that_starts_from_a_later_stage_is_refused_even_without_a_cycle():
    message = _refusal([{"name": "a", "init_from": "b"}, {"name": "b", "init_from": "base"}])
    assert "stages[a].init_from: 'b' is a later stage (a → b → base)" in message


def test_init_from_naming_no_stage_is_refused_at_load_with_the_stages_there_are():
    assert _refusal([{"name": "a"}, {"name": "b", "init_from": "stage1"}]) == (
        "c.yaml: train.stages: stages[b].init_from: 'stage1' is no stage (stages: a, b; 'base' for the base model)")


def test_earlier_stages_base_and_the_default_previous_stage_are_accepted():
    config = _parse([{"name": "a"}, {"name": "b", "init_from": "a"}, {"name": "c", "init_from": "base"},
                     {"name": "d"}])
    assert [s.init_from for s in config.train.stages] == [None, "a", "base", None]


def test_matryoshka_dims_are_kept_descending_with_their_weights_and_default_to_weight_one():
    cfg = _parse([{"name": "s1", "matryoshka": {"dims": [64, 256, 128], "weights": [2.0, 1.0, 0.5]}}]).train
    stage = cfg.stages[0]
    assert (stage.matryoshka.dims, stage.matryoshka.weights) == ([256, 128, 64], [1.0, 0.5, 2.0])
    whole = _parse([{"name": "s1"}, {"name": "s2", "matryoshka": {"dims": [8]}}]).train
    assert whole.matryoshka_of(whole.stages[0]) is None and whole.matryoshka_of(whole.stages[1]).weights == [1.0]
    raw = {"prepare": {"sources": [{"name": "stsb", "kind": "sts", "path": "stsb/train.csv"}]},
           "train": {"matryoshka": {"dims": [32, 16]}, "stages": [{"name": "a"}, {"name": "b", "matryoshka": {"dims": [8]}}]}}
    both = parse_config(raw, origin="c.yaml").train
    assert [both.matryoshka_of(s).dims for s in both.stages] == [[32, 16], [8]]  # a stage's own wins


@pytest.mark.parametrize("mrl, says", [
    ({"dims": [64, 0]}, "matryoshka.dims must be positive"),
    ({"dims": [64, 64]}, "matryoshka.dims has a repeated dimension"),
    ({"dims": [64, 32], "weights": [1.0]}, "matryoshka.weights needs one weight per dimension (2 dims, 1 weights)"),
    ({"dims": [64], "weights": [-1.0]}, "matryoshka.weights must be >= 0"),
])
def test_bad_matryoshka_settings_are_refused_at_load_in_one_line(mrl, says):
    assert says in _refusal([{"name": "s1", "matryoshka": mrl}])


def test_matryoshka_on_an_autoregembed_stage_is_refused():
    assert "stages[arc].matryoshka: Matryoshka training is for contrastive stages, not autoregembed_ic" in _refusal(
        [{"name": "arc", "mode": "autoregembed_ic", "matryoshka": {"dims": [8]}}])


def test_a_matryoshka_dimension_above_the_models_embedding_size_is_refused_where_the_size_is_known():
    from embed_core.train.engine.trainer import matryoshka_settings

    train = _parse([{"name": "s1", "matryoshka": {"dims": [64, 16], "weights": [1.0, 0.5]}}]).train
    assert matryoshka_settings(train, train.stages[0], 64) == ([64, 16], [1.0, 0.5])
    with pytest.raises(ConfigError) as refused:
        matryoshka_settings(train, train.stages[0], 32)
    assert str(refused.value) == ("train.stages[s1].matryoshka.dims: [64] above the model's embedding size 32 "
                                  "(dims must be at most 32)")
