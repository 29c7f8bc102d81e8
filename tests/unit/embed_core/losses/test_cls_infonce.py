"""Classification InfoNCE with the label mask (QZhou Eq. 3) against hand-computed values."""

import math

import pytest
import torch

from embed_core.losses.cls_infonce import ClassificationInfoNCE, classification_infonce
from tests.helpers.loss_calls import call_loss


def _unit(*xs):
    t = torch.tensor(xs, dtype=torch.float64)
    return t / t.norm(dim=-1, keepdim=True)


T = _unit([1.0, 0.0], [0.0, 1.0])
POS = _unit([0.8, 0.6], [0.6, 0.8])
NEG = _unit([0.0, 1.0], [1.0, 0.0]).view(2, 1, 2)
E = lambda s: math.exp(s)  # noqa: E731  (tau = 1)


def test_cls_loss_masks_other_rows_negatives_of_the_same_class():
    labels = torch.tensor([0, 1])
    neg_labels = torch.tensor([[1], [0]])  # each row's negative is the other class
    # row 0 (class 0): pos 0.8; own neg (class 1) 0; other text t1 (class 1) 0; t_{1,0}- is class 0 -> masked
    l0 = -math.log(E(0.8) / (E(0.8) + E(0) + E(0)))
    # row 1 (class 1): pos 0.8; own neg (class 0) 0; t0 (class 0) 0; t_{0,0}- is class 1 -> masked
    l1 = -math.log(E(0.8) / (E(0.8) + E(0) + E(0)))
    got = classification_infonce(T, POS, NEG, labels, neg_labels, tau=1.0).item()
    assert got == pytest.approx((l0 + l1) / 2, rel=1e-9)


def test_same_label_collision_masks_the_other_text():
    """Two texts of one class in a batch: neither is the other's negative."""
    labels = torch.tensor([5, 5])
    neg_labels = torch.tensor([[2], [3]])
    l0 = -math.log(E(0.8) / (E(0.8) + E(0) + E(1)))  # own neg 0, other row's neg 1; t1 masked
    l1 = -math.log(E(0.8) / (E(0.8) + E(0) + E(1)))  # own neg 0, other row's neg (1,0)·(0,1)... = 1
    got = call_loss(ClassificationInfoNCE(ClassificationInfoNCE.Params(tau=1.0)),
                    {"query": T, "positive": POS, "negative": NEG}, task="classification",
                    num_negatives=2, labels=labels.tolist(), negative_labels=neg_labels.flatten().tolist()).item()
    assert got == pytest.approx((l0 + l1) / 2, rel=1e-9)
    unmasked = classification_infonce(T, POS, NEG, torch.tensor([5, 6]), neg_labels, tau=1.0).item()
    assert unmasked > got  # without the collision the other text adds to the denominator


def test_unknown_negative_labels_are_never_masked():
    labels = torch.tensor([0, 1])
    neg_labels = torch.tensor([[-1], [-1]])
    l0 = -math.log(E(0.8) / (E(0.8) + E(0) + E(0) + E(1)))
    l1 = -math.log(E(0.8) / (E(0.8) + E(0) + E(0) + E(1)))
    got = classification_infonce(T, POS, NEG, labels, neg_labels, tau=1.0).item()
    assert got == pytest.approx((l0 + l1) / 2, rel=1e-9)
