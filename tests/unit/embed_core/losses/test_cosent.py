"""CoSENT (QZhou Eq. 2) against a hand-computed value."""

import math

import pytest
import torch

from embed_core.losses.cosent import CoSENT, cosent
from tests.helpers.loss_calls import call_loss


def _pairs(cosines):
    a = torch.tensor([[1.0, 0.0]] * len(cosines), dtype=torch.float64)
    b = torch.tensor([[c, math.sqrt(1 - c * c)] for c in cosines], dtype=torch.float64)
    return a, b


def test_cosent_matches_hand_computation():
    a, b = _pairs([0.9, 0.5, 0.1])
    scores = torch.tensor([3.0, 1.0, 2.0])
    tau = 1.0
    # pairs (p, q) with y_p > y_q: (0,1): s1-s0 = -0.4; (0,2): s2-s0 = -0.8; (2,1): s1-s2 = 0.4
    expected = math.log(1 + math.exp(-0.4) + math.exp(-0.8) + math.exp(0.4))
    assert cosent(a, b, scores, tau=tau).item() == pytest.approx(expected, rel=1e-9)


def test_only_the_order_of_gold_scores_matters_and_ties_add_nothing():
    a, b = _pairs([0.9, 0.5, 0.1])
    loss = lambda scores: call_loss(CoSENT(CoSENT.Params(tau=0.05)), {"a": a, "b": b}, task="sts",  # noqa: E731
                                    scores=scores).item()
    assert loss([3.0, 1.0, 2.0]) == pytest.approx(loss([30.0, 0.0, 7.0]), rel=1e-6)
    assert loss([1.0, 1.0, 1.0]) == pytest.approx(0.0, abs=1e-12)  # log(1 + 0)
