"""Cosine regression for scored pairs (sentence-transformers' ``CosineSimilarityLoss``; Reimers &
Gurevych 2019, SBERT §3 "Regression Objective Function").

    L = 1/n Σ_i ( cos(u_i, v_i) − y_i / y_max )²

the mean squared error between each pair's cosine similarity and its gold score scaled to [0, 1]
(``y_max``: the ``score_max`` parameter, else the largest score of the dataset — 5 for STS-B).
Unlike CoSENT, the absolute value of the score matters: a pair scored 2.5/5 is pulled to cosine 0.5.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext, LossParams


def cosine_regression(a: Tensor, b: Tensor, targets: Tensor) -> Tensor:
    """a, b: [n, d] normalised (pair i is (a_i, b_i)); targets: [n] in [0, 1]."""
    cos = (a * b).sum(dim=-1)
    return ((cos - targets.to(cos.dtype)) ** 2).mean()


class CosineRegression(Loss):
    """SBERT's regression objective (per-rank)."""

    name = "cosine_regression"
    tasks = ("sts", "nli", "pair_classification")
    default_for = ()

    class Params(LossParams):
        score_max: float | None = Field(None, gt=0, description="Gold score that maps to cosine 1 (scores are "
                                        "divided by it); None = the dataset's largest score.")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        top = self.params.score_max or batch.max_score
        targets = torch.tensor(batch.scores, device=emb["a"].device, dtype=torch.float32) / top
        return cosine_regression(emb["a"], emb["b"], targets)
