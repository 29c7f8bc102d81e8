"""CoDiEmb losses (Eqs. 2, 4, 6, 7) against values computed by hand, ties included."""

import math

import pytest
import torch

from embed_core.losses.codiemb_sts import (
    CoDiEmbSTS,
    average_ranks_desc,
    codiemb_sts,
    pearson_loss,
    pro_loss,
    rank_kl_loss,
)
from embed_core.losses.multi_positive_infonce import MultiPositiveInfoNCE, multi_positive_infonce
from tests.helpers.loss_calls import call_loss


def test_multi_positive_infonce_by_hand():
    tau = 0.5
    q = [[1.0, 0.0], [0.0, 1.0]]
    pos = [[[0.8, 0.6], [0.6, 0.8]], [[0.0, 1.0], [1.0, 0.0]]]  # K+ = 2 each
    neg = [[0.6, -0.8]]
    e = lambda x, y: math.exp(sum(a * b for a, b in zip(x, y)) / tau)  # noqa: E731
    total = 0.0
    for i in range(2):
        z_plus = sum(e(q[i], d) for j in range(2) if j != i for d in pos[j])  # other queries' positives only
        z_minus = sum(e(q[i], d) for d in neg)
        for c in range(2):
            own = e(q[i], pos[i][c])
            total += -math.log(own / (own + z_plus + z_minus))  # the other own positive is in no denominator
    expected = total / 2
    t = torch.tensor
    assert float(multi_positive_infonce(t(q), t(pos), t(neg), tau=tau)) == pytest.approx(expected, rel=1e-6)
    loss = MultiPositiveInfoNCE(MultiPositiveInfoNCE.Params(tau=tau, num_positives=2))
    flat_pos = t(pos).reshape(-1, t(pos).size(-1))  # the batch layout: K+ positives per query, in query order
    got = call_loss(loss, {"query": t(q), "positive": flat_pos, "negative": t(neg)})
    assert float(got) == pytest.approx(expected, rel=1e-6)


def test_pearson_by_hand():
    pred, gold = [0.9, 0.5, 0.1, 0.4], [5.0, 3.0, 0.0, 3.0]
    mp, mg = sum(pred) / 4, sum(gold) / 4
    cov = sum((p - mp) * (g - mg) for p, g in zip(pred, gold)) / 4
    sp = math.sqrt(sum((p - mp) ** 2 for p in pred) / 4)
    sg = math.sqrt(sum((g - mg) ** 2 for g in gold) / 4)
    # float64: the loss is 1 - r with r near 1, so float32's rounding of r is a 3e-6 relative error on
    # the loss, and which one depends on the CPU's vector width
    got = pearson_loss(torch.tensor(pred, dtype=torch.float64), torch.tensor(gold, dtype=torch.float64))
    assert float(got) == pytest.approx(1 - cov / (sp * sg), rel=1e-9)
    assert float(pearson_loss(torch.tensor(pred), torch.tensor([2.0] * 4))) == 0.0  # all labels equal


def test_rank_kl_with_ties_by_hand():
    tau = 0.5
    pred, gold = [0.9, 0.5, 0.1, 0.4], [5.0, 3.0, 0.0, 3.0]
    # descending ranks: 5.0 -> 0; the two 3.0 share ranks 1 and 2 -> 1.5; 0.0 -> 3
    assert average_ranks_desc(torch.tensor(gold)).tolist() == [0.0, 1.5, 3.0, 1.5]
    y = [(3 - r) / 3 for r in (0.0, 1.5, 3.0, 1.5)]  # [1, 0.5, 0, 0.5]
    zp = sum(math.exp(v / tau) for v in y)
    p = [math.exp(v / tau) / zp for v in y]
    zq = sum(math.exp(v / tau) for v in pred)
    qd = [math.exp(v / tau) / zq for v in pred]
    expected = sum(pi * math.log(pi / qi) for pi, qi in zip(p, qd))
    got = rank_kl_loss(torch.tensor(pred, dtype=torch.float64), torch.tensor(gold, dtype=torch.float64), tau=tau)
    assert float(got) == pytest.approx(expected, rel=1e-9)


def test_pro_with_ties_by_hand():
    tau = 0.5
    pred, gold = [0.9, 0.5, 0.1, 0.4], [5.0, 3.0, 0.0, 3.0]
    # sorted by gold desc (stable): items 0 (5), 1 (3), 3 (3), 2 (0)
    ys, ss = [5.0, 3.0, 3.0, 0.0], [0.9, 0.5, 0.4, 0.1]
    losses = []
    for i in range(3):
        later = [(ys[i] - ys[j], ss[j]) for j in range(i + 1, 4) if ys[i] - ys[j] > 1e-8]  # tie 3.0/3.0 left out
        if not later:
            continue
        anchor = ss[i] * max(g for g, _ in later) / tau
        denom = math.exp(anchor) + sum(math.exp(s * g / tau) for g, s in later)
        losses.append(-(anchor - math.log(denom)))
    assert len(losses) == 3  # anchors 5.0, 3.0 (vs 0.0 only), 3.0 (vs 0.0)
    expected = sum(losses) / len(losses)
    assert float(pro_loss(torch.tensor(pred), torch.tensor(gold), tau=tau)) == pytest.approx(expected, rel=1e-6)
    # all gold scores tied: no anchor has a lower item
    assert float(pro_loss(torch.tensor(pred), torch.tensor([1.0] * 4), tau=tau)) == 0.0


def test_sts_combination_uses_the_papers_weights():
    pred, gold = torch.tensor([0.9, 0.5, 0.1, 0.4]), torch.tensor([5.0, 3.0, 0.0, 3.0])
    out = codiemb_sts(pred, gold, tau=0.05)
    expected = 2 * out["pearson"] + 5 * out["rank_kl"] + 0.5 * out["pro"]
    assert float(out["loss"]) == pytest.approx(float(expected))
    a = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    b = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    got = call_loss(CoDiEmbSTS(), {"a": a, "b": b}, task="sts", scores=gold.tolist())
    assert float(got) == pytest.approx(float(codiemb_sts((a * b).sum(-1), gold)["loss"]))
    with pytest.raises(ValueError):
        CoDiEmbSTS.Params(rank_kl_weight=-1.0)
