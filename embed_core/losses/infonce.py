"""InfoNCE with in-batch negatives, hard negatives and query–query negatives (QZhou-Embedding Eq. 1).

    L = -1/n Σ_i log( e^{s(q_i,d_i+)/τ} /
                      ( e^{s(q_i,d_i+)/τ} + Σ_j e^{s(q_i,d_j−)/τ} + Σ_{j≠i} e^{s(q_i,q_j)/τ} ) )

s is cosine similarity (inputs are L2-normalised). The negatives d_j− of query i are every other
query's positive (in-batch) and every hard negative in the batch, its own and the others'; the
query–query term (after gte) treats every other query as a negative. QZhou §6.3: τ = 0.02,
4 hard negatives per query.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext, LossParams


def infonce(q: Tensor, pos: Tensor, neg: Tensor | None = None, *, tau: float = 0.02,
            query_negatives: bool = True, weights: Tensor | None = None) -> Tensor:
    """q, pos: [n, d]; neg: the batch's hard negatives, [n, k, d] or flat [m, d] (rows may
    contribute different numbers: every negative is in every query's denominator), or None.
    Returns the mean loss over queries; ``weights`` [n]: each query's loss times its weight
    (the stage's ``origin_weight``), still divided by n."""
    n = q.size(0)
    docs = pos if neg is None or neg.numel() == 0 else torch.cat([pos, neg.reshape(-1, neg.size(-1))], dim=0)
    logits = q @ docs.T / tau  # [n, n + n*k]; column i is query i's positive
    if query_negatives and n > 1:
        qq = q @ q.T / tau
        qq = qq.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), float("-inf"))  # j ≠ i
        logits = torch.cat([logits, qq], dim=1)
    target = torch.arange(n, device=q.device)
    if weights is None:
        return F.cross_entropy(logits, target)
    return (F.cross_entropy(logits, target, reduction="none") * weights.to(logits.dtype)).mean()


class InfoNCE(Loss):
    """QZhou's retrieval loss: documents and queries of every rank are negatives (all-gathered)."""

    name = "infonce"
    tasks = ("retrieval",)
    default_for = ("retrieval",)

    class Params(LossParams):
        tau: float = Field(0.02, gt=0, description="Temperature τ (QZhou: 0.02).")
        query_negatives: bool = Field(True, description="Eq. 1's query–query term.")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        q = emb["query"]
        weights = (ctx.gather(torch.tensor(batch.weights, dtype=q.dtype, device=q.device))
                   if getattr(batch, "weights", None) else None)
        return infonce(ctx.gather(q), ctx.gather(emb["positive"]), ctx.gather_negatives(emb),
                       tau=self.params.tau, query_negatives=self.params.query_negatives, weights=weights)
