"""CoSENT for scored pairs (QZhou-Embedding Eq. 2; Su 2022).

    L = log( 1 + Σ_{y(i,j) > y(k,l)} exp( (s(x_k,x_l) − s(x_i,x_j)) / τ ) )

over all ordered pairs of pairs in the batch whose gold scores differ (s: cosine similarity).
QZhou uses it for STS scores and for entailment labels mapped to ordinal scores (entailment 2 >
neutral 1 > contradiction 0). Only the order of the gold scores matters. τ = 0.05 (scale 20) is
CoSENT's and sentence-transformers' default.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def cosent(a: Tensor, b: Tensor, scores: Tensor, *, tau: float = 0.05) -> Tensor:
    """a, b: [n, d] (pair i is (a_i, b_i)); scores: [n] gold scores."""
    sim = (a * b).sum(dim=-1) / tau  # [n]
    diff = sim[None, :] - sim[:, None]  # diff[p, q] = s_q − s_p ; a term where y_p > y_q
    mask = scores[:, None] > scores[None, :]
    diff = diff.masked_fill(~mask, float("-inf"))
    zero = torch.zeros(1, dtype=diff.dtype, device=diff.device)  # the "1 +" inside the log
    return torch.logsumexp(torch.cat([zero, diff.flatten()]), dim=0)


class CoSENTLoss(nn.Module):
    def __init__(self, tau: float = 0.05):
        super().__init__()
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        self.tau = tau

    def forward(self, a: Tensor, b: Tensor, scores: Tensor) -> Tensor:
        return cosent(a, b, scores, tau=self.tau)
