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
