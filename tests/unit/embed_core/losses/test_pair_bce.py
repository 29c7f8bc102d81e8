"""Pair-relevance BCE (Eqs. 2–5) against values computed by hand."""

import math

import pytest
import torch

from embed_core.losses import LossContext
from embed_core.losses.pair_bce import PairBCE, graded_targets, logit_bias, pair_bce, pair_bce_pointwise
from tests.helpers.loss_calls import call_loss


def _log_sigmoid(t):
    return -math.log1p(math.exp(-t))


def test_bias_formula_matches_the_paper():
    # β = log(p/(1−p)) with p = 1/(2B): −log(2B − 1); the paper's B = 256 value is −6.24
    assert logit_bias(1 / 512) == pytest.approx(-math.log(511))
    assert logit_bias(1 / 512) == pytest.approx(-6.236, abs=1e-3)
    assert logit_bias(0.269) == pytest.approx(-1.000, abs=2e-3)  # graded TREC-DL share (notes B.1.5)
    with pytest.raises(ValueError):
        logit_bias(1.0)


def test_graded_targets_eq4():
    z = graded_targets(torch.tensor([0.0, 1.0, 2.0, 3.0]), max_grade=3, cutoff=0.7)
    assert z.tolist() == pytest.approx([0.0, 0.8, 0.9, 1.0])


def test_in_batch_bce_by_hand():
    # 2 anchors, 2 positives, 1 hard negative (flat): 3 candidates per anchor
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    pos = torch.tensor([[0.6, 0.8], [0.8, 0.6]])
    neg = torch.tensor([[1.0, 0.0]])
    scale = 2.0
    bias = -math.log(3 - 1)  # p = 1/3
    dots = [[0.6, 0.8, 1.0], [0.8, 0.6, 0.0]]
    total = 0.0
    for i in range(2):
        for c in range(3):
            s = scale * dots[i][c] + bias
            z = 1.0 if c == i else 0.0
            total -= z * _log_sigmoid(s) + (1 - z) * _log_sigmoid(-s)
    expected = total / 2  # summed over candidates, divided by the number of anchors
    assert float(pair_bce(q, pos, neg, scale=scale)) == pytest.approx(expected, rel=1e-6)
    loss = PairBCE(PairBCE.Params(scale=scale, bias=bias, cutoff=0.0))  # relevance 1 of 1: z = 1
    got = call_loss(loss, {"query": q, "positive": pos, "negative": neg}, scores=[1.0] * q.size(0))
    assert float(got) == pytest.approx(expected, rel=1e-6)

    # graded own-positive targets: z = 0.8 for anchor 0, 1.0 for anchor 1
    total = 0.0
    for i, zi in enumerate((0.8, 1.0)):
        for c in range(3):
            s = scale * dots[i][c] + bias
            z = zi if c == i else 0.0
            total -= z * _log_sigmoid(s) + (1 - z) * _log_sigmoid(-s)
    got = pair_bce(q, pos, neg, scale=scale, targets=torch.tensor([0.8, 1.0]))
    assert float(got) == pytest.approx(total / 2, rel=1e-6)


def test_pointwise_graded_bce_by_hand():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    b = torch.tensor([[0.6, 0.8], [0.0, 1.0], [0.0, 1.0]])
    z = torch.tensor([0.9, 1.0, 0.0])
    bias = math.log((2 / 3) / (1 / 3))  # two of three targets are > 0
    expected = 0.0
    for dot, zi in zip((0.6, 1.0, 0.0), (0.9, 1.0, 0.0)):
        s = 20.0 * dot + bias
        expected -= zi * _log_sigmoid(s) + (1 - zi) * _log_sigmoid(-s)
    assert float(pair_bce_pointwise(a, b, z)) == pytest.approx(expected / 3, rel=1e-6)


def test_rejects_bad_scale():
    with pytest.raises(ValueError):
        PairBCE.Params(scale=0)


def test_bias_warmup_moves_linearly_to_the_eq3_value():
    loss = PairBCE(PairBCE.Params(bias_warmup_from=-25.0))
    at = lambda step: loss.bias_at(LossContext(step=step, warmup_steps=4), 9)  # noqa: E731
    target = -math.log(8)  # 9 candidates per anchor: p = 1/9
    assert at(0) == pytest.approx(-25.0)
    assert at(2) == pytest.approx(-25.0 + (target + 25.0) / 2)
    assert at(4) is None  # after warm-up: the configured β (None = Eq. 3 inside the loss)
    fixed = PairBCE(PairBCE.Params(bias=-12.0, bias_warmup_from=-25.0))
    assert fixed.bias_at(LossContext(step=1, warmup_steps=4), 9) == pytest.approx(-25.0 + 13.0 / 4)
