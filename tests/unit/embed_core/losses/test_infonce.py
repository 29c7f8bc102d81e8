"""InfoNCE (QZhou Eq. 1) against a hand-computed value."""

import math

import pytest
import torch

from embed_core.losses.infonce import InfoNCE, infonce
from tests.helpers.loss_calls import call_loss


def _unit(*xs):
    t = torch.tensor(xs, dtype=torch.float64)
    return t / t.norm(dim=-1, keepdim=True)


def test_infonce_matches_hand_computation():
    q = _unit([1.0, 0.0], [0.0, 1.0])
    pos = _unit([1.0, 0.0], [0.6, 0.8])
    neg = _unit([0.0, 1.0], [1.0, 0.0]).view(2, 1, 2)  # one hard negative each
    tau = 0.5
    e = lambda s: math.exp(s / tau)  # noqa: E731
    # query 1: positives (1, 0.6 in-batch), negatives (0 own, 1 other's), other query q2: 0
    l1 = -math.log(e(1) / (e(1) + e(0.6) + e(0) + e(1) + e(0)))
    # query 2: pos1 0, pos2 0.8 (its positive), neg1 1, neg2 0, other query q1: 0
    l2 = -math.log(e(0.8) / (e(0) + e(0.8) + e(1) + e(0) + e(0)))
    assert infonce(q, pos, neg, tau=tau).item() == pytest.approx((l1 + l2) / 2, rel=1e-9)


def test_query_negatives_term_can_be_switched_off():
    q = _unit([1.0, 0.0], [0.0, 1.0])
    pos = _unit([1.0, 0.0], [0.6, 0.8])
    tau = 1.0
    l1 = -math.log(math.exp(1) / (math.exp(1) + math.exp(0.6)))
    l2 = -math.log(math.exp(0.8) / (math.exp(0) + math.exp(0.8)))
    loss = InfoNCE(InfoNCE.Params(tau=tau, query_negatives=False))
    assert call_loss(loss, {"query": q, "positive": pos}).item() == pytest.approx((l1 + l2) / 2, rel=1e-9)


def test_bad_tau_is_rejected():
    with pytest.raises(ValueError):
        InfoNCE.Params(tau=0)


def test_flat_negatives_of_uneven_rows_equal_the_per_row_layout():
    q = _unit([1.0, 0.0], [0.0, 1.0])
    pos = _unit([1.0, 0.0], [0.6, 0.8])
    neg = _unit([0.0, 1.0], [1.0, 0.0], [0.8, 0.6])  # row 0 gave two, row 1 one: all in every denominator
    tau = 0.5
    e = lambda s: math.exp(s / tau)  # noqa: E731
    l1 = -math.log(e(1) / (e(1) + e(0.6) + e(0) + e(1) + e(0.8) + e(0)))
    l2 = -math.log(e(0.8) / (e(0) + e(0.8) + e(1) + e(0) + e(0.6) + e(0)))
    assert infonce(q, pos, neg, tau=tau).item() == pytest.approx((l1 + l2) / 2, rel=1e-9)
