"""CoSENT for scored pairs (QZhou-Embedding Eq. 2; Su 2022).

    L = log( 1 + Σ_{y(i,j) > y(k,l)} exp( (s(x_k,x_l) − s(x_i,x_j)) / τ ) )

over all ordered pairs of pairs in the batch whose gold scores differ (s: cosine similarity).
QZhou uses it for STS scores and for entailment labels mapped to ordinal scores (entailment 2 >
neutral 1 > contradiction 0). Only the order of the gold scores matters. τ = 0.05 (scale 20) is
CoSENT's and sentence-transformers' default.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext, LossParams


def rank_pairs(sim: Tensor, scores: Tensor) -> Tensor:
    """CoSENT's ranking term for any (already scaled) pair similarity ``sim`` [n]:
    log(1 + Σ_{y_p > y_q} exp(s_q − s_p))."""
    diff = sim[None, :] - sim[:, None]  # diff[p, q] = s_q − s_p ; a term where y_p > y_q
    mask = scores[:, None] > scores[None, :]
    diff = diff.masked_fill(~mask, float("-inf"))
    zero = torch.zeros(1, dtype=diff.dtype, device=diff.device)  # the "1 +" inside the log
    return torch.logsumexp(torch.cat([zero, diff.flatten()]), dim=0)


def cosent(a: Tensor, b: Tensor, scores: Tensor, *, tau: float = 0.05) -> Tensor:
    """a, b: [n, d] (pair i is (a_i, b_i)); scores: [n] gold scores."""
    return rank_pairs((a * b).sum(dim=-1) / tau, scores)


class CoSENT(Loss):
    """QZhou's loss for scored pairs (STS, NLI, pair classification; per-rank)."""

    name = "cosent"
    tasks = ("sts", "nli", "pair_classification")
    default_for = ("sts", "nli", "pair_classification")

    class Params(LossParams):
        tau: float = Field(0.05, gt=0, description="Temperature τ (0.05 = scale 20, CoSENT's default).")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        scores = torch.tensor(batch.scores, device=emb["a"].device, dtype=torch.float32)
        return cosent(emb["a"], emb["b"], scores, tau=self.params.tau)
