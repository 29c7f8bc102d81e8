"""The one number format a user reads (embed_core.numbers)."""

import math

import pytest

from embed_core import numbers


@pytest.mark.parametrize("value, shown", [(0.93374, "93.37"), (0.9, "90.00"), (1.0, "100.00"), (0.0, "0.00"),
                                          (None, "–"), (math.nan, "nan")])
def test_a_score_is_shown_times_100_with_two_decimals(value, shown):
    assert numbers.score(value) == shown


def test_a_change_of_a_score_carries_its_sign_times_100():
    assert [numbers.score_change(v) for v in (0.0125, -0.0125, 0.0)] == ["+1.25", "-1.25", "+0.00"]


@pytest.mark.parametrize("value, shown", [(0.015524939633905888, "0.01552"), (2.0, "2.000"), (1.23456, "1.235"),
                                          (12345.678, "12350"), (0.00099996, "0.001000"), (-0.5, "-0.5000"),
                                          (3e-15, "3.000e-15"), (0.0, "0.000"), (None, "–"), (math.inf, "inf")])
def test_a_loss_is_shown_with_four_significant_digits(value, shown):
    assert numbers.loss(value) == shown
