"""The distillation losses margin_mse and listwise_kl against hand-computed values, and what they
need of a batch (teacher scores; a missing one is one line)."""

import math

import pytest
import torch

from embed_core.errors import ConfigError
from embed_core.losses import LossContext, loss_for
from embed_core.losses.listwise_kl import ListwiseKL
from embed_core.losses.margin_mse import MarginMSE
from embed_core.losses.batch import TaskBatch, TextGroup


def _unit(*xs):
    t = torch.tensor(xs, dtype=torch.float64)
    return t / t.norm(dim=-1, keepdim=True)


# query 1 has two hard negatives, query 2 one (rows may have fewer)
Q = _unit([1.0, 0.0], [0.0, 1.0])
POS = _unit([0.8, 0.6], [0.6, 0.8])  # student: .8, .8
NEG = _unit([0.6, 0.8], [0.0, 1.0], [1.0, 0.0])  # student: q1 .6, q1 0, q2 0
T_POS, T_NEG, OWNERS = [5.0, 3.0], [4.0, 1.0, 2.0], [0, 0, 1]


def _batch(**fields):
    texts = {"query": ["q1", "q2"], "positive": ["p1", "p2"], "negative": ["n1", "n2", "n3"]}
    groups = {name: TextGroup(ts, [None] * len(ts), 32) for name, ts in texts.items()}
    base = dict(num_negatives=3, negative_owners=OWNERS, positive_scores=T_POS, negative_scores=T_NEG)
    return TaskBatch("retrieval", "d", groups, **(base | fields))


EMB = {"query": Q, "positive": POS, "negative": NEG}


def test_margin_mse_equals_the_hand_computed_mean_squared_margin_difference():
    scale = 10.0
    # (student margin × λ, teacher margin) per pair: (.8-.6)·10 vs 5-4, (.8-0)·10 vs 5-1, (.8-0)·10 vs 3-2
    expected = ((2.0 - 1.0) ** 2 + (8.0 - 4.0) ** 2 + (8.0 - 1.0) ** 2) / 3
    got = MarginMSE(MarginMSE.Params(scale=scale))(EMB, _batch(), LossContext())
    assert float(got) == pytest.approx(expected, rel=1e-6)


def test_listwise_kl_equals_the_hand_computed_divergence_over_each_querys_own_list():
    temperature, tau = 2.0, 0.5

    def softmax(xs):
        z = sum(math.exp(x) for x in xs)
        return [math.exp(x) / z for x in xs]

    def kl(teacher, student):
        p, q = softmax([t / temperature for t in teacher]), softmax([s / tau for s in student])
        return sum(a * math.log(a / b) for a, b in zip(p, q))

    expected = (kl([5.0, 4.0, 1.0], [0.8, 0.6, 0.0]) + kl([3.0, 2.0], [0.8, 0.0])) / 2
    got = ListwiseKL(ListwiseKL.Params(temperature=temperature, tau=tau))(EMB, _batch(), LossContext())
    assert float(got) == pytest.approx(expected, rel=1e-6)


def test_infonce_weight_adds_the_infonce_term_beside_the_distillation_loss():
    plain = loss_for("retrieval", {"name": "listwise_kl"})
    beside = loss_for("retrieval", {"name": "listwise_kl", "infonce_weight": 0.5, "infonce_tau": 0.1})
    infonce = loss_for("retrieval", {"name": "infonce", "tau": 0.1})
    expected = float(plain(EMB, _batch(), LossContext())) + 0.5 * float(infonce(EMB, _batch(), LossContext()))
    assert float(beside(EMB, _batch(), LossContext())) == pytest.approx(expected, rel=1e-9)


def test_a_negative_without_a_teacher_score_is_one_line_naming_the_dataset():
    with pytest.raises(ConfigError, match=r"dataset 'd': loss margin_mse needs a teacher score .* mine.teacher"):
        MarginMSE()(EMB, _batch(negative_scores=[4.0, math.nan, 2.0]), LossContext())


def test_a_retrieval_batch_carries_the_stored_scores_of_the_drawn_positive_and_of_each_own_negative():
    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords, build_batch

    recs = [Record(id="d:0", dataset="d", task="retrieval", query="q0", positives=["p0"], positive_scores=[9.0],
                   negatives=["a", "b", "c"], negative_scores=[1.0, 2.0, 3.0], source_ref="f:0"),
            Record(id="d:1", dataset="d", task="retrieval", query="q1", positives=["p1"], negatives=["x"],
                   source_ref="f:1")]  # no scores stored: NaN (a distillation loss refuses it)
    batch = build_batch(DatasetRecords("d", records_to_table(recs)), [0, 1], step=0, seed=0, num_negatives=2,
                        query_max_length=16, passage_max_length=16, use_instructions=False)
    texts = batch.groups["negative"].texts
    assert batch.negative_owners == [0, 0, 1] and texts[2] == "x"
    assert batch.negative_scores[:2] == [{"a": 1.0, "b": 2.0, "c": 3.0}[t] for t in texts[:2]]
    assert math.isnan(batch.negative_scores[2]) and batch.positive_scores[0] == 9.0
    assert math.isnan(batch.positive_scores[1]) and batch.scores == [9.0, 1.0]  # graded targets default to 1
