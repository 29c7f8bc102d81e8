"""False negatives out of the InfoNCE-family denominators (embed_core.losses.false_negatives):
duplicates of a positive and candidates above the positive + margin, against hand-computed losses."""

import math

import pytest
import torch

from embed_core.losses import LossContext
from embed_core.losses.cls_infonce import ClassificationInfoNCE
from embed_core.losses.infonce import InfoNCE
from embed_core.losses.multi_positive_infonce import MultiPositiveInfoNCE
from embed_core.losses.batch import TaskBatch, TextGroup


def _unit(*xs):
    t = torch.tensor(xs, dtype=torch.float64)
    return t / t.norm(dim=-1, keepdim=True)


def _batch(task="retrieval", **texts):
    groups = {name: TextGroup(list(ts), [None] * len(ts), 32) for name, ts in texts.items()}
    return TaskBatch(task, "d", groups, num_negatives=len(texts.get("negative", ())))


def _nll(target, others, tau):
    e = lambda s: math.exp(s / tau)  # noqa: E731
    return -math.log(e(target) / (e(target) + sum(e(s) for s in others)))


Q = _unit([1.0, 0.0], [0.0, 1.0])
POS = _unit([0.8, 0.6], [0.6, 0.8])
NEG = _unit([0.6, 0.8], [1.0, 0.0])  # the first hard negative is a copy of query 2's positive


def test_a_hard_negative_that_duplicates_a_positive_is_left_out_of_that_querys_denominator():
    tau = 0.5
    batch = _batch(query=["q1", "q2"], positive=["p1", "p2"], negative=["p2", "n"])
    ctx = LossContext()
    got = InfoNCE(InfoNCE.Params(tau=tau))({"query": Q, "positive": POS, "negative": NEG}, batch, ctx)
    # query 1: p1 .8 (target), p2 .6, n1 .6, n2 1, q2 0 — all in; query 2: p2 .8 (target), p1 .6,
    # n1 = "p2" (its positive's text: left out), n2 0, q1 0
    l1 = _nll(0.8, [0.6, 0.6, 1.0, 0.0], tau)
    l2 = _nll(0.8, [0.6, 0.0, 0.0], tau)
    assert float(got) == pytest.approx((l1 + l2) / 2, rel=1e-9)
    assert ctx.counts == {"masked_duplicates": 1, "masked_margin": 0, "masked_guide": 0}


def test_two_queries_with_the_same_positive_do_not_push_it_away_from_each_other():
    tau = 0.5
    batch = _batch(query=["q1", "q2"], positive=["same", "same"])
    ctx = LossContext()
    pos = _unit([0.8, 0.6], [0.8, 0.6])
    got = InfoNCE(InfoNCE.Params(tau=tau, query_negatives=False))({"query": Q, "positive": pos}, batch, ctx)
    assert float(got) == pytest.approx((_nll(0.8, [], tau) + _nll(0.6, [], tau)) / 2, rel=1e-9)
    assert ctx.counts["masked_duplicates"] == 2
    unmasked = InfoNCE(InfoNCE.Params(tau=tau, query_negatives=False, mask_duplicate_texts=False))
    expected = (_nll(0.8, [0.8], tau) + _nll(0.6, [0.6], tau)) / 2
    assert float(unmasked({"query": Q, "positive": pos}, batch, LossContext())) == pytest.approx(expected, rel=1e-9)


def test_the_margin_rule_masks_exactly_the_candidates_above_the_positive_plus_margin():
    tau, margin = 0.5, 0.1
    q = _unit([1.0, 0.0], [0.0, 1.0])
    pos = _unit([0.6, 0.8], [0.6, 0.8])  # scores .6 and .8
    neg = _unit([1.0, 0.0], [0.8, 0.6], [0.0, 1.0])  # to q1: 1, .8, 0; to q2: 0, .6, 1
    batch = _batch(query=["q1", "q2"], positive=["p1", "p2"], negative=["a", "b", "c"])
    ctx = LossContext()
    loss = InfoNCE(InfoNCE.Params(tau=tau, query_negatives=False, false_negative_margin=margin))
    got = loss({"query": q, "positive": pos, "negative": neg}, batch, ctx)
    # q1: positive .6, threshold .7: p2 .6 stays; a 1 and b .8 go; c 0 stays
    # q2: positive .8, threshold .9: p1 .8 stays; a 0, b .6 stay; c 1 goes
    l1 = _nll(0.6, [0.6, 0.0], tau)
    l2 = _nll(0.8, [0.8, 0.0, 0.6], tau)
    assert float(got) == pytest.approx((l1 + l2) / 2, rel=1e-9)
    assert ctx.counts == {"masked_duplicates": 0, "masked_margin": 3, "masked_guide": 0}


