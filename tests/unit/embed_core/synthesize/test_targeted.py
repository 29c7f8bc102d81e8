"""Error-driven synthesis (``embed_core.synthesize.targeted``): which dev records count as the
model's failures, and which training records they select, on hand-placed embeddings (each text's
vector is written down, so every rank, error and centroid below is computed by hand)."""

import numpy as np

from embed_core.schema import Record
from embed_core.synthesize.config import TargetedConfig
from embed_core.synthesize.targeted import (classification_failures, failures_of, pair_failures,
                                            retrieval_failures, select_records)


def _embedder(vectors: dict[str, list[float]]):
    def embed(texts):
        out = np.array([vectors[t] for t in texts], dtype=np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)
    return embed


def _rec(id_, task, query, positives=(), negatives=(), scores=(), label=None, dataset="d"):
    return Record(id=id_, dataset=dataset, task=task, query=query, positives=list(positives),
                  negatives=list(negatives), positive_scores=list(scores), label=label)


def test_a_retrieval_dev_query_fails_when_its_positive_ranks_at_k_or_below():
    embed = _embedder({"q-good": [1, 0], "q-bad": [0, 1], "p-good": [1, 0.1], "p-bad": [1, 0.2],
                       "other1": [0.1, 1], "other2": [0.2, 1]})
    dev = [_rec("good", "retrieval", "q-good", ["p-good"], ["other1"]),
           _rec("bad", "retrieval", "q-bad", ["p-bad"], ["other2"])]
    # q-bad = (0, 1): other1 and other2 score ~0.99, p-good ~0.1, p-bad ~0.2 -> its positive ranks 3rd (rank 2)
    failures = retrieval_failures("d", dev, embed, k=2)
    assert [(f.dev_id, f.severity) for f in failures] == [("bad", 2.0)]
    assert failures[0].detail == "first positive at rank 3" and failures[0].text == "q-bad"
    assert retrieval_failures("d", dev, embed, k=3) == []


def test_sts_pairs_are_ranked_by_the_distance_of_their_cosine_from_the_scaled_gold_score():
    embed = _embedder({"a": [1, 0], "a2": [1, 0], "b": [1, 0], "b2": [0, 1], "c": [1, 0], "c2": [1, 1]})
    dev = [_rec("same-said-same", "sts", "a", ["a2"], scores=[5.0]),       # cos 1, gold 1   -> error 0
           _rec("same-said-apart", "sts", "b", ["b2"], scores=[5.0]),      # cos 0, gold 1   -> error 1
           _rec("apart-said-close", "sts", "c", ["c2"], scores=[0.0])]     # cos .707, gold 0 -> error .707
    cfg = TargetedConfig(datasets=["d"], failures=2)
    worst = failures_of("d", dev, [], embed, cfg)
    assert [f.dev_id for f in worst] == ["same-said-apart", "apart-said-close"]
    assert np.isclose(worst[1].severity, 2 ** -0.5, atol=1e-6)
    assert {f.dev_id: round(f.severity, 6) for f in pair_failures("d", dev, embed)}["same-said-same"] == 0


def test_a_classification_dev_text_fails_when_another_labels_centroid_is_nearer():
    embed = _embedder({"t1": [1, 0], "t2": [1, 0.2], "u1": [0, 1], "u2": [0.2, 1], "right": [1, 0.1],
                       "wrong": [0.1, 1]})
    train = [_rec("t1", "classification", "t1", label="A"), _rec("t2", "classification", "t2", label="A"),
             _rec("u1", "classification", "u1", label="B"), _rec("u2", "classification", "u2", label="B")]
    dev = [_rec("ok", "classification", "right", label="A"), _rec("confused", "classification", "wrong", label="A")]
    failures = classification_failures("d", dev, train, embed)
    assert [f.dev_id for f in failures] == ["confused"]
    assert failures[0].detail == "labelled A, nearest centroid B" and failures[0].severity > 0


def test_failures_select_their_nearest_training_records_in_turns_within_the_budget_never_a_dev_text():
    embed = _embedder({"fail-a": [1, 0, 0], "fail-b": [0, 1, 0], "near-a": [1, 0.1, 0], "next-a": [1, 0.3, 0],
                       "near-b": [0, 1, 0.1], "next-b": [0, 1, 0.3], "far": [0, 0, 1], "dev copy": [1, 0, 0]})
    from embed_core.synthesize.targeted import Failure

    failures = [Failure("a", "retrieval", "da", "fail-a", 30.0, ""), Failure("b", "sts", "db", "fail-b", 0.4, "")]
    train = {"a": [_rec(n, "retrieval", n, dataset="a") for n in ("far", "next-a", "dev copy", "near-a")],
             "b": [_rec(n, "sts", n, dataset="b") for n in ("next-b", "near-b", "far")]}
    cfg = TargetedConfig(datasets=["a", "b"], neighbours=2, max_records=3)
    chosen = select_records(failures, train, {"dev copy"}, embed, cfg)
    # round 1: each dataset's worst failure takes its nearest; round 2: the next nearest until the budget
    assert [(f.dev_id, r.id) for f, r in chosen] == [("da", "near-a"), ("db", "near-b"), ("da", "next-a")]
    everything = select_records(failures, train, {"dev copy"}, embed, cfg.model_copy(update={"max_records": 10}))
    assert "dev copy" not in {r.id for _, r in everything} and len(everything) == 4
