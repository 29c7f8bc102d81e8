"""The guard where main scores are collected: a NaN or infinite main score is an error naming the
task and the metric, never a reported result."""

import math

import pytest

from embed_core.errors import EmbedpipeError
from embed_core.scoring.tasks import check_main_score


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_main_score_that_is_not_a_number_is_an_error_naming_the_task(value):
    with pytest.raises(EmbedpipeError, match=f"task FlatSTS: main score cosine_spearman is {value}"):
        check_main_score("FlatSTS", "cosine_spearman", value)


def test_a_finite_main_score_passes_unchanged():
    assert check_main_score("STS", "cosine_spearman", 0.25) == 0.25


def test_order_tasks_puts_the_named_tasks_first_in_their_order_and_refuses_an_unknown_name():
    from types import SimpleNamespace

    from embed_core.errors import ConfigError
    from embed_core.scoring.requests import order_tasks

    specs = [SimpleNamespace(name=n) for n in ("A", "B", "C", "D")]
    assert [s.name for s in order_tasks(specs, ["C", "A"])] == ["C", "A", "B", "D"]
    assert [s.name for s in order_tasks(specs, [])] == ["A", "B", "C", "D"]
    with pytest.raises(ConfigError, match="'E'"):
        order_tasks(specs, ["E"])
