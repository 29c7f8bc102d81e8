"""HMCL (Eqs. 11–17) and ListMLE against values computed by hand."""

import math

import pytest
import torch

from embed_core.losses.hmcl import HMCL, HMCLHead, hmcl, listmle
from tests.helpers.loss_calls import call_loss


def test_listmle_is_the_negative_log_permutation_likelihood():
    s = [2.0, 0.5, -1.0]
    e = [math.exp(x) for x in s]
    p = e[0] / sum(e) * e[1] / (e[1] + e[2]) * e[2] / e[2]
    assert float(listmle(torch.tensor([s]))) == pytest.approx(-math.log(p), rel=1e-6)


def _cos(x, y):
    return sum(a * b for a, b in zip(x, y))


def test_hmcl_total_with_the_papers_weights_by_hand():
    tau = 0.5  # a large τ keeps the hand computation well-conditioned; the code path is the same
    q = [[1.0, 0.0], [0.0, 1.0]]
    p = [[0.8, 0.6], [0.6, 0.8]]
    w = [[0.6, 0.8], [1.0, 0.0]]
    n = [[0.0, 1.0], [0.0, 0.0]]  # second query has no hard negative
    has_neg = [True, False]
    e = lambda x, y: math.exp(_cos(x, y) / tau)  # noqa: E731
    lc = ll = 0.0
    for i in range(2):
        j = 1 - i
        neg = e(q[i], n[i]) if has_neg[i] else 0.0
        z2 = neg + e(q[i], q[j]) + e(q[i], p[0]) + e(q[i], p[1])
        lc += -math.log(e(q[i], p[i]) / z2)
        z1 = e(q[i], w[i]) + neg + e(q[i], q[j]) + e(q[i], p[j]) + e(q[i], w[j]) + e(p[i], p[j])
        ll += -math.log(e(q[i], p[i]) / (e(q[i], p[i]) + z1) * e(q[i], w[i]) / z1)
    lc, ll = lc / 2, ll / 2
    # L_e with the head's initial affine map z = (s/τ)·(1, 0, −1) + 0
    def ce(sim, level):
        logits = [sim / tau, 0.0, -sim / tau]
        return -(logits[level] - math.log(sum(math.exp(x) for x in logits)))
    pos_ce = (ce(_cos(q[0], p[0]), 0) + ce(_cos(q[1], p[1]), 0)) / 2
    weak_ce = (ce(_cos(q[0], w[0]), 1) + ce(_cos(q[1], w[1]), 1)) / 2
    neg_pairs = [_cos(q[0], n[0]), _cos(q[0], p[1]), _cos(q[1], p[0])]  # own hard negative + in-batch (q_i, p_j)
    neg_ce = sum(ce(s, 2) for s in neg_pairs) / len(neg_pairs)
    le = (pos_ce + weak_ce + 0.1 * neg_ce) / 2
    expected = 2.0 * lc + 1.0 * ll + 0.2 * le

    t = lambda x: torch.tensor(x)  # noqa: E731
    out = hmcl(t(q), t(p), t(w), t(n), torch.tensor(has_neg), head=HMCLHead(), tau=tau)
    assert float(out["L_c"]) == pytest.approx(lc, rel=1e-5)
    assert float(out["L_l"]) == pytest.approx(ll, rel=1e-5)
    assert float(out["L_e"].detach()) == pytest.approx(le, rel=1e-5)
    assert float(out["loss"].detach()) == pytest.approx(expected, rel=1e-5)
    rows = [i for i, has in enumerate(has_neg) if has]  # the batch carries only the rows' real negatives
    emb = {"query": t(q), "positive": t(p), "weak": t(w), "negative": t(n)[rows]}
    loss = call_loss(HMCL(HMCL.Params(tau=tau)), emb, negative_rows=rows).detach()
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_hmcl_prefers_the_three_level_order():
    """The loss is lower when s(q,p) > s(q,w) > s(q,n) than with positive and weak swapped."""
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    near, mid, far = [0.95, 0.312], [0.6, 0.8], [0.0, 1.0]
    good = hmcl(q, torch.tensor([near, near[::-1]]), torch.tensor([mid, mid[::-1]]), torch.tensor([far, far[::-1]]),
                head=HMCLHead())["L_l"]
    bad = hmcl(q, torch.tensor([mid, mid[::-1]]), torch.tensor([near, near[::-1]]), torch.tensor([far, far[::-1]]),
               head=HMCLHead())["L_l"]
    assert float(good) < float(bad)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        HMCL.Params(tau=0)
    with pytest.raises(ValueError):
        HMCL.Params(mu_c=-1)