def test_classification_leaves_out_another_class_text_equal_to_the_positive():
    tau = 0.5
    t = _unit([1.0, 0.0], [0.0, 1.0])
    pos = _unit([0.8, 0.6], [0.6, 0.8])
    neg = _unit([0.8, 0.6], [0.0, 1.0])  # the first negative is t1's positive under another label
    batch = _batch("classification", query=["t1", "t2"], positive=["p1", "p2"], negative=["p1", "x"])
    batch.labels, batch.negative_labels = [0, 1], [1, 0]
    ctx = LossContext()
    got = ClassificationInfoNCE(ClassificationInfoNCE.Params(tau=tau))(
        {"query": t, "positive": pos, "negative": neg}, batch, ctx)
    # t1 (class 0): "p1" (its positive's text) out by text, "x" (class 0) out by label, t2 0 in
    # t2 (class 1): "p1" (class 1) out by label, "x" 1 in, t1 0 in
    l1 = _nll(0.8, [0.0], tau)
    l2 = _nll(0.8, [1.0, 0.0], tau)
    assert float(got) == pytest.approx((l1 + l2) / 2, rel=1e-9)
    assert ctx.counts["masked_duplicates"] == 1


def test_multi_positive_leaves_out_another_querys_positive_equal_to_one_of_its_own():
    tau = 0.5
    q = [[1.0, 0.0], [0.0, 1.0]]
    pos = [[[0.8, 0.6], [0.6, 0.8]], [[0.0, 1.0], [0.6, 0.8]]]  # both have "shared" as second positive
    neg = [[0.6, -0.8]]
    batch = _batch(query=["q1", "q2"], positive=["a", "shared", "b", "shared"], negative=["n"])
    ctx = LossContext()
    t = torch.tensor
    loss = MultiPositiveInfoNCE(MultiPositiveInfoNCE.Params(tau=tau, num_positives=2))
    got = loss({"query": t(q), "positive": t(pos).reshape(4, 2), "negative": t(neg)}, batch, ctx)
    dot = lambda x, y: sum(a * b for a, b in zip(x, y))  # noqa: E731
    total = 0.0
    for i in range(2):
        others = [dot(q[i], d) for d in pos[1 - i][:1]] + [dot(q[i], d) for d in neg]  # "shared" left out
        total += sum(_nll(dot(q[i], pos[i][c]), others, tau) for c in range(2))
    assert float(got) == pytest.approx(total / 2, rel=1e-6)
    assert ctx.counts["masked_duplicates"] == 2


def test_a_guide_model_leaves_out_exactly_the_candidates_it_scores_above_the_positive(tiny_model):
    from embed_core.losses.false_negatives import guide_encoder

    tau = 0.5
    texts = {"query": ["a cat on a mat", "stock prices fell"], "positive": ["a kitten sleeping", "markets dropped"],
             "negative": ["a cat on a mat", "the weather is fine", "shares went down today"]}  # a copy of query 1
    g = {name: torch.from_numpy(guide_encoder(str(tiny_model), "mean").encode(ts)).double()
         for name, ts in texts.items()}
    # the trained model's embeddings: anything (here random); only the guide decides what is left out
    emb = {name: torch.nn.functional.normalize(torch.randn(len(ts), 4, dtype=torch.float64, generator=torch.Generator()
                                                           .manual_seed(i)), dim=-1)
           for i, (name, ts) in enumerate(texts.items())}
    loss = InfoNCE(InfoNCE.Params(tau=tau, query_negatives=False, mask_duplicate_texts=False,
                                  guide_model=str(tiny_model)))
    ctx = LossContext()
    got = loss(emb, _batch(**texts), ctx)
    docs = torch.cat([emb["positive"], emb["negative"]])
    g_docs = torch.cat([g["positive"], g["negative"]])
    expected, masked = 0.0, 0
    for i in range(2):
        s, gs = emb["query"][i] @ docs.T, g["query"][i] @ g_docs.T
        keep = [j for j in range(5) if j != i and not gs[j] > gs[i]]
        masked += 4 - len(keep)
        expected += _nll(float(s[i]), [float(s[j]) for j in keep], tau) / 2
    assert masked >= 1  # query 1's own text among the negatives: the guide scores it 1, above any positive
    assert float(got) == pytest.approx(expected, rel=1e-6)
    assert ctx.counts == {"masked_duplicates": 0, "masked_margin": 0, "masked_guide": masked}
