"""Matryoshka loss (sentence-transformers' MatryoshkaLoss semantics) against hand-computed values."""

import math

import pytest
import torch

from embed_core.losses.infonce import InfoNCE
from embed_core.losses.matryoshka import Matryoshka, truncate
from tests.helpers.loss_calls import call_loss


def _emb():
    t = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731 — unit rows already
    return {"query": t([1.0, 0.0, 0.0, 0.0], [0.0, 0.6, 0.8, 0.0]),
            "positive": t([0.6, 0.0, 0.0, 0.8], [0.0, 0.8, 0.6, 0.0])}


def test_matryoshka_loss_is_the_weighted_sum_of_the_loss_on_cut_and_renormalised_embeddings():
    loss = InfoNCE(InfoNCE.Params(tau=1.0, query_negatives=False))
    # 4 dims: q1·p1 = 0.6, q1·p2 = 0, q2·p1 = 0, q2·p2 = 0.96
    full = (math.log(1 + math.exp(-0.6)) + math.log(1 + math.exp(-0.96))) / 2
    # 2 dims, renormalised: q1 = p1 = (1, 0), q2 = p2 = (0, 1): similarity 1 to its positive, 0 to the other
    cut = math.log(1 + math.exp(-1.0))
    mrl = Matryoshka(loss, dims=[4, 2], weights=[1.0, 0.5])
    assert call_loss(mrl, _emb()).item() == pytest.approx(full + 0.5 * cut, rel=1e-12)
    assert call_loss(loss, _emb()).item() == pytest.approx(full, rel=1e-12)  # the wrapped loss, untouched


def test_a_cut_embedding_is_unit_length_and_the_full_size_passes_through_unchanged():
    emb = _emb()
    cut = truncate(emb, 2, 4)
    assert torch.allclose(cut["query"], torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64))
    assert truncate(emb, 4, 4) is emb


def test_the_matryoshka_gradient_reaches_the_full_embedding_through_every_cut():
    emb = {k: v.clone().requires_grad_() for k, v in _emb().items()}
    call_loss(Matryoshka(InfoNCE(InfoNCE.Params(tau=1.0)), dims=[2], weights=[1.0]), emb).backward()
    # only the first 2 coordinates enter the 2-dim loss: the others get no gradient
    assert emb["query"].grad[:, 2:].abs().sum() == 0 and emb["query"].grad[:, :2].abs().sum() > 0
