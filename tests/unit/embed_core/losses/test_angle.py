"""AnglE (cosine + in-batch negative + angle objectives) against hand-computed values."""

import math

import pytest
import torch

from embed_core.losses.angle import AnglE, angle_loss, angle_similarity
from embed_core.losses.cosent import cosent
from tests.helpers.loss_calls import call_loss


def _unit(theta):
    return [math.cos(theta), math.sin(theta)]


def test_angle_similarity_of_one_complex_plane_is_abs_cos_minus_sin_of_the_angle():
    # a = 1, b = e^{iθ}: z = a / b = e^{-iθ}, so s = |cos θ − sin θ|
    a = torch.tensor([_unit(0.0)] * 3, dtype=torch.float64)
    b = torch.tensor([_unit(0.0), _unit(math.pi / 3), _unit(math.pi / 2)], dtype=torch.float64)
    expected = [1.0, abs(0.5 - math.sqrt(3) / 2), 1.0]
    assert angle_similarity(a, b).tolist() == pytest.approx(expected, rel=1e-9)


def test_the_angle_objective_ranks_pairs_by_angle_similarity():
    a = torch.tensor([_unit(0.0), _unit(0.0)], dtype=torch.float64)
    b = torch.tensor([_unit(0.0), _unit(math.pi / 3)], dtype=torch.float64)
    scores = torch.tensor([2.0, 1.0])
    s0, s1 = 1.0, abs(0.5 - math.sqrt(3) / 2)
    expected = math.log(1 + math.exp(s1 - s0))  # the one ordered pair: y_0 > y_1
    got = angle_loss(a, b, scores, w_cos=0.0, w_ibn=0.0, w_angle=1.0)
    assert got.item() == pytest.approx(expected, rel=1e-9)


def test_the_in_batch_objective_uses_only_pairs_at_or_above_the_threshold_as_anchors():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    scores = torch.tensor([5.0, 4.0, 1.0])  # the third pair is not a positive, its b is still a candidate
    # τ = 1: row 0 logits (1, 0, 0) → −log(e / (e + 2)); row 1 logits (0, 1, 1) → −log(e / (1 + 2e))
    expected = (-math.log(math.e / (math.e + 2)) - math.log(math.e / (1 + 2 * math.e))) / 2
    got = angle_loss(a, b, scores, w_cos=0.0, w_ibn=1.0, w_angle=0.0, tau_ibn=1.0, ibn_min_score=4.0)
    assert got.item() == pytest.approx(expected, rel=1e-9)
    none = angle_loss(a, b, scores, w_cos=0.0, w_ibn=1.0, w_angle=0.0, ibn_min_score=6.0)
    assert none.item() == 0.0


def test_the_loss_is_the_weighted_sum_of_its_three_objectives():
    torch.manual_seed(0)
    a = torch.nn.functional.normalize(torch.randn(6, 8, dtype=torch.float64), dim=-1)
    b = torch.nn.functional.normalize(torch.randn(6, 8, dtype=torch.float64), dim=-1)
    scores = [5.0, 4.2, 3.0, 2.0, 1.0, 0.0]
    t = torch.tensor(scores)
    parts = [angle_loss(a, b, t, w_cos=1.0, w_ibn=0.0, w_angle=0.0), angle_loss(a, b, t, w_cos=0.0, w_ibn=1.0, w_angle=0.0),
             angle_loss(a, b, t, w_cos=0.0, w_ibn=0.0, w_angle=1.0)]
    assert parts[0].item() == pytest.approx(cosent(a, b, t, tau=0.05).item(), rel=1e-12)
    loss = AnglE(AnglE.Params(w_cos=0.5, w_ibn=2.0, w_angle=3.0))
    got = call_loss(loss, {"a": a, "b": b}, task="sts", scores=scores).item()
    assert got == pytest.approx(0.5 * parts[0].item() + 2.0 * parts[1].item() + 3.0 * parts[2].item(), rel=1e-6)
