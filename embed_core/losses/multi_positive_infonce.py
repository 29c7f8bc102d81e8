"""Multi-positive, hard-negative InfoNCE for retrieval (CoDiEmb Eq. 2, "L_ENCE").

Query i has K+ positives d_ic+ and K− hard negatives (drawn from its record, with replacement
when it has fewer). With cos the cosine similarity:

    Z_i+ = Σ_{j≠i} Σ_k exp(cos(q_i, d_jk+)/τ)      other queries' positives
    Z_i− = Σ_j Σ_k exp(cos(q_i, d_jk−)/τ)          every hard negative of the batch, own included
    L_IR = −(1/N) Σ_i Σ_c log( exp(cos(q_i, d_ic+)/τ) / (exp(cos(q_i, d_ic+)/τ) + Z_i+ + Z_i−) )

Each positive gets its own softmax term and the query's other positives are in no denominator
(they are not negatives). The paper takes the expectation of the sum over i and c; here the sum
over c is kept and the mean is over queries (N). The authors' code differs (one positive slot
of every other query per term, mean over c); the paper's form is implemented. τ = 0.02 (the
authors' scripts; the paper does not state it). False negatives leave Z_i (Z_ic with the margin)
(``embed_core.losses.false_negatives``): a candidate whose text equals one of q_i's positives or q_i,
with ``false_negative_margin`` m, for the term of d_ic+ one with cos(q_i, ·) > cos(q_i, d_ic+) + m; with
a ``guide_model`` g, for that term one with g(q_i, ·) > g(q_i, d_ic+) − m_g.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext
from embed_core.losses.false_negatives import FalseNegativeParams, FalseNegatives


def multi_positive_infonce(q: Tensor, pos: Tensor, neg: Tensor | None = None, *, tau: float = 0.02,
                           false_negatives: FalseNegatives | None = None) -> Tensor:
    """q: [N, d]; pos: [N, K+, d]; neg: [N, K−, d] or flat [M, d] (the batch's hard negatives) or None;
    false_negatives: the masks by text, margin and guide model."""
    n, kp, d = pos.shape
    pos_flat = pos.reshape(n * kp, d)
    owner = torch.arange(n, device=q.device).repeat_interleave(kp)  # query each positive belongs to
    own = owner[None, :] == torch.arange(n, device=q.device)[:, None]  # [N, N*K+]
    scores = q @ pos_flat.T  # [N, N*K+]; column j*K+ + c is d_jc+
    own_scores = scores[own].view(n, kp)  # cos(q_i, d_ic+)
    has_neg = neg is not None and neg.numel() > 0
    if has_neg:
        scores = torch.cat([scores, q @ neg.reshape(-1, d).T], dim=1)  # Z_i+ candidates, then Z_i−
        own = torch.cat([own, own.new_zeros(n, scores.size(1) - own.size(1))], dim=1)
    drop = own[:, None, :].expand(n, kp, scores.size(1))  # the own positives are in no denominator
    fn = false_negatives
    if fn is not None and fn.active:
        ids = fn.ids("positive")
        cand = None if ids is None else torch.cat([ids, fn.ids("negative")]) if has_neg else ids
        guide = None
        if fn.guide("query") is not None:
            gq, gp, gn = fn.guide("query"), fn.guide("positive"), fn.guide("negative")
            g = gq @ torch.cat([gp, gn] if has_neg else [gp]).T
            guide = (g, g[:, :n * kp][own[:, :n * kp]].view(n, kp))
        drop = drop | fn.mask(scores, own_scores, cand, own, None if ids is None else ids.view(n, kp),
                              fn.ids("query"), guide)
    cands = (scores / tau)[:, None, :].expand(n, kp, scores.size(1)).masked_fill(drop, float("-inf"))
    s = (own_scores / tau)[:, :, None]
    # −log(e^s / (e^s + Z_ic)): the term's own score is in the sum, so it is never empty
    loss = torch.logsumexp(torch.cat([s, cands], dim=-1), dim=-1) - s[..., 0]
    return loss.sum(dim=1).mean()


class MultiPositiveInfoNCE(Loss):
    """CoDiEmb's retrieval loss: K+ positives per query; gathered across ranks (CoDiEmb A.5)."""

    name = "codiemb_ir"
    tasks = ("retrieval",)
    layout = "multi_positive"

    class Params(FalseNegativeParams):
        tau: float = Field(0.02, gt=0, description="Temperature τ.")
        num_positives: int = Field(2, ge=1, description="Positives per query K+ (CoDiEmb: 2; drawn with replacement "
                                   "when a record has fewer, as are the stage's num_hard_negatives K−).")

    def batch_options(self) -> dict:
        return {"num_positives": self.params.num_positives}

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        q, pos, neg = ctx.gather(emb["query"]), ctx.gather(emb["positive"]), ctx.gather_negatives(emb)
        fn = FalseNegatives(self.params, batch, ctx, gathered=True, device=q.device)
        loss = multi_positive_infonce(q, pos.view(q.size(0), self.params.num_positives, -1), neg,
                                      tau=self.params.tau, false_negatives=fn)
        fn.record()
        return loss
