"""Cosine regression (SBERT's CosineSimilarityLoss) against a hand-computed value."""

import math

import pytest
import torch

from embed_core.losses.cosine_regression import CosineRegression, cosine_regression
from tests.helpers.loss_calls import call_loss


def _pairs(cosines):
    a = torch.tensor([[1.0, 0.0]] * len(cosines), dtype=torch.float64)
    b = torch.tensor([[c, math.sqrt(1 - c * c)] for c in cosines], dtype=torch.float64)
    return a, b


def test_cosine_regression_matches_hand_computation():
    a, b = _pairs([0.9, 0.5])
    # targets 4/5 = 0.8 and 1/5 = 0.2: ((0.9 - 0.8)^2 + (0.5 - 0.2)^2) / 2 = (0.01 + 0.09) / 2
    assert cosine_regression(a, b, torch.tensor([0.8, 0.2], dtype=torch.float64)).item() == pytest.approx(0.05, rel=1e-9)
    loss = CosineRegression(CosineRegression.Params(score_max=5.0))
    assert call_loss(loss, {"a": a, "b": b}, task="sts", scores=[4.0, 1.0]).item() == pytest.approx(0.05, rel=1e-6)


def test_scores_are_scaled_by_the_datasets_largest_score_by_default():
    a, b = _pairs([0.9, 0.5])
    loss = CosineRegression()
    got = call_loss(loss, {"a": a, "b": b}, task="sts", scores=[4.0, 1.0], max_score=5.0).item()
    assert got == pytest.approx(0.05, rel=1e-6)
    # unlike CoSENT the absolute value matters: the same order with other values is another loss
    assert call_loss(loss, {"a": a, "b": b}, task="sts", scores=[4.5, 2.5], max_score=5.0).item() != pytest.approx(got)
