"""InfoNCE with in-batch negatives, hard negatives and query–query negatives (QZhou-Embedding Eq. 1).

    L = -1/n Σ_i log( e^{s(q_i,d_i+)/τ} /
                      ( e^{s(q_i,d_i+)/τ} + Σ_j M_ij e^{s(q_i,d_j−)/τ} + Σ_{j≠i} M'_ij e^{s(q_i,q_j)/τ} ) )

s is cosine similarity (inputs are L2-normalised). The negatives d_j− of query i are every other
query's positive (in-batch) and every hard negative in the batch, its own and the others'; the
query–query term (after gte) treats every other query as a negative. QZhou §6.3: τ = 0.02,
4 hard negatives per query. M (M') is 0 for a false negative and 1 otherwise
(``embed_core.losses.false_negatives``): a candidate whose text equals q_i's positive or q_i itself;
with ``false_negative_margin`` m, one with s(q_i, ·) > s(q_i, d_i+) + m (Qwen3-Embedding, GTE); with
a ``guide_model`` g, one with g(q_i, ·) > g(q_i, d_i+) − m_g (GISTEmbed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext
from embed_core.losses.false_negatives import FalseNegativeParams, FalseNegatives


def _columns(q: Tensor, pos: Tensor, neg: Tensor | None, query_negatives: bool) -> Tensor:
    """Cosine scores of each query with its candidates: every positive, every hard negative and,
    with the query–query term, every query ([n, n + m (+ n)]; column i is query i's positive)."""
    parts = [pos] if neg is None or neg.numel() == 0 else [pos, neg.reshape(-1, neg.size(-1))]
    if query_negatives and q.size(0) > 1:
        parts.append(q)
    return q @ torch.cat(parts, dim=0).T


def infonce(q: Tensor, pos: Tensor, neg: Tensor | None = None, *, tau: float = 0.02,
            query_negatives: bool = True, false_negatives: FalseNegatives | None = None,
            weights: Tensor | None = None) -> Tensor:
    """q, pos: [n, d]; neg: the batch's hard negatives, [n, k, d] or flat [m, d] (rows may
    contribute different numbers: every negative is in every query's denominator), or None;
    false_negatives: the masks (text ids and guide embeddings of the query, positive and negative
    groups, rows in this order). Returns the mean loss over queries; ``weights`` [n]: each
    query's loss times its weight (the stage's ``origin_weight``), still divided by n."""
    n = q.size(0)
    scores = _columns(q, pos, neg, query_negatives)
    qq = query_negatives and n > 1
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    own = torch.zeros_like(scores, dtype=torch.bool)
    own[:, :n] = eye  # column i of the documents is the target
    if qq:
        own[:, -n:] = eye  # j ≠ i
    drop = own.clone()
    drop[:, :n] = False
    fn = false_negatives
    if fn is not None and fn.active:
        cand = pos_ids = query_ids = guide = None
        if fn.ids("query") is not None:
            query_ids, pos_ids = fn.ids("query"), fn.ids("positive")
            cand = torch.cat([pos_ids, fn.ids("negative")] + ([query_ids] if qq else []))
            pos_ids = pos_ids[:, None]
        if fn.guide("query") is not None:
            g = _columns(fn.guide("query"), fn.guide("positive"), fn.guide("negative"), query_negatives)
            guide = (g, g[:, :n].diagonal()[:, None])
        drop |= fn.mask(scores, scores[:, :n].diagonal()[:, None], cand, own, pos_ids, query_ids, guide)[:, 0]
    logits = (scores / tau).masked_fill(drop, float("-inf"))
    target = torch.arange(n, device=q.device)
    if weights is None:
        return F.cross_entropy(logits, target)
    return (F.cross_entropy(logits, target, reduction="none") * weights.to(logits.dtype)).mean()


class InfoNCE(Loss):
    """QZhou's retrieval loss: documents and queries of every rank are negatives (all-gathered),
    false negatives left out."""

    name = "infonce"
    tasks = ("retrieval",)
    default_for = ("retrieval",)

    class Params(FalseNegativeParams):
        tau: float = Field(0.02, gt=0, description="Temperature τ (QZhou: 0.02).")
        query_negatives: bool = Field(True, description="Eq. 1's query–query term.")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        q = ctx.gather(emb["query"])
        fn = FalseNegatives(self.params, batch, ctx, gathered=True, device=q.device)
        weights = (ctx.gather(torch.tensor(batch.weights, dtype=q.dtype, device=q.device))
                   if getattr(batch, "weights", None) else None)
        loss = infonce(q, ctx.gather(emb["positive"]), ctx.gather_negatives(emb), tau=self.params.tau,
                       query_negatives=self.params.query_negatives, false_negatives=fn, weights=weights)
        fn.record()
        return loss
